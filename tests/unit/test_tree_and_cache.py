"""Token-tree forwards and cache compaction on a tiny model, against plain sequential decoding."""

from __future__ import annotations

import pytest
import torch
from helpers import PARENTS, Runner, ancestor_mask, depth, path_to

from specdecode.cache import BlockManager, KVCache, SeqBlocks, keep_path
from specdecode.models.fast import accelerate
from specdecode.models.loader import load_model

ATOL = 1e-4
TOKENS = [11, 12, 13, 14, 15, 16]


@pytest.fixture(scope="module", params=["eager", "fast"])
def model(tiny_llama_dir, request):
    m = load_model(tiny_llama_dir).model
    if request.param == "fast" and not accelerate(m):
        pytest.skip("CPU kernels unavailable here")
    return m


def test_ancestor_mask_is_the_hand_drawn_one():
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0],
            [1, 0, 1, 0, 0, 0],
            [1, 1, 0, 1, 0, 0],
            [1, 1, 0, 0, 1, 0],
            [1, 0, 1, 0, 0, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(ancestor_mask(PARENTS), expected)


@pytest.mark.parametrize("batched", [False, True])
def test_tree_forward_equals_sequential_paths(model, batched):
    prefix = list(range(20, 33))
    r = Runner(model)
    s = r.new_seq()
    r.feed([s], [prefix])
    L = s.length
    positions = [L + depth(PARENTS, i) for i in range(len(PARENTS))]
    if batched:  # a second sequence decoding a chain in the same forward
        other = r.new_seq()
        r.feed([other], [list(range(40, 45))])
        tree_logits, _ = r.feed(
            [s, other],
            [TOKENS, [46, 47]],
            positions=[positions, [5, 6]],
            trees=[ancestor_mask(PARENTS), None],
            commit=False,
        )
    else:
        (tree_logits,) = r.feed(
            [s], [TOKENS], positions=[positions], trees=[ancestor_mask(PARENTS)], commit=False
        )
    for leaf in (3, 4, 5):
        path = path_to(PARENTS, leaf)
        ref = Runner(model)
        t = ref.new_seq()
        (seq_logits,) = ref.feed([t], [prefix + [TOKENS[i] for i in path]])
        torch.testing.assert_close(tree_logits[path], seq_logits[L:], atol=ATOL, rtol=0)


@pytest.mark.parametrize("accepted_leaf", [0, 3, 4, 5])
def test_keep_path_compaction_equals_recomputation(model, accepted_leaf):
    """After a tree forward, keep one root-to-leaf path; the next token's logits must equal those
    of a cache that only ever saw the prefix plus that path."""
    prefix = list(range(20, 31))
    r = Runner(model, block_size=4)
    s = r.new_seq()
    r.feed([s], [prefix])
    L = s.length
    positions = [L + depth(PARENTS, i) for i in range(len(PARENTS))]
    r.feed([s], [TOKENS], positions=[positions], trees=[ancestor_mask(PARENTS)], commit=False)
    path = path_to(PARENTS, accepted_leaf)
    keep_path(r.manager, r.cache, s, path)
    assert s.length == L + len(path)
    assert len(s.block_table) == -(-s.length // 4)  # blocks past the path are returned
    (after,) = r.feed([s], [[77, 78]])
    ref = Runner(model)
    t = ref.new_seq()
    (want,) = ref.feed([t], [prefix + [TOKENS[i] for i in path] + [77, 78]])
    torch.testing.assert_close(after, want[-2:], atol=ATOL, rtol=0)


def test_block_manager_accounting():
    m = BlockManager(num_blocks=9, block_size=4)  # block 0 is reserved: 8 usable
    a, b = SeqBlocks(), SeqBlocks()
    assert m.capacity_tokens == 32
    assert m.allocate(a, 10) and len(a.block_table) == 3
    assert m.allocate(b, 16) and m.num_free_blocks == 1
    assert not m.allocate(a, 17)  # needs 2 more, 1 free: refused, unchanged
    assert len(a.block_table) == 3
    assert m.contiguous_range(a, 10) == (4, 14)
    m.truncate(b, 5)
    assert len(b.block_table) == 2 and m.num_free_blocks == 3
    m.free(a)
    m.free(b)
    assert m.num_free_blocks == 8 and 0 not in m._free


def test_scattered_blocks_use_the_gather_path(model):
    """Interleaved growth leaves a sequence non-contiguous; results must not change."""
    r = Runner(model, block_size=2)
    a, b = r.new_seq(), r.new_seq()
    ids = list(range(30, 45))
    for i in range(0, len(ids), 2):  # a and b alternate block allocations
        r.feed([a], [ids[i : i + 2]])
        r.feed([b], [ids[i : i + 2]])
    assert r.manager.contiguous_range(a, a.length) is None
    (la,) = r.feed([a], [[50]])
    ref = Runner(model)
    t = ref.new_seq()
    (want,) = ref.feed([t], [ids + [50]])
    torch.testing.assert_close(la, want[-1:], atol=ATOL, rtol=0)


def test_kv_cache_memory_follows_tokens():
    from specdecode.config import ModelConfig

    cfg = ModelConfig("llama", 128, 64, 128, 2, 4, 2, 16, 1e-6, 256, False, False, False)
    per_token = KVCache.bytes_per_token(cfg, torch.float32)
    assert per_token == 2 * 2 * 2 * 16 * 4


def test_a_kv_cache_that_does_not_fit_on_the_device_names_its_flag(monkeypatch):
    """A GPU allocates the whole budget at start-up: out of memory there is a clear error that
    names the flag to lower, not CUDA's."""
    from specdecode.config import ModelConfig
    from specdecode.errors import InvalidRequestError

    def oom(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory")

    cfg = ModelConfig("llama", 128, 64, 128, 2, 4, 2, 16, 1e-6, 256, False, False, False)
    monkeypatch.setattr(torch, "empty", oom)
    with pytest.raises(InvalidRequestError, match="--kv-cache-memory-gb") as e:
        KVCache(cfg, num_blocks=1 << 20)  # 16 Mi tokens of 512 bytes
    assert "8.0 GiB" in str(e.value) and e.value.param == "kv_cache_memory_gb"


def test_the_free_heap_stays_bounded_over_many_steps():
    """Each decoding step reserves room for its drafts and gives back what was not kept; the
    next-block preference leaves stale heap entries, which must not pile up without end."""
    m = BlockManager(num_blocks=300, block_size=4)  # 10 x 27 blocks at most
    seqs = [SeqBlocks() for _ in range(10)]
    for step in range(20_000):
        seq = seqs[step % len(seqs)]
        if seq.length >= 100:
            m.free(seq)
        seq.length += 1
        assert m.allocate(seq, seq.length + 6)  # the step's drafts
        m.truncate(seq, seq.length)  # rejected: their blocks back
        assert len(m._heap) <= 2 * m.num_free_blocks + 64 + 6
    for seq in seqs:
        m.free(seq)
    assert m.num_free_blocks == 299
    got = [m._pop_lowest() for _ in range(3)]
    assert got == [1, 2, 3]


def test_draft_trees_give_way_before_a_request_is_preempted():
    """Three blocks of 4 slots: A (3 cached + 1 new token) took a tree's block, and B (4 cached +
    1 new) needs a block for its token. A's tree gives way, nobody is preempted, and neither
    drafts this step but for the 3 slots left in B's new block; with room again, A gets its
    whole tree back."""
    from specdecode.core import Sequence
    from specdecode.engine.scheduler import Scheduler
    from specdecode.sampling import SamplingParams

    manager = BlockManager(4, 4)
    scheduler = Scheduler(manager)
    a, b = (
        Sequence(seq_id=i, prompt_token_ids=list(range(n)), params=SamplingParams(max_tokens=50))
        for i, n in ((0, 4), (1, 5))
    )
    for seq in (a, b):
        scheduler.add(seq)
    batch = scheduler.schedule(num_lookahead=4)  # prefill
    for seq, n in zip(batch.seqs, batch.num_new, strict=True):
        seq.blocks.length += n - 1  # as after a step: all but the last token cached
        manager.truncate(seq.blocks, seq.blocks.length)
    batch = scheduler.schedule(num_lookahead=4)
    assert [s.seq_id for s in batch.seqs] == [0, 1] and batch.num_new == [1, 1]
    assert scheduler.num_preemptions == 0 and batch.draft_slots == {0: 0, 1: 3}
    assert manager.num_free_blocks == 0 and len(a.blocks.block_table) == 1
    scheduler.finish(b)
    batch = scheduler.schedule(num_lookahead=4)
    assert batch.draft_slots == {0: 4} and len(a.blocks.block_table) == 2


def test_a_draft_tree_takes_the_slots_the_cache_has():
    """Three blocks of 4 slots, one sequence of 5 cached tokens decoding: a 8-slot tree does not
    fit, the 6 slots the free block and its own hold do; a tree that fits is held whole."""
    from specdecode.core import Sequence
    from specdecode.engine.scheduler import Scheduler
    from specdecode.sampling import SamplingParams

    manager = BlockManager(4, 4)
    scheduler = Scheduler(manager)
    a = Sequence(seq_id=0, prompt_token_ids=list(range(6)), params=SamplingParams(max_tokens=9))
    scheduler.add(a)
    scheduler.schedule(num_lookahead=8)  # prefill
    a.blocks.length = 5
    batch = scheduler.schedule(num_lookahead=8)
    assert batch.draft_slots == {0: 6} and manager.num_free_blocks == 0
    manager.truncate(a.blocks, a.blocks.length)
    batch = scheduler.schedule(num_lookahead=2)
    assert batch.draft_slots == {0: 2} and len(a.blocks.block_table) == 2


def test_a_waiting_request_is_admitted_before_a_tree_takes_the_rest():
    """Four blocks of 4 slots: A (5 cached + 1 new) wants 12 draft slots, which do not fit. B's
    prompt is admitted first; A's tree takes the block left (6 slots), not B's."""
    from specdecode.core import Sequence
    from specdecode.engine.scheduler import Scheduler
    from specdecode.sampling import SamplingParams

    manager = BlockManager(5, 4)
    scheduler = Scheduler(manager)
    a, b = (
        Sequence(seq_id=i, prompt_token_ids=list(range(n)), params=SamplingParams(max_tokens=9))
        for i, n in ((0, 6), (1, 4))
    )
    scheduler.add(a)
    scheduler.schedule(num_lookahead=12)  # prefill
    a.blocks.length = 5
    scheduler.add(b)
    batch = scheduler.schedule(num_lookahead=12)
    assert [s.seq_id for s in batch.seqs] == [0, 1] and batch.num_new == [1, 4]
    assert batch.draft_slots == {0: 6} and manager.num_free_blocks == 0


def test_priority_policy_orders_the_queue_and_preempts_the_last_in_its_order():
    """Priority scheduling (vLLM's): the queue in order of priority (lower first), then
    arrival, for new and preempted requests alike; when the cache is short, the running request
    last in that order is preempted, even one already placed this step (its place given back:
    the budget and the batch no longer hold it). FCFS keeps arrival order, and preempts the
    latest admitted."""
    from specdecode.core import Sequence
    from specdecode.engine.scheduler import Scheduler
    from specdecode.sampling import SamplingParams

    def seqs(*specs):
        return [Sequence(seq_id=i, prompt_token_ids=list(range(n)), priority=p,
                         params=SamplingParams(max_tokens=50)) for i, n, p in specs]  # fmt: skip

    for policy, order in (("priority", [2, 0, 3, 1]), ("fcfs", [0, 1, 2, 3])):
        scheduler = Scheduler(BlockManager(64, 4), max_num_seqs=1, policy=policy)
        for seq in seqs((0, 3, 0), (1, 3, 5), (2, 3, -1), (3, 3, 0)):
            scheduler.add(seq)
        assert [s.seq_id for s in scheduler.waiting] == order
        scheduler.waiting.rotate(1)  # (refilled by hand, as the culprit search does)
        scheduler.reorder()
        assert [s.seq_id for s in scheduler.waiting] == (order if policy == "priority"
                                                         else [3, 0, 1, 2])  # fmt: skip
    # three blocks of 4 slots: A (priority 5, 3 tokens) and B (priority 0, 9 tokens) running,
    # A first; A's next token fits its block, B's needs a third: A, placed first, gives way
    manager = BlockManager(4, 4)
    scheduler = Scheduler(manager, policy="priority")
    a, b = seqs((0, 3, 5), (1, 8, 0))
    b.output_token_ids.append(7)
    for seq in (a, b):
        manager.allocate(seq.blocks, seq.num_tokens - 1)
        seq.blocks.length = seq.num_tokens - 1  # all but the last token cached
        scheduler.running.append(seq)
    assert manager.num_free_blocks == 0
    batch = scheduler.schedule()
    assert batch.seqs == [b] and batch.num_new == [1] and scheduler.num_preemptions == 1
    assert list(scheduler.waiting) == [a] and a.blocks.block_table == []
    c = seqs((2, 3, 1))[0]
    scheduler.add(c)  # priority 1 goes before A's 5, though A came first
    assert [s.seq_id for s in scheduler.waiting] == [2, 0]


def _reference_metadata(manager, seqs, num_new, masks):
    """Batched metadata built per sequence and token, the plainest way."""
    from specdecode.models.attention import _one_mask

    b = len(seqs)
    lmax = max(s.length + n for s, n in zip(seqs, num_new, strict=True))
    nmax = max(num_new)
    kv_slots = torch.zeros(b, lmax, dtype=torch.long)
    query_index = torch.zeros(b, nmax, dtype=torch.long)
    query_valid = torch.zeros(b, nmax, dtype=torch.bool)
    mask = torch.zeros(b, 1, nmax, lmax, dtype=torch.bool)
    mask[:, :, :, 0] = True
    offset = 0
    for i, (seq, n, tree) in enumerate(zip(seqs, num_new, masks, strict=True)):
        ctx = seq.length + n
        kv_slots[i, :ctx] = torch.tensor(manager.slots(seq, 0, ctx), dtype=torch.long)
        query_index[i, :n] = torch.arange(offset, offset + n)
        query_valid[i, :n] = True
        mask[i, 0, :n, :] = _one_mask(seq.length, n, tree, lmax)
        offset += n
    return kv_slots, query_index, query_valid, mask


def test_batched_metadata_matches_a_per_sequence_build():
    """The vectorised batch metadata equals the per-sequence build: scattered block tables
    with spare lookahead blocks, rows with no new token, tree masks reaching back over tokens
    written earlier, padded query rows that see key 0 only."""
    import random

    from specdecode.models.attention import _padded_metadata

    rng = random.Random(0)
    for _ in range(200):
        bs = rng.choice([1, 2, 4, 16])
        manager = BlockManager(600, bs)
        seqs, nums, trees = [], [], []
        for _ in range(rng.randint(2, 6)):
            s = SeqBlocks()
            cached, n = rng.randint(0, 40), rng.randint(0, 6)
            extra = rng.randint(0, 2 * bs)  # lookahead blocks past the context
            assert manager.allocate(s, cached + n + extra)
            s.length = cached
            rng.shuffle(s.block_table)  # scattered
            tree = None
            if n and rng.random() < 0.4:
                w = rng.randint(n, min(cached + n, n + 6))
                tree = (
                    torch.rand(n, w, generator=torch.Generator().manual_seed(rng.randint(0, 99)))
                    < 0.5
                )
            seqs.append(s), nums.append(n), trees.append(tree)
        if max(nums) == 0:
            continue
        got = _padded_metadata(torch.zeros(1), manager, seqs, nums, trees, None)
        want = _reference_metadata(manager, seqs, nums, trees)
        for name, w in zip(("kv_slots", "query_index", "query_valid", "mask"), want, strict=True):
            g = getattr(got, name)
            assert g.dtype == w.dtype and torch.equal(g, w), name
