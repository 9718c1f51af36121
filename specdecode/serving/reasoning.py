"""Reasoning models' replies (vLLM's and SGLang's `--reasoning-parser`): a reply that thinks in
"<think> ... </think>" before it answers is split into its reasoning and its content, whole or
streamed, by one state machine (so both agree):

- a leading "<think>" (after whitespace) is dropped: DeepSeek-R1-0528 and Qwen3 up to 2507
  write it, newer templates put it in the prompt and the reply starts thinking at once;
- the reasoning runs to "</think>"; the content is what follows (its leading whitespace
  dropped). A reply cut off before "</think>" is all reasoning, and has no content (vLLM's);
- a prompt that ends by closing the reasoning (a template that was asked not to think:
  Qwen3's `enable_thinking: false` ends it with "<think>\\n\\n</think>\\n\\n"), or, for `qwen3`,
  a request with `chat_template_kwargs.enable_thinking` false, gets a reply that is all
  content. Earlier turns' reasoning in the prompt (shown again in a tool-call loop) does not
  count. The tool-call parser reads the content only, once the reasoning has ended.

A structured output (or a "required" / named tool call) constrains the content only: the
grammar starts after "</think>" (`SamplingParams.reasoning_end`), unless the server is started
with `--structured-outputs-config '{"enable_in_reasoning": true}'` (vLLM's option).
"""

from __future__ import annotations

from typing import Any

from specdecode.serving.tools import partial_suffix

START, END = "<think>", "</think>"
# vLLM's names and SGLang's; the formats are one here
PARSERS = {
    "deepseek_r1": "deepseek_r1",
    "deepseek-r1": "deepseek_r1",
    "qwen3": "qwen3",
    "qwen3-thinking": "qwen3",
}


def check_parser(name: str | None) -> str | None:
    """The parser's canonical name (None: none), or a ValueError naming those there are."""
    if name is None:
        return None
    if name not in PARSERS:
        raise ValueError(
            f"unknown reasoning parser {name!r}: this server reads {', '.join(PARSERS)} "
            f"(all of them: {START} ... {END})"
        )
    return PARSERS[name]


def thinks(
    parser: str, prompt: str, template_kwargs: dict[str, Any] | None,
    continued: str | None = None,
) -> bool:  # fmt: skip
    """Whether a reply to `prompt` starts by reasoning: not where the prompt ends by closing
    it (a template asked not to think writes an empty "<think>\n\n</think>\n\n" last;
    earlier turns' reasoning, shown again in a tool-call loop, does not count), nor for `qwen3`
    where the request turned thinking off (`enable_thinking` false, as vLLM's parser reads
    it). A reply that continues a message (`continued`: its text, as the request gave it)
    thinks unless that message closed its reasoning (its last END after its last START)."""
    if parser == "qwen3" and (template_kwargs or {}).get("enable_thinking", True) is False:
        return False
    if continued is not None:
        end = continued.rfind(END)
        return end < 0 or continued.rfind(START) > end
    return not prompt.rstrip().endswith(END)


class ReasoningStream:
    """One reply's split into reasoning and content, fed its text as it comes: `feed` returns
    what may go out now as (reasoning, content); `last` the rest at its end. A reply that does
    not think (`thinking` False) is all content."""

    def __init__(self, thinking: bool = True) -> None:
        self.phase = "lead" if thinking else "content"
        self._buffer = ""
        self.ended = not thinking  # the reasoning has ended (or never began)

    def feed(self, text: str) -> tuple[str, str]:
        self._buffer += text
        reasoning = content = ""
        if self.phase == "lead":  # a leading START is dropped; wait until that can tell
            lead = self._buffer.lstrip()
            if START.startswith(lead) and lead != START:
                return "", ""  # (all held: whitespace or a proper prefix of START)
            self._buffer = lead[len(START) :] if lead.startswith(START) else self._buffer
            self.phase = "reasoning"
        if self.phase == "reasoning":
            at = self._buffer.find(END)
            if at < 0:
                keep = partial_suffix(self._buffer, END)
                cut = len(self._buffer) - keep
                reasoning, self._buffer = self._buffer[:cut], self._buffer[cut:]
                return reasoning, ""
            reasoning, self._buffer = self._buffer[:at], self._buffer[at + len(END) :]
            self.phase, self.ended = "after", True
        if self.phase == "after":  # the content's leading whitespace is dropped
            self._buffer = self._buffer.lstrip()
            if not self._buffer:
                return reasoning, ""
            self.phase = "content"
        content, self._buffer = self._buffer, ""
        return reasoning, content

    def last(self, text: str = "") -> tuple[str, str]:
        """The rest of the reply, at its end: text held back goes where it was (a reply cut
        off while its reasoning could still be starting or ending is reasoning)."""
        reasoning, content = self.feed(text)
        rest, self._buffer = self._buffer, ""
        if self.phase == "lead":  # whitespace, or START's beginning: cut off as it began
            reasoning += rest.lstrip()
        elif self.phase == "reasoning":
            reasoning += rest
        return reasoning, content


def split(stream: ReasoningStream, text: str) -> tuple[str | None, str | None]:
    """A whole reply as (reasoning, content), each None where empty (vLLM's message fields)."""
    reasoning, content = stream.last(text)
    return reasoning or None, content or None
