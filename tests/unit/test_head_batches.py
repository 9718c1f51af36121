"""Head-training batches are bounded by their padded size, not only by their real tokens."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from specdecode.train.datagen import Example
from specdecode.train.heads import _Trainer


def test_a_batch_never_pads_past_its_token_budget():
    gen = torch.Generator().manual_seed(0)
    lengths = [int(x) for x in torch.randint(4, 600, (300,), generator=gen)]
    lengths[7] = 900  # longer than max_len: cut to it
    train = [
        Example(str(i), list(range(n + 1)), [1] * (n + 1), torch.zeros(n, 3))
        for i, n in enumerate(lengths)
    ]
    tr = object.__new__(_Trainer)
    tr.cfg = SimpleNamespace(batch_tokens=1024, max_len=640)
    tr.train, tr.gen, tr._order = train, gen, []
    tr.device = torch.device("cpu")
    tr._collate_dtype = torch.float32
    seen, real, padded = 0, 0, 0
    for _ in range(200):
        b = tr.next_batch(extra=2)
        rows, n = b.rows.tolist(), b.feats.shape[1]
        assert len(rows) * n <= 1024 or len(rows) == 1
        assert n == max(rows) <= 640
        seen, real, padded = seen + len(rows), real + sum(rows), padded + len(rows) * n
    assert seen >= len(train)  # every example comes round
    assert real / padded > 0.8  # similar lengths batched together: little padding
