"""`specdecode bench http`: load over HTTP against any OpenAI-compatible server (`specdecode
serve`, vLLM, SGLang), measured as vLLM's `vllm bench serve` measures one.

Requests are streamed (`stream`, with `stream_options.include_usage` for the server's token
counts) and arrive on a schedule drawn up front: gaps with mean 1/`--request-rate` (Poisson;
`--burstiness` below 1 is burstier, above 1 steadier: gamma-distributed, as vLLM draws them;
`inf` sends them all at once), at most `--max-concurrency` in flight (a request waits for a
slot and its clock starts when it is sent, as in vLLM's). Reported as vLLM's benchmark reports
them: the requests that completed and failed, the duration (the start of the schedule to the
last answer), request and token throughput, and per request TTFT, TPOT ((end - first token) /
(output tokens - 1)), ITL (the gaps between streamed updates: under speculation an update can
carry several tokens, so ITL is above TPOT there) and E2EL, each as mean, median and p99
(percentiles interpolated, as numpy's). One difference: the first token is the first update
that carries output (text, reasoning or a tool call), not the first chunk, since a server may
send the reply's role before its prompt is even read (this one does), which would make TTFT
near zero. Where the server exports vLLM's speculative-decoding counters on `/metrics`
(`vllm:spec_decode_num_*`: this server and vLLM do), their change over the run gives the
acceptance and mean acceptance length it served.

The prompts: a benchmark workload, sent as chat messages, or `--traffic FILE` (one request per
line, the lines `advise` accepts: chat `{"messages"}` and completions `{"prompt"}` bodies sent
as written with `stream` added and the served model named, Responses bodies and bare message
lists as chat, OpenAI Batch API lines as their body). Standard library HTTP only: a thread and
a connection per request in flight.
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import random
import statistics
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from specdecode.errors import InvalidRequestError, SpecDecodeError

MAX_THREADS = 256  # requests in flight at most without --max-concurrency (a thread each)
SPEC_COUNTERS = (
    "vllm:spec_decode_num_drafts",
    "vllm:spec_decode_num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens",
)


@dataclass
class Outcome:
    """One request: times in seconds from its send."""

    ok: bool = False
    error: str = ""
    ttft: float | None = None
    e2el: float = 0.0
    gaps: list[float] = field(default_factory=list)  # between updates that brought text
    prompt_tokens: int = 0
    output_tokens: int = 0
    sent: float = 0.0  # (wall clock, perf_counter)
    no_usage: bool = False  # the server sent no usage: output_tokens counts updates


class Target:
    """A server's base URL (`http://host:port`, an optional path prefix), and its API key."""

    def __init__(self, base_url: str, api_key: str | None, timeout: float) -> None:
        u = urllib.parse.urlsplit(base_url.rstrip("/"))
        if u.scheme not in ("http", "https") or not u.hostname:
            raise InvalidRequestError(f"--base-url {base_url!r}: expected http(s)://host[:port]")
        self.https, self.host, self.port = u.scheme == "https", u.hostname, u.port
        self.prefix = u.path.removesuffix("/v1")  # (a base URL given with /v1, as clients do)
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"
        self.timeout = timeout

    def connect(self) -> http.client.HTTPConnection:
        cls = http.client.HTTPSConnection if self.https else http.client.HTTPConnection
        return cls(self.host, self.port, timeout=self.timeout)

    def get(self, path: str) -> tuple[int, bytes]:
        conn = self.connect()
        try:
            conn.request("GET", self.prefix + path, headers=self.headers)
            r = conn.getresponse()
            return r.status, r.read()
        finally:
            conn.close()


def _stream(target: Target, path: str, body: dict) -> Outcome:
    """Send one streamed request and time its updates."""
    out = Outcome(sent=time.perf_counter())
    conn = target.connect()
    try:
        conn.request("POST", target.prefix + path, json.dumps(body), target.headers)
        r = conn.getresponse()
        if r.status != 200:
            out.error = f"HTTP {r.status}: {r.read()[:300].decode(errors='replace')}"
            return out
        last, updates, usage, done = None, 0, False, False
        while True:
            line = r.readline()
            if not line:
                break
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if not data:  # (a keep-alive)
                continue
            if data == b"[DONE]":
                done = True
                break
            chunk = json.loads(data)
            if not isinstance(chunk, dict):
                raise ValueError(f"a stream chunk that is not an object: {data[:80]!r}")
            if "error" in chunk and not chunk.get("choices"):
                err = chunk["error"]
                out.error = str(err.get("message", err) if isinstance(err, dict) else err)[:300]
                return out
            if chunk.get("usage"):
                usage = True
                out.prompt_tokens = chunk["usage"].get("prompt_tokens", 0)
                out.output_tokens = chunk["usage"].get("completion_tokens", 0)
            if any(_carries_output(c) for c in chunk.get("choices") or []):
                now = time.perf_counter()
                if last is None:
                    out.ttft = now - out.sent
                else:
                    out.gaps.append(now - last)
                last, updates = now, updates + 1
        out.e2el = time.perf_counter() - out.sent
        if not usage:  # a server without include_usage: its updates, at least (an undercount
            out.output_tokens = updates  # under speculation: `run_http_bench` says so)
            out.no_usage = True
        # an answer, or an empty one the server counted (no stream at all is a failure)
        out.ok = out.ttft is not None or (usage and done and out.output_tokens == 0)
        if not out.ok:
            out.error = "no streamed answer (was it a stream?)"
    finally:
        conn.close()
    return out


def _carries_output(choice: dict) -> bool:
    """Whether a streamed choice brings output: text (chat or completions), reasoning, or a
    tool call (a role-only or finish-only chunk does not)."""
    delta = choice.get("delta") or {}
    return bool(
        choice.get("text")
        or delta.get("content")
        or delta.get("reasoning_content")
        or delta.get("reasoning")
        or delta.get("tool_calls")
    )


def spec_counters(target: Target) -> dict[str, float] | None:
    """vLLM's speculative-decoding counters on /metrics (summed over their labels); None where
    the server exports none."""
    try:
        status, text = target.get("/metrics")
    except (OSError, http.client.HTTPException):
        return None
    if status != 200:
        return None
    found: dict[str, float] = {}
    for line in text.decode(errors="replace").splitlines():
        if line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0].removesuffix("_total")
        if name in SPEC_COUNTERS:
            try:
                found[name] = found.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
            except ValueError:
                continue
    return found if len(found) == len(SPEC_COUNTERS) else None


def gaps_between_arrivals(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Seconds before each request: 0 at an infinite rate, else gamma-distributed with mean
    1/rate (shape `burstiness`: 1 is a Poisson process)."""
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    return [rng.gammavariate(burstiness, 1.0 / (rate * burstiness)) for _ in range(n)]


def _requests(args: argparse.Namespace, model: str) -> list[tuple[str, dict]]:
    """(endpoint path, body) per request: `--num-prompts` of them (the prompts cycled; a traffic
    file's lines once each by default), each naming the served `model`."""
    bodies: list[tuple[str, dict]] = []
    if args.traffic:
        from specdecode.advise import read_traffic

        read = read_traffic(args.traffic, args.max_tokens)  # (a clear error for a bad file)
        for bad in read.bad_lines:
            print(f"skipped: {bad}", flush=True)
        usable = {r.line: r for r in read.requests}
        with open(args.traffic, encoding="utf-8-sig", errors="replace") as f:
            for n, line in enumerate(f, 1):
                if n not in usable:
                    continue
                raw, url = json.loads(line), None
                if isinstance(raw, dict) and isinstance(raw.get("body"), dict) and "url" in raw:
                    url, raw = raw["url"], raw["body"]  # (a Batch API line, as advise reads it)
                if isinstance(raw, dict) and ("messages" in raw or "prompt" in raw):
                    chat = "/v1/chat/completions" if "messages" in raw else "/v1/completions"
                    url, body = url or chat, {"max_tokens": args.max_tokens, **raw}
                else:  # a bare message list, or a Responses body as chat (all its options)
                    body, url = _as_chat(raw, args.max_tokens), "/v1/chat/completions"
                bodies.append((url, body))
    else:
        from specdecode.bench import workloads

        for messages in workloads.load(args.workload, args.num_prompts or 32):
            body = {"messages": messages, "max_tokens": args.max_tokens,
                    "temperature": args.temperature}  # fmt: skip
            if args.ignore_eos:
                body["ignore_eos"] = True  # (vLLM's and this server's extension)
            bodies.append(("/v1/chat/completions", body))
    out = []
    for i in range(args.num_prompts or len(bodies)):
        path, body = bodies[i % len(bodies)]
        # the served model, whatever the line named (a Batch API file names OpenAI's models)
        body = {**body, "model": model, "stream": True, "stream_options": {"include_usage": True}}
        out.append((path, body))
    return out


def _as_chat(raw, max_tokens: int) -> dict:
    """A bare message list or a Responses body as a chat completions body (the server's own
    translation, every option kept)."""
    if isinstance(raw, list):
        return {"messages": raw, "max_tokens": max_tokens}
    from specdecode.serving.protocol import ResponsesRequest

    chat = ResponsesRequest.model_validate(raw).as_chat()
    body = chat.model_dump(exclude_unset=True, exclude_none=True)
    if "max_tokens" not in body and "max_completion_tokens" not in body:
        body["max_tokens"] = max_tokens
    return body


def _served_model(target: Target) -> str:
    try:
        status, text = target.get("/v1/models")
    except (OSError, http.client.HTTPException) as e:
        raise InvalidRequestError(f"no server at {target.host}:{target.port}: {e}") from None
    if status != 200:
        raise InvalidRequestError(f"GET /v1/models answered {status}: {text[:200]!r}")
    try:
        return json.loads(text)["data"][0]["id"]
    except (ValueError, KeyError, IndexError, TypeError):
        raise InvalidRequestError(
            f"GET /v1/models names no model ({text[:200]!r}): give --served-model-name"
        ) from None


def _stats(values: list[float]) -> dict:
    if not values:
        return {"mean_ms": None, "median_ms": None, "p99_ms": None}
    # (interpolated between ranks, as numpy's percentile and so vLLM's benchmark)
    p99 = (
        values[0]
        if len(values) == 1
        else statistics.quantiles(values, n=100, method="inclusive")[98]
    )
    return {
        "mean_ms": 1000 * statistics.mean(values),
        "median_ms": 1000 * statistics.median(values),
        "p99_ms": 1000 * p99,
    }


def summarize(outcomes: list[Outcome], duration: float, spec: dict | None) -> dict:
    """Every request's outcome (a failed one included) over the run's duration."""
    done = [o for o in outcomes if o.ok]
    out_tokens = sum(o.output_tokens for o in done)
    in_tokens = sum(o.prompt_tokens for o in done)
    tpot = [
        (o.e2el - o.ttft) / (o.output_tokens - 1)
        for o in done
        if o.ttft is not None and o.output_tokens > 1
    ]
    result = {
        "completed": len(done),
        "failed": len(outcomes) - len(done),
        "errors": sorted({o.error for o in outcomes if not o.ok})[:5],
        "duration_s": duration,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(done) / duration if duration > 0 else None,
        "output_throughput": out_tokens / duration if duration > 0 else None,
        "total_token_throughput": (in_tokens + out_tokens) / duration if duration > 0 else None,
        "ttft": _stats([o.ttft for o in done if o.ttft is not None]),
        "tpot": _stats(tpot),
        "itl": _stats([g for o in done for g in o.gaps]),
        "e2el": _stats([o.e2el for o in done]),
    }
    if spec is not None:
        drafts, drafted, accepted = (spec[k] for k in SPEC_COUNTERS)
        result["speculative"] = {
            "drafts": drafts,
            "draft_tokens": drafted,
            "accepted_tokens": accepted,
            "acceptance_rate": accepted / drafted if drafted else None,
            "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
        }
    return result


def run_http_bench(args: argparse.Namespace) -> dict:
    target = Target(args.base_url, args.api_key, args.timeout)
    model = args.served_model_name or _served_model(target)
    requests = _requests(args, model)
    gaps = gaps_between_arrivals(len(requests), args.request_rate, args.burstiness, args.seed)
    before = spec_counters(target)
    outcomes: list[Outcome] = [Outcome(error="not sent") for _ in requests]

    def one(i: int) -> None:
        try:
            outcomes[i] = _stream(target, *requests[i])
        except Exception as e:  # noqa: BLE001 - counted as failed, with what it was
            outcomes[i] = Outcome(error=f"{type(e).__name__}: {e}"[:300])

    # the pool's threads are the slots: a request waits for one, and its clock starts when it
    # is sent; the schedule goes on meanwhile (arrival times fixed from the start)
    workers = args.max_concurrency or min(len(requests), MAX_THREADS)
    print(f"{len(requests)} requests to {args.base_url} ({model}), rate {args.request_rate} "
          f"/s, at most {workers} in flight", flush=True)  # fmt: skip
    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=workers) as pool:
        due = start
        for i, gap in enumerate(gaps):
            due += gap
            if (wait := due - time.perf_counter()) > 0:
                time.sleep(wait)
            pool.submit(one, i)
    duration = time.perf_counter() - start
    if any(o.no_usage for o in outcomes if o.ok):
        print("note: the server sent no usage: output tokens are counted as streamed updates "
              "(an undercount where an update carries several)", flush=True)  # fmt: skip
    after = spec_counters(target)
    spec = (
        {k: after[k] - before[k] for k in SPEC_COUNTERS} if before is not None and after else None
    )
    result = {
        "base_url": args.base_url,
        "model": model,
        "source": args.traffic or f"workload {args.workload}",
        "num_prompts": len(requests),
        "request_rate": args.request_rate,
        "burstiness": args.burstiness,
        "max_concurrency": workers,
        "max_tokens": args.max_tokens,
        **summarize(outcomes, duration, spec),
    }
    print(report(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
        print(f"wrote {args.json}")
    if not result["completed"]:
        raise SpecDecodeError(
            f"no request completed ({result['failed']} failed: {'; '.join(result['errors'])})"
        )
    return result


def report(r: dict) -> str:
    def num(v, spec=".2f") -> str:
        return "-" if v is None else format(v, spec)

    lines = [
        f"{'Successful requests:':<36}{r['completed']}",
        f"{'Failed requests:':<36}{r['failed']}",
        f"{'Benchmark duration (s):':<36}{r['duration_s']:.2f}",
        f"{'Total input tokens:':<36}{r['total_input_tokens']}",
        f"{'Total generated tokens:':<36}{r['total_output_tokens']}",
        f"{'Request throughput (req/s):':<36}{num(r['request_throughput'])}",
        f"{'Output token throughput (tok/s):':<36}{num(r['output_throughput'])}",
        f"{'Total token throughput (tok/s):':<36}{num(r['total_token_throughput'])}",
    ]
    for key, name in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2EL")):
        s = r[key]
        lines.append(
            f"{name + ' mean / median / p99 (ms):':<36}{num(s['mean_ms'])} / "
            f"{num(s['median_ms'])} / {num(s['p99_ms'])}"
        )
    if r.get("speculative") and not r["speculative"]["drafts"]:
        lines.append(f"{'Speculation (server counters):':<36}no drafts in this run")
    elif r.get("speculative"):
        s = r["speculative"]
        lines.append(
            f"{'Speculation (server counters):':<36}acceptance {num(s['acceptance_rate'], '.1%')}"
            f", mean acceptance length {num(s['mean_acceptance_length'])}"
        )
    if r["errors"]:
        lines.append("Errors: " + "; ".join(r["errors"]))
    return "\n".join(lines)


def add_args(p: argparse.ArgumentParser) -> None:
    from specdecode.argtypes import number, output_file, temperature
    from specdecode.bench import at_least, workloads

    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server")
    p.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    p.add_argument(
        "--served-model-name", default=None, help="the model name sent (default: the server's)"
    )
    p.add_argument("--workload", default="chat", choices=list(workloads.WORKLOADS))
    p.add_argument("--traffic", default=None, help="a JSONL file of request bodies to replay")
    p.add_argument(
        "--num-prompts",
        type=at_least(1),
        default=None,
        help="requests sent, the prompts cycled (default: 32, or each --traffic line once)",
    )
    p.add_argument("--max-tokens", type=at_least(1), default=128)
    p.add_argument("--temperature", type=temperature, default=0.0, help="(workload prompts)")
    p.add_argument(
        "--ignore-eos",
        action="store_true",
        help="(workload prompts) every answer max-tokens long (vLLM's flag)",
    )
    p.add_argument(
        "--request-rate",
        type=lambda t: math.inf if t.strip().lower() in ("inf", "infinity") else number(above=0)(t),
        default=math.inf,
        help="requests per second (default inf: all at once)",
    )
    p.add_argument(
        "--burstiness",
        type=number(above=0),
        default=1.0,
        help="gamma shape of the gaps between arrivals: 1 Poisson, below 1 burstier",
    )
    p.add_argument(
        "--max-concurrency",
        type=at_least(1),
        default=None,
        help=f"requests in flight at most (default: all, up to {MAX_THREADS}: a thread each)",
    )
    p.add_argument("--seed", type=int, default=0, help="of the arrival times")
    p.add_argument(
        "--timeout",
        type=number(above=0),
        default=600.0,
        help="seconds a request may wait for a byte",
    )
    p.add_argument("--json", type=output_file, default=None, help="also write the results here")
