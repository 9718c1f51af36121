"""The engine behind the server: one background thread runs `LLMEngine.step()` in a loop while
requests arrive and leave through thread-safe queues (continuous batching).

- `generate()` is an async iterator of `StreamUpdate`s; if the consumer stops early (a client
  disconnected, a task was cancelled), the request is aborted and its memory freed.
- A step that raises fails only the request that caused it: every request of the failed batch is
  sent back to the queue (recomputed, nothing lost), then they are stepped one at a time; the
  one that raises alone gets an error, the others carry on.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from specdecode.core import Sequence
from specdecode.engine.engine import LLMEngine
from specdecode.engine.output import OutputProcessor
from specdecode.sampling import SamplingParams

log = logging.getLogger(__name__)


class EngineStoppedError(RuntimeError):
    """A request arrived after the engine loop stopped (the server answers 503)."""


_MAX_FAILED_STEPS = 3  # steps in a row that fail before running any request: give up on them


@dataclass
class StreamUpdate:
    text: str  # new text since the last update (stop strings held back until decided)
    token_ids: list[int]  # new tokens since the last update
    finish_reason: str | None = None
    error: str | None = None  # the request failed inside the engine
    error_status: int = 500  # 400 when the request itself cannot go on (a grammar dead end)
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0  # so far
    logprobs: list = field(default_factory=list)  # one entry per new token when asked for

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None or self.error is not None


class _Stream:
    def __init__(self, seq: Sequence, loop: asyncio.AbstractEventLoop) -> None:
        self.seq = seq
        self.loop = loop
        self.queue: asyncio.Queue[StreamUpdate] = asyncio.Queue()
        self.sent_tokens = 0
        self.first_token_time: float | None = None
        self.arrival = time.perf_counter()

    def put(self, update: StreamUpdate) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, update)
        except RuntimeError:  # the event loop is gone: nobody is listening any more
            pass


class RequestHandle:
    def __init__(self, engine: AsyncLLMEngine, seq: Sequence, stream: _Stream) -> None:
        self._engine, self.seq, self._stream = engine, seq, stream
        self.done = False

    async def updates(self) -> AsyncIterator[StreamUpdate]:
        """The request's updates until it finishes; leaving early aborts it."""
        try:
            while not self.done:
                update = await self._stream.queue.get()
                self.done = update.finished
                yield update
        finally:
            self.abort()

    def abort(self) -> None:
        """Cancel the request if it is still running (idempotent)."""
        if not self.done:
            self.done = True
            self._engine._post("abort", self.seq, None)


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._inbox: list[tuple[str, Sequence, _Stream | None]] = []
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._streams: dict[int, _Stream] = {}
        self._stop = False
        self._closed = False  # set with the lock once nobody reads the inbox any more
        self._failed_steps = 0  # steps in a row that failed before running any request
        self._running = False
        self._thread: threading.Thread | None = None
        self.num_failed_requests = 0
        self.num_finished_requests = 0
        self.step_error: str | None = None  # the last exception a step raised
        # time to first token and inter-token gaps of finished requests, for /metrics
        self.on_finish: list = []  # callbacks(seq, ttft_s, e2e_s)

    # ---- lifecycle -----------------------------------------------------------------------------

    def start(self) -> None:
        """Run the engine loop on a background thread (tests, embedding in an app)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self.run, name="specdecode-engine", daemon=True)
            self._thread.start()

    def run(self) -> None:
        """Run the engine loop in the calling thread until `shutdown()`. Serving runs it on the
        main thread and the HTTP event loop on another: with GNU OpenMP, the main thread's
        parallel regions are markedly faster here (a 1-sequence step: ~15-20 ms on the main
        thread, ~25 ms on another)."""
        self._running = True
        try:
            self._run()
        finally:
            self._running = False

    def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None

    @property
    def alive(self) -> bool:
        return self._running and not self._stop

    # ---- requests ------------------------------------------------------------------------------

    def add(
        self, prompt_token_ids: list[int], params: SamplingParams, request_id: str = "",
        priority: int = 0,
    ) -> RequestHandle:  # fmt: skip
        """Queue a request (raises `InvalidRequestError` at once if it is malformed); read its
        output with `handle.updates()` inside a running event loop."""
        if self._stop:
            raise EngineStoppedError("the engine is not running")
        seq = self.engine.make_sequence(prompt_token_ids, params, request_id, priority)
        stream = _Stream(seq, asyncio.get_running_loop())
        self._post("add", seq, stream)
        return RequestHandle(self, seq, stream)

    async def generate(
        self, prompt_token_ids: list[int], params: SamplingParams, request_id: str = ""
    ) -> AsyncIterator[StreamUpdate]:
        """Stream one request's output (a shortcut for `add(...).updates()`)."""
        handle = self.add(prompt_token_ids, params, request_id)
        async for update in handle.updates():
            yield update

    def _post(self, action: str, seq: Sequence, stream: _Stream | None) -> None:
        with self._lock:
            closed = self._closed
            if not closed:
                self._inbox.append((action, seq, stream))
        if closed:  # the engine stopped after `add` checked: its stream must still end
            if action == "add" and stream is not None:
                stream.put(StreamUpdate("", [], error=self._stopped_message()))
            return
        self._wake.set()

    def _stopped_message(self) -> str:
        return f"the engine stopped: {self.step_error or 'shutdown'}"

    # ---- the engine thread ---------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stop:
                self._drain()
                if not self.engine.has_unfinished():
                    self._wake.wait(0.1)
                    self._wake.clear()
                    continue
                try:
                    updated = self.engine.step()
                except Exception as e:  # noqa: BLE001 - isolate the request that caused it
                    log.exception("a step failed; isolating its requests")
                    self.step_error = f"{type(e).__name__}: {e}"
                    batch = list(self.engine.last_batch)
                    for seq in batch:  # finished inside the failed step: tell their clients
                        if seq.finished:
                            self._emit(seq)
                    # a failure before any request ran (scheduling, calibration) names no
                    # suspect: after a few in a row, fail what is open rather than spin
                    self._failed_steps = 0 if batch else self._failed_steps + 1
                    if self._failed_steps >= _MAX_FAILED_STEPS:
                        self._failed_steps = 0
                        for seq in list(self.engine.scheduler.running) + list(
                            self.engine.scheduler.waiting
                        ):
                            self._fail(seq, f"internal error: {self.step_error}")
                    self._isolate(batch)
                    continue
                self._failed_steps = 0
                for seq in updated:
                    self._emit(seq)
        except BaseException as e:
            if isinstance(e, KeyboardInterrupt):  # Ctrl-C: a stop asked for, not a failure
                log.info("the engine loop stopped: interrupted")
            else:
                log.exception("the engine loop stopped")
            self.step_error = f"{type(e).__name__}: {e}"
            raise
        finally:
            self._stop = True
            self._fail_all(self._stopped_message())

    def _fail_all(self, message: str) -> None:
        """Nobody is left to serve the open requests: end every stream with an error."""
        with self._lock:
            inbox, self._inbox = self._inbox, []
            self._closed = True
        for action, _, stream in inbox:
            if action == "add" and stream is not None:
                stream.put(StreamUpdate("", [], error=message))
        for stream in list(self._streams.values()):
            stream.put(StreamUpdate("", [], error=message))
        self._streams.clear()

    def _drain(self) -> None:
        with self._lock:
            inbox, self._inbox = self._inbox, []
        for action, seq, stream in inbox:
            if action == "add":
                try:
                    self.engine.add_sequence(seq)
                except Exception as e:  # noqa: BLE001 - report it on the request's own stream
                    stream.put(StreamUpdate("", [], error=str(e)))
                    continue
                self._streams[seq.seq_id] = stream
            elif action == "abort" and self._streams.pop(seq.seq_id, None) is not None:
                self.engine.abort(seq)

    def _emit(self, seq: Sequence) -> None:
        stream = self._streams.get(seq.seq_id)
        if stream is None:
            return
        if seq.error is not None:
            self._streams.pop(seq.seq_id, None)
            self.num_failed_requests += 1
            stream.put(StreamUpdate("", [], error=seq.error, error_status=400))
            return
        new = seq.output_token_ids[stream.sent_tokens :]
        text = OutputProcessor.stream_delta(seq)
        if not new and not text and not seq.finished:
            return
        if stream.first_token_time is None and new:
            stream.first_token_time = time.perf_counter()
        logprobs = []
        if seq.params.logprobs is not None:  # (token, (logprob, top-n)) per new token
            logprobs = list(zip(new, seq.output_logprobs[stream.sent_tokens :], strict=False))
        stream.sent_tokens = len(seq.output_token_ids)
        update = StreamUpdate(
            text,
            new,
            finish_reason=seq.finish_reason if seq.finished else None,
            num_prompt_tokens=len(seq.prompt_token_ids),
            num_output_tokens=len(seq.output_token_ids),
            logprobs=logprobs,
        )
        stream.put(update)
        if seq.finished:
            self._streams.pop(seq.seq_id, None)
            self.num_finished_requests += 1
            now = time.perf_counter()
            ttft = (stream.first_token_time or now) - stream.arrival
            for callback in self.on_finish:
                callback(seq, ttft, now - stream.arrival)

    def _fail(self, seq: Sequence, message: str) -> None:
        self.engine.abort(seq)
        self.num_failed_requests += 1
        stream = self._streams.pop(seq.seq_id, None)
        if stream is not None:
            stream.put(StreamUpdate("", [], error=message))

    def _isolate(self, suspects: list[Sequence]) -> None:
        """Re-run the requests of a failed step one at a time; fail the ones that raise alone."""
        engine, sched = self.engine, self.engine.scheduler
        suspects = [s for s in suspects if not s.finished]
        if len(suspects) <= 1:
            for seq in suspects:
                self._fail(seq, f"internal error: {self.step_error}")
            return
        for seq in suspects:
            engine.preempt(seq)
        parked_running = list(sched.running)
        parked_waiting = [s for s in sched.waiting if s not in suspects]
        sched.running = []
        try:
            for seq in suspects:
                if seq.finished:
                    continue
                sched.waiting.clear()
                sched.waiting.append(seq)
                before = len(seq.output_token_ids)
                try:
                    for _ in range(64):  # a prompt in chunks, then one token
                        for s in engine.step():
                            self._emit(s)
                        if seq.finished or len(seq.output_token_ids) > before:
                            break
                except Exception as e:  # noqa: BLE001
                    log.warning("request %s fails on its own: %s", seq.request_id, e)
                    self._fail(seq, f"internal error: {type(e).__name__}: {e}")
                    continue
                if not seq.finished:
                    parked_running += [s for s in sched.running if s not in parked_running]
                    parked_waiting += [s for s in sched.waiting if s not in parked_waiting]
                sched.running = []
        finally:
            sched.running = parked_running
            sched.waiting.clear()
            sched.waiting.extend(parked_waiting)
            sched.reorder()  # (suspects left waiting came last)
