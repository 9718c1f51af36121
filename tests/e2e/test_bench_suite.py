"""`specdecode bench suite` and `specdecode advise` on the tiny model, through the command line."""

from __future__ import annotations

import json

import pytest
from test_cli import _roomy_tiny, run

WORKLOADS = ("code", "sql", "json", "writing", "chat")


@pytest.fixture(scope="module")
def roomy(tiny_llama_dir, tmp_path_factory):
    return _roomy_tiny(tiny_llama_dir, tmp_path_factory.mktemp("roomy"))


def test_suite_runs_every_workload_method_and_level(roomy, tmp_path):
    out, report = tmp_path / "suite", tmp_path / "BENCHMARKS.md"
    r = run(
        "-v", "bench", "suite", "--model", str(roomy), "--methods", "off,ngram,draft_model,eagle3",
        "--draft-model", str(roomy), "--temperatures", "0,1", "--num-prompts", "1",
        "--max-tokens", "6", "--max-prompt-tokens", "96", "--concurrency", "1,2",
        "--min-requests", "2", "--references", "transformers,llamacpp", "--out", str(out),
        "--report", str(report), timeout=1200,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    result = json.loads((out / "suite.json").read_text())
    # the command recorded to rerun it: the words after `bench suite`, a global -v not among them
    assert result["command"].startswith("specdecode bench suite --model ")
    (t,) = result["targets"]
    cells = {(row["workload"], row["temperature"], row["method"]) for row in t["rows"]}
    for wl in WORKLOADS:
        for temp in (0.0, 1.0):
            for m in ("off", "ngram", "draft_model", "transformers", "transformers prompt lookup"):
                assert (wl, temp, m) in cells, (wl, temp, m)
    spec = [row for row in t["rows"] if row["method"] in ("ngram", "draft_model")]
    assert all(row["tok_s"] > 0 and row["speedup"] > 0 and row["tau"] >= 1 for row in spec)
    # a method with nothing to run says why instead of giving a number
    assert "eagle3" in t["skipped"] and "heads" in t["skipped"]["eagle3"]
    assert "llama.cpp" in t["references_skipped"]  # the tiny model has no GGUF file
    levels = {(row["method"], row["policy"], row["concurrency"]) for row in t["concurrency"]}
    for c in (1, 2):
        assert ("off", "off", c) in levels
        for m in ("ngram", "draft_model"):
            assert {(m, "static", c), (m, "adaptive", c)} <= levels
    for png in ("speedup_vs_concurrency", "acceptance_vs_temperature", "tau_per_workload"):
        assert (out / f"{png}.png").read_bytes()[:4] == b"\x89PNG"
    md = (out / "suite.md").read_text()
    assert "| writing | 0 |" in md and "not run" in md
    text = report.read_text()
    assert "against the seed's figures" in text and "bench suite" in text
    assert "speedup_vs_concurrency.png" in text
    # the page can also be rebuilt from several runs' directories; two runs of one target
    # are told apart by their folders, and a folder given twice is refused
    import shutil

    shutil.copytree(out, tmp_path / "rerun")
    again = tmp_path / "again.md"
    r = run("bench", "report", str(out), str(tmp_path / "rerun"), "--out", str(again))
    assert r.returncode == 0, r.stderr
    text = again.read_text()
    assert text.count("## Results:") == 2 and "(suite)" in text and "(rerun)" in text
    r = run("bench", "report", str(out), str(out), "--out", str(again))
    assert r.returncode == 2 and "given twice" in r.stderr
    r = run("bench", "report", str(tmp_path / "nowhere"), "--out", str(again))
    assert r.returncode == 2 and "not found" in r.stderr
    (tmp_path / "bad.json").write_text("{not json")
    r = run(
        "bench", "report", str(out), "--advise", str(tmp_path / "bad.json"), "--out", str(again)
    )
    assert r.returncode == 2 and "not valid JSON" in r.stderr and "Traceback" not in r.stderr
    (tmp_path / "other.json").write_text('{"rows": []}')  # valid JSON, another command's
    r = run(
        "bench", "report", str(out), "--advise", str(tmp_path / "other.json"), "--out", str(again)
    )
    assert r.returncode == 2 and "is not an `advise --json` result" in r.stderr


def test_suite_rejects_unknown_methods(roomy, tmp_path):
    r = run(
        "bench", "suite", "--model", str(roomy), "--methods", "off,magic", "--out", str(tmp_path)
    )
    assert r.returncode == 2 and "unknown methods" in r.stderr and "Traceback" not in r.stderr


def _traffic(path, lines):
    path.write_text("".join(x if isinstance(x, str) else json.dumps(x) + "\n" for x in lines))
    return path


def test_advise_skips_bad_lines_and_validates(roomy, tmp_path):
    traffic = _traffic(
        tmp_path / "traffic.jsonl",
        [
            {"prompt": "a b c a b c a b c a b c", "max_tokens": 12},
            "{broken json\n",
            {"messages": [{"role": "user", "content": "x y z x y z x y z"}], "temperature": 0},
            {"prompt": 7},
            "\n",
            [{"role": "user", "content": "one two one two one two"}],
            {"prompt": "fine", "temperature": "hot"},
            {"prompt": "z" * 5000},  # longer than the context
        ],
    )
    out = tmp_path / "advise.json"
    r = run(
        "advise", "--model", str(roomy), "--traffic", str(traffic), "--concurrency", "2",
        "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}',
        "--max-tokens", "8", "--calibration-seconds", "1", "--validate", "1,2",
        "--json", str(out),
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    for n, why in ((2, "not valid JSON"), (4, "prompt"), (7, "temperature"), (8, "context")):
        assert f"traffic.jsonl line {n}: " in r.stdout and why in r.stdout, (n, r.stdout)
    advice = json.loads(out.read_text())
    assert advice["requests"] == 3 and len(advice["bad_lines"]) == 4
    assert advice["recommendation"]["method"] in ("off", "ngram")
    assert "Recommendation:" in r.stdout
    (option,) = advice["options"]
    assert option["method"] == "ngram" and 1 <= option["depth"] <= 3
    rows = advice["validation"]["rows"]
    assert {(row["method"], row["concurrency"]) for row in rows} >= {("off", 1), ("off", 2)}
    predicted = [row for row in rows if row["policy"] != "adaptive"]
    assert all(row["measured_tok_s"] > 0 and row["predicted_tok_s"] > 0 for row in predicted)
    # the drafter under the default adaptive policy, measured beside plain at each level
    adaptive = [row for row in rows if row["policy"] == "adaptive"]
    assert [(row["method"], row["concurrency"]) for row in adaptive] == [("ngram", 1), ("ngram", 2)]
    assert all(row["vs_off"] > 0 and "predicted_tok_s" not in row for row in adaptive)
    assert "ngram under the adaptive policy (the default) at concurrency 2" in r.stdout


def test_advise_with_no_usable_line_fails_clearly(roomy, tmp_path):
    traffic = _traffic(tmp_path / "t.jsonl", ["nope\n", {"prompt": ""}])
    r = run("advise", "--model", str(roomy), "--traffic", str(traffic))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "no usable request" in r.stderr and "t.jsonl line 1" in r.stderr
    r = run("advise", "--model", str(roomy), "--traffic", str(tmp_path / "missing.jsonl"))
    assert r.returncode == 2 and "not found" in r.stderr
    # flags that cannot work fail before anything is loaded or measured
    good = _traffic(tmp_path / "g.jsonl", [{"prompt": "hi"}])
    for flags, why in (
        (["--concurrency", "0"], "--concurrency: must be at least 1"),
        (["--num-requests", "-1"], "--num-requests: must be at least 0"),
        (["--json", str(tmp_path / "no" / "such" / "a.json")], "its folder does not exist"),
    ):
        r = run("advise", "--model", str(roomy), "--traffic", str(good), *flags)
        assert r.returncode == 2 and why in r.stderr and "Traceback" not in r.stderr, r.stderr
