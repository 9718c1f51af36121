"""The command line refuses what it would otherwise ignore, misread or overwrite: bad numbers
and output paths at parse time, and flags or folders that would lose the user's work before
anything loads (each case from a review that ran the commands as a user would)."""

from __future__ import annotations

import json

import pytest
import torch

from specdecode.cli import main

HEAD = ["--data", "d", "--out", "o"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["generate", "--prompt", "hi", "--device", "tpu"], "auto, cpu, cuda or cuda:N"),
        (["generate", "--prompt", "hi", "--device", "cpu:1"], "auto, cpu, cuda or cuda:N"),
        (["generate", "--prompt", "hi", "--kv-cache-memory-gb", "0"], "must be above 0"),
        (["generate", "--prompt", "hi", "--max-num-batched-tokens", "0"], "at least 1"),
        (["serve", "--port", "99999"], "at most 65535"),
        (["serve", "--max-num-seqs", "0"], "at least 1"),
        (["train", "eagle3", *HEAD, "--lr", "-1"], "must be above 0"),
        (["train", "eagle3", *HEAD, "--draft-vocab", "-5"], "at least 0"),
        (["train", "eagle3", *HEAD, "--ttt-ramp", "5"], "below 1"),
        (["train", "eagle3", *HEAD, "--max-minutes", "-1"], "must be above 0"),
        (["train", "eagle3", *HEAD, "--checkpoint-minutes", "-1"], "at least 0"),
        (["train", "eagle", *HEAD, "--noise", "-1"], "at least 0"),
        (["train", "eagle", *HEAD, "--ce-weight", "nan"], "finite"),
        (["train", "draft", *HEAD, "--batch-size", "0"], "at least 1"),
        (["train", "draft", *HEAD, "--steps", "-1"], "at least 1"),
        (["train", "draft", *HEAD, "--num-layers", "0"], "at least 1"),
        (["train", "draft", *HEAD, "--lr", "-1"], "must be above 0"),
        (["data", "generate", "--out", "d", "--max-prompt-tokens", "0"], "at least 1"),
        (["data", "generate", "--out", "d", "--temperature", "-1"], "at least 0"),
        (["advise", "--traffic", "t", "--min-gain", "-1"], "at least 0"),
        (["advise", "--traffic", "t", "--calibration-seconds", "-1"], "must be above 0"),
        (["advise", "--traffic", "t", "--temperature", "-3"], "at least 0"),
        (["advise", "--traffic", "t", "--concurrency", "0"], "at least 1"),
        # one temperature range for every command, the server's too
        (["generate", "--prompt", "hi", "--temperature", "-0.5"], "at least 0"),
        (["generate", "--prompt", "hi", "--temperature", "101"], "at most 100"),
        (["bench", "structured", "--temperature", "nan"], "finite"),
        (["bench", "serve", "--temperature", "150"], "at most 100"),
        (["bench", "latency", "--temperatures", "0,-1"], "at least 0"),
        (["bench", "latency", "--temperatures", ","], "a comma list of temperatures"),
        (["data", "traffic", "--out", "t", "--temperature", "x"], "expected a number"),
        (["bench", "serve", "--policies", ""], "names no policy"),
        # the suite's flags fail before its hour of measuring, not after it
        (["bench", "suite", "--concurrency-policies", "foo"], "unknown policy 'foo'"),
        (["bench", "suite", "--references", "foo"], "unknown reference 'foo'"),
        (["bench", "suite", "--qwen-dtype", "int8"], "invalid choice"),
        (["bench", "suite", "--report", "no/such/dir/B.md"], "its folder does not exist"),
        (["bench", "serve", "--policies", "off,bogus"], "unknown policy 'bogus'"),
    ],
)
def test_bad_numbers_and_names_are_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err.strip().splitlines()[-1]


def test_output_paths_are_checked_at_parse_time(tmp_path, capsys):
    a_file = tmp_path / "f.txt"
    a_file.write_text("x")
    for argv, message in (
        (["bench", "latency", "--json", str(tmp_path)], "is a folder"),
        (["data", "traffic", "--out", str(tmp_path)], "is a folder"),
        (["advise", "--traffic", "t", "--json", str(tmp_path)], "is a folder"),
        (["export", "h", "--format", "vllm", "--out", str(a_file)], "is a file, not a folder"),
        (["train", "eagle3", "--data", "d", "--out", str(a_file)], "is a file, not a folder"),
        (["data", "generate", "--out", str(a_file)], "is a file, not a folder"),
        (["bench", "serve", "--out", str(a_file)], "is a file, not a folder"),
    ):
        with pytest.raises(SystemExit):
            main(argv)
        assert message in capsys.readouterr().err, argv


def _fake_head(path):
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"architectures": ["x"]}))
    (path / "model.safetensors").write_bytes(b"weights")
    return path


def test_an_output_folder_that_cannot_be_made_is_refused_before_measuring(tmp_path, capsys):
    (tmp_path / "afile").write_text("x")
    for argv in (["bench", "serve", "--out", str(tmp_path / "afile" / "sub")],
                 ["bench", "suite", "--out", str(tmp_path / "afile" / "a" / "b")]):  # fmt: skip
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "afile' is a file, not a folder" in err[0]


def test_output_paths_are_tried_not_asked(tmp_path, capsys):
    """Where no file can be made (/proc, even for root, whom os.access always answers yes),
    every kind of output flag is refused at the start, in one line; a file named inside a
    file says so."""
    import os
    from pathlib import Path

    if not Path("/proc/self").is_dir() or os.name != "posix":
        pytest.skip("needs Linux's /proc")
    (tmp_path / "afile").write_text("x")
    cases = [
        (["bench", "suite", "--out", "/proc/sd-x"], "cannot be written here"),
        (["bench", "report", str(tmp_path), "--out", "/proc/sd-r.md"], "cannot be written here"),
        (["bench", "latency", "--json", "/proc/sd-x.json"], "cannot be written here"),
        (["bench", "report", str(tmp_path), "--out", str(tmp_path / "afile" / "r.md")],
         "is a file, not a folder"),
    ]  # fmt: skip
    for argv, message in cases:
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], argv


def test_a_suite_method_config_is_checked_before_anything_loads(tmp_path, capsys):
    out = tmp_path / "suite"
    bad = [
        ('ngram={"num_speculative_tokens": -3}', "--method-config ngram: num_speculative"),
        ("ngram=[1]", "must be a JSON object"),
        ('beam={"x": 1}', "known method"),
        ('off={"x": 1}', "takes no config"),
        ('suffix={"suffix_decoding_max_tree_depth": "24"}', "got '24'"),
    ]
    for item, message in bad:
        assert main(["bench", "suite", "--method-config", item, "--out", str(out)]) == 2
        assert message in capsys.readouterr().err
    assert not out.exists()  # (nothing made, nothing loaded)


def test_export_never_overwrites_its_head_or_mixes_with_other_files(tmp_path, capsys):
    head = _fake_head(tmp_path / "head")
    assert main(["export", str(head), "--format", "sglang", "--out", str(head)]) == 2
    assert "is the head itself" in capsys.readouterr().err
    assert (head / "model.safetensors").read_bytes() == b"weights"  # untouched
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("mine")
    assert main(["export", str(head), "--format", "vllm", "--out", str(busy)]) == 2
    assert "holds other files (keep.txt)" in capsys.readouterr().err
    other = _fake_head(tmp_path / "other")  # a head: the files an export writes, unmarked
    assert main(["export", str(head), "--format", "vllm", "--out", str(other)]) == 2
    assert "did not write" in capsys.readouterr().err
    assert (other / "model.safetensors").read_bytes() == b"weights"
    a_file = tmp_path / "file-head"
    a_file.write_text("x")
    assert main(["export", str(a_file), "--format", "vllm", "--out", str(tmp_path / "o")]) == 2
    assert "is not a directory" in capsys.readouterr().err


def test_training_never_replaces_a_model_unasked(tmp_path, capsys):
    out = _fake_head(tmp_path / "head")
    for kind in ("eagle3", "draft"):
        assert main(["train", kind, "--data", str(tmp_path), "--out", str(out)]) == 2
        assert "already holds a model" in capsys.readouterr().err
    assert (out / "model.safetensors").read_bytes() == b"weights"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["bench", "serve", "--speculative-policy", "static"], "--speculative-policy does not"),
        (["advise", "--traffic", "t", "--speculative-policy", "off"], "measures the policies"),
        (
            [
                "advise",
                "--traffic",
                "t",
                "--draft-model",
                "d",
                "--speculative-config",
                '{"method": "ngram"}',
            ],
            "--draft-model adds a candidate",
        ),  # fmt: skip
        (["bench", "latency", "--compare", '[{"method": "ngram"}]'], "give that first"),
        (["generate", "--prompt", "hi", "--speculative-policy", "static"], "it needs a spec"),
        # each mode of bench latency has flags of its own
        (["bench", "latency", "--num-prompts", "2"], "--num-prompts applies to its speculative"),
        (
            ["bench", "latency", "--workloads", "code", "--temperatures", "0"],
            "--workloads, --temperatures apply to its speculative mode only (give a spec",
        ),
        (
            ["bench", "latency", "--speculative-config", '{"method": "ngram"}', "--repeats", "5"],
            "--repeats applies to its plain mode only",
        ),
        (
            ["generate", "--prompt", "hi", "--speculative-draft-model-path", "h"],
            "(--speculative-draft-model-path) given without a method",
        ),
    ],
)
def test_flags_that_would_be_ignored_are_refused(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_a_cuda_device_where_there_is_none_is_a_one_line_error(capsys):
    assert main(["generate", "--prompt", "hi", "--device", "cuda"]) == 2
    assert "no CUDA device is available" in capsys.readouterr().err


def test_dtype_auto_is_vllms_default(monkeypatch):
    """`dtype="auto"` (vLLM's default) stands for bfloat16 on CUDA (float16 before Ampere,
    which has no fast bfloat16) and float32 on a CPU."""
    from specdecode.config import EngineConfig

    assert EngineConfig(dtype="auto", device="cpu").dtype == "float32"
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    asked = []

    def capability(index=None):
        asked.append(index)
        return (8, 0) if index in (None, 0) else (7, 5)  # an A100 beside a T4

    monkeypatch.setattr("torch.cuda.get_device_capability", capability)
    assert EngineConfig(dtype="auto", device="cuda:0").dtype == "bfloat16"
    assert EngineConfig(dtype="auto", device="cuda:1").dtype == "float16"
    assert EngineConfig(dtype="auto").dtype == "bfloat16" and asked == [0, 1, None]
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    assert EngineConfig(dtype="auto").dtype == "float32"


def test_train_checks_its_data_folders_before_the_model_loads(tmp_path, capsys, monkeypatch):
    """A missing or empty --data folder, or --out naming one, is a one-line error before the
    target loads (it said "holds 0 examples" after loading and computing nothing)."""
    import specdecode.models.loader as loader

    def no_load(*args, **kwargs):
        raise AssertionError("the model loaded")

    monkeypatch.setattr(loader, "load_model", no_load)
    (tmp_path / "empty").mkdir()
    for kind in ("draft", "eagle"):
        for data, out, message in (
            (tmp_path / "missing", tmp_path / "out", "does not exist"),
            (tmp_path / "empty", tmp_path / "out", "no shards"),
        ):
            assert main(["train", kind, "--data", str(data), "--out", str(out)]) == 2
            assert message in capsys.readouterr().err
