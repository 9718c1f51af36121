"""Sampling parameters and the one function that turns logits into the distribution we sample from.

`warp` is shared by plain decoding and (later) verification, so the target distribution p and the
draft distribution q always see the same temperature, top-k and top-p.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from specdecode.errors import InvalidRequestError


@dataclass
class SamplingParams:
    """Per-request sampling settings, named as in vLLM. temperature 0 means greedy."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: no top-k
    seed: int | None = None
    max_tokens: int | None = 16  # None: until the context is full
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True  # (vLLM's) special tokens' text is left out of the output
    # None: no log-probabilities; n >= 0: the sampled token's log-probability and the n most
    # likely tokens', from the model's raw distribution (before temperature, top-k, top-p)
    logprobs: int | None = None
    # None: none; n >= 0: each prompt token's log-probability given the tokens before it and
    # the n most likely tokens' there (vLLM's; such a request skips the prefix cache)
    prompt_logprobs: int | None = None
    # a StructuredOutput (or its dict: {"json": schema} | {"json_object": True} | {"regex": r}
    # | {"grammar": ebnf}); see specdecode/structured.py
    structured_output: Any = None
    # a reply that reasons first (vLLM's reasoning models: "</think>"): the structured output
    # constrains only what comes after the reply has written this text; before, any token goes
    reasoning_end: str | None = None
    # read what the request generated (see specdecode/processors.py), as in vLLM
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit
    min_tokens: int = 0  # stop tokens and stop strings are ignored until this many
    min_p: float = 0.0  # drop tokens below min_p x the most likely one's probability
    # vLLM's: choices per prompt. `LLM.generate` / `chat` and the server expand a request into
    # n sequences (choice j seeded with seed + j); an engine sequence is one choice
    n: int = 1

    def __post_init__(self) -> None:
        bad = _bad
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is not None and (
            not isinstance(self.stop, (list, tuple))
            or not all(isinstance(s, str) for s in self.stop)
        ):
            raise bad(f"stop must be a string or a list of strings, got {self.stop!r}", "stop")
        self.stop = list(self.stop or [])
        if self.stop_token_ids is not None and not isinstance(self.stop_token_ids, (list, tuple)):
            raise bad(
                f"stop_token_ids must be a list of token ids, got {self.stop_token_ids!r}",
                "stop_token_ids",
            )
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.structured_output is not None:
            from specdecode.structured import StructuredOutput

            self.structured_output = StructuredOutput.coerce(self.structured_output)
        self.validate()

    def validate(self) -> None:
        bad = _bad

        if not _number(self.temperature):
            raise bad(
                f"temperature must be a finite number, got {self.temperature!r}", "temperature"
            )
        if self.temperature < 0:
            raise bad(f"temperature must be >= 0, got {self.temperature}", "temperature")
        if not _number(self.top_p) or not 0 < self.top_p <= 1:
            raise bad(f"top_p must be in (0, 1], got {self.top_p!r}", "top_p")
        if not _integer(self.top_k) or self.top_k < -1:
            raise bad(f"top_k must be -1, 0 or a positive integer, got {self.top_k!r}", "top_k")
        if not _integer(self.n) or self.n < 1:
            raise bad(f"n must be a positive integer, got {self.n!r}", "n")
        if self.reasoning_end is not None and (
            not isinstance(self.reasoning_end, str) or not self.reasoning_end
        ):
            raise bad(
                f"reasoning_end must be a non-empty string, got {self.reasoning_end!r}",
                "reasoning_end",
            )
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise bad(f"{name} must be true or false, got {getattr(self, name)!r}", name)
        if self.max_tokens is not None and (not _integer(self.max_tokens) or self.max_tokens < 1):
            raise bad(
                f"max_tokens must be a positive integer, got {self.max_tokens!r}", "max_tokens"
            )
        if self.seed is not None:
            # OpenAI's seed is an int64: a negative one is read as its two's complement, so
            # every 64-bit seed (signed or not) names its own stream
            if (
                not isinstance(self.seed, int)
                or isinstance(self.seed, bool)
                or not -(2**63) <= self.seed < 2**64
            ):
                raise bad(f"seed must be a 64-bit integer, got {self.seed!r}", "seed")
            self.seed %= 2**64
        for name, own in (("logprobs", "sampled one"), ("prompt_logprobs", "prompt's own")):
            value = getattr(self, name)
            if value is not None and (not _integer(value) or not 0 <= value <= 20):
                raise bad(
                    f"{name} must be an integer in [0, 20] (the top tokens to list besides the "
                    f"{own}), got {value!r}",
                    name,
                )
        if any(not s for s in self.stop):
            raise bad("stop strings must be non-empty", "stop")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _number(value) or not -2 <= value <= 2:
                raise bad(f"{name} must be in [-2, 2], got {value!r}", name)
        rp = self.repetition_penalty
        if not _number(rp) or not 0 < rp <= 100:
            raise bad(f"repetition_penalty must be in (0, 100], got {rp!r}", "repetition_penalty")
        if not _number(self.min_p) or not 0 <= self.min_p <= 1:
            raise bad(f"min_p must be in [0, 1], got {self.min_p!r}", "min_p")
        if not _integer(self.min_tokens) or self.min_tokens < 0:
            raise bad(
                f"min_tokens must be a non-negative integer, got {self.min_tokens!r}", "min_tokens"
            )
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad(
                f"min_tokens ({self.min_tokens}) exceeds max_tokens ({self.max_tokens})",
                "min_tokens",
            )
        if not all(_integer(t) and t >= 0 for t in self.stop_token_ids):
            raise bad(
                f"stop_token_ids must be token ids, got {self.stop_token_ids!r}", "stop_token_ids"
            )
        if self.logit_bias is not None and not isinstance(self.logit_bias, dict):
            raise bad(
                f"logit_bias must map token ids to biases, got {self.logit_bias!r}", "logit_bias"
            )
        if self.logit_bias:
            for tok, value in self.logit_bias.items():
                if not _integer(tok) or tok < 0:
                    raise bad(f"logit_bias keys must be token ids, got {tok!r}", "logit_bias")
                if not _number(value) or not -100 <= value <= 100:
                    raise bad(
                        f"logit_bias values must be in [-100, 100], got {value!r}", "logit_bias"
                    )

    def for_choice(self, j: int) -> SamplingParams:
        """Choice j of a request's n (the offline API's and the server's): one sequence,
        seeded with seed + j where seeded, so n > 1 gives n different samples."""
        if self.n == 1 and (self.seed is None or j == 0):
            return self
        seed = None if self.seed is None else (self.seed + j) % 2**64
        # the prompt's logprobs are the prompt's: the first choice computes them
        prompt_logprobs = self.prompt_logprobs if j == 0 else None
        return replace(self, n=1, seed=seed, prompt_logprobs=prompt_logprobs)

    @property
    def greedy(self) -> bool:
        """Temperature 0, or so close to it that logits / T would overflow."""
        return self.temperature < 1e-5

    def make_generator(self, device: torch.device | str = "cpu") -> torch.Generator | None:
        """A seeded generator for this request (None: use the global RNG)."""
        if self.seed is None:
            return None
        gen = torch.Generator(device=device)
        gen.manual_seed(self.seed)
        return gen


def _bad(msg: str, param: str | None = None) -> InvalidRequestError:
    """An error naming the field at fault (`param`: OpenAI error bodies carry it)."""
    return InvalidRequestError(f"invalid sampling parameter: {msg}", param)


def _integer(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def warp(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[N, V] logits -> [N, V] fp32 probabilities after temperature, min-p, top-k and top-p
    (vLLM's order).

    Greedy requests get a one-hot distribution on the argmax, so "sample from warp(...)" is the
    same operation for every request and verification can treat greedy as a special case of it.
    """
    logits = logits.float()
    if params.greedy:
        return torch.zeros_like(logits).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    logits = logits / params.temperature
    vocab = logits.shape[-1]
    if params.min_p > 0:  # p < min_p * p_max  <=>  logit < max logit + log(min_p)
        floor = logits.max(-1, keepdim=True).values + math.log(params.min_p)
        logits = logits.masked_fill(logits < floor, float("-inf"))
    if 0 < params.top_k < vocab:
        kth = logits.topk(params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        # Drop a token when the tokens ranked above it already reach top_p (keeps at least one).
        drop_sorted = (sorted_probs.cumsum(-1) - sorted_probs) >= params.top_p
        drop_sorted[..., 0] = False  # (a top_p below fp32's smallest normal compares as 0)
        drop = torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(-1)


RACE_BLOCK = 256  # tokens per block of `position_draws`' first race
_MASK64 = (1 << 64) - 1


def _position_noise(seed: int, position: int, n: int) -> torch.Tensor:
    """n Exp(1) values that are a pure function of (seed, position): Philox keyed by both, 64
    bits each (every 64-bit seed and position its own stream; the same numbers on every
    platform), as -log(1 - u)."""
    key = ((seed & _MASK64) << 64) | (position & _MASK64)
    u = np.random.Generator(np.random.Philox(key=key)).random(n)
    return torch.from_numpy(-np.log1p(-u))


def position_draws(probs: torch.Tensor, seed: int, positions: list[int]) -> list[int]:
    """[N, V] probabilities (need not be normalised), row n that of sequence position
    `positions[n]` -> N tokens, each a draw from its row whose randomness is a pure function of
    (seed, position).

    Sampling the token at position t so makes a seeded output a function of the seed alone:
    whether t was decoded on its own or verified inside a draft tree, in whatever batch, the
    same p gives the same token (see `verify_choices`). And nearly the same p too: a draw is
    the winner of an exponential race (argmax p_i / E_i, E_i ~ Exp(1), which picks i with
    probability p_i / sum p), run in two levels (a block of RACE_BLOCK tokens by its mass, then
    a token of the block, with independent noise) so that it needs ~450 noise values, not one
    per token. A change of p by a relative 1e-5 (what another batch shape, a prefix-cache hit
    or the library's attention over a large tree does in fp32) moves the draw only where the
    two best scores lie that close. An inverse CDF over the vocabulary in id order moved it
    whenever the uniform fell among tokens narrower than the shift: about once in 500 tokens
    at temperature 1."""
    n, v = probs.shape
    blocks = -(-v // RACE_BLOCK)
    rows = torch.nn.functional.pad(probs.float(), (0, blocks * RACE_BLOCK - v))
    rows = rows.view(n, blocks, RACE_BLOCK)
    mass = rows.sum(-1, dtype=torch.float64).cpu()  # [N, blocks]
    noise = [_position_noise(seed, pos, blocks + RACE_BLOCK) for pos in positions]
    chosen = [int((mass[i] / e[:blocks]).argmax()) for i, e in enumerate(noise)]
    within = rows[torch.arange(n, device=rows.device), torch.tensor(chosen, device=rows.device)]
    within = within.double().cpu()  # [N, RACE_BLOCK]: one transfer from a device
    return [
        b * RACE_BLOCK + int((within[i] / e[blocks:]).argmax())
        for i, (b, e) in enumerate(zip(chosen, noise, strict=True))
    ]


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """[N, V] probabilities, [N, 1] float64 uniforms -> [N] token ids."""
    cdf = probs.double().cumsum(-1)
    idx = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).squeeze(-1)
    return idx.clamp_(max=probs.shape[-1] - 1)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """[N, V] probabilities (need not be normalised) -> [N] token ids, drawn with the request's
    own generator: inverse CDF of one uniform per row (never a zero-probability token). Exact,
    and ~4x faster than torch.multinomial over a 152k vocabulary on a CPU."""
    u = torch.rand(probs.shape[0], 1, generator=generator, dtype=torch.float64, device=probs.device)
    return _inverse_cdf(probs, u)


def sample_logits(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> torch.Tensor:
    """[N, V] logits of one request -> [N] next tokens."""
    if params.greedy:
        return logits.argmax(-1)
    return sample(warp(logits, params), generator)
