"""Offline Python API in the shape vLLM users know: `LLM(model=...).generate(prompts, params)`."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from collections.abc import Sequence as Seq
from typing import Any

from specdecode.config import EngineConfig
from specdecode.core import CompletionOutput, RequestOutput
from specdecode.engine.engine import LLMEngine
from specdecode.engine.output import OutputProcessor
from specdecode.errors import InvalidRequestError
from specdecode.sampling import SamplingParams

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

    def get_tokenizer(self):
        return self.tokenizer

    # ---- prompts -------------------------------------------------------------------------------

    def encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return list(self.tokenizer(prompt).input_ids)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return list(prompt["prompt_token_ids"])
        if isinstance(prompt, dict) and "prompt" in prompt:
            return self.encode(prompt["prompt"])
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return list(prompt)
        raise InvalidRequestError(f"cannot understand the prompt {prompt!r:.80}")

    def apply_chat_template(self, messages: Messages) -> str:
        for m in messages:
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise InvalidRequestError("each chat message needs a 'role' and a 'content'")
        return self.engine.render_chat(messages, "generate()")

    def _chat_ids(self, messages: Messages) -> list[int]:
        text = self.apply_chat_template(messages)
        return list(self.tokenizer(text, add_special_tokens=False).input_ids)

    # ---- generation ----------------------------------------------------------------------------

    def generate(
        self,
        prompts: Prompt | Seq[Prompt],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        if isinstance(prompts, (str, dict)) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        return self._run([self.encode(p) for p in prompts], sampling_params, list(prompts))

    def chat(
        self,
        messages: Messages | Seq[Messages],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        ids = [self._chat_ids(list(c)) for c in conversations]
        return self._run(ids, sampling_params, [None] * len(ids))

    def stream(
        self, prompt: Prompt, params: SamplingParams | None = None, chat: bool = False
    ) -> Iterator[str]:
        """Yield text pieces of one completion as they are generated."""
        ids = self._chat_ids(prompt) if chat else self.encode(prompt)  # type: ignore[arg-type]
        seq = self.engine.add_request(ids, params or SamplingParams())
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

    def _run(self, ids: list[list[int]], params, prompts: list) -> list[RequestOutput]:
        if params is None:
            params = SamplingParams()
        plist = [params] * len(ids) if isinstance(params, SamplingParams) else list(params)
        if len(plist) != len(ids):
            raise InvalidRequestError("need one SamplingParams per prompt, or a single one")
        # every request checked before any is queued: a bad one leaves nothing behind
        seqs = [
            self.engine.make_sequence(p, sp, request_id=str(i))
            for i, (p, sp) in enumerate(zip(ids, plist, strict=True))
        ]
        for seq in seqs:
            self.engine.add_sequence(seq)
        try:
            for _ in self.engine.run_to_completion():
                pass
        finally:  # interrupted (Ctrl-C, an error): the rest must not run in the next call
            for seq in seqs:
                self.engine.abort(seq)
        return [
            RequestOutput(
                request_id=s.request_id,
                prompt=pr if isinstance(pr, str) else None,
                prompt_token_ids=s.prompt_token_ids,
                outputs=[
                    CompletionOutput(
                        0,
                        s.text,
                        list(s.output_token_ids),
                        s.finish_reason,
                        s.spec.as_dict() if s.spec.num_drafts else None,
                        list(s.output_logprobs) if s.params.logprobs is not None else None,
                    )
                ],
                finished=True,
                num_cached_tokens=s.num_cached_tokens,
            )
            for s, pr in zip(seqs, prompts, strict=True)
        ]
