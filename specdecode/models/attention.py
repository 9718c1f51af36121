"""Attention over the paged KV cache, for flattened batches of new tokens.

A step's new tokens from every sequence are flattened into one list of T tokens. Each new token
attends to its sequence's cached prefix plus, among the new tokens of the same sequence, those its
mask allows: the causal triangle for ordinary prefill/decoding, or ancestor-or-self for a token
tree. `AttentionMetadata` carries everything a layer needs; the runner builds it once per step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specdecode.cache import BlockManager, SeqBlocks


@dataclass
class AttentionMetadata:
    kv_cache: torch.Tensor  # [layers, 2, kv_heads, slots, head_dim]
    slot_mapping: torch.Tensor  # [T] slot each new token's k/v is written to
    # Fast path, one sequence whose context sits in consecutive slots: (first, end) slot.
    kv_range: tuple[int, int] | None = None
    # General path (several sequences or a scattered one), padded to the longest:
    kv_slots: torch.Tensor | None = None  # [B, L] slots of each sequence's context
    query_index: torch.Tensor | None = None  # [B, N] index into the T new tokens
    query_valid: torch.Tensor | None = None  # [B, N] bool, False on padding
    mask: torch.Tensor | None = None  # [B, 1, N, L] bool, True = may attend; None = all


def causal_tree_mask(num_new: int) -> torch.Tensor:
    """[n, n] ancestor-or-self mask of a chain: the causal lower triangle."""
    return torch.ones(num_new, num_new, dtype=torch.bool).tril_()


def build_metadata(
    kv_cache: torch.Tensor,
    manager: BlockManager,
    seqs: list[SeqBlocks],
    num_new: list[int],
    tree_masks: list[torch.Tensor | None] | None = None,
) -> AttentionMetadata:
    """Metadata for a step that writes `num_new[i]` tokens after `seqs[i].length` committed ones.

    `tree_masks[i]` ([n_i, n_i] bool, node j may attend node k) replaces the causal triangle for
    sequence i. It may also be [n_i, w] with w > n_i: then it covers the last w indices, the
    w - n_i tokens already written before these (earlier levels of a tree drafted level by
    level) and the new ones. Blocks for the new tokens must already be allocated.
    """
    device = kv_cache.device
    masks = tree_masks or [None] * len(seqs)
    slots = []
    for seq, n in zip(seqs, num_new, strict=True):
        slots += manager.slots(seq, seq.length, seq.length + n)
    slot_mapping = torch.tensor(slots, dtype=torch.long, device=device)
    if len(seqs) == 1:
        seq, n, tree = seqs[0], num_new[0], masks[0]
        rng = manager.contiguous_range(seq, seq.length + n)
        if rng is not None:
            mask = None
            if n > 1 or tree is not None:
                mask = _one_mask(seq.length, n, tree, seq.length + n).to(device)[None, None]
            return AttentionMetadata(kv_cache, slot_mapping, kv_range=rng, mask=mask)
    return _padded_metadata(kv_cache, manager, seqs, num_new, masks, slot_mapping)


def _one_mask(cached: int, n: int, tree: torch.Tensor | None, width: int) -> torch.Tensor:
    """[n, width]: new tokens see the whole prefix, and among the last `tree.shape[1]` indices
    (which end with the n new ones) what `tree` allows."""
    mask = torch.zeros(n, width, dtype=torch.bool)
    if tree is None:
        mask[:, :cached] = True
        mask[:, cached : cached + n] = causal_tree_mask(n)
        return mask
    w = tree.shape[1]
    mask[:, : cached + n - w] = True
    mask[:, cached + n - w : cached + n] = tree
    return mask


def _padded_metadata(kv_cache, manager, seqs, num_new, masks, slot_mapping) -> AttentionMetadata:
    """Batched metadata built with tensor ops, not per sequence and token in Python (which
    halved a tiny model's decoding throughput at 64-256 sequences, where the engine's own work
    is the step)."""
    device, bs = kv_cache.device, manager.block_size
    cached = torch.tensor([s.length for s in seqs], dtype=torch.long)
    new = torch.tensor(num_new, dtype=torch.long)
    ctx = cached + new
    lmax, nmax = int(ctx.max()), int(new.max())
    width = -(-lmax // bs)
    rows = []
    for seq, c in zip(seqs, ctx.tolist(), strict=True):
        used = seq.block_table[: -(-c // bs)]
        rows.append(used + [0] * (width - len(used)))
    pos = torch.arange(lmax)
    kv_slots = torch.tensor(rows, dtype=torch.long)[:, pos // bs] * bs + pos % bs
    kv_slots.masked_fill_(pos[None] >= ctx[:, None], 0)  # padding reads the zeroed block 0
    q = torch.arange(nmax)
    query_valid = q[None] < new[:, None]
    query_index = torch.where(query_valid, (torch.cumsum(new, 0) - new)[:, None] + q[None], 0)
    # each new token sees the prefix and the new tokens up to itself; padded query rows see
    # one key, so softmax stays finite
    mask = pos[None, None] <= (cached[:, None] + q[None])[..., None]
    mask &= query_valid[..., None]
    mask[:, :, 0] |= ~query_valid
    mask = mask[:, None]
    for i, (seq, n, tree) in enumerate(zip(seqs, num_new, masks, strict=True)):
        if tree is not None:
            mask[i, 0, :n, :] = _one_mask(seq.length, n, tree, lmax)
    return AttentionMetadata(
        kv_cache,
        slot_mapping,
        kv_slots=kv_slots.to(device),
        query_index=query_index.to(device),
        query_valid=query_valid.to(device),
        mask=mask.to(device),
    )


def paged_attention(
    q: torch.Tensor,  # [T, H, D] (rotary applied)
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    layer: int,
    meta: AttentionMetadata,
) -> torch.Tensor:  # [T, H * D]
    """Write this step's k/v into the cache, then attend over each sequence's context."""
    cache_k, cache_v = meta.kv_cache[layer, 0], meta.kv_cache[layer, 1]  # [Hkv, S, D]
    cache_k.index_copy_(1, meta.slot_mapping, k.transpose(0, 1))
    cache_v.index_copy_(1, meta.slot_mapping, v.transpose(0, 1))
    t, h, d = q.shape
    if meta.kv_range is not None:
        start, end = meta.kv_range
        keys = cache_k[:, start:end].unsqueeze(0)  # [1, Hkv, L, D]
        values = cache_v[:, start:end].unsqueeze(0)
        query = q.transpose(0, 1).unsqueeze(0)  # [1, H, T, D]
        out = F.scaled_dot_product_attention(
            query, keys, values, attn_mask=meta.mask, enable_gqa=True
        )
        return out[0].transpose(0, 1).reshape(t, h * d)
    keys = cache_k[:, meta.kv_slots].transpose(0, 1)  # [B, Hkv, L, D]
    values = cache_v[:, meta.kv_slots].transpose(0, 1)
    query = q[meta.query_index].transpose(1, 2)  # [B, H, N, D]
    out = F.scaled_dot_product_attention(query, keys, values, attn_mask=meta.mask, enable_gqa=True)
    return out.transpose(1, 2)[meta.query_valid].reshape(t, h * d)
