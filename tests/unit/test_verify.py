"""Lossless verification: hand-built cases, then distribution tests in the style of vLLM's
rejection-sampler tests (small vocabulary, random p and q, many samples)."""

from __future__ import annotations

import pytest
import torch

from specdecode.tree import TreeShape
from specdecode.verify import DraftBatch, verify

V = 10


def one_hot(token: int, v: int = V) -> torch.Tensor:
    return torch.zeros(v).index_fill_(0, torch.tensor([token]), 1.0)


def run(shape: TreeShape, tokens, p_rows, q_rows=None, seed=0):
    p = torch.stack(p_rows)[None]
    q = [torch.stack(q_rows)] if q_rows is not None else None
    drafts = DraftBatch.from_trees([shape], [tokens], q)
    g = torch.Generator().manual_seed(seed)
    return verify(p, drafts, [g])


# ---- hand-built cases: p forces the outcome --------------------------------------------------


@pytest.mark.parametrize("with_q", [False, True])
def test_all_accepted_then_bonus(with_q):
    shape = TreeShape.chain(3)
    p = [one_hot(4), one_hot(5), one_hot(6), one_hot(7)]
    q = [one_hot(4), one_hot(5), one_hot(6), one_hot(0)] if with_q else None
    r = run(shape, [9, 4, 5, 6], p, q)
    assert r.accepted == [[1, 2, 3]] and r.tokens == [[4, 5, 6, 7]]


@pytest.mark.parametrize("with_q", [False, True])
def test_rejection_emits_the_recovered_token(with_q):
    shape = TreeShape.chain(3)
    p = [one_hot(4), one_hot(5), one_hot(6), one_hot(7)]
    q = [one_hot(4), one_hot(8), one_hot(6), one_hot(0)] if with_q else None
    r = run(shape, [9, 4, 8, 6], p, q)  # second draft (8) is wrong: target wants 5
    assert r.accepted == [[1]] and r.tokens == [[4, 5]]


def test_tree_tries_siblings_in_order():
    # root -> {1: token 3, 2: token 4}; 2 -> {3: token 6}
    shape = TreeShape((-1, 0, 0, 2))
    p = [one_hot(4), one_hot(0), one_hot(6), one_hot(2)]
    r = run(shape, [9, 3, 4, 6], p)
    assert r.accepted == [[2, 3]] and r.tokens == [[4, 6, 2]]


def test_greedy_is_longest_matching_path():
    """Greedy = one-hot p: the accepted path is the deepest one matching the target argmax."""
    shape = TreeShape.from_choices([[0], [1], [0, 0], [1, 0], [1, 0, 0]])
    # nodes: 0 root, 1=[0], 2=[1], 3=[0,0], 4=[1,0], 5=[1,0,0]
    tokens = [0, 1, 2, 3, 4, 5]
    argmax = {0: 2, 2: 4, 4: 7}  # root wants 2 (node 2), node 2 wants 4 (node 4), node 4 wants 7
    p = [one_hot(argmax.get(i, 0)) for i in range(6)]
    r = run(shape, tokens, p)
    assert r.accepted == [[2, 4]] and r.tokens == [[2, 4, 7]]


def test_ragged_batch():
    shapes = [TreeShape.chain(1), TreeShape.chain(4)]
    tokens = [[0, 3], [0, 1, 2, 3, 4]]
    p = torch.zeros(2, 5, V)
    p[0, 0, 3] = p[0, 1, 9] = 1
    for i, t in enumerate([1, 2, 8, 4, 5]):
        p[1, i, t] = 1
    r = verify(p, DraftBatch.from_trees(shapes, tokens), [None, None])
    assert r.tokens == [[3, 9], [1, 2, 8]]


def test_choice_list_validation():
    with pytest.raises(ValueError, match="lacks its parent"):
        TreeShape.from_choices([[0], [1, 0]])
    s = TreeShape.from_choices([[1], [0], [0, 0]])
    assert s.parents == (-1, 1, 1, 2) or s.parents == (-1, 0, 0, 1)
    assert s.ranks == (0, 0, 1, 0)
    assert s.paths() == [[0, 2], [0, 1, 3]]


# ---- distribution tests ------------------------------------------------------------------------

N_SAMPLES = 100_000


def random_dist(g: torch.Generator, v: int = V, sharp: float = 2.0) -> torch.Tensor:
    return torch.softmax(torch.randn(v, generator=g) * sharp, -1)


def build_batch(shape: TreeShape, p_depth, q_depth, deterministic: bool, g: torch.Generator):
    """N_SAMPLES draft trees of one shape. p and q depend only on the node's depth, so every
    output token must be distributed as p of its position."""
    depths = shape.depths
    n = len(shape)
    p = torch.stack([p_depth[d] for d in depths])[None].expand(N_SAMPLES, n, V)
    q = torch.stack([q_depth[d] for d in depths])[None].expand(N_SAMPLES, n, V)
    tokens = torch.zeros(N_SAMPLES, n, dtype=torch.long)
    for node, kids in enumerate(shape.children):
        if not kids:
            continue
        if deterministic:  # top-k candidates of q, in rank order
            top = q_depth[depths[node]].topk(len(kids)).indices
            tokens[:, kids] = top[None].expand(N_SAMPLES, -1)
        else:  # i.i.d. draws from q at the parent
            draws = torch.multinomial(q[:, node], len(kids), replacement=True, generator=g)
            tokens[:, kids] = draws
    c = max(len(k) for k in shape.children)
    children = torch.full((n, c), -1, dtype=torch.long)
    for node, kids in enumerate(shape.children):
        children[node, : len(kids)] = torch.tensor(kids, dtype=torch.long)
    drafts = DraftBatch(
        tokens,
        children[None].expand(N_SAMPLES, n, c),
        [n] * N_SAMPLES,
        None if deterministic else q,
    )
    return p, drafts


def tv(a: torch.Tensor, b: torch.Tensor) -> float:
    return 0.5 * float((a - b).abs().sum())


SHAPES = {
    "chain1": TreeShape.chain(1),
    "chain3": TreeShape.chain(3),
    "chain5": TreeShape.chain(5),
    "tree": TreeShape.from_choices([[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]]),
}


@pytest.mark.parametrize("mode", ["sampled", "deterministic"])
@pytest.mark.parametrize("name", list(SHAPES))
def test_first_two_tokens_follow_the_target(mode, name):
    """The first output token must be ~ p_0 and the second ~ p_1 (the second comes from this
    step if a draft was accepted, else from a second step started at position 1).

    With 1e5 samples over 10 tokens the sampling error of a total-variation distance is about
    0.005, so a correct sampler lands well under 0.02, while the random reference distributions
    (and the draft q itself) sit far above it."""
    shape = SHAPES[name]
    g = torch.Generator().manual_seed(1)
    depth = max(shape.depths) + 2
    p_depth = [random_dist(g) for _ in range(depth)]
    q_depth = [random_dist(g) for _ in range(depth)]
    p, drafts = build_batch(shape, p_depth, q_depth, mode == "deterministic", g)
    torch.manual_seed(2)
    r = verify(p, drafts)
    first = torch.tensor([t[0] for t in r.tokens])
    second = torch.full((N_SAMPLES,), -1)
    has_second = torch.tensor([len(t) > 1 for t in r.tokens])
    second[has_second] = torch.tensor([t[1] for t in r.tokens if len(t) > 1])
    # rows that stopped after one token: a new step from position 1
    p2, drafts2 = build_batch(shape, p_depth[1:], q_depth[1:], mode == "deterministic", g)
    r2 = verify(p2, drafts2)
    fill = torch.tensor([t[0] for t in r2.tokens])
    second = torch.where(has_second, second, fill)
    for tokens, want in ((first, p_depth[0]), (second, p_depth[1])):
        freq = torch.bincount(tokens, minlength=V).float() / N_SAMPLES
        err = tv(freq, want)
        assert err < 0.02, err
        for _ in range(5):
            assert err < tv(freq, random_dist(g)) / 3
    assert tv(torch.bincount(first, minlength=V).float() / N_SAMPLES, q_depth[0]) > 0.05


def test_acceptance_rate_matches_theory():
    """For a chain of 1 with sampled drafts, P(accept) = sum_x min(p(x), q(x))."""
    g = torch.Generator().manual_seed(5)
    p_depth = [random_dist(g) for _ in range(3)]
    q_depth = [random_dist(g) for _ in range(3)]
    p, drafts = build_batch(TreeShape.chain(1), p_depth, q_depth, False, g)
    r = verify(p, drafts)
    rate = sum(r.num_accepted) / N_SAMPLES
    want = float(torch.minimum(p_depth[0], q_depth[0]).sum())
    assert abs(rate - want) < 0.01


def test_seeded_verification_is_deterministic():
    g = torch.Generator().manual_seed(3)
    shape = SHAPES["tree"]
    p_depth = [random_dist(g) for _ in range(5)]
    q_depth = [random_dist(g) for _ in range(5)]
    p, drafts = build_batch(shape, p_depth, q_depth, False, g)
    p, drafts.tokens, drafts.children = p[:50], drafts.tokens[:50], drafts.children[:50]
    drafts.draft_probs = drafts.draft_probs[:50]
    gens = [torch.Generator().manual_seed(i) for i in range(50)]
    a = verify(p, drafts, gens).tokens
    gens = [torch.Generator().manual_seed(i) for i in range(50)]
    assert verify(p, drafts, gens).tokens == a


def test_greedy_shortcut_equals_one_hot_verification():
    """`verify_choices` must give exactly what `verify` gives with one-hot p, on random trees."""
    from specdecode.verify import verify_choices

    g = torch.Generator().manual_seed(0)
    for shape in SHAPES.values():
        n = len(shape)
        for _ in range(50):
            tokens = torch.randint(0, 3, (n,), generator=g).tolist()
            best = torch.randint(0, 3, (n,), generator=g).tolist()
            p = torch.zeros(1, n, V).scatter_(2, torch.tensor(best)[None, :, None], 1.0)
            full = verify(p, DraftBatch.from_trees([shape], [tokens]))
            fast = verify_choices([shape], [tokens], [best])
            assert (fast.accepted, fast.tokens) == (full.accepted, full.tokens)
