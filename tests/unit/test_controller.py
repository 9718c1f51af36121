"""The goodput controller: cost curves, acceptance estimates, and the decisions they lead to."""

from __future__ import annotations

import pytest

from specdecode.core import Sequence
from specdecode.engine.controller import (
    DraftCostModel,
    GoodputController,
    StepCostModel,
)
from specdecode.errors import InvalidRequestError
from specdecode.sampling import SamplingParams


def seqs(n: int, temperature: float = 0.0) -> list[Sequence]:
    return [Sequence([1, 2, 3], SamplingParams(temperature=temperature)) for _ in range(n)]


def controller(
    step_time, acceptance: float | None = None, draft_s: float = 0.0, **kw
) -> GoodputController:
    """A chain drafter of depth 4 whose step time is `step_time(tokens)`, calibrated on
    1..1024 tokens, and whose drafting costs `draft_s` per level; `acceptance`: per-depth
    acceptance already observed on greedy traffic."""
    c = GoodputController("adaptive", 4, lambda k: k, **kw)
    for n in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024):
        c.step_cost.calibrate(n, step_time(n))
    for x in (1, 2, 4, 8):
        c.record_draft(x, x * draft_s)
    if acceptance is not None:
        warm = seqs(1)[0]
        for _ in range(200):  # a greedy workload whose drafts are accepted with `acceptance`
            accepted = 0
            while accepted < 4 and (hash((_, accepted)) % 1000) / 1000 < acceptance:
                accepted += 1
            c.record_verification(warm, 4, accepted)
        c.release(warm)
    return c


def memory_bound(n: int) -> float:  # verifying a few tokens costs about one
    return 0.020 + 0.0001 * n


def compute_bound(n: int) -> float:  # every token costs the same
    return 0.001 * n


def test_curves_interpolate_and_prefer_measurements():
    m = StepCostModel()
    for n, t in ((1, 1.0), (10, 2.0), (100, 11.0)):
        m.calibrate(n, t)
    assert m.predict(1) == pytest.approx(1.0)
    assert m.predict(55) == pytest.approx(6.5)
    assert m.predict(200) == pytest.approx(21.0)  # linear past the last point
    for _ in range(50):  # the engine's real steps cost twice the bare forwards
        m.observe(10, 4.0)
    assert m.predict(10) == pytest.approx(4.0, rel=0.01)
    assert m.predict(100) == pytest.approx(22.0, rel=0.02)  # calibrated shape, measured level
    d = DraftCostModel()
    for x in (1, 2, 3, 4, 8):
        d.observe(x, 0.5 + 0.25 * x)
    assert d.coefficients() == pytest.approx((0.5, 0.25, 0.0), abs=1e-4)
    d = DraftCostModel()  # a draft model's prefill of what it has not seen: d2 per token
    for x, c in ((1, 0), (2, 160), (4, 0), (8, 320), (4, 40), (2, 0)):
        d.observe(x, 0.01 + 0.02 * x + 0.003 * c, catch_up=c)
    assert d.coefficients() == pytest.approx((0.01, 0.02, 0.003), rel=0.01)
    assert d.catch_up_seconds(100) == pytest.approx(0.3, rel=0.01)
    d = DraftCostModel()  # never a catch-up: no price for one, and no negative slopes
    for x in (1, 2, 4):
        d.observe(x, 0.1 * x)
    assert d.catch_up_seconds(100) == 0.0 and min(d.coefficients()) >= 0.0

    # what predict keeps between observations is dropped by new points: a model asked
    # after every point answers as one built from the same points and asked once
    points = [("c", 1, 1.0), ("c", 100, 2.0), ("c", 200, 5.0), ("o", 50, 3.0), ("o", 60, 3.0)]
    points += [("c", 40, 3.5), ("o", 200, 4.0), ("c", 400, 9.0), ("c", 150, 2.0), ("o", 2, 1.5)]
    asked = StepCostModel()
    for n, (kind, x, t) in enumerate(points):
        (asked.calibrate if kind == "c" else asked.observe)(x, t)
        fresh = StepCostModel()
        for kind2, x2, t2 in points[: n + 1]:
            (fresh.calibrate if kind2 == "c" else fresh.observe)(x2, t2)
        for x in (1, 30, 55, 150, 300, 800):
            assert asked.predict(x) == fresh.predict(x), (n, x)


def catch_up_controller(step_time, catch_up_s: float, acceptance: float = 0.9) -> GoodputController:
    """Depth-4 chains accepted `acceptance` of the time, drafting 2 ms per level, and a draft
    model's catch-up costing `catch_up_s` per token (learned from timed proposals)."""
    c = controller(step_time, acceptance=acceptance)
    c.draft_cost = DraftCostModel()
    for x, n in ((1, 0), (4, 0), (8, 100), (4, 200), (16, 0), (2, 50)):
        c.record_draft(x, 0.002 * x + catch_up_s * n, catch_up=n)
    return c


def test_catch_up_is_priced_once_and_spread_over_the_request():
    """A draft model must prefill a new request's prompt before drafting for it: at one request
    that pays back over its answer, in a compute-bound batch of 64 it does not."""
    c = catch_up_controller(memory_bound, catch_up_s=0.001)
    long = [Sequence([1] * 160, SamplingParams(temperature=0, max_tokens=64)) for _ in range(1)]
    assert c.plan(long, 1, 1, catch_up=[159]) == [4]
    c = catch_up_controller(compute_bound, catch_up_s=0.001)
    batch = [Sequence([1] * 160, SamplingParams(temperature=0, max_tokens=64)) for _ in range(64)]
    # without a catch-up these requests would draft (verification is cheap relative to plain
    # decoding here only if drafts are free: check the catch-up is what stops them)
    assert c.plan(batch, 64, 64, catch_up=[159] * 64) == [0] * 64


def test_probes_are_paid_from_a_share_of_the_time():
    """Idle requests are probed from a credit of probe_share of every step's time: however many
    requests are idle, probing (a draft model's catch-up included) takes at most that share."""
    c = catch_up_controller(memory_bound, catch_up_s=0.0001, acceptance=0.1)
    s = [Sequence([1] * 160, SamplingParams(temperature=0, max_tokens=4096)) for _ in range(8)]
    probes = 0
    for _ in range(400):
        probes += sum(1 for k in c.plan(s, 8, 8, catch_up=[159] * 8) if k)
    # 400 steps x 20.8 ms x 0.02 = 0.166 s of credit; a probe costs 15.9 + 2 ms
    assert 7 <= probes <= 10
    cheap = catch_up_controller(memory_bound, catch_up_s=1e-6, acceptance=0.1)
    per_step = [sum(1 for k in cheap.plan(s, 8, 8, catch_up=[159] * 8) if k) for _ in range(200)]
    assert sum(per_step[:63]) == 0 and sum(per_step[63:]) > 0  # after 64 idle steps
    assert max(per_step) == 1  # one request per step at most


def test_no_probes_where_even_perfect_acceptance_would_lose():
    """In a compute-bound batch (every fed token costs the same) drafting loses whatever the
    acceptance, so a probe could not change a decision: none runs, however much credit."""
    s = [Sequence([1] * 160, SamplingParams(temperature=0, max_tokens=4096)) for _ in range(64)]
    c = catch_up_controller(compute_bound, catch_up_s=1e-6, acceptance=0.1)
    assert sum(sum(1 for k in c.plan(s, 64, 64, catch_up=[159] * 64) if k) for _ in range(400)) == 0
    # where the catch-up alone is too dear to pay back, likewise
    c = catch_up_controller(memory_bound, catch_up_s=0.01, acceptance=0.1)
    assert sum(sum(1 for k in c.plan(s, 64, 64, catch_up=[159] * 64) if k) for _ in range(400)) == 0


def test_a_probe_is_charged_what_it_really_cost():
    """Probes are charged their predicted cost, then corrected by the measured one: a probe
    that took ten times its prediction holds the next ones back for ten times as long."""

    def probe_steps(actual_factor: float) -> list[int]:
        c = catch_up_controller(memory_bound, catch_up_s=0.0001, acceptance=0.1)
        s = [Sequence([1] * 160, SamplingParams(temperature=0, max_tokens=4096)) for _ in range(8)]
        steps = []
        for step in range(600):
            plan = c.plan(s, 8, 8, catch_up=[159] * 8)
            if any(plan):
                steps.append(step)
                predicted = c.draft_cost.predict(1) + c.draft_cost.catch_up_seconds(159)
                c.draft_cost.observe = lambda *a, **k: None  # keep the prediction fixed
                c.record_draft(1, predicted * actual_factor, 159)
        return steps

    honest, dear = probe_steps(1.0), probe_steps(10.0)
    assert len(honest) >= 6 and 1 <= len(dear) <= len(honest) // 4


def test_high_acceptance_on_a_memory_bound_step_drafts_deep():
    c = controller(memory_bound, acceptance=0.9)
    assert c.plan(seqs(4), base_tokens=4, num_running=4) == [4, 4, 4, 4]
    assert c.last_predicted_gain > 2


def test_low_acceptance_turns_speculation_off():
    c = controller(memory_bound, acceptance=0.0)
    assert c.plan(seqs(4), base_tokens=4, num_running=4) == [0, 0, 0, 0]


def test_compute_bound_batches_do_not_speculate():
    c = controller(compute_bound, acceptance=0.7)
    assert c.plan(seqs(64), base_tokens=64, num_running=64) == [0] * 64


def test_the_budget_shrinks_as_drafting_gets_expensive():
    cheap = controller(memory_bound, acceptance=0.6)
    dear = controller(memory_bound, acceptance=0.6, draft_s=0.010)  # 10 ms per draft level
    deep = cheap.plan(seqs(1), 1, 1)[0]
    shallow = dear.plan(seqs(1), 1, 1)[0]
    assert deep == 4 and shallow < deep


def test_requests_learn_their_own_acceptance():
    c = controller(memory_bound, acceptance=0.9, draft_s=0.005)
    good, bad = seqs(2)
    for _ in range(30):
        c.record_verification(bad, 4, 0)
        c.record_verification(good, 4, 4)
    assert c.plan([good, bad], 2, 2) == [4, 0]


def test_hysteresis_keeps_a_plan_that_is_nearly_as_good():
    c = controller(memory_bound, acceptance=0.5, hysteresis=0.5)
    batch = seqs(2)
    first = c.plan(batch, 2, 2)
    for _ in range(3):  # a small shift in the estimates does not flip the plan
        c.record_verification(batch[0], 4, 1)
    assert c.plan(batch, 2, 2) == first


def test_drafting_starts_only_on_a_clear_predicted_gain():
    """Where drafting is predicted to gain less than `min_gain` the step decodes plainly: the
    cost model is off by several percent at compute-bound batch sizes."""
    c = controller(memory_bound, acceptance=0.9, draft_s=0.016)  # a draft level costs ~0.8 step
    rates = [c.acceptance(s) for s in seqs(1)]
    gain = max(c.goodput(1, rates, [k]) for k in (1, 2, 3, 4)) / c.goodput(1, rates, [0])
    assert 1.0 < gain < 1 + c.min_gain  # predicted to win, but by less than the margin
    assert c.plan(seqs(1), 1, 1) == [0]
    eager = controller(memory_bound, acceptance=0.9, draft_s=0.016, min_gain=0.0)
    assert eager.plan(seqs(1), 1, 1) != [0]


def test_hysteresis_does_not_keep_a_drafting_plan_that_loses():
    """A request drafting at full depth keeps drafting while it pays; once its acceptance
    falls so far that drafting is predicted to lose, it stops, hysteresis or not."""
    c = controller(memory_bound, acceptance=0.9, draft_s=0.005, hysteresis=10.0)
    seq = seqs(1)[0]
    assert c.plan([seq], 1, 1) == [4]
    for _ in range(40):
        c.record_verification(seq, 4, 0)
    assert c.plan([seq], 1, 1) == [0]


def test_catch_up_is_priced_over_part_of_the_remaining_steps():
    c = catch_up_controller(memory_bound, catch_up_s=0.001)
    seq = Sequence([1, 2, 3], SamplingParams(temperature=0.0, max_tokens=100))
    expected = [c.expected_tokens(c.acceptance(seq), c.max_depth)]
    half = c._catch_up_costs([seq], expected, [100])[0]
    assert half > 0
    c.catch_up_horizon = 1.0
    assert c._catch_up_costs([seq], expected, [100])[0] == pytest.approx(half / 2)


def test_idle_requests_are_probed():
    c = controller(memory_bound, acceptance=0.0, draft_s=0.002, probe_interval=5)
    batch = seqs(1)
    plans = [c.plan(batch, 1, 1)[0] for _ in range(12)]
    assert plans == [0, 0, 0, 0, 1, 0, 0, 0, 0, 1, 0, 0]  # one probe every 5 idle steps


def test_short_requests_are_probed_when_the_whole_engine_is_quiet():
    """Requests that each live fewer steps than the probe interval are never idle that long
    themselves; once no request has drafted for `probe_interval` steps, the next one is probed
    anyway (a controller that stopped drafting would otherwise never look again)."""
    c = controller(memory_bound, acceptance=0.0, draft_s=0.002, probe_interval=5)
    plans = []
    for _ in range(4):  # four requests of three steps each, one after another
        seq = seqs(1)[0]
        plans += [c.plan([seq], 1, 1)[0] for _ in range(3)]
        c.release(seq)
    assert plans == [0, 0, 0, 0, 1, 0, 0, 0, 0, 1, 0, 0]


def test_what_is_recorded_is_the_depth_that_fits():
    """Depths are cut to what each request can take (its context, max_tokens, cache slots)
    before they are recorded: a request cut to nothing is not counted as drafting, stays idle,
    and gets no probe it could not run."""
    c = GoodputController("static", 4, lambda k: k)
    batch = seqs(3)
    assert c.plan(batch, 3, 3, caps=[0, 2, 9]) == [0, 2, 4]
    assert c.num_drafting == 2 and c.num_decisions == 3
    assert c._idle_steps[batch[0].seq_id] == 1 and c._last_plan[batch[1].seq_id] == 2
    c = controller(memory_bound, acceptance=0.0, draft_s=0.002, probe_interval=5)
    seq = seqs(1)[0]
    assert [c.plan([seq], 1, 1, caps=[0])[0] for _ in range(8)] == [0] * 8  # no room, no probe
    assert c.plan([seq], 1, 1, caps=[3]) == [1]  # room again: the overdue probe runs


def test_shadow_drafts_are_scored_against_the_real_output():
    c = controller(memory_bound, acceptance=0.0, draft_s=0.002, shadow_capable=True)
    seq = seqs(1)[0]
    for _ in range(c.shadow_interval - 1):
        c.plan([seq], 1, 1)
        assert c.shadow_requests == []
    assert c.plan([seq], 1, 1) == [0] and c.shadow_requests == [seq]  # no real probe
    before = c.acceptance(seq)
    # a chain 7 -> 8 -> 5 proposed after the prompt; the request then produces 7, 8, 9
    c.add_shadow(seq, [3, 7, 8, 5], [[1], [2], [3], []])
    seq.output_token_ids += [7, 8]
    c.resolve_shadows(seq)  # not decided yet: the third token is unknown
    assert c.acceptance(seq) == before
    seq.output_token_ids += [9]
    c.resolve_shadows(seq)
    after = c.acceptance(seq)
    assert after[0] > before[0] and after[1] > before[1] and after[2] < 0.5


def test_static_policy_and_its_batch_size_switch():
    c = GoodputController("static", 3, lambda k: k, disable_by_batch_size=4)
    assert c.plan(seqs(4), 4, 4) == [3] * 4
    assert c.plan(seqs(5), 5, 5) == [0] * 5
    # a hard cap under the adaptive policy too (no drafts, probes or lite drafts past it)
    a = controller(memory_bound, acceptance=0.9, draft_s=0.0001)
    a.disable_by_batch_size = 4
    assert any(a.plan(seqs(4), 4, 4)) and a.last_predicted_gain > 1
    assert a.plan(seqs(5), 5, 5) == [0] * 5 and not a.shadow_requests
    assert a.last_predicted_gain == 1.0  # the gauge: nothing drafts, no gain predicted
    off = GoodputController("off", 3, lambda k: k)
    assert off.plan(seqs(2), 2, 2) == [0, 0]
    with pytest.raises(InvalidRequestError, match="policy"):
        GoodputController("sometimes", 3, lambda k: k)


def test_a_fully_accepted_shadow_counts():
    c = controller(memory_bound, acceptance=0.0, draft_s=0.002, shadow_capable=True)
    seq = seqs(1)[0]
    before = c.acceptance(seq)
    c.add_shadow(seq, [3, 7, 8], [[1], [2], []])
    seq.output_token_ids += [7, 8]  # both drafts right: decided without a third token
    c.resolve_shadows(seq)
    after = c.acceptance(seq)
    assert after[0] > before[0] and after[1] > before[1]


def test_levels_that_add_no_nodes_are_still_reached():
    """A static tree drafts the same nodes at any depth budget: deeper levels cost nothing."""
    c = GoodputController("adaptive", 3, lambda k: 6)
    for n in (1, 2, 4, 8, 16):
        c.step_cost.calibrate(n, memory_bound(n))
    assert c.plan(seqs(1), 1, 1) == [3]


def test_a_fixed_draft_cost_shared_by_the_batch_does_not_block_drafting():
    """A draft model's forwards cost about the same for 1 request as for 8 (bandwidth-bound):
    one request alone does not pay its fixed part, all 8 together do. The planner must weigh
    the batch drafting together, not only one request at a time (the Qwen pair at 8 clients)."""
    c = GoodputController("adaptive", 4, lambda k: k)
    for n in (1, 2, 4, 8, 16, 32, 64):
        c.step_cost.calibrate(n, memory_bound(n))
    for _ in range(20):  # 30 ms per proposal, + 0.5 ms per request and level
        for x in (4, 16, 32):
            c.record_draft(x, 0.030 + 0.0005 * x)
    warm = seqs(1)[0]
    for _ in range(100):
        c.record_verification(warm, 4, 4)
    c.release(warm)
    batch = seqs(8)
    rates = [c.acceptance(s) for s in batch]
    alone = c.goodput(8, rates, [4] + [0] * 7)
    assert alone < c.goodput(8, rates, [0] * 8) < c.goodput(8, rates, [4] * 8)
    assert c.plan(batch, 8, 8) == [4] * 8


def test_a_fixed_draft_cost_does_not_block_deep_drafts():
    """Each draft step has a fixed part (a draft model catching up): one level alone loses,
    four win. The planner must look past the first level (the int8 Qwen pair's case)."""
    c = GoodputController("adaptive", 4, lambda k: k)
    for n in (1, 2, 4, 8, 16):
        c.step_cost.calibrate(n, memory_bound(n))
    for _ in range(20):  # 25 ms whatever the depth, + 4 ms a level
        for x in (1, 2, 4):
            c.record_draft(x, 0.025 + 0.004 * x)
    warm = seqs(1)[0]
    for _ in range(100):
        c.record_verification(warm, 4, 4)  # everything accepted: a ~ 1
    c.release(warm)
    one = c.expected_tokens(c.acceptance(seqs(1)[0]), 1)
    assert one / (0.0201 + 0.029) < 1 / 0.0201  # depth 1 alone is slower than plain decoding
    assert c.plan(seqs(1), 1, 1) == [4]


def test_a_drafter_that_shadows_part_of_its_drafts_is_still_probed():
    """A head with a lookup branch shadows its lookup alone: the controller scores those every
    few idle steps and still gives the head a real probe now and then."""
    c = controller(
        memory_bound,
        acceptance=0.0,
        draft_s=0.002,
        shadow_capable=True,
        needs_probes=True,
        probe_interval=6,
    )
    seq = seqs(1)[0]
    plans, shadowed = [], []
    for _ in range(13):
        plans.append(c.plan([seq], 1, 1)[0])
        shadowed.append(c.shadow_requests == [seq])
    assert plans.index(1) == 5 and plans.count(1) == 2  # a probe every 6-7 idle steps
    assert shadowed[:4] == [False, False, False, True] and shadowed.count(True) == 3
    assert not any(p and s for p, s in zip(plans, shadowed, strict=True))
    # a pending shadow is not replaced, but does not hold a probe back
    c.add_shadow(seq, [3, 7, 8], [[1], [2], []])
    plans = [c.plan([seq], 1, 1)[0] for _ in range(6)]
    assert c.shadow_requests == [] and plans[-1] == 1


def test_one_dear_first_proposal_does_not_switch_drafting_off():
    """A head's first proposal also runs it over the whole prompt: until a few proposals are
    timed the fit cannot tell that from drafting, so requests draft at full depth and half of
    it in turn (two depths separate the fixed cost from the per-level one); then the plan
    prices what the routine proposals cost."""
    c = GoodputController("adaptive", 4, lambda k: k)
    for n in (1, 2, 4, 8, 16):
        c.step_cost.calibrate(n, memory_bound(n))
    warm = seqs(1)[0]
    for _ in range(50):
        c.record_verification(warm, 4, 3)
    c.release(warm)
    c.record_draft(4, 0.200, catch_up=300)  # 200 ms: the prompt's catch-up and 4 levels
    batch = seqs(1)
    plans = []
    for _ in range(3):
        plans.append(c.plan(batch, 1, 1)[0])
        c.record_draft(plans[-1], 0.001 + 0.001 * plans[-1])  # 1 ms + 1 ms a level
    assert plans == [2, 4, 2] and len(c.draft_cost) == 4
    d0, d1, _ = c.draft_cost.coefficients()
    assert d0 == pytest.approx(0.001, abs=2e-4) and d1 == pytest.approx(0.001, abs=2e-4)
    assert c.plan(batch, 1, 1)[0] > 0


def test_learning_drafts_only_where_free_drafts_could_pay_and_ends():
    """Before the fit has its proposals, a compute-bound batch still decodes plainly; and a
    drafter that never times a proposal does not keep the controller learning for ever."""
    c = GoodputController("adaptive", 4, lambda k: k)
    for n in (1, 2, 4, 8, 16, 32, 64, 128):
        c.step_cost.calibrate(n, compute_bound(n))
    assert c.plan(seqs(8), 8, 8) == [0] * 8
    m = GoodputController("adaptive", 4, lambda k: k)
    for n in (1, 2, 4, 8, 16):
        m.step_cost.calibrate(n, memory_bound(n))
    batch = seqs(1)
    assert [m.plan(batch, 1, 1)[0] for _ in range(16)] == [4] * 16  # no proposal timed
    m.record_draft(4, 0.5)  # after the learning steps: the fit decides (a dear drafter)
    assert m.plan(batch, 1, 1) == [0]


def test_a_partial_shadow_brings_a_probe_forward_and_is_not_counted():
    """The lookup branch's shadow is not what the head would draft: a good one moves the next
    real probe up instead of entering the acceptance estimates; a poor one changes nothing."""
    c = controller(
        memory_bound, acceptance=0.0, draft_s=0.002, shadow_capable=True, needs_probes=True
    )
    seq = seqs(1)[0]
    for _ in range(3):
        assert c.plan([seq], 1, 1) == [0]
    before = c.acceptance(seq)
    c.add_shadow(seq, [3, 9, 9], [[1], [2], []])  # wrong at once
    seq.output_token_ids += [7, 8]
    c.resolve_shadows(seq)
    assert c.plan([seq], 1, 1) == [0]
    c.add_shadow(seq, [8, 5, 6, 4], [[1], [2], [3], []])  # the next three tokens, all right
    seq.output_token_ids += [5, 6, 4]
    c.resolve_shadows(seq)
    assert c.acceptance(seq) == before
    assert c.plan([seq], 1, 1) == [1]  # a probe now, not 64 idle steps on


def small_cpu(n: int) -> float:  # SmolLM2 on 2 AVX2 cores: 1 token 16 ms, 8 tokens 44 ms
    return 0.012 + 0.004 * n


def lite_controller(step_time, head_acceptance: float, draft_s: float) -> GoodputController:
    """A head of depth 4 with a lite mode of depth 8 (its lookup branch alone)."""
    return controller(
        step_time,
        acceptance=head_acceptance,
        draft_s=draft_s,
        shadow_capable=True,
        needs_probes=True,
        lite_depth=8,
    )


def shadow_outcome(c: GoodputController, seq: Sequence, right: int, depth: int = 8) -> None:
    """A lite shadow of `depth` tokens whose first `right` the request really produced."""
    guess = [100 + j for j in range(depth)]
    c.add_shadow(seq, [seq.last_token] + guess, [[j + 1] for j in range(depth)] + [[]])
    real = guess[:right] + [7] * (depth - right + 1)
    seq.output_token_ids += real
    c.resolve_shadows(seq)


def test_lite_drafts_where_the_head_does_not_pay_but_its_lookup_does():
    """A head that is dear and rarely right keeps a request plain; its lookup branch is then
    verified alone (a negative depth: lite drafts, no drafting time). Lite drafts start on the
    optimistic prior, stop when they are wrong, and resume when the shadows (lookup alone,
    scored against the real output) find it right again; the head is still probed."""
    c = lite_controller(small_cpu, head_acceptance=0.1, draft_s=0.004)
    seq = seqs(1)[0]
    plan = c.plan([seq], 1, 1)
    assert plan[0] < 0 and c.shadow_requests == []  # lite drafts are verified: no shadow
    assert c.summary()["lite_fraction"] == 1.0
    for _ in range(4):
        c.record_verification(seq, -plan[0], 0, lite=True)
        plan = c.plan([seq], 1, 1)
    assert c.num_lite == 4  # lite drafts verified
    assert plan == [0] and c.acceptance(seq, lite=True)[0] < 0.3
    while not c.shadow_requests:
        assert c.plan([seq], 1, 1) == [0]
    for _ in range(3):
        shadow_outcome(c, seq, right=8)
        plan = c.plan([seq], 1, 1)
    assert plan[0] < -4 and c.last_predicted_gain > 1.5
    assert c.acceptance(seq)[0] < 0.3  # the head's own estimates are untouched
    plans = []
    for _ in range(70):
        plans.append(c.plan([seq], 1, 1)[0])
        if plans[-1] < 0:
            c.record_verification(seq, -plans[-1], -plans[-1], lite=True)
    assert 1 in plans and all(p < 0 for p in plans if p != 1)  # the head is still probed


def test_no_lite_drafts_when_lookup_is_wrong_or_verification_is_dear():
    c = lite_controller(small_cpu, head_acceptance=0.1, draft_s=0.004)
    seq = seqs(1)[0]
    for _ in range(5):
        shadow_outcome(c, seq, right=0)
    assert c.plan([seq], 1, 1) == [0]
    # the same lookup, always right, on a compute-bound step: each node costs a token's time
    b = lite_controller(compute_bound, head_acceptance=0.1, draft_s=0.02)
    for _ in range(20):
        b.record_verification(seq, 8, 8, lite=True)
    assert b.acceptance(seq, lite=True)[7] > 0.9
    assert b.plan(seqs(4), 4, 4) == [0] * 4


def test_lite_drafts_only_for_requests_the_head_plan_keeps_plain():
    """A head that pays keeps its plan (it grafts the lookup branch anyway): lite drafts never
    replace it. A request whose head is wrong but whose lookup is right goes lite in the same
    step, its nodes and tokens priced with no drafting time."""
    c = lite_controller(small_cpu, head_acceptance=0.9, draft_s=0.001)
    batch = seqs(2)
    for _ in range(20):
        c.record_verification(batch[0], 4, 4)
        c.record_verification(batch[1], 4, 0)
        c.record_verification(batch[0], 8, 8, lite=True)
        c.record_verification(batch[1], 8, 8, lite=True)
    plan = c.plan(batch, 2, 2)
    assert plan[0] > 0 and plan[1] < 0
    rates = [c.acceptance(s) for s in batch]
    lite = [c.acceptance(s, lite=True) for s in batch]
    plain = c.goodput(2, rates, [0, 0])
    assert c.last_predicted_gain * plain == pytest.approx(
        c.goodput(2, rates, plan, lite_rates=lite)
    )
    tokens = c.expected_tokens(rates[0], plan[0]) + c.expected_tokens(lite[1], -plan[1])
    fed = 2 + plan[0] - plan[1]
    want = tokens / (c.step_cost.predict(fed) + c.draft_cost.predict(plan[0]))
    assert c.goodput(2, rates, plan, lite_rates=lite) == pytest.approx(want)


def test_a_lite_request_drops_its_pending_shadow():
    """A shadow taken while a request was plain covers the tokens its lite drafts then verify:
    it is dropped, not counted a second time."""
    c = lite_controller(small_cpu, head_acceptance=0.1, draft_s=0.004)
    seq = seqs(1)[0]
    c.add_shadow(seq, [seq.last_token, 5, 6], [[1], [2], []])
    assert c.plan([seq], 1, 1)[0] < 0  # the optimistic prior: lite drafts
    seq.output_token_ids += [5, 6, 7]
    c.resolve_shadows(seq)
    assert "greedy" not in c._lite_workloads


def test_a_lookup_budget_is_priced_at_the_nodes_its_proposals_feed():
    """n-gram and suffix lookups often propose fewer tokens than their budget, or none: the
    controller learns what a budget feeds (per request, shrunk towards the workload) instead
    of pricing k nodes; a drafter of fixed trees keeps `nodes_for_depth`."""
    fixed = controller(memory_bound)
    seq = seqs(1)[0]
    fixed.record_proposal(seq, 4, 1)  # (ignored: not a variable-size drafter)
    assert fixed.expected_sizes(seq) == [0.0, 1.0, 2.0, 3.0, 4.0]
    c = controller(memory_bound, variable_size=True)
    assert c.expected_sizes(seq) == [0.0, 1.0, 2.0, 3.0, 4.0]  # unmeasured: the full budget
    for _ in range(40):  # two tokens whatever the budget
        c.record_proposal(seq, 4, 2)
    sizes = c.expected_sizes(seq)
    assert sizes[1] == pytest.approx(1.0) and sizes[2] == pytest.approx(2.0, abs=0.02)
    assert sizes[4] < 2.1 and sizes == sorted(sizes)
    for _ in range(40):  # then nothing found
        c.record_proposal(seq, 4, 0)
    assert c.expected_sizes(seq)[4] < 0.5
    other = seqs(1)[0]  # a new request of the workload starts from the workload's sizes
    assert c.expected_sizes(other)[4] < 2.5
    # goodput prices the plan at those sizes: fewer nodes fed, a faster step
    rates = [[0.5] * 4]
    small = c.goodput(1, rates, [4], sizes=[c.expected_sizes(seq)])
    assert small > c.goodput(1, rates, [4])
    # and its drafting time at the levels it drafts: the draft-cost fit counts the depth a
    # proposal really had, so a budget of 4 that finds one token costs one level, not four
    c.release(seq)
    assert seq.seq_id not in c._size_requests
    for _ in range(40):
        c.record_proposal(seq, 4, 1)
    one = [c.expected_sizes(seq)]
    assert c._totals(1, rates, [4], sizes=one)[2] == pytest.approx(one[0][4])
    assert one[0][4] < 1.05
    assert fixed._totals(1, rates, [4], sizes=[fixed.expected_sizes(seq)])[2] == 4


def test_an_empty_lookup_counts_as_a_miss_and_a_short_one_against_its_budget():
    """For a variable-size drafter a(d) is a depth's yield: an empty shadow is a miss at
    depth 1 at once, and a shadow of 2 tokens under a budget of 4, both right, misses at
    depth 3 (a budget of 3 would have fed no third token)."""
    c = controller(memory_bound, variable_size=True, shadow_capable=True)
    seq = seqs(1)[0]
    before = c.acceptance(seq)
    c.add_shadow(seq, [3], [[]], budget=4)
    assert c.acceptance(seq)[0] < before[0]
    assert c.expected_sizes(seq)[1] < 1.0  # and the budget fed nothing
    mid = c.acceptance(seq)
    c.add_shadow(seq, [3, 7, 8], [[1], [2], []], budget=4)
    seq.output_token_ids += [7, 8]
    c.resolve_shadows(seq)  # decided after the tree's depth, not the budget's
    after = c.acceptance(seq)
    assert after[0] > mid[0] and after[1] > mid[1] and after[2] < mid[2]
    # the same shadow for a fixed-size drafter leaves depth 3 unmeasured
    f = controller(memory_bound, shadow_capable=True)
    seq2 = seqs(1)[0]
    f.add_shadow(seq2, [3, 7, 8], [[1], [2], []], budget=4)
    seq2.output_token_ids += [7, 8]
    f.resolve_shadows(seq2)
    assert f.acceptance(seq2)[2] == pytest.approx(0.5)


@pytest.mark.parametrize("variable", [False, True])
def test_one_request_gets_the_depth_of_highest_goodput(variable):
    """For one request the plan is the depth that `goodput` scores best (or none, under the
    required gain): the planner's running tables agree with the plain formula, whatever the
    acceptance, proposal sizes, curve and draft costs."""
    import random

    for trial in range(60):
        rnd = random.Random(trial)
        c = GoodputController("adaptive", 8, lambda k: k, variable_size=variable)
        base, slope = rnd.uniform(0.01, 0.04), rnd.uniform(0.0, 0.004)
        for n in (1, 2, 4, 8, 16, 32):
            c.step_cost.calibrate(n, base + slope * n * rnd.uniform(0.9, 1.1))
        for n in range(1, 12, 2):
            c.step_cost.observe(n, 1.1 * (base + slope * n))
        for x in (1, 2, 4, 8):
            c.record_draft(x, rnd.uniform(0.0, 0.003) + rnd.uniform(0.0, 0.002) * x)
        s = seqs(1)[0]
        a = rnd.uniform(0.1, 0.95)
        for _ in range(rnd.randint(0, 20)):
            accepted = 0
            while accepted < 8 and rnd.random() < a:
                accepted += 1
            c.record_verification(s, 8, accepted)
            c.record_proposal(s, 8, rnd.randint(0, 8))
        rates, sizes = [c.acceptance(s)], [c.expected_sizes(s)]
        scores = [c.goodput(1, rates, [k], sizes=sizes) for k in range(9)]
        best = max(range(9), key=lambda k: scores[k])
        want = best if scores[best] >= scores[0] * (1 + c.min_gain) else 0
        assert c.plan([s], 1, 1) == [want], (trial, scores)


def lite_shadows(c: GoodputController, seq: Sequence, found_every: int, right: int, n: int):
    """`n` lite shadows under the lite budget (8), the engine's way: one in `found_every` holds
    an 8-token chain whose first `right` tokens the request really produced, the rest are empty
    (the lookup found nothing)."""
    for step in range(n):
        if step % found_every == 0:
            guess = [100 + j for j in range(8)]
            c.add_shadow(seq, [seq.last_token] + guess, [[j + 1] for j in range(8)] + [[]], 8)
            seq.output_token_ids += guess[:right] + [7] * (9 - right)
            c.resolve_shadows(seq)
        else:
            c.add_shadow(seq, [seq.last_token], [[]], 8)
            seq.output_token_ids += [7]


def test_a_lite_mode_is_priced_at_what_its_lookups_yield():
    """A lookup branch that rarely finds anything: its empty shadows count as misses against
    the lite budget and the nodes its budgets feed are learnt, as for lookup drafters. A branch
    right for two tokens whenever it finds any, one step in ten, does not pay as lite drafts
    (scored only where it found something, it looked right twice a step and was drafted); one
    that finds a good match one step in four does, priced at the nodes it really feeds."""
    c = lite_controller(small_cpu, head_acceptance=0.1, draft_s=0.004)
    seq = seqs(1)[0]
    lite_shadows(c, seq, found_every=10, right=2, n=60)
    lite = c.acceptance(seq, lite=True)
    assert lite[0] < 0.3  # the yield of depth 1, not the chance a found draft is right
    assert c.expected_sizes(seq, lite=True)[8] < 3.0  # under 8 nodes for a budget of 8
    assert c.plan([seq], 1, 1) == [0]
    good = lite_controller(small_cpu, head_acceptance=0.1, draft_s=0.004)
    seq = seqs(1)[0]
    lite_shadows(good, seq, found_every=4, right=8, n=40)
    plan = good.plan([seq], 1, 1)
    assert plan[0] < 0
    rates, lite = [good.acceptance(seq)], [good.acceptance(seq, lite=True)]
    nodes = [good.expected_sizes(seq, lite=True)]
    assert nodes[0][-plan[0]] < -plan[0] - 1  # fewer nodes than the lite depth
    tokens = good.expected_tokens(lite[0], -plan[0])
    want = tokens / good.step_cost.predict(1 + nodes[0][-plan[0]])
    assert good.goodput(1, rates, plan, lite_rates=lite, lite_sizes=nodes) == pytest.approx(want)
    assert good.last_predicted_gain * good.goodput(1, rates, [0]) == pytest.approx(want)


def test_where_no_drafting_could_pay_no_plan_is_weighed_and_no_shadow_taken():
    """A compute-bound step (every fed token costs the same): not even every draft accepted,
    drafted for free, would beat plain decoding by min_gain, so the planner weighs nothing (no
    estimate is read) and takes no shadows; where drafting could pay, shadows of the idle
    requests resume."""
    c = controller(compute_bound, acceptance=0.05, shadow_capable=True, variable_size=True)
    batch = seqs(8)
    read = []
    acceptance = c.acceptance
    c.acceptance = lambda *a, **k: (read.append(1), acceptance(*a, **k))[1]
    for _ in range(3 * c.shadow_interval):
        assert c.plan(batch, 8, 8) == [0] * 8 and c.shadow_requests == []
    assert read == []
    m = controller(memory_bound, acceptance=0.05, shadow_capable=True, variable_size=True)
    shadows = 0
    for _ in range(3 * m.shadow_interval):
        assert m.plan(batch, 8, 8) == [0] * 8  # acceptance too low to draft
        shadows += len(m.shadow_requests)
    assert shadows >= 8


def test_whether_drafting_could_pay_at_all_is_decided_at_the_curves_knots():
    """The bound checked at the knots and ends is never below a scan of draft sizes (no step
    where drafting could pay is called hopeless), and says hopeless where nothing pays."""
    import random

    rnd = random.Random(0)
    hopeless = 0
    for _ in range(300):
        c = GoodputController("adaptive", rnd.choice([3, 5, 8]), lambda k: 2 * k)
        for n in sorted(rnd.sample(range(1, 300), 6)):
            c.step_cost.calibrate(n, 0.01 + 0.001 * n * rnd.uniform(0.2, 3.0))
        for n in sorted(rnd.sample(range(1, 300), rnd.randint(0, 5))):
            c.step_cost.observe(n, 0.012 + 0.0012 * n * rnd.uniform(0.2, 3.0))
        n = rnd.randint(1, 40)
        depth, top = c.max_depth, n * 2 * c.max_depth
        target = c._rate(n, n, 0) * (1 + c.min_gain)
        scan = any(
            c._rate(n + min(x / 4, n * depth), n + x / 4, 0) >= target
            for x in range(4, 4 * top + 1)
        )
        bound = c._could_pay_at_all(n, n)
        assert bound or not scan
        hopeless += not bound
    assert 10 <= hopeless <= 290  # both cases were tried


def test_the_step_cost_curve_answers_many_sizes_as_it_answers_each():
    """`predict_many` (what the planner screens with) gives `predict`'s figures exactly: inside
    and outside the measured span, on flat, falling and single-point curves."""
    import random

    import numpy as np

    rnd = random.Random(1)
    for _ in range(200):
        m = StepCostModel()
        for n in rnd.sample(range(1, 400), rnd.randint(0, 6)):
            m.calibrate(n, rnd.choice([0.02, rnd.uniform(0.001, 0.05)]))
        for n in rnd.sample(range(1, 400), rnd.randint(0 if m.calibrated else 1, 4)):
            m.observe(n, rnd.uniform(0.001, 0.05))
        xs = [rnd.uniform(0, 500) for _ in range(20)] + [float(x) for x in range(0, 420, 7)]
        assert m.predict_many(np.array(xs)).tolist() == [m.predict(x) for x in xs]


def planning_state(seed: int, n: int, lite: int = 0, variable: bool = False):
    """A controller with random curves, draft costs and per-request histories, and `n` requests
    (some with catch-up, some with a previous plan): what `_adaptive` weighs."""
    import random

    rnd = random.Random(seed)
    top = rnd.choice([3, 5, 16])
    c = GoodputController(
        "adaptive",
        top,
        rnd.choice([lambda k: k, lambda k: 1 + 3 * k if k else 0]),
        shadow_capable=variable,
        variable_size=variable,
        lite_depth=lite,
    )
    a, b, knee = rnd.uniform(0.001, 0.05), rnd.uniform(1e-5, 1e-3), rnd.choice([8, 64, 512])
    for x in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024):
        c.step_cost.calibrate(x, a + b * max(0, x - knee))
    for _ in range(rnd.randint(0, 20)):
        x = rnd.randint(1, 600)
        c.step_cost.observe(x, (a + b * max(0, x - knee)) * rnd.uniform(0.8, 1.5))
    d0, d1, d2 = rnd.uniform(0, a / 10), rnd.uniform(0, a / 100), rnd.uniform(0, 1e-5)
    for _ in range(8):
        x, cu = rnd.randint(1, 4 * top), rnd.choice([0, rnd.randint(1, 200)])
        c.record_draft(x, d0 + d1 * x + d2 * cu, cu)
    batch = [
        Sequence([1, 2, 3], SamplingParams(temperature=rnd.choice([0.0, 1.0]), max_tokens=300))
        for _ in range(n)
    ]
    for s in batch:
        rate = rnd.random()
        for _ in range(rnd.randint(0, 30)):
            d = rnd.randint(1, top)
            got = next((j for j in range(d) if rnd.random() > rate), d)
            c.record_proposal(s, d, rnd.randint(0, d))
            c.record_verification(s, d, got)
            if lite:
                c.record_proposal(s, lite, rnd.randint(0, lite), lite=True)
                c.record_verification(s, lite, rnd.randint(0, lite), lite=True)
        if rnd.random() < 0.2:
            c._last_plan[s.seq_id] = rnd.randint(0, top)
    return c, batch, [rnd.choice([0, 0, rnd.randint(1, 300)]) for _ in batch]


def test_screening_and_array_tables_leave_the_plans_unchanged(monkeypatch):
    """Many requests are planned from arrays and screened all at once (`_cannot_win`); the
    plans, and the gains predicted, are those of the request-by-request planner, on random
    states where some requests draft, some verify lite drafts and many do neither."""
    import specdecode.engine.controller as module

    screened, kinds = [], set()
    cannot_win = GoodputController._cannot_win

    def spy(self, *a):
        out = cannot_win(self, *a)
        screened.append(int(out.sum()))
        return out

    monkeypatch.setattr(GoodputController, "_cannot_win", spy)
    for seed in range(80):
        args = (seed, 24 + seed % 3 * 20, 6 * (seed % 2), seed % 4 < 2)
        c, batch, catch_up = planning_state(*args)
        fast = c._adaptive(batch, len(batch), catch_up), c.last_predicted_gain
        full = [0.0] + [float(c.nodes_for_depth(k)) for k in range(1, c.max_depth + 1)]
        wants = [(full, False)] + ([([float(k) for k in range(7)], True)] if args[2] else [])
        tables = [c._tables(batch, f, {}, lite) for f, lite in wants]
        with monkeypatch.context() as m:
            m.setattr(module, "_SCREEN_MIN", 10**9)  # lists, and no screening
            c, batch, catch_up = planning_state(*args)
            assert (c._adaptive(batch, len(batch), catch_up), c.last_predicted_gain) == fast
            assert [c._tables(batch, f, {}, lite) for f, lite in wants] == tables
        kinds |= {k > 0 for k in fast[0]} | {"lite" for k in fast[0] if k < 0}
    assert {True, False, "lite"} <= kinds and sum(screened) > 100, (kinds, screened)
