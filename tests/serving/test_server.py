"""The OpenAI-compatible server, driven over loopback by the official `openai` client and by raw
HTTP: outputs equal plain greedy decoding whatever shares the batch, bad input gets a 4xx and
the server keeps serving, a client that leaves frees its memory, one failing request fails
alone, and hundreds of concurrent streams lose or duplicate nothing."""

from __future__ import annotations

import asyncio
import functools
import http.client
import json
import logging
import socket
import threading
import time
from collections import defaultdict

import openai
import pytest
import uvicorn

from specdecode import LLM, SamplingParams
from specdecode.config import EngineConfig
from specdecode.engine.engine import LLMEngine
from specdecode.errors import InvalidRequestError, SpecDecodeError
from specdecode.serving.async_engine import AsyncLLMEngine
from specdecode.serving.server import ServerConfig, build_app

MODEL = "tiny"
KEY = "sk-test"
QUESTIONS = ["abcabcabc", "Hello Hello", "xyz", "1212121212", "count: 1 2 3", "aaaa"]


class Served:
    def __init__(
        self, engine: AsyncLLMEngine, api_key: str | None, aliases=(), trust=False, **extra
    ) -> None:
        config = ServerConfig(MODEL, api_key=api_key, max_request_bytes=20_000, aliases=aliases,
                              trust_request_chat_template=trust, **extra)  # fmt: skip
        app = build_app(engine, config)
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="error"))
        self.thread = threading.Thread(target=self.server.run, args=([self.sock],), daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    core = LLMEngine(
        EngineConfig(
            model=str(tiny_llama_dir),
            max_num_seqs=256,
            speculative_config={
                "method": "ngram",
                "num_speculative_tokens": 3,
                "prompt_lookup_min": 1,
            },  # fmt: skip
        )
    )
    eng = AsyncLLMEngine(core)
    eng.start()
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def served(engine):
    s = Served(engine, api_key=None)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{served.port}/v1", api_key="none")


@pytest.fixture(scope="module")
def plain(tiny_llama_dir):
    return LLM(str(tiny_llama_dir))


def chat_messages(q: str) -> list[dict]:
    return [{"role": "user", "content": q}]


def expected(plain: LLM, q: str, n: int, **params) -> str:
    p = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **params)
    return plain.chat(chat_messages(q), p)[0].outputs[0].text


def raw(port: int, method: str, path: str, body: bytes | None = None, headers=None):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request(method, path, body=body, headers={"Content-Type": "application/json",
                                                   **(headers or {})})  # fmt: skip
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    return resp.status, data


def idle(engine: AsyncLLMEngine, timeout: float = 30.0) -> bool:
    """Everything freed: no request state anywhere, every cache block back."""
    core = engine.engine
    deadline = time.time() + timeout
    while time.time() < deadline:
        if core.num_tracked() == 0 and core.manager.num_free_blocks == core.manager.num_blocks - 1:
            return True
        time.sleep(0.05)
    return False


def test_models_health_and_metrics(served, client, engine):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert raw(served.port, "GET", "/health")[0] == 200
    assert raw(served.port, "POST", "/ping")[0] == raw(served.port, "GET", "/ping")[0] == 200
    from specdecode import __version__

    assert json.loads(raw(served.port, "GET", "/version")[1]) == {"version": __version__}
    engine.engine.set_policy("static")  # drafts for sure, whatever the controller would pick
    try:
        client.chat.completions.create(
            model=MODEL, messages=chat_messages("abcabcabcabc"), max_tokens=12, temperature=0
        )
    finally:
        engine.engine.set_policy("adaptive")
    status, body = raw(served.port, "GET", "/metrics")
    text = body.decode()
    assert status == 200
    names = (
        "vllm:spec_decode_num_drafts_total",
        "vllm:spec_decode_num_draft_tokens_total",
        "vllm:spec_decode_num_accepted_tokens_total",
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="tiny",position="0"}',
        "specdecode:speculative_budget",
        "vllm:time_to_first_token_seconds_bucket",
    )
    for name in names:
        assert name in text
    drafts = next(line for line in text.splitlines()
                  if line.startswith("vllm:spec_decode_num_draft_tokens_total"))  # fmt: skip
    assert float(drafts.split()[-1]) > 0


def test_chat_equals_plain_greedy(client, plain):
    for q in QUESTIONS[:3]:
        r = client.chat.completions.create(
            model=MODEL, messages=chat_messages(q), max_tokens=20, temperature=0,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        assert r.choices[0].message.content == expected(plain, q, 20)
        assert r.choices[0].finish_reason == "length"
        assert r.usage.completion_tokens == 20
        assert r.usage.total_tokens == r.usage.prompt_tokens + 20


def test_streaming_reassembles_with_usage(client, plain):
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=chat_messages("Hello Hello"), max_tokens=24, temperature=0,
            stream=True, stream_options={"include_usage": True}, n=2,
            extra_body={"ignore_eos": True},
        )
    )  # fmt: skip
    texts = {0: "", 1: ""}
    finish = {}
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] += ch.delta.content or ""
            if ch.finish_reason:
                finish[ch.index] = ch.finish_reason
    want = expected(plain, "Hello Hello", 24)
    assert texts == {0: want, 1: want}
    assert finish == {0: "length", 1: "length"}
    assert chunks[-1].usage.completion_tokens == 48
    assert all(c.usage is None for c in chunks[:-1])
    # vLLM's continuous_usage_stats: each update's chunk carries its choice's usage so far
    chunks = list(
        client.completions.create(
            model=MODEL, prompt=["abc", "xyzxyz"], max_tokens=6, temperature=0, stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
            extra_body={"ignore_eos": True},
        )
    )  # fmt: skip
    counts = {0: 0, 1: 0}
    for c in chunks[:-1]:
        i = c.choices[0].index
        assert c.usage.prompt_tokens == (3, 6)[i] and c.usage.completion_tokens > counts[i]
        counts[i] = c.usage.completion_tokens
        assert c.usage.total_tokens == c.usage.prompt_tokens + counts[i]
    assert counts == {0: 6, 1: 6} and chunks[-1].usage.completion_tokens == 12
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=chat_messages("abc"), max_tokens=3, temperature=0, n=2,
            stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True},
        )
    )  # fmt: skip
    assert chunks[0].choices[0].delta.role == "assistant"  # the role chunk has its usage too
    assert chunks[0].usage.completion_tokens == 0 and all(c.usage for c in chunks)


def test_completions_prompts_n_seed_stop_and_logprobs(client, plain):
    kw = dict(model=MODEL, prompt=["abcabc", "xyz"], max_tokens=10, temperature=1.0, n=2, seed=5)
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1, 2, 3]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]  # seeded
    assert a.choices[0].text != a.choices[1].text or a.choices[2].text != a.choices[3].text
    neg = dict(kw, seed=-1)  # OpenAI's seed is an int64: a negative one is a seed too
    c, d = client.completions.create(**neg), client.completions.create(**neg)
    assert [x.text for x in c.choices] == [x.text for x in d.choices]
    assert [x.text for x in c.choices] != [x.text for x in a.choices]
    want = plain.generate("abcabc", SamplingParams(temperature=0, max_tokens=12))[0].outputs[0]
    stop = want.text[5:7]
    r = client.completions.create(
        model=MODEL, prompt="abcabc", max_tokens=12, temperature=0, stop=[stop], logprobs=2
    )
    c = r.choices[0]
    assert c.finish_reason == "stop" and c.text == want.text[: want.text.index(stop)]
    assert len(c.logprobs.tokens) == r.usage.completion_tokens
    assert all(len(top) == 2 for top in c.logprobs.top_logprobs)
    assert all(lp <= 0 for lp in c.logprobs.token_logprobs)
    r = client.chat.completions.create(
        model=MODEL, messages=chat_messages("xyz"), max_tokens=6, temperature=0, logprobs=True,
        top_logprobs=3,
    )  # fmt: skip
    content = r.choices[0].logprobs.content
    assert len(content) == 6 and all(len(t.top_logprobs) == 3 for t in content)
    assert "".join(t.token for t in content) == r.choices[0].message.content
    assert content[0].logprob == pytest.approx(content[0].top_logprobs[0].logprob)  # greedy


HI = [{"role": "user", "content": "hi"}]


def body(**fields) -> bytes:
    return json.dumps({"messages": HI, **fields}).encode()


BAD = [
    (b"{not json", 400),
    (b'{"messages": [{"role": "user", "content": "caf\xe9"}]}', 400),  # not UTF-8
    (b"[1, 2]", 400),
    (body(messages=[]), 400),
    (body(messages=[{"role": "robot", "content": "hi"}]), 400),
    (body(temperature="hot"), 400),
    (body(max_tokens=-3), 400),
    (body(max_tokens=10**9), 400),
    (body(n=1000), 400),
    (body(top_p=0), 400),
    (body(messages=[{"role": "user", "content": "x" * 400}]), 400),  # longer than the context
    (body(model="gpt-9"), 404),
    (body(messages=[{"role": "user", "content": "x" * 30_000}]), 413),
    (body(presence_penalty=2.5), 400),  # sampling fields out of their ranges
    (body(frequency_penalty=-3), 400),
    (body(repetition_penalty=0), 400),
    (body(min_p=1.5), 400),
    (body(min_tokens=-1), 400),
    (body(min_tokens=8, max_tokens=4), 400),
    (body(logit_bias={"abc": 1}), 400),
    (body(logit_bias={"5": 101}), 400),
    (body(logit_bias={"10000000": 1}), 400),  # not a token of the vocabulary
    (body(seed=2**64), 400),  # not a 64-bit integer (a negative int64 is one: see below)
    (body(max_tokens=1)[:-1] + b', "seed": 1' + b"1" * 5000 + b"}", 400),  # past int() digits
    (body(messages=[{"role": "user", "content": "ab\ud800cd"}]), 400),  # a lone surrogate
]


def test_penalties_bias_min_p_and_min_tokens_reach_the_request():
    from specdecode.serving.protocol import ChatCompletionRequest

    req = ChatCompletionRequest(
        messages=HI, presence_penalty=0.5, frequency_penalty=-0.25, repetition_penalty=1.2,
        min_p=0.05, min_tokens=3, logit_bias={"17": -100, "4": 2.5},
    )  # fmt: skip
    p = req.sampling_params(8, None)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.5, -0.25, 1.2)
    assert (p.min_p, p.min_tokens, p.logit_bias) == (0.05, 3, {17: -100, 4: 2.5})
    p = ChatCompletionRequest(messages=HI).sampling_params(8, None)
    assert (p.presence_penalty, p.repetition_penalty, p.min_tokens, p.logit_bias) == (
        0.0, 1.0, 0, None
    )  # fmt: skip


def test_unsupported_sampling_fields_are_refused_unless_neutral():
    from specdecode.serving.protocol import CompletionRequest

    neutral = CompletionRequest(prompt="x", best_of=1)
    assert neutral.sampling_params(4, None).max_tokens == 4
    for field, value in (("best_of", 2), ("use_beam_search", True)):
        with pytest.raises(InvalidRequestError, match=field):
            CompletionRequest(prompt="x", **{field: value}).sampling_params(4, None)
    # prompt logprobs come with the whole response
    assert (
        CompletionRequest(prompt="x", prompt_logprobs=0).sampling_params(4, None).prompt_logprobs
        == 0
    )
    with pytest.raises(InvalidRequestError, match="prompt_logprobs"):
        CompletionRequest(prompt="x", prompt_logprobs=1, stream=True).sampling_params(4, None)
    # tool calling is not implemented: tools pass only where the request says not to call one
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    for choice in (None, "auto", "required", {"type": "function", "function": {"name": "f"}}):
        with pytest.raises(InvalidRequestError, match="tool calling is not supported"):
            CompletionRequest(prompt="x", tools=[tool], tool_choice=choice).sampling_params(4, None)
    CompletionRequest(prompt="x", tools=[tool], tool_choice="none").sampling_params(4, None)
    with pytest.raises(InvalidRequestError, match="functions"):
        CompletionRequest(prompt="x", functions=[tool["function"]]).sampling_params(4, None)


@pytest.mark.parametrize("payload,status", BAD)
def test_bad_input_is_a_4xx_and_the_server_keeps_serving(served, client, payload, status):
    got, data = raw(served.port, "POST", "/v1/chat/completions", payload)
    assert got == status, data
    err = json.loads(data)["error"]
    assert err["message"] and err["type"] and err["code"] == status
    ok = client.chat.completions.create(model=MODEL, messages=chat_messages("hi"), max_tokens=3)
    assert ok.choices[0].message.content is not None


def test_null_fields_take_their_defaults(served, client):
    """OpenAI marks n, stream, logprobs, echo... nullable: a JSON null means the default."""
    nulls = {k: None for k in ("n", "stream", "logprobs", "ignore_eos", "top_logprobs")}
    got, data = raw(served.port, "POST", "/v1/chat/completions", body(max_tokens=3, **nulls))
    assert got == 200, data
    assert len(json.loads(data)["choices"]) == 1
    req = {"prompt": "abc", "max_tokens": 3, "echo": None, "n": None, "stream": None}
    got, data = raw(served.port, "POST", "/v1/completions", json.dumps(req).encode())
    assert got == 200, data


def test_completion_top_logprobs_hold_the_sampled_token(client):
    """The legacy API lists the sampled token among each position's top logprobs (up to
    logprobs + 1 entries), as OpenAI and vLLM do; logprobs 0 lists only it."""
    for n in (0, 1):
        r = client.completions.create(
            model=MODEL, prompt="abcabc", max_tokens=8, temperature=1, seed=3, logprobs=n
        )
        lp = r.choices[0].logprobs
        for tok, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
            assert top[tok] == pytest.approx(value) and len(top) <= n + 1
            if n == 0:
                assert len(top) == 1


def test_bad_completion_prompts_and_routes(served):
    for bad in ({"prompt": []}, {"prompt": [[1, 2], [999999]]}):
        got, data = raw(served.port, "POST", "/v1/completions", json.dumps(bad).encode())
        assert got == 400, (bad, data)
    assert raw(served.port, "GET", "/v1/nothing")[0] == 404
    assert raw(served.port, "GET", "/v1/chat/completions")[0] == 405


def test_api_key(engine):
    s = Served(engine, api_key=KEY)
    try:
        req = body(max_tokens=2)
        assert raw(s.port, "POST", "/v1/chat/completions", req)[0] == 401
        bad = {"Authorization": "Bearer nope"}
        assert raw(s.port, "POST", "/v1/chat/completions", req, bad)[0] == 401
        good = {"Authorization": f"Bearer {KEY}"}
        assert raw(s.port, "POST", "/v1/chat/completions", req, good)[0] == 200
        assert raw(s.port, "GET", "/health")[0] == 200
    finally:
        s.stop()


def test_client_disconnect_mid_stream_frees_the_request(served, engine, monkeypatch):
    assert idle(engine)
    core = engine.engine
    step = core.step

    def slow_step():  # so the request is surely still running when the client leaves
        time.sleep(0.01)
        return step()

    monkeypatch.setattr(core, "step", slow_step)
    monkeypatch.setattr(core.controller, "policy", "off")  # a token a step, whatever it plans
    before = core.num_generated_tokens
    body = json.dumps({"messages": chat_messages("abc"), "max_tokens": 200, "stream": True,
                       "temperature": 0, "ignore_eos": True})  # fmt: skip
    conn = http.client.HTTPConnection("127.0.0.1", served.port, timeout=30)
    conn.request("POST", "/v1/chat/completions", body=body,
                 headers={"Content-Type": "application/json"})  # fmt: skip
    resp = conn.getresponse()
    assert resp.status == 200
    assert resp.read(6) == b"data: "  # streaming has begun
    # the first chunk (the assistant role) goes out before any token: leave after a second one,
    # so a token was surely generated (leaving at once made the lower bound below flaky)
    resp.readline()  # the rest of the first chunk
    line = b"\n"
    while line and not line.startswith(b"data: "):  # until the second chunk begins
        line = resp.readline()
    assert line, "the stream ended before its first token"
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    assert idle(engine), "the abandoned request must be aborted and its memory freed"
    assert 0 < core.num_generated_tokens - before < 200  # it was cut short


@pytest.mark.parametrize("api_key", [None, KEY], ids=["open", "keyed"])
def test_client_disconnect_before_a_full_response_frees_the_request(engine, monkeypatch, api_key):
    """A non-streaming request whose client leaves is aborted too (with or without the API key
    check in front of the route, which must not hide the disconnect)."""
    s = Served(engine, api_key=api_key)
    try:
        assert idle(engine)
        core = engine.engine
        step = core.step

        def slow_step():
            time.sleep(0.02)
            return step()

        monkeypatch.setattr(core, "step", slow_step)
        monkeypatch.setattr(core.controller, "policy", "off")  # a token a step
        before = core.num_generated_tokens
        body = json.dumps({"messages": chat_messages("abc"), "max_tokens": 200,
                           "temperature": 0, "ignore_eos": True})  # fmt: skip
        headers = {"Content-Type": "application/json"}
        if api_key:
            headers["Authorization"] = f"Bearer {api_key}"
        conn = http.client.HTTPConnection("127.0.0.1", s.port, timeout=30)
        conn.request("POST", "/v1/chat/completions", body=body, headers=headers)
        deadline = time.time() + 10
        while core.num_generated_tokens == before and time.time() < deadline:
            time.sleep(0.01)  # until it is generating
        conn.sock.shutdown(socket.SHUT_RDWR)
        conn.close()
        assert idle(engine), "the abandoned request must be aborted and its memory freed"
        assert 0 < core.num_generated_tokens - before < 200  # it was cut short
    finally:
        s.stop()


def test_an_exception_in_one_request_fails_only_that_request(served, engine, client, plain):
    core = engine.engine
    real = core.output.append

    def faulty(seq, tokens, logprobs=None):
        if "BOOM" in core.tokenizer.decode(seq.prompt_token_ids) and seq.output_token_ids:
            raise RuntimeError("injected fault")
        return real(seq, tokens, logprobs)

    core.output.append = faulty
    try:

        async def run():
            aclient = openai.AsyncOpenAI(
                base_url=f"http://127.0.0.1:{served.port}/v1", api_key="none", max_retries=0
            )
            calls = [
                aclient.chat.completions.create(
                    model=MODEL,
                    messages=chat_messages(q),
                    max_tokens=15,
                    temperature=0,
                    extra_body={"ignore_eos": True},
                )  # fmt: skip
                for q in ["BOOM", *QUESTIONS[:4]]
            ]
            return await asyncio.gather(*calls, return_exceptions=True)

        results = asyncio.run(run())
    finally:
        core.output.append = real
    assert isinstance(results[0], openai.InternalServerError)
    for q, r in zip(QUESTIONS[:4], results[1:], strict=True):
        assert r.choices[0].message.content == expected(plain, q, 15)
    assert engine.num_failed_requests >= 1
    assert idle(engine)


def test_one_failing_choice_of_several_answers_with_its_own_error(served, engine):
    """n=2 with the second choice failing while the first still runs: the response is the
    failed choice's error, not a 500 about reading an unfinished choice."""
    core = engine.engine
    real = core.output.append

    def faulty(seq, tokens, logprobs=None):
        if seq.request_id.endswith("-1"):
            raise RuntimeError("injected fault")
        return real(seq, tokens, logprobs)

    core.output.append = faulty
    try:
        got, data = raw(served.port, "POST", "/v1/completions", json.dumps(
            {"prompt": "hello", "n": 2, "max_tokens": 40, "ignore_eos": True, "temperature": 0}
        ).encode())  # fmt: skip
    finally:
        core.output.append = real
    err = json.loads(data)["error"]
    assert got == 500 and "injected fault" in err["message"], data
    assert idle(engine)


def test_steps_that_fail_before_running_anything_fail_the_open_requests(served, engine, client):
    """A step that raises before any request ran (scheduling, calibration) names no suspect:
    after a few in a row the open requests get the error instead of waiting forever."""
    core = engine.engine
    real = core.step

    def broken():
        core.last_batch = []
        raise RuntimeError("cannot schedule")

    core.step = broken
    try:
        got, data = raw(served.port, "POST", "/v1/completions",
                        json.dumps({"prompt": "hello", "max_tokens": 5}).encode())  # fmt: skip
    finally:
        core.step = real
    assert got == 500 and "cannot schedule" in json.loads(data)["error"]["message"], data
    assert idle(engine)
    ok = client.chat.completions.create(model=MODEL, messages=chat_messages("hi"), max_tokens=3)
    assert ok.choices[0].message.content is not None  # and the server goes on


def test_a_request_after_the_engine_stopped_is_told_so(tiny_llama_dir):
    from specdecode.serving.async_engine import EngineStoppedError

    engine = AsyncLLMEngine(LLMEngine(EngineConfig(model=str(tiny_llama_dir))))
    engine.start()
    try:

        async def late():
            # the loop stopped after `add` checked (simulated): the stream still ends, with why
            engine.shutdown()
            engine._stop = False
            handle = engine.add([65, 66], SamplingParams(max_tokens=3))

            async def read():
                return [u async for u in handle.updates()]

            return await asyncio.wait_for(read(), timeout=10)

        (update,) = asyncio.run(late())
        assert update.error and "stopped" in update.error
        engine._stop = True
        with pytest.raises(EngineStoppedError):
            asyncio.run(asyncio.to_thread(engine.add, [65], SamplingParams(max_tokens=3)))
    finally:
        engine.shutdown()
    s = Served(engine, api_key=None)
    try:
        got, data = raw(s.port, "POST", "/v1/completions", json.dumps({"prompt": "hi"}).encode())
        assert got == 503, data
    finally:
        s.stop()


def test_load_hundreds_of_concurrent_streams(served, engine, plain):
    """300 concurrent streaming clients, greedy and seeded sampling mixed in one batch: no
    errors, every stream equals its plain output token for token, memory back to baseline."""
    n_clients, max_tokens = 300, 12
    jobs = [(QUESTIONS[i % len(QUESTIONS)], (i % 3) * 0.5, i) for i in range(n_clients)]
    want = {}
    for q, t, seed in jobs:
        p = SamplingParams(temperature=t, seed=seed, max_tokens=max_tokens, ignore_eos=True)
        want[seed] = plain.chat(chat_messages(q), p)[0].outputs[0].text

    async def one(aclient, q, t, seed):
        stream = await aclient.chat.completions.create(
            model=MODEL, messages=chat_messages(q), max_tokens=max_tokens, temperature=t,
            seed=seed, stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        text, usage = "", None
        async for c in stream:
            if c.choices:
                text += c.choices[0].delta.content or ""
            if c.usage:
                usage = c.usage
        return seed, text, usage.completion_tokens

    async def run():
        aclient = openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{served.port}/v1", api_key="none", max_retries=0,
            timeout=300,
        )  # fmt: skip
        return await asyncio.gather(*(one(aclient, *j) for j in jobs), return_exceptions=True)

    results = asyncio.run(run())
    errors = [r for r in results if isinstance(r, BaseException)]
    assert not errors, errors[:3]
    for seed, text, completion in results:
        assert text == want[seed]
        assert completion == max_tokens
    assert idle(engine)


def test_response_format_json_schema_and_guided_regex(served, client):
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 6}, "ok": {"type": "boolean"}},
        "required": ["name", "ok"],
        "additionalProperties": False,
    }
    r = client.chat.completions.create(
        model=MODEL, messages=chat_messages("abc"), max_tokens=60, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
    )  # fmt: skip
    value = json.loads(r.choices[0].message.content)
    assert set(value) == {"name", "ok"} and r.choices[0].finish_reason == "stop"
    chunks = client.chat.completions.create(
        model=MODEL, messages=chat_messages("abc"), max_tokens=60, temperature=0, stream=True,
        extra_body={"guided_regex": "[ab]{2,5}x"},
    )  # fmt: skip
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert __import__("re").fullmatch("[ab]{2,5}x", text)
    status, data = raw(
        served.port, "POST", "/v1/chat/completions",
        body(response_format={"type": "json_schema", "json_schema": {"schema": {"type": 7}}}),
    )  # fmt: skip
    assert status == 400 and "json" in json.loads(data)["error"]["message"]
    assert json.loads(data)["error"]["param"] == "response_format"
    status, data = raw(served.port, "POST", "/v1/completions",
                       json.dumps({"prompt": "abc", "guided_regex": "é+"}).encode())  # fmt: skip
    # the vocabulary cannot write it: found mid-generation, named as the compile errors are
    assert status == 400 and json.loads(data)["error"]["param"] == "guided_regex"
    streamed = {"prompt": "abc", "guided_regex": "é+", "stream": True}
    status, data = raw(served.port, "POST", "/v1/completions", json.dumps(streamed).encode())
    event = json.loads(data.decode().split("data: ")[1])
    assert status == 200 and event["error"]["param"] == "guided_regex", data
    status, data = raw(served.port, "POST", "/v1/completions",
                       json.dumps({"prompt": "abc", "guided_regex": "("}).encode())  # fmt: skip
    assert status == 400 and json.loads(data)["error"]["param"] == "guided_regex"  # its own
    status, data = raw(served.port, "POST", "/v1/completions",
                       json.dumps({"prompt": "abc", "guided_choice": []}).encode())  # fmt: skip
    assert status == 400 and json.loads(data)["error"]["param"] == "guided_choice"
    status, data = raw(served.port, "POST", "/v1/completions",
                       json.dumps({"prompt": "x" * 400}).encode())  # fmt: skip
    assert status == 400 and json.loads(data)["error"]["param"] == "prompt"  # not "messages"
    choices = ["yes", 'say "no"', "maybe\\"]  # quotes and backslashes are literal
    for n, extra in enumerate(
        ({"guided_choice": choices}, {"structured_outputs": {"choice": choices}})
    ):
        r = client.completions.create(
            model=MODEL, prompt="abc", max_tokens=20, temperature=1.0, seed=n, n=4, extra_body=extra
        )
        assert all(c.text in choices and c.finish_reason == "stop" for c in r.choices), r.choices


def test_streamed_completion_logprobs_offsets_run_on(client):
    chunks = client.completions.create(
        model=MODEL, prompt="abcabc", max_tokens=10, temperature=0, logprobs=1, stream=True
    )
    tokens, offsets = [], []
    for c in chunks:
        for ch in c.choices:
            if ch.logprobs:
                tokens += ch.logprobs.tokens
                offsets += ch.logprobs.text_offset
    assert len(tokens) == 10
    assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]


@pytest.fixture(scope="module")
def word_dir(tiny_llama_dir, tmp_path_factory):
    """The tiny model with a SentencePiece-style tokenizer (Metaspace): a token's leading
    space shows only after another token, as with Llama 2's and Mistral's tokenizers."""
    import shutil

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    out = tmp_path_factory.mktemp("words")
    for f in tiny_llama_dir.iterdir():
        if f.suffix in (".json", ".safetensors") and "token" not in f.name:
            shutil.copy(f, out / f.name)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"\u2581w{i}": i for i in range(3, 128)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="always")
    tok.decoder = decoders.Metaspace(prepend_scheme="always")
    tok.save(str(out / "tokenizer.json"))
    _write_tokenizer_config(out)
    return out


def test_logprob_tokens_add_up_to_the_text_with_a_sentencepiece_tokenizer(word_dir):
    """Each token's text is decoded where it follows the tokens before it, so the logprob
    tokens join into the choice's text (alone, every `▁wN` would lose its space), and the text
    starts as it follows the prompt, as vLLM's detokenizer gives it."""
    core = LLMEngine(EngineConfig(model=str(word_dir)))
    eng = AsyncLLMEngine(core)
    eng.start()
    s = Served(eng, api_key=None)
    try:
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{s.port}/v1", api_key="none")
        prompt = "w5 w6 w7"
        extra = {"ignore_eos": True}
        r = c.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0,
                                 logprobs=2, extra_body=extra)  # fmt: skip
        text, lp = r.choices[0].text, r.choices[0].logprobs
        assert text.startswith(" w") and text.count(" w") == 8, text
        assert "".join(lp.tokens) == text
        assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(8)]
        assert all(t.startswith(" w") for top in lp.top_logprobs for t in top)
        streamed = c.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0,
                                        logprobs=1, stream=True, extra_body=extra)  # fmt: skip
        tokens, offsets, pieces = [], [], []
        for chunk in streamed:
            for ch in chunk.choices:
                pieces.append(ch.text)
                if ch.logprobs:
                    tokens += ch.logprobs.tokens
                    offsets += ch.logprobs.text_offset
        assert "".join(pieces) == text and tokens == lp.tokens and offsets == lp.text_offset
        ask = [{"role": "user", "content": prompt}]
        chat = c.chat.completions.create(model=MODEL, messages=ask, max_tokens=6, temperature=0,
                                         logprobs=True, extra_body=extra)  # fmt: skip
        content = chat.choices[0].logprobs.content
        assert "".join(t.token for t in content) == chat.choices[0].message.content
    finally:
        s.stop()
        eng.shutdown()


def test_penalties_over_http_match_the_offline_api(client, plain):
    """The served request carries its penalties, bias and min_tokens: the text is what the
    offline API gives with the same parameters (and not the unpenalised one)."""
    fields = dict(presence_penalty=0.8, frequency_penalty=0.4, logit_bias={str(ord("c")): 3.0})
    extra = dict(repetition_penalty=1.4, min_tokens=4)
    r = client.completions.create(
        model=MODEL, prompt="abcabc", max_tokens=12, temperature=0, extra_body=extra, **fields
    )
    params = SamplingParams(temperature=0, max_tokens=12, presence_penalty=0.8,
                            frequency_penalty=0.4, logit_bias={ord("c"): 3.0},
                            repetition_penalty=1.4, min_tokens=4)  # fmt: skip
    want = plain.generate("abcabc", params)[0].outputs[0].text
    assert r.choices[0].text == want
    assert (
        want
        != plain.generate("abcabc", SamplingParams(temperature=0, max_tokens=12))[0].outputs[0].text
    )


def test_a_served_chat_template_of_ones_own(tiny_llama_dir):
    core = LLMEngine(
        EngineConfig(model=str(tiny_llama_dir), chat_template="{{ messages[-1]['content'] }}!")
    )
    eng = AsyncLLMEngine(core)
    eng.start()
    served = Served(eng, api_key=None)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{served.port}/v1", api_key="none")
        r = client.chat.completions.create(
            model=MODEL, messages=chat_messages("abc"), max_tokens=6, temperature=0
        )
        p = SamplingParams(temperature=0, max_tokens=6)
        assert (
            r.choices[0].message.content
            == LLM(str(tiny_llama_dir)).generate("abc!", p)[0].outputs[0].text
        )
        assert r.usage.prompt_tokens == 4
    finally:
        served.stop()
        eng.shutdown()


TAGGED = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}{{ tail }}"
)


def test_vllm_chat_options(engine, served, client, plain):
    """vLLM's chat fields: a request's own template (only where the server trusts one),
    `add_generation_prompt`, `chat_template_kwargs` as template variables,
    `continue_final_message` with `echo` (the reply starts with the message it continues)."""
    p = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    extra = {"ignore_eos": True}
    for field in ({"chat_template": TAGGED}, {"chat_template_kwargs": {"chat_template": TAGGED}}):
        with pytest.raises(openai.BadRequestError, match="--trust-request-chat-template") as e:
            client.chat.completions.create(model=MODEL, messages=chat_messages("abc"),
                                           max_tokens=2, extra_body=field)  # fmt: skip
        assert e.value.body["param"] == next(iter(field))
    trusted = Served(engine, api_key=None, trust=True, response_role="bot")
    try:
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{trusted.port}/v1", api_key="none")

        def ask(messages, **body):
            return c.chat.completions.create(
                model=MODEL,
                messages=messages,
                max_tokens=6,
                temperature=0,
                extra_body={**extra, **body},
            )

        def want(text):
            return plain.generate(text, p)[0].outputs[0].text

        r = ask(chat_messages("abc"), chat_template=TAGGED)
        assert r.choices[0].message.content == want("<user>abc<assistant>")
        assert r.usage.prompt_tokens == len("<user>abc<assistant>")  # a token per character
        r = ask(chat_messages("abc"), chat_template_kwargs={"chat_template": TAGGED, "tail": "!"},
                add_generation_prompt=False)  # fmt: skip
        assert r.choices[0].message.content == want("<user>abc!")
        docs = "{{ documents[0].title }}{{ messages[0].content }}"
        r = ask(chat_messages("abc"), chat_template=docs, documents=[{"title": "xy", "text": ""}])
        assert r.choices[0].message.content == want("xyabc")
        prefill = [*chat_messages("abc"), {"role": "assistant", "content": "abcab"}]
        r = ask(prefill, chat_template=TAGGED, add_generation_prompt=False,
                continue_final_message=True, echo=True)  # fmt: skip
        assert r.choices[0].message.content == "abcab" + want("<user>abc<assistant>abcab")
        lp = (
            ask(
                prefill,
                chat_template=TAGGED,
                add_generation_prompt=False,
                continue_final_message=True,
                echo=True,
                logprobs=True,
            )
            .choices[0]
            .logprobs
        )
        assert len(lp.content) == 6  # the generated tokens' (chat lists no prompt tokens)
        chunks = c.chat.completions.create(
            model=MODEL, messages=prefill, max_tokens=6, temperature=0, stream=True,
            extra_body={**extra, "chat_template": TAGGED, "add_generation_prompt": False,
                        "continue_final_message": True, "echo": True},
        )  # fmt: skip
        pieces = [ch.choices[0].delta.content for ch in chunks if ch.choices]
        assert pieces[:2] == ["", "abcab"]
        assert "".join(pieces) == r.choices[0].message.content
        # the reply's role (vLLM's): --response-role after a generation prompt, else the last
        # message's, which echo repeats
        r = ask(chat_messages("abc"), chat_template=TAGGED, add_generation_prompt=False,
                echo=True)  # fmt: skip
        assert r.choices[0].message.role == "user"
        assert r.choices[0].message.content == "abc" + want("<user>abc")
        chunks = c.chat.completions.create(
            model=MODEL, messages=chat_messages("abc"), max_tokens=6, temperature=0, stream=True,
            extra_body={**extra, "chat_template": TAGGED, "add_generation_prompt": False},
        )  # fmt: skip
        deltas = [ch.choices[0].delta for ch in chunks if ch.choices]
        assert deltas[0].role == "user" and "".join(d.content or "" for d in deltas) == want(
            "<user>abc"
        )
        # echo repeats only the reply's own role; the model's template by default
        r = ask(chat_messages("abc"), echo=True)
        assert r.choices[0].message.content == expected(plain, "abc", 6)
        assert r.choices[0].message.role == "bot"
        bad = [
            ({"continue_final_message": True}, "add_generation_prompt=False",
             "continue_final_message"),
            ({"chat_template_kwargs": {"tokenize": True}}, "tokenize", "chat_template_kwargs"),
            ({"chat_template_kwargs": {"add_generation_prompt": False}}, "option of its own",
             "chat_template_kwargs"),
            ({"add_generation_prompt": "no"}, "boolean", "add_generation_prompt"),
        ]  # fmt: skip
        for body, message, param in bad:
            with pytest.raises(openai.BadRequestError, match=message) as e:
                ask(prefill, **body)
            assert e.value.body["param"] == param, body
    finally:
        trusted.stop()


def test_responses_api(client, plain):
    """OpenAI's Responses API (vLLM and SGLang serve it): `input` and `instructions` rendered as
    chat messages, the reply as a `response` object or its stream of typed events (read by the
    openai SDK's own client), `text.format` as structured output, logprobs on request."""
    p = SamplingParams(temperature=0, max_tokens=6)
    want = plain.chat(chat_messages("abc"), p)[0].outputs[0]
    r = client.responses.create(model=MODEL, input="abc", max_output_tokens=6, temperature=0)
    assert r.output_text == want.text and r.object == "response" and r.id.startswith("resp_")
    assert r.status == ("incomplete" if want.finish_reason == "length" else "completed")
    prompt = len(client_prompt_ids(plain, "abc"))
    assert (r.usage.input_tokens, r.usage.output_tokens) == (prompt, len(want.token_ids))
    # instructions come first, as a system message; input items in their roles and parts
    items = [
        {"role": "user", "content": "ab"},
        {"role": "assistant", "content": "c"},
        {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": "x"}, {"type": "input_text", "text": "y"}],
        },
    ]
    conv = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "ab"},
            {"role": "assistant", "content": "c"}, {"role": "user", "content": "xy"}]  # fmt: skip
    r = client.responses.create(model=MODEL, input=items, instructions="be brief",
                                max_output_tokens=6, temperature=0)  # fmt: skip
    assert r.output_text == plain.chat(conv, p)[0].outputs[0].text
    # streamed: the SDK's events, the deltas joining to the whole reply
    events = list(client.responses.create(model=MODEL, input="abc", max_output_tokens=6,
                                          temperature=0, stream=True))  # fmt: skip
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]  # fmt: skip
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done",
                            "response.output_item.done"]  # fmt: skip
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert deltas == want.text == final.output_text
    assert kinds[-1] == "response.completed" and final.usage.input_tokens == prompt
    assert final.status == ("incomplete" if want.finish_reason == "length" else "completed")
    # text.format: a JSON schema (structured output); logprobs where include asks for them
    fmt = {"type": "json_schema", "name": "answer", "schema": {"enum": ["yes", "no"]}}
    r = client.responses.create(
        model=MODEL, input="abc", max_output_tokens=8, temperature=0, text={"format": fmt},
        include=["message.output_text.logprobs"], top_logprobs=2,
    )  # fmt: skip
    assert json.loads(r.output_text) in ("yes", "no") and r.text.format.type == "json_schema"
    lp = r.output[0].content[0].logprobs
    # (a token the grammar forced lists itself alone, at probability 1)
    assert len(lp) == r.usage.output_tokens and {len(t.top_logprobs) for t in lp} <= {1, 2}
    assert any(len(t.top_logprobs) == 2 for t in lp)
    bad = [
        ({"previous_response_id": "resp_1"}, "keeps no responses", "previous_response_id"),
        ({"input": [{"type": "computer_call"}]}, "'computer_call' are not supported", "input"),
        ({"input": [{"type": "reasoning", "content": "x"}]}, "must be text parts", "input"),
        ({"input": [{"role": "wizard", "content": "x"}]}, r"input\[0\]\.role", "input"),
        ({"top_logprobs": 2}, "include", "top_logprobs"),
        ({"max_output_tokens": 10**6}, "maximum context length", "max_output_tokens"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "schema", "text"),
        ({"tools": [{"type": "function", "name": "f"}]}, "--enable-auto-tool-choice",
         "tool_choice"),
        ({"tools": [{"type": "web_search"}]}, "only function tools", "tools"),
        ({"input": [{"type": "function_call_output", "output": "x"}]}, "call_id", "input"),
        ({"text": {"format": {"type": "foo"}}}, "text.format type 'foo'", "text"),
        ({"input": {"a": 1}}, "- input: ", "input"),  # (not "input.str": a union member)
        ({"extra_body": {"priority": 1}}, "--scheduling-policy priority", "priority"),
        # (a format this vocabulary cannot write: found mid-generation, the field named)
        ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"enum": ["é"]}}}},
         "cannot be continued", "text"),
    ]  # fmt: skip
    for body, message, param in bad:
        with pytest.raises(openai.BadRequestError, match=message) as e:
            client.responses.create(**{"model": MODEL, "input": "abc", **body})
        assert e.value.body["param"] == param, body
    # vLLM's logit_bias: a token pushed to the top is the reply (a character a token here)
    r = client.responses.create(model=MODEL, input="abc", max_output_tokens=3, temperature=0,
                                extra_body={"logit_bias": {str(ord("q")): 100}})  # fmt: skip
    assert r.output_text == "qqq"
    with pytest.raises(openai.NotFoundError):  # (this server keeps no responses)
        client.responses.retrieve("resp_1")
    # a failure mid-stream: an error event, then response.failed (as OpenAI ends)
    fmt = {"type": "json_schema", "name": "x", "schema": {"enum": ["é"]}}
    events = list(client.responses.create(model=MODEL, input="abc", text={"format": fmt},
                                          stream=True))  # fmt: skip
    assert [e.type for e in events[-2:]] == ["error", "response.failed"]
    assert events[-2].param == "text" and events[-1].response.status == "failed"
    assert not events[-1].response.store


def test_stored_responses_continue_a_conversation(engine, plain):
    """serve --max-stored-responses N (vLLM's in-memory store): a stored response is continued
    by previous_response_id (its conversation, without its instructions, as in OpenAI's),
    returned by GET and removed by DELETE; the least recently used goes past N; `store: false`
    keeps nothing."""
    s = Served(engine, api_key=None, max_stored_responses=2)
    try:
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{s.port}/v1", api_key="none")
        p = SamplingParams(temperature=0, max_tokens=4)

        def ask(**kw):
            return c.responses.create(model=MODEL, max_output_tokens=4, temperature=0, **kw)

        first = ask(input="ab", instructions="be brief")
        assert first.store
        again = ask(input="cd", previous_response_id=first.id, instructions="x")
        conv = [{"role": "system", "content": "x"}, {"role": "user", "content": "ab"},
                {"role": "assistant", "content": first.output_text},
                {"role": "user", "content": "cd"}]  # fmt: skip
        assert again.output_text == plain.chat(conv, p)[0].outputs[0].text
        assert again.previous_response_id == first.id
        streamed = list(c.responses.create(model=MODEL, input="ef", max_output_tokens=4,
                                           previous_response_id=again.id, stream=True,
                                           temperature=0))  # fmt: skip
        final = streamed[-1].response
        conv = [*conv[1:], {"role": "assistant", "content": again.output_text},
                {"role": "user", "content": "ef"}]  # fmt: skip
        assert final.output_text == plain.chat(conv, p)[0].outputs[0].text and final.store
        assert c.responses.retrieve(final.id).output_text == final.output_text
        with pytest.raises(openai.NotFoundError):  # the least recent of 3, past 2 kept
            c.responses.retrieve(first.id)
        c.responses.delete(final.id)
        with pytest.raises(openai.NotFoundError) as e:
            ask(input="x", previous_response_id=final.id)
        assert e.value.body["param"] == "previous_response_id"
        assert not ask(input="x", store=False).store
    finally:
        s.stop()


def test_tokenize_and_detokenize(served, engine, plain):
    """vLLM's /tokenize (a prompt, or messages rendered as chat completions render them) and
    /detokenize; behind the API key like /v1/."""

    def post(path, body, port=served.port, headers=None):
        status, data = raw(port, "POST", path, json.dumps(body).encode(), headers)
        return status, json.loads(data)

    status, r = post("/tokenize", {"prompt": "abcabc", "return_token_strs": True})
    assert status == 200
    assert r["tokens"] == plain.encode("abcabc") and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == engine.engine.max_model_len
    assert "".join(r["token_strs"]).endswith("abcabc")
    chat = client_prompt_ids(plain, "xyz")
    status, r = post("/tokenize", {"messages": chat_messages("xyz")})
    assert status == 200 and r["tokens"] == chat and "token_strs" not in r
    assert post("/detokenize", {"tokens": r["tokens"]})[1] == {
        "prompt": plain.tokenizer.decode(chat)
    }
    for path, body, param in [
        ("/tokenize", {"prompt": "a", "messages": chat_messages("b")}, None),
        ("/tokenize", {}, None),
        ("/tokenize", {"messages": chat_messages("b"), "chat_template": "x"}, "chat_template"),
        ("/detokenize", {"tokens": [1, 10**6]}, "tokens"),
        ("/detokenize", {"tokens": "abc"}, "tokens"),
        ("/tokenize", {"prompt": "a", "model": "nope"}, "model"),
    ]:  # fmt: skip
        status, r = post(path, body)
        assert status in (400, 404) and r["error"]["param"] == param, (body, r)
    keyed = Served(engine, api_key=KEY)
    try:
        assert post("/tokenize", {"prompt": "a"}, keyed.port)[0] == 401
        auth = {"Authorization": f"Bearer {KEY}"}
        assert post("/detokenize", {"tokens": [97]}, keyed.port, auth)[0] == 200
    finally:
        keyed.stop()


def test_return_token_ids(client, plain):
    """vLLM's `return_token_ids`: the prompt's ids (per completions choice, once for chat) and
    each choice's generated ids, whole or streamed (each chunk's new ids; the prompt's in a
    choice's first chunk)."""
    p = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    ids = [ord(c) for c in "abcabc"]
    want = plain.generate({"prompt_token_ids": ids}, p)[0].outputs[0].token_ids
    extra = {"ignore_eos": True, "return_token_ids": True}
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0, n=2,
                                  extra_body=extra).model_dump()  # fmt: skip
    for c in r["choices"]:
        assert c["prompt_token_ids"] == ids and c["token_ids"] == want
    chunks = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0,
                                       stream=True, extra_body=extra)  # fmt: skip
    parts = [c.model_dump()["choices"][0] for c in chunks if c.choices]
    assert [c.get("prompt_token_ids") for c in parts] == [ids] + [None] * (len(parts) - 1)
    assert sum((c["token_ids"] for c in parts), []) == want
    chunks = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0,
                                       stream=True, echo=True, extra_body=extra)  # fmt: skip
    parts = [c.model_dump()["choices"][0] for c in chunks if c.choices]
    assert parts[0]["text"] == "abcabc" and parts[0]["prompt_token_ids"] == ids  # the echo
    assert all(c.get("prompt_token_ids") is None for c in parts[1:])
    chat_ids = client_prompt_ids(plain, "xyz")
    gen = plain.chat(chat_messages("xyz"), p)[0].outputs[0].token_ids
    r = client.chat.completions.create(model=MODEL, messages=chat_messages("xyz"), max_tokens=8,
                                       temperature=0, extra_body=extra).model_dump()  # fmt: skip
    assert r["prompt_token_ids"] == chat_ids and r["choices"][0]["token_ids"] == gen
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=chat_messages("xyz"), max_tokens=8, temperature=0, stream=True,
        extra_body=extra))  # fmt: skip
    assert chunks[0].model_dump()["prompt_token_ids"] == chat_ids
    assert sum((c.model_dump()["choices"][0].get("token_ids") or [] for c in chunks[1:]), []) == gen
    plain_r = client.completions.create(model=MODEL, prompt=ids, max_tokens=2).model_dump()
    assert "token_ids" not in plain_r["choices"][0]


def test_return_tokens_as_token_ids(engine, served):
    """serve --return-tokens-as-token-ids (vLLM's): logprob tokens read "token_id:N", their
    bytes stay the token's own; text offsets are unchanged."""
    s = Served(engine, api_key=None, return_tokens_as_token_ids=True)

    def post(path, body):
        return json.loads(raw(s.port, "POST", path, json.dumps(body).encode())[1])

    try:
        body = {"prompt": "abc", "max_tokens": 3, "temperature": 0, "logprobs": 1, "echo": True,
                "ignore_eos": True}  # fmt: skip
        lp = post("/v1/completions", body)["choices"][0]["logprobs"]
        assert lp["tokens"][:3] == [f"token_id:{ord(ch)}" for ch in "abc"]
        assert all(t.startswith("token_id:") for t in lp["tokens"])
        assert all(k.startswith("token_id:") for k in lp["top_logprobs"][1])
        assert lp["text_offset"][:4] == [0, 1, 2, 3]
        body = {"messages": chat_messages("x"), "max_tokens": 2, "logprobs": True}
        content = post("/v1/chat/completions", body)["choices"][0]["logprobs"]["content"]
        assert all(e["token"].startswith("token_id:") for e in content)
        assert all(e["bytes"] and not bytes(e["bytes"]).startswith(b"token_id") for e in content)
        # the request's own field wins over the flag, either way
        body = {
            "prompt": "abc",
            "max_tokens": 2,
            "logprobs": 0,
            "return_tokens_as_token_ids": False,
        }
        assert not post("/v1/completions", body)["choices"][0]["logprobs"]["tokens"][0].startswith(
            "token_id:"
        )
    finally:
        s.stop()
    body = {"prompt": "abc", "max_tokens": 2, "logprobs": 0, "return_tokens_as_token_ids": True}
    status, data = raw(served.port, "POST", "/v1/completions", json.dumps(body).encode())
    assert json.loads(data)["choices"][0]["logprobs"]["tokens"][0].startswith("token_id:")


def client_prompt_ids(plain: LLM, q: str) -> list[int]:
    """The ids a chat request's prompt has (the model's template, no special tokens added)."""
    return plain._chat_ids(chat_messages(q))


def test_a_repeated_prefix_is_reported_cached(served, client):
    """usage.prompt_tokens_details.cached_tokens (OpenAI's field) and vLLM's prefix-cache
    counters: a prompt sharing an earlier one's first blocks reports them, n > 1 once."""
    doc = "Some shared context that many requests start with. " * 3  # 156 tokens
    first = client.completions.create(model=MODEL, prompt=doc + "A?", max_tokens=2)
    assert first.usage.prompt_tokens_details.cached_tokens in (0, 144)  # (a rerun of the test)
    again = client.completions.create(model=MODEL, prompt=doc + "B?", max_tokens=2, n=2)
    assert again.usage.prompt_tokens_details.cached_tokens == 144  # 9 full blocks of 16
    assert again.usage.prompt_tokens == first.usage.prompt_tokens
    text = raw(served.port, "GET", "/metrics")[1].decode()
    hits = next(x for x in text.splitlines() if x.startswith("vllm:prefix_cache_hits_total"))
    queries = next(x for x in text.splitlines() if x.startswith("vllm:prefix_cache_queries_total"))
    assert 144 <= float(hits.split()[-1]) < float(queries.split()[-1])


def test_errors_name_the_field_at_fault(served):
    """Range errors carry the request field in `param` (OpenAI's error body), the one the
    client sent; stream_options without stream is refused, as vLLM does."""
    cases = [
        (body(max_tokens=10**6), "max_tokens"),
        (body(max_completion_tokens=10**6), "max_completion_tokens"),
        (body(logit_bias={"10000000": 1}), "logit_bias"),  # past the vocabulary
        (body(stop_token_ids=[10_000_000]), "stop_token_ids"),
        (body(stop_token_ids=[-1]), "stop_token_ids"),
        (body(priority=2), "priority"),  # (the priority policy is off)
        (body(priority="high"), "priority"),
        (body(stream_options={"include_usage": True}), "stream_options"),
        (body(stream=False, stream_options={"include_usage": True}), "stream_options"),
        (body(stream_options={"continuous_usage_stats": False, "x": 1}), "stream_options"),
        (body(messages=[{"role": "user", "content": "ab\ud800cd"}]), "messages"),
        # OpenAI's: a user turn needs content (it generated from the template alone), and a
        # flag is a boolean
        (body(messages=[{"role": "user"}]), "messages.0"),
        (
            body(stream=True, stream_options={"include_usage": "yes"}),
            "stream_options.include_usage",
        ),
    ]
    for payload, param in cases:
        got, data = raw(served.port, "POST", "/v1/chat/completions", payload)
        err = json.loads(data)["error"]
        assert (got, err["param"]) == (400, param), (payload, data)
    prompt = {"prompt": "abc", "stream_options": {"include_usage": True}}
    got, data = raw(served.port, "POST", "/v1/completions", json.dumps(prompt).encode())
    assert (got, json.loads(data)["error"]["param"]) == (400, "stream_options")
    assert "stream: true" in json.loads(data)["error"]["message"]
    got, data = raw(served.port, "POST", "/v1/chat/completions",
                    body(messages=[{"role": "user", "content": "\ud800"}]))  # fmt: skip
    assert json.loads(data)["error"]["message"] == "the text of the messages is not valid Unicode"
    # an empty or null stream_options asks for nothing: it passes, as in vLLM
    for options in ({}, None):
        got, data = raw(served.port, "POST", "/v1/chat/completions",
                        body(max_tokens=2, stream_options=options))  # fmt: skip
        assert got == 200, data


def test_head_probes_of_health_and_metrics(served):
    for path in ("/health", "/metrics"):
        status, data = raw(served.port, "HEAD", path)
        assert (status, data) == (200, b"")


def test_a_request_may_name_the_model_by_an_alias(engine):
    """A model served as `qwen2.5-coder-1.5b` also answers to its Hugging Face id (what a
    client written for vLLM sends); responses carry the served name; others are 404."""
    s = Served(engine, api_key=None, aliases=("Org/Tiny-Instruct",))
    try:
        for name in (MODEL, "Org/Tiny-Instruct", None):
            got, data = raw(s.port, "POST", "/v1/chat/completions", body(max_tokens=2, model=name))
            assert got == 200 and json.loads(data)["model"] == MODEL, data
        assert raw(s.port, "POST", "/v1/chat/completions", body(model="org/tiny"))[0] == 404
    finally:
        s.stop()


def test_echo_prepends_the_prompt_to_each_choice(client, plain):
    """`echo`: each choice's text starts with its prompt (token id prompts decoded); streamed,
    the prompt comes first, then the generated text, as vLLM sends it."""
    p = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    want = {q: plain.generate(q, p)[0].outputs[0].text for q in ("abcabc", "xyz")}
    extra = {"ignore_eos": True}
    r = client.completions.create(model=MODEL, prompt=["abcabc", "xyz"], max_tokens=6, n=2,
                                  temperature=0, echo=True, extra_body=extra)  # fmt: skip
    texts = [c.text for c in r.choices]
    assert texts == [q + want[q] for q in ("abcabc", "abcabc", "xyz", "xyz")]
    assert r.usage.completion_tokens == 24  # the echo is not generated
    ids = [ord(c) for c in "xyz"]  # the test tokenizer: one token per ASCII character
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0,
                                  echo=True, extra_body=extra)  # fmt: skip
    assert r.choices[0].text == "xyz" + want["xyz"]
    chunks = client.completions.create(model=MODEL, prompt="xyz", max_tokens=6, temperature=0,
                                       echo=True, stream=True, extra_body=extra)  # fmt: skip
    pieces = [c.choices[0].text for c in chunks if c.choices]
    assert pieces[0] == "xyz" and "".join(pieces) == "xyz" + want["xyz"]


def test_prompt_logprobs_and_echo_with_logprobs(client, plain, engine, monkeypatch):
    """vLLM's `prompt_logprobs`, and echo with logprobs (what evaluation harnesses send to
    score a text): the prompt's tokens come first, the first with no logprob; each scores as
    it did when it was generated, and the text offsets index the echoed text."""
    ids = [ord(c) for c in "abcabcab"]
    p = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0)
    gen = plain.generate({"prompt_token_ids": ids}, p)[0].outputs[0]
    want = [d[t].logprob for t, d in zip(gen.token_ids, gen.logprobs, strict=True)]
    full = ids + gen.token_ids
    r = client.completions.create(model=MODEL, prompt=full, max_tokens=1, temperature=0,
                                  echo=True, logprobs=1, n=2)  # fmt: skip
    for choice in r.choices:
        lp = choice.logprobs
        assert len(lp.tokens) == len(full) + 1 and lp.token_logprobs[0] is None
        assert lp.top_logprobs[0] is None and len(lp.top_logprobs[1]) in (1, 2)
        assert lp.token_logprobs[len(ids) : len(full)] == pytest.approx(want, abs=1e-4)
        # a character a token; the generated one starts where the echoed text ends
        assert lp.text_offset == list(range(len(full) + 1))
        assert "".join(lp.tokens) == choice.text
    # streamed (as vLLM streams it): each choice's echo chunk lists the prompt's tokens, and
    # its chunks join to the whole response's choice, for several prompts of several choices
    prompts, extra = [full, ids[:5]], {"ignore_eos": True}
    whole = client.completions.create(model=MODEL, prompt=prompts, max_tokens=4, temperature=0,
                                      echo=True, logprobs=2, n=2, extra_body=extra)  # fmt: skip
    chunks = client.completions.create(model=MODEL, prompt=prompts, max_tokens=4, temperature=0,
                                       echo=True, logprobs=2, n=2, stream=True,
                                       extra_body={**extra, "return_token_ids": True})  # fmt: skip
    joined = {i: {"text": "", "ids": [], "lp": defaultdict(list)} for i in range(4)}
    for ch in chunks:
        for c in ch.choices:
            got = joined[c.index]
            got["text"] += c.text
            got["ids"] += c.model_extra.get("prompt_token_ids") or []
            for key, value in c.logprobs.model_dump().items():
                got["lp"][key] += value
    for i, choice in enumerate(whole.choices):
        got = joined[i]
        assert got["text"] == choice.text and got["ids"] == prompts[i // 2]
        assert got["lp"]["tokens"] == choice.logprobs.tokens
        assert got["lp"]["text_offset"] == choice.logprobs.text_offset
        assert got["lp"]["token_logprobs"] == pytest.approx(choice.logprobs.token_logprobs)
        assert len(got["lp"]["top_logprobs"]) == len(choice.logprobs.top_logprobs)
    # a prompt's other choices whose updates come before its first choice's wait for its echo
    add = engine.add

    def slow_first(ids, params, request_id="", priority=0):
        handle = add(ids, params, request_id, priority)
        if request_id.endswith("-0"):
            updates = handle.updates

            async def late():
                await asyncio.sleep(0.5)
                async for u in updates():
                    yield u

            handle.updates = late
        return handle

    monkeypatch.setattr(engine, "add", slow_first)
    chunks = list(client.completions.create(model=MODEL, prompt=full, max_tokens=4, n=2,
                                            temperature=0, echo=True, logprobs=2, stream=True,
                                            extra_body=extra))  # fmt: skip
    assert [c.index for c in chunks[0].choices] == [0, 1]  # the echo, of both choices
    assert chunks[1].choices[0].index == 1  # then what waited
    for i in (0, 1):
        lp = defaultdict(list)
        for c in (c for ch in chunks for c in ch.choices if c.index == i):
            for key, value in c.logprobs.model_dump().items():
                lp[key] += value
        assert lp["tokens"] == whole.choices[0].logprobs.tokens
    monkeypatch.undo()
    r = client.completions.create(model=MODEL, prompt=full, max_tokens=1, temperature=0,
                                  extra_body={"prompt_logprobs": 2})  # fmt: skip
    got = r.model_dump()["choices"][0]["prompt_logprobs"]
    assert got[0] is None and len(got) == len(full)
    for tok, entry, lp in zip(gen.token_ids, got[len(ids) :], want, strict=True):
        assert list(entry)[0] == str(tok) and 1 <= len(entry) <= 3
        assert entry[str(tok)]["logprob"] == pytest.approx(lp, abs=1e-4)
    extra = {"prompt_logprobs": 0}
    chat = client.chat.completions.create(
        model=MODEL, messages=chat_messages("abc"), max_tokens=2, extra_body=extra
    )
    body = chat.model_dump()
    assert len(body["prompt_logprobs"]) == chat.usage.prompt_tokens
    assert all(len(e) == 1 for e in body["prompt_logprobs"][1:])


@pytest.fixture(scope="module")
def byte_dir(tiny_llama_dir, tmp_path_factory):
    """The tiny model with a byte-level BPE tokenizer (GPT-2's, SmolLM2's, Llama 3's kind):
    ASCII, the four bytes of 🎉 as tokens of their own and the first two merged, so a token
    can end inside a character."""
    import shutil

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    out = tmp_path_factory.mktemp("bytes")
    for f in tiny_llama_dir.iterdir():
        if f.suffix in (".json", ".safetensors") and "token" not in f.name:
            shutil.copy(f, out / f.name)
    pre = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    (party, _), (space, _) = pre.pre_tokenize_str("🎉")[0], pre.pre_tokenize_str(" ")[0]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for symbol in (space, *map(chr, range(33, 127)), *party, party[:2]):
        vocab.setdefault(symbol, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[(party[0], party[1])]))
    tok.pre_tokenizer = pre
    tok.decoder = decoders.ByteLevel()
    tok.save(str(out / "tokenizer.json"))
    _write_tokenizer_config(out)
    return out


def test_logprob_bytes_rebuild_characters_split_over_tokens(byte_dir):
    """A token that ends inside a character reads U+FFFD (as in vLLM), and its `bytes` are its
    own (OpenAI's): joined, they are the text's UTF-8. The legacy API's text_offset counts the
    text's characters before each token, so it never runs past the text."""
    core = LLMEngine(EngineConfig(model=str(byte_dir)))
    eng = AsyncLLMEngine(core)
    eng.start()
    s = Served(eng, api_key=None)
    try:
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{s.port}/v1", api_key="none")
        force = {"guided_regex": "🎉🎉", "ignore_eos": True}  # 4 to 8 tokens
        r = c.chat.completions.create(model=MODEL, messages=chat_messages("a b"), max_tokens=6,
                                      temperature=0, logprobs=True, top_logprobs=2,
                                      extra_body=force)  # fmt: skip
        text, content = r.choices[0].message.content, r.choices[0].logprobs.content
        joined = b"".join(bytes(t.bytes) for t in content)
        assert text and joined.startswith(text.encode()) and joined.decode(errors="ignore") == text
        assert any(t.token == "\ufffd" and t.bytes != [0xEF, 0xBF, 0xBD] for t in content)
        for t in content:
            for alt in t.top_logprobs:  # every alternative's bytes too
                assert alt.token != "\ufffd" or alt.bytes != [0xEF, 0xBF, 0xBD]
        want = [len(b"".join(bytes(t.bytes) for t in content[:i]).decode(errors="ignore"))
                for i in range(len(content))]  # fmt: skip
        r = c.completions.create(model=MODEL, prompt="a b", max_tokens=6, temperature=0,
                                 logprobs=1, extra_body=force)  # fmt: skip
        assert r.choices[0].text == text
        assert r.choices[0].logprobs.text_offset == want
        assert max(want) <= len(text) < len(content)
        streamed = c.completions.create(model=MODEL, prompt="a b", max_tokens=6, temperature=0,
                                        logprobs=1, stream=True, extra_body=force)  # fmt: skip
        offsets = [o for ch in streamed for x in ch.choices if x.logprobs
                   for o in x.logprobs.text_offset]  # fmt: skip
        assert offsets == want
    finally:
        s.stop()
        eng.shutdown()


@pytest.mark.slow
def test_emoji_logprob_bytes_with_the_default_model():
    """The report's case on SmolLM2 (named by its Hugging Face id, in lower case): three-token
    emojis whose tokens each read U+FFFD."""
    from specdecode.models.loader import DEFAULT_HUB_ID

    core = LLMEngine(EngineConfig(model=DEFAULT_HUB_ID.lower()))
    eng = AsyncLLMEngine(core)
    eng.start()
    s = Served(eng, api_key=None)
    try:
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{s.port}/v1", api_key="none")
        ask = chat_messages("Reply only with three party emojis 🎉🎉🎉")
        r = c.chat.completions.create(model=MODEL, messages=ask, max_tokens=8, temperature=0,
                                      logprobs=True, top_logprobs=1)  # fmt: skip
        text, content = r.choices[0].message.content, r.choices[0].logprobs.content
        assert text == "🎉🎉" and [t.token for t in content] == ["\ufffd"] * 8
        assert [t.bytes for t in content[:3]] == [[0xF0, 0x9F], [0x8E], [0x89]]
        assert all(t.top_logprobs[0].bytes == t.bytes for t in content)  # greedy
        r = c.completions.create(model=MODEL, prompt="🎉🎉🎉🎉", max_tokens=6, temperature=0,
                                 logprobs=1)  # fmt: skip
        assert r.choices[0].text == "🎉🎉"
        assert r.choices[0].logprobs.text_offset == [0, 0, 0, 1, 1, 1]
    finally:
        s.stop()
        eng.shutdown()


def test_token_bytes_of_sentencepiece_byte_fallback_tokens():
    """SentencePiece's byte fallback (Llama 2, Mistral): a character outside the vocabulary is
    spelt `<0xHH>` tokens, each of which stands for its byte; other tokens' bytes are their
    text's, and a char-level vocabulary records none."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    from specdecode.serving.server import vocab_bytes

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "▁": 3, "a": 4, "▁a": 5,
             **{f"<0x{b:02X}>": 6 + i for i, b in enumerate("🎉".encode())}}  # fmt: skip
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[("▁", "a")], byte_fallback=True,
                               unk_token="<unk>"))  # fmt: skip
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])  # fmt: skip
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>")
    ids = hf("a🎉", add_special_tokens=False).input_ids
    assert hf.decode(ids) == "a🎉" and len(ids) == 5  # ▁a, then 4 byte tokens
    raw = vocab_bytes(hf)
    assert b"".join(raw(t) for t in ids[1:]) == "🎉".encode()
    assert raw(ids[0]) is None and raw(2) is None  # text, and a special token
    char_level = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(
        vocab={"<0xF0>": 0, "a": 1}, unk_token="a")))  # fmt: skip
    assert vocab_bytes(char_level)(1) is None


def _write_tokenizer_config(out) -> None:
    """The tokenizer_config.json of the fabricated tokenizers above (</s> ends, plain chat)."""
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": "</s>",
                "bos_token": "<s>",
                "unk_token": "<unk>",
                "chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}",
            }
        )
    )


def test_bench_http_measures_a_server_over_http(served, engine, plain, tmp_path, capsys):
    """`bench http` replays a traffic file against this server over loopback: every answer's
    tokens counted (the server's usage), a request the server refuses counted as failed with
    its reason, and the acceptance read from the server's vLLM counters on /metrics."""
    from specdecode.bench.http_load import gaps_between_arrivals, spec_counters
    from specdecode.cli import main

    lines = [{"messages": chat_messages(q), "max_tokens": 12, "temperature": 0,
              "ignore_eos": True} for q in QUESTIONS]  # fmt: skip
    # a Batch API line (naming OpenAI's model: the served one is sent) to a path the server
    # does not have, a Responses body (sent as chat), and a line advise refuses (not sent)
    lines.append({"custom_id": "1", "method": "POST", "url": "/v1/no-such-path",
                  "body": {"model": "gpt-4o-mini", "messages": chat_messages("hi")}})  # fmt: skip
    lines.append({"model": "gpt-4o-mini", "input": "abcabc", "max_output_tokens": 5})
    lines.append({"messages": chat_messages("hi"), "temperature": -1})
    traffic = tmp_path / "traffic.jsonl"
    traffic.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    out = tmp_path / "http.json"
    stats = engine.engine.spec_stats
    before = (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens)
    rc = main(["bench", "http", "--base-url", f"http://127.0.0.1:{served.port}/v1",
               "--traffic", str(traffic), "--max-concurrency", "3",
               "--json", str(out)])  # fmt: skip
    assert rc == 0
    r = json.loads(out.read_text())
    assert r["num_prompts"] == 8  # (each usable line once)
    assert (r["completed"], r["failed"]) == (7, 1) and "HTTP 404" in r["errors"][0]
    assert 6 * 12 < r["total_output_tokens"] <= 6 * 12 + 5
    chats = [chat_messages(q) for q in QUESTIONS] + [chat_messages("abcabc")]
    assert r["total_input_tokens"] == sum(len(plain._chat_ids(m)) for m in chats)
    assert 0 < r["ttft"]["mean_ms"] <= r["e2el"]["mean_ms"] and r["itl"]["mean_ms"] > 0
    # the server's counters over the run: what its engine counted (the adaptive policy may
    # have drafted little or nothing here, after the tests before)
    spec = r["speculative"]
    after = (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens)
    got = (spec["drafts"], spec["draft_tokens"], spec["accepted_tokens"])
    assert got == tuple(a - b for a, b in zip(after, before, strict=True))
    printed = capsys.readouterr().out
    assert "Successful requests:                7" in printed and "line 9" in printed
    # the counters it reads are this server's (vLLM's names)
    from specdecode.bench.http_load import Target

    assert spec_counters(Target(f"http://127.0.0.1:{served.port}", None, 10))
    assert gaps_between_arrivals(3, float("inf"), 1.0, 0) == [0.0, 0.0, 0.0]
    gaps = gaps_between_arrivals(4000, 10.0, 1.0, 0)
    assert abs(sum(gaps) / len(gaps) - 0.1) < 0.01  # a Poisson process of rate 10
    assert main(["bench", "http", "--base-url", "http://127.0.0.1:1", "--num-prompts", "1"]) == 2


@pytest.mark.parametrize("policy,calibrated", [("adaptive", True), ("static", False)])
def test_serve_times_its_step_costs_before_it_listens(tiny_llama_dir, monkeypatch, policy,
                                                      calibrated):  # fmt: skip
    """The adaptive policy's step-cost curve is timed while the server loads, not by the first
    requests' step (they waited ~3 s for it: a 5 s p99 TTFT in a `bench http` run)."""
    from specdecode.cli import build_parser
    from specdecode.serving.server import run_server

    events = []
    real = LLMEngine.calibrate

    def calibrate(self, *a, **k):
        events.append("calibrate")
        return real(self, *a, **k)

    class Listening:  # uvicorn's server, which here stops at once (and so stops the engine)
        def __init__(self, config):
            self.started, self.should_exit = True, False

        def run(self):
            events.append("listen")

    monkeypatch.setattr(LLMEngine, "calibrate", calibrate)
    monkeypatch.setattr(uvicorn, "Server", Listening)
    args = build_parser().parse_args(
        [
            "serve",
            "--model",
            str(tiny_llama_dir),
            "--port",
            "0",
            "--speculative-policy",
            policy,
            "--speculative-config",
            '{"method": "ngram"}',
        ]  # fmt: skip
    )
    run_server(args)
    assert events == (["calibrate", "listen"] if calibrated else ["listen"])


def test_a_copied_serve_commands_settings_reach_the_engine_and_the_http_server(
    tiny_llama_dir, monkeypatch, tmp_path
):
    """vLLM's flags of a copied command take their meaning: the block size and the priority
    policy reach the engine, a Unix socket and TLS files reach uvicorn, several served names,
    forced usage, request-id headers and the logprobs limit reach the server."""
    from specdecode.cli import build_parser
    from specdecode.serving import server as srv

    seen = {}
    real_build = srv.build_app

    def build_app(engine, config):
        seen["engine"], seen["config"] = engine, config
        return real_build(engine, config)

    class Listening:
        def __init__(self, config):
            seen["uvicorn"] = config
            self.started, self.should_exit = True, False

        def run(self):
            pass

    monkeypatch.setattr(srv, "build_app", build_app)
    monkeypatch.setattr(uvicorn, "Server", Listening)
    sock = str(tmp_path / "s.sock")
    key, cert = tmp_path / "k.pem", tmp_path / "c.pem"
    key.write_text("k")
    cert.write_text("c")
    args = build_parser().parse_args(
        ["serve", str(tiny_llama_dir), "--speculative-policy", "off", "--block-size", "32",
         "--scheduling-policy", "priority", "--uds", sock, "--ssl-keyfile", str(key),
         "--ssl-certfile", str(cert), "--served-model-name", "a", "b", "--max-logprobs", "3",
         "--enable-force-include-usage", "--enable-request-id-headers", "--reasoning-parser",
         "qwen3", "--structured-outputs-config.enable_in_reasoning", "true",
         "--enable-prompt-tokens-details", "--max-seq-len-to-capture", "8192", "-pp", "1"]
    )  # fmt: skip
    srv.run_server(args)
    engine, config, http = seen["engine"].engine, seen["config"], seen["uvicorn"]
    assert engine.config.block_size == 32 and engine.manager.block_size == 32
    assert engine.config.scheduling_policy == "priority"
    assert (http.uds, http.ssl_keyfile, http.ssl_certfile) == (sock, str(key), str(cert))
    assert (config.served_model_name, config.aliases, config.listed) == ("a", ("b",), ("b",))
    assert (config.max_logprobs, config.force_include_usage, config.request_id_headers) == (
        3, True, True)  # fmt: skip
    assert config.reasoning_parser == "qwen3" and config.reasoning_in_grammar
    # refused before anything loads
    for flags, message in (
        ("m --enable-reasoning", "needs --reasoning-parser"),
        (f"m --ssl-keyfile {key}", "need --ssl-certfile"),
        (f"m --ssl-certfile {tmp_path / 'none.pem'}", "no file"),
        ("--served-model-name a m", "name the model before --served-model-name"),
    ):
        with pytest.raises(SpecDecodeError, match=message):
            srv.run_server(build_parser().parse_args(["serve", *flags.split()]))


def test_usage_request_ids_and_the_logprobs_limit_when_asked(engine):
    """Several served names are all listed; --enable-force-include-usage: a stream ends with
    its usage unasked;
    --enable-request-id-headers: X-Request-Id, the client's own or a new one; --max-logprobs:
    more is a 400 naming the field."""
    s = Served(engine, api_key=None, force_include_usage=True, request_id_headers=True,
               max_logprobs=1, aliases=("other",), listed=("other",))  # fmt: skip
    try:
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{s.port}/v1", api_key="none")
        assert [m.id for m in c.models.list().data] == [MODEL, "other"]  # (vLLM's names)
        chunks = list(c.chat.completions.create(model=MODEL, messages=chat_messages("x"),
                                                max_tokens=3, stream=True))  # fmt: skip
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 3
        r = c.chat.completions.with_raw_response.create(
            model=MODEL, messages=chat_messages("x"), max_tokens=1,
            extra_headers={"X-Request-Id": "mine-1"})  # fmt: skip
        assert r.headers["x-request-id"] == "mine-1"
        conn = http.client.HTTPConnection("127.0.0.1", s.port)
        conn.request("GET", "/v1/models")
        assert len(conn.getresponse().getheader("x-request-id")) == 32  # a new one
        for ask, param in ((dict(logprobs=True, top_logprobs=2), "top_logprobs"),):
            with pytest.raises(openai.BadRequestError, match="--max-logprobs") as e:
                c.chat.completions.create(model=MODEL, messages=chat_messages("x"), max_tokens=1,
                                          **ask)  # fmt: skip
            assert e.value.body["param"] == param
        with pytest.raises(openai.BadRequestError, match="at most 1") as e:
            c.completions.create(model=MODEL, prompt="x", max_tokens=1, logprobs=2)
        assert e.value.body["param"] == "logprobs"
        assert c.completions.create(model=MODEL, prompt="x", max_tokens=1, logprobs=1).choices
    finally:
        s.stop()


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "weather",
        "description": "the weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 5}, "days": {"type": "integer",
                           "minimum": 1, "maximum": 9}},
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}  # fmt: skip
NOW_TOOL = {"type": "function", "function": {"name": "now"}}


def joined_calls(chunks) -> tuple[str, list[dict], list]:
    """A stream's content, its tool-call deltas joined (OpenAI's rule), its finish reasons."""
    content, calls, finishes = "", [], []
    for c in chunks:
        for ch in c.choices:
            content += ch.delta.content or ""
            for d in ch.delta.tool_calls or []:
                if d.id is not None:
                    assert d.index == len(calls) and d.type == "function"
                    calls.append({"id": d.id, "name": d.function.name,
                                  "arguments": d.function.arguments or ""})  # fmt: skip
                else:
                    calls[d.index]["arguments"] += d.function.arguments or ""
            if ch.finish_reason:
                finishes.append(ch.finish_reason)
    return content, calls, finishes


def test_tool_choice_required_and_named_are_constrained(client):
    """ "required": a JSON list of calls of the given tools, under the grammar (any model, no
    parser); a named function: its arguments. Streamed, the deltas join into the same calls."""
    ask = functools.partial(client.chat.completions.create, model=MODEL, max_tokens=120,
                            temperature=0, messages=chat_messages("weather?"))  # fmt: skip
    r = ask(tools=[WEATHER_TOOL, NOW_TOOL], tool_choice="required", parallel_tool_calls=False)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and msg.content is None
    assert len(msg.tool_calls) == 1  # (parallel_tool_calls false: one at most)
    call = msg.tool_calls[0]
    assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
    args = json.loads(call.function.arguments)
    if call.function.name == "weather":
        assert set(args) == {"city", "days"} and 1 <= args["days"] <= 9
    else:
        assert call.function.name == "now" and args == {}
    content, calls, finishes = joined_calls(
        ask(
            tools=[WEATHER_TOOL, NOW_TOOL],
            stream=True,
            tool_choice="required",
            parallel_tool_calls=False,
        )
    )
    assert content == "" and finishes == ["tool_calls"]
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (call.function.name, call.function.arguments)
    ]
    named = {"type": "function", "function": {"name": "weather"}}
    r = ask(tools=[WEATHER_TOOL, NOW_TOOL], tool_choice=named, n=2, temperature=1.0, seed=3)
    for choice in r.choices:
        (call,) = choice.message.tool_calls
        assert call.function.name == "weather" and choice.finish_reason == "stop"  # (OpenAI's)
        assert set(json.loads(call.function.arguments)) == {"city", "days"}
    content, calls, finishes = joined_calls(ask(tools=[WEATHER_TOOL], tool_choice=named,
                                                stream=True))  # fmt: skip
    assert len(calls) == 1 and calls[0]["name"] == "weather" and finishes == ["stop"]
    assert set(json.loads(calls[0]["arguments"])) == {"city", "days"}
    # "none": text, as without tools
    r = ask(tools=[WEATHER_TOOL], tool_choice="none", max_tokens=4, extra_body={"ignore_eos": True})
    assert r.choices[0].message.tool_calls is None and len(r.choices[0].message.content) == 4


def test_tool_choice_auto_parses_the_reply(engine, client):
    """ "auto" needs a parser (vLLM's flags); with one, a hermes-style reply becomes calls,
    whole or streamed (the reply is forced here with guided_regex: the tiny model would not
    write one)."""
    with pytest.raises(openai.BadRequestError, match="--enable-auto-tool-choice") as e:
        client.chat.completions.create(model=MODEL, messages=chat_messages("x"), max_tokens=2,
                                       tools=[WEATHER_TOOL])  # fmt: skip
    assert e.value.body["param"] == "tool_choice"
    s = Served(engine, api_key=None, tool_parser="hermes")
    try:
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{s.port}/v1", api_key="none")
        reply = ('Ok. <tool_call>{"name": "weather", "arguments": {"city": "Oslo", "days": 2}}'
                 '</tool_call><tool_call>{"name": "now", "arguments": {}}</tool_call>')  # fmt: skip
        regex = __import__("re").escape(reply)
        ask = functools.partial(c.chat.completions.create, model=MODEL, max_tokens=200,
                                temperature=0, messages=chat_messages("weather?"),
                                tools=[WEATHER_TOOL, NOW_TOOL])  # fmt: skip
        r = ask(extra_body={"guided_regex": regex})
        msg = r.choices[0].message
        assert msg.content == "Ok. " and r.choices[0].finish_reason == "tool_calls"
        got = [(t.function.name, json.loads(t.function.arguments)) for t in msg.tool_calls]
        assert got == [("weather", {"city": "Oslo", "days": 2}), ("now", {})]
        content, calls, finishes = joined_calls(ask(extra_body={"guided_regex": regex},
                                                    stream=True))  # fmt: skip
        assert content == "Ok. " and finishes == ["tool_calls"]
        assert [(x["name"], json.loads(x["arguments"])) for x in calls] == got
        # no call: text, finish "stop"
        r = ask(extra_body={"guided_regex": "no <tool"})
        assert r.choices[0].message.content == "no <tool" and not r.choices[0].message.tool_calls
        assert r.choices[0].finish_reason == "stop"
        # a conversation carrying an earlier call and its result renders
        history = [
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
             "function": {"name": "now", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "noon"},
        ]  # fmt: skip
        r = c.chat.completions.create(model=MODEL, messages=history, max_tokens=3,
                                      tools=[WEATHER_TOOL], tool_choice="none")  # fmt: skip
        assert r.choices[0].finish_reason in ("length", "stop")
    finally:
        s.stop()


def test_tools_reach_the_template_and_bad_tools_are_400(engine, client, plain):
    core = engine.engine
    template = ("{% for t in tools or [] %}[{{ t.function.name }}]{% endfor %}"
                "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
                "{% for c in m.tool_calls or [] %}{{ c.function.arguments.a }}{% endfor %}"
                "{% endfor %}")  # fmt: skip
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"a": 7}'}}
    from specdecode.serving.tools import template_messages

    msgs = template_messages([{"role": "assistant", "content": "", "tool_calls": [call]}])
    text = core.render_chat(msgs, "x", chat_template=template, tools=[WEATHER_TOOL])
    assert text == "[weather]<assistant>7"
    # the Python API renders them alike (and checks them as the server does)
    raw_msgs = [{"role": "assistant", "content": "", "tool_calls": [call]}]
    assert plain.apply_chat_template(raw_msgs, chat_template=template, tools=[WEATHER_TOOL]) == text
    with pytest.raises(InvalidRequestError, match="two tools named"):
        plain.chat(chat_messages("x"), tools=[WEATHER_TOOL, WEATHER_TOOL])
    for tools, choice, message, param in [
        ([{"type": "function", "function": {}}], "auto", "function.name", "tools"),
        ([WEATHER_TOOL], {"type": "function", "function": {"name": "x"}}, "not among",
         "tool_choice"),
        ([WEATHER_TOOL], "required", "both constrain", "tool_choice"),
    ]:  # fmt: skip
        extra = {"guided_regex": "a"} if message == "both constrain" else {}
        with pytest.raises(openai.BadRequestError, match=message) as e:
            client.chat.completions.create(
                model=MODEL,
                messages=chat_messages("x"),
                max_tokens=2,
                tools=tools,
                tool_choice=choice,
                extra_body=extra,
            )
        assert e.value.body["param"] == param


def test_responses_api_calls_tools(engine, plain):
    """/v1/responses: flat function tools; "required" / a named function give function_call
    items (streamed: their events, the arguments as deltas), and a stored response continues
    with the calls' outputs as function_call_output items."""
    flat = {"type": "function", **WEATHER_TOOL["function"]}
    s = Served(engine, api_key=None, max_stored_responses=4, tool_parser="json")
    try:
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{s.port}/v1", api_key="none")
        ask = functools.partial(c.responses.create, model=MODEL, input="weather?",
                                max_output_tokens=120, temperature=0)  # fmt: skip
        r = ask(tools=[flat], tool_choice="required", parallel_tool_calls=False)
        assert r.status == "completed" and [o.type for o in r.output] == ["function_call"]
        call = r.output[0]
        assert call.name == "weather" and call.call_id.startswith("chatcmpl-tool-")
        assert set(json.loads(call.arguments)) == {"city", "days"} and call.id.startswith("fc_")
        events = list(ask(tools=[flat], tool_choice="required", parallel_tool_calls=False,
                          stream=True))  # fmt: skip
        kinds = [e.type for e in events]
        assert kinds[:3] == ["response.created", "response.in_progress",
                             "response.output_item.added"]  # fmt: skip
        assert "response.output_text.delta" not in kinds and kinds[-1] == "response.completed"
        deltas = "".join(
            e.delta for e in events if e.type == "response.function_call_arguments.delta"
        )
        (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
        final = events[-1].response
        assert deltas == done.arguments == final.output[0].arguments == call.arguments
        assert [e.sequence_number for e in events] == list(range(len(events)))
        named = {"type": "function", "name": "weather"}
        r = ask(tools=[flat], tool_choice=named)
        assert [o.type for o in r.output] == ["function_call"] and r.output[0].name == "weather"
        # with logprobs asked: a call's tokens open no message, and it closes whole
        lp = {"include": ["message.output_text.logprobs"]}
        events = list(ask(tools=[flat], tool_choice=named, stream=True, **lp))
        (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
        assert [o.type for o in events[-1].response.output] == ["function_call"]
        assert done.arguments == events[-1].response.output[0].arguments
        assert [o.type for o in ask(tools=[flat], tool_choice=named, **lp).output] == [
            "function_call"
        ]
        # auto: a reply that is a whole JSON call (forced here by text.format) is a call
        schema = {"type": "object", "properties": {"name": {"const": "weather"}, "arguments": {
            "type": "object", "properties": {"city": {"const": "Oslo"}}, "required": ["city"],
            "additionalProperties": False}}, "required": ["name", "arguments"],
            "additionalProperties": False}  # fmt: skip
        fmt = {"format": {"type": "json_schema", "name": "call", "schema": schema}}
        r = ask(tools=[flat], text=fmt)
        assert [(o.type, o.name, o.arguments) for o in r.output] == [
            ("function_call", "weather", '{"city": "Oslo"}')
        ]
        events = list(ask(tools=[flat], text=fmt, stream=True))
        assert events[-1].response.output[0].arguments == '{"city": "Oslo"}'
        # the conversation goes on with the call's output, from the store or as input items
        r2 = ask(previous_response_id=r.id, tools=[flat], tool_choice="none", max_output_tokens=3,
                 input=[{"type": "function_call_output", "call_id": r.output[0].call_id,
                         "output": "sunny"}])  # fmt: skip
        assert r2.output[0].type == "message"
        r3 = ask(tools=[flat], tool_choice="none", max_output_tokens=3, input=[
            {"role": "user", "content": "weather?"},
            {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "sunny"}])  # fmt: skip
        assert r3.output[0].type == "message"
    finally:
        s.stop()


def test_tool_rendering_with_exclude_and_special_tokens(engine, plain):
    """--exclude-tools-when-tool-choice-none leaves them out of a "none" request's prompt
    only: /tokenize counts what chat's default renders. `skip_special_tokens: false` (vLLM's)
    keeps special tokens' text, as "auto" does for its parser."""
    listing = "{% for t in tools or [] %}[{{ t.function.name }}]{% endfor %}"
    template = listing + "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    s = Served(engine, api_key=None, trust=True, exclude_tools_when_tool_choice_none=True)
    try:
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{s.port}/v1", api_key="none")
        ask = functools.partial(c.chat.completions.create, model=MODEL, max_tokens=1,
                                messages=chat_messages("x"), tools=[NOW_TOOL],
                                extra_body={"chat_template": template})  # fmt: skip
        assert ask(tool_choice="none").usage.prompt_tokens == len("<user>x")
        assert ask(tool_choice="required").usage.prompt_tokens == len("[now]<user>x")
        body = {"messages": chat_messages("x"), "tools": [NOW_TOOL], "chat_template": template}
        status, data = raw(s.port, "POST", "/tokenize", json.dumps(body).encode())
        assert status == 200 and json.loads(data)["count"] == len("[now]<user>x")
    finally:
        s.stop()
    eos = plain.tokenizer.eos_token_id
    params = dict(temperature=0, max_tokens=3, ignore_eos=True, logit_bias={eos: 100})
    shown = plain.generate("abc", SamplingParams(**params, skip_special_tokens=False))
    hidden = plain.generate("abc", SamplingParams(**params))
    assert shown[0].outputs[0].token_ids == [eos] * 3 == hidden[0].outputs[0].token_ids
    assert shown[0].outputs[0].text == plain.tokenizer.eos_token * 3
    assert hidden[0].outputs[0].text == ""


def test_required_tools_with_other_reference_styles(client):
    params = {"type": "object", "properties": {"a": {"$ref": "#/definitions/A"}},
              "required": ["a"], "definitions": {"A": {"type": "integer", "minimum": 3,
                                                       "maximum": 5}}}  # fmt: skip
    # another tool with the same $defs name, another schema (pydantic writes such pairs)
    other = {"type": "object", "properties": {"b": {"$ref": "#/$defs/A"}}, "required": ["b"],
             "$defs": {"A": {"type": "string", "maxLength": 2}}}  # fmt: skip
    tools = [{"type": "function", "function": {"name": "f", "parameters": params}},
             {"type": "function", "function": {"name": "g", "parameters": other}}]  # fmt: skip
    for seed in range(3):
        r = client.chat.completions.create(
            model=MODEL, messages=chat_messages("x"), max_tokens=60, temperature=1.0, seed=seed,
            tools=tools, tool_choice="required", parallel_tool_calls=False,
        )  # fmt: skip
        (call,) = r.choices[0].message.tool_calls
        args = json.loads(call.function.arguments)
        if call.function.name == "f":
            assert 3 <= args["a"] <= 5
        else:
            assert isinstance(args["b"], str) and len(args["b"]) <= 2


def test_cors_and_request_logs_when_asked(engine, served, caplog):
    """vLLM's --allowed-origins (CORS, a preflight needs no API key) and
    --enable-log-requests; by default neither: no CORS headers, nothing logged."""
    pre = {"Origin": "https://a.example", "Access-Control-Request-Method": "POST",
           "Access-Control-Request-Headers": "authorization,content-type"}  # fmt: skip
    status, _ = raw(served.port, "OPTIONS", "/v1/chat/completions", headers=pre)
    assert status in (404, 405)  # no CORS: no preflight answer
    s = Served(engine, api_key=KEY, allowed_origins=("https://a.example",), log_requests=True,
               max_log_len=4)  # fmt: skip
    try:
        conn = http.client.HTTPConnection("127.0.0.1", s.port, timeout=30)
        conn.request("OPTIONS", "/v1/chat/completions", headers=pre)
        r = conn.getresponse()
        r.read()
        assert r.status == 200
        assert r.getheader("access-control-allow-origin") == "https://a.example"
        conn.request("OPTIONS", "/v1/chat/completions", headers={**pre, "Origin": "https://b.x"})
        r = conn.getresponse()
        r.read()
        assert r.status == 400  # an origin not allowed
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{s.port}/v1", api_key=KEY)
        with caplog.at_level(logging.INFO, logger="specdecode.requests"):
            c.completions.create(model=MODEL, prompt="abcdefgh", max_tokens=2)
        (rec,) = [r for r in caplog.records if r.name == "specdecode.requests"]
        assert "prompt 'abcd'" in rec.getMessage() and "max_tokens=2" in rec.getMessage()
        with pytest.raises(openai.BadRequestError):  # (logged only once checked: a 400)
            c.completions.create(model=MODEL, prompt=[10**12], max_tokens=2)
    finally:
        s.stop()


def test_the_api_key_holds_behind_a_root_path():
    """--root-path: uvicorn puts the prefix in front of the path the middleware sees; the key
    is still required on /v1/ (a review found it was not)."""
    from specdecode.serving.server import _ApiKey

    reached, sent = [], []

    async def app(scope, receive, send):
        reached.append(scope["path"])

    async def send(message):
        sent.append(message)

    guard = _ApiKey(app, KEY)
    for path, root in (("/llm/v1/models", "/llm"), ("/v1/models", "/llm"), ("/v1/models", "")):
        scope = {"type": "http", "path": path, "root_path": root, "headers": []}
        asyncio.run(guard(scope, None, send))
    assert reached == [] and [m["status"] for m in sent if "status" in m] == [401] * 3
    scope = {"type": "http", "path": "/llm/health", "root_path": "/llm", "headers": []}
    asyncio.run(guard(scope, None, send))
    assert reached == ["/llm/health"]


def test_reasoning_parser_splits_replies(engine, plain):
    """--reasoning-parser: a reply's reasoning and content, whole and streamed, as vLLM's
    `reasoning` and SGLang's `reasoning_content`; vLLM's include_reasoning and SGLang's
    separate_reasoning; tool calls read from the content. The replies are forced with
    guided_regex over the whole reply (vLLM's enable_in_reasoning: the tiny model thinks in
    no tags)."""
    s = Served(engine, api_key=None, reasoning_parser="deepseek_r1", reasoning_in_grammar=True,
               tool_parser="hermes", trust=True)  # fmt: skip
    try:
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{s.port}/v1", api_key="none")
        reply = "<think>2 and 2 make 4</think>  Four."
        ask = functools.partial(c.chat.completions.create, model=MODEL, max_tokens=80,
                                temperature=0, messages=chat_messages("2+2?"))  # fmt: skip
        force = {"guided_regex": __import__("re").escape(reply)}
        r = ask(extra_body=force)
        msg = r.choices[0].message
        assert msg.content == "Four." and msg.model_extra["reasoning"] == "2 and 2 make 4"
        # (a token a character here: the reasoning's, its tags' included)
        assert r.usage.completion_tokens_details.reasoning_tokens == reply.index("  ")
        assert msg.model_extra["reasoning_content"] == "2 and 2 make 4"
        thought, content = "", ""
        for ch in ask(extra_body=force, stream=True):
            d = ch.choices[0].delta if ch.choices else None
            if d is not None:
                thought += (d.model_extra or {}).get("reasoning") or ""
                content += d.content or ""
        assert (thought, content) == ("2 and 2 make 4", "Four.")
        streamed = list(ask(extra_body=force, stream=True, stream_options={"include_usage": True}))
        assert streamed[-1].usage.completion_tokens_details.reasoning_tokens == reply.index("  ")
        msg = ask(extra_body={**force, "include_reasoning": False}).choices[0].message
        assert msg.content == "Four." and msg.model_extra["reasoning"] is None
        msg = ask(extra_body={**force, "separate_reasoning": False}).choices[0].message
        assert msg.content == reply and "reasoning" not in msg.model_extra
        # cut off while thinking: all reasoning, no content (vLLM's)
        r = ask(extra_body=force, max_tokens=13)
        assert r.choices[0].message.content is None and r.choices[0].finish_reason == "length"
        assert r.choices[0].message.model_extra["reasoning"] == reply[7:13]
        # tool calls are read from the content only
        call = '<tool_call>{"name": "now", "arguments": {}}</tool_call>'
        tooled = {"guided_regex": __import__("re").escape("<think>a <tool_call></think>" + call)}
        r = ask(extra_body=tooled, tools=[NOW_TOOL], max_tokens=120)
        msg = r.choices[0].message
        assert msg.model_extra["reasoning"] == "a <tool_call>" and msg.content is None
        assert [t.function.name for t in msg.tool_calls] == ["now"]
        assert r.choices[0].finish_reason == "tool_calls"
        _, calls, _ = joined_calls(ask(extra_body=tooled, tools=[NOW_TOOL], stream=True,
                                       max_tokens=120))  # fmt: skip
        assert [x["name"] for x in calls] == ["now"]
        # an earlier reasoning reaches the template as reasoning_content (vLLM's field or
        # SGLang's); include_reasoning false sends no empty chunk for the reasoning's tokens
        shown = "{% for m in messages %}[{{ m.reasoning_content }}|{{ m.content }}]{% endfor %}"
        for field in ("reasoning", "reasoning_content"):
            history = [{"role": "assistant", "content": "yo", field: "greet"}]
            status, data = raw(
                s.port,
                "POST",
                "/tokenize",
                json.dumps(
                    {"messages": history, "chat_template_kwargs": {"chat_template": shown}}
                ).encode(),
            )
            assert status == 200, data
            assert engine.engine.tokenizer.decode(json.loads(data)["tokens"]) == "[greet|yo]"
        chunks = list(ask(extra_body={**force, "include_reasoning": False}, stream=True))
        assert all(ch.choices[0].delta.content or ch.choices[0].finish_reason
                   for ch in chunks[1:])  # fmt: skip
    finally:
        s.stop()


def test_structured_output_constrains_what_follows_the_reasoning(engine, plain):
    """With a reasoning parser a structured output constrains the content: the reply may
    think first (the tiny model never closes its thinking: it is the model's own greedy
    text, all reasoning); a prompt whose template closed the thinking, or qwen3's
    enable_thinking false, is constrained from its first token."""
    s = Served(engine, api_key=None, reasoning_parser="qwen3")
    try:
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{s.port}/v1", api_key="none")
        schema = {"type": "object", "properties": {"ok": {"type": "boolean"}},
                  "required": ["ok"], "additionalProperties": False}  # fmt: skip
        fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
        ask = functools.partial(c.chat.completions.create, model=MODEL, max_tokens=12,
                                temperature=0, response_format=fmt)  # fmt: skip
        msg = ask(messages=chat_messages("ok?")).choices[0].message
        assert msg.content is None
        assert msg.model_extra["reasoning"] == expected(plain, "ok?", 12).lstrip()
        off = {"chat_template_kwargs": {"enable_thinking": False}}
        for extra in (off, {"messages": [*chat_messages("ok?"), {"role": "assistant",
                      "content": "<think>\n\n</think>\n\n"}], "add_generation_prompt": False,
                      "continue_final_message": True}):  # fmt: skip
            body = {"messages": chat_messages("ok?"), **extra}
            msg = ask(messages=body.pop("messages"), extra_body=body, max_tokens=30)
            msg = msg.choices[0].message
            assert json.loads(msg.content) in ({"ok": True}, {"ok": False})
            assert msg.model_extra["reasoning"] is None
        # a named function: its call comes after the reasoning (here cut off: no call)
        named = {"type": "function", "function": {"name": "now"}}
        call = functools.partial(c.chat.completions.create, model=MODEL, max_tokens=12,
                                 temperature=0, tools=[NOW_TOOL], tool_choice=named,
                                 messages=chat_messages("ok?"))  # fmt: skip
        msg = call().choices[0].message
        assert msg.tool_calls is None and msg.content is None
        assert msg.model_extra["reasoning"] == expected(plain, "ok?", 12).lstrip()
        thought = ""
        for ch in call(stream=True):
            assert not ch.choices[0].delta.tool_calls and not ch.choices[0].delta.content
            thought += (ch.choices[0].delta.model_extra or {}).get("reasoning") or ""
        assert thought == msg.model_extra["reasoning"]
        msg = call(extra_body=off).choices[0].message  # (not thinking: the call at once)
        assert [t.function.name for t in msg.tool_calls] == ["now"]
        # separate_reasoning false: the reply as written, so a named or "required" call is
        # constrained from its first token (its arguments could not hold the reasoning)
        for choice in (named, "required"):
            r = call(tool_choice=choice, extra_body={"separate_reasoning": False}, max_tokens=60)
            assert [t.function.name for t in r.choices[0].message.tool_calls] == ["now"]
        # a continued message that closed its reasoning: its continuation is the answer
        closed = [*chat_messages("ok?"), {"role": "assistant", "content": "<think>x</think>"}]
        msg = (
            ask(
                messages=closed,
                max_tokens=30,
                extra_body={"add_generation_prompt": False, "continue_final_message": True},
            )
            .choices[0]
            .message
        )
        assert json.loads(msg.content) in ({"ok": True}, {"ok": False})
    finally:
        s.stop()


def test_responses_api_gives_reasoning_items(engine, plain):
    """/v1/responses with a reasoning parser: a `reasoning` item (its reasoning_text) before
    the message, streamed as reasoning_text deltas; reasoning input items go back to the
    template with their reply. (The tiny model never closes its thinking: its reply is all
    reasoning; a reply with both is read from chat chunks written for the test.)"""
    s = Served(engine, api_key=None, reasoning_parser="deepseek_r1", max_stored_responses=2)
    try:
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{s.port}/v1", api_key="none")
        ask = functools.partial(c.responses.create, model=MODEL, input="2+2?", temperature=0,
                                max_output_tokens=8)  # fmt: skip
        r = ask()
        want = expected(plain, "2+2?", 8).lstrip()
        assert [o.type for o in r.output] == ["reasoning"] and r.status == "incomplete"
        assert r.output[0].content[0].text == want and r.output_text == ""
        assert r.usage.output_tokens_details.reasoning_tokens == r.usage.output_tokens == 8
        events = list(ask(stream=True))
        kinds = [e.type for e in events]
        assert kinds[2:5] == ["response.output_item.added", "response.content_part.added",
                              "response.reasoning_text.delta"]  # fmt: skip
        thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
        (done,) = [e for e in events if e.type == "response.reasoning_text.done"]
        final = events[-1].response
        assert thought == done.text == final.output[0].content[0].text == want
        assert [e.sequence_number for e in events] == list(range(len(events)))
        # the conversation goes on: from the store, or with the items as input
        r2 = c.responses.create(model=MODEL, previous_response_id=r.id, input="and 3+3?",
                                max_output_tokens=2)  # fmt: skip
        assert r2.status == "incomplete"
        items = [{"role": "user", "content": "2+2?"},
                 *[o.model_dump(exclude_none=True) for o in r.output],
                 {"role": "assistant", "content": "Four."},
                 {"role": "user", "content": "and 3+3?"}]  # fmt: skip
        r3 = c.responses.create(model=MODEL, input=items, max_output_tokens=2)
        assert r3.status == "incomplete"
    finally:
        s.stop()
    # a reply that reasons, then answers, from its chat chunks
    from specdecode.serving.protocol import ResponsesRequest
    from specdecode.serving.responses import response_events, response_object

    def chunk(delta, tokens, finish=None):  # (tokens labelled by id: their bytes are read)
        lp = {"content": [{"token": f"token_id:{len(t)}", "logprob": -1.0,
                           "bytes": list(t.encode()), "top_logprobs": []}
                          for t in tokens]}  # fmt: skip
        return "data: " + json.dumps({"choices": [{"index": 0, "delta": delta, "logprobs": lp,
                                       "finish_reason": finish}]}) + "\n\n"  # fmt: skip

    # (a speculative step's chunk may end the reasoning and begin the answer)
    pieces = [({"reasoning": "su"}, ["<think>", "su"]), ({"reasoning": "m"}, ["m"]),
              ({"reasoning": "!"}, ["!", "</th"]), ({"content": "Fo"}, ["ink>", " ", "Fo"]),
              ({"content": "ur."}, ["ur."])]  # fmt: skip
    whole = {"created": 0, "choices": [{"message": {"content": "Four.", "reasoning": "sum!"},
             "finish_reason": "stop", "logprobs": {"content": [
                 e for d, t in pieces for e in json.loads(chunk(d, t)[6:])["choices"][0][
                     "logprobs"]["content"]]}}]}  # fmt: skip

    async def chunks():
        for k, (d, t) in enumerate(pieces):
            yield chunk(d, t, "stop" if k == len(pieces) - 1 else None)
        yield "data: [DONE]\n\n"

    async def run():
        req = ResponsesRequest(input="2+2?", include=["message.output_text.logprobs"])
        return [json.loads(e.split("data: ", 1)[1]) async for e in
                response_events(req, MODEL, chunks(), None, True, True)]  # fmt: skip

    events = __import__("asyncio").run(run())
    final = events[-1]["response"]
    assert [(o["type"], o["status"]) for o in final["output"]] == [
        ("reasoning", "completed"),
        ("message", "completed"),
    ]
    assert final["output"][0]["content"] == [{"type": "reasoning_text", "text": "sum!"}]
    assert final["output"][1]["content"][0]["text"] == "Four."
    # the message's logprobs are its answer's tokens', from the one its text begins in
    kept = final["output"][1]["content"][0]["logprobs"]
    assert [bytes(e["bytes"]).decode() for e in kept] == ["Fo", "ur."]
    kinds = [e["type"] for e in events]
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    out = response_object(ResponsesRequest(input="2+2?"), MODEL, whole, thinking=True)["output"]
    assert [o["type"] for o in out] == ["reasoning", "message"]
    assert out[0]["content"] == final["output"][0]["content"]
    assert out[1]["content"][0]["logprobs"] == final["output"][1]["content"][0]["logprobs"]
    # reasoning input items rejoin their reply
    req = ResponsesRequest(input=[
        {"role": "user", "content": "2+2?"},
        {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text",
                                                          "text": "sum"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Four."}]},
        {"role": "user", "content": "and 3+3?"}])  # fmt: skip
    assert req.input_messages()[1] == {"role": "assistant", "content": "Four.",
                                       "reasoning_content": "sum"}  # fmt: skip
