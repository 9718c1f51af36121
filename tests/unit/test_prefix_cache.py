"""Prefix caching in the block manager: registered full blocks are found by the hash of every
token up to their end, shared by reference count, kept after they are freed until their memory
is needed (plain free blocks first, then the least recently freed), and never past the tokens a
sequence has."""

from __future__ import annotations

from specdecode.cache import BlockManager, SeqBlocks

BS = 4


def computed(m: BlockManager, tokens: list[int]) -> SeqBlocks:
    """A sequence that found what it could, then computed and committed all of `tokens`."""
    seq = SeqBlocks()
    m.match(seq, tokens)
    assert m.allocate(seq, len(tokens))
    seq.length = len(tokens)
    m.register(seq, lambda a, b: tokens[a:b], len(tokens))
    return seq


def test_a_freed_prefix_is_found_and_shared():
    m = BlockManager(10, BS, prefix_caching=True)
    a_tokens = list(range(11))  # two full blocks and 3 tokens
    a = computed(m, a_tokens)
    first_two = a.block_table[:2]
    b = SeqBlocks()
    assert m.match(b, a_tokens[:8] + [99, 98]) == 8  # both full blocks, shared with a
    assert b.block_table == first_two and b.length == 8
    m.free(a)  # b still holds them: not free
    assert not set(first_two) & (m._free | set(m._cached))
    m.free(b)
    c = SeqBlocks()
    assert m.match(c, a_tokens) == 8 and c.block_table == first_two
    d = SeqBlocks()  # the same tokens after a different first block: nothing
    assert m.match(d, [7] + a_tokens[1:]) == 0 and d.block_table == []


def test_peek_finds_what_match_would_and_takes_nothing():
    m = BlockManager(10, BS, prefix_caching=True)
    tokens = list(range(11))
    m.free(computed(m, tokens))
    free = m.num_free_blocks
    assert m.peek(tokens[:8] + [50, 51]) == 8 and m.num_free_blocks == free
    assert m.peek([9] + tokens[1:]) == 0
    assert m.match(SeqBlocks(), tokens[:8] + [50, 51]) == 8


def test_the_last_token_is_always_computed():
    m = BlockManager(10, BS, prefix_caching=True)
    tokens = list(range(8))
    m.free(computed(m, tokens))
    seq = SeqBlocks()
    assert m.match(seq, tokens) == 4  # its logits are needed: the second block is recomputed
    off = BlockManager(10, BS)
    m2 = computed(off, tokens)
    off.free(m2)
    assert off.match(SeqBlocks(), tokens) == 0  # prefix caching off: nothing registered


def test_cached_blocks_are_reused_last_and_oldest_first():
    m = BlockManager(7, BS, prefix_caching=True)  # 6 usable blocks
    a = computed(m, [1] * 8)  # 2 blocks, registered
    b = computed(m, [2] * 8)
    m.free(a)
    m.free(b)  # a's blocks were freed first
    assert m.num_free_blocks == 6
    c = SeqBlocks()
    assert m.allocate(c, 8)  # the two plain free blocks first: both prefixes stay
    again = SeqBlocks()
    assert m.match(again, [1] * 8 + [0]) == 8
    m.free(again)
    m.free(c)
    # a's blocks were taken and freed again: b's are now the oldest freed
    d = SeqBlocks()
    assert m.allocate(d, 4 * BS)  # the 2 plain ones, then b's two cached blocks
    assert m.match(SeqBlocks(), [2] * 8 + [0]) == 0
    assert m.match(SeqBlocks(), [1] * 8 + [0]) == 8


def test_blocks_past_the_tokens_a_sequence_has_are_not_registered():
    """Accepted drafts a stop cut off leave committed keys and values of tokens the sequence
    does not hold: their block must not be findable under other tokens."""
    m = BlockManager(10, BS, prefix_caching=True)
    seq = SeqBlocks()
    assert m.allocate(seq, 8)
    seq.length = 8  # keys and values of 8 positions
    tokens = [5, 6, 7, 8, 9]  # but only 5 tokens were kept
    m.register(seq, lambda a, b: tokens[a:b], len(tokens))
    assert len(seq.hashes) == 1
    m.free(seq)
    assert m.match(SeqBlocks(), tokens + [1, 2, 3, 4]) == 4


def test_truncation_keeps_only_the_hashes_of_kept_blocks():
    m = BlockManager(10, BS, prefix_caching=True)
    tokens = list(range(12))
    seq = computed(m, tokens)
    assert len(seq.hashes) == 3
    m.truncate(seq, 9)
    assert len(seq.hashes) == 2 and len(seq.block_table) == 3


def test_a_freed_prefix_is_evicted_from_its_end():
    """Blocks are freed last first: taking one cached block costs a prefix its last block, not
    its first (which would strand the rest, unreachable)."""
    m = BlockManager(6, BS, prefix_caching=True)  # 5 usable blocks
    tokens = list(range(17))
    m.free(computed(m, tokens))  # 4 full blocks registered and a partial one, all freed
    taker = SeqBlocks()
    assert m.allocate(taker, 2 * BS)  # the plain free block, then one cached block
    assert m.match(SeqBlocks(), tokens) == 12


def test_a_registered_block_cut_inside_is_no_longer_found():
    m = BlockManager(10, BS, prefix_caching=True)
    tokens = list(range(12))
    seq = computed(m, tokens)
    m.truncate(seq, 9)  # the third block will be written again from position 9
    assert m.match(SeqBlocks(), tokens + [0]) == 8


def test_a_request_preempted_in_its_prefill_is_counted_once():
    from specdecode.core import Sequence
    from specdecode.engine.scheduler import Scheduler
    from specdecode.sampling import SamplingParams

    m = BlockManager(20, BS, prefix_caching=True)
    scheduler = Scheduler(m, max_num_batched_tokens=8)
    seq = Sequence(list(range(40)), SamplingParams(max_tokens=4))
    scheduler.add(seq)
    for _ in range(3):  # three chunks of 8, registered as a step would
        batch = scheduler.schedule()
        seq.blocks.length += batch.num_new[0]
        m.register(seq.blocks, seq.token_ids, seq.num_tokens)
    scheduler.preempt(seq)
    batch = scheduler.schedule()  # back: finds its own 24 tokens
    assert seq.blocks.length == 24 and batch.num_new == [8]
    assert seq.num_cached_tokens == 0
    assert (m.prefix_queries, m.prefix_hits) == (40, 0)


def test_a_smaller_draft_tree_takes_no_cached_block():
    """Slots for a tree that did not fit whole come from unused blocks only: a cached prefix is
    worth more than a few more draft nodes."""
    from specdecode.core import Sequence
    from specdecode.engine.scheduler import Scheduler
    from specdecode.sampling import SamplingParams

    m = BlockManager(6, BS, prefix_caching=True)  # 5 usable blocks
    m.free(computed(m, list(range(100, 108))))  # 2 cached blocks
    scheduler = Scheduler(m)
    seq = Sequence(list(range(6)), SamplingParams(max_tokens=9))
    scheduler.add(seq)
    scheduler.schedule(num_lookahead=16)  # prefill: 2 blocks
    seq.blocks.length = 5
    batch = scheduler.schedule(num_lookahead=16)  # 22 slots do not fit in 5 blocks
    assert batch.draft_slots == {seq.seq_id: 6}  # its own 2 blocks + the 1 unused one
    assert m.match(SeqBlocks(), list(range(100, 108)) + [0]) == 8
