"""Suffix decoding: model-free draft trees from the request's own text and from earlier answers.

SuffixDecoding (Oliaro et al. 2024, arXiv:2411.04975; vLLM's `"method": "suffix"`) extends
prompt lookup in three ways, all kept here:
- two sources: the request's prompt and output so far, and a corpus of the outputs of earlier
  requests (FIFO, `suffix_decoding_max_cached_requests` of them; 0 turns it off), so answers
  that repeat across requests (boilerplate, SQL over one schema, agent loops) are drafted too;
- frequencies: the earlier occurrences of the request's longest matching suffix vote for what
  followed them, and the draft is a *tree* of the likeliest continuations, a node's probability
  being the share of matches that continue with its path (`suffix_decoding_min_token_prob`
  prunes rare ones);
- an adaptive length: a match of n tokens drafts at most `max_spec_factor * n` tokens, and the
  match plus the draft stay within `suffix_decoding_max_tree_depth`.

The matching here is not a suffix tree: each source is indexed by its 2-grams (the corpus once,
as answers arrive; the request's own text by a vectorised scan each step), the most recent
`MAX_CANDIDATES` occurrences of the request's last 2-gram are extended backwards with numpy
(on the corpus, those of its last 8 tokens where it has any, so a long match is found however
common its last two tokens are), and the continuations of those with the longest match are
counted level by level. Of the two sources' trees the one
with the larger expected number of accepted tokens (the sum of its nodes' probabilities) is
proposed. Drafts are deterministic: verified losslessly by the tree sampler, at any
temperature.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from specdecode.core import Sequence
from specdecode.drafters.base import Drafter, DraftProposal
from specdecode.drafters.ngram import context_ids
from specdecode.tree import TreeShape

SEP = -1  # ends every answer in the corpus: never equal to a token, so matches stop there
KEY = 2  # the tokens a match covers at least (the corpus's index key)
LONG = 8  # a second index's key: where the last 8 tokens occurred before, those matches first
MAX_CANDIDATES = 256  # the most recent matches of a key that vote (bounds a step's work)


_MULT = np.uint64(0x9E3779B97F4A7C15)  # the window hash's multiplier (odd, 64-bit)


def window_hashes(tokens: np.ndarray, width: int) -> np.ndarray:
    """[len - width + 1] a 64-bit polynomial hash of every `width`-token window of `tokens`
    (wrapping arithmetic), as int64; the same for the corpus and a query."""
    t = tokens.astype(np.uint64)
    n = len(t) - width + 1
    h = np.zeros(max(n, 0), dtype=np.uint64)
    with np.errstate(over="ignore"):
        for i in range(width):
            h = h * _MULT + t[i : i + n]
    return h.view(np.int64)


class KeyIndex:
    """key -> the absolute positions it was added at, ascending. A run sorted by (key,
    position), searched by bisection, and the newest entries (at most `PENDING`) in one small
    array scanned directly, inserted into the run when it fills (a sort of the few, then one
    linear copy of the run). 16 bytes an entry: a dict of lists took about 200 (401 MB for a
    1M-token corpus of distinct 2-grams)."""

    PENDING = 4096

    def __init__(self) -> None:
        self._keys = np.empty(0, dtype=np.int64)
        self._pos = np.empty(0, dtype=np.int64)
        self._new_keys = np.empty(0, dtype=np.int64)
        self._new_pos = np.empty(0, dtype=np.int64)

    def __len__(self) -> int:
        return len(self._keys) + len(self._new_keys)

    @property
    def pending(self) -> int:
        return len(self._new_keys)

    def add(self, keys: np.ndarray, positions: np.ndarray) -> None:
        """Entries at positions above every earlier one."""
        self._new_keys = np.concatenate([self._new_keys, keys.astype(np.int64)])
        self._new_pos = np.concatenate([self._new_pos, positions.astype(np.int64)])
        if len(self._new_keys) > self.PENDING:
            self._merge()

    def _merge(self) -> None:
        order = np.argsort(self._new_keys, kind="stable")  # equal keys: positions ascending
        keys, pos = self._new_keys[order], self._new_pos[order]
        at = np.searchsorted(self._keys, keys, "right")  # after the older positions of a key
        self._keys, self._pos = np.insert(self._keys, at, keys), np.insert(self._pos, at, pos)
        self._new_keys, self._new_pos = self._new_keys[:0], self._new_pos[:0]

    def find(self, key: int, floor: int, most: int) -> np.ndarray:
        """The last `most` positions of `key` at or above `floor`, ascending."""
        recent = self._new_pos[self._new_keys == key]
        lo, hi = np.searchsorted(self._keys, key, "left"), np.searchsorted(self._keys, key, "right")
        old = self._pos[max(lo, hi - max(most - len(recent), 0)) : hi]
        found = np.concatenate([old, recent])[-most:] if most > 0 else recent[:0]
        return found[np.searchsorted(found, floor) :]

    def drop_below(self, floor: int) -> None:
        """Forget the entries below `floor` (evicted answers'): one vectorised pass."""
        keep = self._pos >= floor
        self._keys, self._pos = self._keys[keep], self._pos[keep]
        keep = self._new_pos >= floor
        self._new_keys, self._new_pos = self._new_keys[keep], self._new_pos[keep]


class SuffixCorpus:
    """The outputs of finished requests, oldest evicted first, indexed by their 2-grams and by
    the hashes of their 8-token windows. Positions in the indexes are absolute (since the
    corpus began); the buffer holds those from `_base` on."""

    def __init__(self, max_requests: int, max_tokens: int) -> None:
        self.max_requests = max_requests
        self.max_tokens = max_tokens
        self._buf = np.full(1024, SEP, dtype=np.int64)
        self._len = 0  # used part of _buf
        self._base = 0  # the absolute position of _buf[0]
        self._docs: deque[tuple[int, int]] = deque()  # absolute [start, end) of each answer
        self._tokens = 0  # tokens of the answers held
        self._floor = 0  # absolute positions below this were evicted
        # position p is indexed under the 2 tokens before it (where a continuation of that
        # 2-gram starts) and under the hash of the 8 before it, so a long match is found
        # however common its last two tokens are
        self._index = KeyIndex()
        self._long = KeyIndex()

    def __len__(self) -> int:
        return len(self._docs)

    @property
    def num_tokens(self) -> int:
        return self._tokens

    @property
    def buffer(self) -> np.ndarray:
        return self._buf[: self._len]

    def clear(self) -> None:
        self.__init__(self.max_requests, self.max_tokens)

    def add(self, tokens: list[int]) -> None:
        if self.max_requests <= 0 or len(tokens) <= KEY:
            return
        toks = np.asarray(tokens[-self.max_tokens :], dtype=np.int64)
        n = len(toks)
        if self._len + n + 1 > len(self._buf):
            grown = np.full(max(2 * len(self._buf), self._len + n + 1), SEP, dtype=np.int64)
            grown[: self._len] = self._buf[: self._len]
            self._buf = grown
        self._buf[self._len : self._len + n] = toks
        self._buf[self._len + n] = SEP
        start = self._base + self._len
        self._len += n + 1
        self._docs.append((start, start + n))
        self._tokens += n
        # a continuation must follow the key: positions KEY..n-1 (LONG..n-1)
        self._index.add(pair_keys(toks[:-2], toks[1:-1]), start + np.arange(KEY, n))
        if n > LONG:
            self._long.add(window_hashes(toks[:-1], LONG)[: n - LONG], start + np.arange(LONG, n))
        while len(self._docs) > self.max_requests or self._tokens > self.max_tokens:
            s, e = self._docs.popleft()
            self._tokens -= e - s
            self._floor = e + 1
        dead = self._floor - self._base
        if dead > self._len // 2 and dead > 4096:
            self._compact()

    def _compact(self) -> None:
        """Drop the evicted answers: the buffer's dead prefix and the indexes' dead entries
        (numpy copies; lookups skip what is below the floor meanwhile). On the engine's thread,
        once per live corpus's worth of evicted tokens."""
        dead = self._floor - self._base
        self._buf = self._buf[dead:].copy()
        self._len -= dead
        self._base = self._floor
        self._index.drop_below(self._floor)
        self._long.drop_below(self._floor)

    def candidates(self, context: np.ndarray) -> np.ndarray:
        """Buffer positions where continuations of the most recent live occurrences of the
        context's last 8 tokens start, or where there are none, of its last 2."""
        buf, base = self._buf, self._base
        if len(context) >= LONG:
            key = int(window_hashes(np.asarray(context[-LONG:]), LONG)[0])
            found = self._long.find(key, self._floor, MAX_CANDIDATES) - base
            if found.size:  # (a hash collision is weeded out by its last two tokens)
                found = found[(buf[found - 1] == context[-1]) & (buf[found - 2] == context[-2])]
                if found.size:
                    return found
        key = int(pair_keys(context[-2:-1], context[-1:])[0])
        return self._index.find(key, self._floor, MAX_CANDIDATES) - base


def pair_keys(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """One int64 per 2-gram (token ids are below 2**31)."""
    return (a.astype(np.int64) << 32) | b.astype(np.int64)


def own_candidates(context: np.ndarray) -> np.ndarray:
    """Continuation starts p < len(context) with context[p-2:p] == context[-2:] (the current
    suffix itself excluded): the request's own earlier occurrences of its last 2-gram."""
    if len(context) <= KEY:
        return np.empty(0, dtype=np.int64)
    a, b = context[-2], context[-1]
    head = context[:-1]  # p - 1 <= len - 2: a continuation token exists
    hits = np.flatnonzero((head[:-1] == a) & (head[1:] == b)) + KEY
    return hits[-MAX_CANDIDATES:]


def match_lengths(source: np.ndarray, starts: np.ndarray, context: np.ndarray, limit: int):
    """For each candidate (its 2-gram already matched), how many of the context's last tokens
    precede it in `source`, up to `limit` (every candidate's next `limit` - 2 tokens back
    compared at once: a few thousand comparisons, cheaper than a numpy step per token)."""
    top = min(limit, len(context))
    if top <= KEY or len(starts) == 0:
        return np.full(len(starts), KEY, dtype=np.int64)
    back = np.arange(KEY + 1, top + 1)
    idx = starts[:, None] - back
    same = source[np.maximum(idx, 0)] == context[len(context) - back]
    same &= idx >= 0
    return KEY + np.logical_and.accumulate(same, axis=1).sum(axis=1)


def continuations(source: np.ndarray, starts: np.ndarray, depth: int) -> np.ndarray:
    """[len(starts), depth] the tokens that followed each candidate, SEP past an answer's end."""
    idx = starts[:, None] + np.arange(depth)
    inside = idx < len(source)
    out = np.where(inside, source[np.minimum(idx, len(source) - 1)], SEP)
    out[np.cumsum(out == SEP, axis=1) > 0] = SEP
    return out


def frequency_tree(cont: np.ndarray, min_prob: float, size: int):
    """The `size` likeliest continuations of the rows of `cont` as a tree: a node's probability
    is the share of rows that begin with its path (a child's is at most its parent's, so the
    kept set holds every kept node's parent). Returns (parents, tokens, probabilities) in level
    order (within a level, by parent, then token), the root (-1, SEP, 1.0) first.

    With the rows sorted by their paths, a node of depth d is a run of rows that agree on
    their first d tokens: every level's runs are found at once, not a level at a time."""
    rows = cont.shape[0]
    if rows == 0 or size < 1 or cont.shape[1] == 0:
        return [-1], [SEP], [1.0]
    depth = cont.shape[1]
    paths = cont[np.lexsort(cont.T[::-1])]
    new = np.empty(paths.shape, dtype=bool)  # new[i, d]: row i starts a node of depth d + 1
    new[0] = True
    np.not_equal(paths[1:], paths[:-1], out=new[1:])
    np.logical_or.accumulate(new, axis=1, out=new)
    runs = np.flatnonzero(new.T)  # level by level, in path order (each level's row 0 starts)
    share = np.diff(runs, append=depth * rows) / rows
    token = paths.T.reshape(-1)[runs]
    kept = (token != SEP) & (share >= min_prob)
    if not kept.any():
        return [-1], [SEP], [1.0]
    up = np.searchsorted(runs, runs - rows, side="right") - 1  # the run one level up
    ids = np.cumsum(kept)  # node numbers in level order (the root is 0)
    parent = np.where(up >= 0, ids[np.maximum(up, 0)], 0)
    k = np.flatnonzero(kept)
    parent, token, prob = parent[k], token[k], share[k]
    # the best `size` nodes by probability (ties: the first numbered, so the shallower), in
    # level order
    chosen = np.sort(np.argsort(-prob, kind="stable")[:size])
    where = np.zeros(len(k) + 1, dtype=np.int64)
    where[chosen + 1] = np.arange(1, len(chosen) + 1)
    return (
        [-1] + where[parent[chosen]].tolist(),
        [SEP] + token[chosen].tolist(),
        [1.0] + prob[chosen].tolist(),
    )


class SuffixDrafter(Drafter):
    samples_drafts = False
    variable_size = True
    stateless = True  # proposals read the corpus, never change what it holds

    def __init__(
        self,
        max_tree_depth: int = 24,
        max_cached_requests: int = 10000,
        max_spec_factor: float = 1.0,
        min_token_prob: float = 0.1,
        corpus_tokens: int = 1_000_000,
    ) -> None:
        if max_tree_depth <= KEY:
            raise ValueError(f"suffix_decoding_max_tree_depth must be above {KEY}")
        self.max_tree_depth = max_tree_depth
        self.max_spec_factor = max_spec_factor
        self.min_token_prob = min_token_prob
        self.corpus = SuffixCorpus(max_cached_requests, corpus_tokens)
        # False: finished requests' answers are not added (benchmarks measuring prompts whose
        # answers were just generated by another configuration)
        self.learning = True

    def propose(self, seqs: list[Sequence], budgets: list[int]) -> list[DraftProposal]:
        out = []
        for seq, k in zip(seqs, budgets, strict=True):
            parents, tokens = [-1], []
            if k > 0:
                parents, tokens = self.draft(context_ids(seq), k)
            out.append(DraftProposal(TreeShape(tuple(parents)), [seq.last_token] + tokens))
        return out

    def drafted_depth(self, seq: Sequence, proposal: DraftProposal) -> int:
        """Its nodes: the unit the controller prices a variable-size budget's drafting in
        (a budget's expected nodes), and a tree's nodes, not its depth, are what it built."""
        return proposal.num_drafts

    def draft(self, context: np.ndarray, size: int) -> tuple[list[int], list[int]]:
        """(parents, draft tokens) of the better tree of the two sources, at most `size` nodes."""
        parents, tokens, _ = self._best_tree(context, size)
        return parents, tokens[1:]

    def chain(self, context: np.ndarray, size: int) -> list[int]:
        """The likeliest path of that tree (for a lookup branch on a head's tree): from the
        root, the likeliest child each time."""
        parents, tokens, probs = self._best_tree(context, size)
        out, node = [], 0
        while True:
            kids = [j for j in range(node + 1, len(parents)) if parents[j] == node]
            if not kids:
                return out
            node = max(kids, key=lambda j: probs[j])
            out.append(tokens[node])

    def _best_tree(self, context: np.ndarray, size: int):
        if len(context) < KEY:
            return [-1], [SEP], [1.0]
        best = ([-1], [SEP], [1.0])
        tail = context[-self.max_tree_depth :]
        sources = [(context, own_candidates(context))]
        if len(self.corpus):
            corpus = self.corpus.buffer
            sources.append((corpus, self.corpus.candidates(context)))
        for source, starts in sources:
            if starts.size == 0:
                continue
            lengths = match_lengths(source, starts, tail, self.max_tree_depth - 1)
            longest = int(lengths.max())
            # the longest match, and the longest that leaves room for a full draft (the match
            # and the draft share max_tree_depth)
            for n in sorted({longest, max(KEY, min(longest, self.max_tree_depth - size))}):
                cap = min(size, self.max_tree_depth - n, int(self.max_spec_factor * n))
                if cap < 1:
                    continue
                cont = continuations(source, starts[lengths >= n], cap)
                tree = frequency_tree(cont, self.min_token_prob, cap)
                if sum(tree[2][1:]) > sum(best[2][1:]):
                    best = tree
        return best

    def release(self, seq: Sequence) -> None:
        if self.learning and seq.error is None and seq.output_token_ids:
            self.corpus.add(list(seq.output_token_ids))

    def preempt(self, seq: Sequence) -> None:
        """Nothing per request to drop; a preempted request's answer is not finished."""

    def clear_history(self) -> None:
        self.corpus.clear()
