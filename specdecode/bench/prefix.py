"""`specdecode bench prefix`: what prefix caching saves on multi-turn chat, batch 1.

Workload: held-out ShareGPT conversations with several user turns. Turn t's prompt is the chat
template over the conversation's first t exchanges (the dataset's own assistant answers as
history) and its next user message, so each turn's prompt starts with the previous one's. Each
request runs alone, turn after turn, on two engines sharing one model: prefix caching off and
on, conversation by conversation in one run, with speculation if configured. Reported: time to
first token, end-to-end time, the share of prompt tokens found in the cache, whether the outputs
are token-identical, and tau with speculation (an EAGLE head sees no cached history).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from specdecode import data
from specdecode.bench import at_least, machine, output_file
from specdecode.errors import InvalidRequestError
from specdecode.sampling import SamplingParams


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-conversations", type=at_least(1), default=6)
    p.add_argument("--turns", type=at_least(2), default=3, help="user turns per conversation")
    p.add_argument("--max-prompt-tokens", type=at_least(2), default=1536)
    p.add_argument("--max-tokens", type=at_least(1), default=32)
    p.add_argument(
        "--json", type=output_file, default=None, help="also write the results to this JSON file"
    )


def conversations(tokenizer, n: int, turns: int, max_prompt_tokens: int) -> list[list[list[int]]]:
    """Per conversation, its turns' prompts (token ids), each starting with the one before."""
    out = []
    for _, messages in data.sharegpt("held-out"):
        prompts = []
        for i, m in enumerate(messages):
            if m["role"] != "user":
                continue
            text = tokenizer.apply_chat_template(
                messages[: i + 1], tokenize=False, add_generation_prompt=True
            )
            prompts.append(list(tokenizer(text, add_special_tokens=False).input_ids))
            if len(prompts) == turns:
                break
        if len(prompts) == turns and len(prompts[-1]) <= max_prompt_tokens:
            out.append(prompts)
        if len(out) == n:
            break
    return out


def _alone(engine, ids: list[int], params: SamplingParams) -> tuple[list[int], float, float, int]:
    """One request alone: (tokens, seconds to the first token, seconds in all, cached tokens)."""
    start = time.perf_counter()
    seq = engine.add_request(ids, params)
    first = None
    while not seq.finished:
        engine.step()
        if first is None and seq.output_token_ids:
            first = time.perf_counter() - start
    return (
        list(seq.output_token_ids),
        first or 0.0,
        time.perf_counter() - start,
        seq.num_cached_tokens,
    )


def run_prefix_bench(args: argparse.Namespace) -> dict:
    from specdecode import LLM
    from specdecode.cli import engine_kwargs

    kwargs = engine_kwargs(args, default_policy="static")  # a drafter as configured, if any
    off = LLM(args.model, **{**kwargs, "enable_prefix_caching": False})
    on = LLM(args.model, share_model_with=off, **{**kwargs, "enable_prefix_caching": True})
    convs = conversations(off.tokenizer, args.num_conversations, args.turns, args.max_prompt_tokens)
    if not convs:
        raise InvalidRequestError(
            f"no held-out conversation has {args.turns} user turns within "
            f"--max-prompt-tokens {args.max_prompt_tokens}"
        )
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    warm = [1] + convs[0][0][:7]  # first-call costs, on both (its blocks match no prompt)
    _alone(off.engine, warm, params)
    _alone(on.engine, warm, params)
    runs = {"off": [], "on": []}
    identical = True
    for turns in convs:
        for ids in turns:
            a = _alone(off.engine, ids, params)
            b = _alone(on.engine, ids, params)
            identical &= a[0] == b[0]
            for name, r in (("off", a), ("on", b)):
                runs[name].append({"prompt_tokens": len(ids), "ttft_s": r[1], "total_s": r[2],
                                   "cached_tokens": r[3]})  # fmt: skip

    def mean(name: str, key: str) -> float:
        return sum(r[key] for r in runs[name]) / len(runs[name])

    prompt_tokens = sum(r["prompt_tokens"] for r in runs["on"])
    result = {
        "machine": machine(),
        "model": off.engine.model_path.name,  # (not a path of this machine)
        "dtype": args.dtype,
        "quantization": getattr(args, "quantization", None),
        "requests": len(runs["on"]),
        "conversations": len(convs),
        "turns": args.turns,
        "mean_prompt_tokens": prompt_tokens / len(runs["on"]),
        "cached_share": sum(r["cached_tokens"] for r in runs["on"]) / prompt_tokens,
        "ttft_s": {"off": mean("off", "ttft_s"), "on": mean("on", "ttft_s")},
        "total_s": {"off": mean("off", "total_s"), "on": mean("on", "total_s")},
        "token_identical": identical,
        "runs": runs,
    }
    for name, llm in (("off", off), ("on", on)):  # an EAGLE head sees no cached history
        stats = llm.engine.spec_stats
        result.setdefault("tau", {})[name] = (
            1 + stats.num_accepted_tokens / stats.num_drafts if stats.num_drafts else None
        )
    result["ttft_speedup"] = result["ttft_s"]["off"] / result["ttft_s"]["on"]
    result["total_speedup"] = result["total_s"]["off"] / result["total_s"]["on"]
    print(
        f"{result['requests']} requests ({len(convs)} conversations x {args.turns} turns, "
        f"{result['mean_prompt_tokens']:.0f} prompt tokens on average), batch 1, "
        f"{args.max_tokens} tokens each, on {result['machine']}:"
    )
    print("| prefix caching | time to first token | end to end | prompt tokens cached |")
    print("|---|---|---|---|")
    for name in ("off", "on"):
        share = f"{100 * result['cached_share']:.0f}%" if name == "on" else "-"
        print(f"| {name} | {result['ttft_s'][name] * 1000:.0f} ms | "
              f"{result['total_s'][name]:.2f} s | {share} |")  # fmt: skip
    print(
        f"time to first token {result['ttft_speedup']:.2f}x, end to end "
        f"{result['total_speedup']:.2f}x; outputs token-identical: {identical}"
    )
    if result["tau"]["off"] is not None:
        print(f"tau (speculation): off {result['tau']['off']:.2f}, on {result['tau']['on']:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return result
