"""Medusa-1 drafting: K heads on the target's last feature give candidates for K positions at
once (no draft forward per depth), arranged as a static tree.

A node at depth d with rank r holds the r-th best candidate of head d-1 whatever its parent
(Medusa's Cartesian tree). Drafts are deterministic, verified with the deterministic-drafts
rule (lossless). Medusa's own "typical acceptance" is lossy and is not offered.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from specdecode.core import Sequence
from specdecode.drafters.base import Drafter, DraftProposal, penalize
from specdecode.errors import InvalidRequestError
from specdecode.models.heads import MedusaHeads
from specdecode.processors import columns_of, has_penalties
from specdecode.tree import TreeShape

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from specdecode.config import SpeculativeConfig
    from specdecode.engine.engine import LLMEngine

# The default tree for 4 heads: 15 drafts, wide where the heads are sure and narrow deeper
# (the top candidates of the first heads carry most of the accepted length). With its root, 16
# nodes: what the decoder's direct attention verifies bit for bit as decoding would (larger
# trees take the library's attention, whose rounding differs by ~1e-5).
DEFAULT_TREE = [
    [0], [1], [2], [3],
    [0, 0], [0, 1], [0, 2], [1, 0], [1, 1], [2, 0],
    [0, 0, 0], [0, 0, 1], [0, 1, 0], [1, 0, 0],
    [0, 0, 0, 0],
]  # fmt: skip


class MedusaDrafter(Drafter):
    feature_layers = ()  # the target's final feature

    def __init__(self, heads: MedusaHeads, tree: TreeShape) -> None:
        depth = max(tree.depths)
        if depth > heads.num_heads:  # (a head drafts one depth)
            raise InvalidRequestError(
                f"speculative_token_tree is {depth} deep, but the Medusa head set has only "
                f"{heads.num_heads} heads"
            )
        self.heads = heads
        self.tree = tree
        # seq id -> (tokens committed, the last committed token's feature)
        self._last: dict[int, tuple[int, torch.Tensor]] = {}
        self._columns: torch.Tensor | None = None  # a draft vocabulary's, for penalties

    @classmethod
    def from_config(cls, config: SpeculativeConfig, engine: LLMEngine) -> MedusaDrafter:
        from specdecode.models.head_io import load_head_for

        heads = load_head_for(config, engine, kind="medusa")
        choices = config.speculative_token_tree
        if choices is None:
            depth = min(heads.num_heads, config.num_speculative_tokens)
            if depth < config.num_speculative_tokens:  # (a head drafts one depth: vLLM's n_predict)
                log.info(
                    "medusa: %d heads draft at most %d tokens deep (num_speculative_tokens %d)",
                    heads.num_heads,
                    depth,
                    config.num_speculative_tokens,
                )
            choices = [c for c in DEFAULT_TREE if len(c) <= depth]
        return cls(heads, TreeShape.from_choices(choices))

    def max_nodes(self, k: int) -> int:
        return sum(1 for d in self.tree.depths if 0 < d <= k)

    def observe(self, seqs: list[Sequence], features: list[torch.Tensor]) -> None:
        for seq, f in zip(seqs, features, strict=True):
            # (a copy: a view would keep the step's whole feature tensor alive)
            self._last[seq.seq_id] = (seq.blocks.length, f[-1].clone())

    def _fresh(self, seq: Sequence) -> bool:
        """Whether the feature held for `seq` is its last committed token's (the one before its
        root): not one from before steps whose features were not captured (policy `off`)."""
        last = self._last.get(seq.seq_id)
        return last is not None and last[0] == seq.num_tokens - 1

    def tracked_ids(self) -> set[int]:
        return set(self._last)

    def release(self, seq: Sequence) -> None:
        self._last.pop(seq.seq_id, None)

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], budgets: list[int]) -> list[DraftProposal]:
        out = [DraftProposal.empty(s.last_token) for s in seqs]
        active = [i for i, (s, k) in enumerate(zip(seqs, budgets, strict=True))
                  if k > 0 and self._fresh(s)]  # fmt: skip
        if not active:
            return out
        feats = torch.stack([self._last[seqs[i].seq_id][1] for i in active])
        logits = self.heads(feats.float())  # [B, K, Vd]
        if any(has_penalties(seqs[i].params) for i in active):
            # every head under the request's bias and penalties (the candidates of a level
            # are shared by the tree's paths: the drafts before them are not counted)
            if self._columns is None and self.heads.vocab_ids is not None:
                ids = self.heads.vocab_ids
                self._columns = columns_of(ids, int(ids.max()) + 1)
            logits = logits.contiguous()
            flat, k = logits.view(-1, logits.shape[-1]), logits.shape[1]
            penalize(flat, [seqs[i] for i in active], [[[]] * k for _ in active], self._columns)
        width = max(self.tree.ranks) + 1
        cand = logits.topk(width, dim=-1).indices  # [B, K, width]
        vocab = self.heads.vocab_ids
        if vocab is not None:
            cand = vocab[cand]
        cand = cand.tolist()
        depths, ranks = self.tree.depths, self.tree.ranks
        for r, i in enumerate(active):
            n = sum(1 for d in depths if d <= budgets[i])  # level order: a prefix
            shape = TreeShape(self.tree.parents[:n], self.tree.ranks[:n])
            tokens = [seqs[i].last_token] + [cand[r][depths[j] - 1][ranks[j]] for j in range(1, n)]
            out[i] = DraftProposal(shape, tokens)
        return out
