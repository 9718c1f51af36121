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

import bisect
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


class SuffixCorpus:
    """The outputs of finished requests, oldest evicted first, indexed by 2-grams. Positions in
    the index are absolute (since the corpus began); the buffer holds those from `_base` on."""

    def __init__(self, max_requests: int, max_tokens: int) -> None:
        self.max_requests = max_requests
        self.max_tokens = max_tokens
        self._buf = np.full(1024, SEP, dtype=np.int64)
        self._len = 0  # used part of _buf
        self._base = 0  # the absolute position of _buf[0]
        self._docs: deque[tuple[int, int]] = deque()  # absolute [start, end) of each answer
        self._tokens = 0  # tokens of the answers held
        self._floor = 0  # absolute positions below this were evicted
        # (a, b) -> absolute positions p (ascending) with (a, b) just before p: where a
        # continuation of that 2-gram starts; and the same by the hash of the 8 tokens before
        # p, so a long match is found however common its last two tokens are
        self._index: dict[tuple[int, int], list[int]] = {}
        self._long: dict[int, list[int]] = {}

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
        tokens = tokens[-self.max_tokens :]
        n = len(tokens)
        if self._len + n + 1 > len(self._buf):
            grown = np.full(max(2 * len(self._buf), self._len + n + 1), SEP, dtype=np.int64)
            grown[: self._len] = self._buf[: self._len]
            self._buf = grown
        self._buf[self._len : self._len + n] = tokens
        self._buf[self._len + n] = SEP
        start = self._base + self._len
        self._len += n + 1
        self._docs.append((start, start + n))
        self._tokens += n
        index, long = self._index, self._long
        for p in range(KEY, n):  # a continuation must follow the key
            index.setdefault((tokens[p - 2], tokens[p - 1]), []).append(start + p)
        for p in range(LONG, n):
            long.setdefault(hash(tuple(tokens[p - LONG : p])), []).append(start + p)
        while len(self._docs) > self.max_requests or self._tokens > self.max_tokens:
            s, e = self._docs.popleft()
            self._tokens -= e - s
            self._floor = e + 1
        dead = self._floor - self._base
        if dead > self._len // 2 and dead > 4096:
            self._compact()

    def _compact(self) -> None:
        """Drop the evicted answers: the buffer's dead prefix (one numpy copy), and the index's
        dead entries (a pass over its keys, not its tokens; lookups trim what this leaves). On
        the engine's thread, once per live corpus's worth of evicted tokens: 0.41 s at the
        1M-token cap with a million distinct 2-grams (random tokens; text has fewer), where
        rebuilding the indexes would take seconds (2-core EPYC VM)."""
        dead = self._floor - self._base
        self._buf = self._buf[dead:].copy()
        self._len -= dead
        self._base = self._floor
        floor = self._floor
        for index in (self._index, self._long):
            for key in list(index):
                found = index[key]
                if found[-1] < floor:
                    del index[key]
                elif found[0] < floor:
                    del found[: bisect.bisect_left(found, floor)]

    def candidates(self, context: np.ndarray) -> np.ndarray:
        """Buffer positions where continuations of the most recent live occurrences of the
        context's last 8 tokens start, or where there are none, of its last 2."""
        if len(context) >= LONG:
            found = self._live(self._long, hash(tuple(context[-LONG:].tolist())))
            if found.size:  # (a hash collision is weeded out by its last two tokens)
                buf = self._buf
                found = found[(buf[found - 1] == context[-1]) & (buf[found - 2] == context[-2])]
                if found.size:
                    return found
        return self._live(self._index, (int(context[-2]), int(context[-1])))

    def _live(self, index: dict, key) -> np.ndarray:
        found = index.get(key)
        if not found:
            return np.empty(0, dtype=np.int64)
        if found[0] < self._floor:  # evicted entries are a prefix: trim them
            del found[: bisect.bisect_left(found, self._floor)]
            if not found:
                del index[key]
                return np.empty(0, dtype=np.int64)
        return np.asarray(found[-MAX_CANDIDATES:], dtype=np.int64) - self._base


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
    precede it in `source`, up to `limit`."""
    m = np.full(len(starts), KEY, dtype=np.int64)
    alive = np.ones(len(starts), dtype=bool)
    for j in range(KEY + 1, min(limit, len(context)) + 1):
        idx = starts - j
        ok = alive & (idx >= 0)
        ok[ok] = source[idx[ok]] == context[-j]
        alive = ok
        if not alive.any():
            break
        m += alive
    return m


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
    order, the root (-1, SEP, 1.0) first."""
    rows = cont.shape[0]
    parents, tokens, probs = [-1], [SEP], [1.0]
    if rows == 0 or size < 1:
        return parents, tokens, probs
    node = np.zeros(rows, dtype=np.int64)
    alive = np.ones(rows, dtype=bool)
    depth_of = [0]
    for d in range(cont.shape[1]):
        col = cont[:, d]
        alive &= col != SEP
        live = np.flatnonzero(alive)
        if live.size == 0:
            break
        keys = (node[live] << 32) | col[live]
        uniq, inverse, counts = np.unique(keys, return_inverse=True, return_counts=True)
        share = counts / rows
        keep = share >= min_prob
        ids = np.full(len(uniq), -1, dtype=np.int64)
        ids[keep] = np.arange(len(parents), len(parents) + int(keep.sum()))
        for u in np.flatnonzero(keep):
            parents.append(int(uniq[u] >> 32))
            tokens.append(int(uniq[u] & 0xFFFFFFFF))
            probs.append(float(share[u]))
            depth_of.append(d + 1)
        node[live] = ids[inverse]
        alive[live[ids[inverse] < 0]] = False
    # the best `size` nodes by probability (ties: shallower, then first found), in level order
    chosen = sorted(range(1, len(parents)), key=lambda j: (-probs[j], depth_of[j], j))[:size]
    chosen.sort(key=lambda j: (depth_of[j], j))
    where = {0: 0} | {j: n + 1 for n, j in enumerate(chosen)}
    return (
        [-1] + [where[parents[j]] for j in chosen],
        [SEP] + [tokens[j] for j in chosen],
        [1.0] + [probs[j] for j in chosen],
    )


class SuffixDrafter(Drafter):
    samples_drafts = False
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
