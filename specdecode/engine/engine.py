"""The engine loop: schedule, run, append outputs. Requests can join between any two steps."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import torch

from specdecode.cache import BlockManager, KVCache
from specdecode.config import EngineConfig
from specdecode.core import Sequence
from specdecode.engine.model_runner import ModelRunner
from specdecode.engine.output import OutputProcessor
from specdecode.engine.scheduler import Scheduler
from specdecode.errors import InvalidRequestError
from specdecode.models.loader import load_model, load_tokenizer
from specdecode.sampling import SamplingParams

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str) -> torch.dtype:
    if dtype not in _DTYPES:
        raise InvalidRequestError(f"unknown dtype {dtype!r}; choose from {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        torch.manual_seed(config.seed)
        dtype, device = resolve_dtype(config.dtype), resolve_device(config.device)
        loaded = load_model(
            config.model, dtype=dtype, device=device, allow_pickle=config.allow_pickle
        )
        self.model, self.model_config, self.model_path = loaded.model, loaded.config, loaded.path
        self.tokenizer = load_tokenizer(loaded.path)
        mc = self.model_config
        self.max_model_len = min(
            config.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings
        )
        per_token = KVCache.bytes_per_token(mc, dtype)
        num_blocks = max(2, int(config.kv_cache_memory_gb * 2**30 / per_token / config.block_size))
        self.manager = BlockManager(num_blocks, config.block_size)
        self.cache = KVCache(mc, num_blocks, config.block_size, dtype, device)
        self.scheduler = Scheduler(self.manager, config.max_num_seqs, config.max_num_batched_tokens)
        self.runner = ModelRunner(self.model, self.cache, self.manager)
        self.output = OutputProcessor(self.tokenizer, self._eos_ids(), self.max_model_len)

    def _eos_ids(self) -> set[int]:
        ids = set(self.model_config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids

    def add_request(
        self, prompt_token_ids: list[int], params: SamplingParams, request_id: str = ""
    ) -> Sequence:
        if not prompt_token_ids:
            raise InvalidRequestError("the prompt is empty")
        if len(prompt_token_ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"the prompt has {len(prompt_token_ids)} tokens; the context holds "
                f"{self.max_model_len}, leaving no room to generate"
            )
        vocab = self.model_config.vocab_size
        if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= vocab:
            raise InvalidRequestError(f"prompt token ids must be in [0, {vocab})")
        seq = Sequence(list(prompt_token_ids), params, request_id=request_id)
        self.scheduler.add(seq)
        return seq

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[Sequence]:
        """Run one forward for the scheduled batch; return the sequences that received tokens."""
        batch = self.scheduler.schedule()
        if not batch.seqs:
            return []
        next_tokens = self.runner.run(batch)
        updated = []
        for seq, tok in zip(batch.seqs, next_tokens, strict=True):
            if tok is None:
                continue
            self.output.append(seq, [tok])
            if seq.finish_reason is not None:
                self.scheduler.finish(seq)
                self.runner.release(seq)
            updated.append(seq)
        return updated

    def run_to_completion(self) -> Iterator[list[Sequence]]:
        while self.has_unfinished():
            yield self.step()
