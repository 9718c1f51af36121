"""Sampling: validation, warping against hand-computed distributions, seeds, convergence."""

from __future__ import annotations

import pytest
import torch

from specdecode.errors import InvalidRequestError
from specdecode.sampling import SamplingParams, sample, warp


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": -0.1},
        {"temperature": float("nan")},
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"top_k": -2},
        {"max_tokens": 0},
        {"stop": [""]},
        {"seed": "x"},
        {"seed": 2**64},
        {"seed": -(2**63) - 1},
        {"seed": True},
    ],
)
def test_invalid_values_are_rejected_clearly(kwargs):
    with pytest.raises(InvalidRequestError, match="invalid sampling parameter"):
        SamplingParams(**kwargs)


def test_greedy_is_one_hot_on_argmax():
    logits = torch.tensor([[0.1, 3.0, 2.9, -1.0]])
    assert warp(logits, SamplingParams(temperature=0)).tolist() == [[0, 1, 0, 0]]


def test_temperature_top_k_top_p_by_hand():
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.15, 0.10]]))
    p = warp(logits, SamplingParams(temperature=1.0, top_k=2))
    torch.testing.assert_close(p, torch.tensor([[2 / 3, 1 / 3, 0, 0]]))
    # top_p 0.7: 0.5 alone < 0.7, so 0.25 joins; 0.75 >= 0.7 stops there.
    p = warp(logits, SamplingParams(temperature=1.0, top_p=0.7))
    torch.testing.assert_close(p, torch.tensor([[2 / 3, 1 / 3, 0, 0]]))
    # temperature 0.5 squares the probabilities before renormalising.
    p = warp(logits, SamplingParams(temperature=0.5))
    sq = torch.tensor([0.25, 0.0625, 0.0225, 0.01])
    torch.testing.assert_close(p, (sq / sq.sum())[None])


def test_top_p_keeps_at_least_one_token():
    logits = torch.tensor([[5.0, 0.0, 0.0]])
    p = warp(logits, SamplingParams(temperature=1.0, top_p=0.01))
    assert p[0, 0] == 1 and p[0, 1:].sum() == 0
    # a top_p below fp32's range compares as 0 against the cumulative sum: the top token stays
    p = warp(torch.tensor([[0.0, 5.0, 0.0]]), SamplingParams(temperature=1.0, top_p=1e-46))
    assert p.tolist() == [[0.0, 1.0, 0.0]]


def test_seeded_sampling_is_reproducible():
    probs = torch.full((1, 50), 1 / 50)
    a = [int(sample(probs, SamplingParams(seed=7).make_generator())) for _ in range(3)]
    g1, g2 = SamplingParams(seed=7).make_generator(), SamplingParams(seed=7).make_generator()
    s1 = [int(sample(probs, g1)) for _ in range(20)]
    s2 = [int(sample(probs, g2)) for _ in range(20)]
    assert s1 == s2 and len(set(s1)) > 1 and len(set(a)) == 1


def test_samples_converge_to_the_warped_distribution():
    """20k draws: each frequency's standard error is <= sqrt(.25/20000) = 0.0035, so a 0.02
    tolerance is more than 5 sigma: this fails only if the sampler is wrong."""
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]])
    params = SamplingParams(temperature=0.8, top_k=4, seed=0)
    p = warp(logits, params)[0]
    g = params.make_generator()
    draws = torch.multinomial(p.expand(1, -1), 20000, replacement=True, generator=g)[0]
    freq = torch.bincount(draws, minlength=5).float() / 20000
    assert freq[4] == 0
    torch.testing.assert_close(freq, p, atol=0.02, rtol=0)


def test_every_64_bit_seed_is_accepted_and_names_its_own_stream():
    """OpenAI's seed is an int64: a negative one is its two's complement, not an error."""
    assert SamplingParams(seed=-1).seed == 2**64 - 1 == SamplingParams(seed=2**64 - 1).seed
    assert SamplingParams(seed=-(2**63)).seed == 2**63
    probs = torch.full((1, 50), 1 / 50)

    def stream(seed: int) -> tuple[int, ...]:
        g = SamplingParams(seed=seed).make_generator()
        return tuple(int(sample(probs, g)) for _ in range(20))

    assert stream(-1) == stream(-1)
    assert len({stream(s) for s in (-1, -2, 1, 2)}) == 4


def test_position_draws_follow_p_and_never_pick_a_zero():
    """One draw per position, 20k positions: frequencies within 0.02 of p (> 5 sigma), none
    on a zero-probability token, across the race's blocks (a vocabulary of 3 blocks)."""
    from specdecode.sampling import RACE_BLOCK, position_draws

    p = torch.zeros(1, 2 * RACE_BLOCK + 7)
    for tok, mass in (
        (3, 0.4),
        (RACE_BLOCK + 1, 0.25),
        (RACE_BLOCK + 9, 0.2),
        (2 * RACE_BLOCK + 6, 0.15),
    ):
        p[0, tok] = mass
    draws = [position_draws(p, 2**64 - 1, [t])[0] for t in range(20000)]
    freq = torch.bincount(torch.tensor(draws), minlength=p.shape[1]).float() / 20000
    torch.testing.assert_close(freq, p[0], atol=0.02, rtol=0)
    assert freq[p[0] == 0].sum() == 0
    # every bit of a 64-bit seed names its own stream (a generator seeded with the low 32 bits
    # gave seeds 1 and 1 + 2**32 the same draws)
    flat = torch.full((1, 1000), 1e-3)
    assert [position_draws(flat, 1, [t]) for t in range(20)] != [
        position_draws(flat, 1 + 2**32, [t]) for t in range(20)
    ]
    # a pure function of (seed, position): rows batched or alone, the same tokens
    rows = p.expand(5, -1)
    assert position_draws(rows, 7, list(range(5))) == [
        position_draws(p, 7, [t])[0] for t in range(5)
    ]


def test_position_draws_hold_under_rounding_sized_changes_of_p():
    """p changed by a relative 1e-5 (another batch shape, a prefix-cache hit, a tree's
    attention order in fp32) leaves the draw where it was: an inverse CDF over the vocabulary
    in id order moved about 1 draw in 100 here (the uniform lands among tokens narrower than
    the shift), the race moves one only where its two best scores are that close."""
    from specdecode.sampling import position_draws

    torch.manual_seed(0)
    p = (torch.randn(1, 49152) * 3).softmax(-1)
    noisy = p * (1 + 1e-5 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
    moved = sum(position_draws(p, 11, [t]) != position_draws(noisy, 11, [t]) for t in range(2000))
    assert moved <= 1  # (the inverse CDF: 25 of these 2000)
