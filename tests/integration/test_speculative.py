"""Speculative decoding end to end on a tiny model: greedy outputs identical to plain decoding,
sampled outputs identically distributed."""

from __future__ import annotations

import json
import time
from copy import deepcopy

import pytest
import torch
from helpers import assert_seeded_outputs_match, chi_square_pvalue, seeded_params

from specdecode import LLM, SamplingParams
from specdecode.core import Sequence
from specdecode.errors import InvalidRequestError

# Repetitive prompts give the n-gram drafter something to match.
PROMPTS = ["abcabcabcabcabc", "Hello Hello Hello Hello", "xyz", "1212121212121212"]


@pytest.fixture(scope="module")
def plain(tiny_llama_dir):
    return LLM(str(tiny_llama_dir))


def spec_llm(path, **cfg):
    return LLM(
        str(path), speculative_config={"method": "ngram", **cfg}, speculative_policy="static"
    )


def draft_llm(target, draft, k: int, tree=None) -> LLM:
    cfg = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": k}
    if tree is not None:
        cfg["speculative_token_tree"] = tree
    return LLM(str(target), speculative_config=cfg, speculative_policy="static")


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


@pytest.mark.parametrize("k", [1, 3, 5])
def test_ngram_greedy_equals_plain(plain, tiny_llama_dir, k):
    spec = spec_llm(tiny_llama_dir, num_speculative_tokens=k, prompt_lookup_min=1)
    want = plain.generate(PROMPTS, greedy(40))
    got = spec.generate(PROMPTS, greedy(40))  # batched
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    for prompt, w in zip(PROMPTS, want, strict=True):  # batch 1
        assert spec.generate(prompt, greedy(40))[0].outputs[0].token_ids == w.outputs[0].token_ids
    stats = spec.engine.spec_stats
    assert stats.num_accepted_tokens > 0, "the test must exercise accepted drafts"
    assert stats.num_draft_tokens > stats.num_accepted_tokens  # and rejections


def test_stops_inside_an_accepted_run(plain, tiny_llama_dir):
    """max_tokens and stop tokens that fall inside a multi-token step cut it exactly."""
    spec = spec_llm(tiny_llama_dir, num_speculative_tokens=5, prompt_lookup_min=1)
    for n in (1, 2, 7, 13):
        want = plain.generate(PROMPTS, greedy(n))
        got = spec.generate(PROMPTS, greedy(n))
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    full = plain.generate(PROMPTS[0], greedy(30))[0].outputs[0].token_ids
    params = SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[full[9]])
    got = spec.generate(PROMPTS[0], params)[0].outputs[0].token_ids
    assert got == full[: full.index(full[9]) + 1]


def test_drafts_accepted_past_a_stop_are_not_counted(plain, tiny_llama_dir):
    """The target drafting for itself has every draft accepted at T=0; a stop token inside
    such a run ends the request, and the statistics (per request and the engine's) count only
    the drafts emitted, not those accepted after the stop."""
    spec = draft_llm(tiny_llama_dir, tiny_llama_dir, 5)
    full = plain.generate(PROMPTS[0], greedy(40))[0].outputs[0].token_ids
    # a stop token first met 1-4 tokens into a verification step's six (5 drafts + 1): the
    # tokens after the prefill's first come 6 a step
    cut = next(i + 1 for i, t in enumerate(full) if t not in full[:i] and i > 6 and (i - 1) % 6 < 4)
    params = SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[full[cut - 1]])
    before = deepcopy(spec.engine.spec_stats)
    out = spec.generate(PROMPTS[0], params)[0]
    assert out.outputs[0].token_ids == full[:cut]
    steps = -(-(cut - 1) // 6)
    last = cut - 1 - 6 * (steps - 1)  # the last step's tokens up to the stop: all drafts
    assert steps > 1
    got = out.outputs[0].spec
    assert got["num_drafts"] == steps
    assert got["num_accepted_tokens"] == 5 * (steps - 1) + last  # not 5 * steps
    stats = spec.engine.spec_stats
    assert stats.num_accepted_tokens - before.num_accepted_tokens == 5 * (steps - 1) + last
    old = before.accepted_per_position + [0] * (5 - len(before.accepted_per_position))
    kept = [a - b for a, b in zip(stats.accepted_per_position, old, strict=True)]
    assert kept == [steps] * last + [steps - 1] * (5 - last)


def test_sampled_distribution_unchanged(sharp_llama_dir):
    """Chi-square homogeneity test on the first three tokens, 2000 seeded samples each way at
    temperature 1 with top-k and top-p. A correct verifier gives p-values uniform on [0, 1]; we
    fail below 1e-3, and a biased verifier (tested by mutation) falls far below that."""
    plain = LLM(str(sharp_llama_dir))
    spec = spec_llm(sharp_llama_dir, num_speculative_tokens=3, prompt_lookup_min=1)
    # The model's own greedy text loops; sampled continuations often follow the loop, so the
    # n-gram drafter gets accepted often enough to matter.
    prompt = PROMPTS[0] + plain.generate(PROMPTS[0], greedy(60))[0].outputs[0].text
    assert_same_distribution(plain, spec, prompt, positions=3, temperature=1.0, top_k=8, top_p=0.9)
    assert spec.engine.spec_stats.num_accepted_tokens > 100


def assert_same_distribution(plain, spec, prompt, n: int = 2000, positions: int = 4, **sampling):
    """Sample `n` seeded completions with and without speculation (different seeds) and
    chi-square test each of the first `positions` tokens: p < 1e-3 fails."""

    def run(llm, offset):
        params = [
            SamplingParams(max_tokens=positions, ignore_eos=True, seed=offset + s, **sampling)
            for s in range(n)
        ]
        return [o.outputs[0].token_ids for o in llm.generate([prompt] * n, params)]

    a, b = run(plain, 0), run(spec, n)
    for pos in range(positions):
        pval = chi_square_pvalue([t[pos] for t in a], [t[pos] for t in b])
        assert pval > 1e-3, (pos, pval)


def test_bad_speculative_config(tiny_llama_dir):
    with pytest.raises(InvalidRequestError, match="unknown speculative method"):
        LLM(str(tiny_llama_dir), speculative_config={"method": "magic"})
    with pytest.raises(InvalidRequestError, match="unknown speculative config keys"):
        LLM(str(tiny_llama_dir), speculative_config={"method": "ngram", "k": 3})
    with pytest.raises(InvalidRequestError, match="positive"):
        LLM(
            str(tiny_llama_dir), speculative_config={"method": "ngram", "num_speculative_tokens": 0}
        )


@pytest.fixture(scope="module")
def other_draft_dir(tmp_path_factory):
    """A different random tiny model: a draft that disagrees with the target often."""
    from conftest import _write_byte_tokenizer, make_tiny_hf

    out = tmp_path_factory.mktemp("draft")
    make_tiny_hf("llama", out, seed=7)
    _write_byte_tokenizer(out)
    return out


@pytest.mark.parametrize("draft", ["self", "other"])
@pytest.mark.parametrize("k", [1, 4])
def test_draft_model_greedy_equals_plain(plain, tiny_llama_dir, other_draft_dir, draft, k):
    path = tiny_llama_dir if draft == "self" else other_draft_dir
    spec = LLM(
        str(tiny_llama_dir),
        speculative_config={
            "method": "draft_model",
            "model": str(path),
            "num_speculative_tokens": k,
        },
        speculative_policy="static",
    )
    want = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, greedy(30))]
    got = [o.outputs[0].token_ids for o in spec.generate(PROMPTS, greedy(30))]
    assert got == want
    assert spec.generate(PROMPTS[1], greedy(30))[0].outputs[0].token_ids == want[1]
    stats = spec.engine.spec_stats
    if draft == "self":  # the target drafting for itself: every draft is accepted
        assert stats.acceptance_rate == 1.0
    else:
        assert 0 < stats.acceptance_rate < 1.0


@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_quantized_draft_greedy_equals_plain(plain, tiny_llama_dir, dtype):
    """An int8 / int4 draft (the target drafting for itself) still gives the plain output."""
    from specdecode import kernels

    ready = kernels.available() and (dtype == "int8" or kernels.int4_ready())
    if not ready:
        wanted = "CPU kernels" if not kernels.available() else "AVX512_VNNI"
        with pytest.raises(InvalidRequestError, match=f"{dtype} needs .*{wanted}"):
            LLM(
                str(tiny_llama_dir),
                speculative_config={
                    "method": "draft_model",
                    "model": str(tiny_llama_dir),
                    "draft_dtype": dtype,
                },
            )
        return
    spec = spec_llm(
        tiny_llama_dir,
        method="draft_model",
        model=str(tiny_llama_dir),
        num_speculative_tokens=3,
        draft_dtype=dtype,
    )
    assert spec.engine.drafter.model.fast.lm_head.dtype == getattr(torch, dtype)
    want = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, greedy(30))]
    assert [o.outputs[0].token_ids for o in spec.generate(PROMPTS, greedy(30))] == want
    assert spec.engine.spec_stats.acceptance_rate > 0.5  # itself, quantised: mostly agrees


@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_a_quantized_target_speculates_exactly(tiny_llama_dir, dtype):
    """`quantization` int8 / int4: the target's projections and LM head packed so (a quarter,
    an eighth of fp32's bytes); speculation (n-gram, a draft model, quantized alike by
    default) gives exactly the quantized target's own greedy output. Where the CPU cannot run
    it, a clear error."""
    from specdecode import kernels

    ready = kernels.available() and (dtype == "int8" or kernels.int4_ready())
    if not ready:
        with pytest.raises(InvalidRequestError, match=f"quantization {dtype} runs on the CPU"):
            LLM(str(tiny_llama_dir), quantization=dtype)
        return
    plain = LLM(str(tiny_llama_dir), quantization=dtype)
    assert plain.engine.model.fast.lm_head.dtype == getattr(torch, dtype)
    want = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, greedy(30))]
    for cfg in ({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1},
                {"method": "draft_model", "model": str(tiny_llama_dir),
                 "num_speculative_tokens": 3}):  # fmt: skip
        spec = LLM(str(tiny_llama_dir), quantization=dtype, speculative_config=cfg,
                   speculative_policy="static")  # fmt: skip
        assert [o.outputs[0].token_ids for o in spec.generate(PROMPTS, greedy(30))] == want
        assert spec.engine.spec_stats.num_accepted_tokens > 0
        if cfg["method"] == "draft_model":  # (quantized alike, no draft_dtype given)
            assert spec.engine.drafter.model.fast.lm_head.dtype == getattr(torch, dtype)
    with pytest.raises(InvalidRequestError, match="--kernels auto"):
        LLM(str(tiny_llama_dir), quantization=dtype, kernels="off")


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_reduced_draft_vocab_is_lossless(plain, tiny_llama_dir, temperature):
    """A draft LM head cut to the first ids: greedy output unchanged, sampled drafts stay in
    the kept ids (q is zero elsewhere) and still verify."""
    spec = spec_llm(
        tiny_llama_dir,
        method="draft_model",
        model=str(tiny_llama_dir),
        num_speculative_tokens=3,
        draft_vocab_size=40,
    )
    kept = spec.engine.drafter.model.vocab_ids
    assert 40 <= len(kept) < spec.engine.model_config.vocab_size
    if temperature == 0.0:
        want = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, greedy(30))]
        assert [o.outputs[0].token_ids for o in spec.generate(PROMPTS, greedy(30))] == want
    else:
        params = SamplingParams(temperature=1.0, max_tokens=30, seed=3)
        assert spec.generate(PROMPTS, params)[0].outputs[0].token_ids
    assert spec.engine.spec_stats.num_draft_tokens > 0


def test_a_token_map_cuts_a_draft_models_vocabulary_losslessly(plain, tiny_llama_dir, tmp_path):
    """SGLang's --speculative-token-map on a draft model (STANDALONE): its LM head keeps the
    map's rows and the end ids; greedy output unchanged."""
    path = tmp_path / "map.json"
    path.write_text(json.dumps(list(range(3, 60, 2))))
    spec = spec_llm(
        tiny_llama_dir,
        method="draft_model",
        model=str(tiny_llama_dir),
        num_speculative_tokens=3,
        token_map=str(path),
    )
    kept = spec.engine.drafter.model.vocab_ids.tolist()
    assert kept == sorted({*range(3, 60, 2), *spec.engine._eos_ids()})
    want = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, greedy(30))]
    assert [o.outputs[0].token_ids for o in spec.generate(PROMPTS, greedy(30))] == want
    assert spec.engine.spec_stats.num_draft_tokens > 0


def test_share_model_with(plain, tiny_llama_dir):
    """A second engine on the same loaded target (benchmarks comparing drafters)."""
    spec = LLM(
        str(tiny_llama_dir),
        share_model_with=plain,
        speculative_config={"method": "ngram", "num_speculative_tokens": 3},
        speculative_policy="static",
    )
    assert spec.engine.model is plain.engine.model
    assert spec.engine.cache is not plain.engine.cache
    want = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, greedy(20))]
    assert [o.outputs[0].token_ids for o in spec.generate(PROMPTS, greedy(20))] == want
    with pytest.raises(ValueError, match="same model"):
        LLM(str(tiny_llama_dir), share_model_with=plain, dtype="bfloat16")


def test_draft_dtype_validated(tiny_llama_dir):
    with pytest.raises(InvalidRequestError, match="unknown draft_dtype"):
        LLM(str(tiny_llama_dir), speculative_config={"method": "ngram", "draft_dtype": "int2"})
    with pytest.raises(InvalidRequestError, match="draft_vocab_size applies"):
        LLM(str(tiny_llama_dir), speculative_config={"method": "ngram", "draft_vocab_size": 9})


def test_draft_model_sampled_distribution_unchanged(sharp_llama_dir, tmp_path):
    """Sampled drafts verified with their real q: first tokens distributed as without
    speculation (same chi-square test as above)."""
    from conftest import _write_byte_tokenizer, make_tiny_hf

    make_tiny_hf("llama", tmp_path, seed=1, logit_scale=3.0)  # same weights, softer: q != p
    _write_byte_tokenizer(tmp_path)
    plain = LLM(str(sharp_llama_dir))
    spec = draft_llm(sharp_llama_dir, tmp_path, 3)
    assert_same_distribution(plain, spec, PROMPTS[0], temperature=1.0, top_k=8, top_p=0.9)
    stats = spec.engine.spec_stats
    assert stats.num_accepted_tokens > 1000 and stats.acceptance_rate < 0.95


@pytest.mark.parametrize("tree", [None, "TREE"], ids=["chain", "tree"])
def test_a_draft_model_with_a_shorter_context_stops_drafting_there(
    plain, tiny_llama_dir, other_draft_dir, tmp_path, tree
):
    """A draft model whose context (64) is shorter than the target's (256) drafts while the
    request fits it and verifies without drafts past it: plain decoding's tokens, no crash."""
    import json
    import shutil

    short = tmp_path / "short"
    shutil.copytree(other_draft_dir, short)
    cfg = json.loads((short / "config.json").read_text())
    (short / "config.json").write_text(json.dumps({**cfg, "max_position_embeddings": 64}))
    spec = draft_llm(tiny_llama_dir, short, 3, TREE if tree else None)
    prompt = "abcabcabcabc" * 4  # 48 tokens: drafts at first, none from position 64 on
    want = plain.generate(prompt, greedy(40))[0].outputs[0].token_ids
    assert spec.generate(prompt, greedy(40))[0].outputs[0].token_ids == want
    assert spec.engine.spec_stats.num_draft_tokens > 0
    assert spec.engine.num_tracked() == 0
    # past the draft's context the request's draft cache is freed while it still runs
    engine, drafter = spec.engine, spec.engine.drafter
    seq = engine.add_request(spec.tokenizer.encode(prompt), greedy(40))
    while seq.num_tokens < 66:
        engine.step()
    assert seq.finish_reason is None
    assert drafter.manager.num_free_blocks == drafter.manager.num_blocks - 1
    # and the controller plans no drafts there (it would count them as drafting)
    drafting = engine.controller.num_drafting
    engine.step()
    assert engine.controller.last_budgets == [0] and engine.controller.num_drafting == drafting
    list(engine.run_to_completion())


@pytest.mark.parametrize("branch", [False, True], ids=["chain", "lookup-branch"])
def test_a_preempted_seeded_draft_stream_goes_on(tiny_llama_dir, other_draft_dir, branch):
    """A seeded request's sampled drafts draw from the draft model's own generator. Preempted,
    the request's draft cache is rebuilt but its random stream goes on where it was: restarted
    from the seed, the new drafts would reuse the uniforms that chose tokens already emitted,
    and the text would no longer be distributed as the target's."""
    cfg = {"method": "draft_model", "model": str(other_draft_dir), "num_speculative_tokens": 3}
    if branch:  # the draft model under a lookup branch
        cfg["prompt_lookup_tokens"] = 4
    spec = LLM(str(tiny_llama_dir), speculative_config=cfg, speculative_policy="static")
    engine = spec.engine
    drafter = engine.drafter.head if branch else engine.drafter
    if branch:  # the draft model every step, whatever the step times
        engine.drafter.step_time = None
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=40, ignore_eos=True)
    seq = engine.add_request([5, 6, 7, 8], params)
    while engine.spec_stats.num_draft_tokens < 6:
        engine.step()
    gen = drafter._state[seq.seq_id].generator
    before = gen.get_state()
    engine.preempt(seq)
    assert seq.seq_id not in drafter._state and seq in engine.scheduler.waiting
    engine.step()  # recomputing its prompt: no drafts yet, no draft state
    assert seq.seq_id not in drafter._state
    engine.preempt(seq)  # preempted again before it drafted: the parked stream is kept
    drafts = engine.spec_stats.num_draft_tokens
    while engine.spec_stats.num_draft_tokens == drafts:  # recomputed, then drafting again
        engine.step()
    assert drafter._state[seq.seq_id].generator is gen  # the same stream, not a new one
    assert not torch.equal(gen.get_state(), before)  # which went on drawing
    list(engine.run_to_completion())
    assert engine.num_tracked() == 0


@pytest.mark.parametrize("source", ["ngram", "suffix"])
def test_draft_model_with_a_lookup_branch_greedy_equals_plain(
    plain, tiny_llama_dir, other_draft_dir, source
):
    """The lookup chain grafted onto a draft model's greedy chain: plain decoding's tokens,
    batched and alone, with the branch accepted where the draft model was not (its chain from
    the last n-gram's match, or suffix decoding's likeliest path, earlier answers included)."""
    cfg = {
        "method": "draft_model",
        "model": str(other_draft_dir),
        "num_speculative_tokens": 3,
        "prompt_lookup_tokens": 5,
        "prompt_lookup_method": source,
        # (the n-gram bounds are the ngram source's; suffix decoding matches suffixes itself)
        **({"prompt_lookup_min": 1} if source == "ngram" else {}),
    }
    spec = LLM(str(tiny_llama_dir), speculative_config=cfg, speculative_policy="static")
    spec.engine.drafter.step_time = None  # the whole branch every step, whatever the step times
    want = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, greedy(40))]
    assert [o.outputs[0].token_ids for o in spec.generate(PROMPTS, greedy(40))] == want
    assert spec.generate(PROMPTS[0], greedy(40))[0].outputs[0].token_ids == want[0]
    assert spec.engine.drafter.branch_stats.accepted > 0


def test_a_draft_model_tree_with_a_lookup_branch_the_draft_model_skipped(
    plain, tiny_llama_dir, other_draft_dir
):
    """A static top-k tree (deterministic drafts) takes the graft; where the lookup matches the
    draft model is skipped (forced here on every lookup step, from a request's first): the
    draft model, which has fed nothing, keeps its cache as it was; greedy output unchanged."""
    cfg = {
        "method": "draft_model",
        "model": str(other_draft_dir),
        "num_speculative_tokens": 3,
        "speculative_token_tree": TREE,
        "prompt_lookup_tokens": 4,
        "prompt_lookup_min": 1,
    }
    spec = LLM(str(tiny_llama_dir), speculative_config=cfg, speculative_policy="static")
    drafter = spec.engine.drafter
    drafter._head_pays = lambda *a: False
    # the model's own loop as the prompt: lookup matches from the first decoding step on
    prompts = [p + plain.generate(p, greedy(40))[0].outputs[0].text for p in PROMPTS]
    first: dict[int, int] = {}  # the draft model's budget on each request's first step
    ran = []  # the levels the draft model ran, all steps
    propose = drafter.head.propose

    def spy(seqs, budgets):
        for seq, k in zip(seqs, budgets, strict=True):
            first.setdefault(seq.seq_id, k)
        out = propose(seqs, budgets)
        ran.extend(max(p.shape.depths) for p in out if p.num_drafts)
        return out

    drafter.head.propose = spy
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, greedy(30))]
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, greedy(30))] == want
    assert 0 in first.values()  # skipped before its cache held anything for the request
    assert spec.generate(prompts[0], greedy(30))[0].outputs[0].token_ids == want[0]
    assert drafter.branch_stats.head_skipped > 0 and drafter.branch_stats.accepted > 0
    # drafting time is priced on the levels the draft model ran: none on the skipped steps
    stats = spec.engine.spec_stats
    assert stats.drafted_levels == sum(ran) < sum(stats.drafted_per_position)
    assert spec.engine.num_tracked() == 0


def test_draft_model_with_a_lookup_branch_keeps_the_distribution(sharp_llama_dir, tmp_path):
    """At temperature 1 a step verifies the draft model's sampled chain with its q, the lookup
    chain alone (lite drafts: deterministic, no q), or nothing, per request: forced here to mix
    in every verification, greedy requests (grafted trees) among them. Sampled first tokens are
    distributed as without speculation, and the greedy requests give plain decoding's tokens."""
    from conftest import _write_byte_tokenizer, make_tiny_hf

    make_tiny_hf("llama", tmp_path, seed=1, logit_scale=3.0)  # same weights, softer: q != p
    _write_byte_tokenizer(tmp_path)
    plain = LLM(str(sharp_llama_dir))
    cfg = {
        "method": "draft_model",
        "model": str(tmp_path),
        "num_speculative_tokens": 3,
        "prompt_lookup_tokens": 3,
        "prompt_lookup_min": 1,
    }
    spec = LLM(str(sharp_llama_dir), speculative_config=cfg)
    engine, ctrl = spec.engine, spec.engine.controller
    engine.drafter.step_time = None  # the draft model whenever planned, whatever the step times
    plan, step = ctrl.plan, [0]
    cycle = [-3, 3, 0, 2, -2]

    def mixed(seqs, *a):  # (and no shadows beside: whether one is taken depends on timing)
        step[0] += 1
        budgets = plan(seqs, *a)
        ctrl.shadow_requests = []
        return [cycle[(step[0] + j) % len(cycle)] for j, _ in enumerate(budgets)]

    ctrl.plan = mixed
    calls = []  # per verification: the rules its rows took
    runner = engine.runner
    for name in ("_verify", "_verify_sampled", "_verify_choices"):
        real = getattr(runner, name)

        def spy(seqs, *a, real=real, name=name):
            if name == "_verify":
                calls.append(set())
            else:
                calls[-1].add(name)
            return real(seqs, *a)

        setattr(runner, name, spy)
    prompt = PROMPTS[0] + plain.generate(PROMPTS[0], greedy(60))[0].outputs[0].text
    n, positions, sampling = 2000, 4, {"temperature": 1.0, "top_k": 8, "top_p": 0.9}

    def params(offset):
        return [
            SamplingParams(max_tokens=positions, ignore_eos=True, seed=offset + s, **sampling)
            for s in range(n)
        ]

    a = [o.outputs[0].token_ids for o in plain.generate([prompt] * n, params(0))]
    want_greedy = plain.generate(prompt, greedy(12))[0].outputs[0].token_ids
    outs = spec.generate([prompt] * (n + 8), params(n) + [greedy(12)] * 8)
    b = [o.outputs[0].token_ids for o in outs[:n]]
    for pos in range(positions):
        pval = chi_square_pvalue([t[pos] for t in a], [t[pos] for t in b])
        assert pval > 1e-3, (pos, pval)
    assert all(o.outputs[0].token_ids == want_greedy for o in outs[n:])
    stats = engine.spec_stats
    assert stats.num_accepted_tokens > 500 and ctrl.num_lite > 100
    assert {"_verify_sampled", "_verify_choices"} in calls  # both in one step: split, merged


TREE = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1], [0, 0, 0, 0]]


@pytest.mark.parametrize("draft", ["self", "other"])
def test_draft_model_tree_greedy_equals_plain(plain, tiny_llama_dir, other_draft_dir, draft):
    path = tiny_llama_dir if draft == "self" else other_draft_dir
    spec = draft_llm(tiny_llama_dir, path, 4, tree=TREE)
    want = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, greedy(30))]
    assert [o.outputs[0].token_ids for o in spec.generate(PROMPTS, greedy(30))] == want
    assert spec.generate(PROMPTS[3], greedy(30))[0].outputs[0].token_ids == want[3]
    stats = spec.engine.spec_stats
    if draft == "self":  # greedy + self-draft: the top-1 path is always fully accepted
        assert stats.mean_acceptance_length == pytest.approx(5.0, abs=0.3)
    else:
        assert stats.num_accepted_tokens > 0


def test_draft_model_tree_sampled_distribution_unchanged(sharp_llama_dir, other_draft_dir):
    """Deterministic top-k tree drafts at temperature 1: first tokens distributed as without."""
    plain = LLM(str(sharp_llama_dir))
    spec = draft_llm(sharp_llama_dir, sharp_llama_dir, 3, tree=TREE)
    assert_same_distribution(plain, spec, PROMPTS[1], positions=5, temperature=1.0, top_p=0.95)
    assert spec.engine.spec_stats.num_accepted_tokens > 500


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_sampled_tokens_stay_in_the_top_k_support(plain, tiny_llama_dir, other_draft_dir, method):
    """With top_k=2 every emitted token must be one of the target's top-2 at its position,
    accepted draft, recovered or bonus alike (checked by teacher forcing the target)."""
    cfg = {"method": method, "num_speculative_tokens": 4, "prompt_lookup_min": 1}
    if method == "draft_model":
        cfg = {"method": method, "model": str(other_draft_dir), "num_speculative_tokens": 4}
    spec = LLM(str(tiny_llama_dir), speculative_config=cfg, speculative_policy="static")
    params = [
        SamplingParams(temperature=1.5, top_k=2, max_tokens=24, ignore_eos=True, seed=s)
        for s in range(8)
    ]
    outs = spec.generate([PROMPTS[0]] * 8, params)
    assert spec.engine.spec_stats.num_accepted_tokens > 0
    from helpers import Runner

    model = plain.engine.model
    for out in outs:
        ids = out.prompt_token_ids + out.outputs[0].token_ids
        r = Runner(model)
        (logits,) = r.feed([r.new_seq()], [ids[:-1]])
        top2 = logits[len(out.prompt_token_ids) - 1 :].topk(2).indices
        for tok, allowed in zip(out.outputs[0].token_ids, top2.tolist(), strict=True):
            assert tok in allowed


@pytest.mark.parametrize("policy", ["static", "adaptive"])
def test_seeded_sampling_gives_the_plain_tokens(plain, tiny_llama_dir, policy):
    """Deterministic drafts are verified by the target's own position-seeded draw, so a seeded
    request samples the same tokens with or without speculation, alone or batched."""
    spec = LLM(
        str(tiny_llama_dir),
        speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1},
        speculative_policy=policy,
    )
    params = seeded_params(11, 60, ((0.3, 3), (0.5, 0), (1.0, 2), (0.2, 5)))
    assert_seeded_outputs_match(plain, spec, PROMPTS, params, alone=0)
    if policy == "static":  # adaptive may rightly decide not to draft on this tiny model
        assert spec.engine.spec_stats.num_accepted_tokens > 0


def test_adaptive_policy_is_lossless_and_decides(plain, tiny_llama_dir):
    spec = LLM(
        str(tiny_llama_dir),
        speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1},
    )
    assert spec.engine.controller.policy == "adaptive"
    want = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, greedy(40))]
    assert [o.outputs[0].token_ids for o in spec.generate(PROMPTS, greedy(40))] == want
    ctrl = spec.engine.controller
    assert ctrl.step_cost.calibrated and ctrl.step_cost.measured
    spec.engine.set_policy("off")
    before = spec.engine.spec_stats.num_drafts
    assert [o.outputs[0].token_ids for o in spec.generate(PROMPTS, greedy(40))] == want
    assert spec.engine.spec_stats.num_drafts == before  # off means no drafts at all
    with pytest.raises(InvalidRequestError):
        spec.engine.set_policy("maybe")


def test_an_engine_switched_to_adaptive_calibrates_and_drafts(plain, tiny_llama_dir):
    """Plain steps measure one token only: an engine that ran under `off` first (as a benchmark
    comparing policies on one engine does) still times its bare forwards when it turns
    adaptive, and drafts where that pays."""
    spec = LLM(
        str(tiny_llama_dir),
        speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1},
        speculative_policy="off",
    )
    spec.generate(PROMPTS, greedy(20))
    ctrl = spec.engine.controller
    assert ctrl.step_cost.measured and not ctrl.step_cost.calibration
    spec.engine.set_policy("adaptive")
    calibrate, timed = spec.engine.calibrate, []

    def calibrated(*a, **kw):  # timed, then a memory-bound shape, whatever this machine's
        calibrate(*a, **kw)
        timed.append(bool(ctrl.step_cost.calibration))
        for n in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024):
            ctrl.step_cost.calibrate(n, 0.01)

    spec.engine.calibrate = calibrated
    spec.generate(PROMPTS, greedy(40))
    assert timed == [True]
    assert ctrl.num_drafting > 0 and spec.engine.spec_stats.num_accepted_tokens > 0


def test_calibration_times_what_the_requests_reach(tiny_llama_dir):
    """The Python API's first step times the step-cost curve only as far as its requests can
    feed (one request: its own token and tree, not max_num_seqs' worth); a larger batch
    later times the sizes past it, once."""
    spec = LLM(
        str(tiny_llama_dir),
        speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1},
        max_num_seqs=16,
    )
    engine, calls = spec.engine, []
    calibrate = engine.calibrate

    def recorded(*a, **kw):
        calls.append((kw["upto"], kw["after"]))
        calibrate(*a, **kw)

    engine.calibrate = recorded
    per = engine.tokens_per_decode
    assert per == 4  # (a chain of 3 drafts)
    spec.generate(PROMPTS[:1], greedy(8))

    def top():
        return max(x for x, _ in engine.controller.step_cost.calibration.points())

    assert calls == [(per, 0)] and top() == per
    spec.generate(PROMPTS[:1], greedy(8))  # nothing new to time
    spec.generate(PROMPTS[:4], greedy(8))
    assert calls == [(per, 0), (4 * per, per)]
    assert top() == 4 * per
    engine.ensure_calibrated()  # (serve's: the whole curve)
    assert calls[-1] == (16 * per, 4 * per)


def test_abort_frees_memory(tiny_llama_dir):
    llm = spec_llm(tiny_llama_dir, num_speculative_tokens=3, prompt_lookup_min=1)
    engine = llm.engine
    free = engine.manager.num_free_blocks
    ids = llm.encode("abcabcabcabc")
    running = engine.add_request(ids, greedy(50))
    queued = [engine.add_request(ids, greedy(50)) for _ in range(3)]
    for _ in range(3):
        engine.step()
    assert engine.manager.num_free_blocks < free
    for seq in [running, *queued]:
        engine.abort(seq)
        assert seq.finished and seq.finish_reason == "abort"
    assert not engine.has_unfinished()
    assert engine.manager.num_free_blocks == free


def test_bench_measures_decode_time_inside_the_request(tiny_llama_dir):
    """bench latency's per-prompt timing: the first token's time is read inside the same request,
    so decode seconds are positive and below the total even on an engine's first request."""
    from specdecode.bench.speculative import _measure_interleaved, _measure_one

    spec = LLM(  # adaptive: the engine's first step calibrates the step-cost curve
        str(tiny_llama_dir),
        speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1},
    )
    ids = spec.encode(PROMPTS[0])
    engine, spent = spec.engine, []
    calibrate = engine.calibrate

    def timed_calibrate(*args, **kwargs):  # what the first request pays, timed where it is paid
        t0 = time.perf_counter()
        calibrate(*args, **kwargs)
        spent.append(time.perf_counter() - t0)

    engine.calibrate = timed_calibrate
    n, total, decode_n, decode_s = _measure_one(spec, ids, 0, 0.0, 20)
    assert (n, decode_n) == (20, 19)
    assert len(spent) == 1  # the request's first step calibrated
    assert 0 < decode_s < total - spent[0]  # the calibration is not decode time
    plain, [(tok_s, decode_tok_s, stats, branch, drafting)] = _measure_interleaved(
        spec, [("ngram", spec)], [ids, spec.encode(PROMPTS[1])], 0.0, 12
    )
    assert all(0 < r < 1e6 for r in (*plain, tok_s, decode_tok_s))
    (drafting, lite) = drafting
    assert branch is None and 0 <= drafting <= 1 and lite == 0  # n-gram has no lite mode
    assert drafting > 0 or stats.num_drafts == 0  # what adaptive chose, reported


def test_a_one_token_prompt_gets_room_for_a_tree_larger_than_a_block(plain, tiny_llama_dir):
    """A one-token prompt decodes, and drafts, on its first step: it is admitted with room for
    its draft tree, here 6 drafts + the root in blocks of 4 tokens."""
    cfg = {"method": "draft_model", "model": str(tiny_llama_dir), "num_speculative_tokens": 6}
    spec = LLM(str(tiny_llama_dir), block_size=4, speculative_config=cfg,
               speculative_policy="static")  # fmt: skip
    prompts = [[65], [66, 67], [68]]
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, greedy(20))]
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, greedy(20))] == want
    assert spec.generate([[65]], greedy(20))[0].outputs[0].token_ids == want[0]
    assert spec.engine.spec_stats.num_accepted_tokens > 0


@pytest.mark.parametrize("tree", [None, TREE], ids=["chain", "tree"])
def test_a_full_draft_cache_stops_only_the_requests_it_cannot_hold(plain, tiny_llama_dir, tree):
    """A draft cache of 6 blocks (96 tokens) holds the short request, never the long one
    (listed first): the long one is verified without drafts, the short one drafts on."""
    from specdecode.cache import BlockManager

    spec = draft_llm(tiny_llama_dir, tiny_llama_dir, 4, tree=tree)
    spec.engine.drafter.manager = BlockManager(7, 16)
    prompts = ["abcdefghij" * 12, "xyz"]
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, greedy(30))]
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, greedy(30))] == want
    stats = spec.engine.spec_stats
    assert stats.num_drafts > 0 and stats.acceptance_rate > 0
    assert spec.engine.drafter.manager.num_free_blocks == 6  # all released


PENALTIES = {
    "presence_penalty": 0.6,
    "frequency_penalty": 0.3,
    "repetition_penalty": 1.3,
    "logit_bias": {ord("l"): 2.0, ord(" "): -1.0},
}


@pytest.mark.parametrize("method", ["ngram", "draft_tree"])
def test_penalties_and_bias_keep_greedy_equal(plain, tiny_llama_dir, method):
    """Penalties read the drafts on each node's path: greedy output with speculation (chain and
    tree, batched and alone) is plain decoding's, which the penalties do change."""
    if method == "ngram":
        spec = spec_llm(tiny_llama_dir, num_speculative_tokens=4, prompt_lookup_min=1)
    else:
        spec = draft_llm(tiny_llama_dir, tiny_llama_dir, 3, TREE)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, **PENALTIES)
    want = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, params)]
    assert want != [o.outputs[0].token_ids for o in plain.generate(PROMPTS, greedy(30))]
    assert [o.outputs[0].token_ids for o in spec.generate(PROMPTS, params)] == want
    assert spec.generate(PROMPTS[3], params)[0].outputs[0].token_ids == want[3]
    assert spec.engine.spec_stats.num_accepted_tokens > 0


@pytest.mark.parametrize("tree", [None, TREE])
def test_a_draft_model_drafts_under_the_penalties(plain, tiny_llama_dir, tree):
    """The target drafting for itself under penalties and bias (chain: with the drafts before
    each in its history; tree: each node's path): its drafts are the penalised target's, so
    all are accepted at T=0 (those the penalties change were rejected when it drafted without)."""
    spec = draft_llm(tiny_llama_dir, tiny_llama_dir, 3, tree)
    params = SamplingParams(temperature=0, max_tokens=29, ignore_eos=True, **PENALTIES)
    want = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, params)]
    assert [o.outputs[0].token_ids for o in spec.generate(PROMPTS, params)] == want
    stats = spec.engine.spec_stats
    assert stats.num_drafts == 4 * 7  # one prefill token, then 3 drafts + 1 a step
    assert stats.num_accepted_tokens == 4 * 7 * 3


def test_penalties_and_min_p_keep_seeded_sampling_equal(sharp_llama_dir):
    """Seeded sampling with penalties, bias and min-p: a draft model's static tree (drafts
    verified by the target's own draws) gives plain decoding's tokens, batched and alone."""
    plain = LLM(str(sharp_llama_dir))
    spec = draft_llm(sharp_llama_dir, sharp_llama_dir, 3, TREE)
    params = [
        SamplingParams(temperature=t, min_p=0.05, seed=11 + i, max_tokens=30, ignore_eos=True,
                       **PENALTIES)
        for i, t in enumerate((0.5, 1.0, 0.8, 1.3))
    ]  # fmt: skip
    assert_seeded_outputs_match(plain, spec, PROMPTS, params, alone=1)
    assert spec.engine.spec_stats.num_accepted_tokens > 10


def test_min_tokens_holds_stops_back_with_speculation(plain, tiny_llama_dir):
    """A stop token plain decoding emits third is held back until the sixth token, and a stop
    string until then too; speculation gives the same tokens."""
    spec = spec_llm(tiny_llama_dir, num_speculative_tokens=4, prompt_lookup_min=1)
    full = plain.generate(PROMPTS[0], greedy(30))[0].outputs[0].token_ids
    stop = full[2]
    early = SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[stop])
    assert len(plain.generate(PROMPTS[0], early)[0].outputs[0].token_ids) == 3
    held = SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[stop], min_tokens=6)
    want = plain.generate(PROMPTS[0], held)[0].outputs[0]
    assert stop not in want.token_ids[:5] and len(want.token_ids) >= 6
    assert spec.generate(PROMPTS[0], held)[0].outputs[0].token_ids == want.token_ids
    text = plain.generate(PROMPTS[0], greedy(30))[0].outputs[0].text
    for llm in (plain, spec):
        out = llm.generate(
            PROMPTS[0], SamplingParams(temperature=0, max_tokens=30, stop=[text[1]], min_tokens=8)
        )
        assert len(out[0].outputs[0].token_ids) >= 8  # fmt: skip


def test_penalised_sampled_distribution_unchanged(sharp_llama_dir, tmp_path):
    """Sampled drafts (a softer copy of the target) verified by rejection sampling against
    penalised p: the first three tokens are distributed as without speculation. (The rows'
    penalties themselves are checked exactly by the greedy and seeded tests above.)"""
    from conftest import _write_byte_tokenizer, make_tiny_hf

    make_tiny_hf("llama", tmp_path, seed=1, logit_scale=3.0)
    _write_byte_tokenizer(tmp_path)
    plain = LLM(str(sharp_llama_dir))
    spec = draft_llm(sharp_llama_dir, tmp_path, 3)
    sampling = {"temperature": 1.0, "top_k": 8, "repetition_penalty": 1.8,
                "frequency_penalty": 1.0, "min_p": 0.02}  # fmt: skip
    assert_same_distribution(plain, spec, PROMPTS[0], positions=3, **sampling)
    assert spec.engine.spec_stats.num_accepted_tokens > 500


def test_min_tokens_holds_each_stop_back_exactly_that_long(plain, tiny_llama_dir):
    """The m-th token of plain decoding as a stop token with min_tokens m, for every m: each
    draft node's depth decides whether it may stop, so speculation gives plain's tokens. And a
    stop string that the first token ends cannot stop a request with min_tokens 1."""
    spec = spec_llm(tiny_llama_dir, num_speculative_tokens=4, prompt_lookup_min=1)
    for prompt in PROMPTS:
        full = plain.generate(prompt, greedy(16))[0].outputs[0]
        for m in range(1, 12):
            stop = [full.token_ids[m]]
            params = SamplingParams(temperature=0, max_tokens=16, stop_token_ids=stop, min_tokens=m)
            want = plain.generate(prompt, params)[0].outputs[0].token_ids
            assert spec.generate(prompt, params)[0].outputs[0].token_ids == want
            assert len(want) > m
        text = plain.generate(prompt, greedy(1))[0].outputs[0].text
        if text:
            params = SamplingParams(temperature=0, max_tokens=6, stop=[text], min_tokens=1)
            out = plain.generate(prompt, params)[0].outputs[0]
            assert len(out.token_ids) > 1 and out.text.startswith(text)
    assert spec.engine.spec_stats.num_accepted_tokens > 0


def test_logprobs_are_the_raw_models_under_bias_and_penalties(plain):
    """Penalties and bias change what is sampled, not the reported log-probabilities (vLLM's
    raw logprobs): a bias against a likely token that is not chosen leaves them unchanged."""
    base = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3)
    ref = plain.generate(PROMPTS[0], base)[0].outputs[0]
    # the second most likely first token
    runner_up = next(t for t, lp in ref.logprobs[0].items() if lp.rank == 2)
    biased = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3,
                            logit_bias={runner_up: -100}, min_tokens=6)  # fmt: skip
    got = plain.generate(PROMPTS[0], biased)[0].outputs[0]
    assert got.token_ids == ref.token_ids
    assert got.logprobs == ref.logprobs


@pytest.mark.parametrize("tree", [None, "TREE"], ids=["chain", "tree"])
def test_a_draft_models_cache_is_prefix_cached_too(plain, tiny_llama_dir, tree):
    """A request that starts like an earlier one finds the draft model's blocks as well as the
    target's: the draft runs only the rest of the prompt, and drafts as well as with the whole
    prompt run (the target as its own draft: every draft accepted). Greedy output is plain's."""
    spec = draft_llm(tiny_llama_dir, tiny_llama_dir, 3, TREE if tree else None)
    drafter = spec.engine.drafter
    found, match = [], drafter.manager.match
    drafter.manager.match = lambda *a, **k: found.append(match(*a, **k)) or found[-1]
    shared = "The quick brown fox jumps over the lazy dog. " * 2  # 90 tokens
    prompts = [shared + "Then", shared + "And so"]
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, greedy(24))]
    assert spec.generate(prompts[0], greedy(24))[0].outputs[0].token_ids == want[0]
    ids = spec.encode(prompts[1])
    probe = spec.engine.make_sequence(ids, greedy(24))  # priced before it drafts: the rest
    assert drafter.catch_up_tokens(probe) == len(ids) - 80 - 1
    drafter.release(probe)
    out = spec.generate(prompts[1], greedy(24))[0]
    assert out.outputs[0].token_ids == want[1] and out.num_cached_tokens == 80
    assert found == [0, 80] and spec.engine.num_tracked() == 0
    assert out.outputs[0].spec["acceptance_by_position"][0] == 1.0


def test_a_lookup_engine_tells_the_controller_what_its_budgets_fed(plain, tiny_llama_dir):
    """n-gram proposals shorter than their budget, or empty, are reported against the budget:
    every decoding step of a drafting request records one proposal and one verification
    outcome at depth k, an empty proposal as a miss (see the controller)."""
    spec = spec_llm(tiny_llama_dir, num_speculative_tokens=4, prompt_lookup_min=1)
    ctrl = spec.engine.controller
    assert ctrl.variable_size
    proposed, verified = [], []
    record_proposal, record_verification = ctrl.record_proposal, ctrl.record_verification
    record_empty = ctrl.record_empty
    ctrl.record_proposal = lambda s, b, n: (proposed.append((b, n)), record_proposal(s, b, n))
    ctrl.record_verification = lambda s, d, a, lite=False: (
        verified.append((d, a)),
        record_verification(s, d, a, lite),
    )
    ctrl.record_empty = lambda s, b, lite=False: (verified.append((b, 0)), record_empty(s, b, lite))
    want = plain.generate(PROMPTS[0], greedy(40))[0].outputs[0].token_ids
    assert spec.generate(PROMPTS[0], greedy(40))[0].outputs[0].token_ids == want
    assert proposed and len(proposed) == len(verified)
    assert {b for b, _ in proposed} <= {1, 2, 3, 4} and {d for d, _ in verified} <= {1, 2, 3, 4}
    assert [b for b, _ in proposed] == [d for d, _ in verified]
    empty = sum(1 for _, n in proposed if n == 0)
    short = sum(1 for b, n in proposed if 0 < n < b)
    assert empty and short, "the test must exercise empty and short proposals"
    assert sum(1 for _, a in verified if a == 0) >= empty
    # a new greedy request starts from what the workload's budgets fed
    assert ctrl.expected_sizes(Sequence([1], greedy(1)))[4] < 4


def test_a_small_cache_cuts_the_context_as_much_as_without_speculation(plain, tiny_llama_dir):
    """Draft slots give way to tokens, so a KV cache smaller than the context cuts it to what
    the cache holds, not that less the draft tree: a request fills it, drafting while there is
    room, with plain decoding's tokens."""
    memory = 7 * 16 * 512 / 2**30  # 6 blocks of 16 tokens
    small = LLM(str(tiny_llama_dir), kv_cache_memory_gb=memory)
    spec = LLM(
        str(tiny_llama_dir),
        kv_cache_memory_gb=memory,
        speculative_config={"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 1},
        speculative_policy="static",
    )
    assert spec.engine.max_model_len == small.engine.max_model_len == 6 * 16 - 1
    want = small.generate(PROMPTS[0], greedy(200))[0].outputs[0]
    got = spec.generate(PROMPTS[0], greedy(200))[0].outputs[0]
    assert got.token_ids == want.token_ids and got.finish_reason == want.finish_reason
    assert spec.engine.spec_stats.num_accepted_tokens > 0
