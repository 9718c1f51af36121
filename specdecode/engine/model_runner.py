"""Owns every tensor of a step: builds inputs and attention metadata, runs the model, samples."""

from __future__ import annotations

import torch

from specdecode.cache import BlockManager, KVCache
from specdecode.core import Sequence
from specdecode.engine.scheduler import ScheduledBatch
from specdecode.models.attention import build_metadata
from specdecode.models.llama import LlamaModel
from specdecode.sampling import sample, warp


class ModelRunner:
    def __init__(self, model: LlamaModel, cache: KVCache, manager: BlockManager) -> None:
        self.model = model
        self.cache = cache
        self.manager = manager
        self.device = model.norm.weight.device
        self._generators: dict[int, torch.Generator | None] = {}

    def generator(self, seq: Sequence) -> torch.Generator | None:
        if seq.seq_id not in self._generators:
            self._generators[seq.seq_id] = seq.params.make_generator(self.device)
        return self._generators[seq.seq_id]

    def release(self, seq: Sequence) -> None:
        self._generators.pop(seq.seq_id, None)

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> list[int | None]:
        """Feed each sequence its scheduled tokens; return its next token, or None while a
        prompt is still being prefilled in chunks."""
        ids, positions = [], []
        for seq, n in zip(batch.seqs, batch.num_new, strict=True):
            start = seq.blocks.length
            ids += seq.token_ids(start, start + n)
            positions += range(start, start + n)
        meta = build_metadata(
            self.cache.kv, self.manager, [s.blocks for s in batch.seqs], batch.num_new
        )
        out = self.model(
            torch.tensor(ids, device=self.device),
            torch.tensor(positions, device=self.device),
            meta,
        )
        wants = [
            i
            for i, (s, n) in enumerate(zip(batch.seqs, batch.num_new, strict=True))
            if s.blocks.length + n == s.num_tokens
        ]
        last = torch.tensor(batch.num_new, device=self.device).cumsum(0) - 1
        logits = self.model.compute_logits(out.hidden[last[wants]]) if wants else None
        for seq, n in zip(batch.seqs, batch.num_new, strict=True):
            seq.blocks.length += n
        result: list[int | None] = [None] * len(batch)
        for row, i in enumerate(wants):
            result[i] = self._sample(batch.seqs[i], logits[row : row + 1])
        return result

    def _sample(self, seq: Sequence, logits: torch.Tensor) -> int:
        if seq.params.greedy:
            return int(logits.argmax(-1))
        return int(sample(warp(logits, seq.params), self.generator(seq)))
