"""Gen 1: a separate, smaller draft model with the target's tokenizer.

The draft keeps its own paged KV cache. Each step it first catches up on the tokens the target
committed since it last looked (the root included), then proposes k tokens one forward at a
time, sampling each from q = warp(draft logits) with the request's own temperature, top-k and
top-p, so verification can use the sampled-drafts rule with the real q. After verification its
cache is rolled back to the tokens that survived.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from specdecode.cache import BlockManager, KVCache, SeqBlocks
from specdecode.config import SpeculativeConfig
from specdecode.core import Sequence
from specdecode.drafters.base import Drafter, DraftProposal
from specdecode.errors import InvalidRequestError
from specdecode.models.attention import build_metadata
from specdecode.models.llama import LlamaModel
from specdecode.sampling import sample, warp
from specdecode.tree import TreeShape

if TYPE_CHECKING:
    from specdecode.engine.engine import LLMEngine


@dataclass
class _DraftState:
    blocks: SeqBlocks
    generator: torch.Generator | None
    pending: tuple[int, int] = (0, 0)  # (sequence length at proposal, drafts proposed)


class DraftModelDrafter(Drafter):
    samples_drafts = True

    def __init__(self, model: LlamaModel, kv_memory_gb: float, block_size: int = 16) -> None:
        self.model = model
        self.device = model.norm.weight.device
        dtype = model.norm.weight.dtype
        per_token = KVCache.bytes_per_token(model.config, dtype)
        num_blocks = max(2, int(kv_memory_gb * 2**30 / per_token / block_size))
        self.manager = BlockManager(num_blocks, block_size)
        self.cache = KVCache(model.config, num_blocks, block_size, dtype, self.device)
        self._state: dict[int, _DraftState] = {}

    @classmethod
    def from_config(cls, config: SpeculativeConfig, engine: LLMEngine) -> DraftModelDrafter:
        from specdecode.engine.engine import resolve_dtype
        from specdecode.models.loader import load_model

        dtype = resolve_dtype(config.draft_dtype or engine.config.dtype)
        loaded = load_model(
            config.model,
            dtype=dtype,
            device=engine.model.norm.weight.device,
            allow_pickle=engine.config.allow_pickle,
        )
        if loaded.config.vocab_size != engine.model_config.vocab_size:
            raise InvalidRequestError(
                f"the draft model's vocabulary ({loaded.config.vocab_size}) differs from the "
                f"target's ({engine.model_config.vocab_size}); they must share a tokenizer"
            )
        return cls(loaded.model, engine.config.kv_cache_memory_gb / 4, engine.config.block_size)

    def _get_state(self, seq: Sequence) -> _DraftState:
        st = self._state.get(seq.seq_id)
        if st is None:
            seed = seq.params.seed
            gen = None
            if seed is not None:
                gen = torch.Generator(device=self.device)
                gen.manual_seed(seed ^ 0x5EED5EED)
            st = self._state[seq.seq_id] = _DraftState(SeqBlocks(), gen)
        return st

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], budgets: list[int]) -> list[DraftProposal]:
        states = [self._get_state(s) for s in seqs]
        active = [i for i, k in enumerate(budgets) if k > 0]
        if active and not self._ensure_room(
            [states[i] for i in active], [seqs[i].num_tokens + budgets[i] for i in active]
        ):
            active = []  # out of draft cache memory: no drafts this step (still lossless)
        drafts: list[list[int]] = [[] for _ in seqs]
        qs: list[list[torch.Tensor]] = [[] for _ in seqs]
        # Catch up on everything the draft has not seen, the root included.
        feeds = {i: seqs[i].token_ids(states[i].blocks.length, seqs[i].num_tokens) for i in active}
        step = 0
        while active:
            logits = self._forward([states[i].blocks for i in active], [feeds[i] for i in active])
            for row, i in enumerate(active):
                q = warp(logits[row : row + 1], seqs[i].params)
                tok = int(sample(q, states[i].generator))
                drafts[i].append(tok)
                qs[i].append(q[0])
            step += 1
            active = [i for i in active if step < budgets[i]]
            feeds = {i: [drafts[i][-1]] for i in active}
        out = []
        for seq, st, d, q in zip(seqs, states, drafts, qs, strict=True):
            st.pending = (seq.num_tokens, len(d))
            probs = None
            if d:
                probs = torch.stack(q + [torch.zeros_like(q[0])])  # leaf row: unused
            out.append(DraftProposal(TreeShape.chain(len(d)), [seq.last_token] + d, probs))
        return out

    def _ensure_room(self, states: list[_DraftState], lengths: list[int]) -> bool:
        for st, n in zip(states, lengths, strict=True):
            if not self.manager.allocate(st.blocks, n):
                return False
        return True

    def _forward(self, blocks: list[SeqBlocks], feeds: list[list[int]]) -> torch.Tensor:
        """Append `feeds[i]` to sequence i; return [B, V] logits at each last new token."""
        nums = [len(f) for f in feeds]
        meta = build_metadata(self.cache.kv, self.manager, blocks, nums)
        ids = torch.tensor([t for f in feeds for t in f], device=self.device)
        pos = torch.tensor(
            [p for b, n in zip(blocks, nums, strict=True) for p in range(b.length, b.length + n)],
            device=self.device,
        )
        hidden = self.model(ids, pos, meta).hidden
        last = torch.tensor(nums, device=self.device).cumsum(0) - 1
        for b, n in zip(blocks, nums, strict=True):
            b.length += n
        return self.model.compute_logits(hidden[last])

    def on_verified(self, seqs, proposals, accepted) -> None:
        for seq, acc in zip(seqs, accepted, strict=True):
            st = self._state.get(seq.seq_id)
            if st is None:
                continue
            length, k = st.pending
            # The draft fed the root and drafts 1..k-1; those accepted stay valid.
            valid = length + min(len(acc), max(k - 1, 0))
            self.manager.truncate(st.blocks, min(valid, st.blocks.length))

    def release(self, seq: Sequence) -> None:
        st = self._state.pop(seq.seq_id, None)
        if st is not None:
            self.manager.free(st.blocks)
