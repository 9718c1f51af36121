"""Logits processors that read what a request has generated: logit bias, the OpenAI presence and
frequency penalties, vLLM's repetition penalty and min_tokens.

They change the target distribution p of every row the step computes, plain or draft node, as
if the row had been decoded on its own: a draft node's history is the request's tokens plus the
drafts on the path from the root to the node. So speculation stays lossless under them (the
drafters' q need not see them: verification corrects for any q). The drafters apply them too
(`apply` over their own vocabulary's columns), so their drafts follow the penalised target and
are accepted as often as without penalties. Semantics follow vLLM:
- logit_bias: added to the named tokens' logits;
- presence / frequency penalty: subtracted once per token present / per occurrence, counting
  the generated tokens only;
- repetition penalty (CTRL, as in Hugging Face and vLLM): a logit of a token in the prompt or
  the output is divided by it when positive, multiplied when negative;
- min_tokens: the stop tokens (EOS unless ignore_eos, and stop_token_ids) are masked until that
  many tokens were generated; applied after any grammar mask, and never to a row they would
  leave empty.
"""

from __future__ import annotations

from collections import Counter

import torch

from specdecode.core import Sequence
from specdecode.sampling import SamplingParams


def has_penalties(params: SamplingParams) -> bool:
    """Whether `apply` changes this request's logits."""
    return bool(
        params.logit_bias
        or params.presence_penalty
        or params.frequency_penalty
        or params.repetition_penalty != 1.0
    )


def paths(parents: tuple[int, ...], tokens: list[int]) -> list[list[int]]:
    """Per node of a draft tree: the draft tokens from the root (excluded) to the node, in order:
    what follows the request's tokens when the node's row is computed."""
    out: list[list[int]] = []
    for i, p in enumerate(parents):
        out.append([] if p < 0 else [*out[p], tokens[i]])
    return out


class _History:
    """What a request's penalties read, kept up to date incrementally (a long prompt is not
    re-scanned every step): the tokens seen in the prompt and output, the output's counts."""

    def __init__(self, seq: Sequence) -> None:
        self.seen = set(seq.prompt_token_ids)
        self.counts: Counter[int] = Counter()
        self.num_counted = 0

    def update(self, seq: Sequence) -> None:
        new = seq.output_token_ids[self.num_counted :]
        self.counts.update(new)
        self.seen.update(new)
        self.num_counted = len(seq.output_token_ids)


def columns_of(vocab_ids: torch.Tensor | None, vocab_size: int) -> torch.Tensor | None:
    """For logits over a draft vocabulary (`vocab_ids` [Vd]: column -> target token): target
    token -> its column, -1 for tokens the draft vocabulary lacks (None: the full vocabulary)."""
    if vocab_ids is None:
        return None
    ids = vocab_ids.cpu()  # looked up on the CPU: no device sync per lookup
    cols = torch.full((vocab_size,), -1, dtype=torch.long)
    cols[ids] = torch.arange(ids.shape[0])
    return cols


def apply(
    rows: torch.Tensor,
    seq: Sequence,
    histories: list[list[int]],
    columns: torch.Tensor | None = None,
) -> None:
    """Bias and penalise `rows` [n, V] in place; `histories[r]`: the tokens after the request's
    own that row r follows (draft nodes; [] for a plain row). Only the logits of tokens the
    request has seen are touched (no pass over the vocabulary). `columns` (`columns_of`): rows
    over a draft vocabulary, whose column for a token is `columns[token]` (-1: none)."""
    params = seq.params
    device = rows.device
    if seq.penalty_history is None:
        seq.penalty_history = _History(seq)
    hist = seq.penalty_history
    hist.update(seq)

    def at(tokens: list[int], values: list[float] | None = None):
        """(columns, values) of these tokens, those the rows have, on the rows' device."""
        if columns is not None:  # (a CPU table: `columns_of`)
            n = columns.shape[0]
            cols = columns[torch.tensor([t if t < n else 0 for t in tokens])].tolist()
            pairs = enumerate(zip(tokens, cols, strict=True))
            kept = [i for i, (t, c) in pairs if t < n and c >= 0]
            tokens = [cols[i] for i in kept]
            values = None if values is None else [values[i] for i in kept]
        ids = torch.tensor(tokens, dtype=torch.long, device=device)
        vals = None if values is None else torch.tensor(values, dtype=rows.dtype, device=device)
        return ids, vals

    if params.logit_bias:
        ids, bias = at(list(params.logit_bias), list(params.logit_bias.values()))
        rows[:, ids] += bias
    rp = params.repetition_penalty
    if rp != 1.0:

        def repeat(values: torch.Tensor) -> torch.Tensor:
            return torch.where(values > 0, values / rp, values * rp)

        if hist.seen:
            ids, _ = at(sorted(hist.seen))
            rows[:, ids] = repeat(rows[:, ids])
        for r, extra in enumerate(histories):  # the path's tokens not seen before, once each
            new = sorted(set(extra) - hist.seen)
            if new:
                ids, _ = at(new)
                rows[r, ids] = repeat(rows[r, ids])
    pres, freq = params.presence_penalty, params.frequency_penalty
    if pres or freq:
        # Each row subtracts freq * count + pres once, from the counts of the output and its
        # path together: the same arithmetic, bit for bit, as the plain row decoding that
        # position would compute once the path is output (two subtractions round differently).
        plain = [r for r, extra in enumerate(histories) if not extra]
        if hist.counts and plain:
            ids, n = at(list(hist.counts), list(hist.counts.values()))
            sel = torch.tensor(plain, device=device)[:, None]
            rows[sel, ids[None]] -= freq * n + pres
        for r, extra in enumerate(histories):
            if extra:
                counts = hist.counts + Counter(extra)
                ids, n = at(list(counts), list(counts.values()))
                rows[r, ids] -= freq * n + pres


def mask_stops(rows: torch.Tensor, seq: Sequence, depths: list[int], stop_ids: set[int]) -> None:
    """min_tokens: in place, mask the stop tokens in each row whose token would be generated
    before the request has `min_tokens` (row r follows `depths[r]` drafts), unless nothing else
    is left in that row."""
    params = seq.params
    done = len(seq.output_token_ids)
    ids = sorted(set(params.stop_token_ids) | (set() if params.ignore_eos else stop_ids))
    ids = [t for t in ids if t < rows.shape[-1]]
    if not ids:
        return
    index = torch.tensor(ids, device=rows.device)
    for r, d in enumerate(depths):
        if done + d >= params.min_tokens:
            continue
        row = rows[r]
        keep = torch.isfinite(row)
        keep[index] = False
        if keep.any():
            row[index] = float("-inf")
