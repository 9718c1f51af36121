"""docs/BENCHMARKS.md from a `bench suite` run (and, when present beside it, an `advise`
validation run): the tables, the plots, the command and the machine, and a section that sets
this run's numbers against the figures that motivate the project (the "seed"):

- speedups of 3x-5.6x and tau 3.5-4.8 for trained heads (EAGLE-2/3 papers);
- acceptance above 85% and 4x+ on structured output (code, JSON, SQL);
- acceptance near 50% and 1.8-2.2x on open conversation at temperature >= 1;
- a net loss below ~30% acceptance;
- a concurrency boundary: -10-15% throughput at >= 128 concurrent requests on GPUs.

Every verdict is computed from the rows, so a rerun rewrites it.
"""

from __future__ import annotations

import datetime
import json
import os
from pathlib import Path

from specdecode.bench.suite import METHODS, markdown

STRUCTURED = ("code", "sql", "json")


def _spec_rows(t: dict) -> list[dict]:
    return [r for r in t["rows"] if r["method"] not in ("off",) and not r.get("reference")]


HEADS = ("draft_model", "medusa", "eagle", "eagle3")  # what the 3x-5.6x figures are about


def _verdict(*checks: bool) -> str:
    return "agrees" if all(checks) else "partly agrees" if any(checks) else "disagrees"


def seed_comparison(result: dict) -> list[str]:
    """One bullet per seed figure: what this run measured, and agrees / partly / disagrees."""
    out = []
    for t in result["targets"]:
        rows = _spec_rows(t)
        if not rows:
            continue
        name = t["target"]
        heads = [r for r in rows if r["method"] in HEADS]
        if heads:
            best = max(heads, key=lambda r: r["speedup"])
            top_tau = max(heads, key=lambda r: r["tau"])
            out.append(
                f"**Speedup 3x-5.6x, tau 3.5-4.8 with a trained drafter** ({name}): "
                f"{_verdict(best['speedup'] >= 3, top_tau['tau'] >= 3.5)}. Best "
                f"{best['speedup']:.2f}x ({best['method']}, {best['workload']}, "
                f"T={best['temperature']:g}); highest tau {top_tau['tau']:.2f} "
                f"({top_tau['method']}, {top_tau['workload']}, T={top_tau['temperature']:g})."
            )
        best_any = max(rows, key=lambda r: r["speedup"])
        out.append(
            ("  " if heads else "")  # (below the heads' bullet where there is one)
            + f"Best of any method on {name}: {best_any['speedup']:.2f}x ({best_any['method']}, "
            f"{best_any['workload']}, T={best_any['temperature']:g})."
        )
        # a cell that drafted nothing has no acceptance to judge (older runs did not say)
        idle = [r for r in rows if r.get("draft_tokens") == 0]
        judged = [r for r in rows if r.get("draft_tokens") != 0]
        structured = [r for r in judged if r["workload"] in STRUCTURED and r["temperature"] == 0]
        if structured:
            s = max(structured, key=lambda r: r["acceptance_rate"])
            fast = max(structured, key=lambda r: r["speedup"])
            out.append(
                f"**>85% acceptance and 4x+ on structured output** ({name}, code/SQL/JSON at "
                f"T=0): {_verdict(s['acceptance_rate'] > 0.85, fast['speedup'] >= 4)}. Best "
                f"acceptance {s['acceptance_rate']:.0%} ({s['method']} on {s['workload']}"
                + (f", {s['draft_tokens']} drafted tokens" if s.get("draft_tokens") else "")
                + "); "
                f"best speedup {fast['speedup']:.2f}x ({fast['method']} on {fast['workload']}); "
                f"mean acceptance by method: {_per_method(structured, 'acceptance_rate')}."
            )
        chat = [r for r in judged if r["workload"] == "chat" and r["temperature"] >= 1.0]
        if chat:
            acc = _per_method(chat, "acceptance_rate")
            spd = _per_method(chat, "speedup", fmt="{:.2f}x")
            best = max(chat, key=lambda r: r["speedup"])
            out.append(
                f"**~50% acceptance and 1.8-2.2x on open chat at T>=1** ({name}): "
                f"{_verdict(0.4 <= best['acceptance_rate'] <= 0.6, best['speedup'] >= 1.8)} "
                f"(judged on the fastest method, {best['method']}: "
                f"{best['acceptance_rate']:.0%}, {best['speedup']:.2f}x). Mean acceptance by "
                f"method {acc}; mean speedup {spd}."
            )
        low = [r for r in judged if r["acceptance_rate"] < 0.3]
        if low:
            losing = sum(r["speedup"] < 1 for r in low)
            verdict = (
                "agrees"
                if losing == len(low)
                else "mostly agrees"
                if losing > len(low) / 2
                else "disagrees"
            )
            out.append(
                f"**Net loss below ~30% acceptance** ({name}): {verdict}. {losing} of {len(low)} "
                "method/workload/temperature cells under 30% acceptance were slower than plain "
                "decoding (acceptance here is accepted / drafted tokens, so wide trees sit low "
                "even when they pay)."
            )
        if idle:
            out.append(
                f"  {len(idle)} method/workload/temperature cells drafted nothing: they are left "
                "out of the acceptance verdicts above and below."
            )
        above = [r for r in judged if r["acceptance_rate"] >= 0.3]
        if above:
            lost = [r for r in above if r["speedup"] < 1]
            out.append(
                f"  At or above 30% acceptance, {len(lost)} of {len(above)} cells were slower "
                "than plain decoding: where the break-even lies depends on what a speculative "
                "step costs against a plain one on the machine."
            )
        conc = [r for r in t.get("concurrency", []) if r["method"] != "off"]
        if conc:
            parts, first_loss = [], []
            for m in dict.fromkeys(r["method"] for r in conc):
                st = sorted(
                    (r for r in conc if r["method"] == m and r["policy"] == "static"),
                    key=lambda r: r["concurrency"],
                )
                ad = [r for r in conc if r["method"] == m and r["policy"] == "adaptive"]
                part = m + ":"
                if st:
                    neg = next((r["concurrency"] for r in st if r["vs_off"] < 1), None)
                    if neg is not None and st[0]["vs_off"] >= 1:  # paid at first, then lost
                        first_loss.append(neg)
                    part += " static " + (
                        f"loses from concurrency {neg}" if neg else "never loses in this sweep"
                    )
                    part += f" ({st[-1]['vs_off']:.2f}x at {st[-1]['concurrency']})"
                if ad:
                    worst = min(ad, key=lambda r: r["vs_off"])
                    part += f", adaptive worst {worst['vs_off']:.2f}x at {worst['concurrency']}"
                parts.append(part)
            top = max(r["concurrency"] for r in conc)
            if first_loss and min(first_loss) < 128:
                where = (
                    "where static speculation pays at the lowest concurrency, it starts losing "
                    f"at concurrency {min(first_loss)} here, below 128: on this machine a few "
                    "sequences already make a step compute-bound"
                )
            elif not any(r["vs_off"] >= 1 for r in conc if r["policy"] == "static"):
                where = "no method paid under static speculation at any level measured"
            elif top < 128:
                where = f"this sweep stops at {top}, below the reported boundary"
            else:
                where = "static speculation did not lose below 128 here"
            out.append(
                f"**Concurrency boundary (-10-15% at >= 128 on GPUs)** ({name}): {where}. "
                + "; ".join(parts)
                + "."
            )
    return out


def _per_method(rows: list[dict], key: str, fmt: str = "{:.0%}") -> str:
    by: dict[str, list[float]] = {}
    for r in rows:
        by.setdefault(r["method"], []).append(r[key])
    return ", ".join(
        f"{m} {fmt.format(sum(v) / len(v))}"
        for m, v in sorted(by.items(), key=lambda kv: METHODS.index(kv[0]))
    )


def _references(result: dict) -> list[str]:
    out = []
    for t in result["targets"]:
        refs: dict[str, list[float]] = {}
        for r in t["rows"]:
            if r.get("reference"):
                refs.setdefault(r["method"], []).append(r["vs_off"])
        for name, v in refs.items():
            out.append(
                f"{t['target']}: {name} runs at {sum(v) / len(v):.2f}x specdecode's plain "
                f"decoding on the same prompts, end to end with prefill (mean over {len(v)} "
                "workload/temperature cells)."
            )
        for name, why in t.get("references_skipped", {}).items():
            out.append(f"{t['target']}: {name} not run: {why}.")
    return out


def write_report(
    runs: list[tuple[dict, Path]], path: Path, advise: dict | None = None, advise_path=None
) -> None:
    """BENCHMARKS.md from one or more suite runs (result, its output directory), e.g. the
    full matrix on the default model and a smaller one on the Qwen pair, plus an optional
    `advise --validate` result."""
    path.parent.mkdir(parents=True, exist_ok=True)
    runs = _labelled(runs)
    merged = {"targets": [t for r, _ in runs for t in r["targets"]]}
    when = datetime.date.today().isoformat()
    commands = "\n".join(r["command"].strip() for r, _ in runs)
    if advise and advise.get("command"):
        commands += "\n" + advise["command"].strip()
    minutes = round(sum(r.get("seconds", 0) for r, _ in runs) / 60)
    spent = "under a minute" if minutes < 1 else f"{minutes} minute{'s' * (minutes != 1)}"
    references = [f"- {x}" for r, _ in runs for x in _references(r)]
    lines = [
        "# Benchmarks",
        "",
        f"Generated on {when} from the runs below ({spent} of measurement) on "
        f"{runs[0][0]['machine']}. Every ratio compares runs made side by side in one run. "
        "To regenerate this page, run these and then `specdecode bench report` with their "
        "output directories (the last line):",
        "",
        "```bash",
        commands,
        "specdecode bench report "
        + " ".join(str(d) for _, d in runs)
        + (f" --advise {advise_path or 'ADVISE.json'}" if advise else "")
        + f" --out {path}",
        "```",
        "",
        "## How speculation fares against the seed's figures",
        "",
        *[f"- {b}" if not b.startswith("  ") else b for b in seed_comparison(merged)],
        "",
        f"The machine: {runs[0][0]['machine']}. The heads shipped for the default target "
        "(SmolLM2-135M) were trained in about 5 minutes of one GPU on 1.4M answer tokens, about "
        "1/100 of the data of the EAGLE papers (see the README), which bounds their acceptance.",
        "",
        "Acceptance and tau of a seeded run are reproducible; tok/s of one cell (a few prompts) "
        "varies from run to run on a shared VM, so single cells near 1.0x are not significant.",
        "",
        *(["## References on the same prompts", "", *references, ""] if references else []),
    ]
    if advise:
        title = "prediction against measurement" if advise.get("validation") else "advice"
        lines += [
            f"## `specdecode advise`: {title}",
            "",
            "```",
            advise["text"],
            "```",
            "",
        ]
    for r, d in runs:
        rel = os.path.relpath(d, path.parent)
        names = ", ".join(t["target"] for t in r["targets"]) or "no target"
        lines += [f"## Results: {names}", "", f"`{r['command'].strip()}`", ""]
        lines += [
            f"![speedup against concurrency]({rel}/speedup_vs_concurrency.png)"
            if any(t["concurrency"] for t in r["targets"])
            else "",
            f"![acceptance against temperature]({rel}/acceptance_vs_temperature.png)",
            f"![tau per workload]({rel}/tau_per_workload.png)",
            "",
            markdown(r),
        ]
    path.write_text("\n".join(lines) + "\n")


def _labelled(runs: list[tuple[dict, Path]]) -> list[tuple[dict, Path]]:
    """Runs whose targets share a name (the same model measured twice) have each such target
    named with its run's folder, in every bullet and heading."""
    from collections import Counter

    counts = Counter(t["target"] for r, _ in runs for t in r["targets"])
    out = []
    for r, d in runs:
        targets = [
            {**t, "target": f"{t['target']} ({d.name or d})"} if counts[t["target"]] > 1 else t
            for t in r["targets"]
        ]
        out.append(({**r, "targets": targets}, d))
    return out


def _read_json(path: Path):
    from specdecode.errors import InvalidRequestError

    try:
        return json.loads(path.read_text())
    except OSError as e:
        raise InvalidRequestError(f"{path}: cannot read it ({e.strerror})") from None
    except json.JSONDecodeError as e:
        raise InvalidRequestError(f"{path} is not valid JSON ({e.msg})") from None


def run_report(args) -> None:
    from specdecode.errors import InvalidRequestError

    runs, seen = [], set()
    for d in args.runs:
        if Path(d).resolve() in seen:
            raise InvalidRequestError(f"{d} is given twice: name each run's folder once")
        seen.add(Path(d).resolve())
        f = Path(d) / "suite.json"
        if not f.is_file():
            raise InvalidRequestError(f"{f} not found: give directories written by bench suite")
        run = _read_json(f)
        if not isinstance(run, dict) or "targets" not in run or "command" not in run:
            raise InvalidRequestError(f"{f} is not a `bench suite` result")
        runs.append((run, Path(d)))
    advise = _read_json(Path(args.advise)) if args.advise else None
    if advise is not None and (not isinstance(advise, dict) or "text" not in advise):
        raise InvalidRequestError(f"{args.advise} is not an `advise --json` result")
    write_report(runs, Path(args.out), advise, args.advise)
    print(f"wrote {args.out}")
