"""`specdecode bench latency --speculative-config ...`: batch-1 speculative decoding against plain
decoding of the same engine, per workload and temperature, next to transformers' own speculative
mode on the same prompts (prompt lookup for `ngram`, assisted generation for `draft_model`).

tok/s is tokens generated / wall time, prefill included; "decode only" subtracts each prompt's
time to its first token (prefill is the same work with and without speculation and dilutes the
ratio on long prompts). All measured in this run.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

import torch

from specdecode.bench import machine, workloads

log = logging.getLogger(__name__)


def run_speculative(args: argparse.Namespace) -> dict:
    """The engine's speculative config, plus any in `--compare` (a JSON list of configs), each
    against plain decoding measured in the same run on the same prompts."""
    from specdecode import LLM
    from specdecode.cli import engine_kwargs

    kwargs = engine_kwargs(args, default_policy="static")  # the drafter as configured
    llm = LLM(args.model, **kwargs)
    methods = [(_label(llm.engine.spec_config), llm)]
    for cfg in json.loads(args.compare) if getattr(args, "compare", None) else []:
        other = LLM(args.model, share_model_with=llm, **{**kwargs, "speculative_config": cfg})
        methods.append((_label(other.engine.spec_config), other))
    # plain decoding on an engine of its own (the same weights, no drafter): on a method's
    # engine with its policy off, a head's feature capture and catch-up would still run
    base = LLM(args.model, share_model_with=llm, **{**kwargs, "speculative_config": None})
    engine = llm.engine
    hf = _HFReference(llm, engine.spec_config) if not args.skip_transformers else None
    temps = [float(t) for t in args.temperatures.split(",")]
    rows = []
    for name in args.workloads.split(","):
        prompts = [llm._chat_ids(m) for m in workloads.load(name, args.num_prompts)]
        for temp in temps:
            # every prompt runs plain, then each method, before the next prompt: slow drifts of
            # the machine (seen here: +-20% over minutes) hit all of them alike
            plain, measured = _measure_interleaved(base, methods, prompts, temp, args.max_tokens)
            for (label, m), got in zip(methods, measured, strict=True):
                row = {"workload": name, "temperature": temp, "prompts": len(prompts)}
                row["method"] = label
                row["plain_tok_s"], row["plain_decode_tok_s"] = plain
                row["spec_tok_s"], row["spec_decode_tok_s"], stats, branch, drafting = got
                row["policy"] = m.engine.controller.policy
                row["drafting_fraction"], row["lite_fraction"] = drafting
                row.update(
                    speedup=row["spec_tok_s"] / row["plain_tok_s"],
                    decode_speedup=row["spec_decode_tok_s"] / row["plain_decode_tok_s"],
                    acceptance_rate=stats.acceptance_rate,
                    tau=stats.mean_acceptance_length,
                    acceptance_by_position=[
                        round(a / max(1, stats.num_drafts), 4) for a in stats.accepted_per_position
                    ],
                )
                if branch is not None:  # prompt_lookup_tokens: what the lookup branch added
                    row["lookup_branch"] = branch
                if hf is not None and m is llm:
                    row.update(hf.measure(prompts, temp, args.max_tokens))
                rows.append(row)
                _print_row(row)
    result = {
        "model": engine.model_path.name,
        "speculative_configs": [m.engine.spec_config.__dict__ for _, m in methods],
        "dtype": args.dtype,
        "quantization": getattr(args, "quantization", None),
        "machine": machine(),
        "max_tokens": args.max_tokens,
        "rows": rows,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


def _label(cfg) -> str:
    parts = [cfg.method]
    if cfg.topk and cfg.topk > 1:
        parts.append(f"tree k{cfg.topk}x{cfg.num_speculative_tokens}/{cfg.num_draft_tokens}")
    elif cfg.num_draft_tokens and cfg.topk != 1:
        parts.append(f"tree {cfg.num_draft_tokens}x{cfg.num_speculative_tokens}")
    elif cfg.speculative_token_tree:
        parts.append(f"tree {len(cfg.speculative_token_tree)}")
    else:
        parts.append(f"k={cfg.num_speculative_tokens}")
    if cfg.method == "suffix":
        if cfg.suffix_decoding_max_spec_factor != 1.0:
            parts.append(f"factor {cfg.suffix_decoding_max_spec_factor:g}")
        if cfg.suffix_decoding_max_cached_requests == 0:
            parts.append("no corpus")
    if cfg.prompt_lookup_tokens:
        source = "suffix" if cfg.prompt_lookup_method == "suffix" else "lookup"
        parts.append(f"+{source} {cfg.prompt_lookup_tokens}")
    if cfg.draft_dtype:
        parts.append(cfg.draft_dtype)
    if cfg.draft_vocab_size:
        parts.append(f"vocab {cfg.draft_vocab_size}")
    if cfg.token_map:
        parts.append(f"map {Path(cfg.token_map).name}")
    return " ".join(parts)


def _measure_interleaved(llm, methods, prompts, temp: float, max_tokens: int):
    """Plain decoding (on `llm`, which has no drafter) and every method, prompt by prompt:
    ((tok/s, decode tok/s) plain, [(tok/s, decode tok/s, SpecDecodeStats) per method])."""
    plain: list = []
    parts: list[list] = [[] for _ in methods]
    # A drafter that learns from finished answers (suffix decoding) starts each cell empty and
    # learns from its own measured requests only, after each is timed: the plain runs and the
    # warm-ups produce the answers of the prompts it is about to be measured on.
    for _, m in methods:
        _learning(m.engine, False)
        if m.engine.drafter is not None:
            m.engine.drafter.clear_history()
    _measure_one(llm, prompts[0], 0, temp, 8)  # one short request each first: one-off costs
    for _, m in methods:
        _measure_one(m, prompts[0], 0, temp, 8)
    before = [_copy_stats(m.engine) for _, m in methods]
    branch_before = [_branch_stats(m.engine) for _, m in methods]
    decisions_before = [_decisions(m.engine) for _, m in methods]
    for i, ids in enumerate(prompts):
        plain.append(_measure_one(llm, ids, i, temp, max_tokens))
        for j, (_, m) in enumerate(methods):
            _learning(m.engine, True)
            parts[j].append(_measure_one(m, ids, i, temp, max_tokens))
            _learning(m.engine, False)
    measured = [
        (*_rates(p), _diff_stats(m.engine, b), _branch_diff(m.engine, bb), _drafting(m.engine, d))
        for p, (_, m), b, bb, d in zip(
            parts, methods, before, branch_before, decisions_before, strict=True
        )
    ]
    return _rates(plain), measured


def _learning(engine, on: bool) -> None:
    if engine.drafter is not None:
        engine.drafter.learning = on


def _decisions(engine) -> tuple[int, int, int]:
    c = engine.controller
    return c.num_decisions, c.num_drafting, c.num_lite


def _drafting(engine, before: tuple[int, int, int]) -> tuple[float | None, float | None]:
    """The shares of (request, step) decisions since `before` that planned drafts, and that
    verified lite drafts (a head's lookup branch alone, where the lookup found a continuation):
    what an adaptive policy chose (None when nothing was decided)."""
    decided, drafted, lite = (a - b for a, b in zip(_decisions(engine), before, strict=True))
    return (drafted / decided, lite / decided) if decided else (None, None)


def _rates(parts) -> tuple[float, float]:
    """(tok/s including prefill, decode-only tok/s) from _measure_one results."""
    n, t, dn, dt = (sum(p[j] for p in parts) for j in range(4))
    return n / t, dn / max(dt, 1e-9)


def _measure_one(llm, ids, i: int, temp: float, max_tokens: int):
    """(tokens, seconds, decode tokens, decode seconds) of one prompt at batch 1. The first
    token's time is taken inside the same request (stepping the engine), so a one-off cost of
    the engine's first request or a prefix already cached cannot make decode time negative."""
    from specdecode import SamplingParams

    engine = llm.engine
    params = SamplingParams(temperature=temp, max_tokens=max_tokens, seed=i)
    t0 = time.perf_counter()
    seq = engine.add_request(list(ids), params, request_id=f"bench-{i}")
    first = None
    while not seq.finished:
        engine.step()
        if first is None and seq.output_token_ids:
            first = time.perf_counter()
    end = time.perf_counter()
    if seq.error:
        raise RuntimeError(f"benchmark request failed: {seq.error}")
    n = len(seq.output_token_ids)
    first = end if first is None else first
    return n, end - t0, n - 1, end - first


def _measure(llm, prompts, temp: float, max_tokens: int) -> tuple[float, float]:
    """(tok/s including prefill, decode-only tok/s) over the prompts, batch 1, after one short
    warm-up request."""
    _measure_one(llm, prompts[0], 0, temp, 8)
    return _rates([_measure_one(llm, ids, i, temp, max_tokens) for i, ids in enumerate(prompts)])


def _copy_stats(engine):
    from copy import deepcopy

    return deepcopy(engine.spec_stats)


def _branch_stats(engine) -> dict | None:
    stats = getattr(engine.drafter, "branch_stats", None)  # LookupBranchDrafter's BranchStats
    return stats.as_dict() if stats is not None else None


def _branch_diff(engine, before: dict | None) -> dict | None:
    now = _branch_stats(engine)
    if now is None or before is None:
        return None
    return {k: now[k] - before[k] for k in now}


def _diff_stats(engine, before):
    from specdecode.metrics import SpecDecodeStats

    now = engine.spec_stats

    def minus(a: list[int], b: list[int]) -> list[int]:
        return [x - (b[i] if i < len(b) else 0) for i, x in enumerate(a)]

    return SpecDecodeStats(
        now.num_drafts - before.num_drafts,
        now.num_draft_tokens - before.num_draft_tokens,
        now.num_accepted_tokens - before.num_accepted_tokens,
        minus(now.accepted_per_position, before.accepted_per_position),
        minus(now.drafted_per_position, before.drafted_per_position),
        now.drafted_levels - before.drafted_levels,
    )


def _print_row(r: dict) -> None:
    line = (
        f"{r['method']:<24} {r['workload']:<5} T={r['temperature']:<4} "
        f"plain {r['plain_tok_s']:6.1f} tok/s  "
        f"spec {r['spec_tok_s']:6.1f} tok/s  speedup {r['speedup']:.2f}x "
        f"(decode only: {r['plain_decode_tok_s']:.1f} -> {r['spec_decode_tok_s']:.1f} tok/s, "
        f"{r['decode_speedup']:.2f}x)  accept {100 * r['acceptance_rate']:4.0f}%  "
        f"tau {r['tau']:.2f}"
    )
    if r.get("policy") == "adaptive" and r.get("drafting_fraction") is not None:
        line += f"  (drafting planned on {100 * r['drafting_fraction']:.0f}% of steps"
        if r.get("lite_fraction"):
            line += f", lookup alone verified on {100 * r['lite_fraction']:.0f}%"
        line += ")"
    if "lookup_branch" in r:
        b = r["lookup_branch"]
        line += (
            f"  (lookup branch: {b['accepted']} tokens kept over {b['steps']} steps, "
            f"head skipped {b['head_skipped']}x)"
        )
    if "hf_speedup" in r:
        line += (
            f"  | transformers {r['hf_method']}: {r['hf_spec_tok_s']:.1f} vs "
            f"{r['hf_plain_tok_s']:.1f} tok/s = {r['hf_speedup']:.2f}x"
        )
    print(line, flush=True)


@torch.inference_mode()
def hf_rate(model, pad: int, prompts: list[list[int]], temp: float, max_tokens: int, **extra):
    """transformers `generate` tok/s over the prompts, batch 1, seeded per prompt."""
    total_n, total_t = 0, 0.0
    for i, ids in enumerate(prompts):
        torch.manual_seed(i)
        x = torch.tensor([ids], device=model.device)
        # the engine samples the full distribution: no top-k 50 (transformers' default)
        sample = {"temperature": temp, "top_k": 0, "top_p": 1.0} if temp > 0 else {}
        kw = {"do_sample": temp > 0, **sample}
        t = time.perf_counter()
        y = model.generate(
            x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=max_tokens,
            pad_token_id=pad,
            **kw,
            **extra,
        )
        if y.is_cuda:
            torch.cuda.synchronize(y.device)
        total_t += time.perf_counter() - t
        total_n += y.shape[1] - x.shape[1]
    return total_n / total_t


class _HFReference:
    """transformers `generate` on the same checkpoint, plain and with its speculative mode."""

    def __init__(self, llm, spec_cfg) -> None:
        import transformers
        from transformers import AutoModelForCausalLM

        from specdecode.engine.engine import resolve_dtype
        from specdecode.models.loader import resolve_model

        transformers.logging.set_verbosity_error()
        transformers.logging.disable_progress_bar()
        dtype = resolve_dtype(llm.engine.config.dtype)
        device = llm.engine.runner.device  # (the engine's: a fair baseline)
        self.model = (
            AutoModelForCausalLM.from_pretrained(str(llm.engine.model_path), dtype=dtype)
            .to(device)
            .eval()
        )
        self.pad = llm.tokenizer.eos_token_id
        self.k = spec_cfg.num_speculative_tokens
        self.extra: dict = {}
        if spec_cfg.method == "ngram":
            self.method = "prompt lookup"
            self.extra = {"prompt_lookup_num_tokens": self.k}
        elif spec_cfg.method == "draft_model":
            self.method = "assisted"
            # transformers has no int8 / int4 path here: its draft runs in the target's dtype then
            draft_dtype = resolve_dtype(spec_cfg.load_dtype or llm.engine.config.dtype)
            draft = (
                AutoModelForCausalLM.from_pretrained(
                    str(resolve_model(spec_cfg.model)), dtype=draft_dtype
                )
                .to(device)
                .eval()
            )
            # k drafts a step, as the engine's (transformers' default is 20, then a heuristic)
            draft.generation_config.num_assistant_tokens = self.k
            draft.generation_config.num_assistant_tokens_schedule = "constant"
            self.extra = {"assistant_model": draft}
        else:
            self.method = None

    @torch.inference_mode()
    def measure(self, prompts: list[list[int]], temp: float, max_tokens: int) -> dict:
        if self.method is None:
            return {}
        out = {"hf_method": self.method}
        for mode, extra in (("plain", {}), ("spec", self.extra)):
            hf_rate(self.model, self.pad, prompts[:1], temp, 4, **extra)  # warm-up, untimed
            out[f"hf_{mode}_tok_s"] = hf_rate(
                self.model, self.pad, prompts, temp, max_tokens, **extra
            )
        out["hf_speedup"] = out["hf_spec_tok_s"] / out["hf_plain_tok_s"]
        return out
