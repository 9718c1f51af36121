"""`specdecode serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) on the async engine.

Endpoints: POST /v1/chat/completions and /v1/completions (SSE streaming, usage, n, stop, seed,
logprobs, completions' echo), POST /v1/responses (OpenAI's Responses API; GET and DELETE of
the ones kept), POST /tokenize and /detokenize (vLLM's), GET /v1/models, /ping and /version
(vLLM's), GET or HEAD /health and /metrics (Prometheus; the spec-decode counters under
vLLM's names). Safe by default: binds 127.0.0.1, optional API key, limits on body size, n,
prompt and max_tokens; every bad input is a 4xx with an OpenAI-style error body, and the
server keeps serving.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import logging
import os
import re
import secrets
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from specdecode.engine.output import DETOKENIZE_CONTEXT, fast_decoder
from specdecode.errors import InvalidRequestError, SpecDecodeError
from specdecode.llm import prompt_logprob_entries
from specdecode.serving.async_engine import (
    AsyncLLMEngine,
    EngineStoppedError,
    RequestHandle,
    StreamUpdate,
)
from specdecode.serving.metrics import ServerMetrics
from specdecode.serving.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ResponsesRequest,
    TokenizeRequest,
    field_path,
)
from specdecode.serving.reasoning import END as REASONING_END
from specdecode.serving.reasoning import ReasoningStream, split, thinks
from specdecode.serving.responses import ResponseStore, response_events, response_object
from specdecode.serving.tools import ToolCalling, parser_format, whole

log = logging.getLogger(__name__)
req_log = logging.getLogger("specdecode.requests")  # (--enable-log-requests)


@dataclass
class ServerConfig:
    served_model_name: str
    api_key: str | None = None
    # further names a request's "model" may use (the model as it was named, its Hugging Face
    # id); responses and /v1/models carry served_model_name
    aliases: tuple[str, ...] = ()
    listed: tuple[str, ...] = ()  # of the aliases, those /v1/models lists too (vLLM's names)
    max_request_bytes: int = 1 << 20  # 1 MiB of JSON
    max_n: int = 16
    max_prompts: int = 64  # prompts in one /v1/completions request
    trust_request_chat_template: bool = False  # a request's chat_template is used (vLLM's flag)
    return_tokens_as_token_ids: bool = False  # logprob tokens as "token_id:N" (vLLM's flag)
    response_role: str = "assistant"  # a chat reply's role (vLLM's --response-role)
    # CORS (vLLM's --allowed-origins ...): None answers no browser page of another origin
    allowed_origins: tuple[str, ...] | None = None
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    log_requests: bool = False  # (vLLM's --enable-log-requests)
    max_log_len: int | None = None  # characters of a prompt logged at most
    max_stored_responses: int = 0  # Responses API: the last N kept in memory (0: none)
    # tool_choice "auto": the format calls are parsed from (--tool-call-parser; None: refused)
    tool_parser: str | None = None
    exclude_tools_when_tool_choice_none: bool = False  # (vLLM's flag)
    # a reasoning model's replies split into reasoning and content (--reasoning-parser; see
    # reasoning.py); `reasoning_in_grammar`: structured outputs constrain the reasoning too
    # (vLLM's --structured-outputs-config enable_in_reasoning), else only what follows it
    reasoning_parser: str | None = None
    reasoning_in_grammar: bool = False
    # a request's `priority` as the engine orders it (lower first): 1 for vLLM's order, -1
    # for SGLang's (higher values first); `priority_absent_last`: a request without one goes
    # after all that give one (SGLang's), else it counts as 0 (vLLM's)
    priority_sign: int = 1
    priority_absent_last: bool = False
    force_include_usage: bool = False  # every stream ends with its usage (vLLM's flag)
    request_id_headers: bool = False  # answers carry X-Request-Id (vLLM's flag)
    max_logprobs: int = 20  # the most top logprobs a request may ask for (vLLM's flag)


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type_, param


def _error(status: int, message: str, type_: str, param: str | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": type_, "param": param, "code": status}}
    return JSONResponse(body, status_code=status)


class _RequestIdHeader:
    """vLLM's --enable-request-id-headers: every answer carries `X-Request-Id`, the request's
    own where it sent one, else a new id."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = (dict(scope.get("headers") or []).get(b"x-request-id") or b"")[:512].strip()
        rid = given or uuid.uuid4().hex.encode()  # (a cut may not end in whitespace)

        async def send_with_id(message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []),
                                                   (b"x-request-id", rid)]}  # fmt: skip
            await send(message)

        await self.app(scope, receive, send_with_id)


class _ApiKey:
    """`Authorization: Bearer KEY` required on /v1/ routes and the tokenizer's (/health and
    /metrics stay open)."""

    def __init__(self, app, key: str) -> None:
        self.app, self.want = app, f"Bearer {key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        path = scope.get("path", "") if scope["type"] == "http" else ""
        root = scope.get("root_path", "")  # (--root-path: the routes are matched without it)
        if root and path.startswith(root):
            path = path[len(root) :]
        if path.startswith("/v1/") or path in ("/tokenize", "/detokenize"):
            got = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(got, self.want):
                response = _error(401, "invalid or missing API key", "authentication_error")
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param)


_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's table from bytes to the printable characters byte-level BPE vocabularies spell
    them with (printable Latin-1 stands for itself, the rest is shifted past U+0100)."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]  # fmt: skip
    table, shifted = {}, 0
    for b in range(256):
        if b in kept:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + shifted)
            shifted += 1
    return table


def _decoder_types(tokenizer) -> set[str] | None:
    """The types in a fast tokenizer's decoder (a Sequence's parts too); None when unknown."""
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    if decoder is None:
        return None
    try:
        spec = json.loads(decoder.__getstate__())
    except (AttributeError, TypeError, ValueError):
        return None
    types, todo = set(), [spec]
    while todo:
        d = todo.pop()
        if isinstance(d, dict):
            types.add(d.get("type"))
            todo += d.get("decoders") or []
    return types


def vocab_bytes(tokenizer) -> Callable[[int], bytes | None]:
    """`raw(tok)`: the bytes a token stands for where its vocabulary entry records them, or
    None (then its decoded text's UTF-8 is its bytes). A token that ends inside a character
    decodes to U+FFFD, so only these bytes let a client rebuild the text (OpenAI's `bytes`): a
    byte-level BPE token (GPT-2, SmolLM2, Llama 3, Qwen) spells its bytes with GPT-2's
    bytes_to_unicode characters; a SentencePiece byte-fallback token is `<0xHH>`. Added and
    special tokens are stored as text, not spelled in bytes."""
    types = _decoder_types(tokenizer)
    inverse = None
    if types is not None and "ByteLevel" in types:
        inverse = {c: b for b, c in _bytes_to_unicode().items()}
    byte_fallback = inverse is None and (types is None or "ByteFallback" in types)
    added = set(getattr(tokenizer, "added_tokens_decoder", None) or ())

    @functools.cache
    def raw(tok: int) -> bytes | None:
        if tok in added:
            return None
        try:
            piece = tokenizer.convert_ids_to_tokens(tok)
        except (IndexError, KeyError, OverflowError, TypeError, ValueError):
            return None  # an id past the tokenizer's vocabulary (a padded embedding's)
        if not isinstance(piece, str) or not piece:
            return None
        if inverse is not None:
            if all(c in inverse for c in piece):
                return bytes(inverse[c] for c in piece)
            return None
        if byte_fallback and (m := _BYTE_FALLBACK.fullmatch(piece)):
            return bytes([int(m[1], 16)])
        return None

    return raw


def build_app(engine: AsyncLLMEngine, config: ServerConfig) -> FastAPI:
    app = FastAPI(title="specdecode", docs_url=None, redoc_url=None, openapi_url=None)
    core = engine.engine
    tokenizer = core.tokenizer
    decode = fast_decoder(tokenizer)
    raw_bytes = vocab_bytes(tokenizer)
    decode_one = functools.lru_cache(maxsize=1 << 16)(lambda t: tokenizer.decode([t]))
    names = {config.served_model_name, *config.aliases}
    metrics = ServerMetrics(engine, config.served_model_name)

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError):
        return _error(e.status, e.message, e.type, e.param)

    @app.exception_handler(InvalidRequestError)
    async def _invalid(_: Request, e: InvalidRequestError):
        return _error(400, str(e), "invalid_request_error", e.param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, e: StarletteHTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return _error(e.status_code, str(e.detail), kind)

    @app.exception_handler(Exception)
    async def _internal(_: Request, e: Exception):
        log.exception("unhandled error")
        return _error(500, f"internal error: {type(e).__name__}", "internal_error")

    if config.api_key:
        # a plain ASGI middleware: Starlette's BaseHTTPMiddleware (@app.middleware) would hide
        # a client's disconnect from the route, and an abandoned request would run to its end
        app.add_middleware(_ApiKey, key=config.api_key)
    if config.request_id_headers:
        app.add_middleware(_RequestIdHeader)
    if config.allowed_origins is not None:  # (outside the key: a browser's preflight has none)
        from starlette.middleware.cors import CORSMiddleware

        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(config.allowed_origins),
            allow_methods=list(config.allowed_methods),
            allow_headers=list(config.allowed_headers),
            allow_credentials=config.allow_credentials,
        )

    async def read_json(request: Request, model_cls):
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > config.max_request_bytes:
            raise APIError(413, "request body too large", "invalid_request_error")
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > config.max_request_bytes:
                raise APIError(413, "request body too large", "invalid_request_error")
        try:
            raw = json.loads(body.decode("utf-8"))
        except UnicodeDecodeError as e:
            raise bad_request("the request body is not valid UTF-8") from e
        except json.JSONDecodeError as e:
            raise bad_request(f"the request body is not valid JSON: {e.msg}") from e
        except RecursionError as e:
            raise bad_request("the request body is nested too deeply") from e
        except ValueError as e:  # e.g. an integer literal past Python's 4300 digits
            raise bad_request(f"the request body is not valid JSON: {e}") from e
        if not isinstance(raw, dict):
            raise bad_request("the request body must be a JSON object")
        try:
            req = model_cls.model_validate(raw)
        except ValidationError as e:
            err = e.errors()[0]
            where = field_path(err.get("loc", ()))
            message = f"{where}: {err.get('msg')}" if where else str(err.get("msg"))
            raise bad_request(message, where or None) from e
        if req.model is not None and req.model not in names:
            raise APIError(
                404, f"the model {req.model!r} does not exist", "not_found_error", "model"
            )
        if getattr(req, "n", 1) > config.max_n:
            raise bad_request(f"n must be at most {config.max_n}", "n")
        if hasattr(req, "check_stream_options"):
            req.check_stream_options()
        return req

    def check_length(prompt_len: int, req, field: str) -> int:
        """The tokens to generate: the request's max_tokens (or max_completion_tokens, named in
        the error where that is the field sent), or all the context leaves after the prompt."""
        max_tokens = req.requested_max_tokens()
        limit = core.max_model_len
        if prompt_len >= limit:
            raise bad_request(
                f"this model's maximum context length is {limit} tokens; the prompt has "
                f"{prompt_len}",
                field,
            )
        room = limit - prompt_len
        if max_tokens is None:
            return room
        if max_tokens > room:
            raise bad_request(
                f"this model's maximum context length is {limit} tokens; you requested "
                f"{prompt_len + max_tokens} ({prompt_len} in the prompt, {max_tokens} to "
                "generate)",
                req.max_tokens_field(),
            )
        return max_tokens

    # ---- routes --------------------------------------------------------------------------------

    # HEAD too: load balancers and uptime checks probe with it
    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health():
        if not engine.alive:
            return _error(503, "the engine is not running", "internal_error")
        return {"status": "ok"}

    # vLLM's: SageMaker's liveness probe (GET or POST), and the server's version
    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping():
        return await health()

    @app.get("/version")
    async def version():
        from specdecode import __version__

        return {"version": __version__}

    @app.api_route("/v1/models", methods=["GET", "HEAD"])
    async def models():
        cards = [
            {"id": name, "object": "model", "created": int(time.time()),
             "owned_by": "specdecode", "max_model_len": core.max_model_len}
            for name in (config.served_model_name, *config.listed)
        ]  # fmt: skip
        return {"object": "list", "data": cards}

    @app.api_route("/metrics", methods=["GET", "HEAD"])
    async def prometheus():
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        req = await read_json(request, ChatCompletionRequest)
        messages, text = render(req, "/v1/completions")
        tools = calling(req)
        ids = encode(text, "messages", add_special_tokens=req.add_special_tokens)
        max_tokens = check_length(len(ids), req, "messages")
        params = req.sampling_params(max_tokens, req.requested_logprobs())
        thinking, params = reasoning_of(req, text, params)
        jobs = [(ids, params.for_choice(j)) for j in range(req.n)]
        # the reply's role (vLLM's): the server's response role after a generation prompt;
        # without one the model goes on with the last message, and the reply is in its role
        last = messages[-1]
        role = config.response_role if req.add_generation_prompt else last["role"]
        # echo (vLLM's): the reply starts with the last message where that is the reply's own
        echo = last["content"] if req.echo and last["role"] == role else ""
        echoes = [echo] * req.n if echo else []
        return await respond(request, req, jobs, len(ids), chat=True, echoes=echoes, role=role,
                             tools=tools, thinking=thinking)  # fmt: skip

    def reasoning_of(req, prompt: str, params):
        """A chat request's reply under the reasoning parser: whether it starts by reasoning
        (None: the reply is not split), and its sampling settings (a structured output then
        constrains what follows the reasoning)."""
        parser = config.reasoning_parser
        if parser is None:
            return None, params
        # (a reply that continues the last message: that message tells whether it thinks)
        last = req.messages[-1].text() if req.continue_final_message else None
        thinking = thinks(parser, prompt, req.chat_template_kwargs, last)
        # SGLang's separate_reasoning false: the reply as written, its grammar gated still,
        # but for a "required" / named call, whose arguments cannot hold the reasoning
        tools = req.tool_calling()
        whole_call = tools is not None and tools.constrained and not req.separate_reasoning
        gated = thinking and not config.reasoning_in_grammar and not whole_call
        if gated and params.structured_output is not None:
            params = dataclasses.replace(params, reasoning_end=REASONING_END)
        return (thinking if req.separate_reasoning else None), params

    def calling(req) -> ToolCalling | None:
        """A chat request's tool calling, where its reply is to be read for calls."""
        tools = req.tool_calling()
        if tools is not None and tools.mode == "auto" and config.tool_parser is None:
            raise bad_request(
                'tool_choice "auto" (the default with tools) needs a server started with '
                '--enable-auto-tool-choice --tool-call-parser hermes; "required" or a named '
                'function works without them, "none" calls no tool',
                "tool_choice",
            )
        return None if tools is None or tools.mode == "none" else tools

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = await read_json(request, CompletionRequest)
        prompts = req.prompts()
        if len(prompts) > config.max_prompts:
            raise bad_request(f"at most {config.max_prompts} prompts per request", "prompt")
        logprobs = req.requested_logprobs()
        jobs, prompt_tokens, echoes = [], 0, []
        for p in prompts:
            ids = encode(p, "prompt") if isinstance(p, str) else list(p)
            if not ids:
                raise bad_request("the prompt is empty", "prompt")
            max_tokens = check_length(len(ids), req, "prompt")
            params = req.sampling_params(max_tokens, logprobs)
            jobs += [(ids, params.for_choice(j)) for j in range(req.n)]
            prompt_tokens += len(ids)
            if req.echo:  # the prompt as sent; token ids as they decode (as vLLM does)
                echoes += [p] * req.n
        return await respond(request, req, jobs, prompt_tokens, chat=False, echoes=echoes)

    @app.post("/v1/responses")
    async def responses(request: Request):
        """OpenAI's Responses API: run as a chat completion of one reply, answered as a
        `response` object or its stream of events."""
        req = await read_json(request, ResponsesRequest)
        history: list[dict] = []
        if req.previous_response_id is not None:
            history = stored_response(req.previous_response_id, "previous_response_id").conversation
        chat_req = req.as_chat(history)
        try:
            _, text = render(chat_req, "/v1/completions")
        except APIError as e:  # (the messages are this request's input)
            e.param = "input" if e.param == "messages" else e.param
            raise
        # (as chat renders them: the template writes the special tokens, not the tokenizer)
        ids = encode(text, "input", add_special_tokens=chat_req.add_special_tokens)
        max_tokens = check_length(len(ids), chat_req, "input")
        params = chat_req.sampling_params(max_tokens, chat_req.requested_logprobs())
        tools = calling(chat_req)
        thinking, params = reasoning_of(chat_req, text, params)
        out = await respond(request, chat_req, [(ids, params)], len(ids), chat=True, tools=tools,
                            thinking=thinking)  # fmt: skip
        name = config.served_model_name
        keep = None
        if req.store and store.capacity:  # its conversation, without its instructions

            def keep(response: dict, reply: dict) -> None:
                store.put(response, [*history, *req.input_messages(), reply])

        if isinstance(out, StreamingResponse):
            lazy = tools is not None or thinking is not None
            events = response_events(req, name, out.body_iterator, keep, lazy, bool(thinking))
            return StreamingResponse(events, media_type="text/event-stream")
        if isinstance(out, Response):  # the client left
            return out
        return response_object(req, name, out, keep, bool(thinking))

    store = ResponseStore(config.max_stored_responses)

    def stored_response(response_id: str, param: str | None = None):
        """A stored response (`Stored`); a 404 where it is not kept (a continuation on a
        server that keeps none: a 400 saying so)."""
        if not store.capacity and param is not None:
            raise bad_request(
                "this server keeps no responses (serve --max-stored-responses N keeps the "
                "last N): send the conversation as input",
                param,
            )
        kept = store.get(response_id)
        if kept is None:
            why = (f"not stored, deleted, or past the last {store.capacity} kept"
                   if store.capacity else "this server keeps none")  # fmt: skip
            raise APIError(
                404, f"no stored response {response_id!r} ({why})", "not_found_error", param
            )
        return kept

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str):
        return stored_response(response_id).response

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str):
        stored_response(response_id)
        store.delete(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    # vLLM's tokenizer endpoints: what a prompt costs before sending it, and ids back to text
    @app.post("/tokenize")
    async def tokenize(request: Request):
        req = await read_json(request, TokenizeRequest)
        if req.messages is not None:
            text = render(req, "a prompt")[1]
            special, param = bool(req.add_special_tokens), "messages"
        else:
            text, param = req.prompt, "prompt"
            special = True if req.add_special_tokens is None else req.add_special_tokens
        ids = encode(text, param, add_special_tokens=special)
        out = {"count": len(ids), "max_model_len": core.max_model_len, "tokens": ids}
        if req.return_token_strs:
            out["token_strs"] = tokenizer.convert_ids_to_tokens(ids)
        return out

    @app.post("/detokenize")
    async def detokenize(request: Request):
        req = await read_json(request, DetokenizeRequest)
        size = len(tokenizer)
        bad = next((t for t in req.tokens if not 0 <= t < size), None)
        if bad is not None:
            raise bad_request(f"token id {bad} is outside the vocabulary (0..{size - 1})", "tokens")
        return {"prompt": tokenizer.decode(req.tokens)}

    def render(req, instead: str) -> tuple[list[dict], str]:
        """A request's chat messages, and the prompt text they render to (its template
        options; `instead`: what to use where the model has no template)."""
        try:
            messages = req.chat_messages()
            options = req.template_options(
                config.trust_request_chat_template, config.exclude_tools_when_tool_choice_none
            )
            return messages, core.render_chat(messages, instead, **options)
        except InvalidRequestError as e:
            raise bad_request(str(e), e.param) from e

    def encode(text: str, param: str, **kwargs) -> list[int]:
        try:
            return list(tokenizer(text, **kwargs).input_ids)
        except (TypeError, UnicodeEncodeError) as e:  # a lone surrogate ("\ud800") is valid JSON
            raise bad_request(f"the text of the {param} is not valid Unicode", param) from e

    # ---- generation ----------------------------------------------------------------------------

    async def respond(
        request: Request, req, jobs, prompt_tokens: int, chat: bool, echoes=(), role="assistant",
        tools: ToolCalling | None = None, thinking: bool | None = None,
    ):  # fmt: skip
        """Run the jobs (one per choice) and answer, streamed or whole. `echoes`: per choice,
        the prompt (text, or token ids: decoded once the engine has checked them) its text
        starts with (`echo`); empty for none. `role`: a chat reply's. `tools`: a chat
        request's tool calling (its replies parsed for calls). `thinking`: a chat reply is
        split into reasoning and content (None: not), starting in its reasoning (True) or not."""
        request_id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        handles: list[RequestHandle] = []
        for field, asked in (("logprobs", jobs[0][1].logprobs),
                             ("prompt_logprobs", jobs[0][1].prompt_logprobs)):  # fmt: skip
            if asked is not None and asked > config.max_logprobs:
                name = "top_logprobs" if field == "logprobs" and chat else field
                raise bad_request(f"{name} may be at most {config.max_logprobs} on this server "
                                  "(serve --max-logprobs)", name)  # fmt: skip
        so = jobs[0][1].structured_output
        if so is not None:  # compile (or fetch) off the event loop; `add` then hits the cache
            try:
                # the compiler itself too: its first build reads the whole vocabulary
                await asyncio.to_thread(lambda: core.grammar_compiler().compile(so))
            except InvalidRequestError as e:
                raise bad_request(str(e), req.structured_param()) from e
        try:
            rank = priority_rank(req.priority, config)
            for i, (ids, params) in enumerate(jobs):
                handles.append(engine.add(ids, params, f"{request_id}-{i}", rank))
        except BaseException as e:
            for h in handles:  # the choices added so far do not run on for nobody
                h.abort()
            if isinstance(e, InvalidRequestError):
                raise bad_request(str(e), e.param) from e
            if isinstance(e, EngineStoppedError):
                raise APIError(503, str(e), "internal_error") from e
            if isinstance(e, RecursionError):  # a schema nested past the event loop's stack
                raise bad_request("the structured output schema is nested too deeply") from e
            raise
        if config.log_requests:  # (once the engine has checked the prompts)
            log_request(request_id, jobs, req.n)
        # usage: a prompt's tokens count once, however many choices it has, and so do its
        # tokens found in the prefix cache (read when the response ends: found on admission)
        n = req.n
        prompt_tokens = (prompt_tokens, handles[::n])
        # a choice that fails mid-generation with a 400 is a grammar dead end: its field
        param = req.structured_param() if so is not None else None
        # the reasoning parser's split: whether replies start reasoning, and whether the
        # reasoning goes out (vLLM's include_reasoning)
        split_as = None if thinking is None else (thinking, req.include_reasoning)
        meta = (request_id, created, chat, prompt_tokens, param, role, tools, split_as)
        echoes = [e if isinstance(e, str) else tokenizer.decode(e) for e in echoes]
        # vLLM's return_tokens_as_token_ids: the request's, else the server's flag
        labels = req.return_tokens_as_token_ids
        labels = config.return_tokens_as_token_ids if labels is None else labels
        if req.stream:
            usage_too = req.include_usage or config.force_include_usage
            body = sse(handles, usage_too, meta, echoes, req.return_token_ids, labels,
                       req.continuous_usage)  # fmt: skip
            return StreamingResponse(body, media_type="text/event-stream")
        try:
            # (completions' echo with logprobs computes them: they are given too, as in vLLM)
            asked = jobs[0][1].prompt_logprobs is not None
            return await collect(
                request, handles, meta, echoes, asked, req.return_token_ids, labels
            )
        finally:
            for h in handles:
                h.abort()

    def log_request(request_id: str, jobs, n: int) -> None:
        """vLLM's --enable-log-requests: each prompt of a request (its text and ids, cut to
        --max-log-len) and its sampling settings, logged as it starts."""
        cut = config.max_log_len
        for i in range(0, len(jobs), n):
            ids, params = jobs[i]
            ids = ids if cut is None else ids[:cut]
            text = tokenizer.decode(ids)
            text = text if cut is None else text[:cut]
            req_log.info("received request %s-%d: prompt %r, prompt token ids %s, n %d, params %s",
                         request_id, i, text, ids, n, params)  # fmt: skip

    def failure(u, param: str | None) -> APIError:
        """A choice's failure as the error it answers: a 400 (a grammar dead end) names the
        request's structured-output field."""
        if u.error_status < 500:
            return APIError(u.error_status, u.error, "invalid_request_error", param)
        return APIError(u.error_status, u.error, "internal_error")

    async def collect(
        request: Request,
        handles: list[RequestHandle],
        meta,
        echoes: list[str],
        prompt_logprobs: bool = False,
        token_ids: bool = False,
        labels: bool = False,
    ):
        """The whole response; `prompt_logprobs`: the request asked for them (vLLM's field),
        where echo with logprobs computes them for its own use; `token_ids`: vLLM's
        `return_token_ids` (the prompt's and each choice's token ids)."""
        request_id, created, chat, prompt_tokens, param, role, tools, split_as = meta
        firsts = prompt_tokens[1]  # each prompt's first choice
        decoded: dict = {}  # each prompt's vLLM prompt_logprobs, built once

        async def drain(h: RequestHandle) -> dict:
            out = {"text": "", "tokens": 0, "logprobs": [], "finish": None}
            async for u in h.updates():
                if u.error:
                    raise failure(u, param)
                out["text"] += u.text
                out["tokens"] = u.num_output_tokens
                out["logprobs"] += u.logprobs
                out["finish"] = u.finish_reason
            return out

        tasks = [asyncio.ensure_future(drain(h)) for h in handles]
        try:
            while not all(t.done() for t in tasks):
                done, _ = await asyncio.wait(tasks, timeout=0.25, return_when="FIRST_EXCEPTION")
                failed = next((t for t in done if t.exception() is not None), None)
                if failed is not None:  # one choice failed: the response is that error
                    raise failed.exception()
                if await request.is_disconnected():
                    return Response(status_code=499)  # aborted below, memory freed
            results = [t.result() for t in tasks]
        finally:
            for t in tasks:
                t.cancel()
        choices = []
        for i, (h, r) in enumerate(zip(handles, results, strict=True)):
            choice: dict = {"index": i}
            finish = r["finish"]
            if chat:
                echo = echoes[i] if echoes else ""
                text, reasoning, answered = r["text"], None, True
                if split_as is not None:
                    thought = ReasoningStream(split_as[0])
                    reasoning, text = split(thought, text)
                    answered = thought.ended  # (a reply cut off in its reasoning calls nothing)
                if tools is None or not answered:
                    content = echo + text if text is not None else (echo or None)
                    choice["message"] = {"role": role, "content": content}
                else:
                    content, calls = whole(tools.stream(config.tool_parser), text or "")
                    if echo:
                        content = echo + (content or "")
                    choice["message"] = {"role": role, "content": content}
                    if calls:
                        choice["message"]["tool_calls"] = calls
                    finish = tool_finish(tools, bool(calls), finish)
                if split_as is not None:  # (vLLM's field, and SGLang's / DeepSeek's)
                    choice["message"].update(reasoning_fields(reasoning if split_as[1] else None))
            else:
                choice["text"] = (echoes[i] if echoes else "") + r["text"]
            wants = h.seq.params.logprobs is not None
            context = h.seq.prompt_token_ids[-DETOKENIZE_CONTEXT:]
            # the prompt's first choice holds its prompt logprobs (the others skip them)
            first = firsts[i // (len(handles) // len(firsts))].seq
            if echoes and wants and not chat:  # echo with logprobs: the prompt's tokens first
                lp = echo_logprobs(
                    first, r["logprobs"], echoes[i], h.seq.params.logprobs, labels, decoded
                )
            else:
                lp = (
                    format_logprobs(r["logprobs"], chat, context, labels=labels)[0]
                    if wants
                    else None
                )
            choice["logprobs"] = lp
            choice["finish_reason"] = finish
            choice["stop_reason"] = h.seq.stop_reason  # (vLLM's: the stop string or token id)
            if prompt_logprobs and not chat:  # vLLM's field, per choice
                choice["prompt_logprobs"] = vllm_prompt_logprobs(first, decoded)
            if token_ids:  # (vLLM's: completions give the prompt's per choice, chat once)
                if not chat:
                    choice["prompt_token_ids"] = list(h.seq.prompt_token_ids)
                choice["token_ids"] = list(h.seq.output_token_ids)
            choices.append(choice)
        completion = sum(r["tokens"] for r in results)
        body = {
            "id": request_id,
            "object": "chat.completion" if chat else "text_completion",
            "created": created,
            "model": config.served_model_name,
            "choices": choices,
            "usage": usage(*prompt_tokens, completion, split_as, handles),
        }
        if prompt_logprobs and chat:  # vLLM's field, for the one prompt
            body["prompt_logprobs"] = vllm_prompt_logprobs(firsts[0].seq, decoded)
        if token_ids and chat:
            body["prompt_token_ids"] = list(firsts[0].seq.prompt_token_ids)
        return body

    def vllm_prompt_logprobs(seq, memo: dict) -> list:
        """vLLM's `prompt_logprobs`: None for the first token, then per prompt token
        {token id: {logprob, rank, decoded_token}}, its own token first, then the top-n
        (built once per prompt: `memo`, by the prompt's first choice)."""
        if id(seq) not in memo:
            memo[id(seq)] = [
                None if d is None else {str(t): vars(lp) for t, lp in d.items()}
                for d in prompt_logprob_entries(seq, decode_one)
            ]
        return memo[id(seq)]

    def echo_logprobs(seq, entries: list, echo: str, n: int, labels: bool, memo: dict) -> dict:
        """Completions' logprobs with echo (vLLM's, what evaluation harnesses read): the
        prompt's tokens, the first with no logprob (null), each with its top `n` (the request's
        logprobs, as vLLM trims them), then the generated ones, whose text offsets count from
        the end of the echoed text."""
        prompt = prompt_logprobs_object(seq, n, labels, memo)
        ids = seq.prompt_token_ids
        out, _ = format_logprobs(
            entries, False, list(ids[-DETOKENIZE_CONTEXT:]), len(echo), labels=labels
        )
        return {key: [*prompt[key], *out[key]] for key in prompt}

    def prompt_logprobs_object(seq, n: int, labels: bool, memo: dict) -> dict:
        """A prompt's tokens as completions' logprobs (what echo lists first): the first
        with no logprob (null), each with its top `n` (built once per prompt: `memo`, shared
        by its choices, which do not change it)."""
        key = ("echo", id(seq), n, labels)
        if key not in memo:
            memo[key] = _prompt_logprobs_object(seq, n, labels)
        return memo[key]

    def _prompt_logprobs_object(seq, n: int, labels: bool) -> dict:
        ids = seq.prompt_token_ids
        head = f"token_id:{ids[0]}" if labels else token_text([], ids[0])
        scored = [(t, (lp, top[:n], rank)) for t, (lp, top, rank) in
                  zip(ids[1:], seq.prompt_logprobs, strict=True)]  # fmt: skip
        first = text_advance([], ids[0])
        prompt, _ = format_logprobs(scored, False, [ids[0]], first, labels=labels)
        return {
            "tokens": [head, *prompt["tokens"]],
            "token_logprobs": [None, *prompt["token_logprobs"]],
            "top_logprobs": [None, *prompt["top_logprobs"]],
            "text_offset": [0, *prompt["text_offset"]],
        }

    def usage(
        prompt_tokens: int, firsts: list[RequestHandle], completion: int, split_as=None,
        handles: list[RequestHandle] = (),
    ) -> dict:  # fmt: skip
        """A response's usage; with the reasoning parser's split (`split_as`), the reasoning
        tokens of its replies (`handles`) too, as OpenAI counts them."""
        out = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion,
            "prompt_tokens_details": {
                "cached_tokens": sum(h.seq.num_cached_tokens for h in firsts)
            },
        }
        if split_as is not None:
            thinking = split_as[0]
            n = sum(reasoning_tokens(h.seq.output_token_ids) for h in handles) if thinking else 0
            out["completion_tokens_details"] = {"reasoning_tokens": n}
        return out

    # the reasoning's end tag as one token of the vocabulary (as reasoning models have it)
    end_ids = tokenizer.encode(REASONING_END, add_special_tokens=False)
    end_token = end_ids[0] if len(end_ids) == 1 else None

    def reasoning_tokens(ids: list[int]) -> int:
        """How many of a reply's tokens are its reasoning: up to the one whose text completes
        the reasoning's end tag (all of them where it never ends)."""
        if end_token is not None:  # (a reply may write the tag's text in pieces too)
            at = ids.index(end_token) if end_token in ids else -1
            if at >= 0 and REASONING_END not in tokenizer.decode(
                ids[:at], skip_special_tokens=False
            ):
                return at + 1
        if REASONING_END not in tokenizer.decode(ids, skip_special_tokens=False):
            return len(ids)
        lo, hi = 1, len(ids)  # the fewest tokens whose text holds the tag
        while lo < hi:
            mid = (lo + hi) // 2
            if REASONING_END in tokenizer.decode(ids[:mid], skip_special_tokens=False):
                hi = mid
            else:
                lo = mid + 1
        return lo

    def token_text(context: list[int], tok: int) -> str:
        """`tok`'s text where it follows `context` (a SentencePiece token's leading space
        shows only after another token; decoded alone it is dropped). A token that ends
        inside a character is U+FFFD, as in vLLM; its `bytes` are the real ones."""
        base = tokenizer.decode(context)
        full = tokenizer.decode(context + [tok])
        if base.endswith("\ufffd") or not full.startswith(base):
            return tokenizer.decode([tok])
        return full[len(base) :]

    def token_bytes(tok: int, text: str) -> list[int]:
        """OpenAI's `bytes`: the token's own bytes, so that joining them rebuilds the text even
        where a character spans tokens; the text's UTF-8 where the vocabulary records none."""
        raw = raw_bytes(tok)
        return list(raw if raw is not None else text.encode())

    def text_advance(context: list[int], tok: int) -> int:
        """Characters `tok` adds to the choice's text where it follows `context`. The text
        holds whole characters only (the engine waits for a character's last token), so a
        token that ends inside one adds nothing yet and the one that ends it adds it: offsets
        from the decoded prefix, as OpenAI's, never run past the text."""
        base = decode(context, skip_special_tokens=True).rstrip("\ufffd")
        full = decode(context + [tok], skip_special_tokens=True).rstrip("\ufffd")
        if not full.startswith(base):
            return len(token_text(context, tok))
        return len(full) - len(base)

    def format_logprobs(
        entries: list, chat: bool, context: list[int], text_offset: int = 0, labels: bool = False
    ) -> tuple[dict, int]:
        """Our (logprob, top) per token -> OpenAI's chat or completions logprobs object, and
        the text offset after these tokens. `context`: the token ids before these (the prompt's
        last ones, then the output's), extended with them; `text_offset`: characters of the
        choice's text before them; `labels`: tokens named "token_id:N" (vLLM's
        return_tokens_as_token_ids: exact where a token's text is not), bytes still theirs."""

        def name(tok: int, text: str) -> str:
            return f"token_id:{tok}" if labels else text

        pieces, offsets, pos = [], [], text_offset
        for tok, (lp, top, _) in entries:
            window = context[-DETOKENIZE_CONTEXT:]
            pieces.append(
                (
                    (tok, token_text(window, tok)),
                    lp,
                    [((t, token_text(window, t)), v) for t, v in top],
                )
            )
            if not chat:
                offsets.append(pos)
                pos += text_advance(window, tok)
            context.append(tok)
        if chat:
            content = [
                {
                    "token": name(tok, s),
                    "logprob": lp,
                    "bytes": token_bytes(tok, s),
                    "top_logprobs": [
                        {"token": name(t_id, t), "logprob": v, "bytes": token_bytes(t_id, t)}
                        for (t_id, t), v in top
                    ],
                }
                for (tok, s), lp, top in pieces
            ]
            return {"content": content}, pos
        return {
            "tokens": [name(tok, s) for (tok, s), _, _ in pieces],
            "token_logprobs": [lp for _, lp, _ in pieces],
            # the sampled token is always among them (OpenAI's legacy API and vLLM: up to
            # logprobs + 1 entries)
            "top_logprobs": [
                {**{name(t_id, t): v for (t_id, t), v in top}, name(tok, s): lp}
                for (tok, s), lp, top in pieces
            ],
            "text_offset": offsets,
        }, pos

    async def sse(
        handles: list[RequestHandle],
        include_usage: bool,
        meta,
        echoes: list[str],
        token_ids: bool = False,
        labels: bool = False,
        continuous: bool = False,
    ) -> AsyncIterator[str]:
        """The response as server-sent events; `token_ids`: vLLM's `return_token_ids` (each
        chunk's new token ids; the prompt's in the first chunk, of each choice for
        completions); `continuous`: vLLM's `continuous_usage_stats` (each update's chunk
        carries its choice's usage so far: its prompt's tokens and its own)."""
        request_id, created, chat, prompt_tokens, param, role, tools, split_as = meta
        obj = "chat.completion.chunk" if chat else "text_completion"
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, h: RequestHandle) -> None:
            try:
                async for u in h.updates():
                    await queue.put((i, u))
            except Exception as e:  # noqa: BLE001 - reported on the stream
                await queue.put((i, StreamUpdate("", [], error=f"{type(e).__name__}: {e}")))

        def chunk(choices: list, usage_=None, **extra) -> str:
            body = {"id": request_id, "object": obj, "created": created,
                    "model": config.served_model_name, "choices": choices, **extra}  # fmt: skip
            if usage_ is not None:
                body["usage"] = usage_
            return f"data: {json.dumps(body)}\n\n"

        def so_far(i: int, completion: int) -> dict | None:
            """Choice i's usage so far, on each of its chunks (`continuous`), else None."""
            if not continuous:
                return None
            prompt = len(handles[i].seq.prompt_token_ids)
            return {"prompt_tokens": prompt, "completion_tokens": completion,
                    "total_tokens": prompt + completion}  # fmt: skip

        tasks = [asyncio.ensure_future(pump(i, h)) for i, h in enumerate(handles)]
        try:
            if chat:  # (one prompt: its choices' usage so far is one)
                first = {"role": role, "content": ""}
                prompt = {"prompt_token_ids": list(handles[0].seq.prompt_token_ids)}
                yield chunk(
                    [
                        {"index": i, "delta": first, "logprobs": None, "finish_reason": None}
                        for i in range(len(handles))
                    ],  # fmt: skip
                    so_far(0, 0),
                    **(prompt if token_ids else {}),
                )
            prompt_sent = set()  # completions' choices whose prompt ids went out
            echoed: dict = {}  # each prompt's echoed logprobs, built once

            def echo_chunk(indices, scored: bool = False) -> str:
                """Each choice's text starts with its prompt (chat: the last message); with
                completions' logprobs, the prompt's tokens and theirs (`scored`)."""
                key = "delta" if chat else "text"
                firsts = [
                    {"index": i, key: {"content": echoes[i]} if chat else echoes[i],
                     "logprobs": None, "finish_reason": None}
                    for i in indices
                ]  # fmt: skip
                for c in firsts:
                    i = c["index"]
                    if scored:
                        top = handles[i].seq.params.logprobs
                        c["logprobs"] = prompt_logprobs_object(group_first(i), top, labels, echoed)
                    if token_ids and not chat:  # (a choice's first chunk carries its prompt's)
                        c["prompt_token_ids"] = list(handles[i].seq.prompt_token_ids)
                        prompt_sent.add(i)
                if continuous:  # a chunk a choice: each its own prompt's usage
                    return "".join(chunk([c], so_far(c["index"], 0)) for c in firsts)
                return chunk(firsts)

            # completions' echo with logprobs: a prompt's echo waits for its prompt's logprobs,
            # scored by the prompt's first choice (whole once that choice's first update comes);
            # the prompt's other choices' updates wait with it
            n = len(handles) // len(prompt_tokens[1])

            def group_first(i: int):
                return handles[i - i % n].seq

            scored = bool(echoes) and not chat and handles[0].seq.params.logprobs is not None
            held: dict[int, list] = {}  # a prompt (its first choice's index): updates waiting
            if echoes and not scored:
                yield echo_chunk(range(len(handles)))

            def fed(stream, text: str, finished: bool):
                """A reply's parser fed its new text, or its last."""
                return (stream.last if finished else stream.feed)(text)

            def emit(i: int, u: StreamUpdate) -> str | None:
                """Choice i's update as its chunk (None: nothing to send)."""
                if u.error:
                    e = failure(u, param)
                    err = {"message": e.message, "type": e.type, "param": e.param, "code": e.status}
                    return f"data: {json.dumps({'error': err})}\n\n"
                completion[i] = u.num_output_tokens
                if not (u.text or u.finished or u.logprobs or (token_ids and u.token_ids)):
                    return None
                lp = None
                if u.logprobs:
                    lp, offsets[i] = format_logprobs(
                        u.logprobs, chat, contexts[i], offsets[i], labels=labels
                    )
                c: dict = {"index": i}
                finish = u.finish_reason
                text, reasoning = u.text, ""
                if chat and split_as is not None:
                    reasoning, text = fed(thoughts[i], text, u.finished)
                # (the calls are read from the content: a named function's call opens with it,
                # and a reply cut off in its reasoning calls nothing)
                if chat and tools is not None and (not split_as or thoughts[i].ended):
                    parsed = fed(streams[i], text, u.finished)
                    if u.finished:
                        finish = tool_finish(tools, streams[i].num_calls > 0, finish)
                    c["delta"] = {}
                    if parsed.content:
                        c["delta"]["content"] = parsed.content
                    if parsed.calls:
                        c["delta"]["tool_calls"] = parsed.calls
                elif chat:
                    c["delta"] = {"content": text} if text else {}
                else:
                    c["text"] = text
                if reasoning and split_as[1]:
                    c["delta"] = {**reasoning_fields(reasoning), **c["delta"]}
                if split_as and not (c["delta"] or lp or u.finished or (token_ids and u.token_ids)):
                    return None  # (reasoning left out, or text held back: nothing to send)
                c["logprobs"] = lp
                c["finish_reason"] = finish
                if u.finished:
                    c["stop_reason"] = handles[i].seq.stop_reason
                if token_ids:
                    if not chat and i not in prompt_sent:
                        c["prompt_token_ids"] = list(handles[i].seq.prompt_token_ids)
                        prompt_sent.add(i)
                    c["token_ids"] = list(u.token_ids)
                return chunk([c], so_far(i, u.num_output_tokens))

            remaining, completion = len(handles), {}
            streams = [tools.stream(config.tool_parser) for _ in handles] if tools else []
            thoughts = [ReasoningStream(split_as[0]) for _ in handles] if split_as else []
            # text offsets count from the end of the echoed text
            offsets = [len(e) for e in echoes] if scored else [0] * len(handles)
            contexts = [h.seq.prompt_token_ids[-DETOKENIZE_CONTEXT:] for h in handles]
            while remaining:
                i, u = await queue.get()
                ready = [(i, u)]
                g = i - i % n  # the prompt's first choice
                if scored and held.get(g, []) is not None:  # not echoed yet
                    if i != g:
                        held.setdefault(g, []).append((i, u))
                        continue
                    # (a failure before the prompt was scored echoes its text alone)
                    yield echo_chunk(range(g, g + n), scored=not u.error)
                    ready = [*held.get(g, []), (i, u)]
                    held[g] = None
                for i, u in ready:
                    piece = emit(i, u)
                    if piece:
                        yield piece
                    if u.finished or u.error:
                        remaining -= 1
            if include_usage:
                total = sum(completion.values())
                yield chunk([], usage(*prompt_tokens, total, split_as, handles))
            yield "data: [DONE]\n\n"
        finally:
            for t in tasks:
                t.cancel()
            for h in handles:
                h.abort()

    app.state.metrics = metrics
    return app


def priority_rank(priority: int | None, config: ServerConfig) -> int:
    """A request's priority as the engine orders it (lower first): vLLM's as given (none: 0),
    SGLang's negated (higher first) unless low values go first, none after all given."""
    if priority is None:
        return 2**63 if config.priority_absent_last else 0
    return config.priority_sign * priority


def reasoning_fields(reasoning: str | None) -> dict:
    """A reply's reasoning as vLLM names it, and as SGLang and DeepSeek do."""
    return {"reasoning": reasoning, "reasoning_content": reasoning}


def tool_finish(tools: ToolCalling, called: bool, finish: str | None) -> str | None:
    """A reply's finish reason: "tool_calls" where it ended by calling tools (OpenAI's; a
    named function's call ends with "stop", as OpenAI's does)."""
    if called and finish == "stop" and tools.mode in ("auto", "required"):
        return "tool_calls"
    return finish


def run_server(args) -> None:
    """`specdecode serve`: load the engine, then serve until interrupted."""
    import uvicorn

    from specdecode.cli import engine_kwargs
    from specdecode.config import EngineConfig
    from specdecode.engine.engine import LLMEngine

    model = serve_model(args)
    if model is None and args.served_model_name and len(args.served_model_name) > 1:
        raise SpecDecodeError(
            f"no model given, and --served-model-name took {args.served_model_name}: name the "
            "model before --served-model-name (its several names take what follows)"
        )
    parser = tool_parser(args)  # (flags checked before the model loads)
    check_tls(args)
    policy, sign = scheduling(args)
    if args.enable_reasoning and args.reasoning_parser is None:
        raise SpecDecodeError("--enable-reasoning needs --reasoning-parser (which alone turns it "
                              "on here)")  # fmt: skip
    in_reasoning = args.structured_outputs_config.get("enable_in_reasoning", False)
    if args.structured_outputs_in_reasoning is not None:  # (vLLM's dotted form)
        in_reasoning = args.structured_outputs_in_reasoning == "true"
    if args.log_level is not None:  # (SGLang's: specdecode's loggers and the HTTP server's)
        logging.getLogger("specdecode").setLevel(args.log_level.upper())
    # (an explicit --kv-cache-memory-gb wins over the fraction, as vLLM's byte budget does)
    fraction = None if args.kv_cache_memory_gb is not None else args.gpu_memory_utilization
    kwargs = {**engine_kwargs(args), "max_num_seqs": args.max_num_seqs,
              "gpu_memory_utilization": fraction, "scheduling_policy": policy,
              "block_size": args.block_size}  # fmt: skip
    if args.seed is not None:
        kwargs["seed"] = args.seed
    core = LLMEngine(EngineConfig(model=model, **kwargs))
    name, aliases = served_names(model, args.served_model_name)
    api_key = args.api_key or os.environ.get("SPECDECODE_API_KEY")
    engine = AsyncLLMEngine(core)
    app = build_app(
        engine,
        ServerConfig(
            served_model_name=name,
            aliases=aliases,
            listed=aliases if args.served_model_name else (),  # (several names: all listed)
            api_key=api_key,
            max_request_bytes=args.max_request_bytes,
            max_n=args.max_n,
            trust_request_chat_template=args.trust_request_chat_template,
            return_tokens_as_token_ids=args.return_tokens_as_token_ids,
            response_role=args.response_role,
            max_stored_responses=args.max_stored_responses,
            tool_parser=parser,
            exclude_tools_when_tool_choice_none=args.exclude_tools_when_tool_choice_none,
            reasoning_parser=args.reasoning_parser,
            priority_sign=sign,
            priority_absent_last=args.enable_priority_scheduling,
            reasoning_in_grammar=in_reasoning,
            force_include_usage=args.enable_force_include_usage,
            request_id_headers=args.enable_request_id_headers,
            max_logprobs=20 if args.max_logprobs == -1 else args.max_logprobs,
            allowed_origins=None if args.allowed_origins is None else tuple(args.allowed_origins),
            allowed_methods=tuple(args.allowed_methods),
            allowed_headers=tuple(args.allowed_headers),
            allow_credentials=args.allow_credentials,
            log_requests=args.enable_log_requests,
            max_log_len=args.max_log_len,
        ),
    )
    if args.enable_log_requests:
        req_log.setLevel(logging.INFO)
        if not logging.getLogger().handlers or logging.getLogger().level > logging.INFO:
            handler = logging.StreamHandler()
            handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
            req_log.addHandler(handler)
            req_log.propagate = False

    if args.host not in ("127.0.0.1", "localhost", "::1") and not api_key:
        log.warning(
            "serving on %s without an API key: anyone who can reach it can use it", args.host
        )
    if core.controller.policy == "adaptive":
        # before the port opens, as the rest of loading: the first step would run it (~3 s),
        # and the first requests would wait for it (a `bench http` run saw a 5 s p99 TTFT)
        print("specdecode: timing the step-cost curve (adaptive policy) ...", flush=True)
        core.ensure_calibrated()
    # HTTP on a thread, the engine on the main thread (see AsyncLLMEngine.run)
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            root_path=args.root_path,
            log_level=args.uvicorn_log_level or args.log_level or "warning",
            access_log=not args.disable_uvicorn_access_log,
            uds=args.uds,
            ssl_keyfile=args.ssl_keyfile,
            ssl_certfile=args.ssl_certfile,
            ssl_ca_certs=args.ssl_ca_certs,
        )  # fmt: skip
    )
    http = threading.Thread(target=server.run, name="specdecode-http", daemon=True)
    http.start()
    watcher = threading.Thread(target=_stop_with, args=(http, engine), daemon=True)
    watcher.start()
    restore = _drain_on_sigterm(server, engine, args.shutdown_timeout)
    scheme = "https" if args.ssl_certfile else "http"
    where = f"unix socket {args.uds}" if args.uds else f"{scheme}://{args.host}:{args.port}/v1"
    print(f"specdecode: serving {name} on {where}", flush=True)
    try:
        engine.run()
    except KeyboardInterrupt:
        pass
    finally:
        server.should_exit = True
        engine.shutdown()
        http.join(timeout=10)
        if restore is not None:
            restore()
    if not server.started:
        raise SpecDecodeError(f"the HTTP server could not start on {where}")


def check_tls(args) -> None:
    """HTTPS needs its certificate; each file given must be there (checked before the model
    loads, not when the port opens)."""
    if (args.ssl_keyfile or args.ssl_ca_certs) and not args.ssl_certfile:
        raise SpecDecodeError("--ssl-keyfile / --ssl-ca-certs need --ssl-certfile")
    for flag, path in (("--ssl-keyfile", args.ssl_keyfile), ("--ssl-certfile", args.ssl_certfile),
                       ("--ssl-ca-certs", args.ssl_ca_certs)):  # fmt: skip
        if path is not None and not os.path.isfile(path):
            raise SpecDecodeError(f"{flag}: no file {path!r}")


def scheduling(args) -> tuple[str, int]:
    """The scheduling policy, and the sign that turns a request's priority into the engine's
    order (lower first): vLLM's --scheduling-policy priority (lower first), or SGLang's
    --enable-priority-scheduling (higher first, unless --schedule-low-priority-values-first)."""
    sglang = args.enable_priority_scheduling
    if args.schedule_low_priority_values_first and not sglang:
        raise SpecDecodeError("--schedule-low-priority-values-first needs "
                              "--enable-priority-scheduling (SGLang's flags)")  # fmt: skip
    if sglang and args.scheduling_policy == "priority":
        raise SpecDecodeError(
            "give one of --scheduling-policy priority (vLLM's: lower values first) and "
            "--enable-priority-scheduling (SGLang's: higher values first by default)"
        )
    if sglang:
        return "priority", 1 if args.schedule_low_priority_values_first else -1
    return args.scheduling_policy, 1


def tool_parser(args) -> str | None:
    """The call format tool_choice "auto" parses: vLLM's `--enable-auto-tool-choice
    --tool-call-parser NAME`, or SGLang's `--tool-call-parser NAME` alone."""
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise InvalidRequestError(
            "--enable-auto-tool-choice needs --tool-call-parser (hermes: calls written as "
            "<tool_call>JSON</tool_call>, as Qwen2.5's and Hermes' chat templates write them)"
        )
    return parser_format(args.tool_call_parser)


def serve_model(args) -> str | None:
    """The model to serve: `specdecode serve MODEL` (vLLM's form; `model_tag`, as vLLM calls
    it) or `--model`; both only where they agree."""
    tag = getattr(args, "model_tag", None)
    if tag is not None and args.model is not None and tag != args.model:
        raise InvalidRequestError(f"two models given: {tag!r} and --model {args.model!r}")
    return tag if tag is not None else args.model


def served_names(
    model: str | None, served_model_name: str | list[str] | None
) -> tuple[str, tuple[str, ...]]:
    """The name the server answers as, and the others a request may use. `--served-model-name`
    alone, as in vLLM; else the model as it was named (the default's Hugging Face id when none
    was), also known by its Hugging Face id where it is a built-in or pullable model: a client
    written for vLLM sends that id, even where the model was named `qwen2.5-coder-1.5b` here."""
    from specdecode.models.loader import DEFAULT_HUB_ID, hub_id

    if served_model_name:  # (several: the first answers, all are accepted)
        names = [served_model_name] if isinstance(served_model_name, str) else served_model_name
        return names[0], tuple(names[1:])
    name = DEFAULT_HUB_ID if model is None else model
    hub = hub_id(model)
    return name, (hub,) if hub is not None and hub != name else ()


def _drain_on_sigterm(server, engine: AsyncLLMEngine, grace: float):
    """SIGTERM (Kubernetes, systemd, `docker stop -t 30`) stops the server gracefully: it
    accepts no new connection, the requests in flight run to their end, and then the process
    exits 0; past `grace` seconds (`--shutdown-timeout`), or at a second SIGTERM, the engine
    stops and what still runs ends with an error, as on Ctrl-C. (uvicorn's own handlers work
    on the main thread only, where the engine runs; the default action killed the process
    mid-response.) The handler only sets flags; a watcher thread does the rest. Returns a
    function that puts the previous handler back, or None where signals cannot be set (not
    the main thread)."""
    import signal
    import time

    if threading.current_thread() is not threading.main_thread():
        return None
    received: list[int] = []

    def drain(signum, frame) -> None:  # (signal-safe: no locks, no logging)
        received.append(signum)
        server.should_exit = True  # uvicorn closes its socket, then waits for the responses

    def watch() -> None:
        while not received:
            time.sleep(0.1)
        log.warning("SIGTERM: accepting no new requests; finishing those in flight (up to "
                    "%g s)", grace)  # fmt: skip
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and len(received) < 2:
            time.sleep(0.1)
        engine.shutdown()

    previous = signal.signal(signal.SIGTERM, drain)
    threading.Thread(target=watch, name="specdecode-sigterm", daemon=True).start()
    return lambda: signal.signal(
        signal.SIGTERM, previous if previous is not None else signal.SIG_DFL
    )


def _stop_with(http: threading.Thread, engine: AsyncLLMEngine) -> None:
    """If the HTTP server stops (a port already in use, a fatal error), stop the engine too."""
    http.join()
    engine.shutdown()
