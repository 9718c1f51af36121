"""`specdecode advise`: should *your* traffic run with speculative decoding, at *your*
concurrency, on this machine?

Two numbers decide it: acceptance on real traffic and steady-state concurrency. The advisor
measures both sides instead of using rules of thumb:
1. reads a sample of the traffic (JSONL: one request per line, see `read_traffic`);
2. calibrates the step-cost curve of this machine (target forwards of N tokens, up to what the
   given concurrency feeds with drafts) and runs the sample plainly and with each candidate
   drafter, batched at up to the given concurrency: acceptance by draft position, tokens per
   step, the drafting cost, and the real step times (scheduling and sampling included);
3. predicts steady-state throughput and time per output token at the concurrency, for plain
   decoding and for each drafter at each depth, from the same cost model the goodput controller
   uses (`engine.controller`):

       throughput(k) = C * O / ((O / E(k)) * (T(N_k) + D(k)) + C * P(N_k))

   with C requests in flight, O the mean output length, E(k) the tokens a step emits per
   request at depth k (measured acceptance), N_k = C * (1 + drafts per request at k) the tokens
   a step feeds the target, T the step-time curve, D the drafting time, and P(N) the marginal
   cost of one mean-length prompt's prefill in a step of N tokens;
4. recommends the method and depth with the best prediction, or `off` when nothing beats plain
   decoding by at least `--min-gain`, and says why in plain words.

`--validate 1,8` then measures closed-loop throughput at those concurrencies (the serving
engine, as `bench serve` runs it) for plain decoding and the recommendation, and reports the
error of each prediction.
"""

from __future__ import annotations

import argparse
import json
import logging
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from specdecode.errors import InvalidRequestError
from specdecode.sampling import SamplingParams

log = logging.getLogger(__name__)


@dataclass
class TrafficRequest:
    line: int
    params: SamplingParams  # as the server would sample it (its defaults, its checks)
    prompt: str | None = None
    messages: list[dict] | None = None
    chat_options: dict = field(default_factory=dict)  # rendering options, as the server's
    add_special_tokens: bool = False  # (a chat body's: the template writes them)

    @property
    def temperature(self) -> float:
        return self.params.temperature

    @property
    def max_tokens(self) -> int:
        return self.params.max_tokens


@dataclass
class Traffic:
    requests: list[TrafficRequest]
    bad_lines: list[str] = field(default_factory=list)  # "line N: why", skipped
    unused: int = 0  # requests past --num-requests, not read


def read_traffic(path: str | Path, default_max_tokens: int = 128, default_temperature=None):
    """One request per line: `{"prompt": "..."}` (a completions body), `{"messages": [...]}` (a
    chat completions body), `{"input": ...}` (a Responses API body), a bare list of chat
    messages, or an OpenAI Batch API line (`{"custom_id", "url", "body"}`, the file users send
    to batch endpoints: its body). A line is read as the server reads
    that body (`serving.protocol`): its defaults (a line with no `temperature` samples at 1.0,
    as the server does, unless `default_temperature` is given), its checks, and every field
    that changes the output (sampling, penalties, `logit_bias`, stops, `ignore_eos`,
    structured output); a line with no `max_tokens` gets `default_max_tokens`. Blank lines are
    ignored. A bad line is reported by number and skipped; the rest is kept."""
    path = Path(path)
    if not path.is_file():
        what = "is a folder, not a file" if path.is_dir() else "not found"
        raise InvalidRequestError(f"traffic file {str(path)!r} {what}")
    good, bad = [], []
    # (utf-8-sig: a byte-order mark some editors write is not part of the first line)
    with open(path, encoding="utf-8-sig", errors="replace") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                good.append(_parse_line(n, line, default_max_tokens, default_temperature))
            except ValueError as e:
                bad.append(f"{path.name} line {n}: {e}")
    if not good:
        why = f" ({bad[0]}{' ...' if len(bad) > 1 else ''})" if bad else ""
        raise InvalidRequestError(f"no usable request in {str(path)!r}{why}")
    return Traffic(good, bad)


def _parse_line(n: int, line: str, default_max_tokens: int, default_temperature) -> TrafficRequest:
    from pydantic import ValidationError

    from specdecode.serving.protocol import (
        ChatCompletionRequest,
        CompletionRequest,
        ResponsesRequest,
    )

    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"not valid JSON ({e.msg} at column {e.colno})") from None
    except RecursionError:
        raise ValueError("nested too deeply") from None
    try:  # "\ud83d" parses (a log cut inside an emoji) but no tokenizer can take it
        json.dumps(obj, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("holds text that is not valid Unicode (a lone surrogate)") from None
    if isinstance(obj, list):
        obj = {"messages": obj}
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object or a list of messages, got {type(obj).__name__}")
    if isinstance(obj.get("body"), dict) and "url" in obj:  # a Batch API line: its request
        obj = obj["body"]
    if "messages" in obj:
        kind = ChatCompletionRequest
    elif isinstance(obj.get("prompt"), str) and obj["prompt"]:
        kind = CompletionRequest
    elif "input" in obj:
        kind = ResponsesRequest
    else:
        raise ValueError("needs a non-empty 'prompt' string, a 'messages' list or an 'input'")
    if obj.get("temperature") is None and default_temperature is not None:
        obj = {**obj, "temperature": default_temperature}
    if kind is CompletionRequest and obj.get("max_completion_tokens") is not None:
        obj = {**obj, "max_tokens": obj["max_completion_tokens"]}  # (read first, as in chat)
    given = obj.get("max_completion_tokens") or obj.get("max_tokens")
    if kind is ResponsesRequest:
        given = obj.get("max_output_tokens")
    try:
        body = kind.model_validate(obj)
        if kind is ResponsesRequest:  # (run as the chat completion the server makes of it)
            if body.previous_response_id is not None:
                raise ValueError(
                    "previous_response_id: the stored response it continues is not in the "
                    "traffic file (give the whole conversation as input)"
                )
            body, kind = body.as_chat(), ChatCompletionRequest
        max_tokens = body.requested_max_tokens() if given is not None else default_max_tokens
        params = body.sampling_params(max_tokens, None)
        if kind is ChatCompletionRequest:
            messages = body.chat_messages()  # (tools and earlier calls as the server's)
            # a template a line carries is the user's own traffic (the server took it)
            options = body.template_options(trusted=True)
    except ValidationError as e:
        err = e.errors()[0]
        from specdecode.serving.protocol import field_path

        where = field_path(err["loc"])
        raise ValueError(f"{where}: {err['msg']}" if where else err["msg"]) from None
    except InvalidRequestError as e:
        raise ValueError(str(e)) from None
    if kind is ChatCompletionRequest:
        return TrafficRequest(
            n, params, messages=messages, chat_options=options,
            add_special_tokens=body.add_special_tokens,
        )  # fmt: skip
    return TrafficRequest(n, params, prompt=obj["prompt"])


# ---- measurement --------------------------------------------------------------------------


@dataclass
class Measured:
    """What one drafter did on the traffic sample (batched, static policy, full depth)."""

    label: str
    config: dict
    max_depth: int
    tree: bool
    decisions: int  # (request, decode step) pairs
    accepted_per_position: list[int]
    drafted_per_position: list[int]
    num_drafts: int
    num_draft_tokens: int
    num_accepted: int
    tok_s: float  # measured offline batch throughput on the sample
    # levels the drafter ran, all steps together (0: not recorded, the kept depths stand in)
    drafted_levels: int = 0
    # nodes a proposal of depth k feeds (`Drafter.expected_nodes`, k = 0..max_depth): how a
    # tree's size scales with its depth (empty: the measured full-depth size at every depth)
    nodes_by_depth: list[float] = field(default_factory=list)

    def expected_tokens(self, k: int) -> float:
        """Tokens a request-step emits at depth k (1 + accepted). Positions past `max_depth`
        come from a branch that drafts at any depth (`prompt_lookup_tokens`): always counted.
        A shallower tree is priced at what the full one accepted up to depth k: a lower bound,
        as the engine's shallower trees spend their nodes on fewer levels."""
        s = max(1, self.decisions)
        beyond = sum(self.accepted_per_position[self.max_depth :])
        return 1.0 + (sum(self.accepted_per_position[:k]) + beyond) / s

    def drafts_per_step(self, k: int) -> float:
        """Draft tokens fed per request-step at depth k."""
        s = max(1, self.decisions)
        if self.tree:  # trees: measured nodes at full depth, scaled to the tree of depth k
            full = self.num_draft_tokens / s
            sizes = self.nodes_by_depth
            if k >= self.max_depth or len(sizes) <= self.max_depth or not sizes[self.max_depth]:
                return full
            return full * sizes[k] / sizes[self.max_depth]
        return sum(self.drafted_per_position[:k]) / s

    def depth_per_step(self, k: int) -> float:
        """Levels the drafter runs per request-step at depth k: what the engine's draft-cost
        model is fitted on (`Drafter.drafted_depth`). Not the depth the drafts reach: a dynamic
        tree runs more levels than it keeps, and a lookup branch verified without the head
        (or drafting past its depth) runs none. Shallower depths scale the measured levels by
        the share of drafted positions they keep."""
        full = sum(self.drafted_per_position[: self.max_depth])
        if not full:
            return 0.0
        levels = self.drafted_levels or full
        share = sum(self.drafted_per_position[: min(k, self.max_depth)]) / full
        return levels * share / max(1, self.decisions)

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def tau(self) -> float:
        return 1 + self.num_accepted / self.num_drafts if self.num_drafts else 1.0


def candidate_configs(model: str | None, given: dict | None, draft_model: str | None) -> dict:
    """The configs to try: the one given, or every drafter available for the model."""
    if given:
        return {given["method"]: given}
    out = {
        "ngram": {"method": "ngram", "num_speculative_tokens": 5},
        "suffix": {"method": "suffix"},  # (learns from the traffic's earlier answers as it runs)
    }
    if draft_model:
        out["draft_model"] = {"method": "draft_model", "model": draft_model}
        # with a prompt-lookup branch: grafted at T=0, run instead of the draft where it pays
        out["draft_model+lookup"] = {**out["draft_model"], "prompt_lookup_tokens": 8}
    if model is None:  # heads ship for the embedded default model only
        for m in ("medusa", "eagle", "eagle3"):
            out[m] = {"method": m}
        # the EAGLE-3 head with a prompt-lookup branch: pays where answers copy their input
        out["eagle3+lookup"] = {"method": "eagle3", "prompt_lookup_tokens": 8}
    return out


def _params(reqs: list[TrafficRequest]) -> list[SamplingParams]:
    """Each request's parameters, seeded (by its place, unless its line gave a seed) so that
    every configuration samples the same way."""
    from dataclasses import replace

    return [
        replace(r.params, seed=i if r.params.seed is None else r.params.seed)
        for i, r in enumerate(reqs)
    ]


def _run(
    llm, ids: list[list[int]], params: list[SamplingParams], bar, batch: int
) -> tuple[int, float]:
    """All requests through the engine, `batch` at a time at most (the concurrency advised
    on, whatever levels the engine may validate at later); (tokens, seconds)."""
    import time

    engine = llm.engine
    most, engine.scheduler.max_num_seqs = engine.scheduler.max_num_seqs, batch
    try:
        seqs = [engine.add_request(p, sp) for p, sp in zip(ids, params, strict=True)]
        done = 0
        t0 = time.perf_counter()
        for _ in engine.run_to_completion():
            now = sum(s.finished for s in seqs)
            bar.update(now - done)
            done = now
    finally:
        engine.scheduler.max_num_seqs = most
    return sum(len(s.output_token_ids) for s in seqs), time.perf_counter() - t0


# ---- prediction ---------------------------------------------------------------------------


@dataclass
class CostModel:
    """Step time T(N) (calibrated, then measured), drafting time D, prefill marginal P."""

    step: object  # engine.controller.StepCostModel
    draft: object | None  # engine.controller.DraftCostModel

    def step_time(self, n: float) -> float:
        return self.step.predict(max(1.0, n))

    def prefill(self, n: float, prompt_tokens: float) -> float:
        cal = self.step.calibration if self.step.calibration else self.step.measured
        return max(0.0, cal(n + prompt_tokens) - cal(n))


def predict(
    cost: CostModel,
    concurrency: int,
    prompt_tokens: float,
    output_tokens: float,
    m: Measured | None = None,
    k: int = 0,
) -> dict:
    c = concurrency
    e = m.expected_tokens(k) if m and k else 1.0
    n = c * (1 + (m.drafts_per_step(k) if m and k else 0.0))
    t_step = cost.step_time(n)
    drafting = bool(m and k and cost.draft)
    t_draft = cost.draft.predict(c * m.depth_per_step(k)) if drafting else 0.0
    # the drafter's own pass over each prompt (a draft model's prefill, a head's catch-up)
    t_catch_up = c * cost.draft.catch_up_seconds(prompt_tokens) if drafting else 0.0
    steps = max(output_tokens - 1, 0.0) / e  # the first token comes with the prefill
    own_prefill = cost.prefill(n, prompt_tokens)
    cycle = steps * (t_step + t_draft) + c * own_prefill + t_catch_up
    # (at least a step: one-token answers are all prefill, whose marginal cost a flat or
    # noisy curve can put at 0)
    cycle = max(cycle, t_step)
    # time per output token after the first, as `bench serve` measures it: the request's own
    # prefill is before its first token; the other requests' prefills fall between its steps
    decode = max(cycle - own_prefill - t_catch_up / c, 0.0)
    return {
        "concurrency": c,
        "depth": k,
        "tokens_per_step": e,
        "tokens_fed": n,
        "step_ms": 1000 * t_step,
        "draft_ms": 1000 * t_draft,
        "catch_up_ms": 1000 * t_catch_up,
        "throughput_tok_s": c * output_tokens / cycle,
        "tpot_ms": 1000 * decode / (output_tokens - 1) if output_tokens > 1 else 0.0,
    }


def _merged_step_model(engines) -> object:
    """One step-time model from every engine's calibration and measured steps (they run the
    same target; the measured curve keeps a moving average per token-count bucket)."""
    from specdecode.engine.controller import StepCostModel

    model = StepCostModel()
    for eng in engines:
        step = eng.controller.step_cost
        for x, y in step.calibration.points():
            model.calibrate(int(x), y)
        for x, y in step.measured.points():
            model.observe(int(round(x)), y)
    return model


# ---- the command --------------------------------------------------------------------------


def run_advise(args: argparse.Namespace) -> dict:
    from tqdm import tqdm

    from specdecode import LLM
    from specdecode.cli import engine_kwargs, speculative_config

    # the flags first: nothing is loaded or measured for a run that cannot finish
    if args.concurrency < 1:
        raise InvalidRequestError("--concurrency must be >= 1")
    if args.num_requests < 0:
        raise InvalidRequestError("--num-requests must be >= 0 (0: all)")
    if args.json and not Path(args.json).resolve().parent.is_dir():
        raise InvalidRequestError(f"--json {args.json!r}: its folder does not exist")
    levels = sorted({args.concurrency, *_levels(args.validate)})
    traffic = read_traffic(args.traffic, args.max_tokens, args.temperature)
    for bad in traffic.bad_lines:
        print(f"skipped {bad}", flush=True)
    # the engine flags as every command reads them; each engine below sets its own drafter
    common = {k: v for k, v in engine_kwargs(args).items() if not k.startswith("speculative")}
    common["max_num_seqs"] = max(levels)  # (the validation's closed loops)
    configs = candidate_configs(args.model, speculative_config(args), args.draft_model)
    base = LLM(args.model, speculative_policy="off", **common)
    reqs, ids = [], []
    for n, r in enumerate(traffic.requests):
        if args.num_requests and len(reqs) == args.num_requests:
            traffic.unused = len(traffic.requests) - n
            break
        try:
            if r.messages:
                text = base.apply_chat_template(r.messages, **r.chat_options)
                p = base._text_ids(text, r.add_special_tokens)
            else:
                p = base.encode(r.prompt)
            base.engine.make_sequence(p, _params([r])[0])  # validates length and sampling
        except InvalidRequestError as e:
            traffic.bad_lines.append(f"{Path(args.traffic).name} line {r.line}: {e}")
            print(f"skipped {traffic.bad_lines[-1]}", flush=True)
            continue
        reqs.append(r)
        ids.append(p)
    if not reqs:
        raise InvalidRequestError("no request of the traffic sample fits this model")
    params = _params(reqs)
    print(
        f"measuring {len(reqs)} requests plainly and with {', '.join(configs)} on this machine",
        flush=True,
    )
    measured: dict[str, Measured] = {}
    llms = {"off": base}
    with tqdm(total=len(reqs) * (1 + len(configs)), desc="advise", unit="req") as bar:
        n_tok, secs = _run(base, ids, params, bar, args.concurrency)
        # the prefill term needs step times up to C decode tokens plus a mean prompt
        top = max(levels) + sum(len(i) for i in ids) // len(ids)
        base.engine.calibrate(time_budget_s=args.calibration_seconds, upto=top)
        plain_tok_s, out_tokens = n_tok / secs, n_tok / len(ids)
        for label, cfg in configs.items():
            llm = LLM(
                args.model,
                share_model_with=base,
                speculative_config=cfg,
                speculative_policy="static",
                **common,
            )
            llm.engine.calibrate(time_budget_s=args.calibration_seconds)
            measured[label] = _measure(llm, label, ids, params, bar, args.concurrency)
            llms[label] = llm
    step = _merged_step_model([x.engine for x in llms.values()])
    costs = {m: CostModel(step, llms[m].engine.controller.draft_cost) for m in measured}
    costs["off"] = CostModel(step, None)
    prompt_tokens = sum(len(i) for i in ids) / len(ids)
    result = advice(
        args.concurrency,
        traffic,
        reqs,
        measured,
        costs,
        prompt_tokens,
        out_tokens,
        plain_tok_s,
        args.min_gain,
    )
    capacity = base.engine.manager.capacity_tokens
    need = args.concurrency * (prompt_tokens + out_tokens)
    result["kv_capacity_tokens"] = capacity
    if need > capacity:
        result["text"] += (
            f"\nNote: {args.concurrency} requests of this size hold about {need:.0f} tokens of "
            f"KV cache; --kv-cache-memory-gb {base.engine.config.kv_cache_memory_gb:g} holds "
            f"{capacity}: "
            "requests would queue or be preempted, and every prediction above is optimistic. "
            "Give the cache more memory or expect lower concurrency."
        )
    result["model"] = base.engine.model_path.name
    result["command"] = "specdecode advise " + shlex.join(getattr(args, "argv", []) or [])
    result["machine"] = _machine()
    if args.validate:
        result["validation"] = validate(
            llms,
            result,
            measured,
            costs,
            ids,
            params,
            _levels(args.validate),
            prompt_tokens,
            out_tokens,
        )
        result["text"] += "\n" + result["validation"]["text"]
    print(result["text"])
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
        print(f"wrote {args.json}")
    return result


def _machine() -> str:
    from specdecode.bench.suite import machine

    return machine()


def _levels(text: str | None) -> list[int]:
    if not text:
        return []
    try:
        levels = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise InvalidRequestError(
            f"--validate wants concurrency levels like 1,8, got {text!r}"
        ) from None
    if not levels or any(c < 1 for c in levels):
        raise InvalidRequestError(f"--validate wants concurrency levels >= 1, got {text!r}")
    return levels


def _given(cfg) -> dict:
    """A speculative config's method and depth, and its other keys that differ from their
    defaults (the recommended command line names what matters, not every key)."""
    from dataclasses import fields

    out = {"method": cfg.method, "num_speculative_tokens": cfg.num_speculative_tokens}
    for f in fields(cfg):
        v = getattr(cfg, f.name)
        if f.name not in out and v is not None and v != f.default:
            out[f.name] = v
    return out


def _measure(llm, label: str, ids, params, bar, batch: int) -> Measured:
    from specdecode.bench.speculative import _copy_stats, _diff_stats

    eng = llm.engine
    before, dec0 = _copy_stats(eng), eng.controller.num_decisions
    n_tok, secs = _run(llm, ids, params, bar, batch)
    st = _diff_stats(eng, before)
    cfg = eng.spec_config
    return Measured(
        label=label,
        config=_given(cfg),
        max_depth=cfg.num_speculative_tokens,
        tree=eng.drafter.max_nodes(cfg.num_speculative_tokens) != cfg.num_speculative_tokens,
        decisions=eng.controller.num_decisions - dec0,
        accepted_per_position=st.accepted_per_position,
        drafted_per_position=st.drafted_per_position,
        num_drafts=st.num_drafts,
        num_draft_tokens=st.num_draft_tokens,
        num_accepted=st.num_accepted_tokens,
        tok_s=n_tok / secs,
        drafted_levels=st.drafted_levels,
        nodes_by_depth=[
            float(eng.drafter.expected_nodes(k)) for k in range(cfg.num_speculative_tokens + 1)
        ],
    )


def advice(
    concurrency: int,
    traffic: Traffic,
    reqs: list[TrafficRequest],
    measured: dict[str, Measured],
    costs: dict[str, CostModel],
    prompt_tokens: float,
    out_tokens: float,
    plain_tok_s: float,
    min_gain: float,
) -> dict:
    c = concurrency
    plain = predict(costs["off"], c, prompt_tokens, out_tokens)
    options = []
    for label, m in measured.items():
        if m.num_drafts == 0:  # never found anything to draft on this traffic
            continue
        depths = range(1, m.max_depth + 1)
        best = max(
            (predict(costs[label], c, prompt_tokens, out_tokens, m, k) for k in depths),
            key=lambda p: p["throughput_tok_s"],
        )
        best["method"] = label
        best["speedup"] = best["throughput_tok_s"] / plain["throughput_tok_s"]
        best["acceptance_rate"] = m.acceptance_rate
        best["tau"] = m.tau
        options.append(best)
    options.sort(key=lambda o: -o["speedup"])
    top = options[0] if options else None
    go = top is not None and top["speedup"] > 1 and top["speedup"] >= 1 + min_gain
    temps: dict[str, int] = {}
    for r in reqs:
        temps[f"{r.temperature:g}"] = temps.get(f"{r.temperature:g}", 0) + 1
    lines = [
        f"Traffic: {len(reqs)} requests ({len(traffic.bad_lines)} bad lines skipped"
        + (f"; the {traffic.unused} after them unused: --num-requests" if traffic.unused else "")
        + "), "
        f"prompts {prompt_tokens:.0f} tokens and outputs {out_tokens:.0f} tokens on average, "
        "temperatures " + ", ".join(f"{t} ({n})" for t, n in sorted(temps.items())) + ".",
        f"At concurrency {c}, plain decoding: a step feeds {c} tokens and takes "
        f"{plain['step_ms']:.1f} ms; predicted {plain['throughput_tok_s']:.1f} tok/s, "
        f"{plain['tpot_ms']:.1f} ms per output token.",
    ]
    for o in options:
        why = _why(o, plain)
        lines.append(
            f"- {o['method']}: acceptance {o['acceptance_rate']:.0%}, tau {o['tau']:.2f}; best at "
            f"depth {o['depth']}: {o['tokens_per_step']:.2f} tokens per step for a "
            f"{o['tokens_fed']:.0f}-token step of {o['step_ms']:.1f} ms + {o['draft_ms']:.1f} "
            f"ms drafting -> {o['throughput_tok_s']:.1f} tok/s, {o['speedup']:.2f}x plain. {why}"
        )
    if go:
        rec = {**measured[top["method"]].config, "num_speculative_tokens": top["depth"]}
        if rec.get("topk") == 1 and rec.get("num_draft_tokens", 0) > top["depth"] + 1:
            rec["num_draft_tokens"] = top["depth"] + 1  # (a chain of that depth: all it has)
        lines.append(
            f"Recommendation: speculate with {top['method']} at depth {top['depth']} "
            f"(predicted {top['speedup']:.2f}x throughput, time per output token "
            f"{plain['tpot_ms']:.1f} -> {top['tpot_ms']:.1f} ms): "
            f"--speculative-config '{json.dumps(rec)}'. With the default "
            "--speculative-policy adaptive the engine re-decides this every step as your load "
            "and acceptance change."
        )
    else:
        rec = {"method": "off"}
        if top is None:
            reason = "no drafter found anything to draft on this traffic"
        elif top["speedup"] <= 1:
            reason = "no drafter beats plain decoding; static speculation would cost throughput"
        else:
            reason = f"the best gain ({top['speedup']:.2f}x) is under the {min_gain:.0%} margin"
        lines.append(
            f"Recommendation: off ({reason}, at concurrency {c} on this traffic). The adaptive "
            "policy, if you leave speculation configured, drafts only when its own estimates "
            "say a step gains."
        )
    return {
        "concurrency": c,
        "requests": len(reqs),
        "bad_lines": traffic.bad_lines,
        "prompt_tokens": prompt_tokens,
        "output_tokens": out_tokens,
        "measured_plain_tok_s": plain_tok_s,
        "measured": {k: m.__dict__ for k, m in measured.items()},
        "plain": plain,
        "options": options,
        "recommendation": rec,
        # the option recommended, by its label: "eagle3+lookup" is not its config's method
        "recommended_label": top["method"] if go else "off",
        "text": "\n".join(lines),
    }


def _why(o: dict, plain: dict) -> str:
    """The seed's decision flow, with this run's numbers."""
    verify = o["step_ms"] / plain["step_ms"]
    cost = (o["step_ms"] + o["draft_ms"]) / plain["step_ms"]
    gain = o["tokens_per_step"]
    if o["speedup"] >= 1:
        return (
            f"A speculative step costs {cost:.2f}x a plain one and emits {gain:.2f} tokens per "
            "request: verifying the drafts is cheap enough here (the step is still far from "
            "compute-bound)."
        )
    parts = [f"A speculative step costs {cost:.2f}x a plain one but emits only {gain:.2f} tokens"]
    if o["acceptance_rate"] < 0.3 and o["tau"] < 1.5:
        parts.append("acceptance is low (under 30%): most drafted tokens are wasted work")
    if verify > 1.3:
        parts.append(
            f"verifying them alone costs {verify:.2f}x: the batch is compute-bound at this "
            "concurrency"
        )
    if o["draft_ms"] > 0.3 * plain["step_ms"]:
        parts.append(f"drafting takes {o['draft_ms']:.1f} ms a step")
    return "; ".join(parts) + "."


def validate(llms, result, measured, costs, ids, params, levels, prompt_tokens, out_tokens):
    """Closed-loop throughput at `levels` for plain decoding and the recommendation (or the
    best option when the advice is off), against the predictions at those levels; then the
    same drafter under the adaptive policy (the default), measured only: it decides per step
    and request whether and how deep to draft, which the static prediction does not model."""
    from specdecode.bench.serve import closed_loop

    label = result["recommended_label"]
    if label == "off" and result["options"]:
        label = result["options"][0]["method"]
    rows = []
    for name in ["off"] + ([label] if label != "off" else []):
        llm = llms[name]
        depth = next((o["depth"] for o in result["options"] if o["method"] == name), 0)
        m = measured.get(name)
        # predictions first: the validation runs refine the engine's own cost models
        preds = {c: predict(costs[name], c, prompt_tokens, out_tokens, m, depth) for c in levels}
        if name != "off":
            llm.engine.controller.max_depth = depth
        policy = "off" if name == "off" else "static"
        got = closed_loop(llm.engine, ids, levels, [policy], params, len(ids), warmup=True)
        for r in got:
            pred = preds[r["concurrency"]]
            err = pred["throughput_tok_s"] / r["throughput_tok_s"] - 1
            rows.append(
                {
                    "method": name,
                    "policy": policy,
                    "depth": depth,
                    "concurrency": r["concurrency"],
                    "predicted_tok_s": pred["throughput_tok_s"],
                    "measured_tok_s": r["throughput_tok_s"],
                    "error": err,
                    "predicted_tpot_ms": pred["tpot_ms"],
                    "measured_tpot_ms": r["tpot_ms"],
                    "timed_over": r["timed_over"],
                }
            )
    worst = max(abs(r["error"]) for r in rows)
    lines = [
        f"- {r['method']} at concurrency {r['concurrency']}: predicted "
        f"{r['predicted_tok_s']:.1f} tok/s, measured {r['measured_tok_s']:.1f} tok/s "
        f"({100 * r['error']:+.0f}%){_whole_run(r)}"
        for r in rows
    ]
    if label != "off":
        plain = {r["concurrency"]: r["measured_tok_s"] for r in rows if r["method"] == "off"}
        got = closed_loop(llms[label].engine, ids, levels, ["adaptive"], params, len(ids))
        for r in got:
            c = r["concurrency"]
            row = {
                "method": label,
                "policy": "adaptive",
                "depth": llms[label].engine.controller.max_depth,
                "concurrency": c,
                "measured_tok_s": r["throughput_tok_s"],
                "measured_tpot_ms": r["tpot_ms"],
                "vs_off": r["throughput_tok_s"] / plain[c],
                "timed_over": r["timed_over"],
            }
            rows.append(row)
            lines.append(
                f"- {label} under the adaptive policy (the default) at concurrency {c}: "
                f"measured {row['measured_tok_s']:.1f} tok/s, {row['vs_off']:.2f}x plain "
                f"(not predicted: it decides per step whether and how deep to draft)"
                f"{_whole_run(row)}"
            )
    text = "Validation (closed loop, measured now):\n" + "\n".join(lines)
    text += f"\nworst prediction error {100 * worst:.0f}% (static and plain)"
    return {"rows": rows, "worst_error": worst, "text": text}


def _whole_run(row: dict) -> str:
    """The note a measurement timed over its whole run carries: a sample of few requests per
    client has no steady state, so start-up and drain are in it and the prediction (steady
    state) is expected above it."""
    if row["timed_over"] == "steady state":
        return ""
    return "; timed over the whole run, start and drain included: too few requests per client"


def add_args(p: argparse.ArgumentParser) -> None:
    from specdecode.argtypes import integer, number, output_file, temperature

    p.add_argument("--traffic", required=True, help="JSONL: one prompt or chat per line")
    p.add_argument("--concurrency", type=integer(1), default=1, help="expected requests in flight")
    p.add_argument("--draft-model", default=None, help="also try this draft model")
    p.add_argument(
        "--num-requests", type=integer(0), default=32, help="the first ones used (32; 0: all)"
    )
    p.add_argument("--max-tokens", type=integer(1), default=128, help="when a line does not say")
    p.add_argument("--temperature", type=temperature, default=None, help="when a line does not say")
    p.add_argument("--min-gain", type=number(0), default=0.05, help="recommend only above this")
    p.add_argument("--calibration-seconds", type=number(above=0), default=10.0)
    p.add_argument("--validate", default=None, help="measure at these levels too, e.g. 1,8")
    p.add_argument("--json", type=output_file, default=None, help="write the advice as JSON here")
