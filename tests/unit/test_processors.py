"""Penalties, logit bias, min_tokens and min_p: each draft node's row is processed as if it had
been decoded on its own after the drafts on its path (checked against a direct per-row
computation), and the parameters are validated."""

from __future__ import annotations

import math

import pytest
import torch

from specdecode.core import Sequence
from specdecode.errors import InvalidRequestError
from specdecode.processors import apply, columns_of, mask_stops, paths
from specdecode.sampling import SamplingParams, warp

V = 12


def reference(row: torch.Tensor, params: SamplingParams, prompt, output) -> torch.Tensor:
    """One row processed from its full history, the plain way (vLLM's definitions)."""
    row = row.clone()
    for tok, b in (params.logit_bias or {}).items():
        row[tok] += b
    for tok in set(prompt) | set(output):
        rp = params.repetition_penalty
        row[tok] = row[tok] / rp if row[tok] > 0 else row[tok] * rp
    for tok in set(output):
        n = output.count(tok)
        row[tok] -= params.frequency_penalty * n + params.presence_penalty
    return row


def test_paths_follow_each_node_back_to_the_root():
    parents = (-1, 0, 0, 1, 3, 2)
    tokens = [9, 1, 2, 3, 4, 5]  # the root (9) is the request's own last token
    assert paths(parents, tokens) == [[], [1], [2], [1, 3], [1, 3, 4], [2, 5]]


@pytest.mark.parametrize(
    "kw",
    [
        {"presence_penalty": 0.7},
        {"frequency_penalty": 0.4},
        {"frequency_penalty": -0.3, "presence_penalty": 1.1},
        {"repetition_penalty": 1.5},
        {"repetition_penalty": 0.8, "logit_bias": {3: -2.0, 7: 5.0}},
        {"presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.3,
         "logit_bias": {1: 1.5}},
    ],
)  # fmt: skip
def test_every_tree_row_is_processed_as_if_decoded_alone(kw):
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(**kw)
    prompt, output = [0, 5, 5, 2], [3, 3, 8]
    seq = Sequence(list(prompt), params, output_token_ids=list(output))
    parents = (-1, 0, 0, 1, 3, 2, 1)
    tokens = [8, 3, 4, 3, 9, 4, 11]  # repeats the output (3) and itself along a path (3, 3)
    logits = torch.randn(len(parents), V, generator=g) * 3
    got = logits.clone()
    hist = paths(parents, tokens)
    apply(got, seq, hist)
    for r in range(len(parents)):
        want = reference(logits[r], params, prompt, output + hist[r])
        torch.testing.assert_close(got[r], want)
        # and bit for bit what the plain row computes once the path is output (a rounding
        # apart would flip near-ties between speculative and plain decoding)
        alone = logits[r : r + 1].clone()
        apply(alone, Sequence(list(prompt), params, output_token_ids=output + hist[r]), [[]])
        assert torch.equal(got[r], alone[0]), r
    assert not torch.equal(got, logits)


@pytest.mark.parametrize(
    "kw",
    [
        {"presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.3,
         "logit_bias": {1: 1.5, 4: -3.0, 11: 2.0}},
        {"repetition_penalty": 0.7},
    ],
)  # fmt: skip
def test_rows_over_a_draft_vocabulary_are_the_full_rows_columns(kw):
    """A drafter's rows over a draft vocabulary (some of the target's tokens, in its own order)
    get what the full rows would at those tokens; tokens it lacks are skipped."""
    g = torch.Generator().manual_seed(1)
    params = SamplingParams(**kw)
    seq = Sequence([0, 5, 5, 2], params, output_token_ids=[3, 3, 8, 11])
    parents, tokens = (-1, 0, 1, 0), [11, 3, 9, 4]
    hist = paths(parents, tokens)
    vocab_ids = torch.tensor([9, 3, 0, 1, 5, 7])  # no 2, 4, 8, 11: penalised or biased in full
    full = torch.randn(len(parents), V, generator=g) * 3
    want = full.clone()
    apply(want, seq, hist)
    got = full[:, vocab_ids].clone()
    apply(got, seq, hist, columns_of(vocab_ids, V))
    torch.testing.assert_close(got, want[:, vocab_ids])
    assert not torch.equal(got, full[:, vocab_ids])
    assert columns_of(None, V) is None


def test_min_tokens_masks_stop_tokens_until_enough_are_generated():
    params = SamplingParams(min_tokens=4, stop_token_ids=[5])
    seq = Sequence([1, 2], params, output_token_ids=[7, 7])  # 2 generated
    rows = torch.zeros(4, V)
    rows[3] = float("-inf")
    rows[3, 0] = 1.0  # a grammar allows only EOS here: left alone, not emptied
    mask_stops(rows, seq, depths=[0, 1, 2, 1], stop_ids={0})
    # rows at depth 0 and 1 come before the 4th token: EOS (0) and stop id 5 masked
    assert torch.isinf(rows[0, [0, 5]]).all() and torch.isinf(rows[1, [0, 5]]).all()
    assert torch.isfinite(rows[2]).all()  # depth 2: the 5th token, allowed to stop
    assert rows[3, 0] == 1.0
    ignore = SamplingParams(min_tokens=4, ignore_eos=True)
    rows = torch.zeros(1, V)
    mask_stops(rows, Sequence([1], ignore), depths=[0], stop_ids={0})
    assert torch.isfinite(rows).all()  # EOS does not stop this request: not held back


def test_min_p_drops_tokens_below_its_share_of_the_top_one():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.12, 0.08]]))
    p = warp(logits, SamplingParams(min_p=0.2))  # keeps p >= 0.1
    torch.testing.assert_close(p, torch.tensor([[0.5, 0.3, 0.12, 0.0]]) / 0.92)
    assert torch.equal(warp(logits, SamplingParams(min_p=0.0)) > 0, torch.ones(1, 4, dtype=bool))
    p = warp(logits, SamplingParams(min_p=0.2, temperature=2.0))  # after temperature
    assert (p > 0).sum() == 4 and math.isclose(float(p.sum()), 1.0, rel_tol=1e-6)


@pytest.mark.parametrize(
    "kw",
    [
        {"presence_penalty": 2.5},
        {"frequency_penalty": -2.1},
        {"presence_penalty": float("nan")},
        {"repetition_penalty": 0},
        {"min_p": 1.2},
        {"min_tokens": -1},
        {"min_tokens": 9, "max_tokens": 8},
        {"logit_bias": {"3": 1.0}},
        {"logit_bias": {-1: 1.0}},
        {"logit_bias": {3: 200}},
        {"logit_bias": [(3, 1.0)]},
        {"min_tokens": True},
        {"stop_token_ids": [-1]},
        {"stop_token_ids": [2.0]},
    ],
)
def test_bad_values_are_refused(kw):
    with pytest.raises(InvalidRequestError, match="invalid sampling parameter"):
        SamplingParams(**kw)


def test_reasoning_gate_opens_the_grammar_after_its_marker_and_rolls_back():
    """ReasoningGate: tokens pass unconstrained (all bits set) until their bytes complete the
    marker, even across tokens and after a false start; rolling back over the token that
    completed it reopens the reasoning, and the grammar sees only the tokens after it."""
    from specdecode.structured import ReasoningGate

    class Inner:
        def __init__(self):
            self.taken = []

        def accept_token(self, t):
            if t == 9:
                return False
            self.taken.append(t)
            return True

        def rollback(self, n):
            del self.taken[len(self.taken) - n :]

        def fill_next_token_bitmask(self, bitmask, row=0):
            bitmask[row].zero_()

        def is_terminated(self):
            return len(self.taken) >= 2

    vocab = [b"<", b"/", b"th", b"ink>", b"</think>\n", b"x", b"<</", b"", b"", b"y"]
    inner = Inner()
    g = ReasoningGate(inner, b"</think>", vocab)
    mask = torch.zeros(1, 2, dtype=torch.int32)
    for t in (5, 6, 2, 9):  # "x<</th" then a token the grammar would refuse: no grammar yet
        assert g.accept_token(t)
        g.fill_next_token_bitmask(mask, 0)
        assert (mask == -1).all() and not g.is_terminated()
    assert inner.taken == []
    for t in (0, 1, 2, 3):  # "</think>" over four tokens
        assert g.accept_token(t)
    assert not g.reasoning and inner.taken == []
    g.fill_next_token_bitmask(mask, 0)
    assert (mask == 0).all()  # the grammar's mask now
    assert g.accept_token(5) and not g.accept_token(9) and inner.taken == [5]
    g.rollback(2)  # the grammar's token, then the one that ended the reasoning
    assert inner.taken == [] and g.reasoning
    assert g.accept_token(3) and not g.reasoning  # "ink>" again ends it
    g.rollback(3)
    assert g.reasoning and g.matched == 1  # back to "x<</thy<": "<" matched
    g.rollback(4)
    assert g.reasoning and g.matched == 0  # back to "x": nothing matched
    assert g.accept_token(4) and not g.reasoning  # one token spelling it and more
    assert g.accept_token(5) and g.accept_token(5) and g.is_terminated()
