"""Prompt lookup (n-gram) drafting: no model, no parameters to train.

If the last n tokens of a request (n from `prompt_lookup_max` down to `prompt_lookup_min`) occurred
earlier in its own prompt or output, propose the tokens that followed the most recent earlier
occurrence (Saxena 2023, "prompt lookup decoding"; vLLM's `ngram` method). Works best where the
output copies its input: code edits, extraction, JSON from a document.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from specdecode.core import Sequence
from specdecode.drafters.base import Drafter, DraftProposal
from specdecode.tree import TreeShape


def context_ids(seq: Sequence) -> np.ndarray:
    """A request's prompt and output so far, as lookup reads them."""
    return np.asarray(seq.prompt_token_ids + seq.output_token_ids, dtype=np.int64)


def lookup(context: np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """Up to k tokens that followed the most recent earlier match of the longest suffix n-gram."""
    length = len(context)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = context[length - n :]
        windows = sliding_window_view(context[: length - 1], n)  # starts 0 .. length - 1 - n
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        hits = hits[hits + n < length]  # the match must be followed by at least one token
        if hits.size:
            start = int(hits[-1]) + n
            return context[start : start + k].tolist()
    return []


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
