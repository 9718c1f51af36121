"""The per-request speculative counters as the Python API reports them."""

from __future__ import annotations

import pytest

from specdecode.metrics import SpecDecodeStats


def test_acceptance_by_position_is_vllms_and_sums_to_tau():
    """vLLM's per-position acceptance is over every drafting step, so 1 + its sum is tau; the
    rate among the steps that drafted that deep is reported beside it (a review found the second
    under the first's name, rising with depth where the adaptive policy drafted shallower)."""
    s = SpecDecodeStats()
    s.record(3, 3, 3)  # a chain of 3, all accepted
    s.record(1, 1, 0)  # a chain of 1, rejected
    d = s.as_dict()
    assert d["acceptance_by_position"] == [0.5, 0.5, 0.5]
    assert d["acceptance_by_position_when_drafted"] == [0.5, 1.0, 1.0]
    assert d["mean_acceptance_length"] == pytest.approx(1 + sum(d["acceptance_by_position"]))
