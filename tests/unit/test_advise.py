"""The advisor's traffic reader and prediction, and the benchmark report's verdicts."""

from __future__ import annotations

import json

import pytest

from specdecode import advise
from specdecode.advise import CostModel, Measured, predict, read_traffic
from specdecode.bench.report import seed_comparison
from specdecode.engine.controller import DraftCostModel, StepCostModel
from specdecode.errors import InvalidRequestError


def test_read_traffic_formats_and_bad_lines(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text(
        "\n".join(
            [
                json.dumps({"prompt": "hi", "temperature": 0.7, "max_completion_tokens": 5}),
                json.dumps([{"role": "user", "content": "hello"}]),
                "",
                json.dumps({"messages": [{"role": "wizard", "content": "x"}]}),
                json.dumps({"prompt": "x", "max_tokens": 0}),
                json.dumps({"prompt": "x", "top_p": 0}),
                "[1, 2",
                json.dumps("just a string"),
            ]
        )
    )
    t = read_traffic(p, default_max_tokens=9)
    # no temperature: 1.0, as the server samples such a request (OpenAI's default)
    assert [(r.line, r.temperature, r.max_tokens) for r in t.requests] == [(1, 0.7, 5), (2, 1.0, 9)]
    assert t.requests[1].messages == [{"role": "user", "content": "hello"}]
    assert [b.split(":")[0] for b in t.bad_lines] == [f"t.jsonl line {n}" for n in (4, 5, 6, 7, 8)]
    assert "role" in t.bad_lines[0] and "max_tokens" in t.bad_lines[1]
    assert "top_p" in t.bad_lines[2] and "JSON" in t.bad_lines[3]
    with pytest.raises(InvalidRequestError, match="not found"):
        read_traffic(tmp_path / "nothing.jsonl")
    # OpenAI bodies with explicit nulls read as the server reads them; a lone surrogate (a log
    # cut inside an emoji) and a too deeply nested line are bad lines, not a failed run
    p.write_text(
        "\n".join(
            [
                json.dumps({"prompt": "a", "top_p": None, "temperature": None}),
                json.dumps({"prompt": "b", "max_completion_tokens": None, "max_tokens": 7}),
                '{"prompt": "\\ud83d"}',
                "[" * 100_000,
                json.dumps({"prompt": "c", "max_completion_tokens": 0, "max_tokens": 7}),
            ]
        )
    )
    t = read_traffic(p, default_max_tokens=9)
    assert [(r.params.top_p, r.max_tokens) for r in t.requests] == [(1.0, 9), (1.0, 7)]
    assert "surrogate" in t.bad_lines[0] and "line 4" in t.bad_lines[1]
    assert "line 5" in t.bad_lines[2]  # max_completion_tokens 0: the server refuses it too


def test_read_traffic_keeps_the_sampling_fields_the_server_honours(tmp_path):
    from specdecode.advise import _params

    p = tmp_path / "t.jsonl"
    lines = [
        {"prompt": "a", "temperature": 0.8, "top_k": 20, "min_p": 0.1, "presence_penalty": 0.5,
         "frequency_penalty": None, "repetition_penalty": 1.2, "logit_bias": {"7": -100},
         "min_tokens": 3},
        {"prompt": "b", "presence_penalty": 3},
        {"prompt": "c", "logit_bias": {"x": 1}},
        {"prompt": "d", "min_tokens": 50, "max_tokens": 8},
    ]  # fmt: skip
    p.write_text("\n".join(json.dumps(x) for x in lines))
    t = read_traffic(p, default_max_tokens=9)
    assert [r.line for r in t.requests] == [1]
    (params,) = _params(t.requests)
    assert (params.top_k, params.min_p, params.presence_penalty) == (20, 0.1, 0.5)
    assert (params.frequency_penalty, params.repetition_penalty) == (0.0, 1.2)
    assert (params.logit_bias, params.min_tokens, params.temperature) == ({7: -100}, 3, 0.8)
    assert ["presence_penalty" in t.bad_lines[0], "logit_bias" in t.bad_lines[1]] == [True] * 2
    assert "min_tokens" in t.bad_lines[2]


def _measured(accepted, drafted, decisions, tree=False) -> Measured:
    return Measured(
        label="x", config={"method": "ngram"}, max_depth=len(drafted), tree=tree,
        decisions=decisions, accepted_per_position=accepted, drafted_per_position=drafted,
        num_drafts=drafted[0], num_draft_tokens=sum(drafted), num_accepted=sum(accepted),
        tok_s=1.0,
    )  # fmt: skip


def test_traffic_lines_are_read_as_the_server_reads_their_bodies(tmp_path):
    """Content-part arrays and null contents, stops, `ignore_eos`, structured output and
    temperatures past 2 are what the server takes: the advisor measures them so. `--temperature`
    fills in a line without one; a byte-order mark does not cost the first line."""
    from specdecode.advise import _params

    p = tmp_path / "t.jsonl"
    lines = [
        {"messages": [{"role": "system", "content": None},
                      {"role": "user", "content": [{"type": "text", "text": "a"},
                                                   {"type": "text", "text": "b"}]}]},
        {"messages": [{"role": "user", "content": "x"}], "stop": "\n", "ignore_eos": True,
         "response_format": {"type": "json_object"}, "temperature": 3, "seed": 5},
        {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
    ]  # fmt: skip
    p.write_text("\n".join(json.dumps(x) for x in lines), encoding="utf-8-sig")
    t = read_traffic(p, default_max_tokens=9)
    assert [r.line for r in t.requests] == [1, 2] and "text content" in t.bad_lines[0]
    assert t.requests[0].messages == [
        {"role": "system", "content": ""},
        {"role": "user", "content": "ab"},
    ]
    a, b = _params(t.requests)
    assert (a.temperature, a.seed, b.temperature, b.seed) == (1.0, 0, 3.0, 5)
    assert b.stop == ["\n"] and b.ignore_eos and b.structured_output is not None
    t = read_traffic(p, default_max_tokens=9, default_temperature=0.0)
    assert [r.temperature for r in t.requests] == [0.0, 3.0]
    # vLLM's chat rendering fields are kept for the rendering (a prefill continued)
    line = {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}],
            "add_generation_prompt": False, "continue_final_message": True,
            "chat_template_kwargs": {"enable_thinking": False}}  # fmt: skip
    p.write_text(json.dumps(line))
    (r,) = read_traffic(p, default_max_tokens=9).requests
    assert r.chat_options["continue_final_message"] and not r.chat_options["add_generation_prompt"]
    assert r.chat_options["chat_template_kwargs"] == {"enable_thinking": False}
    # an agent's traffic: its tools and earlier calls render as the server renders them; a
    # "required" tool choice is constrained there, and so here
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    lines = [
        {"messages": [{"role": "user", "content": "x"},
                      {"role": "assistant", "content": None, "tool_calls": [call]},
                      {"role": "tool", "tool_call_id": "c", "content": "2"}], "tools": [tool]},
        {"messages": [{"role": "user", "content": "x"}], "tools": [tool],
         "tool_choice": "required"},
        {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "web"}]},
    ]  # fmt: skip
    p.write_text("\n".join(json.dumps(x) for x in lines))
    t = read_traffic(p, default_max_tokens=9)
    assert [r.line for r in t.requests] == [1, 2] and "only function tools" in t.bad_lines[0]
    first, second = t.requests
    assert first.chat_options["tools"] == [tool]
    assert first.messages[1]["tool_calls"][0]["function"]["arguments"] == {"a": 1}
    assert first.messages[2]["tool_call_id"] == "c"
    assert first.params.structured_output is None and second.params.structured_output is not None


def test_traffic_in_batch_api_files_and_responses_bodies(tmp_path):
    """An OpenAI Batch API input file (each line's body, whatever its endpoint) and Responses
    API bodies (`input` after `instructions`, `max_output_tokens`, `text.format`) are traffic
    too, read as the server runs them."""
    p = tmp_path / "batch.jsonl"
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 7}
    resp = {"input": [{"role": "user", "content": [{"type": "input_text", "text": "yo"}]}],
            "instructions": "be brief", "max_output_tokens": 5, "temperature": 0,
            "text": {"format": {"type": "json_object"}}}  # fmt: skip
    lines = [
        {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": chat},
        {"custom_id": "b", "method": "POST", "url": "/v1/responses", "body": resp},
        {"input": "plain", "previous_response_id": "resp_1"},
    ]
    p.write_text("\n".join(json.dumps(x) for x in lines))
    t = read_traffic(p, default_max_tokens=9)
    assert [r.line for r in t.requests] == [1, 2] and "previous_response_id" in t.bad_lines[0]
    a, b = t.requests
    assert a.messages == chat["messages"] and a.max_tokens == 7
    assert b.messages == [{"role": "system", "content": "be brief"},
                          {"role": "user", "content": "yo"}]  # fmt: skip
    assert (b.max_tokens, b.temperature) == (5, 0.0) and b.params.structured_output is not None


def test_one_token_answers_predict_no_gain_and_no_division_by_zero():
    step = StepCostModel()
    for n in (1, 2, 4, 8):
        step.calibrate(n, 0.010)  # a flat curve: a prefill's marginal cost reads as 0
    cost = CostModel(step, None)
    one = predict(cost, 4, prompt_tokens=20, output_tokens=1)
    assert one["throughput_tok_s"] == pytest.approx(4 / 0.010) and one["tpot_ms"] == 0.0
    # time per output token counts the steps after the first token, as `bench serve` does
    many = predict(cost, 1, prompt_tokens=20, output_tokens=11)
    assert many["tpot_ms"] == pytest.approx(10.0)


def test_the_advice_says_when_requests_past_num_requests_went_unused():
    step = StepCostModel()
    for n in (1, 2, 4, 8):
        step.calibrate(n, 0.010)
    costs = {"off": CostModel(step, None)}
    used = advise.Traffic([], [], unused=8)
    text = advise.advice(1, used, [], {}, costs, 20, 50, 10.0, 0.0)["text"]
    assert "Traffic: 0 requests (0 bad lines skipped; the 8 after them unused: --num-requests)" in (
        text
    )
    text = advise.advice(1, advise.Traffic([], []), [], {}, costs, 20, 50, 10.0, 0.0)["text"]
    assert "Traffic: 0 requests (0 bad lines skipped), " in text


def test_candidates_for_the_default_model_include_the_lookup_branch():
    from specdecode.advise import candidate_configs
    from specdecode.config import SpeculativeConfig

    got = candidate_configs(None, None, None)
    assert got["eagle3+lookup"]["prompt_lookup_tokens"] > 0
    assert got["suffix"] == {"method": "suffix"}  # model-free: offered for every model
    for cfg in got.values():
        SpeculativeConfig.from_dict(cfg)  # every candidate is a valid config
    assert "eagle3+lookup" not in candidate_configs("some/model", None, None)  # no shipped head
    got = candidate_configs("some/model", None, "a/draft")
    assert got["draft_model+lookup"] == {
        "method": "draft_model",
        "model": "a/draft",
        "prompt_lookup_tokens": 8,
    }
    for cfg in got.values():
        SpeculativeConfig.from_dict(cfg)


def test_prediction_follows_the_cost_model():
    step = StepCostModel()
    for n in (1, 2, 4, 8, 16, 32, 64, 128, 256):
        step.calibrate(n, 0.010 + 0.001 * n)  # 10 ms + 1 ms per token
    draft = DraftCostModel()
    for d in (1, 2, 4, 8):
        draft.observe(d, 0.002 * d)
    cost = CostModel(step, draft)
    # 100 request-steps: 80 drafted depth 1 and 60 accepted it, 50 reached depth 2, 25 accepted
    m = _measured([60, 25], [80, 50], 100)
    assert m.expected_tokens(1) == pytest.approx(1.6)
    assert m.expected_tokens(2) == pytest.approx(1.85)
    assert m.drafts_per_step(2) == pytest.approx(1.3)
    # a lookup branch drafts past the head's depth 2, at any depth: its tokens always count
    branch = _measured([60, 25, 20, 10], [80, 50, 30, 20], 100)
    branch.max_depth = 2
    assert branch.expected_tokens(1) == pytest.approx(1.9)
    assert branch.expected_tokens(2) == pytest.approx(2.15)
    plain = predict(cost, 4, prompt_tokens=20, output_tokens=50)
    # 49 steps of T(4) = 14 ms (the first token comes with the prefill), plus 4 prefills of 20
    # tokens at 1 ms per token
    assert plain["throughput_tok_s"] == pytest.approx(4 * 50 / (49 * 0.014 + 4 * 0.020))
    spec = predict(cost, 4, 20, 50, m, 2)
    n = 4 * 2.3
    t = 0.010 + 0.001 * n + 0.002 * 4 * 1.3
    assert spec["tokens_fed"] == pytest.approx(n)
    assert spec["throughput_tok_s"] == pytest.approx(4 * 50 / (49 / 1.85 * t + 4 * 0.020), 1e-3)
    # a drafter with a catch-up cost (a draft model's prefill of each prompt) pays it too
    catching = DraftCostModel()
    for d, c in ((1, 0), (2, 0), (4, 100), (8, 0), (1, 50)):
        catching.observe(d, 0.002 * d + 0.0005 * c, c)
    late = predict(CostModel(step, catching), 4, 20, 50, m, 2)
    assert late["catch_up_ms"] == pytest.approx(4 * 20 * 0.5, 1e-2)
    slower = 4 * 50 / (4 * 50 / spec["throughput_tok_s"] + 4 * 20 * 0.0005)
    assert late["throughput_tok_s"] == pytest.approx(slower, 1e-2)
    # more requests in flight: the same drafts cost more in absolute terms, plain gains more
    big = predict(cost, 64, 20, 50)
    big_spec = predict(cost, 64, 20, 50, m, 2)
    small_gain = spec["throughput_tok_s"] / plain["throughput_tok_s"]
    assert big_spec["throughput_tok_s"] / big["throughput_tok_s"] < small_gain


def test_drafting_is_priced_on_the_levels_the_drafter_ran():
    """The draft-cost model is fitted on levels run (`Drafter.drafted_depth`); a dynamic tree
    runs deeper than it keeps and a lookup branch verified alone runs none, so the kept depths
    would misprice both."""
    step = StepCostModel()
    for n in (1, 2, 4, 8, 16, 32):
        step.calibrate(n, 0.010 + 0.001 * n)
    draft = DraftCostModel()
    for d in (1, 2, 4, 8):
        draft.observe(d, 0.002 * d)
    cost = CostModel(step, draft)
    # a tree: 100 steps kept depth 1 (100) and 2 (40) but the head ran 5 levels on each
    tree = _measured([50, 10], [100, 40], 100, tree=True)
    assert tree.depth_per_step(2) == pytest.approx(1.4)  # not recorded: kept depths stand in
    tree.drafted_levels = 500
    assert tree.depth_per_step(2) == pytest.approx(5.0)
    want_ms = 1000 * 0.002 * 2 * 5  # 2 requests x 5 levels at 2 ms a level
    assert predict(cost, 2, 20, 50, tree, 2)["draft_ms"] == pytest.approx(want_ms, 1e-3)
    # a chain of 4 whose lookup branch was verified alone on half the steps: 200 levels run
    chain = _measured([80, 60, 40, 20], [100, 100, 100, 100], 100)
    chain.drafted_levels = 200
    assert chain.depth_per_step(4) == pytest.approx(2.0)
    assert chain.depth_per_step(2) == pytest.approx(1.0)  # half the positions, half the levels
    assert chain.depth_per_step(9) == pytest.approx(2.0)


def test_a_tree_is_priced_at_every_depth_and_a_shallower_one_can_win():
    """A tree drafter runs at any depth up to its own (the engine's controller plans shallower
    trees): the advice prices each depth on the nodes its tree holds (`nodes_by_depth`) and on
    what the full tree accepted up to there, so deep levels that cost more than they accept
    are cut."""
    from specdecode import advise

    step = StepCostModel()
    for n in (1, 2, 4, 8, 16, 32, 64):
        step.calibrate(n, 0.010 + 0.0005 * n)  # every fed token costs: nodes matter
    draft = DraftCostModel()
    for d in (1, 2, 4, 8):
        draft.observe(d, 0.001 * d)
    cost = CostModel(step, draft)
    # 100 steps of a 4-level tree of 16 nodes; depths 3 and 4 almost never accepted
    tree = _measured([70, 60, 1, 0], [100, 100, 100, 100], 100, tree=True)
    tree.num_draft_tokens = 1600
    tree.drafted_levels = 400
    tree.nodes_by_depth = [0.0, 4.0, 8.0, 12.0, 16.0]
    assert tree.drafts_per_step(4) == pytest.approx(16.0)
    assert tree.drafts_per_step(2) == pytest.approx(8.0)
    assert tree.depth_per_step(2) == pytest.approx(2.0)
    assert tree.expected_tokens(2) == pytest.approx(2.3)
    result = advise.advice(1, advise.Traffic([], []), [], {"eagle": tree},
                           {"off": cost, "eagle": cost}, 20, 50, 10.0, 0.0)  # fmt: skip
    best = result["options"][0]
    assert best["depth"] == 2  # deeper levels feed 4 nodes each and accept ~nothing
    full = predict(cost, 1, 20, 50, tree, 4)["throughput_tok_s"]
    assert best["throughput_tok_s"] > full
    # without the sizes (an older measurement) every depth is priced at the full tree's nodes
    tree.nodes_by_depth = []
    assert tree.drafts_per_step(2) == pytest.approx(16.0)


def _row(method, wl, temp, speedup, acc, tau):
    return dict(
        method=method, workload=wl, temperature=temp, speedup=speedup, acceptance_rate=acc, tau=tau
    )


def test_seed_comparison_states_agreement_from_the_rows():
    rows = [
        {"method": "off", "workload": "json", "temperature": 0.0, "tok_s": 50.0},
        _row("ngram", "json", 0.0, 3.4, 0.9, 4.0),
        _row("eagle3", "json", 0.0, 0.8, 0.2, 1.3),
        _row("ngram", "chat", 1.0, 0.9, 0.1, 1.1),
        _row("eagle3", "chat", 1.0, 1.1, 0.5, 1.6),
    ]
    conc = [{"method": "off", "policy": "off", "concurrency": c, "vs_off": 1.0} for c in (1, 8)] + [
        {"method": "ngram", "policy": "static", "concurrency": 1, "vs_off": 1.3},
        {"method": "ngram", "policy": "static", "concurrency": 8, "vs_off": 0.9},
        {"method": "ngram", "policy": "adaptive", "concurrency": 8, "vs_off": 1.0},
    ]
    result = {"targets": [{"target": "t", "rows": rows, "concurrency": conc}]}
    text = "\n".join(seed_comparison(result))
    # the 3x-5.6x figure is about trained drafters: n-gram's 3.4x does not count for it
    assert "with a trained drafter** (t): disagrees. Best 1.10x (eagle3, chat, T=1)" in text
    assert "Best of any method on t: 3.40x (ngram, json, T=0)" in text
    assert "(t, code/SQL/JSON at T=0): partly agrees. Best acceptance 90%" in text  # not 4x
    assert "T>=1** (t): partly agrees (judged on the fastest method, eagle3: 50%, 1.10x)" in text
    assert "2 of 2 method/workload/temperature cells under 30% acceptance" in text
    assert "ngram: static loses from concurrency 8 (0.90x at 8), adaptive worst 1.00x" in text
    assert "it starts losing at concurrency 8 here" in text
    rows[1] = _row("ngram", "json", 0.0, 4.4, 0.9, 5.0)
    rows[2] = _row("eagle3", "json", 0.0, 3.5, 0.5, 3.9)
    text = "\n".join(seed_comparison(result))
    assert "with a trained drafter** (t): agrees. Best 3.50x (eagle3, json, T=0)" in text
    assert "(t, code/SQL/JSON at T=0): agrees" in text
    rows[1] = _row("ngram", "json", 0.0, 1.4, 0.6, 2.0)
    text = "\n".join(seed_comparison(result))
    assert "T=0): disagrees. Best acceptance 60%" in text
    # no head run: the best-of-any line is a bullet of its own, not an orphaned sub-bullet;
    # a cell that drafted nothing is no evidence on acceptance
    no_heads = [r for r in rows if r["method"] != "eagle3"]
    no_heads.append({**_row("ngram", "sql", 1.0, 0.98, 0.0, 1.0), "draft_tokens": 0})
    lines = seed_comparison({"targets": [{"target": "t", "rows": no_heads}]})
    assert lines[0].startswith("Best of any method on t: 1.40x")
    text = "\n".join(lines)
    assert "1 of 1 method/workload/temperature cells under 30%" in text
    assert "1 method/workload/temperature cells drafted nothing" in text


def test_validation_runs_the_option_recommended_by_its_label(monkeypatch):
    """A `+lookup` candidate's config names the bare method: the validation must run that
    candidate's own engine and depth, not the bare drafter's."""
    from types import SimpleNamespace

    from specdecode import advise
    from specdecode.bench import serve

    step = StepCostModel()
    for n in (1, 2, 4, 8, 16):
        step.calibrate(n, 0.010 + 0.001 * n)
    draft = DraftCostModel()
    for d in (1, 2, 4):
        draft.observe(d, 0.002 * d)
    cost = CostModel(step, draft)
    ran = []

    def closed_loop(engine, ids, levels, policies, *a, **k):
        ran.append((engine.name, policies[0], engine.controller.max_depth))
        return [
            {"concurrency": c, "throughput_tok_s": 10.0, "tpot_ms": 1.0, "timed_over": "whole run"}
            for c in levels
        ]

    monkeypatch.setattr(serve, "closed_loop", closed_loop)
    llms = {
        name: SimpleNamespace(
            engine=SimpleNamespace(name=name, controller=SimpleNamespace(max_depth=5))
        )
        for name in ("off", "eagle3", "eagle3+lookup")
    }
    m = _measured([60, 25, 10, 5], [80, 50, 30, 20], 100)
    measured = {"eagle3": m, "eagle3+lookup": m}
    costs = {"off": cost, "eagle3": cost, "eagle3+lookup": cost}
    traffic = advise.Traffic([], [])
    result = advise.advice(1, traffic, [], measured, costs, 20, 50, 10.0, 0.0)
    assert result["recommended_label"] in measured
    result["options"] = [  # the lookup candidate best, at its own depth
        {**o, "depth": 4 if o["method"] == "eagle3+lookup" else 2} for o in result["options"]
    ]
    result["recommended_label"] = "eagle3+lookup"
    got = advise.validate(llms, result, measured, costs, [[1]], [None], [1], 20, 50)
    assert ("eagle3+lookup", "static", 4) in ran and ("eagle3+lookup", "adaptive", 4) in ran
    # a level too small for a steady state says it was timed over the whole run, every row
    assert got["text"].count("timed over the whole run") == len(got["rows"]) == 3
    assert not any(name == "eagle3" for name, _, _ in ran)


def test_a_recommended_config_names_only_what_differs_from_the_defaults():
    from specdecode.advise import _given
    from specdecode.config import SpeculativeConfig

    cfg = SpeculativeConfig(method="suffix", suffix_decoding_max_spec_factor=2.0)
    assert _given(cfg) == {
        "method": "suffix",
        "num_speculative_tokens": 5,
        "suffix_decoding_max_spec_factor": 2.0,
    }
    cfg = SpeculativeConfig(method="eagle3", prompt_lookup_tokens=8, speculative_token_tree=None)
    assert _given(cfg) == {
        "method": "eagle3",
        "num_speculative_tokens": 5,
        "prompt_lookup_tokens": 8,
    }


def test_the_sample_is_measured_at_the_concurrency_advised_on():
    """The engines are built for the largest validation level; the measurement itself batches
    at most the concurrency asked about (its acceptance and step times are that batch's)."""
    from types import SimpleNamespace

    from specdecode.advise import _run

    seen = []

    class Engine:
        scheduler = SimpleNamespace(max_num_seqs=16)

        def add_request(self, ids, params):
            return SimpleNamespace(finished=True, output_token_ids=[1, 2])

        def run_to_completion(self):
            seen.append(self.scheduler.max_num_seqs)
            yield []

    llm = SimpleNamespace(engine=Engine())
    bar = SimpleNamespace(update=lambda n: None)
    assert _run(llm, [[1], [2]], [None, None], bar, 2)[0] == 4
    assert seen == [2] and llm.engine.scheduler.max_num_seqs == 16
