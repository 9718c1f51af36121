"""Appends sampled tokens to a sequence: incremental detokenization and every stop condition.

Several tokens may arrive in one step (speculative decoding); each is checked in order, so tokens
past a stop are dropped exactly as if they had been generated one at a time.
"""

from __future__ import annotations

from specdecode.core import Sequence

DETOKENIZE_CONTEXT = 5  # prompt tokens decoded before the output (vLLM uses 5 as well)


def _window(seq: Sequence, start: int, end: int | None = None) -> list[int]:
    """Tokens [start, end) of the prompt context followed by the output."""
    ctx, out = seq.detok_context or [], seq.output_token_ids
    n = len(ctx)
    end = n + len(out) if end is None else end
    return ctx[start:end] + out[max(0, start - n) : max(0, end - n)]


def fast_decoder(tokenizer):
    """`decode(ids, skip_special_tokens=...)` with transformers' own result. For a fast
    tokenizer that does no clean-up of spaces, its Rust tokenizer is called directly: that is
    all transformers does then, without its per-call Python (half of a tiny model's engine
    overhead at 256 sequences, two decodes per token)."""
    rust = getattr(tokenizer, "_tokenizer", None)
    if rust is None or getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return tokenizer.decode
    return lambda ids, skip_special_tokens=False: rust.decode(
        ids, skip_special_tokens=skip_special_tokens
    )


class OutputProcessor:
    def __init__(self, tokenizer, eos_token_ids: set[int], max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.decode = fast_decoder(tokenizer)
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len

    def append(self, seq: Sequence, tokens: list[int], logprobs: list | None = None) -> None:
        """Add `tokens` (and their `logprobs`, when asked for) to `seq` until one of them
        finishes it; sets `seq.finish_reason`."""
        params = seq.params
        for i, tok in enumerate(tokens):
            seq.output_token_ids.append(tok)
            if logprobs:
                seq.output_logprobs.append(logprobs[i])
            searched = len(seq.text)  # a stop string may straddle the old and the new text
            stop_token = tok in params.stop_token_ids or (
                not params.ignore_eos and tok in self.eos_token_ids
            )
            # a stop token's text is left out unless asked for (as vLLM does): its id is kept
            if not stop_token or params.include_stop_str_in_output:
                self._detokenize(seq)
            # stop strings wait as stop tokens do: the first min_tokens tokens cannot stop
            early = len(seq.output_token_ids) <= params.min_tokens
            if stop_token:
                seq.finish_reason = "stop"
                # (vLLM: the id where a stop_token_ids entry ended it, None for EOS)
                eos = not params.ignore_eos and tok in self.eos_token_ids
                seq.stop_reason = None if eos else tok
            elif params.stop and not early and (hit := self._cut_stop_string(seq, searched)):
                seq.finish_reason, seq.stop_reason = "stop", hit
            elif params.max_tokens is not None and len(seq.output_token_ids) >= params.max_tokens:
                seq.finish_reason = "length"
            elif seq.num_tokens >= self.max_model_len:
                seq.finish_reason = "length"
            if seq.finish_reason is not None:
                return

    def _detokenize(self, seq: Sequence) -> None:
        """Decode only a short window: text of tokens [prefix, read) vs [prefix, end), over the
        prompt's last tokens then the output (so the first token decodes as it follows the
        prompt, as vLLM's detokenizer does)."""
        if seq.detok_context is None:
            seq.detok_context = seq.prompt_token_ids[-DETOKENIZE_CONTEXT:]
            seq.prefix_offset = 0
            seq.read_offset = len(seq.detok_context)
        decode, skip = self.decode, seq.params.skip_special_tokens
        prefix = decode(_window(seq, seq.prefix_offset, seq.read_offset), skip_special_tokens=skip)
        full = decode(_window(seq, seq.prefix_offset), skip_special_tokens=skip)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            seq.text += full[len(prefix) :]
            seq.prefix_offset = seq.read_offset
            seq.read_offset = len(seq.detok_context) + len(seq.output_token_ids)

    def _cut_stop_string(self, seq: Sequence, searched: int) -> str | None:
        """Cut at the first stop string ending in the text added since `searched` chars; the
        string, or None where none ends there."""
        params = seq.params
        longest = max(len(s) for s in params.stop)
        window_start = max(0, searched - longest + 1)
        hits = [(i, s) for s in params.stop if (i := seq.text.find(s, window_start)) >= 0]
        if not hits:
            return None
        i, s = min(hits)
        seq.text = seq.text[: i + len(s)] if params.include_stop_str_in_output else seq.text[:i]
        return s

    @staticmethod
    def stream_delta(seq: Sequence) -> str:
        """New text safe to show: while running, hold back what could begin a stop string."""
        hold = 0 if seq.finish_reason else max((len(s) - 1 for s in seq.params.stop), default=0)
        end = max(seq.streamed, len(seq.text) - hold)
        delta = seq.text[seq.streamed : end]
        seq.streamed = end
        return delta
