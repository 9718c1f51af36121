"""EAGLE drafting (EAGLE-1 and EAGLE-3 heads): a chain (`topk` 1) or an EAGLE-2 dynamic tree.

The head keeps its own one-layer paged KV cache per sequence. Entry i holds (target feature at
position i, token i+1); entries fed from the target's real features are *committed*, those fed
while drafting (predicted features) are dropped before the next step. Every step:

1. catch up: the target features of the tokens it committed last step (`observe`), paired with
   the token after each, are appended; the prediction at the last one gives the root's children;
2. draft:
   - chain: feed back (predicted feature, argmax token) `k - 1` times;
   - EAGLE-2 (Li et al. 2024b): at each of `num_steps` depths expand the frontier's top-`topk`
     children (scores = cumulative log-probabilities under the head), keep the global top
     `topk` as the next frontier (fed to the head together, with a tree mask), then rerank every
     generated node and keep the best `num_draft_tokens - 1`. Scores fall along a path, so the
     kept set contains every kept node's parent (ties go to the node generated first).
Drafts are deterministic (top-k), verified with the deterministic-drafts rule: lossless.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from specdecode.cache import BlockManager, KVCache, SeqBlocks
from specdecode.core import Sequence
from specdecode.drafters.base import Drafter, DraftProposal, penalize
from specdecode.models.attention import build_metadata
from specdecode.models.heads import Eagle3Head, EagleHead
from specdecode.processors import columns_of, has_penalties
from specdecode.tree import TreeShape

if TYPE_CHECKING:
    from specdecode.config import SpeculativeConfig
    from specdecode.engine.engine import LLMEngine


# Defaults when only the method (and head) is given: an EAGLE-2 tree of `num_speculative_tokens`
# levels, 4 children per expanded node, 8 nodes verified (root included). On this project's CPU
# target a verification of up to ~8 tokens costs about one decoding step.
DEFAULT_TOPK = 4
DEFAULT_DRAFT_TOKENS = 8


@dataclass
class _HeadState:
    blocks: SeqBlocks = field(default_factory=SeqBlocks)
    committed: int = 0  # head entries built from real target features
    # target position - entry index of the entries being added: 0, or the gap between the
    # entries found in the head's prefix cache and where the request's features began (its
    # first tokens came from the target's prefix cache, which computes no features); entries
    # sit at their target positions, so attention across the gap reads the right distances
    base: int = 0
    pending: list[torch.Tensor] = field(default_factory=list)  # features not yet fed
    seen: int = 0  # target positions whose features arrived (committed + pending rows)
    broken: bool = False  # a gap in the features: this sequence gets no drafts
    # rows the step after a proposal brings (its root and accepted nodes): routine, not catch-up
    routine: int = 0
    proposed: bool = False  # a proposal ran since the last features arrived
    levels: int = 0  # draft levels the head ran for the last proposal (its drafting depth)


@dataclass
class _Node:
    token: int
    score: float
    parent: int  # index into the pool, -1 = the root
    depth: int
    feature: torch.Tensor | None = None  # predicted feature *after* this node (once fed)


class EagleDrafter(Drafter):
    feature_layers = ()  # the target's final feature

    def __init__(
        self,
        head: EagleHead,
        kv_memory_gb: float,
        block_size: int = 16,
        topk: int = 1,
        num_draft_tokens: int | None = None,
        device: torch.device | str = "cpu",
        prefix_caching: bool = False,
    ) -> None:
        if topk < 1:
            raise ValueError("topk must be at least 1")
        self.head = head
        if isinstance(head, Eagle3Head):  # reads the low/mid/high layer inputs (first 3H)
            self.feature_layers = head.aux_layers
            self._cols = slice(0, head.feature_size)
        else:  # EAGLE-1 reads the final feature
            self.feature_layers = ()
            self._cols = slice(None)
        self.topk = topk
        self.num_draft_tokens = num_draft_tokens
        self.device = torch.device(device)
        cfg = head.config
        num_blocks = KVCache.num_blocks_for(cfg, torch.float32, kv_memory_gb, block_size)
        # the head's entries are cached by prefix too (see `_find_entries`)
        self.manager = BlockManager(num_blocks, block_size, prefix_caching=prefix_caching)
        self.cache = KVCache(cfg, num_blocks, block_size, torch.float32, self.device)
        self._state: dict[int, _HeadState] = {}
        self._columns: torch.Tensor | None = None  # a draft vocabulary's, for penalties

    @classmethod
    def from_config(cls, config: SpeculativeConfig, engine: LLMEngine) -> EagleDrafter:
        from specdecode.models.head_io import load_head_for

        head = load_head_for(config, engine, kind=config.method)
        return cls(
            head,
            engine.config.kv_cache_memory_gb / 8,
            engine.config.block_size,
            topk=config.topk or DEFAULT_TOPK,
            num_draft_tokens=config.num_draft_tokens or DEFAULT_DRAFT_TOKENS,
            device=engine.model.norm.weight.device,
            prefix_caching=engine.config.enable_prefix_caching,
        )

    @property
    def is_tree(self) -> bool:
        return self.topk > 1

    def max_nodes(self, k: int) -> int:
        if not self.is_tree:
            return k
        return self._tree_size(k) - 1

    def _tree_size(self, depth: int) -> int:
        """Nodes kept (root included): `num_draft_tokens`, at most what `depth` levels hold."""
        most = 1 + self.topk + (depth - 1) * self.topk * self.topk
        return min(self.num_draft_tokens or 1 + depth * self.topk, most)

    # ---- features ------------------------------------------------------------------------------

    def observe(self, seqs: list[Sequence], features: list[torch.Tensor]) -> None:
        for seq, f in zip(seqs, features, strict=True):
            start = seq.blocks.length - f.shape[0]
            st = self._state.get(seq.seq_id)
            if st is None or start == 0:
                if st is not None:
                    self.manager.free(st.blocks)
                st = self._state[seq.seq_id] = _HeadState(base=start, seen=start)
                if start:
                    self._find_entries(seq, st)
            if start != st.seen and not st.broken:  # for good: what it holds is of no use
                st.broken, st.pending = True, []  # (nor kept at release: `_keep_entries`)
                self.manager.free(st.blocks)
            st.seen = start + f.shape[0]
            if st.proposed:
                st.routine, st.proposed = f.shape[0], False
            if not st.broken:  # a copy: a view would keep the whole step's features alive
                st.pending.append(f[:, self._cols].clone())

    def _chain_start(self, seq: Sequence) -> bytes:
        """Entry j pairs the feature at position j (which depends on tokens 0..j) with token
        j + 1: a block of entries is keyed by the hash chain of the tokens after its positions,
        started from the first token."""
        return self.manager.chain(b"", seq.token_ids(0, 1))

    def _register(self, seq: Sequence, st: _HeadState) -> None:
        """Register the request's full blocks of committed entries (whole history only)."""
        self.manager.register(
            st.blocks, lambda a, b: seq.token_ids(a + 1, b + 1), st.committed,
            self._chain_start(seq),
        )  # fmt: skip

    def _find_entries(self, seq: Sequence, st: _HeadState) -> None:
        """A request whose first `st.base` tokens came from the target's prefix cache has no
        features there; the head's own entries for those positions may be cached too (an
        earlier request began alike): it drafts with the ones it finds, the rest a gap."""
        found = self.manager.match(
            st.blocks, seq.token_ids(1, st.base + 1), self._chain_start(seq),
            max_blocks=st.base // self.manager.block_size,
        )  # fmt: skip
        st.base, st.committed = st.base - found, found

    def catch_up_tokens(self, seq: Sequence) -> int:
        """Features the head has not run yet beyond what a drafting step brings (its root and
        accepted nodes): the prompt before a request's first draft, every token committed while
        it was not drafting. The head runs them before it drafts, so the controller prices them
        as catch-up, not as drafting depth (a probe after 64 idle steps would otherwise look
        like a dear depth-1 draft)."""
        st = self._state.get(seq.seq_id)
        if st is None or st.broken:
            return 0
        pending = st.seen - st.base - st.committed  # rows not yet fed, O(1) per step
        return max(0, pending - max(1, st.routine))

    def drafted_depth(self, seq: Sequence, proposal: DraftProposal) -> int:
        """The levels the head ran: a dynamic tree expands `budget` levels, then keeps its best
        nodes, which may reach less deep (measured on SmolLM2: 5 levels run, 2 kept), and
        its drafting time is that of the levels run."""
        st = self._state.get(seq.seq_id)
        return st.levels if st is not None and st.levels else max(proposal.shape.depths)

    def tracked_ids(self) -> set[int]:
        return set(self._state)

    def release(self, seq: Sequence) -> None:
        st = self._state.pop(seq.seq_id, None)
        if st is not None:
            self._keep_entries(seq, st)
            self.manager.free(st.blocks)

    @torch.inference_mode()
    def _keep_entries(self, seq: Sequence, st: _HeadState) -> None:
        """Before a request's entries are freed: feed the features it saw but never ran (its
        last steps, or all of them if it never drafted) and register the full blocks, so a later
        request that starts alike (the next turn of a chat) finds the head's whole history, as
        the target's. Not past the tokens it holds (a stop may have cut accepted drafts)."""
        if not self.manager.prefix_caching or st.base != 0 or st.broken or not st.pending:
            return
        self.manager.truncate(st.blocks, st.committed)  # last step's draft entries
        f = torch.cat(st.pending)[: max(0, seq.num_tokens - 1 - st.committed)]
        full = (st.committed + f.shape[0]) // self.manager.block_size * self.manager.block_size
        f = f[: max(0, full - st.committed)]  # only entries that complete a block are kept
        if f.shape[0] == 0 or not self.manager.allocate(st.blocks, full):
            return
        ids = seq.token_ids(st.committed + 1, full + 1)
        self._forward([st.blocks], [f.shape[0]], ids, f, list(range(st.committed, full)))
        st.committed = full
        self._register(seq, st)

    # ---- drafting ------------------------------------------------------------------------------

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], budgets: list[int]) -> list[DraftProposal]:
        out = [DraftProposal.empty(s.last_token) for s in seqs]
        states = [self._state.get(s.seq_id) for s in seqs]
        active = [
            i
            for i, (s, st, k) in enumerate(zip(seqs, states, budgets, strict=True))
            if k > 0 and st is not None and not st.broken and st.seen == s.num_tokens - 1
        ]
        for st in states:
            if st is not None:
                st.levels = 0
        for i in active:  # drop last step's draft entries
            self.manager.truncate(states[i].blocks, states[i].committed)
        # draft entries: k - 1 fed for a chain, `topk` per expanded level for a tree
        room = [states[i].seen - states[i].base + (budgets[i] - 1) * self.topk for i in active]
        # out of head cache: the requests that do not fit draft nothing this step (lossless,
        # just slower), the others draft on
        active = [
            i
            for i, n in zip(active, room, strict=True)
            if self.manager.allocate(states[i].blocks, n)
        ]
        if not active:
            return out
        # 1. catch up on the real features; the last prediction drafts the root's children
        feats, ids, positions, nums = [], [], [], []
        for i in active:
            st, seq = states[i], seqs[i]
            f = torch.cat(st.pending)
            st.pending = []
            feats.append(f)
            start = st.base + st.committed  # the target position of the next entry, which
            ids += seq.token_ids(start + 1, start + 1 + f.shape[0])  # pairs with the next token
            positions += range(start, start + f.shape[0])
            nums.append(f.shape[0])
        pred = self._forward(
            [states[i].blocks for i in active], nums, ids, torch.cat(feats), positions
        )
        last = torch.tensor(nums).cumsum(0) - 1
        root_feat = pred[last]
        for i in active:
            st = states[i]
            st.committed = st.blocks.length
            if st.base == 0:  # its full blocks of entries, for requests that start alike
                self._register(seqs[i], st)
            st.proposed = True
            states[i].levels = budgets[i]
        sub_seqs = [seqs[i] for i in active]
        sub_states = [states[i] for i in active]
        sub_budgets = [budgets[i] for i in active]
        if self.is_tree:
            proposals = self._tree(sub_seqs, sub_states, sub_budgets, root_feat)
        else:
            proposals = self._chain(sub_seqs, sub_states, sub_budgets, root_feat)
        for i, p in zip(active, proposals, strict=True):
            out[i] = p
        return out

    def _forward(self, blocks, nums, ids, feats, positions, masks=None) -> torch.Tensor:
        """Append entries (ids, feats) at `positions` (`nums[i]` for sequence i, causal or with
        `masks`); return the predicted features [sum(nums), H]."""
        meta = build_metadata(self.cache.kv, self.manager, blocks, nums, masks)
        pred = self.head(
            torch.tensor(ids, device=self.device),
            feats,
            torch.tensor(positions, device=self.device),
            meta,
        )
        for b, n in zip(blocks, nums, strict=True):
            b.length += n
        return pred

    def _logits(self, feat, seqs, histories) -> torch.Tensor:
        """The head's logits under the requests' bias and penalties (`penalize`)."""
        if self._columns is None and self.head.vocab_ids is not None:
            self._columns = columns_of(self.head.vocab_ids, int(self.head.vocab_ids.max()) + 1)
        return penalize(self.head.logits(feat), seqs, histories, self._columns)

    def _tokens(self, idx: torch.Tensor) -> list:
        vocab = self.head.vocab_ids
        return (vocab[idx] if vocab is not None else idx).tolist()

    def _chain(self, seqs, states, budgets, root_feat) -> list[DraftProposal]:
        drafts: list[list[int]] = [[] for _ in seqs]
        feat = root_feat
        rows = list(range(len(seqs)))
        step = 0
        while True:
            logits = self._logits(feat, [seqs[i] for i in rows], [[drafts[i]] for i in rows])
            toks = self._tokens(logits.argmax(-1))
            for r, i in enumerate(rows):
                drafts[i].append(toks[r])
            step += 1
            keep = [r for r, i in enumerate(rows) if step < budgets[i]]
            if not keep:
                break
            rows = [rows[r] for r in keep]
            feat = feat[keep]
            positions = [states[i].base + states[i].committed + step - 1 for i in rows]
            feat = self._forward(
                [states[i].blocks for i in rows],
                [1] * len(rows),
                [drafts[i][-1] for i in rows],
                feat,
                positions,
            )
        return [
            DraftProposal(TreeShape.chain(len(d)), [s.last_token] + d)
            for s, d in zip(seqs, drafts, strict=True)
        ]

    def _tree(self, seqs, states, budgets, root_feat) -> list[DraftProposal]:
        k = self.topk
        pools: list[list[_Node]] = [[] for _ in seqs]
        frontiers: list[list[int]] = [[] for _ in seqs]
        fed: list[list[int]] = [[] for _ in seqs]  # pool indices in head-cache order
        logp = self._logits(root_feat, seqs, [[[]] for _ in seqs]).log_softmax(-1)
        top = logp.topk(k, dim=-1)
        for i in range(len(seqs)):
            for s, t in zip(top.values[i].tolist(), self._tokens(top.indices[i]), strict=True):
                pools[i].append(_Node(t, s, -1, 1, None))
            frontiers[i] = list(range(k))
        parent_feat = [root_feat[i : i + 1].expand(k, -1) for i in range(len(seqs))]
        depth = 1
        while True:
            rows = [i for i in range(len(seqs)) if depth < budgets[i]]
            if not rows:
                break
            # feed the frontier: each node's entry is (its parent's predicted feature, its token)
            ids, positions, masks = [], [], []
            for i in rows:
                front = frontiers[i]
                ids += [pools[i][j].token for j in front]
                positions += [states[i].base + states[i].committed + depth - 1] * len(front)
                masks.append(self._level_mask(pools[i], fed[i], front))
                fed[i] += front
            feats = torch.cat([parent_feat[i] for i in rows])
            nums = [len(frontiers[i]) for i in rows]
            pred = self._forward(
                [states[i].blocks for i in rows], nums, ids, feats, positions, masks
            )
            paths = [  # (what a penalised node's children follow)
                [self._path(pools[i], j) for j in frontiers[i]]
                if has_penalties(seqs[i].params)
                else [[]] * len(frontiers[i])
                for i in rows
            ]
            logp = self._logits(pred, [seqs[i] for i in rows], paths).log_softmax(-1)
            top = logp.topk(k, dim=-1)
            # (one device-to-host copy a level, not one per child)
            values, tokens = top.values.tolist(), self._tokens(top.indices)
            r = 0
            for i in rows:
                front, pool = frontiers[i], pools[i]
                base = len(pool)
                for j in front:
                    pool[j].feature = pred[r]
                    for c in range(k):
                        score = pool[j].score + values[r][c]
                        pool.append(_Node(tokens[r][c], score, j, depth + 1))
                    r += 1
                children = range(base, len(pool))
                best = sorted(children, key=lambda c: (-pool[c].score, c))[:k]
                frontiers[i] = best
                parent_feat[i] = torch.stack([pool[pool[c].parent].feature for c in best])
            depth += 1
        return [
            self._select(seq.last_token, pool, self._tree_size(b))
            for seq, pool, b in zip(seqs, pools, budgets, strict=True)
        ]

    @staticmethod
    def _path(pool: list[_Node], j: int) -> list[int]:
        """The drafts from the root (excluded) to node `j` (included)."""
        out = []
        while j >= 0:
            out.append(pool[j].token)
            j = pool[j].parent
        return out[::-1]

    @staticmethod
    def _level_mask(pool: list[_Node], fed: list[int], front: list[int]) -> torch.Tensor:
        """[len(front), len(fed) + len(front)]: each new entry sees its fed ancestors and itself."""
        where = {j: n for n, j in enumerate(fed)}
        mask = torch.zeros(len(front), len(fed) + len(front), dtype=torch.bool)
        for row, j in enumerate(front):
            mask[row, len(fed) + row] = True
            p = pool[j].parent
            while p >= 0:
                mask[row, where[p]] = True
                p = pool[p].parent
        return mask

    @staticmethod
    def _select(root: int, pool: list[_Node], size: int) -> DraftProposal:
        """The best `size - 1` nodes by score, as a tree in level order."""
        chosen = sorted(range(len(pool)), key=lambda j: (-pool[j].score, j))[: size - 1]
        chosen.sort(key=lambda j: (pool[j].depth, j))
        index = {j: n + 1 for n, j in enumerate(chosen)}
        parents, tokens = [-1], [root]
        for j in chosen:
            p = pool[j].parent
            parents.append(0 if p < 0 else index[p])  # a parent scores at least its child
            tokens.append(pool[j].token)
        return DraftProposal(TreeShape(tuple(parents)), tokens)
