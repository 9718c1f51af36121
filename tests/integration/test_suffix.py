"""Suffix decoding end to end on the tiny model: lossless (greedy and seeded sampling, batched
and alone), earlier answers drafted from, config errors, and benchmarks that keep a prompt's
own answer out of the corpus it is measured with."""

from __future__ import annotations

import pytest
from helpers import assert_seeded_outputs_match, seeded_params

from specdecode import LLM, SamplingParams
from specdecode.errors import InvalidRequestError

PROMPTS = ["abcabcabcabcabc", "Hello Hello Hello Hello", "xyz", "1212121212121212"]


@pytest.fixture(scope="module")
def plain(tiny_llama_dir):
    return LLM(str(tiny_llama_dir))


def suffix_llm(path, policy="static", **cfg) -> LLM:
    return LLM(
        str(path),
        speculative_config={"method": "suffix", "num_speculative_tokens": 6, **cfg},
        speculative_policy=policy,
    )


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("factor", [1.0, 4.0])
def test_suffix_greedy_equals_plain(plain, tiny_llama_dir, factor):
    spec = suffix_llm(tiny_llama_dir, suffix_decoding_max_spec_factor=factor)
    want = ids(plain.generate(PROMPTS, greedy(40)))
    assert ids(spec.generate(PROMPTS, greedy(40))) == want  # batched
    for prompt, w in zip(PROMPTS, want, strict=True):  # batch 1, with a corpus by now
        assert spec.generate(prompt, greedy(40))[0].outputs[0].token_ids == w
    stats = spec.engine.spec_stats
    assert stats.num_accepted_tokens > 0 and stats.num_draft_tokens > stats.num_accepted_tokens


@pytest.mark.parametrize("policy", ["static", "adaptive"])
def test_seeded_sampling_gives_the_plain_tokens(plain, tiny_llama_dir, policy):
    """Suffix trees are deterministic drafts: the target's position-seeded draw decides, so a
    seeded request samples what it samples without speculation."""
    spec = suffix_llm(tiny_llama_dir, policy, suffix_decoding_max_spec_factor=4.0)
    params = seeded_params(5, 60, ((0.3, 3), (0.5, 0), (1.0, 2), (0.2, 5)))
    spec.generate(PROMPTS, params)  # a corpus of these answers: trees with siblings
    assert_seeded_outputs_match(plain, spec, PROMPTS, params, alone=1)
    if policy == "static":
        assert spec.engine.spec_stats.num_accepted_tokens > 0


def test_an_earlier_answer_is_drafted_from(plain, tiny_llama_dir):
    """The same prompt again (greedy: the same answer): with the corpus nearly every draft is
    accepted; with the corpus off only the request's own text is drafted from."""
    prompt = "The quick brown fox"
    rates = {}
    for cached in (10000, 0):
        spec = suffix_llm(tiny_llama_dir, suffix_decoding_max_cached_requests=cached)
        first = spec.generate(prompt, greedy(48))[0].outputs[0].token_ids
        before = spec.engine.spec_stats.num_draft_tokens, spec.engine.spec_stats.num_accepted_tokens
        again = spec.generate(prompt, greedy(48))[0].outputs[0].token_ids
        assert again == first == plain.generate(prompt, greedy(48))[0].outputs[0].token_ids
        drafted = spec.engine.spec_stats.num_draft_tokens - before[0]
        accepted = spec.engine.spec_stats.num_accepted_tokens - before[1]
        rates[cached] = (accepted, drafted)
    accepted, drafted = rates[10000]
    assert drafted >= 30 and accepted >= 0.9 * drafted, rates
    assert rates[0][0] < accepted, rates


def test_an_errored_or_preempted_request_teaches_nothing(tiny_llama_dir):
    spec = suffix_llm(tiny_llama_dir)
    engine, drafter = spec.engine, spec.engine.drafter
    spec.generate(PROMPTS[0], greedy(10))
    assert len(drafter.corpus) == 1
    seq = engine.add_request(spec.encode(PROMPTS[1]), greedy(30))
    while len(seq.output_token_ids) < 5:
        engine.step()
    engine.preempt(seq)  # an answer in the making: the engine recomputes it
    assert len(drafter.corpus) == 1
    while len(seq.output_token_ids) < 10:
        engine.step()
    seq.error = "failed"  # (as a request that cannot go on)
    drafter.release(seq)
    assert len(drafter.corpus) == 1
    seq.error = None
    engine.abort(seq)  # aborted (a client gone): its partial answer is still the model's text
    assert len(drafter.corpus) == 2


def test_bad_suffix_configs(tiny_llama_dir):
    bad = [
        ({"model": "x"}, "not a model"),
        ({"suffix_decoding_max_tree_depth": 2}, "max_tree_depth"),
        ({"suffix_decoding_max_cached_requests": -1}, "max_cached_requests"),
        ({"suffix_decoding_max_spec_factor": 0}, "max_spec_factor"),
        ({"suffix_decoding_min_token_prob": 1.5}, "min_token_prob"),
        ({"suffix_decoding_max_spec_factor": float("inf")}, "max_spec_factor"),
        ({"suffix_decoding_max_spec_factor": float("nan")}, "max_spec_factor"),
        ({"suffix_decoding_min_token_prob": "0.1"}, "min_token_prob .* got '0.1'"),
        ({"suffix_decoding_max_tree_depth": 24.0}, "max_tree_depth .* got 24.0"),
        ({"topk": 4}, "topk"),
    ]
    for extra, match in bad:
        with pytest.raises(InvalidRequestError, match=match):
            LLM(str(tiny_llama_dir), speculative_config={"method": "suffix", **extra})


def test_bench_keeps_a_prompts_own_answer_out_of_the_corpus(tiny_llama_dir):
    """bench latency runs each prompt plain first (and a warm-up): those answers are the ones
    the suffix drafter is then measured on, so only its own measured requests teach it, after
    they are timed."""
    from specdecode.bench.speculative import _measure_interleaved

    spec = suffix_llm(tiny_llama_dir)
    prompts = [spec.encode(p) for p in PROMPTS[:3]]
    seen = []
    drafter = spec.engine.drafter
    real = drafter.release

    def release(seq):
        seen.append((len(drafter.corpus), drafter.learning))
        real(seq)

    drafter.release = release
    _measure_interleaved(spec, [("suffix", spec)], prompts, 0.0, 12)
    # warm-ups twice and three plain runs teach nothing; each measured run is added
    assert len(drafter.corpus) == 3
    assert [learning for _, learning in seen] == [False, False] + [False, True] * 3


def test_bench_structured_keeps_the_plain_answers_out_of_the_corpus(tiny_llama_dir):
    from specdecode.bench.structured import plain_then_speculative

    spec = suffix_llm(tiny_llama_dir)
    drafter = spec.engine.drafter
    drafter.corpus.add([1, 2, 3, 4])  # an earlier cell's answer: dropped
    learned = []
    real = drafter.release

    def release(seq):
        learned.append(drafter.learning)
        real(seq)

    drafter.release = release
    prompts = [spec.encode(p) for p in PROMPTS[:3]]
    plain, fast = plain_then_speculative(spec.engine, prompts, greedy(12), "static")
    assert learned == [False] * 3 + [True] * 3 and len(drafter.corpus) == 3
    assert fast["tokens"] == plain["tokens"]


def test_metrics_show_the_corpus(tiny_llama_dir):
    from types import SimpleNamespace

    from specdecode.serving.metrics import _EngineCollector

    spec = suffix_llm(tiny_llama_dir)
    spec.generate(PROMPTS[:2], greedy(8))
    served = SimpleNamespace(engine=spec.engine, num_finished_requests=0, num_failed_requests=0)
    found = {m.name: m.samples[0].value for m in _EngineCollector(served, "t").collect()}
    assert found["specdecode:suffix_corpus_requests"] == 2
    assert found["specdecode:suffix_corpus_tokens"] == 16
