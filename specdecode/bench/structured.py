"""`specdecode bench structured`: speculation under a JSON-schema constraint, batch 1.

Workloads: `json-patch`, the `evals` JSON Patch task (`json_patch_object`), whose answers are
JSON Patch arrays, constrained by the JSON Patch schema below; `tools`, tool calls as a server
makes them with tool_choice "required" (the tools rendered by the chat template, the reply
constrained to one call of them: see serving/tools.py), on three function tools and twelve
requests written for this benchmark (no tool-calling data set ships offline). For each
speculative configuration, on the same
prompts in one run: constrained decoding without and with speculation, and unconstrained
decoding without and with it. Reported per mode: decode tok/s (after the first token), tokens
per target forward (jump-ahead included: forced tokens ride along in the next forward),
acceptance, tau, the share of tokens the grammar forced, and the speedup of speculation over
the same mode without it.
"""

from __future__ import annotations

import argparse
import json
import time
from copy import deepcopy
from pathlib import Path

from specdecode import data
from specdecode.errors import InvalidRequestError
from specdecode.sampling import SamplingParams

JSON_PATCH_SCHEMA = {
    "type": "array",
    "minItems": 1,
    "maxItems": 8,
    "items": {
        "type": "object",
        "properties": {
            "op": {"enum": ["add", "remove", "replace"]},
            "path": {"type": "string", "pattern": "^(/[0-9a-f]{6})+$"},
            "value": {"type": "integer"},
        },
        "required": ["op", "path"],
        "additionalProperties": False,
    },
}


def _tool(name: str, description: str, properties: dict) -> dict:
    return {"type": "function", "function": {"name": name, "description": description,
            "parameters": {"type": "object", "properties": properties,
                           "required": list(properties)}}}  # fmt: skip


TOOLS = [
    _tool("get_weather", "Current weather in a city", {
        "city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}),
    _tool("search_flights", "Search flights between two airports on a date", {
        "origin": {"type": "string", "description": "IATA code"},
        "destination": {"type": "string", "description": "IATA code"},
        "date": {"type": "string", "description": "YYYY-MM-DD"},
        "passengers": {"type": "integer"}}),
    _tool("create_event", "Create a calendar event", {
        "title": {"type": "string"}, "start": {"type": "string", "description": "ISO 8601"},
        "duration_minutes": {"type": "integer"},
        "attendees": {"type": "array", "items": {"type": "string"}}}),
]  # fmt: skip
TOOL_REQUESTS = [
    "What's the weather in Oslo, in celsius?",
    "Find flights from JFK to LHR on 2026-12-20 for 2 people.",
    "Schedule a 30 minute sync called 'Design review' at 2026-12-08T10:00 with ana@example.com "
    "and bo@example.com.",
    "Is it warm in Lisbon right now? Use fahrenheit.",
    "I need 3 seats from SFO to NRT on 2027-01-05.",
    "Set up 'Quarterly planning', 90 minutes, 2026-12-15T14:00, attendees: cy@example.com.",
    "How cold is it in Montreal? Celsius please.",
    "Book a search: Berlin (BER) to Madrid (MAD), 2027-02-14, one traveller.",
    "Put 'Dentist' in my calendar on 2026-12-22T08:30 for 45 minutes, just me (me@example.com).",
    "Weather in Nairobi in fahrenheit?",
    "Flights for a family of four from DEL to SIN on 2027-03-01.",
    "Create a 60 minute 'Hiring sync' at 2026-12-09T16:00 with dee@example.com, eli@example.com.",
]
WORKLOADS = ("json-patch", "tools")


def tool_schema() -> dict:
    """The "required" constraint of the tools workload: one call of one of TOOLS."""
    from specdecode.serving.tools import check_tools

    return check_tools(TOOLS, "required", False, None, None).constraint()


def _prompts(tokenizer, n: int, max_prompt_tokens: int, workload: str) -> list[list[int]]:
    if workload == "tools":
        rows = [[{"role": "user", "content": q}] for q in TOOL_REQUESTS]
        tools = TOOLS
    else:
        rows = (
            [{"role": "user", "content": "\n\n".join(m["content"] for m in row["input"])}]
            for row in data.evals_samples("json_patch_object/samples.jsonl")
        )
        tools = None
    out = []
    for messages in rows:
        text = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, tools=tools
        )
        ids = list(tokenizer(text, add_special_tokens=False).input_ids)
        if len(ids) <= max_prompt_tokens:
            out.append(ids)
        if len(out) == n:
            break
    return out


def plain_then_speculative(engine, prompts, params, policy: str) -> tuple[dict, dict]:
    """The prompts plain, then speculative. A drafter that learns from finished answers (suffix
    decoding) starts empty and learns from its own measured requests only, each after it is
    timed: the plain run's answers are those of the prompts it is measured on next."""
    drafter = engine.drafter
    if drafter is not None:
        drafter.clear_history()
        drafter.learning = False
    engine.set_policy("off")
    plain = _run(engine, prompts, params)
    engine.set_policy(policy)
    if drafter is not None:
        drafter.learning = True
    return plain, _run(engine, prompts, params)


def _run(engine, prompts, params) -> dict:
    """Each prompt alone (batch 1): decode time after the first token, forwards, tokens."""
    tokens = forwards = forced = valid = 0
    seconds = 0.0
    before = deepcopy(engine.spec_stats)
    forced0 = engine.num_forced_tokens
    for ids in prompts:
        seq = engine.add_request(ids, params)
        while not seq.output_token_ids and not seq.finished:
            engine.step()
        start, n0 = time.perf_counter(), len(seq.output_token_ids)
        while not seq.finished:
            engine.step()
            forwards += 1
        seconds += time.perf_counter() - start
        tokens += len(seq.output_token_ids) - n0
        if params.structured_output is not None:
            try:
                json.loads(seq.text)
                valid += 1
            except json.JSONDecodeError:
                pass
    s = engine.spec_stats
    drafts = s.num_drafts - before.num_drafts
    drafted = s.num_draft_tokens - before.num_draft_tokens
    accepted = s.num_accepted_tokens - before.num_accepted_tokens
    forced = engine.num_forced_tokens - forced0
    return {
        "decode_tok_s": tokens / seconds if seconds else 0.0,
        "tokens_per_forward": tokens / forwards if forwards else 0.0,
        "acceptance_rate": accepted / drafted if drafted else None,
        "tau": 1 + accepted / drafts if drafts else None,
        "forced_share": forced / tokens if tokens else 0.0,
        "valid_json": valid if params.structured_output is not None else None,
        "tokens": tokens,
    }


def run_structured_bench(args: argparse.Namespace) -> dict:
    from specdecode import LLM
    from specdecode.bench.speculative import _label
    from specdecode.cli import engine_kwargs, speculative_config

    kwargs = engine_kwargs(args, default_policy="static")
    policy = kwargs["speculative_policy"]  # the speculative runs' (--speculative-policy)
    kwargs["speculative_config"] = speculative_config(args) or {"method": "ngram"}
    configs = [kwargs["speculative_config"]]
    configs += json.loads(args.compare) if args.compare else []
    first = LLM(args.model, **kwargs)
    prompts = _prompts(first.tokenizer, args.num_prompts, args.max_prompt_tokens, args.workload)
    schema = tool_schema() if args.workload == "tools" else JSON_PATCH_SCHEMA
    if not prompts:
        raise InvalidRequestError(
            f"no prompt fits --max-prompt-tokens {args.max_prompt_tokens}; raise it"
        )
    rows = []
    for cfg in configs:
        llm = (
            first
            if cfg is configs[0]
            else LLM(args.model, share_model_with=first, **{**kwargs, "speculative_config": cfg})
        )
        engine = llm.engine
        label = _label(engine.spec_config)
        for constrained in (True, False):
            so = {"json": schema} if constrained else None
            params = SamplingParams(
                temperature=args.temperature, seed=0, max_tokens=args.max_tokens,
                structured_output=so,
            )  # fmt: skip
            plain, spec = plain_then_speculative(engine, prompts, params, policy)
            row = {
                "method": label,
                "policy": policy,
                "constrained": constrained,
                "prompts": len(prompts),
                "plain": plain,
                "spec": spec,
                # none where plain decoding timed no decode step (every answer one step long)
                "speedup": spec["decode_tok_s"] / plain["decode_tok_s"]
                if plain["decode_tok_s"]
                else None,
            }
            rows.append(row)
            _print(row)
    result = {
        "workload": "evals json_patch_object, JSON Patch schema"
        if args.workload == "json-patch"
        else 'tool calls, tool_choice "required": three tools, twelve requests',
        "temperature": args.temperature,
        "max_tokens": args.max_tokens,
        "dtype": args.dtype,
        "quantization": getattr(args, "quantization", None),
        "schema": schema,
        "rows": rows,
    }
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return result


def _print(row: dict) -> None:
    p, s = row["plain"], row["spec"]
    mode = "constrained  " if row["constrained"] else "unconstrained"
    acc = f"acc {s['acceptance_rate']:.0%} tau {s['tau']:.2f}" if s["tau"] else "no drafts"
    speedup = f"{row['speedup']:.2f}x" if row["speedup"] is not None else "(no decode step timed)"
    print(
        f"{row['method']:<16} {mode} plain {p['decode_tok_s']:6.1f} tok/s "
        f"({p['tokens_per_forward']:.2f} tok/fwd, forced {p['forced_share']:.0%})  "
        f"spec {s['decode_tok_s']:6.1f} tok/s ({s['tokens_per_forward']:.2f} tok/fwd, {acc})  "
        f"{speedup}",
        flush=True,
    )


def add_args(p: argparse.ArgumentParser) -> None:
    from specdecode.bench import at_least, config_list, output_file, temperature

    p.add_argument(
        "--workload",
        choices=WORKLOADS,
        default="json-patch",
        help="json-patch: evals' JSON Patch task; tools: tool calls with tool_choice "
        '"required" (three tools, twelve requests, rendered by the chat template)',
    )
    p.add_argument("--num-prompts", type=at_least(1), default=5)
    # (the evals JSON Patch prompts are 1,929-2,215 SmolLM2 tokens: all of them fit)
    p.add_argument("--max-prompt-tokens", type=at_least(1), default=2304)
    p.add_argument("--max-tokens", type=at_least(2), default=96)
    p.add_argument("--temperature", type=temperature, default=0.0)
    p.add_argument(
        "--compare",
        type=config_list,
        default=None,
        help="a JSON list of further speculative configs",
    )
    p.add_argument(
        "--json", type=output_file, default=None, help="also write the results to this JSON file"
    )
