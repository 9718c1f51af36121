"""Prompt lookup: the longest suffix n-gram's most recent earlier match, and what followed it."""

from __future__ import annotations

import random

import numpy as np
import pytest

from specdecode.core import Sequence
from specdecode.drafters.ngram import context_ids, lookup
from specdecode.sampling import SamplingParams


def reference(context: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """The definition, spelled out: for n from max_n down to min_n, the latest start s < len - n
    with context[s:s+n] equal to the last n tokens; the k tokens after it."""
    length = len(context)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = context[length - n :]
        for s in range(length - n - 1, -1, -1):
            if context[s : s + n] == suffix:
                return context[s + n : s + n + k]
    return []


def test_hand_checked_cases():
    ctx = np.asarray([5, 1, 2, 3, 9, 1, 2, 3, 7, 8, 2, 3], dtype=np.int64)
    # the last three tokens, "8 2 3", never occurred before; "2 3" did, at 2-3 and 6-7: the
    # latest is followed by 7 8
    assert lookup(ctx, 1, 3, 2) == [7, 8]
    assert lookup(ctx, 1, 3, 9) == [7, 8, 2, 3]  # up to the end of the context
    assert lookup(ctx, 3, 3, 2) == []  # "8 2 3" never occurred before
    ctx = np.asarray([1, 2, 1, 2, 1, 2], dtype=np.int64)  # overlapping matches count
    assert lookup(ctx, 2, 4, 3) == [1, 2]
    assert lookup(np.asarray([4], dtype=np.int64), 1, 3, 2) == []
    assert lookup(np.asarray([4, 4], dtype=np.int64), 1, 3, 2) == [4]


@pytest.mark.parametrize("few", [0, 2, 16, 1000])  # vectorised, mixed, and Python extension
def test_lookup_matches_the_definition(few):
    rnd = random.Random(few)
    for _ in range(3000):
        length, vocab = rnd.randint(1, 70), rnd.choice([1, 2, 3, 5, 30])
        ctx = [rnd.randrange(vocab) for _ in range(length)]
        lo = rnd.randint(1, 4)
        hi, k = rnd.randint(lo, 7), rnd.randint(1, 8)
        got = lookup(np.asarray(ctx, dtype=np.int64), lo, hi, k, few)
        assert got == reference(ctx, lo, hi, k), (ctx, lo, hi, k)


def test_the_context_array_grows_with_the_output():
    seq = Sequence(list(range(100, 150)), SamplingParams())
    first = context_ids(seq)
    assert first.tolist() == seq.prompt_token_ids
    for i in range(300):  # past the array's first capacity
        seq.output_token_ids.append(i % 11)
        if i % 3 == 0:
            assert context_ids(seq).tolist() == seq.prompt_token_ids + seq.output_token_ids
    assert context_ids(seq).dtype == np.int64
