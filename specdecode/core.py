"""Shared request-side types. No tensors here: the scheduler works on these alone.

Glossary
- prompt tokens / output tokens: what the user sent / what the engine generated.
- committed (`blocks.length`): tokens whose keys and values are in the KV cache. The newest
  sampled token is not committed until the next step feeds it to the model.
- finish reasons (OpenAI's words): "stop" (EOS, a stop token or a stop string, or a grammar
  that is complete), "length" (max_tokens or the context is full); and "abort" (cancelled),
  "error" (the request cannot continue, `Sequence.error` says why).
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import Any

from specdecode.cache import SeqBlocks
from specdecode.metrics import SpecDecodeStats
from specdecode.sampling import SamplingParams

_ids = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)  # a request is itself: compared by identity (scheduler lists)
class Sequence:
    prompt_token_ids: list[int]
    params: SamplingParams
    request_id: str = ""
    seq_id: int = field(default_factory=lambda: next(_ids))
    output_token_ids: list[int] = field(default_factory=list)
    blocks: SeqBlocks = field(default_factory=SeqBlocks)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    # what stopped it, as vLLM reports: a stop_token_ids id or a stop string (None: EOS, length)
    stop_reason: int | str | None = None
    text: str = ""  # detokenized output, stop strings already cut
    # incremental detokenizer: the prompt's last tokens as context (a SentencePiece token's
    # leading space shows only after another token), offsets into context + output ids
    detok_context: list[int] | None = None
    prefix_offset: int = 0
    read_offset: int = 0
    streamed: int = 0  # characters of `text` already handed to a stream consumer
    spec: SpecDecodeStats = field(default_factory=SpecDecodeStats)
    # with params.logprobs, per output token: (logprob, top-n [(token id, logprob)], its rank
    # in the whole vocabulary)
    output_logprobs: list[tuple[float, list[tuple[int, float]], int]] = field(default_factory=list)
    # with params.prompt_logprobs, the same for prompt tokens 1, 2, ... (token 0 has none)
    prompt_logprobs: list[tuple[float, list[tuple[int, float]], int]] = field(default_factory=list)
    # structured output: the grammar matcher (xgrammar), tokens it forced (jump-ahead)
    matcher: Any = None
    num_forced_tokens: int = 0
    next_bitmask: Any = None  # the grammar's mask for the next token, when already computed
    error: str | None = None  # set with finish_reason "error" when the request cannot go on
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache when admitted
    admitted: bool = False  # admitted once (a preempted request coming back is not counted)
    # under the priority scheduling policy: lower runs first (vLLM's), then the earlier
    priority: int = 0
    penalty_history: Any = None  # what penalties read, kept incrementally (processors.py)
    # prompt + output as one array, grown as the output is (drafters/ngram.py; a copy of a
    # request would have to drop it)
    lookup_context: Any = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def last_token(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    @property
    def num_uncommitted(self) -> int:
        """Tokens the next forward must feed (the whole prompt at first, then 1 per step)."""
        return self.num_tokens - self.blocks.length

    def token_ids(self, start: int, end: int) -> list[int]:
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p : end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - p]

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Prompt logprobs asked for and not all computed yet (the prefix cache is skipped)."""
        return (
            self.params.prompt_logprobs is not None
            and len(self.prompt_logprobs) < len(self.prompt_token_ids) - 1
        )

    @property
    def finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED


@dataclass
class Logprob:
    """vLLM's: a token's log-probability (raw: before penalties, bias and masks), its rank in
    the distribution (1: the most likely; None where it was not among the top-n listed) and
    its text decoded alone."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    spec: dict | None = None  # SpecDecodeStats.as_dict() when speculation ran
    # with SamplingParams.logprobs, vLLM's shape: per token {token id: Logprob}, the sampled
    # token first, then the top-n (n = SamplingParams.logprobs) by rank
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None  # their sum, where logprobs were asked for
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache (as vLLM reports)
    # with SamplingParams.prompt_logprobs, vLLM's shape: None for the first prompt token, then
    # per token {token id: Logprob}, the prompt's token first, then the top-n
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None


def content_text(content) -> str:
    """A chat message's content as text: a string, None (empty), or OpenAI's list of text
    parts ({"type": "text", "text": ...}), joined; other parts (images, audio) are refused."""
    from specdecode.errors import InvalidRequestError

    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequestError("a message's content must be text or a list of text parts")
    parts = []
    for part in content:
        if (
            not isinstance(part, dict)
            or part.get("type") != "text"
            or not isinstance(part.get("text"), str)
        ):
            raise InvalidRequestError("only text content parts are supported", param="messages")
        parts.append(part["text"])
    return "".join(parts)
