"""`specdecode bench quantization`: what quantizing the target buys and costs, measured side by
side in one process.

Each setting (`fp32`, `bf16`: the weights as loaded in that dtype; `int8`, `int4`: the target's
projections and LM head packed so, see EngineConfig.quantization) is its own engine on the same
model. Speed: batch-1 greedy decode tok/s per prompt, (n - 1) / (t(n) - t(1)) as `bench
latency` measures it, the settings interleaved prompt by prompt in each round (a VM's speed
drifts within minutes; the order rotates from round to round), the median of the rounds.
Quality: fp32's greedy replies (to their end of sequence, or the token limit) are fed back
through each setting (`prompt_logprobs`, teacher-forced): the share of their tokens that the
setting ranks first (top-1 agreement), and its mean negative log-likelihood of them (fp32's
own is the reference), plus where each setting's own greedy reply first departs from fp32's.
"""

from __future__ import annotations

import argparse
import json
import statistics

from specdecode.argtypes import at_least, name_list, output_file
from specdecode.bench import workload_list

SETTINGS = {
    "fp32": {"dtype": "float32", "quantization": None},
    "bf16": {"dtype": "bfloat16", "quantization": None},
    "int8": {"dtype": "float32", "quantization": "int8"},
    "int4": {"dtype": "float32", "quantization": "int4"},
}


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--settings",
        type=name_list(tuple(SETTINGS), "setting"),
        default=",".join(SETTINGS),
        help="what to compare, against fp32 (always run): fp32,bf16,int8,int4 (default: all; "
        "--dtype and --quantization are set by each setting)",
    )
    p.add_argument(
        "--workloads", type=workload_list, default="chat,code", help="prompt sets (bench workloads)"
    )
    p.add_argument("--num-prompts", type=at_least(1), default=3, help="prompts per workload")
    p.add_argument("--max-tokens", type=at_least(2), default=64)
    p.add_argument("--rounds", type=at_least(1), default=3, help="speed rounds (median)")
    p.add_argument(
        "--json", type=output_file, default=None, help="also write the results to this JSON file"
    )


def run_quantization_bench(args: argparse.Namespace) -> dict:
    from specdecode import LLM, SamplingParams, kernels
    from specdecode.bench import machine, workloads
    from specdecode.bench.latency import _decode_rate, greedy_decoder
    from specdecode.cli import engine_kwargs

    names = ["fp32", *[s for s in args.settings.split(",") if s != "fp32"]]
    skipped = []
    if "int4" in names and not kernels.int4_ready():  # (before any engine loads)
        names.remove("int4")
        skipped.append("int4 (needs AVX512_VNNI)")
        print("specdecode: int4 needs AVX512_VNNI here: left out", flush=True)
    prompts = [m for w in args.workloads.split(",") for m in workloads.load(w, args.num_prompts)]
    kwargs = {**engine_kwargs(args, default_policy="off"), "speculative_config": None}
    engines = {n: LLM(args.model, **{**kwargs, **SETTINGS[n]}) for n in names}
    ids = [engines["fp32"]._chat_ids(m) for m in prompts]
    greedy = SamplingParams(temperature=0, max_tokens=args.max_tokens)  # (to EOS, or the limit)
    decoders = {n: greedy_decoder(engines[n]) for n in names}

    rates: dict[str, list[float]] = {n: [] for n in names}
    for r in range(args.rounds):  # interleaved: each prompt through every setting in turn
        per_round: dict[str, list[float]] = {n: [] for n in names}
        order = names[r % len(names) :] + names[: r % len(names)]  # (rotated each round)
        for p in ids:
            for n in order:
                per_round[n].append(_decode_rate(decoders[n], p, args.max_tokens, 1))
        for n in names:
            rates[n].append(statistics.mean(per_round[n]))

    def reply(llm, p):
        return list(llm.generate({"prompt_token_ids": p}, greedy)[0].outputs[0].token_ids)

    reference = [reply(engines["fp32"], p) for p in ids]
    result = {
        "model": str(engines["fp32"].engine.model_path.name),
        "machine": machine(),
        # int8 multiplies int8 activations (vpdpbusd) as kernels.pack sets it up: on
        # AVX512_VNNI, unless SPECDECODE_INT8_DOT=0; else its weights alone are int8
        "int8_activations": kernels.int8_dot_enabled(),
        "skipped": skipped,
        "prompts": len(ids),
        "max_tokens": args.max_tokens,
        "rounds": args.rounds,
        "settings": {},
    }
    fp32_rate = statistics.median(rates["fp32"])
    for n in names:
        llm = engines[n]
        hits, nll, tokens = 0, 0.0, 0
        for p, out in zip(ids, reference, strict=True):
            scored = llm.generate({"prompt_token_ids": p + out},
                                  SamplingParams(temperature=0, max_tokens=1,
                                                 prompt_logprobs=0))[0]  # fmt: skip
            for tok, entry in zip(out, scored.prompt_logprobs[len(p) :], strict=True):
                hits += entry[tok].rank == 1
                nll -= entry[tok].logprob
                tokens += 1
        own = [reply(llm, p) for p in ids] if n != "fp32" else reference
        departs = [
            next(
                (k for k, (a, b) in enumerate(zip(r, o, strict=False)) if a != b),
                min(len(r), len(o)),
            )
            for r, o in zip(reference, own, strict=True)
        ]
        rate = statistics.median(rates[n])
        result["settings"][n] = {
            "tok_s": rate,
            "tok_s_rounds": rates[n],
            "speedup_vs_fp32": rate / fp32_rate,
            "top1_agreement": hits / max(tokens, 1),  # (no tokens: replies that ended at once)
            "mean_nll": nll / max(tokens, 1),
            "first_departure": departs,
        }
    result["reference_tokens"] = sum(len(r) for r in reference)
    _print(result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


def _print(r: dict) -> None:
    print(f"model {r['model']}: {r['prompts']} prompts, {r['max_tokens']} tokens, batch 1, "
          f"greedy; quality against fp32's replies ({r['reference_tokens']} tokens); "
          f"{r['machine']}")  # fmt: skip
    print(f"  {'setting':<8} {'tok/s':>8} {'vs fp32':>8} {'top-1':>7} {'NLL':>7}  first departure")
    for n, s in r["settings"].items():
        print(f"  {n:<8} {s['tok_s']:8.1f} {s['speedup_vs_fp32']:7.2f}x "
              f"{100 * s['top1_agreement']:6.1f}% {s['mean_nll']:7.3f}  "
              f"{s['first_departure']}")  # fmt: skip
