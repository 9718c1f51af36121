"""Prompt lookup (n-gram) drafting: no model, no parameters to train.

If the last n tokens of a request (n from `prompt_lookup_max` down to `prompt_lookup_min`) occurred
earlier in its own prompt or output, propose the tokens that followed the most recent earlier
occurrence (Saxena 2023, "prompt lookup decoding"; vLLM's `ngram` method). Works best where the
output copies its input: code edits, extraction, JSON from a document.
"""

from __future__ import annotations

import numpy as np

from specdecode.core import Sequence
from specdecode.drafters.base import Drafter, DraftProposal
from specdecode.tree import TreeShape


def context_ids(seq: Sequence) -> np.ndarray:
    """A request's prompt and output so far, as lookup reads them (a view: do not write). The
    array is kept on the request and grown by what was appended since the last call (output
    tokens are only ever appended): converting a long prompt every step cost more than the
    lookup itself."""
    n = seq.num_tokens
    buf, have = seq.lookup_context or (None, 0)
    if buf is None or have > n or n > len(buf):
        grown = np.empty(max(64, 2 * n), dtype=np.int64)
        if buf is not None and have <= n:
            grown[:have] = buf[:have]
        else:
            have = 0
        buf = grown
    if have < n:
        buf[have:n] = seq.token_ids(have, n)
    seq.lookup_context = (buf, n)
    return buf[:n]


def lookup(context: np.ndarray, min_n: int, max_n: int, k: int, _few: int = 16) -> list[int]:
    """Up to k tokens that followed the most recent earlier match of the longest suffix n-gram
    (min_n <= n <= max_n; the match must be followed by at least one token).

    Every earlier occurrence of the last token is a candidate match end; candidates are
    extended backwards a token at a time, vectorised while many remain, in Python once `_few`
    do (one pass over the context, not one per n)."""
    length = len(context)
    max_n = min(max_n, length - 1)
    if max_n < min_n:
        return []
    ends = np.flatnonzero(context[: length - 1] == context[length - 1])
    if ends.size == 0:
        return []
    n = 1  # every end in `ends` matches the context's last n tokens
    while n < max_n and ends.size > _few:
        longer = ends[ends >= n]
        longer = longer[context[longer - n] == context[length - 1 - n]]
        if longer.size == 0:
            break
        ends, n = longer, n + 1
    end = int(ends[-1])
    if n < max_n and ends.size <= _few:  # a few left: extend each in Python
        tail = context[length - max_n :].tolist()
        best = n
        for e in ends.tolist():
            before = context[max(0, e + 1 - max_n) : e + 1].tolist()
            m = n
            while m < len(before) and before[-1 - m] == tail[-1 - m]:
                m += 1
            if m >= best:
                best, end = m, e
        n = best
    if n < min_n:
        return []
    return context[end + 1 : end + 1 + k].tolist()


class NgramDrafter(Drafter):
    samples_drafts = False
    variable_size = True
    stateless = True

    def __init__(self, prompt_lookup_min: int = 2, prompt_lookup_max: int = 5) -> None:
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError("need 1 <= prompt_lookup_min <= prompt_lookup_max")
        self.min_n, self.max_n = prompt_lookup_min, prompt_lookup_max

    def propose(self, seqs: list[Sequence], budgets: list[int]) -> list[DraftProposal]:
        out = []
        for seq, k in zip(seqs, budgets, strict=True):
            root = seq.last_token
            drafts = []
            if k > 0:
                drafts = lookup(context_ids(seq), self.min_n, self.max_n, k)
            out.append(DraftProposal(TreeShape.chain(len(drafts)), [root] + drafts))
        return out
