"""Command line: `specdecode generate | serve | advise | bench | data | train | export | models`.

User errors print one line and exit 2."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from specdecode.argtypes import integer, number, output_dir, output_file, temperature
from specdecode.data import SOURCES
from specdecode.errors import DataError, InvalidRequestError, SpecDecodeError

_at_least_one = integer(1)
_at_least_two = integer(2)
_DEVICES = ("auto", "cpu", "cuda")


def _lossless_threshold(text: str) -> float:
    """SGLang's acceptance thresholds: 1.0 is its exact rejection sampling; below it accepts
    drafts the target would not have sampled."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if v != 1.0:
        raise argparse.ArgumentTypeError(
            f"{text}: a threshold below 1 accepts drafts the target would not sample (lossy); "
            "only 1.0, exact rejection sampling, is offered"
        )
    return v


def _one_device(text: str) -> int:
    """A tensor-, pipeline- or data-parallel size: 1, the one device this engine runs on."""
    if text.strip() != "1":
        raise argparse.ArgumentTypeError(
            f"{text!r}: this engine runs on one device, in one process (no tensor, pipeline "
            "or data parallelism)"
        )
    return 1


def _device(text: str) -> str:
    """auto, cpu, cuda or cuda:N (whether CUDA is there is checked where it is used)."""
    base, _, index = text.partition(":")
    if base not in _DEVICES or (index and (base != "cuda" or not index.isdigit())):
        raise argparse.ArgumentTypeError(f"expected auto, cpu, cuda or cuda:N, got {text!r}")
    return text


def _only(*values: str, why: str):
    """An argparse type taking only `values` (the settings that mean what this engine does),
    refusing others with `why`."""

    def parse(text: str) -> str:
        if text.lower() not in values:
            raise argparse.ArgumentTypeError(f"{text!r}: {why} (only {', '.join(values)})")
        return text.lower()

    return parse


def _quantization(text: str) -> str | None:
    """--quantization: none, int8 (w8a8_int8, SGLang's name) or int4; checkpoint formats
    (AWQ, GPTQ, fp8, ...) are refused with the reason."""
    value = text.lower()
    if value == "none":
        return None
    if value in ("int8", "w8a8_int8"):
        return "int8"
    if value == "int4":
        return "int4"
    raise argparse.ArgumentTypeError(
        f"{text!r}: weights load as stored (a GGUF is dequantized) and are quantized here only "
        "as int8 or int4 (none, int8, w8a8_int8, int4)"
    )


def _refused(why: str):
    """An argparse type refusing every value of a flag this engine cannot honour."""

    def parse(text: str) -> str:
        raise argparse.ArgumentTypeError(f"{text!r}: not supported here: {why}")

    return parse


class _Refused(argparse.Action):
    """A switch this engine cannot honour: refused with the reason (its help)."""

    def __init__(self, option_strings, dest, help=None, **kwargs):
        super().__init__(option_strings, dest, nargs=0, default=None, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string}: not supported here: {self.help}")


def _fraction(text: str) -> float:
    v = number(above=0)(text)
    if v > 1:
        raise argparse.ArgumentTypeError(f"expected a fraction in (0, 1], got {text}")
    return v


def add_vllm_server_args(srv: argparse.ArgumentParser) -> None:
    """vLLM's and SGLang's server flags, so that their serve commands run here: those that mean
    something here do it, those whose setting this engine always has are accepted, and the
    others are refused with the reason (a copied command fails on what it would change)."""
    g = srv.add_argument_group("vLLM / SGLang server flags")
    g.add_argument(
        "--seed",
        "--random-seed",  # (SGLang's)
        type=integer(-(2**63), 2**64 - 1),
        default=None,
        help="seed the random draws of requests without a seed of their own, so a run "
        "replays (vLLM's --seed; a request's `seed` is exact whatever else runs)",
    )
    g.add_argument(
        "--gpu-memory-utilization",
        "--mem-fraction-static",  # (SGLang's)
        type=_fraction,
        default=None,
        help="on CUDA, without --kv-cache-memory-gb: the KV caches (the target's and a "
        "drafter's) take what this fraction of the GPU's memory leaves after the weights "
        "(vLLM's). No effect on a CPU, where --kv-cache-memory-gb sizes it",
    )
    g.add_argument(
        "--uvicorn-log-level",
        choices=["critical", "error", "warning", "info", "debug", "trace"],
        default=None,
        help="the HTTP server's log level (default: warning, with no access log)",
    )
    g.add_argument(
        "--log-level",  # (SGLang's)
        choices=["critical", "error", "warning", "info", "debug"],
        default=None,
        help="SGLang's: the HTTP server's and specdecode's log level",
    )
    g.add_argument(
        "--disable-uvicorn-access-log",
        action="store_true",
        help="no access log line per request (vLLM's), whatever the log level",
    )
    g.add_argument(
        "--enable-log-requests",
        action="store_true",
        help="log each request's id, prompt and sampling settings (vLLM's; off by default)",
    )
    g.add_argument(
        "--max-log-len",
        type=integer(0),
        default=None,
        help="with --enable-log-requests: log at most this many characters of a prompt",
    )
    g.add_argument("--root-path", default="", help="the path prefix behind a proxy (vLLM's)")
    g.add_argument(
        "--allowed-origins",
        type=_json_list,
        default=None,
        help='CORS: origins a browser page may call from, a JSON list (["*"] for any); by '
        "default none (vLLM allows any)",
    )
    g.add_argument("--allowed-methods", type=_json_list, default=["*"], help="CORS (vLLM's)")
    g.add_argument("--allowed-headers", type=_json_list, default=["*"], help="CORS (vLLM's)")
    g.add_argument("--allow-credentials", action="store_true", help="CORS (vLLM's)")
    g.add_argument(
        "--block-size",
        "--page-size",  # (SGLang's)
        type=_at_least_one,
        default=16,
        help="tokens a KV cache block holds (vLLM's; default 16)",
    )
    g.add_argument("--ssl-keyfile", default=None, help="serve HTTPS: the key file (vLLM's)")
    g.add_argument("--ssl-certfile", default=None, help="serve HTTPS: the certificate file")
    g.add_argument(
        "--ssl-ca-certs",
        default=None,
        help="HTTPS: the CA certificates file (clients are not asked for certificates)",
    )
    g.add_argument("--uds", default=None, help="listen on this Unix socket, not a port (vLLM's)")
    g.add_argument(
        "--enable-force-include-usage",
        action="store_true",
        help="every stream ends with its usage, asked for or not (vLLM's)",
    )
    g.add_argument(
        "--enable-request-id-headers",
        action="store_true",
        help="answer with an X-Request-Id header: the request's own, else a new id (vLLM's)",
    )
    g.add_argument(
        "--max-logprobs",
        type=integer(-1, 20),
        default=20,
        help="the most `logprobs` / `top_logprobs` / `prompt_logprobs` a request may ask for "
        "(vLLM's; default and most here: 20; -1, vLLM's \"no limit\": 20)",
    )
    g.add_argument(
        "--logprobs-mode",
        type=_only(
            "raw_logprobs",
            why="logprobs are the model's raw distribution's, before "
            "temperature, penalties and top-k / top-p",
        ),  # fmt: skip
        default="raw_logprobs",
        help="accepted: raw_logprobs (the model's raw distribution's)",
    )
    g.add_argument(
        "--enable-reasoning",
        action="store_true",
        help="older vLLM's switch for --reasoning-parser (which alone turns it on here)",
    )
    for names in (("--pipeline-parallel-size", "-pp"), ("--data-parallel-size", "-dp"),
                  ("--api-server-count",)):  # fmt: skip
        g.add_argument(*names, type=_one_device, default=1, help="1: one device, one process")
    g.add_argument(
        "--guided-decoding-backend",
        type=_xgrammar,
        default=None,
        metavar="VALUE",
        help="older vLLM's: accepted: auto or xgrammar (structured outputs run on xgrammar)",
    )
    g.add_argument(
        "--structured-outputs-config.backend",
        dest="structured_outputs_backend",
        type=_xgrammar,
        default=None,
        metavar="VALUE",
        help="vLLM's dotted form of --structured-outputs-config",
    )
    g.add_argument(
        "--structured-outputs-config.enable_in_reasoning",
        dest="structured_outputs_in_reasoning",
        type=_only("true", "false", why="a boolean"),
        default=None,
        metavar="true|false",
        help="vLLM's dotted form of --structured-outputs-config",
    )
    # settings this engine always has: accepted (as in a copied command), nothing to change
    for flag, what in (
        ("--disable-log-requests", "requests are not logged unless --enable-log-requests"),
        ("--disable-log-stats", "no periodic stats are logged (/metrics has them)"),
        ("--trust-remote-code", "no model code is run from a checkpoint: the Llama-family "
         "architecture is built in"),
        ("--enforce-eager", "the model runs eagerly (no CUDA graphs)"),
        ("--enable-chunked-prefill", "prefills are chunked by --max-num-batched-tokens"),
        ("--enable-prompt-tokens-details", "usage always gives the prompt's cached tokens"),
        ("--disable-custom-all-reduce", "one device: no all-reduce"),
        ("--disable-frontend-multiprocessing", "the server and the engine share a process"),
        ("--disable-fastapi-docs", "no OpenAPI docs are ever served"),
        ("--async-scheduling", "no effect: a step is scheduled after the last one ends"),
    ):  # fmt: skip
        g.add_argument(flag, action="store_true", help=f"accepted: {what}")
    for flag, what in (
        (("--max-seq-len-to-capture",), "no CUDA graphs are captured"),
        (("--compilation-config", "-O"), "nothing is compiled (the C++ layer loop is built "
         "ahead)"),
        (("--max-parallel-loading-workers",), "the weights load in one pass"),
        (("--distributed-executor-backend",), "one process runs the model"),
    ):  # fmt: skip
        g.add_argument(*flag, metavar="VALUE", default=None, help=f"accepted: {what}")
    g.add_argument("--cuda-graph-sizes", nargs="+", metavar="N", default=None,
                   help="accepted: no CUDA graphs are captured")  # fmt: skip
    for flag, values, why in (
        ("--tokenizer-mode", ("auto", "hf"), "the tokenizer is the model's own (Hugging Face)"),
        ("--task", ("auto", "generate"), "the engine generates text"),
        ("--runner", ("auto", "generate"), "the engine generates text"),
        ("--config-format", ("auto", "hf"), "the model's config.json (or its GGUF) is read"),
        ("--num-scheduler-steps", ("1",), "one scheduling per step"),
        ("--max-num-partial-prefills", ("1",), "prefills share a step's token budget"),
        ("--long-prefill-token-threshold", ("0",), "prefills share a step's token budget"),
        ("--tokenizer-pool-size", ("0",), "tokenization runs in the server's process"),
    ):  # fmt: skip
        g.add_argument(flag, type=_only(*values, why=why), default=None, metavar="VALUE",
                       help=f"accepted: {' or '.join(values)} ({why})")  # fmt: skip
    # changes this engine cannot make: refused with the reason, not ignored
    for flag, why in (
        ("--tokenizer", "the tokenizer is the model's own (its directory's tokenizer files)"),
        ("--hf-overrides", "the model's config is used as it is"),
        ("--override-generation-config", "the model's generation_config.json is not read"),
        ("--lora-modules", "LoRA adapters are not supported"),
        ("--max-lora-rank", "LoRA adapters are not supported"),
    ):  # fmt: skip
        g.add_argument(flag, type=_refused(why), default=None, metavar="VALUE", help=why)
    g.add_argument("--enable-lora", action=_Refused, help="LoRA adapters are not supported")
    g.add_argument("--enable-server-load-tracking", action=_Refused,
                   help="no /load endpoint is served")  # fmt: skip
    g.add_argument("--headless", action=_Refused, help="the server is the engine's front end")
    g.add_argument(
        "--swap-space",
        type=number(0),
        default=None,
        help="accepted: a preempted request is recomputed, not swapped out",
    )
    g.add_argument(
        "--kv-cache-dtype",
        type=_only("auto", why="the KV cache is kept in the model's dtype (no fp8 cache)"),
        default="auto",
    )
    g.add_argument(
        "--load-format",
        type=_only(
            "auto",
            "safetensors",
            "gguf",
            why="checkpoints are safetensors or GGUF (pickle only with --allow-pickle)",
        ),  # fmt: skip
        default="auto",
    )
    for flag in ("--revision", "--tokenizer-revision", "--code-revision"):
        g.add_argument(
            flag,
            type=_only(
                "main",
                why="models load from local files or `specdecode models pull`, "
                "not from the Hugging Face Hub",
            ),  # fmt: skip
            default=None,
        )
    g.add_argument(
        "--chat-template-content-format",
        type=_only(
            "auto",
            "string",
            why="message content reaches the template as text (OpenAI's text parts joined)",
        ),  # fmt: skip
        default="auto",
    )
    g.add_argument(
        "--generation-config",
        type=_only(
            "vllm",
            why="a request's defaults are the API's (temperature 1, ...); the "
            "model's generation_config.json is not read",
        ),  # fmt: skip
        default="vllm",
    )


_xgrammar = _only("auto", "xgrammar", why="structured outputs run on xgrammar here")


def _reasoning_parser(text: str) -> str:
    from specdecode.serving.reasoning import check_parser

    try:
        return check_parser(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


def _structured_outputs_config(text: str) -> dict:
    import json

    try:
        v = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}") from e
    if not isinstance(v, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    unknown = set(v) - {"enable_in_reasoning", "backend"}
    if unknown:
        raise argparse.ArgumentTypeError(
            f"{', '.join(sorted(unknown))}: not settable here (enable_in_reasoning, backend)"
        )
    if not isinstance(v.get("enable_in_reasoning", False), bool):
        raise argparse.ArgumentTypeError("enable_in_reasoning must be true or false")
    if "backend" in v:
        _xgrammar(str(v["backend"]))
    return v


def _json_list(text: str) -> list[str]:
    import json

    try:
        v = json.loads(text)
    except json.JSONDecodeError:
        v = None
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        raise argparse.ArgumentTypeError(f'expected a JSON list of strings (["*"]), got {text!r}')
    return v


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        "--model-path",  # (SGLang's)
        default=None,
        help="model directory, .gguf file, or omit for the embedded SmolLM2-135M-Instruct",
    )
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["float32", "bfloat16", "float16", "auto"],
        help="auto (vLLM's default): float32 on a CPU, bfloat16 on CUDA (float16 before "
        "Ampere); float32 is the exact one",
    )
    p.add_argument("--device", type=_device, default="auto", help="cpu, cuda[:N], or auto")
    p.add_argument(
        "--quantization",
        "-q",
        type=_quantization,
        default=None,
        help="int8 (SGLang's w8a8_int8: int8 weights per output row, activations to int8 per "
        "token with AVX512_VNNI, weight-only without) or int4 (int4 weights; AVX512_VNNI): "
        "the target's projections quantized at "
        "load for the CPU kernels, a quarter (an eighth) of fp32's bytes a step; a "
        "quantized target is another model (speculation is exact with respect to it). "
        'none: as loaded. Drafters take "draft_dtype" in --speculative-config',
    )
    p.add_argument("--max-model-len", "--context-length", type=_at_least_one, default=None)
    p.add_argument(
        "--tensor-parallel-size",
        "-tp",
        "--tp-size",
        type=_one_device,
        default=1,
        help="vLLM's / SGLang's: 1 (one device here)",
    )
    p.add_argument(
        "--kv-cache-memory-gb",
        type=number(above=0),
        default=None,
        help="the KV cache's budget (default 2; on CUDA, serve's --gpu-memory-utilization "
        "sizes it where this is not given)",
    )
    p.add_argument(
        "--kernels",
        default="auto",
        choices=["auto", "off"],
        help="auto: packed-weight C++ fast path on x86 CPUs with AVX-512 or AVX2 + FMA "
        "(built on first use)",
    )
    p.add_argument(
        "--allow-pickle",
        action="store_true",
        help="allow loading pickle checkpoints (*.bin); they can run code",
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=_at_least_one,
        default=2048,
        help="tokens one step feeds at most (prefill chunks, decodes and draft trees)",
    )
    p.add_argument(
        "--chat-template",
        default=None,
        help="a Jinja chat template file (or the template itself) instead of the model's",
    )


def add_prefix_caching_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reuse the KV cache of earlier requests' identical first tokens (default: on)",
    )
    p.add_argument(
        "--disable-radix-cache",
        dest="enable_prefix_caching",
        action="store_false",
        help="SGLang's --no-enable-prefix-caching",
    )


def _add_run_flags(p: argparse.ArgumentParser, what: str) -> None:
    """A training run's length, checkpoints and resume (`train draft` and the heads')."""
    p.add_argument(
        "--max-minutes",
        type=number(above=0),
        default=None,
        help=f"stop after this many minutes if --steps are not done; the {what} as it stands is "
        "saved (as on Ctrl-C)",
    )
    p.add_argument(
        "--checkpoint-minutes",
        type=number(0),
        default=5.0,
        help=f"write the {what} as it stands, and its trainer state, to --out this often (0: "
        "only at the end); a run killed later keeps it and --resume continues it",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue the run saved in --out where it stopped (a checkpoint, Ctrl-C, the time "
        "budget): its fp32 weights, optimizer state, step, schedule, data order and time; its "
        "settings are kept, but --steps and --max-minutes may raise them",
    )


def add_speculative_args(p: argparse.ArgumentParser) -> None:
    spec = p.add_argument_group("speculative decoding (vLLM flags)")
    spec.add_argument(
        "--speculative-config",
        default=None,
        help='JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 5}\'',
    )
    spec.add_argument(
        "--speculative-model", default=None, help="legacy vLLM flag: a draft model, or [ngram]"
    )
    spec.add_argument("--num-speculative-tokens", type=int, default=None)
    spec.add_argument("--ngram-prompt-lookup-max", type=int, default=None)
    spec.add_argument("--ngram-prompt-lookup-min", type=int, default=None)
    spec.add_argument(
        "--speculative-disable-by-batch-size",
        type=int,
        default=None,
        help="no drafts while more requests than this are running (any policy)",
    )
    spec.add_argument(
        "--speculative-policy",
        choices=["adaptive", "static", "off"],
        default=None,
        help="adaptive (default): the goodput controller picks each request's draft depth every "
        "step from measured step costs and acceptance; static: always draft "
        "num_speculative_tokens (vLLM); off: plain decoding",
    )
    sg = p.add_argument_group("speculative decoding (SGLang flags)")
    sg.add_argument(
        "--speculative-algorithm",
        type=str.upper,
        choices=["EAGLE", "EAGLE3", "MEDUSA", "NGRAM", "STANDALONE"],
        default=None,
        help="EAGLE (EAGLE-1 head, EAGLE-2 dynamic tree), EAGLE3, MEDUSA, NGRAM, STANDALONE "
        "(a draft model)",
    )
    sg.add_argument("--speculative-draft-model-path", default=None, help="head or draft model")
    sg.add_argument("--speculative-num-steps", type=int, default=None, help="draft depth")
    sg.add_argument(
        "--speculative-eagle-topk", type=int, default=None, help="children per node (1: chain)"
    )
    sg.add_argument(
        "--speculative-num-draft-tokens",
        type=int,
        default=None,
        help="tree nodes verified per step, the root included (NGRAM, or STANDALONE without "
        "--speculative-eagle-topk: a chain of N - 1 drafts)",
    )
    for flag in ("--speculative-accept-threshold-single", "--speculative-accept-threshold-acc"):
        sg.add_argument(
            flag,
            type=_lossless_threshold,
            default=None,
            help="SGLang's relaxed acceptance: 1.0 only (lossless rejection sampling; lower "
            "values change the output and are not offered)",
        )
    sg.add_argument(
        "--speculative-token-map",
        default=None,
        help="FR-Spec: a file of token ids (.json, .safetensors; .pt with --allow-pickle) the "
        "drafter's LM head keeps (EAGLE, MEDUSA, STANDALONE); `specdecode data token-map` "
        "writes one",
    )


def speculative_config(args: argparse.Namespace) -> dict | None:
    """Merge `--speculative-config` with vLLM's legacy flags and SGLang's; a key two flags set
    to different values is an error (which one the user meant is not ours to guess)."""
    cfg: dict = {}
    source: dict[str, str] = {}

    def put(key: str, value, flag: str) -> None:
        if value is None:
            return
        if key in cfg and cfg[key] != value:
            raise InvalidRequestError(
                f"{flag} sets {key} to {value!r} but {source[key]} set it to {cfg[key]!r}"
            )
        cfg[key], source[key] = value, flag

    if getattr(args, "speculative_model", None):
        model = args.speculative_model
        if model.strip("[]") == "ngram":
            put("method", "ngram", "--speculative-model")
        else:  # (its method: the checkpoint's, where no flag names one)
            put("model", model, "--speculative-model")
    algorithm = getattr(args, "speculative_algorithm", None)
    if algorithm:
        method = {
            "EAGLE": "eagle",
            "EAGLE3": "eagle3",
            "MEDUSA": "medusa",
            "NGRAM": "ngram",
            "STANDALONE": "draft_model",
        }[algorithm]
        put("method", method, "--speculative-algorithm")
    put("model", getattr(args, "speculative_draft_model_path", None),
        "--speculative-draft-model-path")  # fmt: skip
    for key, flag in (
        ("num_speculative_tokens", "speculative_num_steps"),
        ("topk", "speculative_eagle_topk"),
        ("num_draft_tokens", "speculative_num_draft_tokens"),
        ("num_speculative_tokens", "num_speculative_tokens"),
        ("prompt_lookup_max", "ngram_prompt_lookup_max"),
        ("prompt_lookup_min", "ngram_prompt_lookup_min"),
        ("disable_by_batch_size", "speculative_disable_by_batch_size"),
        ("token_map", "speculative_token_map"),
    ):
        put(key, getattr(args, flag, None), "--" + flag.replace("_", "-"))
    if getattr(args, "speculative_config", None):
        try:
            raw = json.loads(args.speculative_config)
        except json.JSONDecodeError as e:
            raise InvalidRequestError(f"--speculative-config is not valid JSON: {e}") from e
        if not isinstance(raw, dict):
            raise InvalidRequestError("--speculative-config must be a JSON object")
        for key, value in raw.items():
            put(key, value, "--speculative-config")
    vllm_model = source.get("model") in ("--speculative-model", "--speculative-config")
    if "method" not in cfg and cfg.get("model") and vllm_model:  # vLLM's: the model's method
        from specdecode.config import with_method

        cfg = with_method(cfg)
    chain_nodes = cfg.get("num_draft_tokens")
    if (
        cfg.get("method") in ("ngram", "draft_model")
        and "speculative_token_tree" not in cfg
        and isinstance(chain_nodes, int)
        and chain_nodes >= 2
        and "num_speculative_tokens" not in cfg
        and cfg.get("topk", 1) == 1
    ):
        # SGLang's NGRAM / STANDALONE budget: N verified nodes, the root included, are N - 1
        # drafted tokens; without the EAGLE-2 tree it is a chain that long
        cfg["num_speculative_tokens"] = chain_nodes - 1
    if cfg and "method" not in cfg:
        raise InvalidRequestError(
            f"speculative flags ({', '.join(sorted(source.values()))}) given without a method: "
            'add --speculative-algorithm or a "method" in --speculative-config'
        )
    return cfg or None


def engine_kwargs(args: argparse.Namespace, default_policy: str = "adaptive") -> dict:
    from specdecode.config import EngineConfig

    return dict(
        speculative_policy=getattr(args, "speculative_policy", None) or default_policy,
        dtype=args.dtype,
        device=args.device,
        max_model_len=args.max_model_len,
        # (None: not given; serve's --gpu-memory-utilization may size it on CUDA)
        kv_cache_memory_gb=args.kv_cache_memory_gb or EngineConfig.kv_cache_memory_gb,
        allow_pickle=args.allow_pickle,
        kernels=args.kernels,
        quantization=getattr(args, "quantization", None),
        max_num_batched_tokens=args.max_num_batched_tokens,
        chat_template=args.chat_template,
        # serve and generate: on unless told; measurements (bench, advise) and data generation
        # keep it off, so every configuration they compare pays its own prefill
        enable_prefix_caching=getattr(args, "enable_prefix_caching", False),
        speculative_config=speculative_config(args),
    )


class _Parser(argparse.ArgumentParser):
    """Usage errors on one line, as every other error of the command line (the full usage of
    a command with sixty flags buried the message); --help lists the flags."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (--help lists the flags)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="specdecode", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress to stderr")
    sub = parser.add_subparsers(dest="command", required=True)

    srv = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    srv.add_argument(
        "model_tag",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="the model, as in `vllm serve MODEL` (or --model)",
    )
    add_engine_args(srv)
    add_prefix_caching_arg(srv)
    add_speculative_args(srv)
    srv.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    srv.add_argument("--port", type=integer(0, 65535), default=8000)
    srv.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' (or SPECDECODE_API_KEY)",
    )
    srv.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="the model id clients send; several: the first is the one responses give, the "
        "others are accepted too (vLLM's)",
    )
    srv.add_argument(
        "--max-num-seqs",
        "--max-running-requests",  # (SGLang's)
        type=_at_least_one,
        default=64,
        help="requests in one batch",
    )
    srv.add_argument(
        "--scheduling-policy",
        choices=("fcfs", "priority"),
        default="fcfs",
        help="fcfs (default): requests run in arrival order; priority (vLLM's): by each "
        "request's `priority` field, lower first, then arrival: the order waiting requests "
        "are admitted in, and the running request preempted first when the KV cache is full "
        "(a running request is not preempted only to admit another). Without it a request "
        "giving a priority other than 0 is refused",
    )
    srv.add_argument(
        "--enable-priority-scheduling",
        action="store_true",
        help="SGLang's: the priority policy with SGLang's order, higher `priority` values "
        "first (unless --schedule-low-priority-values-first)",
    )
    srv.add_argument(
        "--schedule-low-priority-values-first",
        action="store_true",
        help="SGLang's: with --enable-priority-scheduling, lower values first (vLLM's order)",
    )
    srv.add_argument(
        "--max-n", type=_at_least_one, default=16, help="largest n a request may ask for"
    )
    srv.add_argument(
        "--max-request-bytes",
        type=_at_least_one,
        default=1 << 20,
        help="largest request body accepted",
    )
    srv.add_argument(
        "--shutdown-timeout",
        type=number(0),
        default=25.0,
        help="seconds SIGTERM lets the requests in flight finish, taking no new ones (vLLM's "
        "flag; 0: they end at once with an error, vLLM's default)",
    )
    srv.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="use a chat template a request sends (`chat_template`, vLLM's flag); refused "
        "by default: a template is code the server runs",
    )
    srv.add_argument(
        "--return-tokens-as-token-ids",
        action="store_true",
        help="name logprob tokens 'token_id:N' instead of their text (vLLM's flag: exact "
        "where a token's text is not, e.g. part of a character)",
    )
    srv.add_argument(
        "--max-stored-responses",
        type=integer(0),
        default=0,
        metavar="N",
        help="keep the last N Responses API responses in memory (those with `store`, true by "
        "default), so that previous_response_id continues one and GET /v1/responses/ID "
        "returns it; 0 (default, as vLLM's) keeps none",
    )
    srv.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='tool_choice "auto" (the default where a request gives tools): the model '
        "decides, its reply parsed for calls by --tool-call-parser (vLLM's flag). Without it "
        'such requests are refused; "required" and named functions are constrained, and '
        "need neither flag",
    )
    srv.add_argument(
        "--tool-call-parser",
        metavar="NAME",
        help="how tool calls are written in a reply: hermes (vLLM's name; qwen25, SGLang's: "
        "<tool_call>JSON</tool_call>, as Qwen2.5's and Hermes' templates write them); json "
        "(those, or a reply that is nothing but a bare or fenced JSON call of a given tool, "
        "as Qwen2.5-Coder and Llama 3 answer; llama3_json and llama3 name it too). Given "
        "alone, as in SGLang, it turns on "
        "--enable-auto-tool-choice",
    )
    srv.add_argument(
        "--exclude-tools-when-tool-choice-none",
        action="store_true",
        help='leave the tools out of the prompt where tool_choice is "none" (vLLM\'s flag; '
        "by default the template renders them anyway)",
    )
    srv.add_argument(
        "--reasoning-parser",
        type=_reasoning_parser,
        metavar="NAME",
        help="split a reasoning model's replies into `reasoning` (also given as "
        "`reasoning_content`, SGLang's name) and `content`: deepseek_r1 or qwen3 (vLLM's "
        "names; deepseek-r1, qwen3-thinking: SGLang's), for replies that think in "
        "<think> ... </think>. A structured output then constrains the content only",
    )
    srv.add_argument(
        "--structured-outputs-config",
        type=_structured_outputs_config,
        default={},
        metavar="JSON",
        help="vLLM's: {\"enable_in_reasoning\": true} constrains a reasoning model's "
        'reasoning too; "backend" may be auto or xgrammar (the one there is)',
    )
    srv.add_argument(
        "--response-role",
        default="assistant",
        metavar="ROLE",
        help="the role of a chat reply that follows a generation prompt (vLLM's flag; "
        "default: assistant). With add_generation_prompt false the reply continues the last "
        "message, in that message's role",
    )

    add_vllm_server_args(srv)

    gen = sub.add_parser("generate", help="generate text for one prompt, streamed to stdout")
    add_engine_args(gen)
    add_prefix_caching_arg(gen)
    add_speculative_args(gen)
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    gen.add_argument("--temperature", type=temperature, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=-1)
    gen.add_argument("--min-p", type=float, default=0.0)
    gen.add_argument("--repetition-penalty", type=float, default=1.0)
    gen.add_argument("--presence-penalty", type=float, default=0.0)
    gen.add_argument("--frequency-penalty", type=float, default=0.0)
    gen.add_argument("--max-tokens", type=int, default=256)  # (SamplingParams says why)
    gen.add_argument("--min-tokens", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true")

    models = sub.add_parser("models", help="list or pull the models specdecode can fetch")
    msub = models.add_subparsers(dest="models", required=True)
    msub.add_parser("list", help="pullable models and heads: whether pulled or built, and where")
    pull = msub.add_parser(
        "pull",
        help="download, verify and convert a model; a head's name also builds it here (data "
        "generation and training: an hour or more on 2 cores)",
    )
    pull.add_argument("name", help="a name `models list` shows (or the model's Hugging Face id)")

    data = sub.add_parser("data", help="training data")
    dsub = data.add_subparsers(dest="data", required=True)
    dgen = dsub.add_parser(
        "generate",
        help="the target answers ShareGPT train prompts "
        "(self-distillation); resumable; runs under torchrun",
    )
    add_engine_args(dgen)
    dgen.add_argument("--out", type=output_dir, required=True, help="directory for the shards")
    dgen.add_argument(
        "--source",
        choices=tuple(SOURCES),
        default="sharegpt",
        help="training prompts: ShareGPT's train split, or only its code requests (first turn "
        "with a code fence, a language keyword or a language / library by name)",
    )
    dgen.add_argument(
        "--exclude-data",
        action="append",
        default=[],
        metavar="DIR",
        help="skip conversations already answered in this shard directory (repeatable), so a "
        "second data set adds new prompts only",
    )
    dgen.add_argument("--num-conversations", type=_at_least_one, default=512)
    dgen.add_argument("--shard-size", type=_at_least_one, default=64)
    dgen.add_argument("--max-tokens", type=_at_least_one, default=256)
    dgen.add_argument("--temperature", type=temperature, default=0.0)
    dgen.add_argument(
        "--max-prompt-tokens",
        type=_at_least_one,
        default=512,
        help="skip conversations whose first turn is longer (prefill dominates otherwise)",
    )
    dgen.add_argument(
        "--max-num-seqs", type=_at_least_one, default=16, help="generation batch size"
    )
    dgen.add_argument(
        "--features",
        choices=("eagle3", "final", "none"),
        default="eagle3",
        help="target features stored with the tokens (bf16): 'eagle3' = the inputs of layers "
        "2, N//2, N-3 and the final feature (every head trains from these), 'final' = the "
        "final feature only (Medusa, EAGLE-1), 'none' = tokens only",
    )

    dmap = dsub.add_parser(
        "token-map",
        help="FR-Spec: the most frequent answer tokens of self-distillation data, as a token map "
        "for --speculative-token-map (a drafter's LM head keeps those rows)",
    )
    dmap.add_argument(
        "--data",
        dest="data_dirs",  # (args.data names the `data` subcommand)
        nargs="+",
        required=True,
        metavar="DIR",
        help="shard directories (data generate)",
    )
    dmap.add_argument(
        "--size", type=_at_least_two, default=32768, help="ids kept (FR-Spec's maps: 8k to 32k)"
    )
    dmap.add_argument(
        "--out", type=output_file, required=True, help="the map: a .safetensors or .json file"
    )
    dtraffic = dsub.add_parser(
        "traffic",
        help="a sample traffic file (JSONL chat requests) from the benchmark workloads, for "
        "`specdecode advise` when you have no traffic of your own yet",
    )
    dtraffic.add_argument("--workloads", default="code,chat", help="comma list")
    dtraffic.add_argument("--num-prompts", type=_at_least_one, default=8, help="per workload")
    dtraffic.add_argument("--temperature", type=temperature, default=0.0)
    dtraffic.add_argument("--max-tokens", type=_at_least_one, default=128)
    dtraffic.add_argument("--out", type=output_file, required=True)

    train = sub.add_parser("train", help="train drafters on a frozen target")
    tsub = train.add_subparsers(dest="train", required=True)
    tdraft = tsub.add_parser("draft", help="distil a small draft model from the target")
    add_engine_args(tdraft)
    tdraft.add_argument(
        "--data",
        required=True,
        action="append",
        help="shards from `specdecode data generate` (repeatable; the last --eval-examples of "
        "each are held out)",
    )
    tdraft.add_argument("--eval-examples", type=_at_least_one, default=32)
    tdraft.add_argument("--out", type=output_dir, required=True)
    tdraft.add_argument("--num-layers", type=_at_least_one, default=2)
    tdraft.add_argument("--draft-vocab", type=integer(0), default=8192)
    tdraft.add_argument("--steps", type=_at_least_one, default=None, help="(default: 300)")
    tdraft.add_argument("--batch-size", type=_at_least_one, default=8)
    tdraft.add_argument("--max-len", type=integer(2), default=384)
    tdraft.add_argument("--lr", type=number(above=0), default=3e-4)
    tdraft.add_argument(
        "--init",
        default=None,
        help="continue training the draft saved here (its layers and draft vocabulary are "
        "kept; a new schedule of --steps)",
    )
    _add_run_flags(tdraft, "draft")

    for kind, what in (
        ("medusa", "Medusa-1 heads on the target's last feature"),
        ("eagle", "an EAGLE head (feature-level autoregression; drafted as EAGLE-2 trees)"),
        ("eagle3", "an EAGLE-3 head (low/mid/high features, training-time test)"),
    ):
        th = tsub.add_parser(kind, help=f"train {what} on a frozen target")
        add_engine_args(th)
        th.add_argument(
            "--data",
            required=True,
            action="append",
            help="shards with features from `specdecode data generate` (repeatable: one head "
            "trains on several data sets; the last --eval-examples of each are held out)",
        )
        th.add_argument("--out", type=output_dir, required=True, help="directory for the head")
        th.add_argument(
            "--draft-vocab", type=integer(0), default=16384, help="draft vocabulary size (0 = full)"
        )
        th.add_argument(
            "--steps", type=_at_least_one, default=None, help="optimizer steps (default 1000)"
        )
        th.add_argument("--batch-tokens", type=_at_least_one, default=4096)
        th.add_argument("--max-len", type=_at_least_one, default=768)
        th.add_argument("--lr", type=number(above=0), default=1e-3)
        th.add_argument("--warmup", type=_at_least_one, default=20, help="linear warm-up steps")
        th.add_argument(
            "--init",
            default=None,
            help="continue training this head (on any data; its draft vocabulary is kept)",
        )
        th.add_argument("--eval-examples", type=_at_least_one, default=64)
        _add_run_flags(th, "head")
        th.add_argument(
            "--precision",
            choices=["auto", "bf16", "fp32"],
            default="auto",
            help="matmul precision (master weights stay fp32); auto: bf16 where it is native (a "
            "CUDA GPU from Ampere on, a CPU with AVX512-BF16 or AMX), else fp32",
        )
        if kind == "medusa":
            th.add_argument("--num-heads", type=_at_least_one, default=4)
        elif kind == "eagle3":
            th.add_argument(
                "--ttt-steps", type=_at_least_one, default=4, help="draft steps unrolled"
            )
            th.add_argument(
                "--ttt-ramp",
                type=number(0, below=1),
                default=0.0,
                help="fraction of the run (by steps or time) that unrolls fewer steps, 1 up to "
                "--ttt-steps - 1 in equal shares (cheaper steps while the head learns the basics)",
            )
            th.add_argument(
                "--variant",
                default="",
                help="speculators' EAGLE-3 variants, comma-separated: norm_before_residual, "
                "norm_before_fc, fc_norm, norm_output (speculators 0.9 trains "
                "norm_before_fc,norm_output by default; vLLM reads all four, SGLang 0.5.23 all "
                "but norm_before_residual). "
                "Default: none. A continued head (--init) keeps its own",
            )
        else:
            th.add_argument("--noise", type=number(0), default=0.1, help="U(-a, a) feature noise")
            th.add_argument("--ce-weight", type=number(0), default=0.1)

    exp = sub.add_parser(
        "export", help="write a trained head in the layout vLLM, SGLang or speculators loads"
    )
    exp.add_argument("head", help="head directory (`specdecode train ...` or an imported one)")
    exp.add_argument("--format", required=True, choices=["vllm", "sglang", "speculators"])
    exp.add_argument("--out", type=output_dir, required=True)
    exp.add_argument(
        "--target-name",
        default=None,
        help="the target's name on the serving side (Hugging Face id or path); default: "
        "the default model's Hub id for the embedded model",
    )
    # (the target's weights are read, not run: of the engine flags only these two apply)
    exp.add_argument(
        "--model", default=None, help="the head's target (default: the embedded SmolLM2)"
    )
    exp.add_argument(
        "--allow-pickle", action="store_true", help="allow a pickle head checkpoint (*.bin)"
    )

    bench = sub.add_parser("bench", help="benchmarks")
    bsub = bench.add_subparsers(dest="bench", required=True)
    from specdecode import bench as b

    lat = bsub.add_parser("latency", help="plain decoding tok/s vs transformers, and the floor")
    add_engine_args(lat)
    add_speculative_args(lat)
    # (each mode's own flags default to None, so that one given to the other mode is refused;
    # the defaults in the help are filled in by _latency_flags)
    lat.add_argument(
        "--workloads",
        type=b.workload_list,
        default=None,
        help="speculative mode: comma list of code, sql, json, writing, chat (default: "
        "code,sql,json,chat)",
    )
    lat.add_argument(
        "--temperatures",
        type=b.temperatures,
        default=None,
        help="speculative mode (default: 0,0.7,1.0)",
    )
    lat.add_argument(
        "--compare",
        type=b.config_list,
        default=None,
        help="speculative mode: a JSON list of further speculative configs measured in the "
        "same run against the same plain baseline",
    )
    lat.add_argument(
        "--num-prompts",
        type=b.at_least(1),
        default=None,
        help="speculative mode, per workload (default: 3)",
    )
    # decode speed is timed from the second token on: two at least
    lat.add_argument("--max-tokens", type=b.at_least(2), default=64)
    lat.add_argument(
        "--repeats",
        type=b.at_least(1),
        default=None,
        help="plain mode: runs per prompt, the best kept (default: 3)",
    )
    lat.add_argument("--skip-transformers", action="store_true")
    lat.add_argument(
        "--json", type=output_file, default=None, help="also write the results to this JSON file"
    )
    srv_bench = bsub.add_parser(
        "serve",
        help="concurrency sweep of the serving engine: policies off / static / adaptive (the "
        "drafter: the speculative flags, n-gram k=5 without them)",
    )
    add_engine_args(srv_bench)
    add_speculative_args(srv_bench)
    from specdecode.bench.serve import add_args as add_serve_bench_args

    add_serve_bench_args(srv_bench)
    st_bench = bsub.add_parser(
        "structured", help="speculation under a JSON-schema constraint vs without, batch 1"
    )
    add_engine_args(st_bench)
    add_speculative_args(st_bench)
    from specdecode.bench.structured import add_args as add_structured_bench_args

    add_structured_bench_args(st_bench)
    q_bench = bsub.add_parser(
        "quantization",
        help="fp32 / bf16 / int8 / int4 targets side by side: decode tok/s, and agreement "
        "with fp32's greedy replies",
    )
    add_engine_args(q_bench)
    from specdecode.bench.quantization import add_args as add_quantization_bench_args

    add_quantization_bench_args(q_bench)
    suite = bsub.add_parser(
        "suite",
        help="every method x workload x temperature (and concurrency) per target, with the "
        "transformers and llama.cpp references; JSON, Markdown, plots, BENCHMARKS.md",
    )
    add_engine_args(suite)
    from specdecode.bench.suite import add_args as add_suite_args

    add_suite_args(suite)
    pre = bsub.add_parser(
        "prefix", help="prefix caching off vs on over multi-turn chat (ShareGPT), batch 1"
    )
    add_engine_args(pre)
    add_speculative_args(pre)
    from specdecode.bench.prefix import add_args as add_prefix_bench_args

    add_prefix_bench_args(pre)
    hb = bsub.add_parser(
        "http",
        help="load over HTTP against any OpenAI-compatible server (this one, vLLM, SGLang): "
        "TTFT, TPOT, ITL, E2EL, throughput, and the server's acceptance where it exports it",
    )
    from specdecode.bench.http_load import add_args as add_http_bench_args

    add_http_bench_args(hb)
    rep = bsub.add_parser("report", help="docs/BENCHMARKS.md from bench suite output directories")
    rep.add_argument("runs", nargs="+", help="directories written by `bench suite`")
    rep.add_argument("--advise", default=None, help="an `advise --validate --json` result")
    rep.add_argument("--out", type=output_file, default="docs/BENCHMARKS.md")
    adv = sub.add_parser(
        "advise",
        help="measure your traffic here and say whether speculative decoding pays at your "
        "concurrency, with which drafter and depth",
    )
    add_engine_args(adv)
    add_speculative_args(adv)
    from specdecode.advise import add_args as add_advise_args

    add_advise_args(adv)
    return parser


def cmd_generate(args: argparse.Namespace) -> None:
    from specdecode import LLM, SamplingParams

    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        max_tokens=args.max_tokens,
        min_tokens=args.min_tokens,
        seed=args.seed,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
    )
    llm = LLM(args.model, **engine_kwargs(args))
    # one request: the step-cost curve timed up to twice its reach (a token and its drafts),
    # not every batch size the engine could (~3 s, paid by this one request)
    llm.engine.ensure_calibrated(upto=2 * llm.engine.tokens_per_decode)
    prompt = [{"role": "user", "content": args.prompt}] if args.chat else args.prompt
    for piece in llm.stream(prompt, params, chat=args.chat):
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    stats = llm.engine.spec_stats
    if stats.num_drafts:
        print(
            f"[speculative: {stats.num_accepted_tokens}/{stats.num_draft_tokens} drafts accepted "
            f"({100 * stats.acceptance_rate:.0f}%), {stats.mean_acceptance_length:.2f} tokens "
            "per step]",
            file=sys.stderr,
        )


def cmd_data(args: argparse.Namespace) -> None:
    from pathlib import Path

    from specdecode import LLM, data

    if args.data == "token-map":
        _write_token_map(args)
        return
    if args.data == "traffic":
        from specdecode.bench import workloads

        names = [w.strip() for w in args.workloads.split(",") if w.strip()]
        if not names:
            raise InvalidRequestError("--workloads names none")
        if not 0 <= args.temperature <= 100:  # what `advise` and the server accept
            raise InvalidRequestError(f"--temperature must be in [0, 100], got {args.temperature}")
        if not Path(args.out).resolve().parent.is_dir():
            raise InvalidRequestError(f"--out {args.out!r}: its folder does not exist")
        lines = [
            json.dumps(
                {"messages": m, "temperature": args.temperature, "max_tokens": args.max_tokens}
            )
            for wl in names
            for m in workloads.load(wl, args.num_prompts)
        ]
        Path(args.out).write_text("\n".join(lines) + "\n")
        print(f"wrote {len(lines)} requests to {args.out}")
        return
    from specdecode.train.datagen import answered_ids, generate

    try:  # before the model loads: a wrong path fails at once
        skip = set().union(*(answered_ids(Path(d)) for d in args.exclude_data))
    except DataError as e:
        raise InvalidRequestError(f"--exclude-data: {e}") from e
    kwargs = {**engine_kwargs(args), "max_num_seqs": args.max_num_seqs}
    llm = LLM(args.model, **kwargs)
    conversations = []
    for item in data.SOURCES[args.source]("train"):
        if item[0] in skip:
            continue
        conversations.append(item)
        if len(conversations) == args.num_conversations:
            break
    from specdecode.train.datagen import default_feature_layers

    layers = {
        "eagle3": default_feature_layers(llm.engine.model_config.num_layers),
        "final": (),
        "none": None,
    }[args.features]
    generate(  # (it says what it wrote)
        llm,
        conversations,
        Path(args.out),
        args.shard_size,
        args.max_tokens,
        args.temperature,
        max_prompt_tokens=args.max_prompt_tokens,
        feature_layers=layers,
        source=args.source,
    )


def _write_token_map(args: argparse.Namespace) -> None:
    """`data token-map`: the `--size` tokens most frequent in the data's answers (then in its
    prompts: answers copy from them), ranked as `train --draft-vocab` ranks a head's."""
    from pathlib import Path

    from specdecode.models.token_map import save_token_map
    from specdecode.train.datagen import iter_examples, shard_metadata
    from specdecode.train.draft import answer_coverage, frequent_tokens

    if Path(args.out).suffix.lower() not in (".safetensors", ".json"):
        raise InvalidRequestError(f"--out {args.out!r}: a token map is .safetensors or .json")
    examples = []
    for d in args.data_dirs:
        shard_metadata(Path(d))  # (a clear error for a folder without shards, or a mixed one)
        examples += list(iter_examples(Path(d), features=False))
    ids = frequent_tokens(examples, args.size, [])
    answers = sum(sum(e.loss_mask) for e in examples)
    covered = answer_coverage(examples, ids)
    save_token_map(ids, args.out)
    short = f" (the data holds only {len(ids)} distinct tokens)" if len(ids) < args.size else ""
    print(
        f"wrote {len(ids)} token ids to {args.out}{short}: {covered:.1%} of the {answers} "
        f"answer tokens of {len(examples)} conversations; serve with --speculative-token-map "
        f"{args.out}"
    )


def cmd_train(args: argparse.Namespace) -> None:
    from pathlib import Path

    from specdecode.engine.engine import resolve_device, resolve_dtype
    from specdecode.models.loader import load_model, load_tokenizer
    from specdecode.train.datagen import shard_metadata
    from specdecode.train.draft import DraftTrainConfig, train_draft

    heads = args.train in ("medusa", "eagle", "eagle3")
    if getattr(args, "quantization", None) is not None:
        raise InvalidRequestError(
            "--quantization: training reads the target's features through its full-precision "
            "weights; train as loaded (a head trained so drafts for a quantized target too)",
            "quantization",
        )
    _check_train_out(Path(args.out), args.resume, args.init)
    if args.resume:  # (what there is to resume, before the data and the model)
        from specdecode.train.draft import resume_draft_config
        from specdecode.train.heads import resume_config

        if args.init:
            raise InvalidRequestError(
                "--resume continues the run in --out; --init starts a new one"
            )
        if heads:
            resume_config(Path(args.out), args.train)
        else:
            resume_draft_config(Path(args.out))
    for d in args.data:  # before the model loads: a wrong path or a mixed set fails at once
        shard_metadata(Path(d))
        if Path(d).resolve() == Path(args.out).resolve():
            raise InvalidRequestError(f"--out {args.out!r} is a --data folder: choose another")

    loaded = load_model(
        args.model, dtype=resolve_dtype(args.dtype), device=resolve_device(args.device)
    )
    tok = load_tokenizer(loaded.path)
    eos = sorted(
        {
            *loaded.config.eos_token_ids,
            *([tok.eos_token_id] if tok.eos_token_id is not None else []),
        }
    )
    if args.train in ("medusa", "eagle", "eagle3"):
        from specdecode.train.heads import HeadTrainConfig, train_eagle, train_eagle3, train_medusa

        extra = {
            "medusa": lambda: {"num_heads": args.num_heads},
            "eagle": lambda: {"noise": args.noise, "ce_weight": args.ce_weight},
            "eagle3": lambda: {
                "ttt_steps": args.ttt_steps,
                "ttt_ramp": args.ttt_ramp,
                "variant": args.variant,
            },
        }[args.train]()
        hcfg = HeadTrainConfig(
            draft_vocab=args.draft_vocab,
            steps=args.steps or 1000,
            batch_tokens=args.batch_tokens,
            max_len=args.max_len,
            lr=args.lr,
            warmup=args.warmup,
            init=args.init,
            allow_pickle=args.allow_pickle,
            eval_examples=args.eval_examples,
            max_minutes=args.max_minutes,
            checkpoint_minutes=args.checkpoint_minutes or None,
            bf16={"auto": None, "bf16": True, "fp32": False}[args.precision],
            **extra,
        )
        if args.resume:
            from specdecode.train.heads import resume_config

            hcfg = _resumed(args, hcfg, lambda out, **o: resume_config(out, args.train, **o))
        fn = {"medusa": train_medusa, "eagle": train_eagle, "eagle3": train_eagle3}[args.train]
        loaded.model.requires_grad_(False)
        history = fn(loaded.model, [Path(d) for d in args.data], Path(args.out), hcfg, eos)
        _report_run(history, hcfg.steps, ("draft_vocab_coverage", "train_answer_tokens"))
        return
    cfg = DraftTrainConfig(
        num_layers=args.num_layers,
        draft_vocab=args.draft_vocab,
        steps=args.steps or 300,
        batch_size=args.batch_size,
        max_len=args.max_len,
        lr=args.lr,
        eval_examples=args.eval_examples,
        max_minutes=args.max_minutes,
        init=args.init,
        checkpoint_minutes=args.checkpoint_minutes or None,
    )
    if args.resume:
        from specdecode.train.draft import resume_draft_config

        cfg = _resumed(args, cfg, resume_draft_config)
    data = [Path(d) for d in args.data]
    history = train_draft(loaded.model, data, Path(args.out), cfg, eos, loaded.path)
    _report_run(history, cfg.steps, ("train_examples", "held_out_examples", "draft_vocab_size",
                                     "draft_vocab_coverage"))  # fmt: skip


def _resumed(args: argparse.Namespace, fresh, saved_settings):
    """--resume: the saved run's settings (`saved_settings(out, steps=, max_minutes=)`), with
    the flags that may change them; one that would change another is refused."""
    from dataclasses import replace

    cfg = saved_settings(Path(args.out), steps=args.steps, max_minutes=args.max_minutes)
    cfg = replace(cfg, checkpoint_minutes=args.checkpoint_minutes or None)
    _check_resume_flags(args, fresh, cfg)
    return cfg


def _report_run(history: dict, steps: int, extra: tuple[str, ...]) -> None:
    """A training run's figures, and how it ended: a time budget says how to go on; Ctrl-C
    (saved, resumable, but not done) exits 130."""
    keys = ("before", "after", "steps_done", "stopped_by", "train_seconds", *extra)
    print(json.dumps({k: history[k] for k in keys}, indent=2))
    if history["stopped_by"].startswith("time budget"):
        print(
            f"stopped by its {history['stopped_by']} after {history['steps_done']} of {steps} "
            "steps; `--resume` with a larger --max-minutes goes on",
            file=sys.stderr,
        )
    if history["stopped_by"] == "interrupt":
        raise KeyboardInterrupt


def _check_train_out(out, resume: bool, init: str | None) -> None:
    """Training writes its checkpoints into --out: one that already holds a model is continued
    (a head's: --resume, or --init naming it) or left alone, never replaced unasked."""
    if resume or not (out / "config.json").is_file():
        return
    if init is not None and Path(init).resolve() == out.resolve():
        return
    how = "continue it with --resume (or --init naming it), or "
    raise InvalidRequestError(
        f"--out {str(out)!r} already holds a model; {how}choose another folder or remove it"
    )


def cmd_export(args: argparse.Namespace) -> None:
    from pathlib import Path

    from specdecode.export import (
        MARK,
        TOKEN_MAP,
        check_format,
        check_out,
        export_head,
        export_notes,
        serve_command,
    )
    from specdecode.models.head_io import head_kind
    from specdecode.models.loader import hub_id, load_model

    check_out(Path(args.head), Path(args.out))  # (before the target loads)
    check_format(head_kind(Path(args.head)), args.format)
    loaded = load_model(args.model)
    # the target's Hugging Face id where it is known: a speculators checkpoint names its
    # verifier, and vLLM serves one alone only if that is a Hub id
    hub = args.target_name or hub_id(args.model)
    name = hub or str(loaded.path)
    # a --target-name that is a local folder is no Hub id (vLLM refuses a local verifier)
    remote = bool(hub) and _is_hub_id(hub)
    head = Path(args.head)
    kind = head_kind(head) or "eagle3"
    config = export_head(head, loaded.model, args.format, Path(args.out), name, args.allow_pickle)
    print(f"wrote {args.out}; serve it with:")
    heads = config.get("num_heads")
    mapped = (Path(args.out) / TOKEN_MAP).is_file()
    print("  " + serve_command(args.format, kind, name, str(args.out), heads, remote, mapped))
    # the draft vocabulary of the head as loaded (ours, or an imported token_map)
    draft_vocab = json.loads((Path(args.out) / MARK).read_text())["draft_vocab"]
    for note in export_notes(args.format, kind, draft_vocab, remote, config):
        print(f"note: {note}")


def _is_hub_id(name: str) -> bool:
    """A Hugging Face repository id ("org/name"), not a path that exists here."""
    import re

    if Path(name).expanduser().exists():
        return False
    return re.fullmatch(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*", name) is not None


def cmd_models(args: argparse.Namespace) -> None:
    from specdecode.models.registry import (
        RECIPES,
        REGISTRY,
        built_head,
        gguf_path,
        is_built,
        pull,
    )

    if args.models == "list":
        for m in REGISTRY.values():
            where = gguf_path(m)
            state = "pulled" if where.is_file() else "not pulled"
            print(f"{m.name:<26} {state:<11} {m.description}")
            if where.is_file():
                print(f"{'':<26} {'':<11} {where}")
        for r in RECIPES.values():
            state = "built" if is_built(r.name) else "not built"
            print(f"{r.name:<26} {state:<11} {r.description}")
            if is_built(r.name):
                print(f"{'':<26} {'':<11} {built_head(r.name)}")
        return
    print(pull(args.name))


def _words_after(argv: list[str] | None, *command: str) -> list[str]:
    """The command line's words after `command` (what a report records to rerun it; a global
    flag such as -v before it is not part of it)."""
    words = list(argv if argv is not None else sys.argv[1:])
    i = 0
    for name in command:
        i = words.index(name, i) + 1
    return words[i:]


# `train --resume` keeps the run's settings: these flags, given with values of their own, are
# refused rather than ignored (HeadTrainConfig field: the flag's name where it differs)
RESUMED_SETTINGS = {"num_layers": None, "batch_size": None,
                    "draft_vocab": None, "batch_tokens": None, "max_len": None, "lr": None,
                    "warmup": None, "eval_examples": None, "bf16": "precision",
                    "num_heads": None, "noise": None, "ce_weight": None, "ttt_steps": None,
                    "ttt_ramp": None, "variant": None}  # fmt: skip


def _check_resume_flags(args: argparse.Namespace, given, resumed) -> None:
    """`given`: the settings the flags name; `resumed`: the saved run's. A flag the user set
    (not its default) to another value than the run's is refused: --resume continues that run
    as it was, which the flag would not change."""
    defaults = build_parser().parse_args(["train", args.train, "--data", "d", "--out", args.out])
    changed = [
        "--" + (flag or key).replace("_", "-")
        for key, flag in RESUMED_SETTINGS.items()
        if hasattr(given, key)
        and getattr(args, flag or key, None) != getattr(defaults, flag or key, None)
        and getattr(given, key) != getattr(resumed, key)
    ]
    if changed:
        raise InvalidRequestError(
            f"{', '.join(changed)}: --resume continues the run in {args.out} with its own "
            "settings; drop these flags, or start a new run from it with --init"
        )


def _check_unused_flags(args: argparse.Namespace) -> None:
    """Flags a command would accept and then ignore are errors: the user meant something."""
    bench = getattr(args, "bench", None)
    if args.command == "advise" or bench == "serve":
        if getattr(args, "speculative_policy", None):
            what = "advise" if args.command == "advise" else "bench serve"
            raise InvalidRequestError(
                f"{what} measures the policies itself (bench serve: --policies); "
                "--speculative-policy does not apply"
            )
    elif (
        getattr(args, "speculative_policy", None)
        and bench != "structured"  # (its drafter is n-gram where no flag names one)
        and not speculative_config(args)
    ):
        raise InvalidRequestError(
            f"--speculative-policy {args.speculative_policy} decides when to draft: it needs a "
            "speculative config (--speculative-config or another speculative flag)"
        )
    if args.command == "advise" and args.draft_model and speculative_config(args):
        raise InvalidRequestError(
            "advise: --draft-model adds a candidate to the drafters it tries on its own; with a "
            "speculative config given it measures that config alone (put the draft model there)"
        )
    if bench == "latency" and args.compare and not speculative_config(args):
        raise InvalidRequestError(
            "bench latency: --compare measures further configs beside --speculative-config "
            "(or another speculative flag); give that first"
        )
    if bench == "latency":
        _latency_flags(args)


# bench latency's modes and their own flags, with their defaults: plain decoding (no
# speculative config) times three fixed prompts; the speculative mode, workloads' prompts
LATENCY_FLAGS = {
    "plain": {"repeats": 3},
    "speculative": {"workloads": "code,sql,json,chat", "temperatures": "0.0,0.7,1.0",
                    "num_prompts": 3},
}  # fmt: skip


def _latency_flags(args: argparse.Namespace) -> None:
    """A flag of the other mode is refused (a review's `--num-prompts 2` timed plain decoding
    on its three prompts); the mode's own flags not given take their defaults."""
    mode = "speculative" if speculative_config(args) else "plain"
    other = "plain" if mode == "speculative" else "speculative"
    given = [k for k in LATENCY_FLAGS[other] if getattr(args, k) is not None]
    if given:
        flags = ", ".join("--" + k.replace("_", "-") for k in given)
        raise InvalidRequestError(
            f"bench latency: {flags} {'apply' if len(given) > 1 else 'applies'} to its "
            f"{other} mode only"
            + (" (give a speculative config)" if other == "speculative" else "")
        )
    for key, default in LATENCY_FLAGS[mode].items():
        if getattr(args, key) is None:
            setattr(args, key, default)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    if getattr(args, "dtype", None) == "auto":  # (every command, and its reports, see the dtype)
        from specdecode.config import auto_dtype

        args.dtype = auto_dtype(args.device)
    try:
        _check_unused_flags(args)
        if args.command == "generate":
            cmd_generate(args)
        elif args.command == "serve":
            from specdecode.serving.server import run_server

            run_server(args)
        elif args.command == "models":
            cmd_models(args)
        elif args.command == "export":
            cmd_export(args)
        elif args.command == "data":
            cmd_data(args)
        elif args.command == "train":
            cmd_train(args)
        elif args.command == "advise":
            from specdecode.advise import run_advise

            args.argv = _words_after(argv, "advise")
            run_advise(args)
        elif args.command == "bench" and args.bench == "report":
            from specdecode.bench.report import run_report

            run_report(args)
        elif args.command == "bench" and args.bench == "suite":
            from specdecode.bench.suite import run_suite

            args.argv = _words_after(argv, "bench", "suite")
            run_suite(args)
        elif args.command == "bench" and args.bench == "structured":
            from specdecode.bench.structured import run_structured_bench

            run_structured_bench(args)
        elif args.command == "bench" and args.bench == "quantization":
            from specdecode.bench.quantization import run_quantization_bench

            run_quantization_bench(args)
        elif args.command == "bench" and args.bench == "prefix":
            from specdecode.bench.prefix import run_prefix_bench

            run_prefix_bench(args)
        elif args.command == "bench" and args.bench == "http":
            from specdecode.bench.http_load import run_http_bench

            run_http_bench(args)
        elif args.command == "bench" and args.bench == "serve":
            from specdecode.bench.serve import run_serve_bench

            run_serve_bench(args)
        elif args.command == "bench" and args.bench == "latency":
            if speculative_config(args):
                from specdecode.bench.speculative import run_speculative

                run_speculative(args)
            else:
                from specdecode.bench.latency import run_latency

                run_latency(args)
    except SpecDecodeError as e:
        print(f"specdecode: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
