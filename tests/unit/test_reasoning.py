"""The reasoning parser (serving/reasoning.py): a reply's split into reasoning and content,
whole and streamed alike."""

from __future__ import annotations

import random

import pytest

from specdecode.serving.reasoning import ReasoningStream, check_parser, split, thinks

CASES = [
    # (reply, reasoning, content)
    ("<think>plan it</think>\n\nThe answer.", "plan it", "The answer."),
    ("plan it</think>The answer.", "plan it", "The answer."),  # <think> in the prompt
    ("\n<think>\nplan</think>", "\nplan", None),  # the reasoning's own text is kept as is
    ("all thought, cut off", "all thought, cut off", None),  # (vLLM's: no end, no content)
    ("<think>a < b and </thin", "a < b and </thin", None),  # a tag cut off is reasoning
    ("<thi", "<thi", None),
    ("<think>", None, None),  # cut off right after the tag
    ("", None, None),
    ("x<think>y</think>z", "x<think>y", "z"),  # only a leading <think> is dropped
    ("</think></think>two", None, "</think>two"),  # the first end ends it
    ("<think></think>   ", None, None),
]


@pytest.mark.parametrize(("reply", "reasoning", "content"), CASES)
def test_whole_and_streamed_replies_split_alike(reply, reasoning, content):
    assert split(ReasoningStream(), reply) == (reasoning, content)
    rng = random.Random(0)
    for _ in range(30):  # random chunkings, down to a character each
        k = max(0, min(len(reply) - 1, rng.randint(0, 6)))
        cuts = sorted(rng.sample(range(1, len(reply)), k))
        pieces = [reply[a:b] for a, b in zip([0, *cuts], [*cuts, len(reply)], strict=True)]
        s = ReasoningStream()
        got = [s.feed(p) for p in pieces[:-1]] + [s.last(pieces[-1] if pieces else "")]
        r = "".join(g[0] for g in got) or None
        c = "".join(g[1] for g in got) or None
        assert (r, c) == (reasoning, content), pieces


def test_held_back_text_is_only_a_tags_beginning():
    s = ReasoningStream()
    assert s.feed(" <th") == ("", "")  # may be <think>
    assert s.feed("ink>abc</") == ("abc", "")  # "</" may begin </think>
    assert s.feed("b>") == ("</b>", "")
    assert s.feed("x</think>") == ("x", "")
    assert s.feed("  ") == ("", "")  # the content's leading whitespace
    assert s.feed(" Hi") == ("", "Hi")
    assert s.ended


def test_a_reply_that_does_not_think_is_all_content():
    s = ReasoningStream(thinking=False)
    assert s.feed("<think>x</think>") == ("", "<think>x</think>")
    assert split(ReasoningStream(False), " y") == (None, " y")


def test_whether_a_reply_thinks():
    assert thinks("deepseek_r1", "<|user|>hi<|assistant|><think>\n", None)
    assert thinks("deepseek_r1", "<|user|>hi<|assistant|>", None)  # the model opens it
    # Qwen3's template asked not to think closes an empty reasoning in the prompt
    assert not thinks("qwen3", "hi<|im_start|>assistant\n<think>\n\n</think>\n\n", None)
    # an earlier turn's closed reasoning, then a new one opened
    assert thinks("qwen3", "<think>a</think>b ... assistant\n<think>\n", None)
    # a tool-call loop: the template shows the last turn's reasoning again; the reply thinks
    loop = (
        "<|im_start|>assistant\n<think>\nr\n</think>\n\n<tool_call>{}</tool_call><|im_end|>"
        "\n<|im_start|>user\n<tool_response>\n9\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert thinks("qwen3", loop, None) and thinks("deepseek_r1", "say </think> x", None)
    # a reply continuing a message: that message tells
    assert not thinks("deepseek_r1", "...</think>\n\nThe ans", None, "</think>\n\nThe ans")
    assert thinks("deepseek_r1", "...<think>\nso", None, "<think>\nso")
    assert thinks("deepseek_r1", "...<think>a</think>b<think>c", None, "<think>a</think>b<think>c")
    assert not thinks("qwen3", "hi", {"enable_thinking": False})
    assert thinks("deepseek_r1", "hi", {"enable_thinking": False})  # (qwen3's switch only)


def test_parser_names():
    assert check_parser("deepseek-r1") == "deepseek_r1" and check_parser(None) is None
    with pytest.raises(ValueError, match="deepseek_r1"):
        check_parser("granite")
