"""Heads end to end on a tiny model: self-distillation data with features -> `train medusa` /
`train eagle` -> speculative decoding with the trained heads, token-identical to plain greedy
decoding (fp32) at batch 1 and batched, chain and EAGLE-2 tree; sampled outputs stay seeded."""

from __future__ import annotations

import json
import re

import pytest
import torch
from helpers import assert_seeded_outputs_match, seeded_params, train_tiny_heads

from specdecode import LLM, SamplingParams
from specdecode.errors import DataError, InvalidRequestError
from specdecode.train.datagen import generate
from specdecode.train.heads import (
    HeadTrainConfig,
    native_bf16_matmul,
    train_eagle,
    train_eagle3,
    train_medusa,
)

PROMPTS = ["say 3 1 9", "abcabc", "xyz", "hello 42"]


@pytest.fixture(scope="module")
def plain(tiny_llama_dir):
    return LLM(str(tiny_llama_dir))


@pytest.fixture(scope="module")
def heads(plain, tiny_llama_dir, tmp_path_factory):
    return train_tiny_heads(plain, tiny_llama_dir, tmp_path_factory.mktemp("heads"))


def test_training_improves_the_held_out_loss(heads):
    _, history = heads
    assert history["medusa"]["after"]["loss"] < history["medusa"]["before"]["loss"]
    assert history["eagle"]["after"]["ce"] < history["eagle"]["before"]["ce"]
    assert history["eagle3"]["after"]["ce"] < history["eagle3"]["before"]["ce"]
    assert len(history["eagle"]["after"]["top1_per_step"]) == 4
    assert len(history["medusa"]["after"]["top1_per_head"]) == 4
    # matmul precision chosen from the CPU: bf16 only where it is native
    assert {h["config"]["bf16"] for h in history.values()} == {native_bf16_matmul()}


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def eagle3(tiny_llama_dir, heads, policy: str = "adaptive", **config) -> LLM:
    """An engine drafting with the EAGLE-3 head trained here, `config` added to its method's."""
    root, _ = heads
    config = {"method": "eagle3", "model": str(root / "eagle3"), **config}
    return LLM(str(tiny_llama_dir), speculative_config=config, speculative_policy=policy)


CONFIGS = [
    ("medusa", {"num_speculative_tokens": 3}),
    ("medusa", {"speculative_token_tree": [[0], [1], [0, 0], [0, 1], [0, 0, 0]]}),
    ("eagle", {"num_speculative_tokens": 4, "topk": 1}),  # chain
    ("eagle", {}),  # the defaults: an EAGLE-2 tree
    ("eagle", {"num_speculative_tokens": 3, "topk": 3, "num_draft_tokens": 8}),  # EAGLE-2
    ("eagle3", {"num_speculative_tokens": 4, "topk": 1}),
    ("eagle3", {"num_speculative_tokens": 4, "topk": 2, "num_draft_tokens": 6}),
    # a prompt-lookup branch grafted onto the head's tree (chain, EAGLE-2 tree, Medusa tree)
    ("eagle3", {"num_speculative_tokens": 3, "topk": 1, "prompt_lookup_tokens": 6}),
    ("eagle", {"prompt_lookup_tokens": 8, "prompt_lookup_min": 1}),
    ("medusa", {"num_speculative_tokens": 2, "prompt_lookup_tokens": 5}),
    # ... its chain from suffix decoding (the request's text and earlier answers)
    (
        "eagle3",
        {
            "num_speculative_tokens": 3,
            "topk": 2,
            "num_draft_tokens": 6,
            "prompt_lookup_tokens": 6,
            "prompt_lookup_method": "suffix",
        },
    ),  # fmt: skip
]


@pytest.mark.parametrize(
    "method,extra",
    [
        ("medusa", {"num_speculative_tokens": 3}),
        ("eagle", {"num_speculative_tokens": 3, "topk": 1}),
        ("eagle", {"num_speculative_tokens": 3, "topk": 2, "num_draft_tokens": 6}),
        ("eagle3", {"num_speculative_tokens": 3, "topk": 1}),
        ("eagle3", {"num_speculative_tokens": 3, "topk": 2, "num_draft_tokens": 6}),
    ],
)
def test_heads_draft_under_the_requests_logit_bias(plain, tiny_llama_dir, heads, method, extra):
    """A bias that makes the target emit one token every time: a head that drafts under the
    request's bias drafts it too, and every draft is accepted (unbiased, it never would be)."""
    root, _ = heads
    spec = LLM(
        str(tiny_llama_dir),
        speculative_config={"method": method, "model": str(root / method), **extra},
        speculative_policy="static",
    )
    drafter = spec.engine.drafter
    ids = (drafter.heads if method == "medusa" else drafter.head).vocab_ids
    assert ids is not None  # a draft vocabulary: the bias is applied to its columns
    token = int(ids[7])
    params = SamplingParams(temperature=0, max_tokens=13, ignore_eos=True,
                            logit_bias={token: 40.0})  # fmt: skip
    want = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, params)]
    assert all(w == [token] * 13 for w in want)
    got = spec.generate(PROMPTS, params)
    assert [o.outputs[0].token_ids for o in got] == want
    stats = spec.engine.spec_stats
    depth = extra["num_speculative_tokens"]
    assert stats.num_drafts == 4 * 3  # 1 prefill token, then 3 drafts + 1 a step
    assert stats.num_accepted_tokens == 4 * 3 * depth


def test_a_short_cache_gives_smaller_draft_trees(plain, tiny_llama_dir, heads):
    """Where a request's 9-node Medusa tree does not fit the cache, it drafts the deepest
    pruned tree its slots hold instead of none; nothing is lost."""
    root, _ = heads
    tree = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1], [0, 0, 0, 0]]
    small = LLM(
        str(tiny_llama_dir),
        kv_cache_memory_gb=7 * 16 * 512 / 2**30,  # 6 blocks of 16
        speculative_config={"method": "medusa", "model": str(root / "medusa"),
                            "speculative_token_tree": tree},
        speculative_policy="static",
    )  # fmt: skip
    engine = small.engine
    assert [engine.drafter.max_nodes(k) for k in range(5)] == [0, 3, 6, 8, 9]
    fitted, fit = [], engine.drafter.fit  # (depth asked, slots held, depth drafted)
    engine.drafter.fit = lambda k, slots: fitted.append((k, slots, fit(k, slots))) or fitted[-1][2]
    sizes, propose = [], engine.drafter.propose
    engine.drafter.propose = lambda seqs, budgets: [
        sizes.append(p.num_drafts) or p for p in propose(seqs, budgets)
    ]
    prompts = ["say 1 2 3 and more", "A"]
    want = plain.generate(prompts, greedy(36))
    got = small.generate(prompts, greedy(36))
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert engine.scheduler.num_preemptions == 0
    assert [f for f in fitted if 0 < f[2] < f[0]], fitted
    assert all(engine.drafter.max_nodes(depth) <= slots for _, slots, depth in fitted)
    assert any(0 < n < 9 for n in sizes) and 9 in sizes, sizes


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_a_head_drafts_after_a_cached_prefix(plain, tiny_llama_dir, heads, method):
    """A request whose first blocks come from the prefix cache has no target features there.
    The head's own entries for them are cached too: it finds them and drafts as it would have
    with the whole history. Where some are gone, it keeps those it finds, leaves a gap, and
    still drafts. Plain decoding's tokens either way."""
    root, _ = heads
    config = {"method": method, "model": str(root / method)}
    spec, off = (
        LLM(str(tiny_llama_dir), speculative_policy="static", speculative_config=config,
            enable_prefix_caching=caching)
        for caching in (True, False)
    )  # fmt: skip
    assert spec.engine.manager.prefix_caching and spec.engine.drafter.manager.prefix_caching
    shared = "say 1 2 3 say 4 5 6 say 7 8 9 " * 2  # 60 tokens: 3 full blocks
    prompts = [shared + "say 3 1 9", shared + "hello 42"]
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, greedy(30))]
    assert spec.generate(prompts[0], greedy(30))[0].outputs[0].token_ids == want[0]
    drafter = spec.engine.drafter
    bases = []
    find = drafter._find_entries
    drafter._find_entries = lambda seq, st: (find(seq, st), bases.append(st.base))
    out = spec.generate(prompts[1], greedy(30))[0]
    assert out.num_cached_tokens == 48 and out.outputs[0].token_ids == want[1]
    assert bases == [0]  # its entries for the 48 cached positions were found
    ref = off.generate(prompts[1], greedy(30))[0].outputs[0]
    assert out.outputs[0].spec == ref.spec  # the same drafts as with the whole history
    # the head's third block of entries forgotten, the target's blocks still cached: it keeps
    # the two before, leaves a gap where no features were computed, and drafts on
    manager, ids = drafter.manager, spec.encode(prompts[1])
    key = drafter._chain_start(spec.engine.make_sequence(ids, greedy(1)))
    for i in range(3):
        key = manager.chain(key, ids[16 * i + 1 : 16 * i + 17])
    block = manager._by_hash.pop(key)  # as an eviction does: a plain free block again
    del manager._hash_of[block], manager._cached[block]
    manager._free.add(block)
    manager._heap = sorted(manager._free)
    fed, forward = [], drafter._forward
    drafter._forward = lambda *a, **k: (fed.append(list(a[4])), forward(*a, **k))[1]
    out = spec.generate(prompts[1], greedy(30))[0]
    assert out.num_cached_tokens == 64  # (its own first run registered one block more)
    assert bases[-1] == 64 - 32  # two blocks of entries found
    assert fed[0][0] == 64  # the next entry at its target position, past the gap
    assert out.outputs[0].token_ids == want[1]
    assert out.outputs[0].spec["num_accepted_tokens"] > 0
    # a request that never drafted (one token) still leaves its entries for the next turn
    first = "hello 42 say 5 5 5 hello 42 say 6 6 6 hello"  # 43 tokens: 2 full blocks
    spec.generate(first, greedy(1))
    out = spec.generate(first + " 42 say 3 1 9", greedy(8))[0]
    assert out.num_cached_tokens == 32 and bases[-1] == 0


@pytest.mark.parametrize("method,extra", CONFIGS)
def test_greedy_equals_plain(plain, tiny_llama_dir, heads, method, extra):
    root, _ = heads
    spec = LLM(
        str(tiny_llama_dir),
        speculative_config={"method": method, "model": str(root / method), **extra},
        speculative_policy="static",
    )
    if "prompt_lookup_tokens" in extra:  # the whole branch every step, whatever the step times
        spec.engine.drafter.step_time = None
    want = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, greedy(30))]
    assert [o.outputs[0].token_ids for o in spec.generate(PROMPTS, greedy(30))] == want
    for prompt, w in zip(PROMPTS, want, strict=True):  # batch 1
        assert spec.generate(prompt, greedy(30))[0].outputs[0].token_ids == w
    # and the logprobs bit for bit: a tree's masked columns do not change how a node's
    # attention sums (they shifted its keys to other vector lanes: ~1e-5 apart)
    lp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=3)

    def logprobs(llm):
        outs = llm.generate(PROMPTS, lp)
        return [[{t: x.logprob for t, x in d.items()} for d in o.outputs[0].logprobs] for o in outs]

    assert logprobs(spec) == logprobs(plain)
    stats = spec.engine.spec_stats
    assert stats.num_draft_tokens > 0
    assert stats.num_accepted_tokens > 0, "the test must exercise accepted drafts"
    if "prompt_lookup_tokens" in extra:  # and the branch's own nodes were kept at times
        branch = spec.engine.drafter.branch_stats
        assert branch.steps > 0 and branch.accepted > 0, branch
        from types import SimpleNamespace

        from specdecode.serving.metrics import _EngineCollector

        served = SimpleNamespace(engine=spec.engine, num_finished_requests=0,
                                 num_failed_requests=0)  # fmt: skip
        found = {m.name: m.samples[0].value for m in _EngineCollector(served, "t").collect()}
        assert found["specdecode:lookup_branch_accepted_tokens"] == branch.accepted
        assert spec.engine.num_tracked() == 0  # the wrapper's per-request state is released
        assert spec.engine.drafter.expected_nodes(3) < spec.engine.drafter.max_nodes(3)


@pytest.mark.parametrize(
    "method,policy,source",
    [
        ("eagle", "static", "ngram"),
        ("eagle3", "adaptive", "ngram"),
        ("medusa", "static", "ngram"),
        ("eagle", "static", "suffix"),
    ],
)
def test_seeded_sampling_with_a_lookup_branch_gives_the_plain_tokens(
    plain, tiny_llama_dir, heads, method, policy, source
):
    """A head's tree with a grafted lookup branch is still deterministic drafts, verified by the
    target's own position-seeded draw: seeded sampled requests get plain decoding's tokens,
    batched and alone, whichever path of the union the target took."""
    root, _ = heads
    spec = LLM(
        str(tiny_llama_dir),
        speculative_config={
            "method": method,
            "model": str(root / method),
            "prompt_lookup_tokens": 6,
            "prompt_lookup_method": source,
            **({"prompt_lookup_min": 1} if source == "ngram" else {}),
        },
        speculative_policy=policy,
    )
    params = seeded_params(5, 40, ((0.3, 3), (0.7, 0), (1.0, 2), (0.5, 5)))
    if policy == "static":  # the whole branch every step: what is verified does not depend on
        # this machine's step times (the cut and the head skipping have their own unit tests)
        spec.engine.drafter.step_time = None
    if source == "suffix":  # a corpus of these answers: the branch follows them
        spec.generate(PROMPTS, params)
    assert_seeded_outputs_match(plain, spec, PROMPTS, params, alone=2)
    if policy == "static":  # adaptive may rightly decide not to draft on this tiny model
        assert spec.engine.drafter.branch_stats.accepted > 0
    assert spec.engine.num_tracked() == 0


def test_sampled_outputs_are_seeded_and_in_support(tiny_llama_dir, heads):
    root, _ = heads
    spec = LLM(
        str(tiny_llama_dir),
        speculative_config={"method": "eagle", "model": str(root / "eagle"), "topk": 2},
    )
    params = SamplingParams(temperature=1.0, top_k=3, max_tokens=20, seed=7, ignore_eos=True)
    a = spec.generate(PROMPTS, params)
    b = spec.generate(PROMPTS, params)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]


def test_wrong_head_kind_and_missing_head_are_clear_errors(tiny_llama_dir, heads, tmp_path):
    root, _ = heads
    with pytest.raises(InvalidRequestError, match="not 'eagle'"):
        LLM(
            str(tiny_llama_dir),
            speculative_config={"method": "eagle", "model": str(root / "medusa")},
        )
    with pytest.raises(InvalidRequestError, match="does not exist"):
        LLM(
            str(tiny_llama_dir),
            speculative_config={"method": "medusa", "model": str(tmp_path / "x")},
        )
    with pytest.raises(InvalidRequestError, match="needs a head directory"):
        LLM(str(tiny_llama_dir), speculative_config={"method": "medusa"})
    cfg = json.loads((root / "eagle" / "config.json").read_text())
    assert cfg["specdecode_head"]["kind"] == "eagle" and cfg["num_hidden_layers"] == 1


def test_medusa_deeper_than_its_heads_says_so(plain, tiny_llama_dir, heads, caplog):
    root, _ = heads
    num_heads = json.loads((root / "medusa" / "config.json").read_text())["medusa_num_heads"]
    with caplog.at_level("INFO", logger="specdecode.drafters.medusa"):
        llm = LLM(
            str(tiny_llama_dir),
            share_model_with=plain,
            speculative_config={
                "method": "medusa",
                "model": str(root / "medusa"),
                "num_speculative_tokens": num_heads + 3,
            },
        )
    assert max(llm.engine.drafter.tree.depths) == num_heads
    assert f"{num_heads} heads draft at most {num_heads} tokens deep" in caplog.text
    deep = [[0] * (d + 1) for d in range(num_heads + 1)]  # a static tree a depth too deep
    with pytest.raises(InvalidRequestError, match=f"has only {num_heads} heads"):
        LLM(str(tiny_llama_dir), share_model_with=plain,
            speculative_config={"method": "medusa", "model": str(root / "medusa"),
                                "speculative_token_tree": deep})  # fmt: skip


@pytest.mark.parametrize(
    "dtype, kernels, message",
    [
        ("int8", "off", "needs the CPU kernels"),
        ("bfloat16", "off", "it needs them"),
        ("float16", "auto", "float32, bfloat16, int8 or int4"),
    ],
)
def test_a_heads_draft_dtype_is_refused_where_it_would_be_dropped(
    tiny_llama_dir, heads, dtype, kernels, message
):
    root, _ = heads
    with pytest.raises(InvalidRequestError, match=message):
        LLM(str(tiny_llama_dir), kernels=kernels,
            speculative_config={"method": "eagle3", "model": str(root / "eagle3"),
                                "draft_dtype": dtype})  # fmt: skip


def test_continuing_the_wrong_run_says_what_is_wrong(heads, tiny_llama_dir, tmp_path):
    from specdecode.models.loader import load_model
    from specdecode.train.heads import resume_config

    root, _ = heads
    target = load_model(tiny_llama_dir).model.requires_grad_(False)
    cfg = HeadTrainConfig(draft_vocab=64, steps=1, batch_tokens=256, eval_examples=8,
                          init=str(root / "eagle3"))  # fmt: skip
    with pytest.raises(DataError, match=r"another kind of head \(Eagle3Head\)"):
        train_eagle(target, root / "data", tmp_path / "e", cfg, [2])
    with pytest.raises(DataError, match="nothing to resume: .* does not exist"):
        resume_config(tmp_path / "nowhere", "eagle3")


def test_training_continues_from_a_head(heads, tiny_llama_dir, tmp_path):
    """--init loads an earlier run: the new run starts where the old one ended."""
    from specdecode.models.head_io import load_head
    from specdecode.models.loader import load_model

    root, history = heads
    target = load_model(tiny_llama_dir).model.requires_grad_(False)
    cfg = HeadTrainConfig(
        draft_vocab=100,  # ignored: the head keeps its own vocabulary (64), and says so
        steps=2,
        batch_tokens=512,
        warmup=1,
        eval_examples=8,
        init=str(root / "eagle"),
    )
    again = train_eagle(target, root / "data", tmp_path / "e", cfg, [2])
    assert again["config"]["draft_vocab"] == 64
    before, after = history["eagle"]["before"], history["eagle"]["after"]
    assert after["top1_per_step"][0] > before["top1_per_step"][0] + 0.3  # it did learn
    # (checkpoints are bf16, so the restart is close to, not exactly, where it ended)
    assert again["before"]["top1_per_step"][0] == pytest.approx(after["top1_per_step"][0], abs=0.1)
    # a head whose fc has a bias (SafeAILab's layout; SGLang's export adds a zero one) too
    from specdecode.export import export_head

    export_head(root / "eagle", target, "sglang", tmp_path / "sg")
    cfg = HeadTrainConfig(draft_vocab=64, steps=1, batch_tokens=512, warmup=1, eval_examples=8,
                          init=str(tmp_path / "sg"))  # fmt: skip
    assert train_eagle(target, root / "data", tmp_path / "e3", cfg, [2])["steps_done"] == 1
    # a Medusa head keeps its own number of heads (a default --num-heads of 4 asked for a 5th)
    cfg = HeadTrainConfig(draft_vocab=64, steps=1, batch_tokens=512, warmup=1, eval_examples=8,
                          num_heads=5, init=str(root / "medusa"))  # fmt: skip
    got = train_medusa(target, root / "data", tmp_path / "m", cfg, [2])
    assert got["steps_done"] == 1 and load_head(tmp_path / "m", target).num_heads == 4


def test_training_stops_at_its_time_budget(heads, tiny_llama_dir, tmp_path):
    from specdecode.models.loader import load_model

    root, _ = heads
    target = load_model(tiny_llama_dir).model.requires_grad_(False)
    cfg = HeadTrainConfig(
        draft_vocab=64, steps=500, batch_tokens=512, warmup=1, eval_examples=8, max_minutes=1e-4
    )
    history = train_eagle(target, root / "data", tmp_path / "e", cfg, [2])
    assert 1 <= history["steps_done"] < 500
    assert (tmp_path / "e" / "config.json").exists()  # still evaluated and saved


def _fail_at(monkeypatch, call: int, exc: BaseException, drawn: bool = False):
    """Training's `call`-th batch raises `exc` (a Ctrl-C, a kill), before it is drawn or, with
    `drawn`, once it was (taken from the data order); returns the real batcher."""
    from specdecode.train import heads as train_heads

    real, calls = train_heads._Trainer.next_batch, []

    def failing(self, extra):
        calls.append(1)
        if len(calls) == call:
            if drawn:
                real(self, extra)
            raise exc
        return real(self, extra)

    monkeypatch.setattr(train_heads._Trainer, "next_batch", failing)
    return real


def test_batches_with_no_answer_within_max_len_are_skipped(heads, tiny_llama_dir, tmp_path):
    """--max-len shorter than the prompts leaves nothing to learn in a batch: each such step is
    skipped, not a crash (Medusa, EAGLE-3) or a NaN loss (EAGLE-1); where every one was, nothing
    was trained and no head is saved as if it had been (a review got an untrained head, exit 0,
    and held-out metrics of "ce 0.0" over no token)."""
    from specdecode.models.loader import load_model
    from specdecode.train.heads import _held_out

    root, _ = heads
    target = load_model(tiny_llama_dir).model.requires_grad_(False)
    cfg = HeadTrainConfig(draft_vocab=64, steps=3, batch_tokens=512, warmup=1, eval_examples=8,
                          max_len=8)  # fmt: skip
    for train in (train_medusa, train_eagle, train_eagle3):
        out = tmp_path / train.__name__
        with pytest.raises(DataError, match="nothing was trained; raise --max-len"):
            train(target, root / "data", out, cfg, [2])
        assert not (out / "config.json").exists()
    assert _held_out("ce", 0.0, [0.0, 0.0], [0, 0], "top1_per_step") == {
        "ce": None,
        "top1_per_step": [None, None],
        "held_out_tokens": 0,
    }
    assert _held_out("loss", 3.0, [1.0, 0.0], [2, 0], "top1_per_head") == {
        "loss": 1.5,
        "top1_per_head": [0.5, None],
        "held_out_tokens": 2,
    }


def test_ctrl_c_stops_training_and_saves_the_head(heads, tiny_llama_dir, tmp_path, monkeypatch):
    from specdecode.models.head_io import load_head
    from specdecode.models.loader import load_model

    root, _ = heads
    target = load_model(tiny_llama_dir).model.requires_grad_(False)
    _fail_at(monkeypatch, 3, KeyboardInterrupt())
    cfg = HeadTrainConfig(draft_vocab=64, steps=50, batch_tokens=512, warmup=1, eval_examples=8)
    history = train_medusa(target, root / "data", tmp_path / "m", cfg, [2])
    assert history["steps_done"] == 2 and history["stopped_by"] == "interrupt"
    assert "top1_per_head" in history["after"]  # evaluated, then saved
    assert type(load_head(tmp_path / "m", target)).__name__ == "MedusaHeads"


def test_a_killed_run_keeps_its_last_checkpoint(heads, tiny_llama_dir, tmp_path, monkeypatch):
    """With checkpoints every step, a run that dies at step 4 leaves the head of step 3 on
    disk, loadable and continuable (`init`)."""
    from specdecode.models.head_io import load_head
    from specdecode.models.loader import load_model
    from specdecode.train import heads as train_heads

    root, _ = heads
    target = load_model(tiny_llama_dir).model.requires_grad_(False)
    real = _fail_at(monkeypatch, 4, MemoryError("killed"))
    cfg = HeadTrainConfig(
        draft_vocab=64, steps=50, batch_tokens=512, warmup=1, eval_examples=8,
        checkpoint_minutes=0.0,
    )  # fmt: skip
    with pytest.raises(MemoryError):
        train_eagle(target, root / "data", tmp_path / "e", cfg, [2])
    saved = json.loads((tmp_path / "e" / "training.json").read_text())
    assert saved["checkpoint"] and saved["steps_done"] == 3
    assert load_head(tmp_path / "e", target).kind == "eagle"
    assert not list((tmp_path / "e").glob("*.tmp"))
    monkeypatch.setattr(train_heads._Trainer, "next_batch", real)
    cfg = HeadTrainConfig(
        draft_vocab=64, steps=1, batch_tokens=512, warmup=1, eval_examples=8,
        init=str(tmp_path / "e"),
    )  # fmt: skip
    assert train_eagle(target, root / "data", tmp_path / "e2", cfg, [2])["steps_done"] == 1


@pytest.mark.parametrize(
    "kind,stop", [("medusa", "kill"), ("eagle", "kill"), ("eagle3", "kill"), ("eagle", "ctrl-c")]
)
def test_a_killed_run_resumes_where_it_stopped(
    heads, plain, tiny_llama_dir, tmp_path, monkeypatch, kind, stop
):
    """Killed at step 5 with a checkpoint every step (or stopped by Ctrl-C once step 5 drew its
    batch), then resumed: the run goes on from step 4 with its optimizer moments, schedule,
    data order and random streams, and ends with the weights of a run never stopped, bit for
    bit."""
    from safetensors.torch import load_file

    from specdecode.models.loader import load_model
    from specdecode.train import heads as train_heads
    from specdecode.train.heads import STATE_FILE, resume_config

    root, _ = heads
    train = {"medusa": train_medusa, "eagle": train_eagle, "eagle3": train_eagle3}[kind]
    target = load_model(tiny_llama_dir).model.requires_grad_(False)
    cfg = HeadTrainConfig(draft_vocab=64, steps=7, batch_tokens=256, warmup=2, eval_examples=8,
                          checkpoint_minutes=0.0)  # fmt: skip
    whole = train(target, root / "data", tmp_path / "whole", cfg, [2])
    assert whole["steps_done"] == 7
    if stop == "kill":
        real = _fail_at(monkeypatch, 5, MemoryError("killed"))
        with pytest.raises(MemoryError):
            train(target, root / "data", tmp_path / "cut", cfg, [2])
    else:  # evaluated and saved as it stands, the cut step's batch back in the order
        real = _fail_at(monkeypatch, 5, KeyboardInterrupt(), drawn=True)
        cut = train(target, root / "data", tmp_path / "cut", cfg, [2])
        assert cut["stopped_by"] == "interrupt" and cut["steps_done"] == 4
    monkeypatch.setattr(train_heads._Trainer, "next_batch", real)
    with pytest.raises(DataError, match="holds a"):
        resume_config(tmp_path / "cut", "medusa" if kind != "medusa" else "eagle")
    again = resume_config(tmp_path / "cut", kind, checkpoint_minutes=None)
    assert again.resume and again.steps == 7 and again.checkpoint_minutes == 0.0
    resumed = train(target, root / "data", tmp_path / "cut", again, [2])
    assert resumed["resumed_at_step"] == 4 and resumed["steps_done"] == 7
    assert resumed["before"] == whole["before"]  # the run's own start, not re-measured
    a = load_file(tmp_path / "whole" / STATE_FILE)
    b = load_file(tmp_path / "cut" / STATE_FILE)
    weights = [k for k in a if k.startswith(("weights.", "optimizer."))]
    assert weights and all(torch.equal(a[k], b[k]) for k in weights)
    assert resumed["after"] == whole["after"]
    # nothing to resume, or another run's data: clear errors
    with pytest.raises(DataError, match="no run to resume"):
        resume_config(tmp_path, kind)
    other = tmp_path / "other"
    convs = [(f"o{i}", [{"role": "user", "content": f"say {i}"}]) for i in range(12)]
    generate(plain, convs, other, shard_size=16, max_tokens=8, feature_layers=(0, 1))
    with pytest.raises(DataError, match="same data"):
        train(target, [root / "data", other], tmp_path / "cut", again, [2])
    if kind == "medusa" and stop == "kill":  # (once)
        # as many examples, other conversations: the saved order would index other data
        same_size = [
            (f"x{i}", [{"role": "user", "content": f"say {i % 7} {i % 5} {i}"}]) for i in range(40)
        ]  # (train_tiny_heads' prompts under other ids)
        generate(plain, same_size, tmp_path / "x", shard_size=16, max_tokens=24,
                 feature_layers=(0, 1))  # fmt: skip
        with pytest.raises(DataError, match="other ones, or in another order"):
            train(target, tmp_path / "x", tmp_path / "cut", again, [2])
        state = tmp_path / "cut" / STATE_FILE
        state.write_bytes(state.read_bytes()[:64])
        with pytest.raises(DataError, match="cannot be read"):
            train(target, root / "data", tmp_path / "cut", again, [2])


def test_train_resume_from_the_command_line(heads, tiny_llama_dir, tmp_path, capsys):
    """`train ... --resume` continues the run in --out with its own settings; --steps raises
    them (the schedule follows the new length from the step reached). A setting given another
    value is refused, not ignored; the same value, or a flag left at its default, is fine. A run
    that used its time budget says so, and resuming it needs a larger one."""
    from specdecode.cli import main

    root, _ = heads
    common = ["train", "eagle3", "--model", str(tiny_llama_dir), "--data", str(root / "data"),
              "--out", str(tmp_path / "h"), "--batch-tokens", "256",
              "--eval-examples", "8"]  # fmt: skip
    assert main([*common, "--steps", "2", "--draft-vocab", "64", "--lr", "0.002"]) == 0
    capsys.readouterr()
    assert main([*common, "--resume", "--steps", "3", "--lr", "0.5", "--ttt-steps", "2"]) == 2
    assert "--lr, --ttt-steps: --resume continues the run" in capsys.readouterr().err
    assert main([*common, "--resume", "--steps", "3", "--lr", "0.002"]) == 0
    saved = json.loads((tmp_path / "h" / "training.json").read_text())
    assert saved["resumed_at_step"] == 2 and saved["steps_done"] == 3
    assert saved["config"]["lr"] == 0.002 and saved["config"]["steps"] == 3  # its own, raised
    assert saved["config"]["draft_vocab"] == 64
    timed = ["--out", str(tmp_path / "t"), "--steps", "500", "--max-minutes", "0.002"]
    assert main([*common[:-6], *common[-4:], *timed]) == 0
    run = json.loads((tmp_path / "t" / "training.json").read_text())
    assert run["stopped_by"] == "time budget of 0.002 minutes" and run["steps_done"] < 500
    assert "`--resume` with a larger --max-minutes goes on" in capsys.readouterr().err
    resumed = [*common[:-6], *common[-4:], "--out", str(tmp_path / "t"), "--resume"]
    assert main(resumed) == 2
    assert "has used its time budget of 0.002 minutes" in capsys.readouterr().err
    more = ["--max-minutes", "5", "--steps", str(run["steps_done"] + 2)]  # (2 more steps)
    assert main([*resumed, *more]) == 0
    run = json.loads((tmp_path / "t" / "training.json").read_text())
    assert run["stopped_by"] == "steps"


def test_one_head_trains_on_two_data_sets_and_reports_each(heads, plain, tiny_llama_dir, tmp_path):
    from specdecode.models.loader import load_model

    root, _ = heads
    convs = [(f"k{i}", [{"role": "user", "content": f"def f{i}(): {i % 3}"}]) for i in range(12)]
    generate(plain, convs, tmp_path / "code", shard_size=16, max_tokens=16, feature_layers=(0, 1))
    target = load_model(tiny_llama_dir).model.requires_grad_(False)
    cfg = HeadTrainConfig(draft_vocab=64, steps=2, batch_tokens=512, warmup=1, eval_examples=4)
    history = train_eagle3(target, [root / "data", tmp_path / "code"], tmp_path / "h", cfg, [2])
    assert history["held_out_examples"] == 8
    assert history["train_examples"] == 36 + 8  # 40 and 12, 4 of each held out
    for when in ("before", "after"):
        by_set = history[when]["by_data_set"]
        assert list(by_set) == ["data", "code"]
        assert all(len(m["top1_per_step"]) == 4 for m in by_set.values())
    # the same set twice: its held-out conversations count once in the overall metrics
    cfg.steps = 1
    twice = train_eagle3(target, [tmp_path / "code"] * 2, tmp_path / "h2", cfg, [2])
    assert (
        twice["held_out_examples"] == 4
        and twice["after"]["held_out_tokens"]
        == (twice["after"]["by_data_set"]["code"]["held_out_tokens"])
    )


def test_an_eagle_heads_catch_up_is_what_it_has_not_run(plain, tiny_llama_dir, heads):
    """The prompt's features before the first draft, nothing after a drafting step (its root
    and accepted nodes are routine), then every token committed while the request was kept
    plain, until the head drafts again."""
    root, _ = heads
    spec = LLM(
        str(tiny_llama_dir),
        speculative_config={"method": "eagle3", "model": str(root / "eagle3"), "topk": 1},
        speculative_policy="static",
    )
    engine, drafter = spec.engine, spec.engine.drafter
    recorded = []  # the catch-up each timed proposal is fitted with
    record = engine.controller.record_draft
    engine.controller.record_draft = lambda d, s, c=0: (recorded.append(c), record(d, s, c))
    ids = spec.encode(PROMPTS[0])
    seq = engine.add_request(ids, greedy(12))
    engine.step()  # prefill: the head has seen nothing yet
    assert drafter.catch_up_tokens(seq) == len(ids) - 1
    engine.step()  # drafted: caught up; the root and accepted nodes it brings are routine
    assert drafter.catch_up_tokens(seq) == 0 and recorded == [len(ids) - 1]
    plan = engine.controller.plan
    engine.controller.plan = lambda seqs, *a, **kw: [0 for _ in plan(seqs, *a, **kw)]
    for n in range(1, 5):  # kept plain by the plan: every committed token is catch-up
        engine.step()
        assert drafter.catch_up_tokens(seq) == n
    engine.controller.plan = plan
    engine.step()
    assert recorded[-1] == 4
    while not seq.finished:
        engine.step()
    want = plain.generate({"prompt_token_ids": ids}, greedy(12))[0].outputs[0].token_ids
    assert seq.output_token_ids == want


def test_lite_drafts_verify_the_lookup_alone_and_leave_the_head_alone(plain, tiny_llama_dir, heads):
    """Where the controller plans lite drafts (a negative depth), the step verifies the lookup
    branch alone: greedy output unchanged, the head neither runs nor hears of them (what they
    commit is catch-up for it), and their outcomes enter the lite estimates only."""
    spec = eagle3(tiny_llama_dir, heads, prompt_lookup_tokens=6, prompt_lookup_min=1)
    engine, drafter = spec.engine, spec.engine.drafter
    ctrl = engine.controller
    assert ctrl.policy == "adaptive" and ctrl.lite_depth == 6
    plan = ctrl.plan

    def lite_plan(seqs, *a):  # lite drafts only: no shadows beside them (their proposals are
        budgets = plan(seqs, *a)  # recorded too, and whether one is taken depends on timing)
        ctrl.shadow_requests = []
        return [-6 for _ in budgets]

    ctrl.plan = lite_plan
    calls = []
    for name in ("propose", "on_verified"):
        real = getattr(drafter.head, name)
        setattr(drafter.head, name, lambda *a, real=real, n=name: (calls.append(n), real(*a))[1])
    proposed, verified = [], []  # lite budgets: what they fed, and the depth counted
    record_proposal, record_verification = ctrl.record_proposal, ctrl.record_verification
    ctrl.record_proposal = lambda s, b, n, lite=False: (
        proposed.append((b, n, lite)),
        record_proposal(s, b, n, lite),
    )
    ctrl.record_verification = lambda s, d, a, lite=False: (
        verified.append((d, lite)),
        record_verification(s, d, a, lite),
    )
    ids = spec.encode(PROMPTS[1] * 4)
    seq = engine.add_request(ids, greedy(24))
    while len(seq.output_token_ids) < 12:
        engine.step()
    assert drafter.catch_up_tokens(seq) == len(ids) + len(seq.output_token_ids) - 2
    while not seq.finished:
        engine.step()
    want = plain.generate({"prompt_token_ids": ids}, greedy(24))[0].outputs[0].token_ids
    assert seq.output_token_ids == want
    stats = engine.spec_stats
    assert stats.num_drafts > 0 and stats.num_accepted_tokens > 0
    assert engine.num_steps < 24  # lite drafts were accepted: fewer steps than tokens
    assert calls == [] and ctrl._workloads == {} and ctrl.num_lite == stats.num_drafts
    # each lite draft's outcome counts against its budget, and the nodes it fed are learnt
    assert proposed and all(lite for *_, lite in proposed) and all(lite for _, lite in verified)
    assert [d for d, _ in verified] == [b for b, n, _ in proposed if n > 0]  # (not the depth)
    assert any(n < b for b, n, _ in proposed) and ctrl._lite_size_workloads
    assert engine.num_tracked() == 0


def test_a_batch_mixing_head_drafts_lite_drafts_and_plain_rows_is_lossless(
    plain, tiny_llama_dir, heads
):
    """One verification holding a head's tree with its branch, a lookup branch alone and plain
    rows, in every combination over the steps, a constrained request among them (its drafts
    pruned by its grammar): greedy outputs stay plain decoding's."""
    spec = eagle3(tiny_llama_dir, heads, topk=2, prompt_lookup_tokens=5, prompt_lookup_min=1)
    ctrl = spec.engine.controller
    spec.engine.drafter.step_time = None  # the head whenever planned, whatever the step times
    plan, step = ctrl.plan, [0]
    cycle = [-5, 3, 0, -2, 1]

    def mixed(seqs, *a):  # (and no shadows beside: whether one is taken depends on timing)
        step[0] += 1
        budgets = plan(seqs, *a)
        ctrl.shadow_requests = []
        return [cycle[(step[0] + j) % len(cycle)] for j, _ in enumerate(budgets)]

    ctrl.plan = mixed
    prompts = [p * 3 for p in PROMPTS] + ["abab abab abab"]
    regex = r"[ab ]{4,12}(cd|ef)"  # the lookup proposes what the grammar partly refuses
    params = [greedy(20)] * len(PROMPTS) + [
        SamplingParams(temperature=0.0, max_tokens=30, structured_output={"regex": regex})
    ]
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    engine, pruned = spec.engine, []
    prune = engine._prune
    engine._prune = lambda i, seq, p: (pruned.append(i in engine._lite), prune(i, seq, p))[1]
    outs = spec.generate(prompts, params)
    assert True in pruned and False in pruned  # lite drafts and a head's tree both pruned
    assert [o.outputs[0].token_ids for o in outs] == want
    assert re.fullmatch(regex, outs[-1].outputs[0].text)
    assert spec.engine.spec_stats.num_accepted_tokens > 0
    assert ctrl._workloads and ctrl.num_lite > 0  # both modes were verified
    assert spec.engine.num_tracked() == 0


def test_a_dynamic_trees_drafting_depth_is_the_levels_the_head_ran(tiny_llama_dir, heads):
    """An EAGLE-2 tree expands `budget` levels and keeps its best nodes, which may reach less
    deep: the draft-cost fit is given the levels run (the time spent), not the kept depth."""
    spec = eagle3(  # two nodes kept: never 5 levels deep
        tiny_llama_dir, heads, "static", num_speculative_tokens=5, topk=4, num_draft_tokens=3
    )
    engine = spec.engine
    recorded = []
    record = engine.controller.record_draft
    engine.controller.record_draft = lambda d, s, c=0: (recorded.append(d), record(d, s, c))
    engine.add_request(spec.encode(PROMPTS[0]), greedy(12))
    engine.step()  # prefill
    engine.step()
    assert recorded == [5] and engine.spec_stats.drafted_per_position[2:] == []
    # read while the head still holds the request: on its last step too, when it finishes
    drafter, held = engine.drafter, []
    depth = drafter.drafted_depth
    drafter.drafted_depth = lambda seq, p: (
        held.append(seq.seq_id in drafter._state),
        depth(seq, p),
    )[1]
    finishing = 0
    for prompt in PROMPTS:
        for n in (5, 6, 7, 8):
            seq = engine.add_request(spec.encode(prompt), greedy(n))
            while not seq.finished:
                before = len(held)
                engine.step()
                finishing += seq.finished and len(held) > before
    assert finishing > 0 and all(held)


def test_data_generation_on_a_drafting_engine_leaves_its_drafter_fed(
    heads, tiny_llama_dir, tmp_path
):
    """`generate` on an engine whose drafter reads target features: data of the drafter's own
    layout is written and the drafter still drafts after; another layout is refused."""
    root, _ = heads
    cfg = {"method": "medusa", "model": str(root / "medusa")}
    spec = LLM(str(tiny_llama_dir), speculative_config=cfg, speculative_policy="static")
    layers = spec.engine.runner.feature_layers
    convs = [(f"c{i}", [{"role": "user", "content": f"say {i}"}]) for i in range(3)]
    with pytest.raises(InvalidRequestError, match="drafter reads features"):
        generate(spec, convs, tmp_path / "other", shard_size=4, max_tokens=8, feature_layers=(0, 1))
    generate(spec, convs, tmp_path / "same", shard_size=4, max_tokens=8, feature_layers=layers)
    assert spec.engine.runner.feature_layers == layers
    before = spec.engine.spec_stats.num_draft_tokens
    spec.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert spec.engine.spec_stats.num_draft_tokens > before


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_a_full_head_cache_stops_only_the_requests_it_cannot_hold(
    plain, tiny_llama_dir, heads, method
):
    """A head cache of 6 blocks (96 entries) holds the short request, never the long one
    (listed first): the long one is verified without drafts, the short one drafts on."""
    from specdecode.cache import BlockManager

    root, _ = heads
    spec = LLM(
        str(tiny_llama_dir),
        speculative_config={"method": method, "model": str(root / method)},
        speculative_policy="static",
    )
    spec.engine.drafter.manager = BlockManager(7, 16)
    prompts = ["abcdefghij" * 12, "say 3 1 9"]
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, greedy(30))]
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, greedy(30))] == want
    assert spec.engine.spec_stats.num_accepted_tokens > 0
    assert spec.engine.drafter.manager.num_free_blocks == 6  # all released


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_training_continues_a_head_shaped_unlike_the_target(heads, tiny_llama_dir, tmp_path, kind):
    """--init from a head whose layer has its own shape (an imported SpecForge or speculators
    head may): the run trains that shape, not the target's."""
    import torch

    from specdecode.models.head_io import head_layer_config, load_head, save_head
    from specdecode.models.heads import Eagle3Head, EagleHead
    from specdecode.models.loader import load_model

    root, _ = heads
    target = load_model(tiny_llama_dir).model.requires_grad_(False)
    own = dict(intermediate_size=80, num_attention_heads=2, num_key_value_heads=1, head_dim=24)
    layer = head_layer_config(own, target.config)
    vocab = torch.arange(64)
    if kind == "eagle":
        head = EagleHead(layer)
        head.attach(target.embed_tokens, target.lm_head.weight[vocab], vocab)
    else:
        head = Eagle3Head(layer, 64, (0, 1))
        head.attach(target.embed_tokens, vocab)
    save_head(head, tmp_path / "own", target.config, {})
    cfg = HeadTrainConfig(steps=2, batch_tokens=512, warmup=1, eval_examples=8,
                          init=str(tmp_path / "own"))  # fmt: skip
    train = train_eagle if kind == "eagle" else train_eagle3
    assert train(target, root / "data", tmp_path / "next", cfg, [2])["steps_done"] == 2
    assert load_head(tmp_path / "next", target).config == load_head(tmp_path / "own", target).config


def test_data_of_another_target_is_refused_and_long_prompts_are_skipped(heads, plain, tmp_path):
    """Features made by another model (here hidden size 64, the target 32) are refused before
    training; a prompt that leaves no room for an answer in the context is skipped by data
    generation (it stopped the whole run)."""
    from helpers import HEAD_TARGET_CONFIG

    from specdecode.models.llama import LlamaModel

    root, _ = heads
    other = LlamaModel(HEAD_TARGET_CONFIG).eval().requires_grad_(False)
    cfg = HeadTrainConfig(steps=1, batch_tokens=256, warmup=1, eval_examples=8)
    with pytest.raises(DataError, match="not this target's"):
        train_medusa(other, root / "data", tmp_path / "m", cfg, [2])
    long = "z" * (plain.engine.max_model_len + 10)
    convs = [(f"s{i}", [{"role": "user", "content": c}]) for i, c in enumerate(["hi", long, "yo"])]
    [shard] = generate(
        plain, convs, tmp_path / "d", shard_size=4, max_tokens=4, feature_layers=(0,)
    )
    from specdecode.train.datagen import iter_examples

    assert [e.conversation_id for e in iter_examples(shard.parent)] == ["s0", "s2"]


def test_a_full_vocabulary_eagle3_head_continues_training(heads, tiny_llama_dir, tmp_path):
    """An EAGLE-3 head over the whole vocabulary is exported without d2t (as vLLM wants it);
    a run continued from that export (--init) has the same vocabulary (it was refused as
    another)."""
    from specdecode.models.loader import load_model

    root, _ = heads
    target = load_model(tiny_llama_dir).model.requires_grad_(False)
    cfg = HeadTrainConfig(draft_vocab=0, steps=1, batch_tokens=256, warmup=1, eval_examples=8)
    train_eagle3(target, root / "data", tmp_path / "full", cfg, [2])
    from specdecode.export import export_head

    export_head(tmp_path / "full", target, "vllm", tmp_path / "vllm")  # no d2t: all ids
    cfg = HeadTrainConfig(**{**cfg.__dict__, "init": str(tmp_path / "vllm")})
    assert train_eagle3(target, root / "data", tmp_path / "next", cfg, [2])["steps_done"] == 1


def test_heads_train_on_a_qwen3_target_and_export(tmp_path):
    """A Qwen3 target's heads are Llama layers (its q/k norms left out): they train, draft
    token-identically to plain decoding, and export to vLLM."""
    from conftest import _write_byte_tokenizer, make_tiny_hf

    from specdecode.export import export_head
    from specdecode.models.loader import load_model

    make_tiny_hf("qwen3", tmp_path / "model")
    _write_byte_tokenizer(tmp_path / "model")
    plain = LLM(str(tmp_path / "model"))
    convs = [(f"c{i}", [{"role": "user", "content": f"say {i % 7} {i}"}]) for i in range(16)]
    generate(plain, convs, tmp_path / "data", shard_size=16, max_tokens=12, feature_layers=(0, 1))
    target = load_model(tmp_path / "model").model.requires_grad_(False)
    cfg = HeadTrainConfig(draft_vocab=64, steps=2, batch_tokens=256, warmup=1, eval_examples=4)
    want = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, greedy(12))]
    for kind, train in (("eagle", train_eagle), ("eagle3", train_eagle3)):
        train(target, tmp_path / "data", tmp_path / kind, cfg, [2])
        export_head(tmp_path / kind, target, "vllm", tmp_path / f"{kind}-vllm")
        exported = {"method": kind, "model": str(tmp_path / f"{kind}-vllm")}
        spec = LLM(
            str(tmp_path / "model"), speculative_config=exported, speculative_policy="static"
        )
        assert [o.outputs[0].token_ids for o in spec.generate(PROMPTS, greedy(12))] == want
        assert spec.engine.spec_stats.num_drafts > 0


def test_a_head_reading_the_last_layers_output_drafts_losslessly(plain, tiny_llama_dir, tmp_path):
    """Feature layer N (one past the last: the last layer's output before the final norm, which
    speculators' `--include-last-layer` heads read): data stores it, a head trains on it and
    drafts from it, token-identical to plain decoding."""
    from specdecode.models.loader import load_model

    convs = [
        (f"c{i}", [{"role": "user", "content": f"say {i % 7} {i % 5} {i}"}]) for i in range(24)
    ]
    generate(plain, convs, tmp_path / "data", shard_size=12, max_tokens=24, feature_layers=(1, 2))
    target = load_model(tiny_llama_dir).model.requires_grad_(False)
    cfg = HeadTrainConfig(
        draft_vocab=64, steps=40, batch_tokens=512, lr=3e-3, warmup=5, eval_examples=8
    )
    train_eagle3(target, tmp_path / "data", tmp_path / "head", cfg, [2])
    written = json.loads((tmp_path / "head" / "config.json").read_text())
    assert written["eagle_aux_hidden_state_layer_ids"] == [1, 2]
    spec = LLM(
        str(tiny_llama_dir),
        speculative_config={"method": "eagle3", "model": str(tmp_path / "head"), "topk": 1},
        speculative_policy="static",
    )
    assert spec.engine.runner.feature_layers == (1, 2)
    want = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, greedy(24))]
    assert [o.outputs[0].token_ids for o in spec.generate(PROMPTS, greedy(24))] == want
    assert spec.engine.spec_stats.num_accepted_tokens > 0


def test_an_eagle3_variant_head_continues_training_as_that_variant(
    heads, tiny_llama_dir, tmp_path, capsys
):
    """--init from a head with speculators' variants (as an imported EAGLE 3.1 checkpoint has):
    the run keeps them, and the head it writes says so and loads as one."""
    from specdecode.models.head_io import load_head, save_head
    from specdecode.models.loader import load_model

    root, _ = heads
    target = load_model(tiny_llama_dir).model.requires_grad_(False)
    head = load_head(root / "eagle3", target)
    trained = {k: v.clone() for k, v in head.state_dict().items()}
    head.set_variant(norm_before_fc=True, norm_output=True)
    head.load_state_dict(trained, strict=False)
    save_head(head, tmp_path / "variant", target.config, {})
    cfg = HeadTrainConfig(draft_vocab=64, steps=3, batch_tokens=512, warmup=1, eval_examples=8,
                          lr=3e-2, init=str(tmp_path / "variant"))  # fmt: skip
    assert train_eagle3(target, root / "data", tmp_path / "out", cfg, [2])["steps_done"] == 3
    # the bar shows the first step's ce beside the weighted loss, as held out reports it
    assert re.search(r"ce=[\d.]+, loss=[\d.]+", capsys.readouterr().err)
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written["norm_before_fc"] is True and written["norm_output"] is True
    again = load_head(tmp_path / "out", target)
    assert again.variant == {**head.variant}
    assert not torch.equal(
        again.input_norm.weight, head.input_norm.weight.to(torch.bfloat16).float()
    )


def test_eagle3_trains_as_a_speculators_variant(plain, heads, tiny_llama_dir, tmp_path):
    """`train eagle3 --variant norm_before_fc,norm_output` (speculators 0.9's default recipe):
    the head trains, says so in its config, loads as one, and drafts losslessly."""
    from specdecode.models.loader import load_model
    from specdecode.train.heads import variant_flags

    root, _ = heads
    target = load_model(tiny_llama_dir).model.requires_grad_(False)
    cfg = HeadTrainConfig(draft_vocab=64, steps=30, batch_tokens=512, lr=3e-3, warmup=5,
                          eval_examples=8, variant="norm_before_fc, norm_output")  # fmt: skip
    history = train_eagle3(target, root / "data", tmp_path / "v", cfg, [2])
    assert history["after"]["ce"] < history["before"]["ce"]
    written = json.loads((tmp_path / "v" / "config.json").read_text())
    assert written["norm_before_fc"] is True and written["norm_output"] is True
    spec = LLM(
        str(tiny_llama_dir),
        speculative_config={"method": "eagle3", "model": str(tmp_path / "v"), "topk": 1},
        speculative_policy="static",
    )
    assert spec.engine.drafter.head.variant["norm_output"]
    want = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, greedy(20))]
    assert [o.outputs[0].token_ids for o in spec.generate(PROMPTS, greedy(20))] == want
    with pytest.raises(DataError, match="unknown EAGLE-3 variant"):
        variant_flags("norm_before_fc,typo")
    with pytest.raises(DataError, match="exclude"):
        variant_flags("norm_before_fc,fc_norm")
    again = HeadTrainConfig(draft_vocab=64, steps=1, batch_tokens=512, warmup=1, eval_examples=8,
                            init=str(tmp_path / "v"), variant="fc_norm")  # fmt: skip
    with pytest.raises(DataError, match="keeps its variant"):
        train_eagle3(target, root / "data", tmp_path / "w", again, [2])


def test_policy_off_captures_no_features_and_feeds_the_head_nothing(plain, tiny_llama_dir, heads):
    """Under `off` a head's engine decodes as a plain one: no target features captured, no
    head state. Switched back, a request admitted under `off` drafts from the features it then
    gets (as after a cached prefix); one whose head had begun before has a gap in its features
    and drafts no more. Every output is plain decoding's."""
    spec = eagle3(tiny_llama_dir, heads, policy="static", topk=1)
    engine, drafter = spec.engine, spec.engine.drafter
    assert engine.runner.feature_layers == drafter.feature_layers
    ids = spec.encode(PROMPTS[0])
    want = plain.generate({"prompt_token_ids": ids}, greedy(24))[0].outputs[0].token_ids

    def run(first: str, then: str) -> int:
        engine.set_policy(first)
        seq = engine.add_request(ids, greedy(24))
        for _ in range(3):
            engine.step()
        if first == "off":
            assert engine.runner.feature_layers is None and engine.feature_observers == []
            assert not engine.runner.features and drafter.tracked_ids() == set()
        else:
            engine.set_policy("off")
            engine.step()
        engine.set_policy(then)
        drafts = engine.spec_stats.num_drafts
        engine.step()
        if first != "off":  # a gap for good: its head cache and waiting features go at once
            st = drafter._state[seq.seq_id]
            assert st.broken and not st.blocks.block_table and not st.pending
        while not seq.finished:
            engine.step()
        assert seq.output_token_ids == want and engine.num_tracked() == 0
        return engine.spec_stats.num_drafts - drafts

    assert run("off", "static") > 0
    assert run("static", "static") == 0
    engine.set_policy("static")  # (twice: one observer)
    assert engine.feature_observers.count(drafter.observe) == 1


def test_medusa_drafts_from_no_feature_older_than_its_last_token(plain, tiny_llama_dir, heads):
    """Medusa reads the feature of a request's last committed token. After steps under `off`
    (nothing captured) the one it holds is older: the first step back drafts nothing, the next
    drafts from the fresh one; the output is plain decoding's."""
    root, _ = heads
    spec = LLM(
        str(tiny_llama_dir),
        speculative_config={"method": "medusa", "model": str(root / "medusa")},
        speculative_policy="static",
    )
    engine = spec.engine
    ids = spec.encode(PROMPTS[0])
    want = plain.generate({"prompt_token_ids": ids}, greedy(24))[0].outputs[0].token_ids
    seq = engine.add_request(ids, greedy(24))
    for _ in range(3):
        engine.step()
    engine.set_policy("off")
    engine.step()
    engine.set_policy("static")
    drafts = engine.spec_stats.num_drafts
    engine.step()
    assert engine.spec_stats.num_drafts == drafts  # the feature it held was a step old
    engine.step()
    assert engine.spec_stats.num_drafts > drafts
    while not seq.finished:
        engine.step()
    assert seq.output_token_ids == want and engine.num_tracked() == 0


@pytest.mark.parametrize("method", ["eagle", "medusa"])
def test_a_token_map_from_the_data_keeps_its_rows_and_stays_lossless(
    plain, tiny_llama_dir, heads, method, tmp_path, capsys
):
    """`data token-map` writes the data's most frequent tokens; a head served with it
    (SGLang's --speculative-token-map) drafts from those rows alone (and the end ids), and the
    output stays the target's."""
    from specdecode.cli import main

    root, _ = heads
    path = tmp_path / "map.json"
    assert main(["data", "token-map", "--data", str(root / "data"), "--size", "12",
                 "--out", str(path)]) == 0  # fmt: skip
    assert f"wrote 12 token ids to {path}" in capsys.readouterr().out
    kept = json.loads(path.read_text())
    spec = LLM(
        str(tiny_llama_dir),
        speculative_config={"method": method, "model": str(root / method), "token_map": str(path)},
        speculative_policy="static",
    )
    head = spec.engine.drafter.head if method == "eagle" else spec.engine.drafter.heads
    eos = sorted(spec.engine._eos_ids())
    assert head.vocab_ids.tolist() == sorted({*kept, *eos})
    assert head.proj.weight.shape[0] == len(head.vocab_ids)
    want = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, greedy(30))]
    assert [o.outputs[0].token_ids for o in spec.generate(PROMPTS, greedy(30))] == want
    stats = spec.engine.spec_stats
    assert stats.num_accepted_tokens > 0, "the test must exercise accepted drafts"
    # an EAGLE-3 head's vocabulary is its own: refused, not silently ignored (SGLang's way)
    with pytest.raises(InvalidRequestError, match="own draft vocabulary"):
        LLM(str(tiny_llama_dir), speculative_config={"method": "eagle3", "token_map": str(path)})


def test_data_token_map_says_what_is_wrong(heads, tmp_path):
    from specdecode.cli import main

    root, _ = heads
    out = str(tmp_path / "map.json")
    assert main(["data", "token-map", "--data", str(tmp_path / "none"), "--out", out]) == 2
    assert main(["data", "token-map", "--data", str(root / "data"), "--out",
                 str(tmp_path / "map.pt")]) == 2  # fmt: skip
    assert not (tmp_path / "map.pt").exists() and not (tmp_path / "map.json").exists()
