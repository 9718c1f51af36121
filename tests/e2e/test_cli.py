"""The command line: streaming output, and one-line errors with a non-zero exit."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def run(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "specdecode.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_generate_streams_text(tiny_llama_dir):
    r = run("generate", "--model", str(tiny_llama_dir), "--prompt", "Hello", "--max-tokens", "12")
    assert r.returncode == 0, r.stderr
    assert len(r.stdout.strip()) > 0


def test_generate_takes_the_penalties(tiny_llama_dir):
    base = ["generate", "--model", str(tiny_llama_dir), "--prompt", "Hello", "--max-tokens", "24",
            "--ignore-eos"]  # fmt: skip
    plain = run(*base)
    pen = run(*base, "--repetition-penalty", "1.5", "--presence-penalty", "1", "--min-tokens", "4")
    assert plain.returncode == 0 and pen.returncode == 0, pen.stderr
    assert pen.stdout != plain.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model", "/definitely/not/here"], "model not found"),
        (["--temperature", "-1"], "--temperature: must be at least 0"),  # (at parse time)
        (["--top-p", "2"], "top_p"),
        (["--max-tokens", "0"], "max_tokens"),
        (["--repetition-penalty", "0"], "repetition_penalty"),
        (["--chat-template", "no-such-template.jinja"], "not found"),
        (["--min-tokens", "20", "--max-tokens", "5"], "min_tokens"),
        (["--prompt-repeat"], "unrecognized arguments: --prompt-repeat"),  # (argparse's)
    ],
)
def test_user_errors_are_one_line(tiny_llama_dir, args, message):
    base = ["generate", "--prompt", "hi"]
    if "--model" not in args:
        base += ["--model", str(tiny_llama_dir)]
    r = run(*base, *args)
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    if message:
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and message in lines[0]


def test_prompt_longer_than_context(tiny_llama_dir):
    r = run("generate", "--model", str(tiny_llama_dir), "--prompt", "x" * 300)
    assert r.returncode == 2 and "context" in r.stderr and "Traceback" not in r.stderr


def test_unsupported_architecture(tiny_llama_dir, tmp_path):
    import shutil

    d = tmp_path / "m"
    shutil.copytree(tiny_llama_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "architectures": ["FalconForCausalLM"]}))
    r = run("generate", "--model", str(d), "--prompt", "hi")
    assert r.returncode == 2 and "unsupported architecture" in r.stderr


def test_speculative_flags(tiny_llama_dir):
    base = [
        "generate",
        "--model",
        str(tiny_llama_dir),
        "--prompt",
        "abcabcabcabc",
        "--max-tokens",
        "20",
        "--ignore-eos",
    ]
    plain = run(*base)
    legacy = run(
        *base,
        "--speculative-model",
        "[ngram]",
        "--num-speculative-tokens",
        "3",
        "--ngram-prompt-lookup-min",
        "1",
    )
    modern = run(
        *base,
        "--speculative-config",
        '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}',
    )
    assert plain.returncode == legacy.returncode == modern.returncode == 0, legacy.stderr
    assert plain.stdout == legacy.stdout == modern.stdout


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--speculative-config", "{not json"], "not valid JSON"),
        (["--speculative-config", '{"method": "eagle9"}'], "unknown speculative method"),
        (["--num-speculative-tokens", "3"], "without a method"),
    ],
)
def test_bad_speculative_flags(tiny_llama_dir, flags, message):
    r = run("generate", "--model", str(tiny_llama_dir), "--prompt", "hi", *flags)
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr


def test_sglang_flags_map_to_the_speculative_config():
    from specdecode.cli import build_parser, speculative_config

    args = build_parser().parse_args(
        [
            "generate",
            "--prompt",
            "x",
            "--speculative-algorithm",
            "eagle",
            "--speculative-draft-model-path",
            "heads/e",
            "--speculative-num-steps",
            "5",
            "--speculative-eagle-topk",
            "4",
            "--speculative-num-draft-tokens",
            "8",
            "--speculative-token-map",
            "freq_32768.pt",
        ]
    )
    assert speculative_config(args) == {
        "method": "eagle",
        "model": "heads/e",
        "num_speculative_tokens": 5,
        "topk": 4,
        "num_draft_tokens": 8,
        "token_map": "freq_32768.pt",
    }


def test_sglang_and_vllm_server_flags_are_their_aliases():
    """A command copied from SGLang's launch_server or `vllm serve` parses to what it means."""
    from specdecode.cli import build_parser, main

    args = build_parser().parse_args(
        [
            "serve",
            "--model-path",
            "m",
            "--context-length",
            "512",
            "--max-running-requests",
            "8",
            "--disable-radix-cache",
            "--tp-size",
            "1",
        ]  # fmt: skip
    )
    assert (args.model, args.max_model_len, args.max_num_seqs) == ("m", 512, 8)
    assert args.enable_prefix_caching is False
    args = build_parser().parse_args(["serve", "m", "--tensor-parallel-size", "1"])
    assert args.enable_prefix_caching is True and args.tensor_parallel_size == 1
    with pytest.raises(SystemExit) as e:  # one device: refused
        main(["generate", "--prompt", "x", "-tp", "2"])
    assert e.value.code == 2
    # SGLang's relaxed acceptance: its exact setting (1.0) parses, a lossy one is refused
    ok = ["--speculative-accept-threshold-single", "1", "--speculative-accept-threshold-acc", "1.0"]
    assert build_parser().parse_args(["serve", *ok]).speculative_accept_threshold_single == 1.0
    with pytest.raises(SystemExit):
        main(["generate", "--prompt", "x", "--speculative-accept-threshold-acc", "0.3"])


def test_a_copied_vllm_or_sglang_serve_command_parses_or_says_why_not(capsys):
    """The flags of a typical `vllm serve` / `sglang.launch_server` command: those with a
    meaning here take it, settings this engine always has pass, and the others fail with the
    reason, not "unrecognized arguments"."""
    from specdecode.cli import build_parser, main

    args = build_parser().parse_args(
        ("serve m --gpu-memory-utilization 0.9 --seed 7 --trust-remote-code --enforce-eager "
         "--disable-log-requests --disable-log-stats --enable-chunked-prefill --swap-space 4 "
         "--kv-cache-dtype auto --load-format safetensors --revision main --generation-config "
         "vllm --uvicorn-log-level info --disable-uvicorn-access-log --root-path /llm "
         '--allowed-origins ["https://a.example"] --enable-log-requests --max-log-len 40 '
         "--chat-template-content-format string --quantization None --block-size 16 "
         "--enable-prompt-tokens-details --disable-custom-all-reduce --max-seq-len-to-capture "
         "8192 -pp 1 --data-parallel-size 1 --distributed-executor-backend mp --tokenizer-mode "
         "auto --task generate --guided-decoding-backend xgrammar --max-logprobs 20 "
         "--logprobs-mode raw_logprobs --async-scheduling --compilation-config {} "
         "--disable-fastapi-docs --cuda-graph-sizes 1 2 4 -O3 --reasoning-parser "
         'deepseek_r1 --structured-outputs-config {"enable_in_reasoning":true}').split()
    )  # fmt: skip
    assert (args.gpu_memory_utilization, args.seed, args.root_path) == (0.9, 7, "/llm")
    assert args.reasoning_parser == "deepseek_r1"
    assert args.structured_outputs_config == {"enable_in_reasoning": True}
    from specdecode.errors import SpecDecodeError
    from specdecode.serving.server import scheduling

    parse = build_parser().parse_args
    assert scheduling(args) == ("fcfs", 1)
    assert scheduling(parse("serve m --scheduling-policy priority".split())) == ("priority", 1)
    # SGLang's: higher values first, unless asked for vLLM's order
    assert scheduling(parse("serve m --enable-priority-scheduling".split())) == ("priority", -1)
    assert scheduling(
        parse("serve m --enable-priority-scheduling --schedule-low-priority-values-first".split())
    ) == ("priority", 1)
    from specdecode.serving.server import ServerConfig, priority_rank

    sglang = ServerConfig("m", priority_sign=-1, priority_absent_last=True)
    assert [priority_rank(p, sglang) for p in (5, -2, None)] == [-5, 2, 2**63]
    assert [priority_rank(p, ServerConfig("m")) for p in (5, None)] == [5, 0]
    for both in ("--scheduling-policy priority --enable-priority-scheduling",
                 "--schedule-low-priority-values-first"):  # fmt: skip
        with pytest.raises(SpecDecodeError):
            scheduling(parse(["serve", "m", *both.split()]))
    assert args.allowed_origins == ["https://a.example"] and args.max_log_len == 40
    sglang = build_parser().parse_args(
        ("serve --model-path m --mem-fraction-static 0.8 --random-seed 3 --log-level info "
         "--reasoning-parser deepseek-r1").split()
    )  # fmt: skip
    assert (sglang.gpu_memory_utilization, sglang.seed, sglang.log_level) == (0.8, 3, "info")
    assert sglang.reasoning_parser == "deepseek_r1"
    for given, want in (("int8", "int8"), ("w8a8_int8", "int8"), ("int4", "int4"), ("None", None)):
        assert build_parser().parse_args(["serve", "-q", given]).quantization == want
    for flags, why in [
        ("--kv-cache-dtype fp8", "no fp8 cache"),
        ("--quantization awq", "weights load as stored"),
        ("--revision v2", "not from the Hugging Face Hub"),
        ("--load-format pt", "pickle only with --allow-pickle"),
        ("--generation-config auto", "generation_config.json is not read"),
        ("--chat-template-content-format openai", "as text"),
        ("--gpu-memory-utilization 1.5", "fraction in (0, 1]"),
        ("--allowed-origins *", "JSON list"),
        ("--reasoning-parser granite", "deepseek_r1, deepseek-r1, qwen3"),
        ("--tokenizer other", "the model's own"),
        ("--enable-lora", "LoRA adapters are not supported"),
        ("--lora-modules a=b", "LoRA adapters are not supported"),
        ("--hf-overrides {}", "used as it is"),
        ("-pp 2", "no tensor, pipeline or data parallelism"),
        ("--max-logprobs 21", "at most 20"),
        ("--logprobs-mode processed_logprobs", "raw distribution"),
        ("--num-scheduler-steps 8", "one scheduling per step"),
        ('--structured-outputs-config {"backend":"outlines"}', "run on xgrammar"),
        ('--structured-outputs-config {"disable_any_whitespace":true}', "not settable here"),
    ]:
        with pytest.raises(SystemExit) as e:
            main(["serve", "m", *flags.split()])
        assert e.value.code == 2 and why in capsys.readouterr().err, flags


def test_kv_budget_from_a_gpu_memory_fraction():
    from specdecode.config import EngineConfig, kv_budget_gb
    from specdecode.errors import InvalidRequestError

    gb = 2**30
    # 0.9 of 80 GB = 72, less 16 GB of weights = 56, less a 10% reserve
    assert kv_budget_gb(80 * gb, 16 * gb, 0.9) == pytest.approx(56 * 0.9)
    assert kv_budget_gb(8 * gb, 7 * gb, 1.0) == pytest.approx(0.75)  # (a 256 MiB reserve)
    with pytest.raises(InvalidRequestError, match="take 16.00 GB, leaving no room"):
        kv_budget_gb(16 * gb, 16 * gb, 0.9)
    with pytest.raises(InvalidRequestError, match="gpu_memory_utilization"):
        EngineConfig(gpu_memory_utilization=0)


def test_vllm_flags_without_a_method_take_the_models(tmp_path):
    """vLLM's `--speculative-config '{"model": ...}'` and legacy `--speculative-model` infer the
    method from the model (here its checkpoint); SGLang's draft path alone names none."""
    from pathlib import Path

    import specdecode
    from specdecode.cli import build_parser, speculative_config
    from specdecode.errors import InvalidRequestError

    head = str(Path(specdecode.__file__).parent / "assets" / "smollm2-135m-eagle3")

    def cfg(*flags):
        return speculative_config(build_parser().parse_args(["generate", "--prompt", "x", *flags]))

    assert cfg("--speculative-config", json.dumps({"model": head}))["method"] == "eagle3"
    assert cfg("--speculative-model", head)["method"] == "eagle3"
    assert cfg("--speculative-model", str(tmp_path))["method"] == "draft_model"
    assert cfg("--speculative-model", "[ngram]") == {"method": "ngram"}
    with pytest.raises(InvalidRequestError, match="without a method"):
        cfg("--speculative-draft-model-path", head)


@pytest.mark.parametrize("algorithm", ["NGRAM", "STANDALONE"])
def test_sglang_draft_budget_without_a_tree_is_a_chain(algorithm):
    """SGLang's NGRAM (and a STANDALONE chain) take --speculative-num-draft-tokens N: N verified
    nodes, the root included, so N - 1 drafted tokens (it was refused as an EAGLE-2 tree)."""
    from specdecode.cli import build_parser, speculative_config
    from specdecode.config import SpeculativeConfig
    from specdecode.errors import InvalidRequestError

    flags = ["--speculative-algorithm", algorithm, "--speculative-num-draft-tokens", "8"]
    if algorithm == "STANDALONE":
        flags += ["--speculative-draft-model-path", "d"]
    cfg = speculative_config(build_parser().parse_args(["generate", "--prompt", "x", *flags]))
    assert cfg["num_speculative_tokens"] == 7 and cfg["num_draft_tokens"] == 8
    if algorithm == "NGRAM":
        assert SpeculativeConfig.from_dict(cfg).num_speculative_tokens == 7
    # steps given too: they must agree with the budget (a chain of 5 has 6 nodes)
    steps = ["--speculative-num-steps", "5"]
    args = build_parser().parse_args(["generate", "--prompt", "x", *flags, *steps])
    assert speculative_config(args)["num_speculative_tokens"] == 5
    if algorithm == "NGRAM":
        with pytest.raises(InvalidRequestError, match="chain's"):
            SpeculativeConfig.from_dict(speculative_config(args))
        # Medusa's tree is its own (static): a node budget there is refused, not read as depth
        medusa = ["--speculative-algorithm", "MEDUSA", "--speculative-num-draft-tokens", "8"]
        cfg = speculative_config(build_parser().parse_args(["generate", "--prompt", "x", *medusa]))
        assert "num_speculative_tokens" not in cfg
        with pytest.raises(InvalidRequestError, match="EAGLE-2 trees"):
            SpeculativeConfig.from_dict(cfg)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--num-speculative-tokens", "3", "--speculative-num-steps", "5"], "num_speculative"),
        (
            ["--speculative-algorithm", "EAGLE3", "--speculative-config", '{"method": "eagle"}'],
            "method",
        ),  # fmt: skip
        (
            [
                "--speculative-config",
                '{"method": "ngram", "num_speculative_tokens": 5}',
                "--num-speculative-tokens",
                "3",
            ],
            "num_speculative_tokens",
        ),  # fmt: skip
    ],
)
def test_flags_that_disagree_are_refused(flags, message):
    from specdecode.cli import build_parser, speculative_config
    from specdecode.config import SpeculativeConfig
    from specdecode.errors import InvalidRequestError

    args = build_parser().parse_args(["generate", "--prompt", "x", *flags])
    with pytest.raises(InvalidRequestError, match=message):
        speculative_config(args)
    same = ["--num-speculative-tokens", "4", "--speculative-num-steps", "4", "--speculative-model",
            "[ngram]"]  # fmt: skip
    assert speculative_config(build_parser().parse_args(["generate", "--prompt", "x", *same]))
    with pytest.raises(InvalidRequestError, match="EAGLE-2 trees"):
        SpeculativeConfig(method="ngram", topk=4)
    SpeculativeConfig(method="ngram", num_speculative_tokens=4, topk=1, num_draft_tokens=5)
    # --speculative-model names the head's path; another flag may name its method
    both = ["--speculative-model", "heads/e3", "--speculative-config", '{"method": "eagle3"}']
    args = build_parser().parse_args(["generate", "--prompt", "x", *both])
    assert speculative_config(args) == {"method": "eagle3", "model": "heads/e3"}


def test_bench_compares_methods_in_one_run(tiny_llama_dir, tmp_path):
    model = _roomy_tiny(tiny_llama_dir, tmp_path)
    out = tmp_path / "bench.json"
    r = run(
        "bench", "latency", "--model", str(model),
        "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}',
        "--compare", '[{"method": "ngram", "num_speculative_tokens": 1}]',
        "--workloads", "code", "--temperatures", "0", "--num-prompts", "1",
        "--max-tokens", "6", "--skip-transformers", "--json", str(out),
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [row["method"] for row in rows] == ["ngram k=3", "ngram k=1"]
    assert rows[0]["plain_tok_s"] == rows[1]["plain_tok_s"]  # one baseline for both
    assert all(row["spec_tok_s"] > 0 for row in rows)
    # the drafter as configured: the static policy drafts every step with room for a draft
    # (with 6 tokens, a step that starts at the fifth has none: it is not counted as drafting)
    assert all(row["policy"] == "static" and row["drafting_fraction"] >= 0.5 for row in rows)


def _roomy_tiny(tiny_llama_dir, tmp_path):
    """The tiny model with room for a real prompt (character tokens)."""
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, model)
    cfg = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**cfg, "max_position_embeddings": 4096}))
    return model


def test_bench_serve_sweeps_policies(tiny_llama_dir, tmp_path):
    model = _roomy_tiny(tiny_llama_dir, tmp_path)
    out = tmp_path / "serve"
    r = run(
        "bench", "serve", "--model", str(model), "--concurrency", "1,3",
        "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}',
        "--workload", "json", "--num-prompts", "3", "--min-requests", "3", "--max-tokens", "8",
        "--max-prompt-tokens", "200", "--out", str(out),
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    result = json.loads((out / "serve.json").read_text())
    got = [(row["concurrency"], row["policy"]) for row in result["rows"]]
    # plain decoding runs again after the others at each level (drift, noise)
    assert got == [(c, p) for c in (1, 3) for p in ("off", "static", "adaptive", "off")]
    for c in (1, 3):  # greedy: the same requests give the same tokens under every policy
        totals = {row["output_tokens"] for row in result["rows"] if row["concurrency"] == c}
        assert len(totals) == 1 and totals.pop() > 0
        offs = [r["throughput_tok_s"] for r in result["rows"] if r["concurrency"] == c][::3]
        adaptive = result["rows"][4 * (c == 3) + 2]["throughput_tok_s"]
        assert result["summary"]["adaptive"][str(c)] == pytest.approx(2 * adaptive / sum(offs))
    assert set(result["summary"]["off_spread"]) == {"1", "3"}
    for row in result["rows"]:  # n-gram has no lite mode (it is lookup alone already)
        if row["policy"] != "off":
            assert 0 <= row["drafting_share"] <= 1 and row["lite_share"] == 0
            assert row["drafting_share"] > 0 or row["policy"] == "adaptive"  # it may decline
            assert f"drafting {row['drafting_share']:.0%} of decisions" in r.stdout
    md = (out / "serve.md").read_text()
    assert "adaptive vs off" in md and "off runs apart" in md
    assert (out / "serve.png").read_bytes()[:4] == b"\x89PNG"
    assert result["complete"] and all(row["itl_ms"] > 0 for row in result["rows"])


def test_bench_serve_keeps_the_levels_measured_before_a_failure(
    tiny_llama_dir, tmp_path, monkeypatch, capsys
):
    """A request failing at the second level ends the run with a clear error; the first
    level's rows are in serve.json (written after every row), marked incomplete."""
    from specdecode.bench import serve
    from specdecode.cli import main

    real, calls = serve._level, []

    async def level(engine, request, concurrency, n):
        calls.append(concurrency)
        if concurrency == 3:
            raise serve.BenchError("a request failed at concurrency 3: boom")
        return await real(engine, request, concurrency, n)

    monkeypatch.setattr(serve, "_level", level)
    out = tmp_path / "serve"
    rc = main(["bench", "serve", "--model", str(_roomy_tiny(tiny_llama_dir, tmp_path)),
               "--concurrency", "1,3", "--policies", "off,static", "--num-prompts", "2",
               "--min-requests", "2", "--max-tokens", "4", "--out", str(out)])  # fmt: skip
    got = capsys.readouterr()
    assert rc == 2 and "boom" in got.err and "the 3 rows measured before are in" in got.err
    assert "Traceback" not in got.err and "calibrating" not in got.out  # (no adaptive policy)
    assert "c=1    static" in got.out  # (the rows printed as they came)
    result = json.loads((out / "serve.json").read_text())
    assert not result["complete"] and [r["concurrency"] for r in result["rows"]] == [1, 1, 1]


def _serve(*flags: str) -> tuple[subprocess.Popen, int]:
    """`specdecode serve FLAGS` in a subprocess on a free port, once /health answers."""
    import socket
    import time
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "specdecode.cli", "serve", "--port", str(port), *flags],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    deadline = time.time() + 120
    while True:
        if proc.poll() is not None:
            raise AssertionError(proc.stderr.read())
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return proc, port
        except OSError:
            pass
        if time.time() > deadline:
            proc.kill()
            raise AssertionError("the server did not come up")
        time.sleep(0.5)


@pytest.mark.slow
def test_serve_the_default_model(tmp_path):
    """`specdecode serve` in a subprocess with the real model, asked through the openai client
    (with flags of a copied vLLM command, and a tool call)."""
    import openai

    proc, port = _serve(
        "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4}',
        "--seed", "1", "--gpu-memory-utilization", "0.9", "--trust-remote-code",
        "--disable-log-requests", "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
    )  # fmt: skip
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
        model = client.models.list().data[0].id
        r = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "What is 2 + 2?"}],
            max_tokens=20, temperature=0,
        )  # fmt: skip
        assert r.choices[0].message.content.strip()
        assert r.usage.completion_tokens > 0
        tool = {"type": "function", "function": {"name": "add", "parameters": {
            "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"]}}}  # fmt: skip
        r = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "What is 2 + 2?"}],
            max_tokens=40, temperature=0, tools=[tool], tool_choice="required",
        )  # fmt: skip
        (call,) = r.choices[0].message.tool_calls
        assert call.function.name == "add" and set(json.loads(call.function.arguments)) == {
            "a",
            "b",
        }
    finally:
        proc.terminate()
        proc.wait(30)


def test_sigterm_lets_the_requests_in_flight_finish(tiny_llama_dir):
    """SIGTERM (docker stop, Kubernetes) killed the server mid-response (uvicorn's handlers
    work on the main thread only, which the engine holds): now a stream in flight runs to its
    end, and the process exits 0."""
    import http.client
    import signal

    proc, port = _serve("--model", str(tiny_llama_dir))
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        body = {"prompt": "abc", "max_tokens": 48, "ignore_eos": True, "stream": True}
        conn.request("POST", "/v1/completions", json.dumps(body),
                     {"Content-Type": "application/json"})  # fmt: skip
        resp = conn.getresponse()
        assert resp.status == 200
        first = resp.readline()
        assert first.startswith(b"data: "), first
        proc.send_signal(signal.SIGTERM)
        rest = resp.read().decode()
        events = [json.loads(x) for x in rest.split("data: ")[1:] if x.strip() != "[DONE]"]
        assert "data: [DONE]" in rest and not any("error" in e for e in events), rest
        assert events[-1]["choices"][0]["finish_reason"] == "length"
        assert proc.wait(30) == 0
        assert "SIGTERM: accepting no new requests" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)


@pytest.mark.parametrize("grace", [0.0, 30.0])
def test_sigterm_stops_the_engine_after_the_shutdown_timeout_or_a_second_signal(grace):
    """`--shutdown-timeout 0` (vLLM's default) stops the engine at once; a longer one waits,
    unless a second SIGTERM comes; the previous handler is put back."""
    import os
    import signal
    import time
    from types import SimpleNamespace

    from specdecode.serving.server import _drain_on_sigterm

    stopped = []
    server = SimpleNamespace(should_exit=False)
    engine = SimpleNamespace(shutdown=lambda: stopped.append(time.monotonic()))
    before = signal.getsignal(signal.SIGTERM)
    restore = _drain_on_sigterm(server, engine, grace)
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.monotonic() + 5
        while not server.should_exit and time.monotonic() < deadline:
            time.sleep(0.01)
        assert server.should_exit  # uvicorn takes no new connection
        time.sleep(0.5)
        if grace:
            assert not stopped  # the requests in flight go on
            os.kill(os.getpid(), signal.SIGTERM)
        while not stopped and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(stopped) == 1
    finally:
        restore()
    assert signal.getsignal(signal.SIGTERM) == before


def test_bench_structured_reports_each_mode(tiny_llama_dir, tmp_path):
    model = _roomy_tiny(tiny_llama_dir, tmp_path)
    out = tmp_path / "structured.json"
    r = run(
        "bench", "structured", "--model", str(model),
        "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}',
        "--num-prompts", "1", "--max-prompt-tokens", "4000", "--max-tokens", "24",
        "--json", str(out),
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [row["constrained"] for row in rows] == [True, False]
    assert all(row["plain"]["tokens"] > 0 and row["spec"]["tokens"] > 0 for row in rows)
    assert rows[0]["plain"]["forced_share"] > 0  # '[{"op":"' is forced
    # tool calls (tool_choice "required"), constrained and not, with and without speculation
    r = run(
        "bench", "structured", "--model", str(model), "--workload", "tools",
        "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}',
        "--num-prompts", "2", "--max-tokens", "200", "--json", str(out),
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    got = json.loads(out.read_text())
    assert "tool calls" in got["workload"] and got["schema"]["maxItems"] == 1
    constrained = got["rows"][0]
    assert constrained["constrained"] and constrained["prompts"] == 2
    assert constrained["plain"]["tokens"] == constrained["spec"]["tokens"] > 0  # (greedy)
    assert constrained["plain"]["valid_json"] == constrained["spec"]["valid_json"]


def test_bench_quantization_compares_settings_with_fp32(tiny_llama_dir, tmp_path):
    """`bench quantization`: each setting's decode rate and its agreement with fp32's greedy
    replies, measured (fp32 agrees with itself wholly; a quantized target, as far as it does)."""
    from specdecode import kernels

    if not kernels.available():
        pytest.skip("int8 runs on the CPU kernels")
    model = _roomy_tiny(tiny_llama_dir, tmp_path)
    out = tmp_path / "q.json"
    r = run(
        "bench", "quantization", "--model", str(model), "--settings", "int8", "--workloads",
        "chat", "--num-prompts", "2", "--max-tokens", "6", "--rounds", "1", "--json", str(out),
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    got = json.loads(out.read_text())
    fp32, int8 = got["settings"]["fp32"], got["settings"]["int8"]
    assert fp32["top1_agreement"] == 1.0 and fp32["first_departure"] == [6, 6]
    assert 0 <= int8["top1_agreement"] <= 1 and int8["tok_s"] > 0 and fp32["speedup_vs_fp32"] == 1
    assert got["reference_tokens"] == 12 and "top-1" in r.stdout
    bad = run("bench", "quantization", "--settings", "fp8")
    assert bad.returncode == 2 and "fp32, bf16, int8, int4" in bad.stderr


def test_bench_prefix_compares_caching_off_and_on(tiny_llama_dir, tmp_path):
    model = _roomy_tiny(tiny_llama_dir, tmp_path)
    out = tmp_path / "prefix.json"
    r = run(
        "bench", "prefix", "--model", str(model), "--num-conversations", "2", "--turns", "2",
        "--max-prompt-tokens", "3000", "--max-tokens", "4", "--json", str(out),
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    got = json.loads(out.read_text())
    assert got["requests"] == 4 and got["token_identical"] and "/" not in got["model"]
    assert [x["cached_tokens"] for x in got["runs"]["off"]] == [0] * 4
    on = got["runs"]["on"]
    assert on[0]["cached_tokens"] == 0 and on[1]["cached_tokens"] >= on[0]["prompt_tokens"] - 16
    assert 0 < got["cached_share"] < 1 and got["ttft_s"]["on"] > 0
    assert "time to first token" in r.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (["--workloads", "bogus"], "unknown workload 'bogus'"),
        (["--workloads", " , "], "names none"),
        (["--temperature", "101"], "--temperature"),
        (["--max-tokens", "0"], "max-tokens"),
    ],
)
def test_data_traffic_refuses_bad_input_in_one_line(tmp_path, args, message):
    r = run("data", "traffic", "--out", str(tmp_path / "t.jsonl"), "--num-prompts", "1", *args)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert message in r.stderr.strip().splitlines()[-1]
    r = run("data", "traffic", "--out", str(tmp_path / "no" / "t.jsonl"), "--num-prompts", "1")
    assert r.returncode == 2 and "folder does not exist" in r.stderr


def test_data_traffic_strips_workload_names(tmp_path):
    out = tmp_path / "t.jsonl"
    r = run("data", "traffic", "--out", str(out), "--num-prompts", "1", "--workloads", "code, sql")
    assert r.returncode == 0, r.stderr
    assert len(out.read_text().splitlines()) == 2


def test_training_data_that_does_not_fit_is_a_one_line_error(tiny_llama_dir, tmp_path):
    (tmp_path / "data").mkdir()
    for kind in ("draft", "eagle"):
        r = run("train", kind, "--model", str(tiny_llama_dir), "--data", str(tmp_path / "data"),
                "--out", str(tmp_path / kind))  # fmt: skip
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        assert "specdecode: error:" in r.stderr.strip().splitlines()[-1]
    # --resume: no folder, a folder without a run, or with --init too
    for extra, message in ((["--resume"], "nothing to resume"),
                           (["--resume"], "holds no run to resume"),
                           (["--resume", "--init", "x"], "--init starts a new one")):  # fmt: skip
        r = run("train", "eagle3", "--model", str(tiny_llama_dir), "--data",
                str(tmp_path / "data"), "--out", str(tmp_path / "r"), *extra)  # fmt: skip
        assert r.returncode == 2 and message in r.stderr.strip().splitlines()[-1], r.stderr
        (tmp_path / "r").mkdir(exist_ok=True)


@pytest.mark.parametrize(
    "args, message",
    [
        (["bench", "latency", "--compare", "{not json"], "not valid JSON"),
        (["bench", "latency", "--compare", '{"method": "ngram"}'], "a JSON list"),
        (["bench", "latency", "--temperatures", "0,x"], "expected a number, got 'x'"),
        (["bench", "latency", "--max-tokens", "1"], "at least 2"),
        (["bench", "latency", "--workloads", "code, nope"], "unknown workload 'nope'"),
        (["bench", "latency", "--json", "/no/such/dir/out.json"], "folder does not exist"),
        (["bench", "serve", "--concurrency", "1,0"], "levels must be >= 1"),
        (["bench", "suite", "--concurrency", "1,x"], "comma list of integers"),
        (["bench", "structured", "--num-prompts", "0"], "at least 1"),
        (["bench", "prefix", "--turns", "1"], "at least 2"),
        (
            [
                "generate",
                "--prompt",
                "hi",
                "--speculative-model",
                "d",
                "--speculative-algorithm",
                "NGRAM",
            ],
            "takes no model",
        ),  # fmt: skip
    ],
)
def test_bench_arguments_are_checked_before_anything_runs(args, message):
    """Bad benchmark arguments fail at once with one message (not a traceback, not after
    minutes of measurement)."""
    r = run(*args)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert message in r.stderr.strip().splitlines()[-1], r.stderr


@pytest.mark.parametrize("flag", ["--shard-size", "--num-conversations", "--max-tokens"])
def test_data_generate_refuses_counts_below_one(flag, capsys):
    from specdecode.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["data", "generate", "--out", "d", flag, "0"])
    assert "must be at least 1" in capsys.readouterr().err


def test_generate_times_only_the_step_costs_one_request_needs(tiny_llama_dir, monkeypatch, capsys):
    """`generate` serves one request: the adaptive policy's step-cost curve is timed up to that
    request's steps (a token and its drafts), not every batch size the engine could reach, which
    the first step would time (~3 s on SmolLM2 here, more than the answer took)."""
    from specdecode.cli import main
    from specdecode.engine.engine import LLMEngine

    calls, real = [], LLMEngine.calibrate

    def calibrate(self, *a, **k):
        calls.append(k.get("upto"))
        return real(self, *a, **k)

    monkeypatch.setattr(LLMEngine, "calibrate", calibrate)
    spec = '{"method": "ngram", "num_speculative_tokens": 3}'
    assert main(["generate", "--model", str(tiny_llama_dir), "--prompt", "abcabc",
                 "--max-tokens", "8", "--speculative-config", spec]) in (0, None)  # fmt: skip
    assert calls == [2 * (1 + 3)]
    capsys.readouterr()


def test_quantization_is_refused_where_it_would_be_ignored(tmp_path, capsys):
    """Training reads features through the full-precision weights, and the suite compares
    targets as loaded: --quantization there is an error naming it, not dropped."""
    from specdecode.cli import main

    for argv in (["train", "eagle", "--data", str(tmp_path), "--out", str(tmp_path / "o"),
                  "-q", "int8"],
                 ["bench", "suite", "-q", "int8", "--out", str(tmp_path / "s")]):  # fmt: skip
        assert main(argv) == 2
        assert "--quantization" in capsys.readouterr().err, argv
