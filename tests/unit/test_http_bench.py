"""`bench http` against a scripted server: what counts as an answer, a failure, the first token,
and the percentiles (as numpy's, and so vLLM's benchmark)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

from specdecode.bench.http_load import Target, _stats, _stream, summarize

ROLE = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
TEXT = {"choices": [{"index": 0, "delta": {"content": "ab"}}]}
THINK = {"choices": [{"index": 0, "delta": {"reasoning_content": "hm"}}]}
USAGE = {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 4}}
SCRIPTS = {
    "/ok": [ROLE, TEXT, TEXT, USAGE, "[DONE]"],
    "/reasoning": [ROLE, THINK, TEXT, USAGE, "[DONE]"],
    "/plain-json": None,  # a 200 answered as one JSON body, no stream
    "/not-an-object": [ROLE, [1, 2]],
    "/error-mid-stream": [ROLE, TEXT, {"error": "the engine stopped"}],
    "/empty-answer": [
        ROLE,
        {**USAGE, "usage": {"prompt_tokens": 5, "completion_tokens": 0}},
        "[DONE]",
    ],  # fmt: skip
}


class Handler(BaseHTTPRequestHandler):
    def do_POST(self):  # noqa: N802 - the stdlib's name
        self.rfile.read(int(self.headers["Content-Length"]))
        script = SCRIPTS[self.path]
        self.send_response(200)
        if script is None:
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(json.dumps({"choices": [{"message": {"content": "ab"}}]}).encode())
            return
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for event in script:
            data = event if isinstance(event, str) else json.dumps(event)
            self.wfile.write(f"data: {data}\n\ndata:\n\n".encode())  # (and a keep-alive)

    def log_message(self, *a):
        pass


@pytest.fixture(scope="module")
def target():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield Target(f"http://127.0.0.1:{server.server_address[1]}/v1", None, 10)
    server.shutdown()


def test_what_counts_as_an_answer(target):
    ok = _stream(target, "/ok", {})
    assert ok.ok and (ok.prompt_tokens, ok.output_tokens) == (5, 4) and len(ok.gaps) == 1
    assert 0 < ok.ttft <= ok.e2el  # the role chunk is not the first token: the text is
    thinking = _stream(target, "/reasoning", {})
    assert thinking.ok and len(thinking.gaps) == 1  # (reasoning is output: it starts the clock)
    plain = _stream(target, "/plain-json", {})
    assert not plain.ok and "no streamed answer" in plain.error
    failed = _stream(target, "/error-mid-stream", {})
    assert not failed.ok and failed.error == "the engine stopped"
    with pytest.raises(ValueError, match="not an object"):  # (the runner counts it as failed)
        _stream(target, "/not-an-object", {})
    empty = _stream(target, "/empty-answer", {})
    assert empty.ok and empty.output_tokens == 0  # an empty answer the server counted
    r = summarize([ok, plain, failed, empty], 2.0, None)
    assert (r["completed"], r["failed"], r["total_output_tokens"]) == (2, 2, 4)
    assert r["request_throughput"] == 1.0 and r["output_throughput"] == 2.0


def test_percentiles_interpolate_as_numpy():
    values = [0.001 * v for v in (3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8)]
    got = _stats(values)
    assert got["p99_ms"] == pytest.approx(1000 * np.percentile(values, 99))
    assert got["median_ms"] == pytest.approx(1000 * np.median(values))
    assert _stats([0.002])["p99_ms"] == pytest.approx(2.0)
    assert _stats([])["p99_ms"] is None
