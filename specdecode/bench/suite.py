"""`specdecode bench suite`: every method on every workload and temperature, per target, next to
the references (transformers `generate` and its prompt lookup, llama.cpp and its prompt lookup)
on the same prompts, in one run.

Three measurements per target:
- batch 1: for each workload (code, sql, json, writing, chat) and temperature, plain decoding
  (`off`) and each method at its defaults (static policy: it always drafts), tok/s end to end
  (prefill included) and decode only (after the first token), acceptance, tau, acceptance by
  draft position; the references decode the same token ids with the same sampling settings;
- concurrency: closed-loop clients at each level on one workload (the `bench serve` runner) for
  `off` and each method (static, and the adaptive controller);
- the results go to `suite.json`, a Markdown table `suite.md`, and plots (speedup against
  concurrency, acceptance against temperature, tau per workload); `--report` also writes
  docs/BENCHMARKS.md (see `specdecode.bench.report`).

Methods that have nothing to run on a target (no draft model, no trained heads) are listed with
the reason instead of a number.
"""

from __future__ import annotations

import argparse
import json
import logging
import shlex
import time
from dataclasses import dataclass, field
from pathlib import Path
from statistics import mean

import torch

from specdecode.bench import (
    at_least,
    level_list,
    machine,
    name_list,
    output_dir,
    output_file,
    temperatures,
    workload_list,
    workloads,
)
from specdecode.bench.speculative import _measure_interleaved
from specdecode.errors import InvalidRequestError

log = logging.getLogger(__name__)

METHODS = ("off", "ngram", "suffix", "draft_model", "medusa", "eagle", "eagle3")
TARGETS = ("smollm2-135m", "qwen2.5-coder-1.5b")
SHIPPED_HEADS = ("medusa", "eagle", "eagle3")  # for the default target only


@dataclass
class Target:
    name: str
    model: str | None  # what LLM() takes; None: the embedded default
    dtype: str
    configs: dict[str, dict] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)  # method -> why it has no number
    gguf: Path | None = None  # the same weights for llama.cpp


def resolve_targets(args: argparse.Namespace) -> tuple[list[Target], dict[str, str]]:
    """The targets asked for that are here, each with its methods' configs (or why not)."""
    from specdecode.models import registry
    from specdecode.models.loader import default_gguf_path

    methods = [m for m in args.methods.split(",") if m]
    unknown = set(methods) - set(METHODS)
    if unknown:
        raise InvalidRequestError(
            f"unknown methods {sorted(unknown)}; choose from {', '.join(METHODS)}"
        )
    overrides = _overrides(args.method_config or [])
    out, missing = [], {}
    for name in [t for t in args.targets.split(",") if t]:
        if name not in TARGETS:
            raise InvalidRequestError(f"unknown target {name!r}; choose from {', '.join(TARGETS)}")
        if name == "smollm2-135m":
            label = Path(args.model).name if args.model else name
            gguf = _maybe(default_gguf_path) if not args.model else None
            if args.model and str(args.model).endswith(".gguf"):
                gguf = Path(args.model)
            t = Target(label, args.model, args.dtype, gguf=gguf)
            draft = args.draft_model
            why_no_draft = (
                "no draft model: SmolLM2-135M is the smallest of its family; give "
                "--draft-model (e.g. one distilled with `specdecode train draft`)"
            )
            heads_missing = (
                "no heads for this model (they ship for the default one)" if (args.model) else ""
            )
        else:
            gguf = registry.gguf_path(registry.REGISTRY[name])
            if not gguf.is_file():
                missing[name] = f"not pulled (`specdecode models pull {name}`)"
                continue
            t = Target(name, name, args.qwen_dtype, gguf=gguf)
            small = registry.gguf_path(registry.REGISTRY["qwen2.5-coder-0.5b"])
            draft = "qwen2.5-coder-0.5b" if small.is_file() else None
            why_no_draft = "draft qwen2.5-coder-0.5b not pulled"
            heads_missing = ""
        for m in methods:
            if m == "off":
                continue
            if m in overrides:
                t.configs[m] = overrides[m]
            elif m == "ngram":
                t.configs[m] = {"method": "ngram", "num_speculative_tokens": 5}
            elif m == "suffix":  # the method's defaults
                t.configs[m] = {"method": "suffix"}
            elif m == "draft_model":
                if draft:
                    t.configs[m] = {"method": "draft_model", "model": draft}
                else:
                    t.skipped[m] = why_no_draft
            elif heads_missing:
                t.skipped[m] = heads_missing
            elif name != "smollm2-135m":  # heads `models pull` builds for a pulled target
                recipe = registry.recipe_for(name, m)
                if recipe is None:
                    t.skipped[m] = "no head recipe for this target"
                elif not registry.is_built(recipe.name):
                    t.skipped[m] = f"head not built (`specdecode models pull {recipe.name}`)"
                else:
                    t.configs[m] = {"method": m, "model": recipe.name}
            else:
                t.configs[m] = {"method": m}
        out.append(t)
    return out, missing


def _maybe(fn):
    try:
        return fn()
    except Exception:  # noqa: BLE001 - the reference is optional
        return None


def _overrides(items: list[str]) -> dict[str, dict]:
    out = {}
    for item in items:
        method, sep, raw = item.partition("=")
        if method == "off":
            raise InvalidRequestError("--method-config: off (plain decoding) takes no config")
        if not sep or method not in METHODS:
            raise InvalidRequestError(
                f"--method-config wants METHOD=JSON with a known method, got {item!r}"
            )
        try:
            cfg = json.loads(raw)
        except json.JSONDecodeError as e:
            raise InvalidRequestError(f"--method-config {method}: not JSON: {e}") from e
        if not isinstance(cfg, dict):
            raise InvalidRequestError(f"--method-config {method}: must be a JSON object")
        out[method] = {"method": method, **cfg}
        from specdecode.config import SpeculativeConfig

        try:  # its values checked now, before any model loads
            SpeculativeConfig.from_dict(out[method])
        except InvalidRequestError as e:
            raise InvalidRequestError(f"--method-config {method}: {e}") from e
    return out


def run_suite(args: argparse.Namespace) -> dict:
    if getattr(args, "quantization", None) is not None:
        raise InvalidRequestError(
            "--quantization: the suite measures the targets as loaded, against transformers "
            "and llama.cpp on the same weights; `bench quantization` compares quantized targets"
        )
    targets, missing = resolve_targets(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {
        "command": "specdecode bench suite " + shlex.join(getattr(args, "argv", []) or []),
        "machine": machine(),
        "max_tokens": args.max_tokens,
        "num_prompts": args.num_prompts,
        "temperatures": _floats(args.temperatures),
        "workloads": args.workloads.split(","),
        "targets": [],
        "missing_targets": missing,
    }
    started = time.perf_counter()
    for target in targets:
        result["targets"].append(run_target(target, args))
        (out / "suite.json").write_text(json.dumps(result, indent=1))  # progress survives
    result["seconds"] = round(time.perf_counter() - started, 1)
    (out / "suite.json").write_text(json.dumps(result, indent=1))
    (out / "suite.md").write_text(markdown(result))
    plots(result, out)
    print(f"wrote {out}/suite.json, suite.md and plots")
    if getattr(args, "report", None):
        from specdecode.bench.report import write_report

        write_report([(result, out)], Path(args.report))
        print(f"wrote {args.report}")
    return result


def _floats(text: str) -> list[float]:
    return [float(t) for t in text.split(",") if t]


def run_target(target: Target, args: argparse.Namespace) -> dict:
    from specdecode import LLM
    from specdecode.config import EngineConfig

    levels = [int(c) for c in args.concurrency.split(",") if c] if args.concurrency else []
    common = dict(
        dtype=target.dtype,
        device=args.device,
        max_model_len=args.max_model_len,
        allow_pickle=args.allow_pickle,
        kernels=args.kernels,
        kv_cache_memory_gb=args.kv_cache_memory_gb or EngineConfig.kv_cache_memory_gb,
        max_num_seqs=max([*levels, 1]),
        enable_prefix_caching=False,  # every configuration pays its own prefill
    )
    n = len(target.configs)
    print(f"== {target.name}: loading the target and {n} drafter{'s' * (n != 1)}", flush=True)
    plain = LLM(target.model, speculative_policy="off", **common)
    # one copy of the weights for all: a buffer's speed here depends on where it lands
    engines = {
        m: LLM(
            target.model,
            share_model_with=plain,
            speculative_config=cfg,
            speculative_policy="static",
            **common,
        )
        for m, cfg in target.configs.items()
    }
    refs = _references(target, plain, args)
    rows: list[dict] = []
    for wl in args.workloads.split(","):
        prompts = [
            _fit(plain, plain._chat_ids(m), args) for m in workloads.load(wl, args.num_prompts)
        ]
        for temp in _floats(args.temperatures):
            # plain decoding and every method prompt by prompt, so drift hits all alike
            (base_tok_s, base_decode), measured = _measure_interleaved(
                plain, list(engines.items()), prompts, temp, args.max_tokens
            )
            cell = {"workload": wl, "temperature": temp, "prompts": len(prompts)}
            rows.append({**cell, "method": "off", "tok_s": base_tok_s, "decode_tok_s": base_decode})
            for m, (tok_s, decode, stats, *_) in zip(engines, measured, strict=True):
                rows.append(
                    {
                        **cell,
                        "method": m,
                        "tok_s": tok_s,
                        "decode_tok_s": decode,
                        "speedup": tok_s / base_tok_s,
                        "decode_speedup": decode / base_decode if base_decode else None,
                        "acceptance_rate": stats.acceptance_rate,
                        "tau": stats.mean_acceptance_length,
                        "draft_tokens": stats.num_draft_tokens,  # (0: it drafted nothing)
                        "acceptance_by_position": [
                            round(a / max(1, stats.num_drafts), 4)
                            for a in stats.accepted_per_position
                        ],
                    }
                )
            for ref in list(refs):
                try:
                    measured = ref.measure(prompts, temp, args.max_tokens)
                except Exception as e:  # noqa: BLE001 - a reference must not end the run
                    print(f"   reference {type(ref).__name__} failed, dropped: {e}", flush=True)
                    args._refs_skipped[ref.name] = f"failed on {wl} T={temp:g}: {e}"
                    refs.remove(ref)
                    continue
                for label, tok_s in measured.items():
                    rows.append(
                        {
                            **cell,
                            "method": label,
                            "reference": True,
                            "tok_s": tok_s,
                            "vs_off": tok_s / base_tok_s,
                        }
                    )
            _print_cell([r for r in rows if r["workload"] == wl and r["temperature"] == temp])
    conc: list[dict] = []
    if levels:
        conc = _concurrency(plain, engines, levels, args)
    for ref in refs:
        ref.close()
    return {
        "target": target.name,
        "model": plain.engine.model_path.name,
        "dtype": target.dtype,
        "configs": {m: llm.engine.spec_config.__dict__ for m, llm in engines.items()},
        "skipped": target.skipped,
        "references_skipped": getattr(args, "_refs_skipped", {}),
        "rows": rows,
        "concurrency": conc,
        "concurrency_workload": args.concurrency_workload,
    }


def _concurrency(plain, engines: dict, levels: list[int], args) -> list[dict]:
    """Closed-loop throughput per level: `off` on the plain engine, each method static and
    adaptive on its own, same requests everywhere. Each method's ratios are taken against
    plain decoding measured on its own engine at each level just before and after it (their
    mean), not against the first `off` run: drift over a long sweep stays out of them."""
    from specdecode.bench.serve import closed_loop
    from specdecode.sampling import SamplingParams

    tok = plain.tokenizer
    prompts = []
    for messages in workloads.load(args.concurrency_workload, max(levels)):
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        prompts.append(_fit(plain, list(tok(text, add_special_tokens=False).input_ids), args, 512))
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, seed=0)
    policies = [p for p in args.concurrency_policies.split(",") if p]
    out = []
    print(f"-- concurrency {levels} on {args.concurrency_workload}", flush=True)
    for r in closed_loop(plain.engine, prompts, levels, ["off"], params, args.min_requests):
        out.append({**r, "method": "off"})
    for r in out:
        r["vs_off"] = 1.0
    for m, llm in engines.items():
        llm.engine.calibrate(time_budget_s=10.0)
        spec = [p for p in policies if p != "off"]
        got = closed_loop(
            llm.engine, prompts, levels, ["off", *spec], params, args.min_requests,
            repeat_off=True,
        )  # fmt: skip
        base: dict[int, list[float]] = {}
        for r in got:
            if r["policy"] == "off":
                base.setdefault(r["concurrency"], []).append(r["throughput_tok_s"])
        for r in got:
            if r["policy"] != "off":
                c = r["concurrency"]
                out.append({**r, "method": m, "vs_off": r["throughput_tok_s"] / mean(base[c])})
    for r in out:
        if r["method"] != "off":
            print(
                f"   c={r['concurrency']:<4} {r['method']:<12} {r['policy']:<9} "
                f"{r['throughput_tok_s']:7.1f} tok/s  {r['vs_off']:.2f}x off",
                flush=True,
            )
    return out


def _fit(llm, ids: list[int], args, limit: int | None = None) -> list[int]:
    """The prompt's last tokens, as many as `--max-prompt-tokens` and the context allow."""
    room = llm.engine.max_model_len - args.max_tokens - 16
    keep = max(1, min(room, args.max_prompt_tokens, limit or room))
    return ids[-keep:]


def _print_cell(rows: list[dict]) -> None:
    r0 = rows[0]
    parts = []
    for r in rows:
        if r["method"] == "off":
            parts.append(f"off {r['tok_s']:.1f}")
        elif r.get("reference"):
            parts.append(f"{r['method']} {r['tok_s']:.1f}")
        else:
            parts.append(
                f"{r['method']} {r['speedup']:.2f}x (acc {r['acceptance_rate']:.0%}, "
                f"tau {r['tau']:.2f})"
            )
    print(f"{r0['workload']:<8} T={r0['temperature']:<4} " + " | ".join(parts), flush=True)


# ---- references ---------------------------------------------------------------------------


class _TransformersRef:
    """transformers `generate` on the same checkpoint: plain and with prompt lookup (k=5)."""

    name = "transformers"

    def __init__(self, plain, k: int = 5) -> None:
        import transformers
        from transformers import AutoModelForCausalLM

        from specdecode.engine.engine import resolve_dtype

        transformers.logging.set_verbosity_error()
        transformers.logging.disable_progress_bar()
        self.model = (
            AutoModelForCausalLM.from_pretrained(
                str(plain.engine.model_path), dtype=resolve_dtype(plain.engine.config.dtype)
            )
            .to(plain.engine.runner.device)
            .eval()
        )  # (the engine's device: a fair baseline)
        self.pad = plain.tokenizer.eos_token_id
        self.k = k

    @torch.inference_mode()
    def measure(self, prompts: list[list[int]], temp: float, max_tokens: int) -> dict[str, float]:
        from specdecode.bench.speculative import hf_rate

        return {
            label: hf_rate(self.model, self.pad, prompts, temp, max_tokens, **extra)
            for label, extra in (
                ("transformers", {}),
                ("transformers prompt lookup", {"prompt_lookup_num_tokens": self.k}),
            )
        }

    def close(self) -> None:
        del self.model


class _LlamaCppRef:
    """llama.cpp (llama-cpp-python) on the target's GGUF file, quantized as shipped: plain and
    with its prompt-lookup drafter (k=5)."""

    name = "llama.cpp"

    def __init__(self, gguf: Path, n_ctx: int, k: int = 5) -> None:
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        common = dict(
            model_path=str(gguf), n_ctx=n_ctx, n_threads=torch.get_num_threads(), verbose=False
        )
        self.llms = {
            "llama.cpp": Llama(**common),
            # logits_all: llama-cpp-python 0.3 sizes its score buffer from this argument but
            # keeps logits for every token once a draft model is set (a longer prompt than
            # n_batch then fails); asking for it explicitly sizes the buffer to n_ctx
            "llama.cpp prompt lookup": Llama(
                **common,
                logits_all=True,
                draft_model=LlamaPromptLookupDecoding(num_pred_tokens=k),
            ),
        }

    def measure(self, prompts: list[list[int]], temp: float, max_tokens: int) -> dict[str, float]:
        out = {}
        for label, llm in self.llms.items():
            n, t = 0, 0.0
            for i, ids in enumerate(prompts):
                llm.reset()
                t0 = time.perf_counter()
                r = llm.create_completion(
                    ids,
                    max_tokens=max_tokens,
                    temperature=temp,
                    top_k=0,
                    top_p=1.0,
                    min_p=0.0,
                    repeat_penalty=1.0,
                    seed=i,
                )
                t += time.perf_counter() - t0
                n += r["usage"]["completion_tokens"]
            out[label] = n / t
        return out

    def close(self) -> None:
        for llm in self.llms.values():
            llm.close()


def _references(target: Target, plain, args) -> list:
    refs, skipped = [], {}
    wanted = [r for r in args.references.split(",") if r]
    if "transformers" in wanted:
        refs.append(_TransformersRef(plain))
    if "llamacpp" in wanted:
        try:
            import llama_cpp  # noqa: F401
        except ImportError:
            skipped["llama.cpp"] = (
                "llama-cpp-python is not installed (pip install 'specdecode[llamacpp]')"
            )
        else:
            if target.gguf is None:
                skipped["llama.cpp"] = "no GGUF file for this target"
            else:
                n_ctx = min(
                    plain.engine.max_model_len, args.max_prompt_tokens + args.max_tokens + 64
                )
                refs.append(_LlamaCppRef(target.gguf, n_ctx))
    args._refs_skipped = skipped
    for name, why in skipped.items():
        print(f"   reference {name} skipped: {why}", flush=True)
    return refs


# ---- output ---------------------------------------------------------------------------------


def _spec_methods(t: dict) -> list[str]:
    return [m for m in METHODS if m != "off" and m in t["configs"]]


def markdown(result: dict) -> str:
    lines = [
        f"Machine: {result['machine']}. Batch 1, {result['max_tokens']} tokens per prompt, "
        f"{result['num_prompts']} prompts per workload. Speedup: end-to-end tok/s against "
        "plain decoding (`off`) on the same weights and prompts, interleaved prompt by "
        "prompt; in brackets acceptance rate (accepted / drafted tokens) and tau (1 + accepted "
        "tokens per step that drafted).",
        "",
    ]
    for t in result["targets"]:
        methods = _spec_methods(t)
        refs = sorted({r["method"] for r in t["rows"] if r.get("reference")})
        lines += [f"### {t['target']} ({t['dtype']})", ""]
        head = "| workload | T | off tok/s | " + " | ".join(methods)
        head += "".join(f" | {r} tok/s" for r in refs) + " |"
        lines += [head, "|" + "---|" * (3 + len(methods) + len(refs))]
        cells: dict = {}
        for r in t["rows"]:
            cells.setdefault((r["workload"], r["temperature"]), {})[r["method"]] = r
        for (wl, temp), c in cells.items():
            row = f"| {wl} | {temp:g} | {c['off']['tok_s']:.1f} | "
            row += " | ".join(
                f"{c[m]['speedup']:.2f}x ({c[m]['acceptance_rate']:.0%}, {c[m]['tau']:.2f})"
                if m in c
                else "-"
                for m in methods
            )
            row += "".join(f" | {c[r]['tok_s']:.1f}" if r in c else " | -" for r in refs)
            lines.append(row + " |")
        for m, why in t["skipped"].items():
            lines.append(f"\n- `{m}`: not run, {why}.")
        for m, why in t.get("references_skipped", {}).items():
            lines.append(f"\n- reference {m}: not run, {why}.")
        if t["concurrency"]:
            lines += [
                "",
                f"Concurrency ({t['concurrency_workload']}, T=0, closed loop): "
                "throughput against `off` at the same concurrency.",
                "",
            ]
            levels = sorted({r["concurrency"] for r in t["concurrency"]})
            keys = sorted(
                {(r["method"], r["policy"]) for r in t["concurrency"] if r["method"] != "off"},
                key=lambda k: (METHODS.index(k[0]), k[1]),
            )
            by = {(r["method"], r["policy"], r["concurrency"]): r for r in t["concurrency"]}
            lines.append("| method | policy | " + " | ".join(f"c={c}" for c in levels) + " |")
            lines.append("|" + "---|" * (2 + len(levels)))
            off = " | ".join(
                f"{by[('off', 'off', c)]['throughput_tok_s']:.0f} tok/s" for c in levels
            )
            lines.append(f"| off | off | {off} |")
            for m, p in keys:
                vals = " | ".join(
                    f"{by[(m, p, c)]['vs_off']:.2f}x" if (m, p, c) in by else "-" for c in levels
                )
                lines.append(f"| {_sweep_label(m)} | {p} | {vals} |")
        lines.append("")
    for name, why in result.get("missing_targets", {}).items():
        lines.append(f"- target {name}: {why}.")
    return "\n".join(lines) + "\n"


def plots(result: dict, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    targets = result["targets"]
    # speedup against concurrency (where a sweep ran)
    if any(t["concurrency"] for t in targets):
        paths.append(_concurrency_plot(plt, targets, out))

    # acceptance against temperature (mean over workloads)
    fig, axes = plt.subplots(
        1, max(1, len(targets)), figsize=(6 * max(1, len(targets)), 4), squeeze=False
    )
    for ax, t in zip(axes[0], targets, strict=False):
        for m in _spec_methods(t):
            temps = sorted({r["temperature"] for r in t["rows"] if r["method"] == m})
            ys = [
                _mean(
                    [
                        r["acceptance_rate"]
                        for r in t["rows"]
                        if r["method"] == m and r["temperature"] == x
                    ]
                )
                for x in temps
            ]
            ax.plot(temps, ys, marker="o", color=f"C{METHODS.index(m)}", label=m)
        ax.axhline(0.3, color="gray", lw=1, ls="--")
        ax.set(
            xlabel="temperature",
            ylabel="acceptance rate (mean over workloads)",
            title=t["target"],
            ylim=(0, 1),
        )
        ax.grid(alpha=0.3)
        _legend(ax)
    fig.tight_layout()
    paths.append(out / "acceptance_vs_temperature.png")
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)
    # tau per workload at the lowest temperature
    fig, axes = plt.subplots(
        1, max(1, len(targets)), figsize=(6 * max(1, len(targets)), 4), squeeze=False
    )
    for ax, t in zip(axes[0], targets, strict=False):
        methods = _spec_methods(t)
        wls = list(dict.fromkeys(r["workload"] for r in t["rows"]))
        t0 = min((r["temperature"] for r in t["rows"]), default=0.0)
        width = 0.8 / max(1, len(methods))
        for j, m in enumerate(methods):
            ys = [
                _mean(
                    [
                        r["tau"]
                        for r in t["rows"]
                        if r["method"] == m and r["workload"] == w and r["temperature"] == t0
                    ]
                )
                for w in wls
            ]
            ax.bar(
                [i + j * width for i in range(len(wls))],
                ys,
                width,
                color=f"C{METHODS.index(m)}",
                label=m,
            )
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(wls))], wls)
        ax.axhline(1.0, color="gray", lw=1)
        ax.set(ylabel="tau (1 + accepted per drafting step)", title=f"{t['target']}, T={t0:g}")
        _legend(ax)
    fig.tight_layout()
    paths.append(out / "tau_per_workload.png")
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)
    return paths


def _concurrency_plot(plt, targets: list[dict], out: Path) -> Path:
    fig, axes = plt.subplots(
        1, max(1, len(targets)), figsize=(6 * max(1, len(targets)), 4), squeeze=False
    )
    for ax, t in zip(axes[0], targets, strict=False):
        for m in _spec_methods(t):
            for policy, style in (("static", "-"), ("adaptive", "--")):
                pts = sorted(
                    (r["concurrency"], r["vs_off"])
                    for r in t["concurrency"]
                    if r["method"] == m and r["policy"] == policy
                )
                if pts:
                    color = f"C{METHODS.index(m)}"
                    ax.plot(
                        *zip(*pts, strict=True),
                        style,
                        marker="o",
                        color=color,
                        label=f"{_sweep_label(m)} {policy}",
                    )
        ax.axhline(1.0, color="gray", lw=1)
        ax.set_xscale("log", base=2)
        ax.set(
            xlabel="concurrent requests",
            ylabel="throughput vs off",
            title=f"{t['target']}: {t['concurrency_workload']}, T=0",
        )
        ax.grid(alpha=0.3)
        _legend(ax)
    fig.tight_layout()
    path = out / "speedup_vs_concurrency.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _sweep_label(method: str) -> str:
    """A method's name in the concurrency sweep, whose clients cycle through the prompts: there
    suffix decoding learns nothing from earlier answers (see `bench.serve.closed_loop`)."""
    return "suffix (no corpus)" if method == "suffix" else method


def _legend(ax) -> None:
    """A legend where something was drawn (none for a target with no rows of the kind)."""
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)


def _mean(xs: list) -> float:
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else float("nan")


def _reference_list(text: str) -> str:
    """`--references`: a comma list of transformers, llamacpp (llama.cpp, as the reports name
    it, reads the same); empty for none."""
    if not text.strip():
        return ""
    names = name_list(("transformers", "llamacpp", "llama.cpp"), "reference")(text)
    return names.replace("llama.cpp", "llamacpp")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--targets",
        default="smollm2-135m",
        help=f"comma list of {', '.join(TARGETS)} (the Qwen pair when pulled)",
    )
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument(
        "--method-config",
        action="append",
        metavar="METHOD=JSON",
        help="override a method's config, e.g. eagle3='{\"num_speculative_tokens\": 3}'",
    )
    p.add_argument("--draft-model", default=None, help="draft model for the SmolLM2 target")
    p.add_argument("--workloads", type=workload_list, default=",".join(workloads.WORKLOADS))
    p.add_argument("--temperatures", type=temperatures, default="0,0.7,1.0,1.2")
    p.add_argument("--num-prompts", type=at_least(1), default=3)
    p.add_argument("--max-tokens", type=at_least(2), default=64)
    p.add_argument(
        "--max-prompt-tokens", type=at_least(1), default=2048, help="longer prompts keep their end"
    )
    p.add_argument(
        "--concurrency", type=level_list, default="1,4,16", help="levels; empty: skip the sweep"
    )
    p.add_argument("--concurrency-workload", default="json", choices=list(workloads.WORKLOADS))
    p.add_argument(
        "--concurrency-policies",
        type=name_list(("off", "static", "adaptive"), "policy"),
        default="static,adaptive",
        help="plain decoding (off) runs at every level anyway",
    )
    p.add_argument(
        "--min-requests", type=at_least(1), default=8, help="requests per level at least"
    )
    p.add_argument(
        "--references",
        type=_reference_list,
        default="transformers,llamacpp",
        help="comma list of transformers, llamacpp (or llama.cpp); empty: none",
    )
    p.add_argument("--qwen-dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    p.add_argument(
        "--out", type=output_dir, default="bench-suite", help="directory for JSON, Markdown, PNGs"
    )
    p.add_argument("--report", type=output_file, default=None, help="also write this BENCHMARKS.md")
