"""Tool calling's parsers and checks (serving/tools.py): a streamed reply parses to what the
whole reply does, however it is cut; the constrained modes' schemas; OpenAI's rules on tools."""

from __future__ import annotations

import json
import random

import pytest

from specdecode.errors import InvalidRequestError
from specdecode.serving.tools import (
    _HermesStream,
    _JsonReplyStream,
    _ListStream,
    _NamedStream,
    check_tools,
    parser_format,
    template_messages,
    whole,
)


def tool(name, params=None):
    f = {"name": name}
    if params is not None:
        f["parameters"] = params
    return {"type": "function", "function": f}


WEATHER = tool("weather", {"type": "object", "properties": {"city": {"type": "string"}}})


def calls_of(calls):
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def streamed(make, text, rng):
    """Feed `text` in random pieces; the content and the calls the deltas join into."""
    stream, content, calls = make(), "", []
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 12))))
    for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True):
        out = stream.feed(text[a:b])
        content += out.content
        calls += out.calls
    end = stream.finish()
    content += end.content
    joined: list[dict] = []
    for d in calls + end.calls:
        if "id" in d:
            assert d["type"] == "function" and d["id"].startswith("chatcmpl-tool-")
            assert d["index"] == len(joined)
            joined.append({"function": dict(d["function"])})
        else:
            joined[d["index"]]["function"]["arguments"] += d["function"]["arguments"]
    return content, joined


HERMES = [
    # (reply, content, calls)
    ('<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
     None, [("weather", {"city": "Oslo"})]),
    ('Let me check.\n<tool_call>{"name": "a", "arguments": {}}</tool_call>\n'
     '<tool_call>{"name": "b", "arguments": {"x": [1, "</tool_call"]}}</tool_call>',
     "Let me check.\n", [("a", {}), ("b", {"x": [1, "</tool_call"]})]),
    ("no call here, only < and <tool and <tool_c", "no call here, only < and <tool and <tool_c",
     []),
    # not a call: written as content
    ("<tool_call>not json</tool_call>", "<tool_call>not json</tool_call>", []),
    ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),
    # cut off (max_tokens): a call if what came parses, else content
    ('<tool_call>{"name": "a", "parameters": {"k": 1}}', None, [("a", {"k": 1})]),
    ('<tool_call>{"name": "a", "argu', '<tool_call>{"name": "a", "argu', []),
    # whitespace around calls is not content; a reply of whitespace alone is
    ('\n<tool_call>{"name": "a", "arguments": {}}</tool_call>\n', None, [("a", {})]),
    (" \n ", " \n ", []),
    # JSON that is no call, or nests past the parser: text
    ("<tool_call>" + "[" * 3000 + "</tool_call>", "<tool_call>" + "[" * 3000 + "</tool_call>",
     []),
    # after a call only calls count (as vLLM's parser reads it): content, then calls
    ('<tool_call>{"name": "a", "arguments": {}}</tool_call>\n\n Done. <tool_call>x</tool_call>',
     None, [("a", {})]),
]  # fmt: skip


@pytest.mark.parametrize("text,content,calls", HERMES)
def test_hermes_whole_and_streamed_agree(text, content, calls):
    got_content, got_calls = whole(_HermesStream(), text)
    assert got_content == content and calls_of(got_calls) == calls
    rng = random.Random(0)
    for _ in range(50):
        c, joined = streamed(_HermesStream, text, rng)
        assert calls_of(joined) == calls
        assert (c if c.strip() or not calls else None) == content


def test_hermes_holds_back_only_a_possible_tag():
    s = _HermesStream()
    assert s.feed("abc <tool").content == "abc "
    assert s.feed("box").content == "<toolbox"  # not a tag after all
    assert s.feed("<").content == ""
    assert s.feed("tool_call>").content == ""
    out = s.feed('{"name": "f", "arguments": {"a": "é"}}</tool_call>')
    assert out.content == "" and out.calls[0]["function"] == {
        "name": "f",
        "arguments": '{"a": "é"}',
    }


def test_required_list_stream_emits_each_call_as_it_closes():
    text = json.dumps(
        [
            {"name": "a", "parameters": {"s": 'x}]"\\{', "n": [1, {"d": 2}]}},
            {"name": "b", "parameters": {}},
        ]  # fmt: skip
    )
    s = _ListStream()
    seen = []
    for i, ch in enumerate(text):
        for d in s.feed(ch).calls:
            seen.append((i, d["function"]["name"], json.loads(d["function"]["arguments"])))
    assert [x[1:] for x in seen] == [("a", {"s": 'x}]"\\{', "n": [1, {"d": 2}]}), ("b", {})]
    assert text[seen[0][0]] == "}" and text[seen[0][0] + 1] == ","  # out when it closed
    rng = random.Random(1)
    for _ in range(30):
        assert calls_of(streamed(_ListStream, text, rng)[1]) == [x[1:] for x in seen]


def test_named_stream_streams_the_arguments():
    content, calls = whole(_NamedStream("f"), '{"a": 1}')
    assert content is None and calls_of(calls) == [("f", {"a": 1})]
    rng = random.Random(2)
    c, joined = streamed(lambda: _NamedStream("f"), '{"a": [1, 2, 3]}', rng)
    assert c == "" and calls_of(joined) == [("f", {"a": [1, 2, 3]})]
    assert whole(_NamedStream("f"), "")[1][0]["function"] == {"name": "f", "arguments": ""}


def test_constraints():
    t = check_tools([WEATHER, tool("now")], "required", True, None, None)
    schema = t.constraint()
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    first, second = schema["items"]["anyOf"]
    assert first["properties"]["name"] == {"type": "string", "enum": ["weather"]}
    assert first["properties"]["parameters"] == WEATHER["function"]["parameters"]
    assert second["properties"]["parameters"] == {"type": "object", "properties": {}}
    assert check_tools([WEATHER], "required", False, None, None).constraint()["maxItems"] == 1
    named = check_tools([WEATHER], {"type": "function", "function": {"name": "weather"}}, True,
                        None, None)  # fmt: skip
    assert named.mode == "named" and named.constraint() == WEATHER["function"]["parameters"]
    # a tool's $defs stay with it, its references pointing there (two tools' never clash)
    ref = {"type": "object", "properties": {"p": {"$ref": "#/$defs/P"}},
           "$defs": {"P": {"type": "integer"}}}  # fmt: skip
    other = {**ref, "$defs": {"P": {"type": "string"}}}
    schema = check_tools([tool("a", ref), tool("b", other)], "required", True, None, None)
    a, b = (o["properties"]["parameters"] for o in schema.constraint()["items"]["anyOf"])
    assert a["$defs"] == ref["$defs"] and b["$defs"] == other["$defs"]
    assert b["properties"]["p"] == {"$ref": "#/items/anyOf/1/properties/parameters/$defs/P"}


@pytest.mark.parametrize(
    "tools,choice,message",
    [
        ([{"type": "retrieval"}], None, "only function tools"),
        ([{"type": "function", "function": {}}], None, "function.name is required"),
        ([WEATHER, WEATHER], None, "two tools named 'weather'"),
        ([tool("f", [1])], None, "parameters must be a JSON schema of an object"),
        ([tool("f", {"type": "string"})], None, "schema of an object"),
        ([WEATHER], {"type": "function", "function": "weather"}, "names a function as"),
        ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "not among the tools"),
        ([WEATHER], {"type": "function"}, "names a function as"),
        ([WEATHER], "sometimes", '"none", "auto", "required"'),
        (None, "required", "tool_choice needs tools"),
    ],
)
def test_bad_tools_are_refused(tools, choice, message):
    with pytest.raises(InvalidRequestError, match=message) as e:
        check_tools(tools, choice, True, None, None)
    assert e.value.param in ("tools", "tool_choice")


def test_defaults_and_legacy_functions():
    assert check_tools([WEATHER], None, True, None, None).mode == "auto"  # OpenAI's default
    assert check_tools(None, None, True, None, None) is None
    assert check_tools(None, "none", True, None, None) is None
    with pytest.raises(InvalidRequestError, match="give them as tools"):
        check_tools(None, None, True, [WEATHER["function"]], None)
    assert check_tools(None, None, True, [WEATHER["function"]], "none") is None


def test_parsers_and_template_messages():
    assert parser_format("hermes") == parser_format("qwen25") == "hermes"
    assert parser_format("llama3_json") == parser_format("llama3") == parser_format("json")
    assert parser_format(None) is None
    with pytest.raises(InvalidRequestError, match="'mistral' is not supported"):
        parser_format("mistral")
    call = {"id": "c1", "type": "function",
            "function": {"name": "f", "arguments": '{"a": 1}'}}  # fmt: skip
    bad = {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "{oops"}}
    msgs = [{"role": "assistant", "content": "", "tool_calls": [call, bad]},
            {"role": "tool", "content": "3", "tool_call_id": "c1"}]  # fmt: skip
    out = template_messages(msgs)
    assert out[0]["tool_calls"][0]["function"]["arguments"] == {"a": 1}
    assert out[0]["tool_calls"][1]["function"]["arguments"] == "{oops"  # as sent
    assert msgs[0]["tool_calls"][0]["function"]["arguments"] == '{"a": 1}'  # not changed
    assert out[1] == msgs[1]


JSON_REPLIES = [
    # Qwen2.5-Coder's way: a reply that is nothing but a call, fenced or bare, or a list
    ('```json\n{\n  "name": "weather",\n  "arguments": {"city": "Oslo"}\n}\n```', None,
     [("weather", {"city": "Oslo"})]),
    (' [{"name": "weather", "arguments": {}}, {"name": "now", "parameters": {"z": 1}}]\n', None,
     [("weather", {}), ("now", {"z": 1})]),
    # hermes' tags still count
    ('Sure. <tool_call>{"name": "now", "arguments": {}}</tool_call>', "Sure. ", [("now", {})]),
    # not a call: a tool it was not given, JSON inside prose, other code, other JSON
    ('{"name": "rm", "arguments": {}}', '{"name": "rm", "arguments": {}}', []),
    ('Call it as {"name": "now", "arguments": {}}.', 'Call it as {"name": "now", "arguments": {}}.',
     []),
    ("```python\nprint(1)\n```", "```python\nprint(1)\n```", []),
    ('{"name": "now", "arguments": "soon"}', '{"name": "now", "arguments": "soon"}', []),
    ('```json\n{"name": "now", "arguments": {}}\n``` and more',
     '```json\n{"name": "now", "arguments": {}}\n``` and more', []),
    ("", "", []),
    # Llama 3's: after <|python_tag|>, with "parameters", several joined by ";"
    ('<|python_tag|>{"name": "now", "parameters": {"tz": "UTC"}}', None, [("now", {"tz": "UTC"})]),
    ('{"name": "now", "parameters": {}}; {"name": "weather", "parameters": {"city": "Rome"}}',
     None, [("now", {}), ("weather", {"city": "Rome"})]),
    ("<|python_tag|>print(1)", "<|python_tag|>print(1)", []),
    ('{"name": ["now"], "arguments": {}}', '{"name": ["now"], "arguments": {}}', []),
    ("[" * 3000, "[" * 3000, []),
]  # fmt: skip


@pytest.mark.parametrize("text,content,calls", JSON_REPLIES)
def test_json_reply_parser_whole_and_streamed_agree(text, content, calls):
    def make():
        return _JsonReplyStream({"weather", "now"})

    got_content, got_calls = whole(make(), text)
    assert got_content == content and calls_of(got_calls) == calls
    rng = random.Random(3)
    for _ in range(40):
        if len(text) < 2:
            break
        c, joined = streamed(make, text, rng)
        assert calls_of(joined) == calls
        assert (c if c.strip() or not calls else None) == content


def test_json_reply_parser_streams_prose_and_other_code_at_once():
    s = _JsonReplyStream({"now"})
    assert s.feed("```py").content == ""  # (may still be a json fence)
    assert s.feed("thon\nx = 1").content == "```python\nx = 1"
    s = _JsonReplyStream({"now"})
    assert s.feed("  He").content == "  He" and s.feed("llo").content == "llo"
    s = _JsonReplyStream({"now"})
    assert s.feed('{"name": "now", ').content == ""  # held: it may be a call


def test_one_call_at_most_without_parallel_calls():
    two = ('<tool_call>{"name": "a", "arguments": {}}</tool_call>'
           '<tool_call>{"name": "b", "arguments": {}}</tool_call>')  # fmt: skip
    assert calls_of(whole(_HermesStream(parallel=False), two)[1]) == [("a", {})]
    assert len(whole(_HermesStream(), two)[1]) == 2
    reply = '[{"name": "a", "arguments": {}}, {"name": "b", "arguments": {}}]'
    assert calls_of(whole(_JsonReplyStream({"a", "b"}, parallel=False), reply)[1]) == [("a", {})]


def test_a_required_list_cut_off_before_a_call_is_text():
    content, calls = whole(
        _ListStream(), '[{"name": "a", "parameters": {"x": 1}}, {"name": "b", "pa'
    )
    assert calls_of(calls) == [("a", {"x": 1})] and content is None  # (after a call: none)
    assert whole(_ListStream(), '[{"name": "a", "par') == ('[{"name": "a", "par', [])
    assert whole(_ListStream(), '[{"name": "a", "parameters": {}}]')[0] is None


def test_required_references_resolve_from_the_lists_root():
    params = {
        "type": "object",
        "properties": {
            "a": {"$ref": "#/definitions/A"},
            "b": {"$ref": "#/properties/a"},
            "c": {"type": "array", "items": {"$ref": "#"}},
        },
        "definitions": {"A": {"type": "string"}},
    }
    # two tools with one definitions name, differently: each keeps its own
    other = {"type": "object", "properties": {"z": {"$ref": "#/definitions/A", "default":
             {"$ref": "#"}}}, "definitions": {"A": {"type": "integer"}}}  # fmt: skip
    schema = check_tools([tool("f", params), tool("g", other)], "required", True, None,
                         None).constraint()  # fmt: skip
    root = "#/items/anyOf/0/properties/parameters"
    got = schema["items"]["anyOf"][0]["properties"]["parameters"]
    assert got["definitions"] == {"A": {"type": "string"}}
    assert got["properties"]["a"] == {"$ref": root + "/definitions/A"}
    assert got["properties"]["b"] == {"$ref": root + "/properties/a"}
    assert got["properties"]["c"]["items"] == {"$ref": root}
    # (a property named as a keyword is a property: its reference is rebased too)
    named = {"type": "object", "properties": {"default": {"$ref": "#/$defs/P"}},
             "$defs": {"P": {"type": "integer"}}}  # fmt: skip
    got = check_tools([tool("h", named)], "required", True, None, None).constraint()
    assert got["items"]["anyOf"][0]["properties"]["parameters"]["properties"]["default"] == {
        "$ref": "#/items/anyOf/0/properties/parameters/$defs/P"
    }
    z = schema["items"]["anyOf"][1]["properties"]["parameters"]["properties"]["z"]
    assert z == {
        "$ref": "#/items/anyOf/1/properties/parameters/definitions/A",
        "default": {"$ref": "#"},
    }  # (data is not rewritten)
    # (the grammar compiles it)
    from specdecode.structured import StructuredOutput

    StructuredOutput(json=schema)


def test_bad_earlier_calls_are_refused():
    for calls in ([{"function": "x"}], "x", [3]):
        with pytest.raises(InvalidRequestError, match="tool_calls"):
            template_messages([{"role": "assistant", "content": "", "tool_calls": calls}])
