"""`bench serve`'s report from a fabricated sweep: ratios against the mean of plain decoding's
two runs, the noise column, and the adaptive policy's drafting and lite-draft shares."""

from __future__ import annotations

import pytest

from specdecode.bench.serve import markdown, summarize


def _row(c, policy, tok_s, drafting=None, lite=None, repeat=False):
    return {
        "concurrency": c,
        "policy": policy,
        "throughput_tok_s": tok_s,
        "tpot_ms": 1000 / tok_s,
        "repeat": repeat,
        "drafting_share": drafting,
        "lite_share": lite,
    }


def test_the_table_reads_ratios_noise_and_lite_drafts():
    rows = [
        _row(1, "off", 10.0),
        _row(1, "adaptive", 16.5, drafting=1.0, lite=0.79),
        _row(1, "off", 12.0, repeat=True),
        _row(4, "off", 30.0),
        _row(4, "adaptive", 30.0, drafting=0.0, lite=0.0),
        _row(4, "off", 30.0, repeat=True),
    ]
    result = {
        "rows": rows,
        "summary": summarize(rows),
        "speculative_config": {"method": "draft_model", "num_speculative_tokens": 4},
        "workload": "code",
        "temperature": 0.0,
        "max_tokens": 64,
        "dtype": "bfloat16",
    }
    assert result["summary"]["adaptive"] == {1: pytest.approx(1.5), 4: pytest.approx(1.0)}
    table = markdown(result).splitlines()
    one = next(line for line in table if line.startswith("| 1 |"))
    four = next(line for line in table if line.startswith("| 4 |"))
    cells = one.split(" | ")[1:]  # off, adaptive, static vs off (none ran), adaptive vs off, ...
    assert cells == ["11.0", "16.5", "-", "1.50x", "100.0 / 60.6", "100% (lite 79%)", "18.2% |"]
    # no lite drafts verified: nothing said
    assert four.split(" | ")[1:] == ["30.0", "30.0", "-", "1.00x", "33.3 / 33.3", "0%", "0.0% |"]
