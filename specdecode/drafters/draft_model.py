"""Gen 1: a separate, smaller draft model with the target's tokenizer.

The draft keeps its own paged KV cache. Each step it first catches up on the tokens the target
committed since it last looked (the root included), then drafts:
- a chain (default): k tokens one forward at a time, each sampled from q = warp(draft logits)
  with the request's own temperature, top-k and top-p, verified with the sampled-drafts rule and
  the real q;
- or a static tree (`speculative_token_tree`): level by level, each node's children are the
  top-ranked candidates of its q (deterministic drafts), one forward per level with a tree mask.
After verification its cache is rolled back to the tokens that survived.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from specdecode.cache import BlockManager, KVCache, SeqBlocks, keep_path
from specdecode.config import QUANTIZED_DRAFT_DTYPES, SpeculativeConfig
from specdecode.core import Sequence
from specdecode.drafters.base import Drafter, DraftProposal, penalize
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
    pending: tuple[int, int] = (0, 0)  # chain: (sequence length at proposal, drafts proposed)
    fed_nodes: int = 0  # tree: nodes written to the draft cache after the root


class DraftModelDrafter(Drafter):
    samples_drafts = True

    def __init__(
        self,
        model: LlamaModel,
        kv_memory_gb: float,
        block_size: int = 16,
        tree: TreeShape | None = None,
        prefix_caching: bool = False,
    ) -> None:
        self.model = model
        self.tree = tree
        if tree is not None:
            depths = tree.depths
            if any(a > b for a, b in zip(depths, depths[1:], strict=False)):
                raise ValueError("tree nodes must be in level order")
            self.samples_drafts = False
        self.device = model.norm.weight.device
        dtype = model.activation_dtype
        num_blocks = KVCache.num_blocks_for(model.config, dtype, kv_memory_gb, block_size)
        # prefix-cached as the target's: a request that starts like an earlier one (the next
        # turn of a chat) does not run its whole history through the draft model again
        self.manager = BlockManager(num_blocks, block_size, prefix_caching=prefix_caching)
        self.cache = KVCache(model.config, num_blocks, block_size, dtype, self.device)
        self._state: dict[int, _DraftState] = {}
        self._preempted_generators: dict[int, torch.Generator] = {}  # until the recompute
        self._found: dict[int, int] = {}  # seq_id -> cached tokens it will find (no state yet)

    @classmethod
    def from_config(cls, config: SpeculativeConfig, engine: LLMEngine) -> DraftModelDrafter:
        from specdecode.engine.engine import resolve_dtype
        from specdecode.models.loader import load_model, resolve_model
        from specdecode.train.draft import is_trained_draft, load_trained_draft

        path = resolve_model(config.model or default_draft_path(engine))
        if config.draft_dtype is None and engine.config.quantization is not None:
            # a quantized target's draft model is quantized alike (an fp32 draft could cost
            # more a step than the target); an explicit draft_dtype says otherwise
            config = replace(config, draft_dtype=engine.config.quantization)
        quantized = quantized_draft_dtype(config, engine)
        if is_trained_draft(path):  # distilled by `specdecode train draft`
            model = load_trained_draft(path, engine.model)
        else:
            dtype = resolve_dtype(config.load_dtype or engine.config.dtype)
            model = load_model(
                path,
                dtype=dtype,
                device=engine.model.norm.weight.device,
                allow_pickle=engine.config.allow_pickle,
            ).model
        if model.config.vocab_size != engine.model_config.vocab_size:
            raise InvalidRequestError(
                f"the draft model's vocabulary ({model.config.vocab_size}) differs from the "
                f"target's ({engine.model_config.vocab_size}); they must share a tokenizer"
            )
        if config.token_map is not None:
            from specdecode.models.head_io import engine_token_map

            if model.vocab_ids is not None:
                raise InvalidRequestError(
                    f"this draft's LM head has rows of its own ({model.vocab_ids.numel()} "
                    "tokens, trained by `train draft`): a token map cannot choose others; drop "
                    "token_map (or train the draft with the vocabulary you want: --draft-vocab)"
                )
            model.reduce_vocab(engine_token_map(config, engine))
        if config.draft_vocab_size and config.draft_vocab_size < model.config.vocab_size:
            if model.vocab_ids is not None:
                raise InvalidRequestError(
                    "this draft already has a reduced vocabulary; drop draft_vocab_size"
                )
            model.reduce_vocab(_frequent_ids(engine, config.draft_vocab_size))
        if engine.config.kernels == "auto":
            from specdecode.models.fast import accelerate

            accelerate(model, quantized)
        tree = config.speculative_token_tree
        return cls(
            model,
            engine.config.kv_cache_memory_gb / 4,
            engine.config.block_size,
            TreeShape.from_choices(tree) if tree else None,
            prefix_caching=engine.config.enable_prefix_caching,
        )

    def max_nodes(self, k: int) -> int:
        if self.tree is None:
            return k
        return sum(1 for d in self.tree.depths if 0 < d <= k)  # the tree pruned to depth k

    def catch_up_tokens(self, seq: Sequence) -> int:
        if seq.num_tokens >= self.model.config.max_position_embeddings:
            return 0  # past the draft's context: it never drafts again, nothing to catch up
        st = self._state.get(seq.seq_id)
        if st is not None:
            have = st.blocks.length
        else:  # what it will find in its prefix cache (looked up once, until it drafts)
            if seq.seq_id not in self._found:
                self._found[seq.seq_id] = self.manager.peek(seq.token_ids(0, seq.num_tokens))
            have = self._found[seq.seq_id]
        return max(0, seq.num_tokens - have - 1)

    def _get_state(self, seq: Sequence) -> _DraftState:
        st = self._state.get(seq.seq_id)
        if st is None:
            seed = seq.params.seed
            gen = self._preempted_generators.pop(seq.seq_id, None)
            if gen is None and seed is not None:
                gen = torch.Generator(device=self.device)
                gen.manual_seed(seed ^ 0x5EED5EED)
            st = self._state[seq.seq_id] = _DraftState(SeqBlocks(), gen)
            self._found.pop(seq.seq_id, None)
            if seq.num_tokens < self.model.config.max_position_embeddings:  # (else never used)
                self.manager.match(st.blocks, seq.token_ids(0, seq.num_tokens))
        return st

    def _within_context(self, seqs: list[Sequence], budgets: list[int]) -> list[int]:
        """Budgets cut to the draft model's own context, which may be shorter than the
        target's: the drafts of a request at position t are fed at t .. t + k - 2, and a
        request past that context is verified without drafts (lossless, just slower)."""
        return [self.depth_room(s, k) for s, k in zip(seqs, budgets, strict=True)]

    def depth_room(self, seq: Sequence, k: int) -> int:
        limit = self.model.config.max_position_embeddings
        st = self._state.get(seq.seq_id)
        # past it for good (a request only grows): its draft cache is freed now, since the
        # engine plans no drafts for it from here (`propose` sees it with a budget of 0 at most)
        if seq.num_tokens >= limit and st is not None and st.blocks.block_table:
            self.manager.free(st.blocks)
        return max(0, min(k, limit - seq.num_tokens))

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], budgets: list[int]) -> list[DraftProposal]:
        budgets = self._within_context(seqs, budgets)
        if self.tree is not None:
            return self._propose_tree(seqs, budgets)
        states = [self._get_state(s) for s in seqs]
        active = [i for i, k in enumerate(budgets) if k > 0]
        active = self._fitting(states, active, [seqs[i].num_tokens + budgets[i] for i in active])
        drafts: list[list[int]] = [[] for _ in seqs]
        qs: list[list[torch.Tensor]] = [[] for _ in seqs]
        # Catch up on everything the draft has not seen, the root included.
        feeds = {i: seqs[i].token_ids(states[i].blocks.length, seqs[i].num_tokens) for i in active}
        step = 0
        while active:
            logits = self._forward([states[i].blocks for i in active], [feeds[i] for i in active])
            penalize(logits, [seqs[i] for i in active], [[drafts[i]] for i in active])
            for row, i in enumerate(active):
                q = warp(logits[row : row + 1], seqs[i].params)
                greedy = seqs[i].params.greedy  # q is one-hot: no draw needed
                tok = int(q[0].argmax()) if greedy else int(sample(q, states[i].generator))
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

    def _propose_tree(self, seqs: list[Sequence], budgets: list[int]) -> list[DraftProposal]:
        tree = self.tree
        states = [self._get_state(s) for s in seqs]
        shapes = [_prune(tree, k) for k in budgets]
        wanted = [i for i, sh in enumerate(shapes) if len(sh) > 1]
        active = self._fitting(
            states, wanted, [seqs[i].num_tokens + len(shapes[i]) - 1 for i in wanted]
        )
        for i in set(wanted) - set(active):
            shapes[i] = _prune(tree, 0)
        tokens = [[s.last_token] + [0] * (len(sh) - 1) for s, sh in zip(seqs, shapes, strict=True)]
        for st in states:
            st.fed_nodes = 0
        if not active:
            return [DraftProposal.empty(s.last_token) for s in seqs]
        feeds = [seqs[i].token_ids(states[i].blocks.length, seqs[i].num_tokens) for i in active]
        logits = self._forward([states[i].blocks for i in active], feeds)
        penalize(logits, [seqs[i] for i in active], [[[]] for _ in active])
        q_rows = {(i, 0): logits[r] for r, i in enumerate(active)}  # (seq, node) -> logits
        path = {(i, 0): [] for i in active}  # (seq, node) -> the drafts from the root to it
        depths, kids = tree.depths, tree.children
        for depth in range(1, max(depths) + 1):
            level = [j for j, d in enumerate(depths) if d == depth]
            for i in active:
                for j in level:
                    if j < len(shapes[i]):
                        # candidates ranked by the draft's logits (deterministic drafts)
                        parent_logits = q_rows[(i, tree.parents[j])]
                        tokens[i][j] = int(parent_logits.topk(tree.ranks[j] + 1).indices[-1])
            deeper = [
                i
                for i in active
                if any(
                    depths[c] == depth + 1 and c < len(shapes[i]) for j in level for c in kids[j]
                )
            ]
            if not deeper:
                break
            lo, hi = level[0], level[-1] + 1
            mask = tree.ancestor_mask()[lo:hi, 1:hi]
            feeds = [tokens[i][lo:hi] for i in deeper]
            # every node of this level sits `depth` positions after its root (the last token)
            positions = [[seqs[i].num_tokens - 1 + depth] * (hi - lo) for i in deeper]
            logits = self._forward(
                [states[i].blocks for i in deeper], feeds, [mask] * len(deeper), positions
            )
            for i in deeper:
                for j in range(lo, hi):
                    path[(i, j)] = [*path[(i, tree.parents[j])], tokens[i][j]]
            penalize(
                logits,
                [seqs[i] for i in deeper],
                [[path[(i, j)] for j in range(lo, hi)] for i in deeper],
            )
            for r, i in enumerate(deeper):
                states[i].fed_nodes = hi - 1
                for j in range(lo, hi):
                    q_rows[(i, j)] = logits[r * (hi - lo) + (j - lo)]
        return [DraftProposal(sh, t) for sh, t in zip(shapes, tokens, strict=True)]

    def _fitting(self, states: list[_DraftState], wanted: list[int], lengths: list[int]):
        """The requests of `wanted` whose draft cache grows to `lengths`, in order; the others
        draft nothing this step (lossless, just slower) and the rest of the batch drafts on: a
        full draft cache does not stop drafting for everyone."""
        return [
            i
            for i, n in zip(wanted, lengths, strict=True)
            if self.manager.allocate(states[i].blocks, n)
        ]

    def _forward(
        self,
        blocks: list[SeqBlocks],
        feeds: list[list[int]],
        masks: list[torch.Tensor] | None = None,
        positions: list[list[int]] | None = None,
    ) -> torch.Tensor:
        """Append `feeds[i]` to sequence i; return logits at each last new token [B, V], or,
        for a tree level (`masks` and `positions` given), at every new token [sum n_i, V]."""
        nums = [len(f) for f in feeds]
        meta = build_metadata(self.cache.kv, self.manager, blocks, nums, masks)
        ids = torch.tensor([t for f in feeds for t in f], device=self.device)
        if positions is None:
            positions = [
                list(range(b.length, b.length + n)) for b, n in zip(blocks, nums, strict=True)
            ]
        pos = torch.tensor([p for ps in positions for p in ps], device=self.device)
        hidden = self.model(ids, pos, meta).hidden
        for b, n in zip(blocks, nums, strict=True):
            b.length += n
        if masks is not None:
            return self.model.compute_logits(hidden)
        last = torch.tensor(nums, device=self.device).cumsum(0) - 1
        return self.model.compute_logits(hidden[last])

    def on_verified(self, seqs, proposals, accepted) -> None:
        for seq, acc in zip(seqs, accepted, strict=True):
            st = self._state.get(seq.seq_id)
            if st is None:
                continue
            if self.tree is not None:
                self._keep_tree_path(st, acc)
            else:
                length, k = st.pending
                # The draft fed the root and drafts 1..k-1; those accepted stay valid.
                valid = length + min(len(acc), max(k - 1, 0))
                self.manager.truncate(st.blocks, min(valid, st.blocks.length))
            # full blocks of the request's own tokens (the accepted drafts join it later)
            self.manager.register(st.blocks, seq.token_ids, seq.num_tokens)

    def _keep_tree_path(self, st: _DraftState, accepted: list[int]) -> None:
        """Nodes 1..fed_nodes sit after the root; keep the accepted ones that were fed."""
        if st.fed_nodes == 0:  # nothing written after the root (or not run: a lookup branch
            return  # verified alone, a request the cache had no room for)
        root_index = st.blocks.length - st.fed_nodes - 1
        fed = [j for j in accepted if j <= st.fed_nodes]  # a prefix of the path
        st.blocks.length = root_index
        keep_path(self.manager, self.cache, st.blocks, [0] + fed)
        st.fed_nodes = 0

    def tracked_ids(self) -> set[int]:
        return set(self._state) | set(self._preempted_generators) | set(self._found)

    def release(self, seq: Sequence) -> None:
        self._preempted_generators.pop(seq.seq_id, None)
        self._found.pop(seq.seq_id, None)
        st = self._state.pop(seq.seq_id, None)
        if st is not None:
            self.manager.register(st.blocks, seq.token_ids, seq.num_tokens)
            self.manager.free(st.blocks)

    def preempt(self, seq: Sequence) -> None:
        """The draft cache is rebuilt with the target's; the seeded draft stream goes on where
        it was (drafts drawn again from its start would reuse the uniforms that chose the
        tokens already emitted, and the text would no longer follow the target)."""
        st = self._state.get(seq.seq_id)
        # preempted again before it drafted (its state not rebuilt yet): the parked stream
        gen = st.generator if st is not None else self._preempted_generators.get(seq.seq_id)
        self.release(seq)
        if gen is not None:
            self._preempted_generators[seq.seq_id] = gen


def _frequent_ids(engine: LLMEngine, n: int) -> torch.Tensor:
    """Token ids 0..n-1 (BPE merge order: the frequent pieces) plus every special token."""
    vocab = engine.model_config.vocab_size
    special = set(getattr(engine.tokenizer, "all_special_ids", None) or []) | engine._eos_ids()
    keep = set(range(n)) | {t for t in special if 0 <= t < vocab}
    return torch.tensor(sorted(keep), device=engine.model.norm.weight.device)


def kernels_ready(engine: LLMEngine) -> bool:
    """Whether a drafter's weights can be packed for the CPU kernels here (--kernels auto, the
    model on the CPU, the extension built)."""
    from specdecode import kernels

    return (
        engine.config.kernels == "auto"
        and engine.model.norm.weight.device.type == "cpu"
        and kernels.available()
    )


def quantized_draft_dtype(config: SpeculativeConfig, engine: LLMEngine) -> torch.dtype | None:
    """torch.int8 / torch.int4 for a quantised `draft_dtype` (None otherwise), or a clear error
    where the CPU kernels cannot run it."""
    from specdecode import kernels

    if config.draft_dtype not in QUANTIZED_DRAFT_DTYPES:
        return None
    if not kernels_ready(engine):
        raise InvalidRequestError(
            f"draft_dtype {config.draft_dtype} needs the CPU kernels (an x86 CPU with AVX-512 or "
            "AVX2, --kernels auto, the model on the CPU)"
        )
    if config.draft_dtype == "int4" and not kernels.int4_ready():
        raise InvalidRequestError(
            "draft_dtype int4 needs a CPU with AVX512_VNNI (vpdpbusd); use int8 here"
        )
    return torch.int8 if config.draft_dtype == "int8" else torch.int4


def default_draft_path(engine: LLMEngine) -> str:
    """The draft shipped for the default target (`specdecode train draft` made it)."""
    from pathlib import Path

    from specdecode.models.loader import DEFAULT_MODEL

    shipped = Path(__file__).resolve().parent.parent / "assets" / "smollm2-135m-draft"
    if engine.model_path.name.startswith(DEFAULT_MODEL) and shipped.is_dir():
        return str(shipped)
    raise InvalidRequestError(
        "method 'draft_model' needs a draft 'model': a model directory, .gguf file or pulled "
        "name (`specdecode train draft` distils one from the target)"
    )


def _prune(tree: TreeShape, max_depth: int) -> TreeShape:
    """The level-ordered prefix of `tree` no deeper than `max_depth` (a chain root if 0)."""
    n = sum(1 for d in tree.depths if d <= max_depth)
    return TreeShape(tree.parents[:n], tree.ranks[:n])
