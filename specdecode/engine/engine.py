"""The engine loop: schedule, run, append outputs. Requests can join between any two steps."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import torch

from specdecode.cache import BlockManager, KVCache
from specdecode.config import EngineConfig, SpeculativeConfig
from specdecode.core import Sequence
from specdecode.drafters.base import Drafter, DraftProposal
from specdecode.engine.model_runner import ModelRunner
from specdecode.engine.output import OutputProcessor
from specdecode.engine.scheduler import Scheduler
from specdecode.errors import InvalidRequestError
from specdecode.metrics import SpecDecodeStats
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
        if config.kernels not in ("auto", "off"):
            raise InvalidRequestError(f"kernels must be 'auto' or 'off', got {config.kernels!r}")
        if config.kernels == "auto":
            from specdecode.models.fast import accelerate

            accelerate(self.model)
        self.tokenizer = load_tokenizer(loaded.path)
        mc = self.model_config
        self.max_model_len = min(
            config.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings
        )
        kv_dtype = self.model.activation_dtype
        num_blocks = KVCache.num_blocks_for(
            mc, kv_dtype, config.kv_cache_memory_gb, config.block_size
        )
        self.manager = BlockManager(num_blocks, config.block_size)
        self.cache = KVCache(mc, num_blocks, config.block_size, kv_dtype, device)
        self.scheduler = Scheduler(self.manager, config.max_num_seqs, config.max_num_batched_tokens)
        self.runner = ModelRunner(self.model, self.cache, self.manager)
        self.output = OutputProcessor(self.tokenizer, self._eos_ids(), self.max_model_len)
        self.spec_config = _speculative_config(config.speculative_config)
        # Called after every step with (sequences, their committed target features) when
        # `runner.feature_layers` is set: feature-reading drafters, data generation.
        self.feature_observers: list = []
        self.drafter: Drafter | None = None
        if self.spec_config is not None:
            from specdecode.drafters.factory import build_drafter

            self.drafter = build_drafter(self.spec_config, self)
            self.scheduler.on_preempt.append(self.drafter.release)
            if self.drafter.feature_layers is not None:
                self.runner.feature_layers = self.drafter.feature_layers
                self.feature_observers.append(self.drafter.observe)
        self.spec_stats = SpecDecodeStats()
        self.speculation_enabled = True  # False: plain decoding with the same engine

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
        speculate = self.drafter is not None and self.speculation_enabled
        k = self.spec_config.num_speculative_tokens if speculate else 0
        lookahead = self.drafter.max_nodes(k) if speculate else 0
        batch = self.scheduler.schedule(num_lookahead=lookahead)
        if not batch.seqs:
            return []
        proposals = self._propose(batch, k)
        samples = self.drafter.samples_drafts if self.drafter else False
        new_tokens = self.runner.run(batch, proposals, samples)
        if self.drafter:
            spec = [i for i, p in enumerate(proposals) if p is not None]
            self.drafter.on_verified(
                [batch.seqs[i] for i in spec],
                [proposals[i] for i in spec],
                [self.runner.accepted_nodes[i] for i in spec],
            )
        if self.runner.features:
            feats = [self.runner.features[i] for i in range(len(batch))]
            for observe in self.feature_observers:
                observe(batch.seqs, feats)
        updated = []
        for seq, tokens in zip(batch.seqs, new_tokens, strict=True):
            self.manager.truncate(seq.blocks, seq.blocks.length)  # unused lookahead slots
            if tokens is None:
                continue
            self.output.append(seq, tokens)
            if seq.finish_reason is not None:
                self._finish(seq)
            updated.append(seq)
        return updated

    def _propose(self, batch, k: int) -> list[DraftProposal | None]:
        proposals: list[DraftProposal | None] = [None] * len(batch)
        if not self.drafter or not self.speculation_enabled:
            return proposals
        decoding = [
            i
            for i, (s, n) in enumerate(zip(batch.seqs, batch.num_new, strict=True))
            if n == 1 and s.num_uncommitted == 1
        ]
        if not decoding:
            return proposals
        seqs = [batch.seqs[i] for i in decoding]
        budgets = [self._budget(s, k) for s in seqs]
        for i, prop in zip(decoding, self.drafter.propose(seqs, budgets), strict=True):
            proposals[i] = prop if prop.num_drafts > 0 else None
        return proposals

    def _budget(self, seq: Sequence, k: int) -> int:
        """Draft depth worth proposing: none past the context, none past max_tokens."""
        room = self.max_model_len - seq.num_tokens
        if seq.params.max_tokens is not None:
            room = min(room, seq.params.max_tokens - len(seq.output_token_ids) - 1)
        return max(0, min(k, room))

    def _finish(self, seq: Sequence) -> None:
        self.scheduler.finish(seq)
        self.runner.release(seq)
        if self.drafter:
            self.drafter.release(seq)
        self.spec_stats.merge(seq.spec)

    def run_to_completion(self) -> Iterator[list[Sequence]]:
        while self.has_unfinished():
            yield self.step()


def _speculative_config(raw) -> SpeculativeConfig | None:
    if raw is None or isinstance(raw, SpeculativeConfig):
        return raw
    return SpeculativeConfig.from_dict(raw)
