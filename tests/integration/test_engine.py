"""The offline API end to end on a tiny model with a character tokenizer."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from transformers import AutoModelForCausalLM

from specdecode import LLM, SamplingParams
from specdecode.errors import InvalidRequestError

PROMPTS = ["Hello there", "A", "The quick brown fox jumps", "12345"]


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(str(tiny_llama_dir))


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **kw)


def test_greedy_equals_transformers_generate(llm, tiny_llama_dir):
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    for prompt in PROMPTS[:2]:
        ids = llm.encode(prompt)
        out = llm.generate(prompt, greedy(24))[0].outputs[0]
        x = torch.tensor([ids])
        ref = hf.generate(
            x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=24,
            min_new_tokens=24,
            do_sample=False,
            pad_token_id=0,
        )
        assert out.token_ids == ref[0, len(ids) :].tolist()
        assert out.finish_reason == "length"


def test_batched_equals_one_at_a_time(llm):
    together = llm.generate(PROMPTS, greedy(20))
    for prompt, out in zip(PROMPTS, together, strict=True):
        alone = llm.generate(prompt, greedy(20))[0]
        assert out.outputs[0].token_ids == alone.outputs[0].token_ids
        assert out.prompt == prompt


def test_preemption_loses_nothing(tiny_llama_dir, llm):
    """A KV cache of 6 blocks of 16 tokens cannot hold four 40-token sequences at once: the
    scheduler must preempt and recompute, and every output must equal the unconstrained one."""
    small = LLM(str(tiny_llama_dir), kv_cache_memory_gb=7 * 16 * 512 / 2**30)
    assert small.engine.manager.capacity_tokens == 6 * 16
    want = llm.generate(PROMPTS, greedy(30))
    got = small.generate(PROMPTS, greedy(30))
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert small.engine.scheduler.num_preemptions > 0


def test_priority_scheduling_runs_lower_priorities_first(tiny_llama_dir, llm):
    """scheduling_policy "priority" (vLLM's): one request at a time, they run in order of
    priority (lower first), not arrival, with the same tokens; and under a cache too small for
    all, preemption loses nothing. Without the policy a priority is refused."""
    one = LLM(str(tiny_llama_dir), scheduling_policy="priority", max_num_seqs=1)
    engine = one.engine
    seqs = [engine.add_request(one.encode(p), greedy(8), str(k), priority=pr)
            for k, (p, pr) in enumerate(zip(PROMPTS[:3], (2, 0, 1), strict=True))]  # fmt: skip
    finished = []
    while engine.has_unfinished():
        engine.step()
        finished += [s.request_id for s in seqs if s.finished and s.request_id not in finished]
    assert finished == ["1", "2", "0"]
    want = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:3], greedy(8))]
    assert [s.output_token_ids for s in seqs] == want
    small = LLM(str(tiny_llama_dir), kv_cache_memory_gb=7 * 16 * 512 / 2**30,
                scheduling_policy="priority")  # fmt: skip
    got = small.generate(PROMPTS, greedy(30), priority=[3, 1, 2, 0])
    want = llm.generate(PROMPTS, greedy(30))
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert small.engine.scheduler.num_preemptions > 0
    with pytest.raises(InvalidRequestError, match="--scheduling-policy priority") as e:
        llm.generate(PROMPTS[:1], greedy(2), priority=[1])
    assert e.value.param == "priority"
    with pytest.raises(InvalidRequestError, match="one priority per prompt"):
        small.generate(PROMPTS[:2], greedy(2), priority=[1])


def test_prompt_logprobs_equal_a_full_forward(tiny_llama_dir, llm):
    """vLLM's prompt_logprobs: each prompt token's log-probability after the tokens before
    it equals transformers' over the whole prompt, with its rank and top-n, whether the
    prompt is fed whole, in chunks of 8, to a speculative engine, or recomputed after a
    preemption; a prefix-cached repeat still scores every position; one entry set for n."""
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    text = "The quick brown fox jumps over the lazy dog"
    ids = llm.encode(text)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].log_softmax(-1)
    want = [float(ref[p - 1, t]) for p, t in enumerate(ids) if p]
    ranks = [int((ref[p - 1] > ref[p - 1, t]).sum()) + 1 for p, t in enumerate(ids) if p]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    small = 7 * 16 * 512 / 2**30  # 6 blocks: four of these cannot run at once
    engines = [llm, LLM(str(tiny_llama_dir), max_num_batched_tokens=8),
               LLM(str(tiny_llama_dir), speculative_config=spec, speculative_policy="static"),
               LLM(str(tiny_llama_dir), kv_cache_memory_gb=small)]  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=30, prompt_logprobs=3, n=2, ignore_eos=True)
    for engine in engines:
        for out in engine.generate([text] * (4 if engine is engines[-1] else 2), params):
            got = out.prompt_logprobs
            assert got[0] is None and len(got) == len(ids)
            assert [d[t].logprob for d, t in zip(got[1:], ids[1:], strict=True)] == (
                pytest.approx(want, abs=1e-4)
            )
            assert [d[t].rank for d, t in zip(got[1:], ids[1:], strict=True)] == ranks
            top = [t for t, lp in got[5].items() if lp.rank <= 3]
            assert top == ref[4].topk(3).indices.tolist()
            assert out.outputs[1].logprobs is None and len(out.outputs) == 2
    assert engines[-1].engine.scheduler.num_preemptions > 0
    assert llm.generate(text, greedy(2))[0].prompt_logprobs is None
    with pytest.raises(InvalidRequestError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)


def test_seeds_reproduce_and_differ(llm):
    a = llm.generate(PROMPTS[0], SamplingParams(temperature=1.0, seed=3, max_tokens=30))
    b = llm.generate(PROMPTS[0], SamplingParams(temperature=1.0, seed=3, max_tokens=30))
    c = llm.generate(PROMPTS[0], SamplingParams(temperature=1.0, seed=4, max_tokens=30))
    assert a[0].outputs[0].token_ids == b[0].outputs[0].token_ids
    assert a[0].outputs[0].token_ids != c[0].outputs[0].token_ids


def test_seeded_request_is_independent_of_its_batch(llm):
    params = SamplingParams(temperature=1.0, seed=11, max_tokens=20)
    alone = llm.generate(PROMPTS[2], params)[0].outputs[0].token_ids
    mixed = llm.generate(
        PROMPTS, [SamplingParams(temperature=0.9, max_tokens=25)] * 2 + [params, greedy(5)]
    )
    assert mixed[2].outputs[0].token_ids == alone


def test_stop_string_cuts_text_and_stops(llm):
    full = llm.generate(PROMPTS[0], greedy(40))[0].outputs[0].text
    stop = full[10:13]
    out = llm.generate(PROMPTS[0], greedy(40, stop=[stop]))[0].outputs[0]
    assert out.finish_reason == "stop"
    assert out.text == full[: full.index(stop)]
    kept = llm.generate(PROMPTS[0], greedy(40, stop=[stop], include_stop_str_in_output=True))
    assert kept[0].outputs[0].text == full[: full.index(stop) + len(stop)]
    assert out.stop_reason == stop and kept[0].outputs[0].stop_reason == stop  # (vLLM's)


def test_stop_token_and_eos(llm):
    full = llm.generate(PROMPTS[0], greedy(40))[0].outputs[0].token_ids
    tok = full[7]
    out = llm.generate(PROMPTS[0], greedy(40, stop_token_ids=[tok]))[0].outputs[0]
    assert out.token_ids == full[: full.index(tok) + 1] and out.finish_reason == "stop"
    assert out.stop_reason == tok  # (vLLM's: the stop token's id; None for EOS and length)
    assert llm.generate(PROMPTS[0], greedy(5))[0].outputs[0].stop_reason is None
    # its text is left out, unless asked for (vLLM's include_stop_str_in_output)
    text = llm.tokenizer.decode(out.token_ids)
    stop_text = llm.tokenizer.decode([tok])
    assert stop_text and out.text == text[: -len(stop_text)]
    kept = llm.generate(
        PROMPTS[0], greedy(40, stop_token_ids=[tok], include_stop_str_in_output=True)
    )
    assert kept[0].outputs[0].text == text
    eos = llm.tokenizer.eos_token_id
    if eos in full:
        out = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=40))[0]
        assert out.outputs[0].token_ids[-1] == eos


def test_stream_concatenates_to_the_text(llm):
    params = greedy(30, stop=["zz"])
    pieces = list(llm.stream(PROMPTS[0], params))
    assert "".join(pieces) == llm.generate(PROMPTS[0], params)[0].outputs[0].text


def test_an_abandoned_stream_or_a_bad_prompt_leaves_nothing_behind(llm):
    """A consumer that stops reading a stream, or a batch with one bad prompt, must not leave
    requests queued or holding KV blocks for the next call to run."""
    free = llm.engine.manager.num_free_blocks
    stream = llm.stream(PROMPTS[0], SamplingParams(max_tokens=None, ignore_eos=True))
    next(stream)
    stream.close()
    assert not llm.engine.has_unfinished() and llm.engine.manager.num_free_blocks == free
    with pytest.raises(InvalidRequestError, match="context"):
        llm.generate([PROMPTS[0], "x" * 256], greedy(5))
    assert not llm.engine.has_unfinished() and llm.engine.num_tracked() == 0
    before = llm.engine.num_generated_tokens
    llm.generate(PROMPTS[1], greedy(5))
    assert llm.engine.num_generated_tokens - before == 5  # only this request ran


def test_a_suspended_stream_neither_holds_up_generate_nor_loses_its_text(llm):
    """generate() while a stream is suspended mid-way returns when its own requests are done
    (the stream, unbounded here, would never finish), and the stream then goes on where it was."""
    params = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)
    stream = llm.stream(PROMPTS[0], params)
    first = next(stream)
    out = llm.generate(PROMPTS[1], greedy(5))[0]
    assert len(out.outputs[0].token_ids) == 5
    rest = [next(stream) for _ in range(3)]
    stream.close()
    assert not llm.engine.has_unfinished()
    bounded = replace(params, max_tokens=20)
    whole = llm.generate(PROMPTS[0], bounded)[0].outputs[0].text
    assert whole.startswith(first + "".join(rest))


def test_chat_template_is_applied(llm):
    out = llm.chat([{"role": "user", "content": "hi"}], greedy(5))[0]
    assert out.prompt_token_ids == llm.encode("<user>hi<assistant>")


def test_the_offline_api_reads_prompts_and_chat_options_as_vllm_does(llm, capsys):
    """Token ids of the wrong type are refused before anything runs (they failed the whole
    batch mid-step); numpy ids, generators, `use_tqdm` and chat's template options are read as
    vLLM reads them; a chat output's prompt is the rendered template; the sampled token's
    rank is its rank in the vocabulary, top-n or not."""
    import numpy as np

    before = llm.engine.num_prompt_tokens
    for bad in ({"prompt_token_ids": [1.0, 2.0]}, {"prompt_token_ids": ["a", "b"]}, [True]):
        with pytest.raises(InvalidRequestError):
            llm.generate([PROMPTS[0], bad], greedy(2))
    with pytest.raises(InvalidRequestError, match="prompts must be"):
        llm.generate(5, greedy(2))
    assert llm.engine.num_prompt_tokens == before and not llm.engine.has_unfinished()
    ids = llm.encode(PROMPTS[0])
    want = llm.generate({"prompt_token_ids": ids}, greedy(3))[0].outputs[0].token_ids
    assert llm.generate(list(np.array(ids)), greedy(3))[0].outputs[0].token_ids == want
    outs = llm.generate((p for p in PROMPTS[:2]), greedy(3), use_tqdm=True)
    assert len(outs) == 2 and "generating" in capsys.readouterr().err
    hi = [{"role": "user", "content": "hi"}]
    assert llm.chat(hi, greedy(2))[0].prompt == "<user>hi<assistant>"
    assert llm.chat(hi, greedy(2), add_generation_prompt=False)[0].prompt == "<user>hi"
    own = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    assert llm.chat(hi, greedy(2), chat_template=own)[0].prompt == "[hi]"
    with pytest.raises(InvalidRequestError, match="add_generation_prompt=False"):
        llm.chat(hi, greedy(2), continue_final_message=True)
    sampled = SamplingParams(temperature=2.0, seed=3, max_tokens=16, logprobs=0)
    o = llm.generate(PROMPTS[0], sampled)[0].outputs[0]
    ranks = [e[t].rank for t, e in zip(o.token_ids, o.logprobs, strict=True)]
    assert all(isinstance(r, int) and r >= 1 for r in ranks) and max(ranks) > 1
    o = llm.generate(PROMPTS[0], greedy(4, logprobs=0))[0].outputs[0]
    assert [e[t].rank for t, e in zip(o.token_ids, o.logprobs, strict=True)] == [1] * 4


def test_context_limit(llm, tiny_llama_dir):
    with pytest.raises(InvalidRequestError, match="context"):
        llm.generate("x" * 256, greedy(5))
    with pytest.raises(InvalidRequestError, match="empty"):
        llm.generate({"prompt_token_ids": []}, greedy(5))
    out = llm.generate("x" * 250, SamplingParams(temperature=0, max_tokens=None, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 6 and out[0].outputs[0].finish_reason == "length"


@pytest.mark.parametrize(
    "setting",
    [
        {"max_num_seqs": 0},
        {"max_num_batched_tokens": 0},
        {"block_size": 0},
        {"max_model_len": 1},
    ],  # fmt: skip
)
def test_settings_that_could_never_schedule_are_refused(tiny_llama_dir, setting):
    """A zero budget would leave every request queued forever: refused when the engine is
    built, with the setting's name."""
    with pytest.raises(InvalidRequestError, match=next(iter(setting))):
        LLM(str(tiny_llama_dir), **setting)


def test_draft_slots_give_way_before_a_request_is_preempted(tiny_llama_dir, llm):
    """Two 40-token requests fit a 6-block cache, their 16-node draft trees do not: they decode
    without drafts at those steps rather than preempt each other, and lose nothing."""
    small = LLM(
        str(tiny_llama_dir),
        kv_cache_memory_gb=7 * 16 * 512 / 2**30,
        speculative_config={"method": "ngram", "num_speculative_tokens": 16,
                            "prompt_lookup_min": 1},
        speculative_policy="static",
    )  # fmt: skip
    prompts = PROMPTS[:2]
    want = llm.generate(prompts, greedy(30))
    got = small.generate(prompts, greedy(30))
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert small.engine.scheduler.num_preemptions == 0
    assert small.engine.spec_stats.num_drafts > 0  # drafting where the trees fit


def test_a_chat_template_of_ones_own(tiny_llama_dir, llm, tmp_path):
    """--chat-template: a file or the template itself replaces the model's; a missing file,
    bad Jinja and a template that refuses the messages are clear errors."""
    msgs = [{"role": "user", "content": "hi"}]
    assert llm.apply_chat_template(msgs) == "<user>hi<assistant>"
    inline = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}>"
    f = tmp_path / "t.jinja"
    f.write_text(inline)
    for given in (inline, str(f)):
        own = LLM(str(tiny_llama_dir), chat_template=given, share_model_with=llm)
        assert own.apply_chat_template(msgs) == "[hi]>"
        want = own.generate("[hi]>", greedy(8))[0].outputs[0].token_ids
        assert own.chat(msgs, greedy(8))[0].outputs[0].token_ids == want
    with pytest.raises(InvalidRequestError, match="not found"):
        LLM(str(tiny_llama_dir), chat_template=str(tmp_path / "none.jinja"))
    with pytest.raises(InvalidRequestError, match="not valid Jinja"):
        LLM(str(tiny_llama_dir), chat_template="{% for m in messages %}")
    strict = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}x"
    own = LLM(str(tiny_llama_dir), chat_template=strict, share_model_with=llm)
    with pytest.raises(InvalidRequestError, match="rejected the messages: user first"):
        own.chat([{"role": "system", "content": "s"}], greedy(4))


def test_prefix_caching_reuses_earlier_requests_and_changes_no_token(tiny_llama_dir, llm):
    """A prompt that starts like an earlier one computes only the rest (its first full blocks
    are found), and every token, greedy or seeded, is the uncached engine's: alone, batched,
    with speculation, and under a cache small enough to evict and preempt."""
    off = LLM(str(tiny_llama_dir), enable_prefix_caching=False, share_model_with=llm)
    assert not off.engine.manager.prefix_caching and llm.engine.manager.prefix_caching
    base = "The quick brown fox jumps over the lazy dog. " * 2  # 90 tokens: 5 full blocks
    prompts = [base + tail for tail in ("Then", "And so", "x", "The quick")]
    params = [greedy(20), SamplingParams(temperature=1.0, seed=3, max_tokens=20, ignore_eos=True)]
    spec = LLM(
        str(tiny_llama_dir), share_model_with=llm, speculative_policy="static",
        speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                            "prompt_lookup_min": 1},
    )  # fmt: skip
    small = LLM(str(tiny_llama_dir), kv_cache_memory_gb=9 * 16 * 512 / 2**30)
    for p in params:
        want = [o.outputs[0].token_ids for o in off.generate(prompts, p)]
        for engine in (llm, spec, small):
            first = engine.generate(prompts[0], p)[0]
            assert first.outputs[0].token_ids == want[0]
            got = engine.generate(prompts, p)  # the rest find the first's blocks
            assert [o.outputs[0].token_ids for o in got] == want
            assert all(o.num_cached_tokens >= 80 for o in got)
            alone = engine.generate(prompts[2], p)[0]
            assert alone.outputs[0].token_ids == want[2] and alone.num_cached_tokens == 80
    assert small.engine.scheduler.num_preemptions > 0
    assert spec.engine.spec_stats.num_accepted_tokens > 0
    m = llm.engine.manager
    assert m.prefix_hits > 0 and m.prefix_queries > m.prefix_hits


def test_n_choices_request_ids_and_the_fields_vllm_users_read(llm):
    """n choices per prompt (choice j seeded with seed + j, as the server does), request ids
    that keep rising across calls, the prompt of a dict, and cumulative_logprob."""
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=8, ignore_eos=True, n=3)
    out = llm.generate([PROMPTS[0], {"prompt": PROMPTS[1]}], params)
    assert [len(o.outputs) for o in out] == [3, 3]
    assert [c.index for c in out[0].outputs] == [0, 1, 2]
    assert out[1].prompt == PROMPTS[1]
    for j in range(3):  # choice j is the request seeded with seed + j
        alone = SamplingParams(temperature=1.0, seed=7 + j, max_tokens=8, ignore_eos=True)
        assert (
            out[0].outputs[j].token_ids == llm.generate(PROMPTS[0], alone)[0].outputs[0].token_ids
        )
    first, second = llm.generate("a", greedy(2)), llm.generate("b", greedy(2))
    assert int(second[0].request_id) > int(first[0].request_id) > int(out[1].request_id)
    o = llm.generate(PROMPTS[0], greedy(5, logprobs=2))[0].outputs[0]
    assert o.cumulative_logprob == pytest.approx(
        sum(e[t].logprob for t, e in zip(o.token_ids, o.logprobs, strict=True))
    )
    for t, e in zip(o.token_ids, o.logprobs, strict=True):  # vLLM's shape: sampled first
        assert next(iter(e)) == t and len(e) in (2, 3)
        assert sorted(lp.rank for lp in e.values() if lp.rank) == [1, 2]
        assert e[t].decoded_token == llm.tokenizer.decode([t])
    assert llm.generate(PROMPTS[0], greedy(2))[0].outputs[0].cumulative_logprob is None
    with pytest.raises(InvalidRequestError, match="n = 1"):
        next(llm.stream(PROMPTS[0], SamplingParams(max_tokens=2, n=2)))
    with pytest.raises(InvalidRequestError, match="n must be 1"):
        llm.engine.add_request([5, 6], SamplingParams(max_tokens=2, n=2))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"stop": [1]}, "stop must be a string or a list of strings"),
        ({"stop": 5}, "stop must be a string or a list of strings"),
        ({"stop_token_ids": 5}, "stop_token_ids must be a list"),
        ({"logprobs": True}, "logprobs must be an integer"),
        ({"temperature": True}, "temperature must be a finite number"),
        ({"max_tokens": True}, "max_tokens must be a positive integer"),
        ({"top_k": True}, "top_k"),
        ({"top_p": "0.5"}, "top_p"),
        ({"ignore_eos": "no"}, "ignore_eos must be true or false"),
        ({"include_stop_str_in_output": "no"}, "include_stop_str_in_output"),
        ({"n": 0}, "n must be a positive integer"),
    ],
)
def test_sampling_values_of_the_wrong_type_are_refused(kwargs, message):
    with pytest.raises(InvalidRequestError, match=message):
        SamplingParams(**kwargs)
    with pytest.raises(ValueError):  # (a ValueError too, as vLLM raises)
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    "setting, message",
    [
        ({"kv_cache_memory_gb": -1}, "kv_cache_memory_gb must be above 0"),
        ({"kv_cache_memory_gb": 0}, "kv_cache_memory_gb must be above 0"),
        ({"speculative_policy": "fast"}, "unknown speculative policy 'fast'"),
        ({"enable_prefix_caching": "no"}, "enable_prefix_caching must be True or False"),
        ({"seed": "x"}, "seed must be an integer"),
        ({"scheduling_policy": "lifo"}, "scheduling_policy must be fcfs or priority"),
        ({"quantization": "fp8"}, "quantization must be int8, int4 or None"),
    ],
)
def test_engine_settings_of_the_wrong_value_are_refused_before_loading(setting, message):
    from specdecode.config import EngineConfig

    with pytest.raises(InvalidRequestError, match=message):
        EngineConfig(**setting)


def test_sampling_params_of_the_wrong_type_are_refused_by_generate(llm):
    with pytest.raises(InvalidRequestError, match="must be SamplingParams"):
        llm.generate("a", {"temperature": 0})


def test_chat_takes_openai_text_parts(llm):
    plain = [{"role": "user", "content": "Hello there"}]
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hello "},
                                          {"type": "text", "text": "there"}]}]  # fmt: skip
    assert llm.apply_chat_template(parts) == llm.apply_chat_template(plain)
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    with pytest.raises(InvalidRequestError, match="only text content parts"):
        llm.chat(image, greedy(2))
