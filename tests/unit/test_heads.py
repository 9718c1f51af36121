"""Draft heads: shapes, Medusa's identity start, EAGLE's cached forward against its dense and
unrolled (training-time test) forwards, checkpoint round trips, and the EAGLE-2 tree expansion
on hand-checked cases."""

from __future__ import annotations

import pytest
import torch
from helpers import HEAD_TARGET_CONFIG, OWN_HEAD_LAYER

from specdecode.cache import BlockManager, KVCache, SeqBlocks
from specdecode.core import Sequence
from specdecode.drafters.eagle import EagleDrafter, _Node
from specdecode.models.attention import build_metadata
from specdecode.models.head_io import load_head, save_head
from specdecode.models.heads import EagleHead, MedusaHeads
from specdecode.models.llama import LlamaModel
from specdecode.sampling import SamplingParams

CFG = HEAD_TARGET_CONFIG


@pytest.fixture
def target():
    torch.manual_seed(0)
    return LlamaModel(CFG).eval()


def eagle(target, vocab=None, seed=1, layer: dict | None = None) -> EagleHead:
    from specdecode.models.head_io import head_layer_config

    torch.manual_seed(seed)
    head = EagleHead(head_layer_config(layer or {}, CFG))
    for p in head.parameters():
        torch.nn.init.normal_(p, std=0.2)
    head.attach(target.embed_tokens, target.lm_head.weight, vocab)
    return head.eval()


def test_medusa_heads_start_as_identity_and_are_separate(target):
    heads = MedusaHeads(32, num_heads=3)
    vocab = torch.tensor([0, 5, 7, 90])
    heads.attach(target.lm_head.weight, vocab)
    h = torch.randn(5, 32)
    assert torch.equal(heads.features(h), h[:, None].expand(5, 3, 32))
    logits = heads(h)
    assert logits.shape == (5, 3, 4)
    torch.testing.assert_close(logits[:, 0], h @ target.lm_head.weight[vocab].T)
    blocks = [b[0].linear.weight for b in heads.medusa_head]
    assert len({id(w) for w in blocks}) == 3  # not one module shared across heads
    assert sum(p.numel() for p in heads.parameters()) == 3 * (32 * 32 + 32)  # the LM head is not


def test_eagle_training_starts_as_identity_on_the_feature(target):
    """EAGLE-1 training starts from f'_{t+1} = f_t (in the LM head's input space), whatever
    the token, and every weight still gets a gradient path."""
    from specdecode.train.heads import _identity_start

    head = EagleHead(CFG)
    _identity_start(head, target)
    head.attach(target.embed_tokens, target.lm_head.weight, None)
    feats = torch.randn(2, 6, CFG.hidden_size)
    ids = torch.randint(0, CFG.vocab_size, (2, 6))
    out = head.forward_dense(ids, feats)
    assert torch.equal(out, feats)
    out.square().sum().backward()
    assert head.fc.weight.grad[:, : CFG.hidden_size].abs().sum() > 0  # the embedding half
    assert head.layers[0].self_attn.o_proj.weight.grad.abs().sum() > 0
    assert head.layers[0].mlp.down_proj.weight.grad.abs().sum() > 0


def test_eagle3_training_starts_as_identity_on_the_high_feature(target):
    """EAGLE-3 training starts by passing the high feature (the last third of the fused input)
    through, with the target's final norm and LM-head rows; gradients reach every part."""
    from specdecode.models.heads import Eagle3Head
    from specdecode.train.heads import _identity_start3

    vocab = torch.tensor([3, 1, 40, 7, 95])
    head = Eagle3Head(CFG, vocab.numel(), (0, 1, 2))
    _identity_start3(head, target, target.lm_head.weight[vocab])
    head.attach(target.embed_tokens, vocab)
    h = CFG.hidden_size
    feats = torch.randn(2, 6, 3 * h)
    ids = torch.randint(0, CFG.vocab_size, (2, 7))
    (out,) = head.forward_unrolled(ids, feats, 1)
    torch.testing.assert_close(out, feats[..., 2 * h :])
    want = target.norm(feats[..., 2 * h :]) @ target.lm_head.weight[vocab].T
    torch.testing.assert_close(head.logits(out), want)
    outs = head.forward_unrolled(ids, feats, 2)
    sum(o.square().sum() for o in outs).backward()
    assert head.fc.weight.grad[:, : 2 * h].abs().sum() > 0  # the low and mid features
    assert head.layers[0].self_attn.o_proj.weight.grad.abs().sum() > 0
    assert head.layers[0].mlp.down_proj.weight.grad.abs().sum() > 0


def test_ttt_ramp_unrolls_fewer_steps_early():
    from specdecode.train.heads import ttt_steps_at

    assert [ttt_steps_at(p, 4, 0.6) for p in (0, 0.19, 0.21, 0.39, 0.41, 0.59, 0.6, 1)] == [
        1, 1, 2, 2, 3, 3, 4, 4,
    ]  # fmt: skip
    assert {ttt_steps_at(p, 4, 0.0) for p in (0, 0.5)} == {4}  # no ramp
    assert ttt_steps_at(0.1, 1, 0.5) == 1


def _paged(head: EagleHead, ids, feats, positions, blocks, manager, cache, mask=None):
    meta = build_metadata(
        cache.kv, manager, [blocks], [len(ids)], [mask] if mask is not None else None
    )
    out = head(torch.tensor(ids), feats, torch.tensor(positions), meta)
    blocks.length += len(ids)
    return out


@pytest.mark.parametrize("layer", [None, OWN_HEAD_LAYER], ids=["target-shaped", "own-shape"])
def test_eagle_cached_forward_equals_dense_and_unrolled(target, layer):
    head = eagle(target, layer=layer)
    t = 10
    ids = torch.randint(0, 96, (1, t + 3))
    feats = torch.randn(1, t, 32)
    with torch.no_grad():
        dense = head.forward_dense(ids[:, :t], feats)
        unrolled = head.forward_unrolled(ids, feats, steps=3)
        torch.testing.assert_close(unrolled[0], dense, atol=1e-5, rtol=1e-5)
        manager = BlockManager(16, 4)
        cache = KVCache(head.config, 16, 4)
        # drafting after origin 5: true entries 0..5, then two fed-back steps
        blocks = SeqBlocks()
        manager.allocate(blocks, 8)
        out = _paged(
            head, ids[0, :6].tolist(), feats[0, :6], list(range(6)), blocks, manager, cache
        )
        torch.testing.assert_close(out, dense[0, :6], atol=1e-5, rtol=1e-5)
        # fed-back steps compound fp32 rounding of a differently ordered sum (seen: 1.3e-5
        # after two steps on an Intel Xeon VM); a wrong cache or position is off by far more
        step1 = _paged(head, [int(ids[0, 6])], out[5:6], [6], blocks, manager, cache)
        torch.testing.assert_close(step1[0], unrolled[1][0, 5], atol=3e-5, rtol=3e-5)
        step2 = _paged(head, [int(ids[0, 7])], step1, [7], blocks, manager, cache)
        torch.testing.assert_close(step2[0], unrolled[2][0, 5], atol=3e-5, rtol=3e-5)


def _eagle3(target, variant: dict) -> EagleHead:
    from specdecode.models.heads import Eagle3Head

    torch.manual_seed(1)
    head = Eagle3Head(CFG, 7, (0, 1))
    head.set_variant(**variant)
    with torch.no_grad():
        for name, p in head.named_parameters():
            p.copy_(1 + 0.3 * torch.randn_like(p) if "norm" in name else 0.2 * torch.randn_like(p))
    head.attach(target.embed_tokens, torch.tensor([0, 3, 5, 8, 13, 21, 34]))
    return head.eval()


VARIANTS3 = [
    {},
    {"norm_before_fc": True},
    {"fc_norm": True},
    {"norm_output": True},
    {"norm_before_fc": True, "norm_output": True, "norm_before_residual": True},
]


@pytest.mark.parametrize("variant", VARIANTS3, ids=lambda v: "+".join(v) or "plain")
def test_eagle3_variants_draft_as_they_train(target, variant):
    """EAGLE-3 with speculators' variants (a norm before fc, per-feature norms, a normalised
    output fed back): the engine's cached forward, fed its own outputs, equals the unrolled
    (training-time test) forward; each variant changes what the head computes."""
    from specdecode.models.heads import Eagle3Head

    head = _eagle3(target, variant)
    assert head.variant == {**dict.fromkeys(head.variant, False), **variant}
    t = 8
    ids = torch.randint(0, 96, (1, t + 3))
    feats = torch.randn(1, t, head.feature_size) * 2
    with torch.no_grad():
        unrolled = head.forward_unrolled(ids, feats, steps=3)
        torch.testing.assert_close(unrolled[0], head.forward_dense(ids[:, :t], feats))
        manager, cache, blocks = BlockManager(16, 4), KVCache(head.config, 16, 4), SeqBlocks()
        manager.allocate(blocks, 8)
        out = _paged(
            head, ids[0, :5].tolist(), feats[0, :5], list(range(5)), blocks, manager, cache
        )
        step1 = _paged(head, [int(ids[0, 5])], out[4:5], [5], blocks, manager, cache)
        torch.testing.assert_close(step1[0], unrolled[1][0, 4], atol=3e-5, rtol=3e-5)
        logits = head.logits(unrolled[1][0])
        if variant:
            plain = Eagle3Head(CFG, 7, (0, 1))
            plain.load_state_dict(head.state_dict(), strict=False)
            plain.attach(target.embed_tokens, head.vocab_ids)
            other = plain.logits(plain.forward_unrolled(ids, feats, steps=3)[1][0])
            assert not torch.allclose(logits, other, atol=1e-3)
            # each variant alone, by its definition, on the plain head's first step
            x = ids[:, :t]
            if variant == {"norm_output": True}:
                want = head.norm(plain.forward_dense(x, feats))
            elif variant == {"norm_before_fc": True}:
                want = plain.forward_dense(x, head.input_norm(feats))
            elif variant == {"fc_norm": True}:
                a, b = feats.chunk(2, -1)
                want = plain.forward_dense(
                    x, torch.cat([head.fc_norm[0](a), head.fc_norm[1](b)], -1)
                )
            else:
                want = None
            if want is not None:
                torch.testing.assert_close(head.forward_dense(x, feats), want)
    with pytest.raises(ValueError, match="exclude"):
        head.set_variant(norm_before_fc=True, fc_norm=True)


@pytest.mark.parametrize(
    "kind",
    ["eagle", "eagle-own-shape", "eagle3", "eagle3-norm_output", "eagle3-norm_before_residual"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_packed_heads_layer_loop_equals_its_eager_layer(target, kind, dtype):
    """On the CPU kernels a head's decoder layer runs as one C++ call (`_FastLayer`): it
    computes what the eager layer computes on the same packed weights, for catch-up rows of
    several sequences (padded metadata), a tree level (masks) and one sequence alone (a slot
    range), and writes the same head cache; bf16 packs as well (with bf16 activations where the
    CPU has vdpbf16ps, on both paths)."""
    import copy

    from specdecode import kernels

    if not kernels.available():
        pytest.skip("no CPU kernels here")
    if kind.startswith("eagle3"):
        variant = kind.split("-")[1] if "-" in kind else None
        head = _eagle3(target, {variant: True} if variant else {})
    else:
        head = eagle(target, layer=OWN_HEAD_LAYER if "own" in kind else None)
    fast = copy.deepcopy(head)
    fast.accelerate(dtype)
    slow = copy.deepcopy(head)
    slow.accelerate(dtype)
    slow._fast = None  # the eager layer on the same packed projections
    assert fast._fast is not None
    with pytest.MonkeyPatch.context() as mp:  # the switch for A/B measurements
        from specdecode.models.heads import LAYER_LOOP_ENV

        mp.setenv(LAYER_LOOP_ENV, "0")
        off = copy.deepcopy(head)
        off.accelerate(dtype)
        assert off._fast is None
    caches, outs = [], []
    torch.manual_seed(3)
    ids = torch.randint(0, 96, (12,)).tolist()
    feats = torch.randn(12, head.feature_size)
    for h in (fast, slow):
        manager, cache = BlockManager(32, 4), KVCache(h.config, 32, 4)
        cache.kv.zero_()  # (allocated empty: compare the slots written)
        a, b, c = SeqBlocks(), SeqBlocks(), SeqBlocks()
        for blocks, n in ((a, 12), (b, 8), (c, 8)):
            manager.allocate(blocks, n)
        got = []
        with torch.no_grad():
            # catch-up: 7 entries of a, 3 of b (padded metadata)
            meta = build_metadata(cache.kv, manager, [a, b], [7, 3])
            pos = torch.tensor(list(range(7)) + list(range(3)))
            first = h(torch.tensor(ids[:7] + ids[:3]), torch.cat([feats[:7], feats[:3]]), pos, meta)
            a.length, b.length = 7, 3
            got.append(first)
            # a tree level fed the heads' own outputs: two siblings each, with masks
            level = torch.stack([first[6], first[6], first[9], first[9]])
            mask = torch.eye(2, dtype=torch.bool)  # siblings see their ancestors and themselves
            meta = build_metadata(cache.kv, manager, [a, b], [2, 2], [mask, mask])
            got.append(
                h(torch.tensor(ids[7:9] + ids[3:5]), level, torch.tensor([7, 7, 3, 3]), meta)
            )
            # one sequence alone: its context in consecutive slots (kv_range), causal
            meta = build_metadata(cache.kv, manager, [c], [5])
            assert meta.kv_range is not None
            got.append(h(torch.tensor(ids[:5]), feats[:5], torch.arange(5), meta))
            got.append(h.logits(got[-1]))
        outs.append(got)
        caches.append(cache.kv.clone())
    # bf16 activations: the two paths' attention sums differ in order by an ulp of fp32, which
    # rounding the next input to bf16 can turn into one of bf16 (~0.4%); a wrong weight,
    # position or cache row is off by far more
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    for x, y in zip(*outs, strict=True):
        torch.testing.assert_close(x, y, atol=tol, rtol=tol)
    torch.testing.assert_close(caches[0], caches[1], atol=tol, rtol=tol)


@pytest.mark.parametrize("kind", ["medusa", "eagle", "eagle-own-layer-shape"])
def test_head_checkpoint_round_trip(target, tmp_path, kind):
    vocab = torch.tensor([1, 2, 3, 50, 60])
    if kind == "medusa":
        head = MedusaHeads(32, num_heads=2)
        for p in head.parameters():
            torch.nn.init.normal_(p, std=0.2)
        head.attach(target.lm_head.weight, vocab)
        x = (torch.randn(3, 32),)
    else:
        head = eagle(target, vocab, layer=OWN_HEAD_LAYER if "own" in kind else None)
        x = (torch.randint(0, 96, (1, 4)), torch.randn(1, 4, 32))
    with torch.no_grad():  # checkpoints are bf16
        for p in head.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    save_head(head, tmp_path, CFG, {"note": "test"})
    loaded = load_head(tmp_path, target)
    assert torch.equal(loaded.vocab_ids, vocab)
    if kind != "medusa":
        assert loaded.config == head.config
    with torch.no_grad():
        if kind == "medusa":
            torch.testing.assert_close(loaded(*x), head(*x))
        else:
            torch.testing.assert_close(loaded.forward_dense(*x), head.forward_dense(*x))


def test_head_for_another_target_is_refused(target, tmp_path):
    from specdecode.errors import InvalidRequestError

    save_head(MedusaHeads(32, 2), tmp_path, CFG, {})
    from dataclasses import replace

    other = LlamaModel(replace(CFG, vocab_size=100))
    with pytest.raises(InvalidRequestError, match="different target"):
        load_head(tmp_path, other)


# ---- EAGLE-2 tree expansion ---------------------------------------------------------------------


def test_select_keeps_the_best_nodes_as_a_level_ordered_tree():
    import math

    lp = math.log
    pool = [
        _Node(10, lp(0.6), -1, 1),  # 0
        _Node(11, lp(0.3), -1, 1),  # 1
        _Node(12, lp(0.6 * 0.9), 0, 2),  # 2
        _Node(13, lp(0.6 * 0.05), 0, 2),  # 3
        _Node(14, lp(0.3 * 0.8), 1, 2),  # 4
        _Node(15, lp(0.3 * 0.1), 1, 2),  # 5
        _Node(16, lp(0.6 * 0.9 * 0.9), 2, 3),  # 6
    ]
    # scores: 0 .6, 2 .54, 6 .486, 1 .3, 4 .24, 3 .03, 5 .03
    prop = EagleDrafter._select(99, pool, size=6)
    assert prop.tokens == [99, 10, 11, 12, 14, 16]
    assert prop.shape.parents == (-1, 0, 0, 1, 2, 3)
    prop = EagleDrafter._select(99, pool, size=4)  # 0, 2, 6: a chain
    assert prop.tokens == [99, 10, 12, 16] and prop.shape.is_chain()
    # what a node's children follow (the penalties' history): the drafts from the root to it
    assert [EagleDrafter._path(pool, j) for j in (0, 4, 6)] == [[10], [11, 14], [10, 12, 16]]


def test_features_waiting_for_a_head_hold_only_their_own_rows(target):
    """A request not drafting keeps its features until it drafts: a copy of its rows, not a
    view of the whole step's feature tensor (every other request's prefill with it)."""
    drafter = EagleDrafter(eagle(target), kv_memory_gb=0.001, block_size=4)
    seq = Sequence([1, 2, 3], SamplingParams(max_tokens=4))
    seq.blocks.length = 3
    step = torch.randn(40, 32)  # the step's features: 3 rows of this request, then others'
    drafter.observe([seq], [step[:3]])
    (kept,) = drafter._state[seq.seq_id].pending
    assert torch.equal(kept, step[:3])
    assert kept.untyped_storage().nbytes() == kept.numel() * kept.element_size()


def test_level_mask_sees_fed_ancestors_only():
    pool = [
        _Node(1, -0.1, -1, 1),
        _Node(2, -0.2, -1, 1),
        _Node(3, -0.3, 0, 2),
        _Node(4, -0.4, 1, 2),
    ]
    pool.append(_Node(5, -0.5, 2, 3))
    mask = EagleDrafter._level_mask(pool, fed=[0, 1], front=[2, 3])
    assert mask.tolist() == [[True, False, True, False], [False, True, False, True]]
    mask = EagleDrafter._level_mask(pool, fed=[0, 1, 2, 3], front=[4])
    assert mask.tolist() == [[True, False, True, False, True]]


class _ScriptedHead:
    """A stand-in head whose next-token log-probabilities depend only on the last token fed
    (carried in the 'feature'), to hand-check the dynamic tree."""

    vocab_ids = None
    config = CFG

    def __init__(self, table: dict[int, dict[int, float]]):
        self.table = table

    def __call__(self, ids, feats, positions, meta):
        return torch.nn.functional.one_hot(ids, 96).float()

    def logits(self, feat):
        out = torch.full((feat.shape[0], 96), -30.0)
        for r, tok in enumerate(feat.argmax(-1).tolist()):
            for t, p in self.table.get(tok, {}).items():
                out[r, t] = torch.tensor(p).log()
        return out


def test_dynamic_tree_expands_global_topk_and_reranks():
    table = {
        7: {1: 0.7, 2: 0.2, 3: 0.1},  # the root's children
        1: {4: 0.9, 5: 0.1},
        2: {6: 0.55, 8: 0.45},
        4: {9: 0.99},
        6: {10: 1.0},
        8: {11: 1.0},
    }
    head = _ScriptedHead(table)
    drafter = EagleDrafter.__new__(EagleDrafter)
    drafter.head, drafter.topk, drafter.num_draft_tokens = head, 2, 6
    drafter.device, drafter._columns = torch.device("cpu"), None
    drafter.manager = BlockManager(16, 4)
    drafter.cache = KVCache(CFG, 16, 4)
    st = type("S", (), {})()
    st.blocks, st.committed, st.base = SeqBlocks(), 0, 0
    drafter.manager.allocate(st.blocks, 32)
    seq = type("Q", (), {"last_token": 7, "params": SamplingParams()})()
    root_feat = torch.nn.functional.one_hot(torch.tensor([7]), 96).float()
    [prop] = drafter._tree([seq], [st], [3], root_feat)
    # depth 1: 1 (.7), 2 (.2); depth 2 from {1, 2}: 4 (.63), 5 (.07), 6 (.11), 8 (.09): keep 4, 6;
    # depth 3: 9 (.6237), 10 (.11); rerank top 5: 1 .7, 4 .63, 9 .6237, 2 .2, 6 (.11, before 10)
    assert prop.tokens == [7, 1, 2, 4, 6, 9]
    assert prop.shape.parents == (-1, 0, 0, 1, 2, 3)


def test_soft_labels_are_read_shifted_at_the_selected_positions():
    """Labels are computed only where a loss reads them; read at shift s they equal the dense
    computation sliced at t + s."""
    from types import SimpleNamespace

    from specdecode.train.heads import _Batch, _Trainer

    torch.manual_seed(0)
    b, n, hsz, extra = 3, 7, 8, 4
    feats = torch.randn(b, n, hsz)
    rows = torch.tensor([7, 4, 6])
    valid = torch.rand(b, n + extra) < 0.7
    batch = _Batch(feats, torch.zeros(b, n + extra, dtype=torch.long), valid, rows)
    w_rows, w_full = torch.randn(5, hsz), torch.randn(11, hsz)
    fake = SimpleNamespace(final=lambda f: f, lm_rows=w_rows, lm_full=w_full)
    targets = _Trainer.labels(fake, batch, top1=True)
    assert targets.probs.shape[0] < b * n  # not every position
    dense = torch.nn.functional.pad((feats @ w_rows.T).softmax(-1), (0, 0, 0, extra))
    best = torch.nn.functional.pad((feats @ w_full.T).argmax(-1), (0, extra))
    t = torch.arange(n)[None]
    for s in (1, 2, 3):
        sel = valid[:, s : n + s] & (t + s < rows[:, None])
        p, want = targets.at(sel, s)
        torch.testing.assert_close(p, dense[:, s : n + s][sel])
        assert torch.equal(want, best[:, s : n + s][sel])


def test_several_data_sets_train_together_each_holding_out_its_last(tmp_path):
    import json

    from specdecode.train.datagen import Example, write_shard
    from specdecode.train.heads import load_examples

    def data_set(name, ids, layers=(1,), width=8):
        d = tmp_path / name
        d.mkdir()
        exs = [Example(c, [1, 2, 3, 4, 5], [0, 0, 1, 1, 1]) for c in ids]
        feats = [torch.arange(4.0 * width).reshape(4, width) for _ in ids]
        write_shard(
            d / "shard-00000.safetensors", exs, {"feature_layers": json.dumps(layers)}, feats
        )
        return d

    chat = data_set("chat", ["a", "b", "c", "d"])
    code = data_set("code", ["b", "e", "f", "c"])  # b stored twice; c held out by code
    layers, train, held, _ = load_examples([chat, code], eval_examples=1)
    assert layers == (1,)
    assert [(name, [e.conversation_id for e in exs]) for name, exs in held] == [
        ("chat", ["d"]),
        ("code", ["c"]),
    ]
    assert [e.conversation_id for e in train] == ["a", "b", "e", "f"]
    assert [e.conversation_id for e in load_examples(chat, 1)[1]] == ["a", "b", "c"]
    other = data_set("other", ["x", "y"], layers=(0, 1), width=12)
    with pytest.raises(ValueError, match="same layers"):
        load_examples([chat, other], 1)
    # Medusa and EAGLE-1 read the final state alone: the sets train together on it
    layers, train, held, every = load_examples([chat, other], 1, final_only=True)
    assert layers == () and {e.features.shape[-1] for e in train + every} == {4}
    x = next(e for e in train if e.conversation_id == "x")
    assert torch.equal(x.features, torch.arange(48.0).reshape(4, 12)[:, -4:])
    # one set too: the final state alone is kept in memory
    layers, train, _, _ = load_examples([chat], 1, final_only=True)
    assert layers == () and {e.features.shape[-1] for e in train} == {4}
    # a conversation both sets hold out counts once among all held out
    twice = load_examples([chat, chat], 1)
    assert [n for n, _ in twice[2]] == ["chat", str(chat)] and len(twice[3]) == 1
    with pytest.raises(ValueError, match="need more than 4"):
        load_examples([chat], 4)


def test_eagle3_feature_layers_are_distinct_at_every_depth():
    from specdecode.models.heads import eagle3_aux_layers

    for n in range(1, 81):
        layers = eagle3_aux_layers(n)
        assert len(set(layers)) == len(layers) and all(0 <= i < n for i in layers), (n, layers)
    assert eagle3_aux_layers(30) == (2, 15, 27)  # the shipped SmolLM2 head's


def test_continuing_a_head_keeps_what_it_has_or_refuses():
    """`--init` from an imported Medusa head with its own vocabulary projections would drop
    them: refused. An EAGLE-1 head whose fc has a bias is continued with its bias."""
    from types import SimpleNamespace

    from specdecode.errors import DataError
    from specdecode.train.heads import _continue_from

    h, v = CFG.hidden_size, CFG.vocab_size
    prev = MedusaHeads(h, 2)
    prev.vocab_ids = None
    prev.own_projections = [torch.randn(v, h), torch.randn(v, h)]
    tr = SimpleNamespace(init_head=prev, cfg=SimpleNamespace(init="imported"))
    with pytest.raises(DataError, match="own vocabulary projections"):
        _continue_from(MedusaHeads(h, 2), tr, None)
    biased = EagleHead(CFG, fc_bias=True)
    biased.vocab_ids = None
    with torch.no_grad():
        biased.fc.bias.uniform_(-1, 1)
    head = EagleHead(CFG, fc_bias=True)
    _continue_from(head, SimpleNamespace(init_head=biased, cfg=tr.cfg), None)
    assert torch.equal(head.fc.bias, biased.fc.bias)
