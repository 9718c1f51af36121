"""Tool calling for chat completions, as OpenAI's API and vLLM serve it.

`tool_choice`:
- `"none"`: the tools are rendered into the prompt (unless `serve
  --exclude-tools-when-tool-choice-none`) and the output is text;
- `"auto"`: the model decides; its output is parsed for calls by the server's
  `--tool-call-parser` (needs `--enable-auto-tool-choice`, vLLM's flags);
- `"required"`: the output is constrained (structured output) to a JSON list of one or more
  `{"name": ..., "parameters": {...}}` calls of the given tools (vLLM's format), one at most
  with `parallel_tool_calls: false`;
- a named function: the output is constrained to that function's parameters schema.

The constrained modes need no parser and work with any model; their calls are exact under
speculative decoding, as every structured output is (see `structured.py`).

Parsers (`--tool-call-parser`): `hermes` (vLLM's name; SGLang's `qwen25`): calls written as
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, the format of Qwen2.5's, Hermes'
and many other chat templates; `json`: those, or a reply that is nothing but a JSON call (or
a list of them) naming given tools, bare or in a ```json fence, as Qwen2.5-Coder answers
(vLLM issue 32926). One streaming state machine parses both whole and streamed replies (a
whole reply is one feed), so the two always agree.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from specdecode.errors import InvalidRequestError

# name -> format: vLLM's and SGLang's names (Llama 3's JSON calls are the json format's)
PARSERS = {"hermes": "hermes", "qwen25": "hermes", "qwen": "hermes", "json": "json",
           "llama3_json": "json", "llama3": "json"}  # fmt: skip
PYTHON_TAG = "<|python_tag|>"  # (Llama 3.1 may open a JSON call with it)


def parser_format(name: str | None) -> str | None:
    """The call format of a `--tool-call-parser` name (vLLM's or SGLang's), None for none."""
    if name is None:
        return None
    if name not in PARSERS:
        raise InvalidRequestError(
            f"--tool-call-parser {name!r} is not supported here: "
            f"{', '.join(sorted(PARSERS))} (hermes: calls written as <tool_call>JSON</tool_call>, "
            "the format of Qwen2.5's and Hermes' chat templates; json: those, or a reply that is "
            "one bare or fenced JSON call, as Qwen2.5-Coder writes them); tool_choice "
            '"required" or a named function works with any model, without a parser'
        )
    return PARSERS[name]


@dataclass(frozen=True)
class ToolCalling:
    """A chat request's tools, as checked: `mode` is none | auto | required | named."""

    tools: tuple[dict, ...]  # OpenAI's {"type": "function", "function": {...}}, checked
    mode: str
    name: str | None = None  # the named function
    parallel: bool = True

    @property
    def constrained(self) -> bool:
        return self.mode in ("required", "named")

    def function(self, name: str) -> dict:
        return next(t["function"] for t in self.tools if t["function"]["name"] == name)

    def constraint(self) -> dict:
        """The JSON schema the output follows (required / named modes)."""
        if self.mode == "named":
            return _parameters(self.function(self.name))
        options = []
        for i, t in enumerate(self.tools):
            # (each tool's schema sits at items.anyOf[i].properties.parameters, its $defs with
            # it: its references get that path, so two tools' $defs never meet)
            params = _rebase(_parameters(t["function"]), f"#/items/anyOf/{i}/properties/parameters")
            options.append({
                "type": "object",
                "properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},
                               "parameters": params},
                "required": ["name", "parameters"],
            })  # fmt: skip
        schema: dict = {"type": "array", "minItems": 1, "items": {"anyOf": options}}
        if not self.parallel:
            schema["maxItems"] = 1
        return schema

    def stream(self, parser: str | None) -> ToolStream:
        """A parser of one choice's output (whole: one feed, then finish)."""
        if self.mode == "named":
            return _NamedStream(self.name)
        if self.mode == "required":
            return _ListStream()
        if self.mode == "auto" and parser == "json":
            return _JsonReplyStream({t["function"]["name"] for t in self.tools}, self.parallel)
        if self.mode == "auto":
            return _HermesStream(self.parallel)
        return ToolStream()


_DATA = {"const", "enum", "default", "examples"}  # keywords whose values are data, not schemas
# keywords whose values map names (a property's, a definition's) to schemas
_NAMED = {"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"}


def _rebase(schema, root: str):
    """A schema with its local references (`#...`) as seen from where it is put (`root`)."""
    if isinstance(schema, list):
        return [_rebase(x, root) for x in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for k, v in schema.items():
        if k in _DATA:
            out[k] = v
        elif k in _NAMED and isinstance(v, dict):  # (names here, not keywords: all schemas)
            out[k] = {name: _rebase(x, root) for name, x in v.items()}
        else:
            out[k] = _rebase(v, root)
    ref = schema.get("$ref")
    if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
        out["$ref"] = root + ref[1:]
    return out


def _parameters(function: dict) -> dict:
    # (a function without parameters takes none: an empty object, as vLLM writes it)
    return function.get("parameters") or {"type": "object", "properties": {}}


def check_tools(
    tools: list | None, tool_choice: Any, parallel: bool, functions: list | None,
    function_call: Any,
) -> ToolCalling | None:  # fmt: skip
    """A request's tools and tool_choice, checked (OpenAI's rules); None where it has none."""
    if functions and function_call != "none":
        raise InvalidRequestError(
            "functions (OpenAI's deprecated form) is not supported: give them as tools",
            param="functions",
        )
    if not tools:
        if tool_choice not in (None, "none"):
            raise InvalidRequestError("tool_choice needs tools", param="tool_choice")
        return None
    checked, names = [], set()
    for i, t in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type", "function") != "function":
            raise InvalidRequestError(
                f"{where}: only function tools are supported ({{'type': 'function', "
                "'function': {...}})", param="tools",
            )  # fmt: skip
        f = t.get("function")
        if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not f["name"]:
            raise InvalidRequestError(f"{where}: function.name is required", param="tools")
        if f["name"] in names:
            raise InvalidRequestError(f"{where}: two tools named {f['name']!r}", param="tools")
        params = f.get("parameters")
        if params is not None and (
            not isinstance(params, dict) or params.get("type", "object") != "object"
        ):  # (arguments are an object: OpenAI's rule)
            raise InvalidRequestError(
                f"{where}: function.parameters must be a JSON schema of an object", param="tools"
            )
        desc = f.get("description")
        if desc is not None and not isinstance(desc, str):
            raise InvalidRequestError(f"{where}: function.description must be a string",
                                      param="tools")  # fmt: skip
        names.add(f["name"])
        checked.append({"type": "function", "function": dict(f)})
    choice = "auto" if tool_choice is None else tool_choice  # (OpenAI's default with tools)
    if isinstance(choice, dict):
        f = choice.get("function") if choice.get("type") == "function" else None
        name = f.get("name") if isinstance(f, dict) else None
        if not isinstance(name, str):
            raise InvalidRequestError(
                'tool_choice names a function as {"type": "function", "function": {"name": '
                "...}}", param="tool_choice",
            )  # fmt: skip
        if name not in names:
            raise InvalidRequestError(f"tool_choice names {name!r}, which is not among the tools",
                                      param="tool_choice")  # fmt: skip
        return ToolCalling(tuple(checked), "named", name, parallel)
    if choice not in ("none", "auto", "required"):
        raise InvalidRequestError(
            'tool_choice is "none", "auto", "required" or a named function', param="tool_choice"
        )
    return ToolCalling(tuple(checked), choice, None, parallel)


def template_messages(messages: list[dict]) -> list[dict]:
    """Messages as chat templates read them: an assistant's earlier calls with their arguments
    as objects (OpenAI sends them as JSON text; templates write them with `tojson`)."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if calls is not None and not isinstance(calls, list):
            raise InvalidRequestError("a message's tool_calls must be a list", param="messages")
        if calls:
            m = dict(m)
            m["tool_calls"] = [_template_call(c) for c in calls]
        out.append(m)
    return out


def _template_call(call) -> dict:
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        raise InvalidRequestError(
            'a message\'s tool_calls are {"id", "type": "function", "function": {"name", '
            '"arguments"}}', param="messages",
        )  # fmt: skip
    call = dict(call)
    f = dict(call["function"])
    args = f.get("arguments")
    if isinstance(args, str):
        try:
            parsed = json.loads(args)
        except json.JSONDecodeError:
            parsed = None
        if isinstance(parsed, dict):
            f["arguments"] = parsed
    call["function"] = f
    return call


def call_id() -> str:
    return "chatcmpl-tool-" + uuid.uuid4().hex  # (vLLM's form)


@dataclass
class Parsed:
    """What one feed of a choice's output gives: text for `content`, and tool-call deltas
    (OpenAI's streamed form: a call's first delta has its index, id, type and name; the
    arguments may follow in pieces)."""

    content: str = ""
    calls: list[dict] = field(default_factory=list)

    def __add__(self, other: Parsed) -> Parsed:
        return Parsed(self.content + other.content, self.calls + other.calls)


class ToolStream:
    """tool_choice "none": the output is content."""

    def __init__(self) -> None:
        self.num_calls = 0

    def feed(self, text: str) -> Parsed:
        return Parsed(text)

    def finish(self) -> Parsed:
        return Parsed()

    def last(self, text: str) -> Parsed:
        """The reply's last piece, and what it leaves once it has ended."""
        out = self.feed(text)
        return out + self.finish()

    def _new_call(self, name: str, arguments: str) -> dict:
        delta = {"index": self.num_calls, "id": call_id(), "type": "function",
                 "function": {"name": name, "arguments": arguments}}  # fmt: skip
        self.num_calls += 1
        return delta


class _NamedStream(ToolStream):
    """A named function: the output is its arguments, streamed as they come."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def feed(self, text: str) -> Parsed:
        if not self.num_calls:
            return Parsed(calls=[self._new_call(self.name, text)])
        return Parsed(calls=[{"index": 0, "function": {"arguments": text}}] if text else [])

    def finish(self) -> Parsed:
        return self.feed("") if not self.num_calls else Parsed()


class _ListStream(ToolStream):
    """tool_choice "required": a JSON list of {"name", "parameters"} objects; each call goes
    out whole as soon as its object closes."""

    def __init__(self) -> None:
        super().__init__()
        self.depth = 0
        self.in_string = self.escaped = False
        self.item: list[str] = []
        self.rest: list[str] = []  # the characters after the last whole call
        self.closed = False

    def finish(self) -> Parsed:
        # cut off (max_tokens) before the list closed, before any call: the text as content
        return Parsed("" if self.closed or self.num_calls else "".join(self.rest).strip())

    def feed(self, text: str) -> Parsed:
        out = Parsed()
        for ch in text:
            self.rest.append(ch)
            if self.depth >= 2:
                self.item.append(ch)
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
                continue
            if ch == '"':
                self.in_string = True
            elif ch in "[{":
                self.depth += 1
                if self.depth == 2:
                    self.item = [ch]
            elif ch in "]}":
                self.depth -= 1
                if self.depth == 1:
                    out.calls.append(self._call("".join(self.item)))
                    self.rest = []
                self.closed = self.depth == 0
        return out

    def _call(self, text: str) -> dict:
        obj = json.loads(text)  # (the grammar wrote it)
        args = json.dumps(obj["parameters"], ensure_ascii=False)
        return self._new_call(obj["name"], args)


class _HermesStream(ToolStream):
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks. The text before the
    first call is content (a block that is not such a call is content as written); after it,
    only calls count (vLLM's hermes parser reads the reply so too), so a reply is always its
    content, then its calls, streamed or whole. Text that may be the start of a tag is held
    back until it is known not to be one, and leading whitespace until other text follows."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self, parallel: bool = True) -> None:
        super().__init__()
        self.parallel = parallel  # (false: calls after the first are dropped, as OpenAI's)
        self.buffer = ""
        self.inside = False
        self.blank = ""  # whitespace so far: content only where other text follows
        self.said = False  # content went out

    def feed(self, text: str) -> Parsed:
        self.buffer += text
        out = Parsed()
        while True:
            if not self.inside:
                at = self.buffer.find(self.OPEN)
                if at < 0:
                    keep = partial_suffix(self.buffer, self.OPEN)
                    self._text(out, self.buffer[: len(self.buffer) - keep])
                    self.buffer = self.buffer[len(self.buffer) - keep :]
                    return out
                self._text(out, self.buffer[:at])
                self.buffer = self.buffer[at + len(self.OPEN) :]
                self.inside = True
            at = self.buffer.find(self.CLOSE)
            if at < 0:
                return out
            self._block(out, self.buffer[:at], closed=True)
            self.buffer = self.buffer[at + len(self.CLOSE) :]
            self.inside = False

    def finish(self) -> Parsed:
        out = Parsed()
        if self.inside:  # cut off inside a block (max_tokens): a call if it parses whole
            self._block(out, self.buffer, closed=False)
        else:
            self._text(out, self.buffer)
        if not self.num_calls:  # (a reply of whitespace alone is its content)
            out.content += self.blank
        self.buffer, self.inside, self.blank = "", False, ""
        return out

    def _text(self, out: Parsed, text: str) -> None:
        if self.num_calls:
            return  # (after a call: not content)
        if not self.said and not text.strip():
            self.blank += text  # (leading whitespace: content only where text follows)
            return
        out.content += self.blank + text
        self.blank, self.said = "", True

    def _block(self, out: Parsed, body: str, closed: bool) -> None:
        obj = _json(body)
        args = obj.get("arguments", obj.get("parameters", {})) if isinstance(obj, dict) else None
        if not (isinstance(obj, dict) and isinstance(obj.get("name"), str)
                and isinstance(args, dict)):  # fmt: skip
            self._text(out, self.OPEN + body + (self.CLOSE if closed else ""))
            return
        self.blank = ""
        if self.num_calls and not self.parallel:
            return
        out.calls.append(self._new_call(obj["name"], json.dumps(args, ensure_ascii=False)))


class _JsonReplyStream(_HermesStream):
    """Hermes' tags, or a reply that is nothing but one call or a list of calls as JSON
    (`{"name": ..., "arguments": {...}}`, bare or in one ```json fence) naming given tools:
    Qwen2.5-Coder answers so, not with tags (vLLM issue 32926), and Llama 3.1 / 3.2 so too
    (`"parameters"`, after an optional <|python_tag|>, several calls joined by ";", vLLM's
    llama3_json format). Only a whole reply counts,
    so JSON inside prose or code is never taken for a call; a reply that opens as such JSON
    may be one, and is held back until it ends."""

    def __init__(self, names: set[str], parallel: bool = True) -> None:
        super().__init__(parallel)
        self.names = names
        self.head = ""  # the reply so far, while it may be a JSON call
        self.deciding = True

    def feed(self, text: str) -> Parsed:
        if not self.deciding:
            return super().feed(text)
        self.head += text
        lead = self.head.lstrip().removeprefix(PYTHON_TAG)
        if PYTHON_TAG.startswith(lead):  # (nothing yet, or maybe the tag)
            return Parsed()
        fence = lead.startswith("```") and (
            "\n" not in lead or lead.partition("\n")[0].strip("`").strip() in ("", "json")
        )  # (a fence of other code is not a call: it streams)
        if not lead or lead[0] in "{[" or fence or "```".startswith(lead):
            return Parsed()
        self.deciding = False  # prose (or tags): hermes' rules from its start
        head, self.head = self.head, ""
        return super().feed(head)

    def finish(self) -> Parsed:
        if not self.deciding:
            return super().finish()
        self.deciding = False
        calls = self._calls(self.head)
        if calls is None:
            return super().feed(self.head) + super().finish()
        calls = calls if self.parallel else calls[:1]
        return Parsed(calls=[self._new_call(n, a) for n, a in calls])

    def _calls(self, text: str) -> list[tuple[str, str]] | None:
        body = text.strip().removeprefix(PYTHON_TAG).strip()
        if body.startswith("```"):
            first, _, rest = body.partition("\n")
            if first.strip("`").strip() not in ("", "json") or not rest.rstrip().endswith("```"):
                return None
            body = rest.rstrip()[:-3]
        obj = _json(body)
        if obj is None and ";" in body:  # (Llama 3's several calls: objects joined by ";")
            parts = [_json(p) for p in body.split(";")]
            obj = parts if all(isinstance(p, dict) for p in parts) else None
        out = []
        for c in obj if isinstance(obj, list) and obj else [obj]:
            if not isinstance(c, dict) or not isinstance(c.get("name"), str) \
                    or c["name"] not in self.names:  # fmt: skip
                return None
            args = c.get("arguments", c.get("parameters", {}))
            if not isinstance(args, dict):
                return None
            out.append((c["name"], json.dumps(args, ensure_ascii=False)))
        return out


def _json(text: str):
    """`text` as JSON, None where it is not (or nests past the parser's depth: a model that
    loops on "[" writes such replies)."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


def partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is a proper start of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def whole(stream: ToolStream, text: str) -> tuple[str | None, list[dict]]:
    """A whole reply: its content (None where it is all calls) and its calls."""
    out = stream.last(text)
    content = out.content
    calls: list[dict] = []
    for delta in out.calls:  # (named: the arguments' pieces join)
        if "id" in delta:
            calls.append({"id": delta["id"], "type": "function",
                          "function": dict(delta["function"])})  # fmt: skip
        else:
            calls[delta["index"]]["function"]["arguments"] += delta["function"]["arguments"]
    if calls and not content.strip():
        content = None
    return content, calls
