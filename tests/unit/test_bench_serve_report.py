"""`bench serve`'s report from a fabricated sweep: ratios against the mean of plain decoding's
two runs, the noise column, and the adaptive policy's drafting and lite-draft shares."""

from __future__ import annotations

import statistics

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
    # off (the mean of its runs), adaptive, static vs off (none ran), adaptive vs off, TPOT
    # off (its runs' mean) / adaptive, ...
    cells = one.split(" | ")[1:]
    assert cells == ["11.0", "16.5", "-", "1.50x", "91.7 / 60.6", "100% (lite 79%)", "18.2% |"]
    # no lite drafts verified: nothing said
    assert four.split(" | ")[1:] == ["30.0", "30.0", "-", "1.00x", "33.3 / 33.3", "0%", "0.0% |"]


def test_a_level_is_timed_while_every_client_is_busy(monkeypatch):
    """Two clients, four requests (2, 4, 2 and 20 tokens): the window runs from the first
    completion (tick 2, when the third request is sent) to the last send (tick 4), both
    clients busy (2 tokens per tick), not over the whole run with its drain (28 tokens in 24
    ticks). The engine steps every running request together on a clock of its own, so the
    figures do not depend on how busy this machine is."""
    import asyncio
    from types import SimpleNamespace

    from specdecode.bench.serve import _level

    tick, lengths = 0.02, [2, 4, 2, 6]

    class Clock:  # `time` for the level: it moves a tick per engine step
        now, waiting = 0.0, []

        def perf_counter(self):
            return self.now

        process_time = perf_counter

        async def step(self):
            done = asyncio.get_running_loop().create_future()
            self.waiting.append(done)
            await done

    clock = Clock()
    monkeypatch.setattr("specdecode.bench.serve.time", clock)

    class Engine:
        per_update, error = 1, None  # tokens an update brings (speculation: several)

        async def generate(self, ids, params):
            for k in range(self.per_update, params + 1, self.per_update):
                await clock.step()
                yield SimpleNamespace(error=self.error, token_ids=[k], num_output_tokens=k)

    async def run(concurrency, n):
        async def steps():  # every request waiting: one step for all of them
            while True:
                for _ in range(20):
                    await asyncio.sleep(0)
                if clock.waiting:
                    clock.now += tick
                    ready, clock.waiting = clock.waiting, []
                    for done in ready:
                        done.set_result(None)

        stepping = asyncio.create_task(steps())
        try:
            return await _level(engine, lambda i: ([1], lengths[i]), concurrency, n)
        finally:
            stepping.cancel()

    engine = Engine()
    row = asyncio.run(run(2, 4))
    assert row["output_tokens"] == 14 and row["seconds"] == pytest.approx(10 * tick)
    # a token per update: the gap between updates (ITL) is the time per token (TPOT)
    assert row["itl_ms"] == pytest.approx(1000 * tick) == row["tpot_ms"]
    assert row["steady_seconds"] == pytest.approx(2 * tick)
    assert row["throughput_tok_s"] == pytest.approx(2 / tick)
    assert row["timed_over"] == "steady state"
    # a long drain: the window's 2 tokens are not a quarter of the run's 28, so the level is
    # timed over the whole run (a review measured "38,253 tok/s" over a window of microseconds)
    lengths[3] = 20
    row = asyncio.run(run(2, 4))
    assert row["output_tokens"] == 28 and row["timed_over"] == "whole run"
    assert row["throughput_tok_s"] == pytest.approx(28 / (24 * tick))
    with pytest.raises(ValueError, match=">= 1"):
        asyncio.run(run(0, 1))
    # two tokens an update (accepted drafts): a tick between updates, half a tick a token
    # after the first update's two (TPOT is per token, ITL per update, as in vLLM's benchmark)
    engine.per_update, lengths[:] = 2, [2, 4, 2, 6]
    row = asyncio.run(run(2, 4))
    assert row["itl_ms"] == pytest.approx(1000 * tick)
    assert row["tpot_ms"] == pytest.approx(1000 * statistics.mean([0, tick / 3, 0, 2 * tick / 5]))
    # a failed request ends the sweep with what failed, as a clear error
    from specdecode.bench.serve import BenchError

    engine.error = "the engine stopped"
    with pytest.raises(BenchError, match="concurrency 2: the engine stopped"):
        asyncio.run(run(2, 4))


def test_the_steady_window_leaves_out_the_start_and_the_drain():
    """By hand: two clients; the first two requests wait 3 s for their first token (every
    prompt prefilled at once), the second pair is sent as the first pair ends (at 4 and 6 s).
    The window is [4, 6]: 4 tokens in 2 s (start to last send: 8 in 6; the whole run 11 in 8)."""
    from specdecode.bench.serve import _steady

    rows = [
        (0.0, 3.0, 4.0, 2, [(3.0, 1), (4.0, 2)]),
        (0.0, 3.0, 6.0, 4, [(3.0, 1), (4.0, 2), (5.0, 3), (6.0, 4)]),
        (4.0, 5.0, 7.0, 3, [(5.0, 1), (6.0, 2), (7.0, 3)]),
        (6.0, 7.0, 8.0, 2, [(7.0, 1), (8.0, 2)]),
    ]
    assert _steady(rows, 2) == (4, 2.0)
    assert _steady(rows, 4) is None  # no more requests than clients: no steady state
    assert _steady(rows[:3], 2) is None  # one send after the start: no window
    # requests that end together: a window of a microsecond holding 1 token of the run's 9
    rows = [
        (0.0, 1.0, 4.0, 4, [(1.0, 1), (4.0, 4)]),
        (0.0, 1.0, 4.0, 4, [(1.0, 1), (4.0, 4)]),
        (4.0, 4.0000005, 4.5, 1, [(4.0000005, 1)]),
        (4.000001, 5.0, 5.0, 0, []),
    ]
    assert _steady(rows, 2) is None


def test_bench_argument_types_normalise_what_they_accept(capsys):
    from specdecode.bench import level_list
    from specdecode.bench.structured import _print

    assert level_list("1, 4,") == "1,4" and level_list("") == ""
    side = {"decode_tok_s": 0.0, "tokens_per_forward": 1.0, "forced_share": 0.0, "tau": None,
            "acceptance_rate": 0.0}  # fmt: skip
    _print({"method": "ngram", "constrained": True, "plain": side, "spec": side, "speedup": None})
    out = capsys.readouterr().out
    assert out.startswith("ngram") and "plain" in out and "(no decode step timed)" in out


def test_temperature_lists_normalise():
    from specdecode.bench import temperatures

    assert temperatures("0, 0.7,") == "0.0,0.7"


def test_cpu_engines_also_report_ratios_by_cpu_time():
    """On a CPU engine each row carries its tokens per CPU second, and the report gives the
    policies' ratios by CPU time beside the wall-clock ones (a busy host often moves wall time
    more); a GPU engine's rows say nothing of CPU time."""
    rows = [
        {**_row(16, "off", 80.0), "tok_per_cpu_s": 40.0, "cpu_engine": True},
        {**_row(16, "static", 60.0, drafting=1.0), "tok_per_cpu_s": 36.0, "cpu_engine": True},
        {**_row(16, "adaptive", 90.0, drafting=0.2), "tok_per_cpu_s": 42.0, "cpu_engine": True},
        {**_row(16, "off", 100.0, repeat=True), "tok_per_cpu_s": 44.0, "cpu_engine": True},
    ]
    summary = summarize(rows)
    assert summary["cpu_time"] == {
        "static": {16: pytest.approx(36 / 42)},
        "adaptive": {16: pytest.approx(1.0)},
    }
    assert "by process CPU time" in summary["text"]
    result = {
        "rows": rows,
        "summary": summary,
        "speculative_config": {"method": "suffix", "num_speculative_tokens": 16},
        "workload": "code",
        "temperature": 0.0,
        "max_tokens": 64,
        "dtype": "float32",
    }
    table = markdown(result).splitlines()
    assert "CPU time" in next(line for line in table if line.startswith("| concurrency"))
    cells = next(line for line in table if line.startswith("| 16 |")).split(" | ")
    assert cells[-2:] == ["0.86x / 1.00x", "22.2% (9.5% CPU) |"]
    gpu = [{**r, "cpu_engine": False} for r in rows]
    gpu_summary = summarize(gpu)
    assert "cpu_time" not in gpu_summary
    assert "CPU" not in markdown({**result, "rows": gpu, "summary": gpu_summary})


def test_a_loss_is_a_ratio_below_plain_decodings_own_spread():
    """0.997x off where plain decoding's two runs came out 1.1% apart is a tie, not a loss (a
    review saw "loses from concurrency 1" there); 0.95x is a loss; a level with too few requests
    for a steady state says it was timed over the whole run."""
    rows = [
        _row(1, "off", 100.0),
        _row(1, "static", 100.25),
        _row(1, "off", 101.1, repeat=True),
        _row(2, "off", 100.0),
        {**_row(2, "static", 95.0), "timed_over": "whole run"},
        _row(2, "off", 100.0, repeat=True),
    ]
    tie = summarize(rows[:3])
    assert tie["static_negative_from"] is None
    assert (
        "never lost" in tie["text"]
        and "within plain decoding's run-to-run spread at 1" in (tie["text"])
    )
    both = summarize(rows)
    assert both["static_negative_from"] == 2 and both["whole_run_levels"] == [2]
    assert "concurrency 2: timed over the whole run" in both["text"]


def test_the_printed_rows_end_a_level_with_ratios_against_both_off_runs(capsys):
    """Each row prints as it finishes, against plain decoding's first run (the only one yet);
    the second off run's line gives every policy's ratio against the mean the table uses."""
    from specdecode.bench.serve import _print

    rows = []
    for row in (
        _row(1, "off", 10.0),
        {**_row(1, "adaptive", 16.5), "ttft_p50_ms": 5.0, "acceptance_rate": None},
        _row(1, "off", 12.0, repeat=True),
    ):
        row.setdefault("ttft_p50_ms", 5.0)
        row.setdefault("acceptance_rate", None)
        rows.append(row)
        _print(row, rows)
    lines = capsys.readouterr().out.splitlines()
    assert "(1.65x off)" in lines[1]  # against the first run, 10 tok/s
    assert "runs 18.2% apart; against their mean: adaptive 1.50x)" in lines[2]


def test_a_suite_report_leaves_out_what_did_not_run(tmp_path):
    """No references, no concurrency sweep: no empty section and no empty plot; a short run's
    time reads as such; the structured verdict says how many tokens its acceptance is from."""
    from specdecode.bench.report import write_report
    from specdecode.bench.suite import plots

    def row(method, speedup, acc, drafted):
        return {"workload": "json", "temperature": 0.0, "method": method, "tok_s": 10 * speedup,
                "speedup": speedup, "acceptance_rate": acc, "tau": 1 + acc, "vs_off": speedup,
                "draft_tokens": drafted}  # fmt: skip

    result = {
        "command": "specdecode bench suite --references ''", "machine": "a VM", "seconds": 20,
        "max_tokens": 8, "num_prompts": 1, "workloads": ["json"], "temperatures": [0.0],
        "targets": [{"target": "t", "dtype": "float32", "skipped": {}, "concurrency": [],
                     "configs": {"ngram": {"method": "ngram"}},
                     "concurrency_workload": "json",
                     "rows": [row("off", 1.0, 0.0, 0), row("ngram", 1.02, 0.93, 14)]}],
    }  # fmt: skip
    paths = plots(result, tmp_path)
    assert "speedup_vs_concurrency.png" not in [p.name for p in paths]
    assert not (tmp_path / "speedup_vs_concurrency.png").exists()
    write_report([(result, tmp_path)], tmp_path / "B.md")
    text = (tmp_path / "B.md").read_text()
    assert "References" not in text and "under a minute" in text
    assert "14 drafted tokens" in text and "speedup_vs_concurrency" not in text


def test_a_level_is_timed_alike_for_every_policy():
    """Where one policy's run at a level has no steady state, every policy there is timed over
    its whole run: a steady window against a whole run (start and drain) is no ratio."""
    from specdecode.bench.serve import _whole_level

    def timed(policy, tok, sec, steady, over):
        return {**_row(4, policy, steady), "output_tokens": tok, "seconds": sec,
                "steady_seconds": 1.0, "timed_over": over}  # fmt: skip

    rows = [timed("off", 100, 10.0, 14.0, "steady state"),
            timed("static", 150, 10.0, 15.0, "whole run")]  # fmt: skip
    assert _whole_level(rows, 4)
    assert [r["throughput_tok_s"] for r in rows] == [10.0, 15.0]
    assert {r["timed_over"] for r in rows} == {"whole run"}
    assert not _whole_level([timed("off", 1, 1.0, 5.0, "steady state")], 4)


def test_losing_at_one_level_is_not_losing_from_it():
    """Static below plain decoding at concurrency 1 and above it at 4 and 16 loses "at 1 only",
    not "from 1" (a review's run printed the latter with static at 1.41x at 4)."""
    rows = [_row(c, p, v) for c, s in ((1, 80.0), (4, 130.0), (16, 120.0))
            for p, v in (("off", 100.0), ("static", s))]  # fmt: skip
    out = summarize(rows)
    assert out["static_negative_from"] is None and out["static_negative_at"] == [1]
    assert "loses to plain decoding at concurrency 1 only" in out["text"]
    rows += [_row(32, "off", 100.0), _row(32, "static", 90.0)]
    rows = [r for r in rows if r["concurrency"] != 16] + [_row(16, "off", 100.0),
                                                          _row(16, "static", 95.0)]  # fmt: skip
    out = summarize(rows)
    assert out["static_negative_from"] == 16 and out["static_negative_at"] == [1, 16, 32]
    assert "from concurrency 16 on (and at 1)" in out["text"]
    # summarised after every row, levels in any order: a level with "off" alone so far is fine
    partial = [_row(16, "off", 100.0), _row(16, "static", 90.0), _row(4, "off", 100.0)]
    assert summarize(partial)["static"] == {16: pytest.approx(0.9)}
