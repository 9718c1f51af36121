"""OpenAI's Responses API on top of chat completions: the request runs as a chat completion
(see `ResponsesRequest.as_chat`), and its answer, whole or streamed, is rewritten as a
`response` object or as the Responses stream's typed events (`response.created`, ...,
`response.output_text.delta`, ..., `response.completed`)."""

from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from specdecode.serving.protocol import ResponsesRequest
from specdecode.serving.reasoning import ReasoningStream


@dataclass
class Stored:
    response: dict  # the response object, as it was answered
    conversation: list[dict]  # its messages without its instructions, its reply last


class ResponseStore:
    """The last `capacity` responses asked to be stored (`store`, true by default as in
    OpenAI's), in memory: `previous_response_id` continues one, GET returns it. 0 keeps none
    (vLLM's default too: an unbounded store is a memory leak)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._kept: OrderedDict[str, Stored] = OrderedDict()

    def get(self, response_id: str) -> Stored | None:
        kept = self._kept.get(response_id)
        if kept is not None:
            self._kept.move_to_end(response_id)  # (the least recently used goes first)
        return kept

    def put(self, response: dict, conversation: list[dict]) -> None:
        self._kept[response["id"]] = Stored(response, conversation)
        while len(self._kept) > self.capacity:
            self._kept.popitem(last=False)

    def delete(self, response_id: str) -> bool:
        return self._kept.pop(response_id, None) is not None


def _usage(chat_usage: dict | None) -> dict | None:
    if chat_usage is None:
        return None
    cached = chat_usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)
    return {
        "input_tokens": chat_usage["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": chat_usage["completion_tokens"],
        "output_tokens_details": {
            "reasoning_tokens": chat_usage.get("completion_tokens_details", {}).get(
                "reasoning_tokens", 0
            )
        },
        "total_tokens": chat_usage["total_tokens"],
    }


class ResponseBuilder:
    """One response's ids and fixed fields, and its object at each stage."""

    def __init__(self, req: ResponsesRequest, model: str, keep: Callable | None = None) -> None:
        self.req, self.model, self.keep = req, model, keep
        self.stored = keep is not None
        self.id = "resp_" + uuid.uuid4().hex
        self.message_id = "msg_" + uuid.uuid4().hex
        self.reasoning_id = "rs_" + uuid.uuid4().hex
        self.created_at = int(time.time())

    def part(self, text: str, logprobs: list | None) -> dict:
        return {"type": "output_text", "text": text, "annotations": [],
                "logprobs": logprobs or []}  # fmt: skip

    def reasoning(self, text: str | None, status: str) -> dict:
        """A reasoning model's reasoning as a `reasoning` output item (its text as the one
        `reasoning_text` part; no summary is written)."""
        content = [] if text is None else [{"type": "reasoning_text", "text": text}]
        return {"type": "reasoning", "id": self.reasoning_id, "summary": [],
                "content": content, "status": status}  # fmt: skip

    def message(self, part: dict | None, status: str) -> dict:
        return {"type": "message", "id": self.message_id, "status": status,
                "role": "assistant", "content": [] if part is None else [part]}  # fmt: skip

    def response(
        self, status: str, output: list, usage: dict | None = None, finish: str | None = None
    ) -> dict:
        req = self.req
        incomplete = {"reason": "max_output_tokens"} if finish == "length" else None
        fmt = (req.text or {}).get("format") or {"type": "text"}
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": None,
            "incomplete_details": incomplete,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "model": self.model,
            "output": output,
            "parallel_tool_calls": req.parallel_tool_calls,
            "previous_response_id": req.previous_response_id,
            "reasoning": {"effort": None, "summary": None},
            "store": self.stored,  # (kept where the server keeps responses and it asked)
            "temperature": 1.0 if req.temperature is None else req.temperature,
            "text": {"format": fmt},
            "tool_choice": req.tool_choice or "auto",
            "tools": req.tools or [],
            "top_logprobs": req.top_logprobs or 0,
            "top_p": 1.0 if req.top_p is None else req.top_p,
            "truncation": req.truncation,
            "usage": usage,
            "user": req.user,
            "metadata": req.metadata or {},
        }

    def done(
        self, text: str, logprobs: list | None, finish: str | None, usage: dict | None,
        calls: list[dict] = (), output: list[dict] | None = None, reasoning: str | None = None,
    ):  # fmt: skip
        """The reply's part, status and whole response, stored where it is to be kept
        (`keep(response, reply message)`). `calls`: its tool calls (chat's form), output
        after its message (none where it has no text); `output`: the items as streamed;
        `reasoning`: a reasoning model's (an item before the others)."""
        status = "incomplete" if finish == "length" else "completed"
        if calls and not text:
            logprobs = None  # (a call's tokens: OpenAI gives no logprobs for calls)
        part = self.part(text, logprobs)
        if output is None:
            output = [self.reasoning(reasoning, "completed")] if reasoning else []
            if text or not (calls or reasoning):
                output.append(self.message(part, "completed"))
            output += [self.function_call(c, "completed") for c in calls]
            output[-1]["status"] = status  # (a cut-off reply: its last item is incomplete)
        response = self.response(status, output, usage, finish)
        if self.keep is not None:
            empty = None if calls or reasoning else ""
            reply: dict = {"role": "assistant", "content": text or empty}
            if reasoning:
                reply["reasoning_content"] = reasoning
            if calls:
                reply["tool_calls"] = [dict(c) for c in calls]
            self.keep(response, reply)
        return part, status, response

    def function_call(self, call: dict, status: str) -> dict:
        """A chat tool call as a `function_call` output item."""
        f = call["function"]
        return {"type": "function_call", "id": "fc_" + uuid.uuid4().hex,
                "call_id": call["id"], "name": f["name"], "arguments": f["arguments"],
                "status": status}  # fmt: skip


class _AnswerLogprobs:
    """The message's logprobs of a reply that reasons first (`thinking`): its tokens' entries
    from the one where its answer's text begins, read token by token as the reasoning parser
    reads the reply (so a whole reply and a streamed one keep the same entries); the
    reasoning's own have no place in the response."""

    def __init__(self, thinking: bool) -> None:
        self.stream = ReasoningStream() if thinking else None

    def __call__(self, entries: list) -> list:
        if self.stream is None:
            return entries
        for k, e in enumerate(entries):
            # (its bytes where given: its text may be a "token_id:N" label)
            raw = e.get("bytes")
            text = bytes(raw).decode("utf-8", "replace") if raw else e.get("token") or ""
            if self.stream.feed(text)[1]:  # (the answer's first text)
                self.stream = None
                return entries[k:]
        return []


def response_object(
    req: ResponsesRequest, model: str, chat: dict, keep: Callable | None = None,
    thinking: bool = False,
) -> dict:  # fmt: skip
    """A whole chat completion (one choice) as the Responses API's `response` object;
    `keep(response, reply text)` stores it; `thinking`: its reply reasons first."""
    b = ResponseBuilder(req, model, keep)
    b.created_at = chat["created"]  # (when the request came, not when it ended)
    choice = chat["choices"][0]
    lp = choice.get("logprobs")
    text, usage = choice["message"]["content"] or "", _usage(chat.get("usage"))
    calls = choice["message"].get("tool_calls") or []
    reasoning = choice["message"].get("reasoning")
    lp = _AnswerLogprobs(thinking)(lp["content"]) if lp else None
    return b.done(text, lp, choice["finish_reason"], usage, calls, reasoning=reasoning)[2]


def _numbered() -> Callable[..., str]:
    """An event writer: each event numbered (`sequence_number`) in the order written."""
    seq = 0

    def event(kind: str, **fields) -> str:
        nonlocal seq
        body = {"type": kind, "sequence_number": seq, **fields}
        seq += 1
        return f"event: {kind}\ndata: {json.dumps(body)}\n\n"

    return event


async def _bodies(chunks: AsyncIterator[str]) -> AsyncIterator[dict]:
    """A chat completion's server-sent chunks, parsed, up to `[DONE]`."""
    async for chunk in chunks:
        data = chunk.removeprefix("data: ").strip()
        if data == "[DONE]":
            return
        yield json.loads(data)


def _failed(event: Callable[..., str], b: ResponseBuilder, e: dict) -> list[str]:
    """The events that end a stream whose reply failed: the error, then the failed response
    (not kept)."""
    failed = b.response("failed", [])
    failed["store"] = False
    failed["error"] = {"code": str(e.get("code")), "message": e.get("message")}
    return [event("error", code=str(e.get("code")), message=e.get("message"),
                  param=e.get("param")),
            event("response.failed", response=failed)]  # fmt: skip


async def response_events(
    req: ResponsesRequest, model: str, chunks: AsyncIterator[str], keep: Callable | None = None,
    items_as_they_come: bool = False, thinking: bool = False,
) -> AsyncIterator[str]:  # fmt: skip
    """A chat completion's server-sent chunks (one choice, usage at the end) as the Responses
    stream's events, each numbered (`sequence_number`); `keep(response, reply message)`
    stores the response once it is whole (a failed one is not kept). Without
    `items_as_they_come` (a reply that may call tools or reason) the reply is one message,
    open from the start. With it, a `reasoning` item opens with the reply's first reasoning
    (as `reasoning_text` deltas), a message item with its first text, a `function_call` item
    with each call (its arguments as `function_call_arguments` deltas); an item closes when
    the next one opens or the reply ends, and a reply with none is one empty message.
    `thinking`: the reply reasons first (the message's logprobs start with its answer)."""
    b = ResponseBuilder(req, model, keep)
    event = _numbered()

    items: list[dict] = []  # the output so far (each closed but the last, maybe)
    state: dict = {"open": None, "text": "", "logprobs": [], "reasoning": None}
    answer = _AnswerLogprobs(thinking)
    calls: list[dict] = []  # chat's form, for the store

    def close(status: str = "completed") -> list[str]:
        item = state["open"]
        if item is None:
            return []
        state["open"] = None
        where = {"item_id": item["id"], "output_index": items.index(item)}
        if item["type"] == "reasoning":
            text = state["reasoning"]
            item.update(b.reasoning(text, status))
            part = item["content"][0]
            return [
                event("response.reasoning_text.done", **where, content_index=0, text=text),
                event("response.content_part.done", **where, content_index=0, part=part),
                event("response.output_item.done", output_index=where["output_index"], item=item),
            ]  # fmt: skip
        if item["type"] == "message":
            part = b.part(state["text"], state["logprobs"])
            item.update(b.message(part, status), id=item["id"])
            return [
                event("response.output_text.done", **where, content_index=0, text=state["text"],
                      logprobs=state["logprobs"]),
                event("response.content_part.done", **where, content_index=0, part=part),
                event("response.output_item.done", output_index=where["output_index"], item=item),
            ]  # fmt: skip
        item["status"] = status
        return [
            event("response.function_call_arguments.done", **where, arguments=item["arguments"]),
            event("response.output_item.done", output_index=where["output_index"], item=item),
        ]  # fmt: skip

    def open_message() -> list[str]:
        out = close()
        item = b.message(None, "in_progress")  # (at most one: text comes before any call)
        items.append(item)
        state.update(open=item, text="", logprobs=[])
        where = {"item_id": item["id"], "output_index": len(items) - 1}
        out.append(event("response.output_item.added", output_index=len(items) - 1, item=item))
        out.append(event("response.content_part.added", **where, content_index=0,
                         part=b.part("", None)))  # fmt: skip
        return out

    def open_reasoning() -> list[str]:
        out = close()
        item = b.reasoning(None, "in_progress")  # (one: the reasoning comes first)
        items.append(item)
        state.update(open=item, reasoning="", reasoning_at=len(items) - 1)
        where = {"item_id": item["id"], "output_index": len(items) - 1}
        part = {"type": "reasoning_text", "text": ""}
        out.append(event("response.output_item.added", output_index=len(items) - 1, item=item))
        out.append(event("response.content_part.added", **where, content_index=0, part=part))
        return out

    yield event("response.created", response=b.response("in_progress", []))
    yield event("response.in_progress", response=b.response("in_progress", []))
    if not items_as_they_come:
        for e in open_message():
            yield e
    finish, usage, held = None, None, []
    async for body in _bodies(chunks):
        if "error" in body:  # the reply failed mid-way: the stream ends with it, as OpenAI's
            for e in _failed(event, b, body["error"]):
                yield e
            return
        if body.get("usage"):
            usage = _usage(body["usage"])
        for c in body.get("choices", []):
            delta = c.get("delta", {})
            thought = delta.get("reasoning") or ""
            if thought:
                if state["reasoning"] is None:
                    for e in open_reasoning():
                        yield e
                state["reasoning"] += thought
                yield event("response.reasoning_text.delta", item_id=b.reasoning_id,
                            output_index=state["reasoning_at"], content_index=0,
                            delta=thought)  # fmt: skip
            piece = delta.get("content") or ""
            lp = answer((c.get("logprobs") or {}).get("content") or [])
            opened = state["open"] is not None and state["open"]["type"] == "message"
            if piece and not opened:  # (a message opens with text; a call's tokens' logprobs,
                for e in open_message():  # which OpenAI does not give, open none)
                    yield e
                opened = True
            if not opened:  # (logprobs of text the parser holds back: the message's, if one
                held += lp  # opens; dropped if a call comes first)
                lp = []
            elif held:
                lp, held = held + lp, []
            if opened and (piece or lp):
                item = state["open"]
                state["text"] += piece
                state["logprobs"] += lp
                yield event("response.output_text.delta", item_id=item["id"],
                            output_index=len(items) - 1, content_index=0, delta=piece,
                            logprobs=lp)  # fmt: skip
            for d in delta.get("tool_calls") or []:
                f = d.get("function") or {}
                if d.get("id"):
                    held = []
                    for e in close():
                        yield e
                    call = {"id": d["id"], "type": "function",
                            "function": {"name": f.get("name"), "arguments": ""}}  # fmt: skip
                    calls.append(call)
                    item = b.function_call(call, "in_progress")
                    items.append(item)
                    state["open"] = item
                    yield event("response.output_item.added", output_index=len(items) - 1,
                                item=dict(item))  # fmt: skip
                args = f.get("arguments") or ""
                if args:  # (a call's arguments: its first delta's, and any that follow)
                    call = calls[d.get("index", len(calls) - 1)]
                    item = next(i for i in items if i.get("call_id") == call["id"])
                    item["arguments"] += args
                    call["function"]["arguments"] += args
                    yield event("response.function_call_arguments.delta", item_id=item["id"],
                                output_index=items.index(item), delta=args)  # fmt: skip
            finish = c.get("finish_reason") or finish
    if not items:
        for e in open_message():
            yield e
    status = "incomplete" if finish == "length" else "completed"
    for e in close(status):  # (a cut-off reply: its last item is incomplete)
        yield e
    _, _, final = b.done(state["text"], state["logprobs"], finish, usage, calls, output=items,
                         reasoning=state["reasoning"])  # fmt: skip
    # (`response.completed` whatever the status, as vLLM and SGLang end: the openai SDK's
    # stream helper and usage readers wait for it; an incomplete reply says so in its status)
    yield event("response.completed", response=final)
