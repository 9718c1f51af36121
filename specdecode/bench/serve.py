"""`specdecode bench serve`: a concurrency sweep of the serving engine for the speculative
policies off / static / adaptive, on the same prompts, in one run, on one loaded engine.

At each concurrency c, c closed-loop clients keep one request each in flight (a client sends
its next request when the previous one finishes) until `max(2c, --min-requests)` requests are
done. Each policy runs the same requests. Throughput is taken over the steady state: from the
first completion until the last request is sent, while all c clients are busy and prefills
interleave with decoding (the start, every prompt prefilled at once, and the drain, with fewer
and fewer requests in flight, are not the level's load).
Reported per (c, policy): output throughput (tok/s),
mean time per output token after the first (TPOT: (end - first token) / (tokens - 1), per
request), the mean gap between a request's streamed updates after the first (ITL, as vLLM's
benchmark counts it: under speculation an update can carry several tokens, so ITL is above TPOT
there), median time to first token, acceptance, and for adaptive the share of decoding steps it
chose to draft. Where one policy at a level leaves no steady state to time (see `_steady`),
every policy at that level is timed over its whole run, so their ratios compare like with like.
Results are written after every row: a failure or Ctrl-C keeps the levels measured. The
engine runs in-process behind the same `AsyncLLMEngine` the HTTP server uses, so the numbers are
the engine's, not the HTTP stack's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import statistics
import threading
import time
from pathlib import Path

from specdecode.argtypes import name_list, temperature
from specdecode.bench import at_least, level_list, machine, output_dir, workloads
from specdecode.errors import SpecDecodeError
from specdecode.sampling import SamplingParams

log = logging.getLogger(__name__)

POLICIES = ("off", "static", "adaptive")


async def _level(engine, request, concurrency: int, n_requests: int) -> dict:
    if concurrency < 1:
        raise ValueError("a concurrency level must be >= 1")
    sem = asyncio.Semaphore(concurrency)
    rows = []

    async def one(ids: list[int], request_params: SamplingParams) -> None:
        async with sem:
            t0 = time.perf_counter()
            first, n, timeline = None, 0, []  # (time, output tokens so far) per update
            async for u in engine.generate(ids, request_params):
                if u.error:
                    raise BenchError(f"a request failed at concurrency {concurrency}: {u.error}")
                now = time.perf_counter()
                if u.token_ids and first is None:
                    first = now
                n = u.num_output_tokens
                timeline.append((now, n))
            rows.append((t0, first or time.perf_counter(), time.perf_counter(), n, timeline))

    start, cpu0 = time.perf_counter(), time.process_time()
    await asyncio.gather(*(one(*request(i)) for i in range(n_requests)))
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu0
    tokens = sum(r[3] for r in rows)
    timed = _steady(rows, concurrency)
    steady, window = timed or (tokens, wall)  # none: the whole run
    tpot = [(end - first) / (n - 1) for _, first, end, n, _ in rows if n > 1]
    gaps = []  # between the updates that brought tokens, after each request's first
    for *_, timeline in rows:
        times, before = [], 0
        for t, k in timeline:
            if k > before:
                times.append(t)
                before = k
        gaps += [b - a for a, b in zip(times, times[1:], strict=False)]
    return {
        "requests": n_requests,
        "output_tokens": tokens,
        "seconds": wall,
        "steady_seconds": window,
        # what the throughput is over: "steady state", or "whole run" where a level's requests
        # leave no steady state worth the name (see _steady)
        "timed_over": "steady state" if timed else "whole run",
        "throughput_tok_s": steady / window,
        # the whole run's tokens per second of this process's CPU time (every thread): on a
        # CPU engine the work itself, which a busy or shared host often disturbs less than wall
        # time (not always); the same requests run under every policy, so its ratios compare
        # their costs
        "cpu_seconds": cpu,
        "tok_per_cpu_s": tokens / cpu if cpu > 0 else None,
        # requests in flight on average over the whole run, drain included
        "mean_in_flight": sum(end - t0 for t0, _, end, _, _ in rows) / wall,
        "tpot_ms": 1000 * statistics.mean(tpot) if tpot else None,
        "itl_ms": 1000 * statistics.mean(gaps) if gaps else None,
        "ttft_p50_ms": 1000 * statistics.median(first - t0 for t0, first, _, _, _ in rows),
    }


def _steady(rows: list[tuple], concurrency: int) -> tuple[int, float] | None:
    """(output tokens, seconds) of a level's steady state: from the first completion (its
    client sends the next request at once: from then on the loop cycles, prefills interleaved
    with decoding) to the last send (after it fewer and fewer requests are in flight). All
    `concurrency` clients are busy throughout; the start, every prompt prefilled at once before
    any token, and the drain are left out. None where there is no such window (no more
    requests than clients) or it holds under STEADY_SHARE of the run's tokens: a few requests
    that finish together leave a window of microseconds, whose tokens over its length is no
    throughput at all. `rows`: (sent, first token, end, tokens, [(time, tokens so far), ...])
    per request."""
    sends = sorted(r[0] for r in rows)
    if len(sends) <= concurrency:
        return None
    begin, end = sends[concurrency], sends[-1]

    def at(timeline, t: float) -> int:
        return max((k for s, k in timeline if s <= t), default=0)

    tokens = sum(at(r[4], end) - at(r[4], begin) for r in rows)
    enough = tokens > 0 and tokens >= STEADY_SHARE * sum(r[3] for r in rows)
    return (tokens, end - begin) if end > begin and enough else None


# The least share of a level's output tokens its steady state must hold to be timed alone
# (2c requests of lengths 0.5x-1.5x the mean put about half of them there).
STEADY_SHARE = 0.25


def _whole_level(rows: list[dict], c: int) -> bool:
    """Where a row at concurrency c had no steady state to time, time every row at c over its
    whole run (a ratio of a steady window to a whole run, start and drain included, compares
    two different things); True if it did so."""
    level = [r for r in rows if r["concurrency"] == c]
    if not any(r["timed_over"] == "whole run" for r in level):
        return False
    for r in level:
        if r["timed_over"] != "whole run":
            r.update(timed_over="whole run", steady_seconds=r["seconds"],
                     throughput_tok_s=r["output_tokens"] / r["seconds"])  # fmt: skip
    return True


class BenchError(SpecDecodeError):
    """A request of the sweep failed (the rows measured before it are kept)."""


def concurrency_levels(text: str) -> list[int]:
    """`--concurrency 1,4,16` -> [1, 4, 16]; a bad or non-positive level is a user error."""
    from specdecode.errors import InvalidRequestError

    try:
        levels = [int(c) for c in text.split(",") if c.strip()]
    except ValueError:
        raise InvalidRequestError(f"--concurrency {text!r}: a comma list of integers") from None
    if not levels or min(levels) < 1:
        raise InvalidRequestError(f"--concurrency {text!r}: levels must be >= 1")
    return levels


def _length(params: SamplingParams, i: int) -> SamplingParams:
    """Request i's output length: 0.5x to 1.5x the mean, the same for every policy. Equal
    lengths would keep a closed loop in lockstep (all finish, all arrive, one big prefill), a
    pattern real traffic does not have and that speculation breaks, confounding the policies."""
    from dataclasses import replace

    mean = params.max_tokens
    return replace(params, max_tokens=max(1, mean // 2 + (i * 37) % (mean + 1)))


def _stats(core) -> tuple[int, ...]:
    s, c = core.spec_stats, core.controller
    return (
        s.num_drafts,
        s.num_draft_tokens,
        s.num_accepted_tokens,
        c.num_decisions,
        c.num_drafting,
        c.num_lite,
    )


def closed_loop(
    core,
    prompts: list[list[int]],
    levels: list[int],
    policies: list[str],
    params: SamplingParams | list[SamplingParams],
    min_requests: int,
    on_row=None,
    warmup: bool = True,
    repeat_off: bool = False,
    on_level=None,
) -> list[dict]:
    """For each concurrency c and each policy, c closed-loop clients over the engine `core`
    until max(2c, min_requests) requests are done (throughput over the steady state); one
    row per (c, policy), and with
    `repeat_off` a second "off" row after the other policies (drift and noise show as the
    difference between the two; ratios are taken against their mean). `params` is one
    SamplingParams (lengths then vary 0.5x-1.5x around its max_tokens) or one per prompt (used
    as given). The engine runs on the main thread, as `serve` runs it (see AsyncLLMEngine.run);
    the clients on a second one."""
    from specdecode.serving.async_engine import AsyncLLMEngine

    engine = AsyncLLMEngine(core)
    if core.drafter is not None:
        # the clients cycle through the prompts: a drafter learning from finished answers
        # (suffix decoding) would replay each repeated prompt's earlier answer, which measures
        # the repetition, not the method; it drafts from each request's own text here
        core.drafter.clear_history()
        core.drafter.learning = False

    def request(i: int) -> tuple[list[int], SamplingParams]:
        if isinstance(params, list):
            return prompts[i % len(prompts)], params[i % len(params)]
        return prompts[i % len(prompts)], _length(params, i)

    on_cpu = core.runner.device.type == "cpu"

    async def sweep() -> list[dict]:
        if warmup:  # kernels, caches, the controller's first estimates
            for policy in policies:
                core.set_policy(policy)
                await _level(engine, request, 2, 4)
        rows: list[dict] = []
        for c in levels:
            n = max(2 * c, min_requests)  # c more than the clients: a steady state to time
            again = ["off"] if repeat_off and "off" in policies and len(policies) > 1 else []
            for run, policy in enumerate(policies + again):
                core.set_policy(policy)
                before = _stats(core)
                row = {"concurrency": c, "policy": policy, "cpu_engine": on_cpu}
                if run >= len(policies):
                    row["repeat"] = True
                row.update(await _level(engine, request, c, n))
                diff = [a - b for a, b in zip(_stats(core), before, strict=True)]
                drafts, drafted, accepted, decisions, drafting, lite = diff
                row["drafting_share"] = drafting / decisions if decisions else None
                # of the decisions, lite drafts verified (a lookup branch without its drafter)
                row["lite_share"] = lite / decisions if decisions else None
                row["acceptance_rate"] = accepted / drafted if drafted else None
                row["tau"] = 1 + accepted / drafts if drafts else None
                rows.append(row)
                if on_row is not None:
                    on_row(row, rows)
            if _whole_level(rows, c) and on_level is not None:
                on_level(c, rows)
        return rows

    box: dict = {}

    def clients() -> None:
        try:
            box["rows"] = asyncio.run(sweep())
        except BaseException as e:  # noqa: BLE001 - re-raised on the main thread
            box["error"] = e
        finally:
            engine.shutdown()

    driver = threading.Thread(target=clients, name="bench-clients")
    driver.start()
    engine.run()
    driver.join()
    if "error" in box:
        raise box["error"]
    return box["rows"]


def run_serve_bench(args: argparse.Namespace) -> dict:
    from specdecode.cli import engine_kwargs, speculative_config
    from specdecode.config import EngineConfig
    from specdecode.engine.engine import LLMEngine
    from specdecode.errors import InvalidRequestError

    levels = concurrency_levels(args.concurrency)
    spec = speculative_config(args) or {"method": "ngram"}
    kwargs = {**engine_kwargs(args), "speculative_config": spec, "max_num_seqs": max(levels)}
    core = LLMEngine(EngineConfig(model=args.model, **kwargs))
    tok = core.tokenizer
    # a prompt over --max-prompt-tokens, or without room for the longest answer (1.5x the
    # mean) in the context, loses its middle: its start (the chat template's opening, a system
    # turn) and its end (the question, the generation prompt) stay
    longest = args.max_tokens + args.max_tokens // 2 + 1
    limit = min(args.max_prompt_tokens, core.max_model_len - longest)
    if limit < 8:
        raise InvalidRequestError(
            f"no room for a prompt: the context ({core.max_model_len}) less the longest answer "
            f"({longest}, 1.5x --max-tokens) leaves {limit} tokens"
        )
    prompts, cut = [], 0
    for messages in workloads.load(args.workload, args.num_prompts):
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = list(tok(text, add_special_tokens=False).input_ids)
        if len(ids) > limit:
            head = min(64, limit // 4)
            ids, cut = ids[:head] + ids[len(ids) - (limit - head) :], cut + 1
        prompts.append(ids)
    if cut:
        log.info("%d of %d prompts cut to %d tokens (their middle)", cut, len(prompts), limit)
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=0)
    policies = [p for p in args.policies.split(",") if p]
    if "adaptive" in policies:  # (what the adaptive policy decides from; the others need none)
        print(f"calibrating the step-cost curve ({core.spec_config.method}) ...", flush=True)
        core.calibrate(time_budget_s=20.0)
    result = {
        "model": core.model_path.name,
        "speculative_config": core.spec_config.__dict__,
        "workload": args.workload,
        "temperature": args.temperature,
        "max_tokens": args.max_tokens,
        "dtype": args.dtype,
        "quantization": getattr(args, "quantization", None),
        "machine": machine(),
        "complete": False,
        "rows": [],
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def save(rows: list[dict]) -> None:  # after every row: what was measured is kept
        result.update(rows=rows, summary=summarize(rows))
        tmp = out / "serve.json.tmp"
        tmp.write_text(json.dumps(result, indent=1))
        tmp.replace(out / "serve.json")

    def on_row(row: dict, rows: list[dict]) -> None:
        _print(row, rows)
        save(rows)

    def on_level(c: int, rows: list[dict]) -> None:
        print(f"c={c:<4} no steady state for every policy: all of them timed over the whole "
              "run (raise --min-requests)", flush=True)  # fmt: skip
        save(rows)

    try:
        rows = closed_loop(
            core, prompts, levels, policies, params, args.min_requests,
            on_row=on_row, repeat_off=args.repeat_off, on_level=on_level,
        )  # fmt: skip
    except (BenchError, KeyboardInterrupt) as e:
        n = len(result["rows"])
        kept = f"; the {n} rows measured before are in {out / 'serve.json'}" if n else ""
        if isinstance(e, KeyboardInterrupt):
            print(f"interrupted{kept}", flush=True)
            raise
        raise InvalidRequestError(f"{e}{kept}") from None
    result["complete"] = True
    save(rows)
    (out / "serve.md").write_text(markdown(result))
    plot(result, out / "serve.png")
    print(f"wrote {out / 'serve.json'}, {out / 'serve.md'}, {out / 'serve.png'}")
    print(result["summary"]["text"])
    return result


def _throughput(rows, c, policy, key: str = "throughput_tok_s") -> float | None:
    """Mean throughput of the runs of `policy` at concurrency c (plain decoding may run twice);
    `key` "tok_per_cpu_s": by CPU time."""
    got = [r.get(key) for r in rows if r["concurrency"] == c and r["policy"] == policy]
    got = [g for g in got if g is not None]
    return sum(got) / len(got) if got else None


def _off_spread(rows, c, key: str = "throughput_tok_s") -> float | None:
    """How far apart the two runs of plain decoding at concurrency c came out (relative)."""
    got = [r.get(key) for r in rows if r["concurrency"] == c and r["policy"] == "off"]
    got = [g for g in got if g is not None]
    return abs(got[1] - got[0]) / ((got[0] + got[1]) / 2) if len(got) == 2 else None


def _ratio(rows, c, policy, key: str = "throughput_tok_s") -> float | None:
    mine, off = _throughput(rows, c, policy, key), _throughput(rows, c, "off", key)
    return mine / off if mine is not None and off else None


def _by_cpu(rows) -> bool:
    """CPU-time ratios are reported for CPU engines (a GPU engine's host CPU time is not its
    work)."""
    return any(r.get("cpu_engine") and r.get("tok_per_cpu_s") for r in rows)


CPU = "tok_per_cpu_s"


def _print(row: dict, rows: list[dict]) -> None:
    r = _ratio(rows, row["concurrency"], row["policy"])
    c, cpu = row["concurrency"], _by_cpu([row])
    vs = f" ({r:.2f}x off" if r and row["policy"] != "off" else ""
    if vs and cpu and (rc := _ratio(rows, c, row["policy"], CPU)) is not None:
        vs += f"; {rc:.2f}x by CPU time"
    vs += ")" if vs else ""
    if row.get("repeat"):
        vs = f" (off again: runs {_off_spread(rows, c):.1%} apart"
        vs += f", {_off_spread(rows, c, CPU):.1%} by CPU time" if cpu else ""
        # the rows above were printed against the first run; the table uses both runs' mean
        mean = [(p, _ratio(rows, c, p)) for p in dict.fromkeys(r["policy"] for r in rows
                if r["concurrency"] == c and r["policy"] != "off")]  # fmt: skip
        mean = [f"{p} {v:.2f}x" for p, v in mean if v is not None]
        vs += f"; against their mean: {', '.join(mean)})" if mean else ")"
    acc = f" acc {row['acceptance_rate']:.0%}" if row["acceptance_rate"] is not None else ""
    if row.get("drafting_share") is not None:
        acc += f", drafting {row['drafting_share']:.0%} of decisions"
        if row.get("lite_share"):
            acc += f" (lite drafts verified on {row['lite_share']:.0%})"
    print(
        f"c={row['concurrency']:<4} {row['policy']:<9} {row['throughput_tok_s']:7.1f} tok/s{vs}"
        f"  tpot {row['tpot_ms'] or 0:6.1f} ms  ttft {row['ttft_p50_ms']:7.0f} ms{acc}",
        flush=True,
    )


def summarize(rows: list[dict]) -> dict:
    levels = sorted({r["concurrency"] for r in rows})
    out: dict = {}
    lines = []
    spreads = {c: v for c in levels if (v := _off_spread(rows, c)) is not None}
    for policy in ("static", "adaptive"):
        ratios = {c: _ratio(rows, c, policy) for c in levels}
        ratios = {c: v for c, v in ratios.items() if v is not None}
        if not ratios:
            continue
        out[policy] = ratios
        worst, first = min(ratios, key=ratios.get), min(ratios)  # (rows so far: any level)
        lines.append(
            f"{policy}: {ratios[first]:.2f}x off at concurrency {first}, worst "
            f"{ratios[worst]:.2f}x at {worst}"
        )
        if policy == "static":
            # a loss is a ratio below plain decoding's own spread between its two runs (where
            # it ran twice): one inside it is a tie this run cannot tell apart
            negative = [c for c in levels if c in ratios and ratios[c] < 1.0 - spreads.get(c, 0)]
            ties = [c for c in levels if c in ratios and c not in negative and ratios[c] < 1.0]
            # "from c": a loss there and at every level above it; other losses are listed
            measured = [c for c in levels if c in ratios]
            tail = [c for i, c in enumerate(measured) if set(measured[i:]) <= set(negative)]
            out["static_negative_from"] = tail[0] if tail else None
            out["static_negative_at"] = negative
            at = ", ".join(map(str, negative))
            lines.append(
                f"static speculation loses to plain decoding from concurrency {tail[0]} on"
                + (
                    f" (and at {', '.join(str(c) for c in negative if c < tail[0])})"
                    if negative[0] < tail[0]
                    else ""
                )  # fmt: skip
                if tail
                else f"static speculation loses to plain decoding at concurrency {at} only"
                if negative
                else "static speculation never lost to plain decoding in this sweep"
                + (
                    f" (below 1.00x within plain decoding's run-to-run spread at "
                    f"{', '.join(map(str, ties))})"
                    if ties
                    else ""
                )
            )
    if _by_cpu(rows):
        cpu = {
            p: {c: v for c in levels if (v := _ratio(rows, c, p, CPU)) is not None}
            for p in ("static", "adaptive")
        }
        out["cpu_time"] = {p: v for p, v in cpu.items() if v}
        parts = [
            f"{p} " + ", ".join(f"{v:.2f}x at {c}" for c, v in r.items())
            for p, r in out["cpu_time"].items()
        ]
        if parts:
            lead = "by process CPU time (a second clock, often steadier on a shared host): "
            lines.append(lead + "; ".join(parts))
    if spreads:
        out["off_spread"] = spreads
        worst = max(spreads, key=spreads.get)
        lines.append(
            f"plain decoding, measured before and after the others at each level: its two runs "
            f"{max(spreads.values()):.1%} apart at most (at {worst}), the noise floor of these "
            f"ratios, which are against the mean of the two"
        )
    whole = sorted({r["concurrency"] for r in rows if r.get("timed_over") == "whole run"})
    if whole:
        out["whole_run_levels"] = whole
        lines.append(
            f"concurrency {', '.join(map(str, whole))}: timed over the whole run, start and "
            "drain included (too few requests per client for a steady state: raise "
            "--min-requests)"
        )
    out["text"] = "\n".join(lines)
    return out


def markdown(result: dict) -> str:
    rows = result["rows"]
    levels = sorted({r["concurrency"] for r in rows})
    by = {(r["concurrency"], r["policy"]): r for r in rows if not r.get("repeat")}
    policies = [p for p in POLICIES if any(r["policy"] == p for r in rows)]
    repeated = any(r.get("repeat") for r in rows)
    cpu = _by_cpu(rows)
    head = "| concurrency | " + " | ".join(f"{p} tok/s" for p in policies)
    head += " | static vs off | adaptive vs off | TPOT off / adaptive (ms) | adaptive drafted |"
    head += " static / adaptive vs off, CPU time |" if cpu else ""
    head += " off runs apart |" if repeated else ""
    lines = [head, "|" + "---|" * (len(policies) + 5 + cpu + repeated)]

    def fmt(v, spec: str) -> str:
        return "-" if v is None else format(v, spec)

    for c in levels:
        cells = [f"{_throughput(rows, c, p):.1f}" for p in policies]
        s, a = _ratio(rows, c, "static"), _ratio(rows, c, "adaptive")
        ad = by.get((c, "adaptive"))
        off_tpot = _throughput(rows, c, "off", "tpot_ms")  # (the mean of its runs)
        tpot = (
            f"{off_tpot:.1f} / {ad['tpot_ms']:.1f}"
            if off_tpot is not None and ad and ad["tpot_ms"] is not None
            else "-"
        )
        share, lite = (ad.get("drafting_share"), ad.get("lite_share")) if ad else (None, None)
        drafted = fmt(share, ".0%") + (f" (lite {lite:.0%})" if lite else "")
        cells += [fmt(s, ".2f") + "x" * (s is not None), fmt(a, ".2f") + "x" * (a is not None)]
        cells += [tpot, drafted]
        if cpu:
            sc, ac = _ratio(rows, c, "static", CPU), _ratio(rows, c, "adaptive", CPU)
            cells.append(fmt(sc, ".2f") + "x" * (sc is not None) + " / " + fmt(ac, ".2f")
                         + "x" * (ac is not None))  # fmt: skip
        if repeated:
            spread = fmt(_off_spread(rows, c), ".1%")
            if cpu and (sp := _off_spread(rows, c, CPU)) is not None:
                spread += f" ({sp:.1%} CPU)"
            cells.append(spread)
        lines.append(f"| {c} | " + " | ".join(cells) + " |")
    cfg = result["speculative_config"]
    return (
        f"Workload `{result['workload']}`, temperature {result['temperature']}, "
        f"{result['max_tokens']} output tokens per request on average (0.5x-1.5x), "
        f"{result['dtype']}, speculative "
        f"method `{cfg['method']}` (k={cfg['num_speculative_tokens']})"
        + (f"; {result['machine']}" if result.get("machine") else "")
        + ".\n\n"
        + "\n".join(lines)
        + "\n\n"
        + result["summary"]["text"]
        + "\n"
    )


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    levels = sorted({r["concurrency"] for r in rows})
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for policy in POLICIES:
        pts = [(c, v) for c in levels if (v := _throughput(rows, c, policy)) is not None]
        color = {"off": "C0", "static": "C1", "adaptive": "C2"}[policy]
        if pts:
            ax1.plot(*zip(*pts, strict=True), marker="o", label=policy, color=color)
        ratios = [(c, _ratio(rows, c, policy)) for c in levels]
        ratios = [(c, v) for c, v in ratios if v is not None]
        if policy != "off" and ratios:
            ax2.plot(*zip(*ratios, strict=True), marker="o", label=policy, color=color)
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent requests")
        ax.grid(alpha=0.3)
        ax.legend()
    ax1.set_ylabel("output tokens / s")
    ax2.set_ylabel("throughput vs off")
    ax2.axhline(1.0, color="gray", lw=1)
    ax2.axhline(0.97, color="gray", lw=1, ls="--")
    cfg = result["speculative_config"]
    fig.suptitle(f"{cfg['method']} on {result['workload']}, T={result['temperature']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


policy_list = name_list(POLICIES, "policy")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--concurrency", type=level_list, default="1,2,4,8,16,32,64,128,256")
    p.add_argument("--policies", type=policy_list, default="off,static,adaptive")
    p.add_argument("--workload", default="json", choices=list(workloads.WORKLOADS))
    p.add_argument("--num-prompts", type=at_least(1), default=64, help="distinct prompts, reused")
    p.add_argument("--max-prompt-tokens", type=at_least(1), default=512)
    p.add_argument(
        "--min-requests", type=at_least(1), default=8, help="requests per level at least"
    )
    p.add_argument(
        "--max-tokens", type=at_least(1), default=48, help="mean output tokens (0.5x-1.5x)"
    )
    p.add_argument("--temperature", type=temperature, default=0.0)
    p.add_argument(
        "--out", type=output_dir, default="bench-serve", help="directory for JSON, Markdown, PNG"
    )
    p.add_argument(
        "--repeat-off",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="measure plain decoding again after the other policies at each level and take "
        "ratios against the mean of its two runs (their spread is the noise floor)",
    )
