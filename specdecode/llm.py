"""Offline Python API in the shape vLLM users know: `LLM(model=...).generate(prompts, params)`."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import numbers
from collections.abc import Iterable, Iterator
from collections.abc import Sequence as Seq
from typing import Any

from specdecode.config import EngineConfig
from specdecode.core import CompletionOutput, Logprob, RequestOutput, content_text
from specdecode.engine.engine import LLMEngine
from specdecode.engine.output import OutputProcessor
from specdecode.errors import InvalidRequestError
from specdecode.sampling import SamplingParams
from specdecode.serving.tools import check_tools, template_messages

Prompt = str | dict[str, Any] | list[int]
Messages = list[dict[str, str]]


class LLM:
    """Load a model once, then generate for many prompts (batched inside the engine)."""

    def __init__(
        self, model: str | None = None, *, share_model_with: LLM | None = None, **engine_args: Any
    ) -> None:
        """`share_model_with`: another LLM of the same model whose loaded weights this one
        reuses (e.g. to compare drafters without a second copy of the target)."""
        fields = {f.name for f in dataclasses.fields(EngineConfig)}
        unknown = set(engine_args) - fields
        if unknown:
            raise TypeError(f"unknown engine arguments: {', '.join(sorted(unknown))}")
        shared = share_model_with.engine if share_model_with is not None else None
        self.engine = LLMEngine(EngineConfig(model=model, **engine_args), shared)
        self.tokenizer = self.engine.tokenizer
        self._request_ids = itertools.count()

    def get_tokenizer(self):
        return self.tokenizer

    # ---- prompts -------------------------------------------------------------------------------

    def encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return list(self.tokenizer(prompt).input_ids)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return _token_ids(prompt["prompt_token_ids"])
        if isinstance(prompt, dict) and "prompt" in prompt:
            return self.encode(prompt["prompt"])
        if isinstance(prompt, list) and prompt and all(_is_id(t) for t in prompt):
            return _token_ids(prompt)
        raise InvalidRequestError(f"cannot understand the prompt {prompt!r:.80}")

    def apply_chat_template(self, messages: Messages, **options: Any) -> str:
        """The conversation as prompt text; `options`: vLLM's `add_generation_prompt`,
        `continue_final_message`, `chat_template` and `chat_template_kwargs`."""
        for m in messages:
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise InvalidRequestError("each chat message needs a 'role' and a 'content'")
        # (OpenAI's text parts read as their joined text, as the server reads them)
        messages = [
            {**m, "content": content_text(m["content"])} if isinstance(m["content"], list) else m
            for m in messages
        ]
        if options.get("tools"):  # checked as the server checks them (not called here)
            tools = check_tools(options["tools"], "none", True, None, None)
            options = {**options, "tools": [dict(t) for t in tools.tools]}
        return self.engine.render_chat(template_messages(messages), "generate()", **options)

    def _chat_ids(self, messages: Messages) -> list[int]:
        return self._text_ids(self.apply_chat_template(messages))

    def _text_ids(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """A rendered chat's ids (its special tokens are in the text already, unless asked)."""
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens).input_ids)

    # ---- generation ----------------------------------------------------------------------------

    def generate(
        self,
        prompts: Prompt | Seq[Prompt],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = False,
        priority: Seq[int] | None = None,
    ) -> list[RequestOutput]:
        """`use_tqdm`: a progress bar over the prompts' requests (vLLM's flag; off here);
        `priority`: one per prompt, lower first (vLLM's; needs `scheduling_policy="priority"`)."""
        if isinstance(prompts, (str, dict)) or (
            isinstance(prompts, list) and prompts and _is_id(prompts[0])
        ):
            prompts = [prompts]
        elif isinstance(prompts, Iterable) and not isinstance(prompts, bytes):
            prompts = list(prompts)  # (a generator is read once)
        else:
            raise InvalidRequestError(
                f"prompts must be a string, token ids, a dict or a list of them: {prompts!r:.80}"
            )
        return self._run(
            [self.encode(p) for p in prompts], sampling_params, prompts, use_tqdm, priority
        )

    def chat(
        self,
        messages: Messages | Seq[Messages],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = False,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[RequestOutput]:
        """One conversation or a list of them; the options are vLLM's (`continue_final_message`
        with `add_generation_prompt=False` continues a final assistant message; `tools`:
        OpenAI's function tools, for templates that describe them). Each output's `prompt`
        is the rendered template."""
        if not isinstance(messages, (list, tuple)):
            raise InvalidRequestError("chat() takes a list of messages or a list of conversations")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        options = {
            "add_generation_prompt": add_generation_prompt,
            "continue_final_message": continue_final_message,
            "chat_template": chat_template,
            "chat_template_kwargs": chat_template_kwargs,
            "tools": tools,
        }
        texts = [self.apply_chat_template(list(c), **options) for c in conversations]
        return self._run([self._text_ids(t) for t in texts], sampling_params, texts, use_tqdm)

    def stream(
        self, prompt: Prompt, params: SamplingParams | None = None, chat: bool = False
    ) -> Iterator[str]:
        """Yield text pieces of one completion as they are generated."""
        ids = self._chat_ids(prompt) if chat else self.encode(prompt)  # type: ignore[arg-type]
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams) or params.n != 1:
            raise InvalidRequestError("stream() takes one SamplingParams with n = 1")
        seq = self.engine.add_request(ids, params)
        try:
            while not seq.finished:
                self.engine.step()
                delta = OutputProcessor.stream_delta(seq)
                if delta:
                    yield delta
            delta = OutputProcessor.stream_delta(seq)
            if delta:
                yield delta
        finally:  # a consumer that stops early (or an error) leaves nothing running
            self.engine.abort(seq)

    def _run(
        self, ids: list[list[int]], params, prompts: list, use_tqdm: bool = False,
        priority: Seq[int] | None = None,
    ) -> list[RequestOutput]:  # fmt: skip
        if params is None:
            params = SamplingParams()
        plist = [params] * len(ids) if isinstance(params, SamplingParams) else list(params)
        if len(plist) != len(ids):
            raise InvalidRequestError("need one SamplingParams per prompt, or a single one")
        if not all(isinstance(sp, SamplingParams) for sp in plist):
            raise InvalidRequestError("sampling_params must be SamplingParams (or a list of them)")
        # every request checked before any is queued: a bad one leaves nothing behind; n
        # choices are n sequences, choice j seeded with seed + j (as the server does)
        if priority is None:
            priority = [0] * len(ids)
        elif not isinstance(priority, (list, tuple)) or len(priority) != len(ids):
            raise InvalidRequestError("need one priority per prompt", "priority")
        numbers = [str(next(self._request_ids)) for _ in ids]  # (rising across calls, as vLLM's)
        seqs = [
            [self.engine.make_sequence(p, sp.for_choice(j), rid, pr) for j in range(sp.n)]
            for rid, p, sp, pr in zip(numbers, ids, plist, priority, strict=True)
        ]
        flat = [s for choices in seqs for s in choices]
        for seq in flat:
            self.engine.add_sequence(seq)
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(flat), desc="generating", unit="request")
        try:  # until these are done (a stream() left suspended shares the steps, not the wait)
            while not all(seq.finished for seq in flat):
                self.engine.step()
                if bar is not None:
                    bar.update(sum(s.finished for s in flat) - bar.n)
        finally:  # interrupted (Ctrl-C, an error): the rest must not run in the next call
            for seq in flat:
                self.engine.abort(seq)
            if bar is not None:
                bar.close()
        decode = functools.cache(lambda t: self.tokenizer.decode([t]))
        return [
            RequestOutput(
                request_id=choices[0].request_id,
                prompt=_prompt_text(pr),
                prompt_token_ids=choices[0].prompt_token_ids,
                outputs=[_completion(j, s, decode) for j, s in enumerate(choices)],
                finished=True,
                num_cached_tokens=choices[0].num_cached_tokens,
                prompt_logprobs=prompt_logprob_entries(choices[0], decode),
            )
            for choices, pr in zip(seqs, prompts, strict=True)
        ]


def _is_id(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _token_ids(ids) -> list[int]:
    """Token ids as Python ints (numpy's too); anything else is refused before it runs."""
    if isinstance(ids, (str, bytes)) or not all(_is_id(t) for t in ids):
        raise InvalidRequestError(f"prompt_token_ids must be integers, got {ids!r:.80}")
    return [int(t) for t in ids]


def _prompt_text(prompt) -> str | None:
    """The prompt as given where it was text (a string, or a dict's "prompt")."""
    if isinstance(prompt, dict):
        prompt = prompt.get("prompt")
    return prompt if isinstance(prompt, str) else None


def _completion(index: int, s, decode) -> CompletionOutput:
    """One choice as vLLM gives it (`decode`: a token id's text, for the logprobs)."""
    wanted = s.params.logprobs is not None
    return CompletionOutput(
        index,
        s.text,
        list(s.output_token_ids),
        s.finish_reason,
        s.spec.as_dict() if s.spec.num_drafts else None,
        [
            _logprob_entry(tok, e, decode)
            for tok, e in zip(s.output_token_ids, s.output_logprobs, strict=True)
        ]
        if wanted
        else None,
        # (vLLM's: the sum of the sampled tokens' logprobs where they were asked for)
        cumulative_logprob=sum(e[0] for e in s.output_logprobs) if wanted else None,
        stop_reason=s.stop_reason,
    )


def prompt_logprob_entries(seq, decode) -> list | None:
    """vLLM's prompt_logprobs: None for the first token (nothing before it), then an entry per
    prompt token (the first choice's: the others do not compute them again)."""
    if seq.params.prompt_logprobs is None:
        return None
    ids = seq.prompt_token_ids
    return [None] + [
        _logprob_entry(tok, e, decode) for tok, e in zip(ids[1:], seq.prompt_logprobs, strict=True)
    ]


def _logprob_entry(tok: int, entry, decode) -> dict[int, Logprob]:
    """(logprob, [(token id, logprob)] top-n, rank) -> {token id: Logprob}, the sampled token
    first with its rank in the vocabulary (always there: vLLM lists it even where it is not
    among the top-n)."""
    lp, top, rank = entry
    ranks = {t: r for r, (t, _) in enumerate(top, 1)}
    out = {tok: Logprob(lp, rank, decode(tok))}
    for t, v in top:
        out.setdefault(t, Logprob(v, ranks[t], decode(t)))
    return out
