"""OpenAI request bodies (the fields this server honours) and their conversion to
`SamplingParams`. Unknown fields are ignored, as OpenAI-compatible servers commonly do; fields
that would change the output but are not supported are refused with a clear message."""

from __future__ import annotations

import types
from typing import Any, Literal, Union, get_args, get_origin

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    StrictBool,
    ValidationError,
    field_validator,
    model_validator,
)

from specdecode.argtypes import MAX_TEMPERATURE
from specdecode.errors import InvalidRequestError
from specdecode.sampling import SamplingParams
from specdecode.serving.tools import ToolCalling, check_tools, template_messages
from specdecode.structured import StructuredOutput

_UNION_TAGS = {"str", "int", "float", "bool", "dict", "list", "none"}


def field_path(loc) -> str:
    """A validation error's location as the request's field path: pydantic puts the member
    of a union it tried there too ("stop.str", "prompt.list[int].0"), which is no field."""
    return ".".join(
        str(x) for x in loc if not (isinstance(x, str) and (x in _UNION_TAGS or "[" in x))
    )


class StreamOptions(BaseModel):
    """OpenAI's `stream_options`: a flag is a JSON boolean ("yes" is refused, as OpenAI does)."""

    model_config = ConfigDict(extra="allow")  # (unknown keys kept: they count as given)

    include_usage: StrictBool | None = None
    # vLLM's: with include_usage, every chunk carries its choice's usage so far
    continuous_usage_stats: StrictBool | None = None


class _NullIsDefault(BaseModel):
    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _null_is_the_default(cls, data: Any) -> Any:
        """OpenAI marks most fields nullable ("or null"; vLLM declares them Optional with a
        default): a JSON null in a field that takes no None means its default."""
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {
            k: v
            for k, v in data.items()
            if v is not None or k not in fields or _allows_none(fields[k].annotation)
        }


class _Request(_NullIsDefault):
    model: str | None = None
    temperature: float | None = Field(default=None, ge=0, le=MAX_TEMPERATURE)
    top_p: float | None = Field(default=None, gt=0, le=1)
    n: int = Field(default=1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**64)  # int64 (or uint64)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None  # token id (a string in JSON) -> bias
    # vLLM's extra sampling fields
    repetition_penalty: float | None = Field(default=None, gt=0, le=100)
    min_p: float | None = Field(default=None, ge=0, le=1)
    min_tokens: int | None = Field(default=None, ge=0, strict=True)
    # fields that change the output and are not implemented: refused, not dropped (their
    # neutral values pass)
    use_beam_search: bool = False
    best_of: int | None = None
    prompt_logprobs: int | None = Field(default=None, ge=0, le=20)
    # tools: chat completions call them (see tools.py); elsewhere refused unless not called
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    functions: list[Any] | None = None
    function_call: str | dict[str, Any] | None = None
    # vLLM's extra sampling fields
    top_k: int | None = Field(default=None, ge=-1)
    # (vLLM's and SGLang's) the request's place in the queue under the priority policy (None:
    # not given, which SGLang's order ranks last and vLLM's as 0)
    priority: int | None = Field(default=None, strict=True, ge=-(2**63), lt=2**63)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: StrictBool = True
    return_token_ids: StrictBool = False  # vLLM's: the prompt's and the output's token ids
    # vLLM's: logprob tokens named "token_id:N" (None: the server's --return-tokens-as-token-ids)
    return_tokens_as_token_ids: StrictBool | None = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > 16:
            raise ValueError("at most 16 stop strings")
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        return stops

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and bool(self.stream_options.continuous_usage_stats)

    def check_stream_options(self) -> None:
        """Options for a stream on a request that does not stream: refused, as vLLM does, not
        ignored (the client likely meant to stream, or expects the usage chunk it set up)."""
        given = self.stream_options is not None and (
            self.stream_options.model_fields_set or self.stream_options.model_extra
        )
        if given and not self.stream:  # (vLLM's: an empty one asks for nothing)
            raise InvalidRequestError(
                "stream_options can only be given with stream: true", param="stream_options"
            )

    def _check_unsupported(self) -> None:
        if self.best_of is not None and self.best_of != 1:
            raise InvalidRequestError("best_of is not supported (only 1)", param="best_of")
        if self.use_beam_search:
            raise InvalidRequestError("use_beam_search is not supported", param="use_beam_search")
        if self.prompt_logprobs is not None and self.stream:
            raise InvalidRequestError(
                "prompt_logprobs are returned with the whole response, not streamed",
                param="prompt_logprobs",
            )
        self.tool_calling()

    def tool_calling(self) -> ToolCalling | None:
        """The request's tools, checked (chat completions); elsewhere tools are refused unless
        the request says not to call them."""
        for tools, choice in (("tools", "tool_choice"), ("functions", "function_call")):
            if getattr(self, tools) and getattr(self, choice) != "none":
                raise InvalidRequestError(
                    f"tool calling is not supported here (chat completions calls tools): "
                    f'{tools} needs {choice}: "none"',
                    param=tools,
                )
        return None

    # structured output: OpenAI's response_format, vLLM's guided_* fields and structured_outputs
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_grammar: str | None = None
    guided_choice: list[str] | None = None
    structured_outputs: dict[str, Any] | None = None

    def structured_output(self) -> StructuredOutput | None:
        given = {}
        rf = self.response_format
        if rf is not None:
            kind = rf.get("type")
            if kind == "json_object":
                given["json_object"] = True
            elif kind == "json_schema":
                spec = rf.get("json_schema")
                if not isinstance(spec, dict) or "schema" not in spec:
                    raise InvalidRequestError(
                        "response_format json_schema needs json_schema.schema",
                        param="response_format",
                    )
                given["json"] = spec["schema"]
            elif kind != "text":
                raise InvalidRequestError(
                    f"unsupported response_format type {kind!r}", param="response_format"
                )
        for field, key in (("guided_json", "json"), ("guided_regex", "regex"),
                           ("guided_grammar", "grammar"), ("guided_choice", "choice")):  # fmt: skip
            if getattr(self, field) is not None:
                given[key] = getattr(self, field)
        if self.structured_outputs:
            given.update(self.structured_outputs)
        tools = self.tool_calling()
        if tools is not None and tools.constrained:
            if given:
                mode = "a named function" if tools.mode == "named" else '"required"'
                raise InvalidRequestError(
                    f"{self._structured_field()} and tool_choice {mode} both constrain the "
                    "output: give one", param="tool_choice",
                )  # fmt: skip
            return StructuredOutput(json=tools.constraint())
        if not given:
            return None
        try:
            return StructuredOutput.coerce(given)
        except InvalidRequestError as e:
            raise InvalidRequestError(str(e), param=self.structured_param()) from e

    def structured_param(self) -> str:
        """The field that asked for structured output, for an error's `param` (the request's
        own name for it: guided_regex, say); response_format where several did."""
        tools = self.tool_calling()
        if tools is not None and tools.constrained:
            return "tool_choice"
        return self._structured_field()

    def _structured_field(self) -> str:
        names = [
            f
            for f in (
                "response_format",
                "guided_json",
                "guided_regex",
                "guided_grammar",
                "guided_choice",
                "structured_outputs",
            )  # fmt: skip
            if getattr(self, f) is not None
            and (f != "response_format" or self.response_format.get("type") != "text")
        ]
        return names[0] if len(names) == 1 else "response_format"

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        self._check_unsupported()
        return SamplingParams(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or -1,
            seed=self.seed,
            max_tokens=max_tokens,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids or [],
            ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            logprobs=logprobs,
            prompt_logprobs=self.requested_prompt_logprobs(),
            structured_output=self.structured_output(),
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            min_p=self.min_p or 0.0,
            min_tokens=self.min_tokens or 0,
            logit_bias=self._logit_bias(),
        )

    def requested_prompt_logprobs(self) -> int | None:
        return self.prompt_logprobs

    def _logit_bias(self) -> dict[int, float] | None:
        if not self.logit_bias:
            return None
        out = {}
        for key, value in self.logit_bias.items():
            try:
                tok = int(key)
            except ValueError:
                raise InvalidRequestError(
                    f"logit_bias keys must be token ids, got {key!r}", param="logit_bias"
                ) from None
            if tok < 0 or not -100 <= value <= 100:
                raise InvalidRequestError(
                    "logit_bias maps token ids to biases in [-100, 100]", param="logit_bias"
                )
            out[tok] = value
        return out


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None
    # an assistant's earlier tool calls; a tool message's answer to one (OpenAI's fields)
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    name: str | None = None
    # an assistant's earlier reasoning, as a reasoning parser gave it (vLLM's field, and
    # SGLang's / DeepSeek's): templates that show it read `reasoning_content`
    reasoning: str | None = None
    reasoning_content: str | None = None

    def template_fields(self) -> dict[str, Any]:
        """The message as chat templates read it (see tools.template_messages)."""
        m: dict[str, Any] = {"role": self.role, "content": self.text()}
        for k in ("tool_calls", "tool_call_id", "name"):
            if getattr(self, k) is not None:
                m[k] = getattr(self, k)
        reasoning = self.reasoning_content if self.reasoning is None else self.reasoning
        if reasoning is not None:
            m["reasoning_content"] = reasoning
        return m

    @model_validator(mode="after")
    def _needs_content(self):
        # a user turn without content (OpenAI refuses it) generated up to the whole context
        # from the template alone; other roles' null content reads as empty, as in vLLM
        if self.content is None and self.role == "user":
            raise ValueError("a user message needs content")
        return self

    def text(self) -> str:
        from specdecode.core import content_text

        return content_text(self.content)


class _ChatRendering(BaseModel):
    """vLLM's fields for rendering chat messages into a prompt (chat completions, /tokenize)."""

    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    add_special_tokens: StrictBool = False
    chat_template: str | None = None  # needs serve --trust-request-chat-template
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, str]] | None = None

    def chat_messages(self) -> list[dict[str, Any]]:
        """The messages as chat templates read them (an earlier call's arguments as objects)."""
        return template_messages([m.template_fields() for m in self.messages])

    def template_options(self, trusted: bool, exclude_unused_tools: bool = False) -> dict[str, Any]:
        """`render_chat`'s keyword options. vLLM's `chat_template_kwargs` may carry the
        template itself; a template sent with a request (code the server runs, however
        sandboxed) is taken only from a server started to trust it, as in vLLM."""
        kwargs = dict(self.chat_template_kwargs or {})
        template, field = self.chat_template, "chat_template"
        if "chat_template" in kwargs:
            given = kwargs.pop("chat_template")
            if template is not None and given is not None and given != template:
                raise InvalidRequestError(
                    "two chat templates given (chat_template and "
                    "chat_template_kwargs.chat_template)", param="chat_template",
                )  # fmt: skip
            if template is None and given is not None:
                template, field = given, "chat_template_kwargs"
        if template is not None and not isinstance(template, str):
            raise InvalidRequestError("chat_template must be a string", param=field)
        if template is not None and not trusted:
            raise InvalidRequestError(
                "this server does not take a chat template from a request: start it with "
                "--trust-request-chat-template to allow one", param=field,
            )  # fmt: skip
        # the tools, for templates that describe them (with tool_choice "none" too, unless
        # `exclude_unused_tools`: vLLM's --exclude-tools-when-tool-choice-none)
        tools = self.tool_calling()
        if tools is not None and tools.mode == "none" and exclude_unused_tools:
            tools = None
        return {
            "add_generation_prompt": self.add_generation_prompt,
            "continue_final_message": self.continue_final_message,
            "chat_template": template,
            "chat_template_kwargs": kwargs,
            "documents": self.documents,
            "tools": None if tools is None else list(tools.tools),
        }


class ChatCompletionRequest(_ChatRendering, _Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: StrictBool = False  # (vLLM's) the reply starts with the last message, if the reply's
    parallel_tool_calls: StrictBool = True
    # with --reasoning-parser: vLLM's `include_reasoning` (false: the reasoning is left out),
    # SGLang's `separate_reasoning` (false: the reply is not split, the reasoning stays in it)
    include_reasoning: StrictBool = True
    separate_reasoning: StrictBool = True

    _tools: Any = PrivateAttr(default=False)  # (tool_calling, checked once)

    def tool_calling(self) -> ToolCalling | None:
        if self._tools is False:
            self._tools = check_tools(self.tools, self.tool_choice, self.parallel_tool_calls,
                                      self.functions, self.function_call)  # fmt: skip
        return self._tools

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        params = super().sampling_params(max_tokens, logprobs)
        tools = self.tool_calling()
        if tools is not None and tools.mode == "auto":  # (as vLLM's parsers: a model may mark
            params.skip_special_tokens = False  # its call tags special; the parser reads them)
        return params

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def max_tokens_field(self) -> str:
        """The field `requested_max_tokens` read, named in its range errors."""
        return "max_completion_tokens" if self.max_completion_tokens else "max_tokens"

    def requested_logprobs(self) -> int | None:
        if self.top_logprobs and not self.logprobs:
            raise InvalidRequestError("top_logprobs needs logprobs: true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_Request):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=1)
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def max_tokens_field(self) -> str:
        return "max_tokens"

    def requested_logprobs(self) -> int | None:
        if self.suffix:
            raise InvalidRequestError("suffix is not supported", param="suffix")
        return self.logprobs

    def requested_prompt_logprobs(self) -> int | None:
        # echo with logprobs lists the prompt's tokens with theirs (as vLLM does)
        if self.echo and self.logprobs is not None and self.prompt_logprobs is None:
            return self.logprobs
        return self.prompt_logprobs

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


def _allows_none(annotation: Any) -> bool:
    if annotation is None or annotation is type(None) or annotation is Any:
        return True
    if get_origin(annotation) in (Union, types.UnionType):
        return any(_allows_none(a) for a in get_args(annotation))
    return False


class TokenizeRequest(_ChatRendering, _NullIsDefault):
    """vLLM's /tokenize body: a `prompt` (special tokens added unless told not to) or chat
    `messages` (rendered as chat completions render them; no special tokens added)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: StrictBool | None = None
    return_token_strs: StrictBool = False
    tools: list[Any] | None = None  # rendered with the messages, as chat completions do

    def tool_calling(self) -> ToolCalling | None:
        # (rendered as chat's default, "auto", renders them: the count a chat prompt costs)
        return check_tools(self.tools, None, True, None, None)

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give either a prompt or messages")
        return self


class DetokenizeRequest(_NullIsDefault):
    model: str | None = None
    tokens: list[int]


class ResponsesRequest(_NullIsDefault):
    """OpenAI's Responses API (`POST /v1/responses`, which vLLM and SGLang serve too): a text
    reply to `input` (a string, or message items) after `instructions`. Responses are kept
    only where the server keeps them (`serve --max-stored-responses`, in memory, as vLLM's
    store): `previous_response_id` then continues one (`history`: its conversation)."""

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=MAX_TEMPERATURE)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    include: list[str] | None = None
    stream: bool = False
    text: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    conversation: str | dict[str, Any] | None = None
    background: StrictBool = False
    store: bool = True
    truncation: Literal["disabled", "auto"] = "disabled"
    metadata: dict[str, str] | None = None
    user: str | None = None
    # (its effort is not acted on: a reasoning model's reasoning is split, with
    # --reasoning-parser, as it comes)
    reasoning: dict[str, Any] | None = None
    # vLLM's extra sampling fields
    logit_bias: dict[str, float] | None = None
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**64)
    priority: int | None = Field(default=None, strict=True, ge=-(2**63), lt=2**63)
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0, le=1)
    repetition_penalty: float | None = Field(default=None, gt=0, le=100)

    def input_messages(self) -> list[dict[str, Any]]:
        """`input` as chat messages."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        if not self.input:
            raise InvalidRequestError("input is empty", param="input")
        out: list[dict[str, Any]] = []
        for i, item in enumerate(self.input):
            kind = item.get("type", "message") if isinstance(item, dict) else None
            if kind in ("function_call", "function_call_output"):
                out.append(_function_item(i, item, out))
                continue
            if kind == "reasoning":  # an earlier reply's reasoning: its assistant turn begins
                out.append({"role": "assistant", "content": None,
                            "reasoning_content": _reasoning_text(i, item)})  # fmt: skip
                continue
            if kind != "message":
                raise InvalidRequestError(
                    f"input[{i}]: items of type {kind!r} are not supported (messages, "
                    "reasoning, function_call and function_call_output only)",
                    param="input",
                )
            content = item.get("content")
            if isinstance(content, list):  # input_text / output_text parts: their text
                texts = []
                for part in content:
                    ok = isinstance(part, dict) and isinstance(part.get("text"), str)
                    if not ok or part.get("type") not in ("input_text", "output_text", "text"):
                        raise InvalidRequestError(
                            f"input[{i}]: only text content parts are supported", param="input"
                        )
                    texts.append(part["text"])
                content = "".join(texts)
            last = out[-1] if out else {}
            if (
                item.get("role") == "assistant"
                and last.get("role") == "assistant"
                and (last.get("content") is None and not last.get("tool_calls"))
            ):  # (the reply whose reasoning came before it)
                last["content"] = content
                continue
            out.append({"role": item.get("role"), "content": content})
        return out

    def chat_tools(self) -> tuple[list[dict] | None, Any]:
        """`tools` and `tool_choice` in chat completions' form (function tools are flat
        here: {"type": "function", "name", "parameters", ...})."""
        if not self.tools:
            return self.tools, self.tool_choice
        tools = []
        for i, t in enumerate(self.tools):
            if not isinstance(t, dict) or t.get("type") != "function":
                kind = t.get("type") if isinstance(t, dict) else None
                raise InvalidRequestError(
                    f"tools[{i}]: only function tools are supported here, not {kind!r}",
                    param="tools",
                )
            f = {k: t[k] for k in ("name", "description", "parameters") if t.get(k) is not None}
            tools.append({"type": "function", "function": f})
        choice = self.tool_choice
        if isinstance(choice, dict):
            if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
                raise InvalidRequestError(
                    'tool_choice names a function as {"type": "function", "name": ...}',
                    param="tool_choice",
                )
            choice = {"type": "function", "function": {"name": choice["name"]}}
        return tools, choice

    def response_format(self) -> dict[str, Any] | None:
        """`text.format` as chat's `response_format` (its json_schema flattened)."""
        fmt = (self.text or {}).get("format")
        if fmt is None:
            return None
        if not isinstance(fmt, dict):
            raise InvalidRequestError("text.format must be an object", param="text")
        kind = fmt.get("type")
        if kind == "json_schema":
            if not isinstance(fmt.get("schema"), dict):
                raise InvalidRequestError("text.format json_schema needs a schema", param="text")
            return {"type": "json_schema",
                    "json_schema": {"name": fmt.get("name"), "schema": fmt["schema"]}}  # fmt: skip
        if kind not in ("text", "json_object"):
            raise InvalidRequestError(
                f"unsupported text.format type {kind!r} (text, json_object or json_schema)",
                param="text",
            )
        return fmt

    @property
    def wants_logprobs(self) -> bool:
        return "message.output_text.logprobs" in (self.include or [])

    def as_chat(self, history: list[dict[str, Any]] = ()) -> ResponsesAsChat:
        """The request as chat completions' (one reply, the usage at the end of a stream):
        `instructions` (a system message), then `history` (a previous response's conversation,
        whose own instructions do not carry over, as in OpenAI's), then `input`."""
        if self.conversation is not None:
            raise InvalidRequestError(
                "conversation is not supported: this server keeps no conversations (send it as "
                "input, or continue a stored response with previous_response_id)",
                param="conversation",
            )
        if self.background:
            raise InvalidRequestError("background responses are not supported", param="background")
        if self.truncation == "auto":
            raise InvalidRequestError(
                'truncation "auto" is not supported: an input past the context is refused',
                param="truncation",
            )
        if self.top_logprobs and not self.wants_logprobs:
            raise InvalidRequestError(
                'top_logprobs needs include: ["message.output_text.logprobs"]',
                param="top_logprobs",
            )
        system = [] if self.instructions is None else [
            {"role": "system", "content": self.instructions}
        ]  # fmt: skip
        messages = [*system, *history, *self.input_messages()]
        response_format = self.response_format()
        tools, tool_choice = self.chat_tools()
        try:
            return ResponsesAsChat.model_validate(
                {
                    "messages": messages,
                    "max_completion_tokens": self.max_output_tokens,
                    "temperature": self.temperature,
                    "top_p": self.top_p,
                    "logprobs": self.wants_logprobs,
                    "top_logprobs": self.top_logprobs if self.wants_logprobs else None,
                    "stream": self.stream,
                    "stream_options": {"include_usage": True} if self.stream else None,
                    "response_format": response_format,
                    "tools": tools,
                    "tool_choice": tool_choice,
                    "parallel_tool_calls": self.parallel_tool_calls,
                    "seed": self.seed,
                    "logit_bias": self.logit_bias,
                    "top_k": self.top_k,
                    "min_p": self.min_p,
                    "repetition_penalty": self.repetition_penalty,
                    "priority": self.priority,
                }
            )
        except ValidationError as e:  # a message it refuses (a role, a user without content)
            err = e.errors()[0]
            loc = err.get("loc", ())
            where = "input"
            if len(loc) > 1 and loc[0] == "messages" and isinstance(loc[1], int):
                where += f"[{loc[1] - len(system) - len(history)}]"  # (the input's own)
                where += "".join(f".{x}" for x in loc[2:])
            raise InvalidRequestError(f"{where}: {err['msg']}", param="input") from e


def _reasoning_text(i: int, item: dict) -> str:
    """A Responses input `reasoning` item's text: its reasoning_text parts, else its summary."""
    for key in ("content", "summary"):
        parts = item.get(key) or []
        if not isinstance(parts, list) or not all(
            isinstance(p, dict) and isinstance(p.get("text"), str) for p in parts
        ):
            raise InvalidRequestError(f"input[{i}]: a reasoning item's {key} must be text parts",
                                      param="input")  # fmt: skip
        if parts:
            return "".join(p["text"] for p in parts)
    return ""


def _function_item(i: int, item: dict, before: list[dict]) -> dict:
    """A Responses input item of a function call (the model's: it joins the assistant
    message before it, or makes one) or of its output (a tool message)."""
    where = f"input[{i}]"
    call_id = item.get("call_id")
    if not isinstance(call_id, str) or not call_id:
        raise InvalidRequestError(f"{where}: call_id is required", param="input")
    if item["type"] == "function_call_output":
        output = item.get("output")
        if isinstance(output, list):  # (text parts)
            texts = [p.get("text") for p in output if isinstance(p, dict)]
            if len(texts) == len(output) and all(isinstance(t, str) for t in texts):
                output = "".join(texts)
        if not isinstance(output, str):
            raise InvalidRequestError(f"{where}: output must be text (a string, or text parts)",
                                      param="input")  # fmt: skip
        return {"role": "tool", "tool_call_id": call_id, "content": output}
    name, arguments = item.get("name"), item.get("arguments")
    if not isinstance(name, str) or not isinstance(arguments, str):
        raise InvalidRequestError(f"{where}: a function_call needs a name and arguments (JSON "
                                  "text)", param="input")  # fmt: skip
    call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
    if before and before[-1]["role"] == "assistant":  # (its message, or its earlier calls)
        last = before.pop()
        return {**last, "tool_calls": [*(last.get("tool_calls") or []), call]}
    return {"role": "assistant", "content": None, "tool_calls": [call]}


class ResponsesAsChat(ChatCompletionRequest):
    """A Responses request as chat completions', its errors naming the Responses fields."""

    def max_tokens_field(self) -> str:
        return "max_output_tokens"

    def structured_param(self) -> str:
        tools = self.tool_calling()
        return "tool_choice" if tools is not None and tools.constrained else "text"

    def _structured_field(self) -> str:
        return "text.format"
