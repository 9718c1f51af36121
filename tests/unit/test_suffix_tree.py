"""Suffix decoding's pieces on hand-checked cases: the frequency tree, the corpus (FIFO eviction,
token cap, compaction), match lengths, the length caps and the choice between the two sources."""

from __future__ import annotations

import numpy as np
import pytest

from specdecode.drafters.suffix import (
    SEP,
    KeyIndex,
    SuffixCorpus,
    SuffixDrafter,
    continuations,
    frequency_tree,
    match_lengths,
)


def arr(xs) -> np.ndarray:
    return np.asarray(xs, dtype=np.int64)


ROWS = arr([[5, 6, 7], [5, 6, 8], [5, 9, SEP], [4, SEP, SEP]])


def test_frequency_tree_keeps_the_likeliest_paths_in_level_order():
    # shares: 5 3/4, 5-6 2/4, then 4, 5-9, 5-6-7, 5-6-8 at 1/4 each (ties: shallower first)
    parents, tokens, probs = frequency_tree(ROWS, min_prob=0.2, size=3)
    assert tokens[1:] == [4, 5, 6] and parents == [-1, 0, 0, 2]
    assert probs[1:] == [0.25, 0.75, 0.5]
    parents, tokens, _ = frequency_tree(ROWS, min_prob=0.2, size=10)
    assert tokens[1:] == [4, 5, 6, 9, 7, 8] and parents == [-1, 0, 0, 2, 2, 3, 3]


def test_frequency_tree_drops_rare_continuations():
    parents, tokens, probs = frequency_tree(ROWS, min_prob=0.3, size=10)
    assert tokens[1:] == [5, 6] and parents == [-1, 0, 1] and probs[1:] == [0.75, 0.5]
    assert frequency_tree(ROWS[:0], 0.1, 5)[0] == [-1]


def test_continuations_stop_at_an_answer_end():
    source = arr([1, 2, 3, SEP, 7, 8])
    got = continuations(source, arr([1, 4, 5]), 3)
    assert got[0].tolist() == [2, 3, SEP]
    assert got[1].tolist() == [7, 8, SEP]  # past the source's end
    assert got[2].tolist() == [8, SEP, SEP]


def test_match_lengths_extend_backwards_until_a_mismatch():
    source = arr([9, 1, 2, 3, 4, 5, SEP, 2, 3, 4, 6])
    context = arr([0, 1, 2, 3, 4])  # suffix (3, 4) matched at continuation starts 5 and 10
    assert match_lengths(source, arr([5, 10]), context, limit=10).tolist() == [4, 3]
    assert match_lengths(source, arr([5, 10]), context, limit=3).tolist() == [3, 3]


def reference_tree(rows: list[list[int]], min_prob: float, size: int):
    """frequency_tree by its definition: count every path prefix (up to the first SEP); keep
    those with a share >= min_prob; number them level by level, by parent then token; take the
    `size` likeliest (ties: shallower, then first numbered), in that order."""
    counts: dict[tuple, int] = {}
    for row in rows:
        path: tuple = ()
        for t in row:
            if t == SEP:
                break
            path += (t,)
            counts[path] = counts.get(path, 0) + 1
    kept = [p for p, c in counts.items() if c / len(rows) >= min_prob]
    order = sorted(kept, key=lambda p: (len(p), p))  # by level, then by parent's path, token
    prob = {p: counts[p] / len(rows) for p in order}
    chosen = sorted(order, key=lambda p: (-prob[p], len(p), order.index(p)))[:size]
    chosen.sort(key=order.index)
    index = {(): 0} | {p: n + 1 for n, p in enumerate(chosen)}
    return (
        [-1] + [index[p[:-1]] for p in chosen],
        [SEP] + [p[-1] for p in chosen],
        [1.0] + [prob[p] for p in chosen],
    )


def test_frequency_tree_and_match_lengths_match_their_definitions():
    rnd = np.random.default_rng(0)
    for _ in range(2000):
        n, depth, vocab = rnd.integers(1, 30), rnd.integers(1, 7), rnd.integers(1, 5)
        rows = rnd.integers(0, vocab, size=(n, depth))
        for r in range(n):  # answers that end (SEP to the end of the row)
            if rnd.random() < 0.3:
                rows[r, rnd.integers(0, depth + 1) :] = SEP
        min_prob, size = float(rnd.choice([0.0, 0.1, 0.25, 0.5])), int(rnd.integers(1, 10))
        got = frequency_tree(rows, min_prob, size)
        assert got == reference_tree(rows.tolist(), min_prob, size), (rows.tolist(), min_prob)
        source = rnd.integers(0, vocab, size=int(rnd.integers(3, 40)))
        context = rnd.integers(0, vocab, size=int(rnd.integers(3, 20)))
        starts = np.arange(2, len(source) + 1)  # every position (the 2-gram taken as matched)
        limit = int(rnd.integers(2, 12))
        want = []
        for p in starts.tolist():
            m = 2
            while m < min(limit, len(context)) and p - m - 1 >= 0:
                if source[p - m - 1] != context[-m - 1]:
                    break
                m += 1
            want.append(m)
        assert match_lengths(source, starts, context, limit).tolist() == want


def test_corpus_evicts_oldest_answers_first():
    corpus = SuffixCorpus(max_requests=2, max_tokens=1000)
    for doc in ([1, 2, 3], [4, 5, 6], [7, 8, 9]):
        corpus.add(doc)
    assert len(corpus) == 2
    assert corpus.candidates(arr([1, 2])).size == 0  # the first answer is gone
    assert corpus.buffer[corpus.candidates(arr([4, 5]))].tolist() == [6]
    capped = SuffixCorpus(max_requests=10, max_tokens=5)
    capped.add([1, 2, 3])
    capped.add([4, 5, 6])  # 6 tokens held > 5: the first goes
    assert len(capped) == 1 and capped.candidates(arr([1, 2])).size == 0
    off = SuffixCorpus(max_requests=0, max_tokens=1000)
    off.add([1, 2, 3])
    assert len(off) == 0


def test_corpus_compaction_keeps_the_live_answers():
    corpus = SuffixCorpus(max_requests=3, max_tokens=10**6)
    rng = np.random.default_rng(0)
    docs = [rng.integers(10, 60000, 400).tolist() for _ in range(40)]
    for doc in docs:
        corpus.add(doc)
    assert len(corpus.buffer) < 10 * 401  # compacted (40 answers were added)
    for doc in docs[-3:]:
        starts = corpus.candidates(arr(doc[:2]))
        assert doc[2] in corpus.buffer[starts].tolist()
    assert corpus.candidates(arr(docs[0][:2])).size == 0


def test_a_long_match_is_found_behind_many_recent_short_ones():
    """An answer repeated from long ago: its last two tokens occur in each of 300 later answers,
    more than the 2-gram index lets vote, but its last eight only in it."""
    drafter = SuffixDrafter(max_spec_factor=1.0)
    old = list(range(100, 130))
    drafter.corpus.add(old)
    for i in range(300):
        drafter.corpus.add([1000 + i, 1000 + i, old[18], old[19], 2000 + i])
    context = arr([7] + old[:20])  # the old answer again, 20 tokens in
    assert drafter.draft(context, 5)[1] == old[20:25]
    drafter.corpus._long = KeyIndex()  # the 2-gram index alone: the 256 most recent vote
    assert drafter.draft(context, 5)[1] == []


def test_the_draft_length_follows_the_match_length():
    ctx = arr([50, 51, 1, 2, 3, 4, 5, 6, 7, 8, 60, 61, 62, 1, 2])  # "1 2" seen once before
    assert SuffixDrafter(max_spec_factor=1.0).draft(ctx, 8) == ([-1, 0, 1], [3, 4])
    assert SuffixDrafter(max_spec_factor=2.0).draft(ctx, 8)[1] == [3, 4, 5, 6]
    assert SuffixDrafter(max_spec_factor=2.0).draft(ctx, 3)[1] == [3, 4, 5]  # the budget


def test_a_long_copy_drafts_a_full_budget_within_the_tree_depth():
    text = list(range(100, 140))
    ctx = arr(text + [7] + text[:30])  # copying: the match is 30 tokens long
    # the longest match leaves no room (24 - 23); a 19-token match leaves 5
    assert SuffixDrafter(max_tree_depth=24).draft(ctx, 5)[1] == text[30:35]
    assert SuffixDrafter(max_tree_depth=24).draft(ctx, 8)[1] == text[30:38]


def test_earlier_answers_are_drafted_from_and_the_likelier_source_wins():
    drafter = SuffixDrafter()
    ctx = arr([9, 9, 1, 2, 3])
    assert drafter.draft(ctx, 5) == ([-1], [])  # nothing to match yet
    drafter.corpus.add([1, 2, 3, 4, 5, 6])
    drafter.corpus.add([0, 2, 3, 4, 5, 6])
    parents, tokens = drafter.draft(ctx, 5)
    assert tokens == [4, 5, 6] and parents == [-1, 0, 1, 2]  # match of 3, up to 3 tokens
    # its own text holds "2 3" followed by 7 once: the corpus's two votes win
    assert drafter.draft(arr([2, 3, 7, 9, 9, 1, 2, 3]), 5)[1] == [4, 5, 6]
    drafter.clear_history()
    assert drafter.draft(arr([2, 3, 7, 9, 9, 1, 2, 3]), 5)[1] == [7, 9]


def test_siblings_come_from_diverging_answers():
    drafter = SuffixDrafter(min_token_prob=0.1, max_spec_factor=4.0)
    for tail in ([4, 5], [4, 6], [8, 9]):
        drafter.corpus.add([1, 2, *tail])
    parents, tokens = drafter.draft(arr([0, 1, 2]), 4)
    assert sorted(zip(parents[1:], tokens, strict=True)) == [(0, 4), (0, 8), (1, 5), (1, 6)]


def test_the_chain_is_the_likeliest_path():
    drafter = SuffixDrafter(max_spec_factor=4.0)
    for tail in ([4, 5], [8, 9], [8, 7], [8, 9]):
        drafter.corpus.add([1, 2, *tail])
    assert drafter.chain(arr([0, 1, 2]), 4) == [8, 9]  # 8 (3/4), then 9 (2/4) over 7 (1/4)
    assert drafter.chain(arr([0, 5, 6]), 4) == []


@pytest.mark.parametrize("depth", [1, 2])
def test_a_too_shallow_tree_depth_is_refused(depth):
    with pytest.raises(ValueError):
        SuffixDrafter(max_tree_depth=depth)


def test_key_index_finds_the_most_recent_positions_as_a_dict_of_lists_would(monkeypatch):
    """Against a dict of lists on random keys: across merged runs and unmerged chunks, with a
    floor, and after dropping evicted entries."""
    monkeypatch.setattr(KeyIndex, "PENDING", 50)
    rng = np.random.default_rng(3)
    index, ref, pos, both = KeyIndex(), {}, 0, False
    for _ in range(60):
        keys = rng.integers(0, 12, rng.integers(1, 40))
        positions = pos + np.arange(len(keys)) * 2
        pos = int(positions[-1]) + 5
        index.add(keys, positions)
        both = both or 0 < index.pending < len(index)
        for k, p in zip(keys.tolist(), positions.tolist(), strict=True):
            ref.setdefault(k, []).append(p)
        floor = int(rng.integers(0, pos))
        for k in range(13):
            for most in (1, 7, 1000):
                want = [p for p in ref.get(k, []) if p >= floor][-most:]
                assert index.find(k, floor, most).tolist() == want, (k, floor, most)
    assert both  # lookups ran with entries in both parts
    index.drop_below(pos // 2)
    assert len(index) == sum(p >= pos // 2 for v in ref.values() for p in v)
    for k in range(13):
        assert index.find(k, 0, 1000).tolist() == [p for p in ref.get(k, []) if p >= pos // 2]
