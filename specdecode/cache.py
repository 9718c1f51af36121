"""Paged KV cache owned by the engine.

Glossary
- slot: one token's keys and values in every layer. Slots are grouped into fixed-size blocks.
- block table: the blocks a sequence owns, in order; logical index i of a sequence lives in slot
  `block_table[i // block_size] * block_size + i % block_size`.
- committed length: how many of the sequence's logical indices hold accepted tokens. A forward may
  write more (a draft tree) past it; `keep_path` then compacts the accepted ones in place.

`BlockManager` is pure bookkeeping (no torch) and is what the scheduler talks to. `KVCache` owns
the tensors and the few copies they need. Memory is bounded by real tokens: a sequence holds
ceil(tokens / block_size) blocks, not max_len.

Prefix caching (automatic, as vLLM's): a full block of committed tokens is registered under a
hash of every token up to its end (sha256, chained block by block). A freed registered block
keeps its keys and values and stays findable until its memory is needed (least recently freed
first, and only once no plain free block is left); a new sequence whose first tokens hash to
registered blocks shares them (reference counts) and computes only the rest. Shared blocks are
full and before the sequence's committed length, which every write lies at or after, so they
are never written again.
"""

from __future__ import annotations

import hashlib
import heapq
import math
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from specdecode.config import ModelConfig


@dataclass
class SeqBlocks:
    """One sequence's share of the cache."""

    block_table: list[int] = field(default_factory=list)
    length: int = 0  # committed tokens whose k/v are valid
    hashes: list[bytes] = field(default_factory=list)  # prefix hash of each full block


class BlockManager:
    """Allocates blocks to sequences. Prefers the block after a sequence's last one, so a lone
    sequence stays contiguous and attention can read it as a view instead of a gather.

    Block 0 is never handed out: it is the zeroed block that padding in a batched attention
    gather points at (so padded keys are finite and masked, never uninitialised memory)."""

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = False) -> None:
        if num_blocks < 2 or block_size < 1:
            raise ValueError("need at least 2 blocks and a positive block size")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: set[int] = set(range(1, num_blocks))  # free and holding nothing findable
        self._heap: list[int] = list(range(1, num_blocks))  # lowest free id first; may hold
        # ids already taken (lazy deletion): `_free` is the truth
        self.prefix_caching = prefix_caching  # match new sequences against registered blocks
        self._refs: dict[int, int] = {}  # block -> sequences holding it (blocks in use)
        self._by_hash: dict[bytes, int] = {}  # registered blocks
        self._hash_of: dict[int, bytes] = {}
        self._cached: OrderedDict[int, None] = OrderedDict()  # free registered blocks, oldest
        # freed first: reused only when `_free` is empty
        self.prefix_queries = 0  # prompt tokens looked up, and found (vLLM's hit-rate counters)
        self.prefix_hits = 0

    @property
    def capacity_tokens(self) -> int:
        return (self.num_blocks - 1) * self.block_size

    @property
    def num_free_blocks(self) -> int:
        return len(self._free) + len(self._cached)

    @property
    def num_unused_blocks(self) -> int:
        """Free blocks that hold nothing findable: taking one costs the prefix cache nothing."""
        return len(self._free)

    def blocks_needed(self, seq: SeqBlocks, total_len: int) -> int:
        have = len(seq.block_table)
        return max(0, -(-total_len // self.block_size) - have)

    def can_allocate(self, seq: SeqBlocks, total_len: int) -> bool:
        return self.blocks_needed(seq, total_len) <= self.num_free_blocks

    def allocate(self, seq: SeqBlocks, total_len: int) -> bool:
        """Grow `seq` to hold `total_len` logical indices; False, unchanged, if out of blocks."""
        need = self.blocks_needed(seq, total_len)
        if need > self.num_free_blocks:
            return False
        for _ in range(need):
            want = seq.block_table[-1] + 1 if seq.block_table else None
            if want in self._free:
                block = want
            elif self._free:
                block = self._pop_lowest()
            else:  # only registered blocks are left: the least recently freed is forgotten
                block, _ = self._cached.popitem(last=False)
                del self._by_hash[self._hash_of.pop(block)]
            self._free.discard(block)
            self._refs[block] = 1
            seq.block_table.append(block)
        return True

    def _pop_lowest(self) -> int:
        while True:
            block = heapq.heappop(self._heap)
            if block in self._free:
                return block

    def _release(self, blocks: list[int]) -> None:
        for b in blocks:
            refs = self._refs.get(b, 0) - 1
            if refs > 0:  # another sequence still holds it
                self._refs[b] = refs
                continue
            if refs < 0:  # not held (released twice): nothing to do
                continue
            del self._refs[b]
            if b in self._hash_of:
                self._cached[b] = None  # findable until its memory is needed
            else:
                self._free.add(b)
                heapq.heappush(self._heap, b)
        # a block taken as the one after its sequence's last leaves its entry behind: rebuilt
        # from the truth before stale entries pile up (a server runs many requests)
        if len(self._heap) > 2 * len(self._free) + 64:
            self._heap = sorted(self._free)

    def truncate(self, seq: SeqBlocks, length: int) -> None:
        """Drop tokens past `length` and return blocks no longer needed."""
        seq.length = min(seq.length, length)
        keep = -(-length // self.block_size)
        self._release(seq.block_table[keep:])
        del seq.block_table[keep:]
        full = seq.length // self.block_size
        if len(seq.hashes) > full and keep > full:  # a registered block cut inside: it will be
            block = seq.block_table[full]  # written again, so no later sequence may find it
            if self._refs.get(block, 0) > 1:
                raise RuntimeError("a block shared through the prefix cache cannot be cut")
            if self._hash_of.get(block) == seq.hashes[full]:
                del self._by_hash[self._hash_of.pop(block)]
        del seq.hashes[full:]

    def free(self, seq: SeqBlocks) -> None:
        # last block first: a prefix is evicted from its end, and what stays findable is still
        # reached from its first block (a lost first block would strand all the others)
        self._release(seq.block_table[::-1])
        seq.block_table.clear()
        seq.hashes.clear()
        seq.length = 0

    # ---- prefix caching ------------------------------------------------------------------------

    @staticmethod
    def chain(previous: bytes, tokens: list[int]) -> bytes:
        """The hash of a block of `tokens` after the blocks hashed to `previous`."""
        return hashlib.sha256(previous + array("q", tokens).tobytes()).digest()

    def match(
        self,
        seq: SeqBlocks,
        token_ids: list[int],
        start: bytes = b"",
        max_blocks: int | None = None,
    ) -> int:
        """An empty `seq` takes the registered blocks its first tokens hash to (leaving at least
        its last token to compute: its logits are needed), at most `max_blocks` (then the last
        token may be found too). `start`: what the chain starts from. Returns the tokens found."""
        if seq.block_table:
            return 0
        for h, block in self._registered(token_ids, start, max_blocks):
            if block in self._cached:
                del self._cached[block]
            self._refs[block] = self._refs.get(block, 0) + 1
            seq.block_table.append(block)
            seq.hashes.append(h)
        seq.length = len(seq.block_table) * self.block_size
        return seq.length

    def peek(self, token_ids: list[int]) -> int:
        """The tokens `match` would find for these, taking nothing."""
        return len(list(self._registered(token_ids))) * self.block_size

    def _registered(self, token_ids: list[int], start: bytes = b"", max_blocks: int | None = None):
        """(hash, block) of the registered blocks `token_ids` begin with, in order (see
        `match` for what is looked up)."""
        if not self.prefix_caching:
            return
        bs, previous = self.block_size, start
        if max_blocks is None:
            count = (len(token_ids) - 1) // bs
        else:
            count = min(len(token_ids) // bs, max_blocks)
        for i in range(count):
            previous = self.chain(previous, token_ids[i * bs : (i + 1) * bs])
            block = self._by_hash.get(previous)
            if block is None:
                return
            yield previous, block

    def register(self, seq: SeqBlocks, token_ids, num_tokens: int, start: bytes = b"") -> None:
        """Register `seq`'s full blocks of committed tokens that are not yet, so later sequences
        starting with the same tokens share them. `token_ids(start, end)` gives its tokens, of
        which it has `num_tokens` (a block past them, e.g. accepted drafts a stop cut off, holds
        keys and values of tokens it does not have: never registered)."""
        if not self.prefix_caching:
            return
        bs = self.block_size
        while len(seq.hashes) < min(seq.length, num_tokens) // bs:
            i = len(seq.hashes)
            previous = seq.hashes[-1] if seq.hashes else start
            h = self.chain(previous, token_ids(i * bs, (i + 1) * bs))
            seq.hashes.append(h)
            block = seq.block_table[i]
            if h not in self._by_hash and block not in self._hash_of:
                self._by_hash[h] = block
                self._hash_of[block] = h

    def slots(self, seq: SeqBlocks, start: int, end: int) -> list[int]:
        """Cache slots of logical indices [start, end)."""
        bs, table = self.block_size, seq.block_table
        return [table[i // bs] * bs + i % bs for i in range(start, end)]

    def contiguous_range(self, seq: SeqBlocks, end: int) -> tuple[int, int] | None:
        """(first_slot, first_slot + end) if indices [0, end) sit in consecutive slots."""
        n = -(-end // self.block_size)
        table = seq.block_table
        if n == 0 or any(table[i + 1] != table[i] + 1 for i in range(n - 1)):
            return None
        start = table[0] * self.block_size
        return start, start + end


class KVCache:
    """Preallocated keys and values: `kv[layer, 0 | 1, kv_head, slot, head_dim]`."""

    def __init__(
        self,
        config: ModelConfig,
        num_blocks: int,
        block_size: int = 16,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        self.block_size = block_size
        self.num_slots = num_blocks * block_size
        # `empty`: on a CPU, pages are committed by the OS only when tokens are written, so
        # resident memory follows real tokens; a GPU allocates the whole budget here. Block 0
        # (the padding target) is zeroed.
        shape = (config.num_layers, 2, config.num_kv_heads, self.num_slots, config.head_dim)
        try:
            self.kv = torch.empty(shape, dtype=dtype, device=device)
        except torch.OutOfMemoryError as e:
            from specdecode.errors import InvalidRequestError

            need = math.prod(shape) * dtype.itemsize / 2**30
            raise InvalidRequestError(
                f"the KV cache's {need:.1f} GiB do not fit on {device}: lower --kv-cache-memory-gb",
                param="kv_cache_memory_gb",
            ) from e
        self.kv[:, :, :, :block_size].zero_()

    @staticmethod
    def num_blocks_for(
        config: ModelConfig, dtype: torch.dtype, memory_gb: float, block_size: int
    ) -> int:
        """Blocks that fit a budget of `memory_gb` (at least 2: one reserved, one usable)."""
        per_block = KVCache.bytes_per_token(config, dtype) * block_size
        return max(2, int(memory_gb * 2**30 / per_block))

    @staticmethod
    def bytes_per_token(config: ModelConfig, dtype: torch.dtype) -> int:
        itemsize = torch.empty((), dtype=dtype).element_size()
        return config.num_layers * 2 * config.num_kv_heads * config.head_dim * itemsize

    def move(self, src_slots: list[int], dst_slots: list[int]) -> None:
        """Copy every layer's k/v from `src_slots` to `dst_slots` (used to compact a tree path)."""
        pairs = [(s, d) for s, d in zip(src_slots, dst_slots, strict=True) if s != d]
        if not pairs:
            return
        dev = self.kv.device
        src = torch.tensor([s for s, _ in pairs], dtype=torch.long, device=dev)
        dst = torch.tensor([d for _, d in pairs], dtype=torch.long, device=dev)
        # Gather first, then scatter: a path only moves entries to lower indices, but a gather makes
        # overlapping source/destination sets safe regardless.
        self.kv.index_copy_(3, dst, self.kv.index_select(3, src))


def keep_path(manager: BlockManager, cache: KVCache, seq: SeqBlocks, path: list[int]) -> None:
    """After a forward that wrote n draft nodes at logical indices [L, L + n) of `seq`, keep the
    nodes `path` (node indices in the flattened tree, root first) as indices L, L+1, ... and discard
    the rest. `seq.length` must still be L; it becomes L + len(path)."""
    base = seq.length
    written = manager.slots(seq, base, base + max(path, default=-1) + 1)
    src = [written[i] for i in path]
    dst = written[: len(path)]
    cache.move(src, dst)
    seq.length = base + len(path)
    manager.truncate(seq, seq.length)
