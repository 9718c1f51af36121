"""How much to speculate, decided every step: the goodput controller.

Policies (`--speculative-policy`):
- `off`: never draft (plain decoding with the same engine).
- `static`: vLLM's behaviour: every decoding request drafts `num_speculative_tokens`.
- `disable_by_batch_size` (vLLM's `--speculative-disable-by-batch-size`) is a hard cap under
  every policy: no drafts at all while more requests than that are running.
- `adaptive` (default): each step, for the requests that are decoding, choose a draft depth k_i
  in 0..K that maximises the expected goodput of the whole step,

      G(k) = sum_i E_i(k_i) / (T_target(N(k)) + T_draft(k)),

  in the spirit of SmartSpec (Liu et al. 2024, "Optimizing Speculative Decoding for Serving
  Large Language Models Using Goodput"):
  - E_i(k) = 1 + sum_{j<=k} prod_{d<=j} a_i(d): tokens a step emits for request i, from its
    per-depth conditional acceptance a_i(d), estimated online (decayed counts of its own
    verifications, shrunk towards the estimate of its workload: its temperature class);
  - N(k) = tokens fed to the target: every request's root (and prefill chunks) plus its draft
    nodes; T_target(N) is a measured step-time curve (`StepCostModel`), calibrated at start-up
    by timing forwards of N tokens and refined by every step the engine runs;
  - T_draft = d0 + d1 * (draft depth summed over requests), fitted online from timed proposals,
    plus each drafting request's catch-up (tokens a draft model must prefill, or an EAGLE head
    run, before it can draft: the prompt, or what the request committed while it was not
    drafting), priced by the same fit (d2 per token) and spread over the steps the request is
    expected to have left, since it is paid once. Probes of idle requests (below) take at most
    `probe_share` of the time, their catch-up included. Until a few proposals are timed
    (`_MIN_DRAFT_OBSERVATIONS`, two depths) the fit is not used: requests draft where drafting
    could pay at all.
  E_i is concave in k and the cost grows with N, so the plan adds draft levels in the order of
  their expected tokens per fed token and stops when the next level lowers G. With many
  requests, those whose next levels could not raise G are found all at once and skipped
  (`_hopeless`): the same plan, without trying each.
  Hysteresis: the plan changes only when it beats the previous one (re-scored with today's
  estimates) by `hysteresis`. Requests that are not drafting keep being measured (`_explore`):
  shadow drafts scored against the real output where drafting has no side effects, else a rare
  one-token probe (after `probe_interval` idle steps of the request, or of the whole engine:
  short requests are never idle that long), so the estimates recover when the traffic changes.
  A drafter whose shadow is only part of its drafts (a head's lookup branch) gets probes, and a
  good shadow brings the next probe forward instead of counting as the drafter's acceptance.
  Lite drafts: a drafter whose shadow can also be verified on its own (`lite_depth`: a head's
  lookup branch without the head) offers a second, cheaper mode. Requests the plan keeps plain
  may verify it, with its own acceptance estimates (from its shadows and its verifications)
  and no drafting time, where it beats the head's plan by `min_gain`. The plan marks such a
  request with a negative depth (-k: lite drafts of depth k). A lookup often finds nothing,
  so lite drafts are priced as lookup drafters are (below): by their yield and the nodes
  their budgets really feed.
  Lookup drafters (n-gram, suffix decoding: `variable_size`) propose up to k tokens, often
  fewer or none. For them a(d) is the yield of depth d: the chance that a draft at depth d
  exists and is accepted once d-1 were, so an empty proposal counts as a miss at depth 1; and
  the nodes a depth-k budget feeds are learnt the same way (the chance that a proposal holds
  a j-th node once it holds j-1, per request, shrunk towards the workload's and that towards
  k nodes); its drafting is priced at those nodes too (`_levels`). Priced at k nodes and k
  levels, a 16-token suffix budget that fed 0.8 nodes on average was kept at 3.
"""

from __future__ import annotations

import bisect
import heapq
from collections import deque
from dataclasses import dataclass, field
from functools import reduce
from itertools import accumulate
from operator import add, mul

import numpy as np

from specdecode.config import SPECULATIVE_POLICIES as POLICIES
from specdecode.core import Sequence
from specdecode.errors import InvalidRequestError


class _Curve:
    """A piecewise-linear curve through buckets of (tokens, seconds) points; each bucket (tokens
    rounded on a geometric grid) keeps an exponential moving average of its points. The
    controller evaluates it a few dozen times a step: the sorted points are kept between
    observations."""

    def __init__(self, smoothing: float) -> None:
        self.smoothing = smoothing
        self._points: dict[int, list[float]] = {}  # bucket -> [mean tokens, mean seconds]
        self._sorted: list[tuple[float, float]] | None = None
        self._xs: list[float] = []

    @staticmethod
    def _bucket(n: int) -> int:
        if n <= 8:
            return n
        b = 8
        while b * 1.25 < n:
            b = int(b * 1.25) + 1
        return b

    def observe(self, num_tokens: float, seconds: float) -> None:
        self._sorted = None
        b = self._bucket(int(num_tokens))
        point = self._points.get(b)
        if point is None:
            self._points[b] = [float(num_tokens), seconds]
            return
        s = self.smoothing
        point[0] += s * (num_tokens - point[0])
        point[1] += s * (seconds - point[1])

    def __bool__(self) -> bool:
        return bool(self._points)

    def points(self) -> list[tuple[float, float]]:
        if self._sorted is None:
            self._sorted = sorted((x, y) for x, y in self._points.values())
            self._xs = [x for x, _ in self._sorted]
            self._arrays = (np.array(self._xs), np.array([y for _, y in self._sorted]))
        return self._sorted

    def __call__(self, num_tokens: float) -> float:
        pts = self._sorted if self._sorted is not None else self.points()
        if not pts:
            return 0.0
        if len(pts) == 1:
            x, y = pts[0]
            return y * num_tokens / x if num_tokens > x else y
        i = bisect.bisect_left(self._xs, num_tokens)
        if i == 0:
            return pts[0][1]
        (x0, y0), (x1, y1) = pts[-2:] if i == len(pts) else pts[i - 1 : i + 1]
        if x1 <= x0:
            return y1
        return y0 + max(0.0, (y1 - y0) / (x1 - x0)) * (num_tokens - x0)

    def many(self, num_tokens: np.ndarray) -> np.ndarray:
        """The curve at each of `num_tokens` (the same figures as calling it on each)."""
        pts = self._sorted if self._sorted is not None else self.points()
        x = np.asarray(num_tokens, dtype=np.float64)
        if not pts:
            return np.zeros_like(x)
        if len(pts) == 1:
            x0, y0 = pts[0]
            return np.where(x > x0, y0 * x / x0, y0)
        xs, ys = self._arrays
        i = np.searchsorted(xs, x, side="left")  # bisect_left
        hi = np.clip(i, 1, len(pts) - 1)  # the segment (hi - 1, hi); past the end: the last
        x0, y0, x1, y1 = xs[hi - 1], ys[hi - 1], xs[hi], ys[hi]
        with np.errstate(divide="ignore", invalid="ignore"):
            slope = np.maximum(0.0, (y1 - y0) / (x1 - x0))
        out = np.where(x1 <= x0, y1, y0 + slope * (x - x0))
        return np.where(i == 0, ys[0], out)


# Proposals timed before the draft-cost fit decides: one proposal cannot tell its fixed,
# per-level and catch-up parts apart (the first also runs a head over the whole prompt), and a
# fit that split it evenly switched drafting off for good. Meanwhile requests draft at full
# depth and half of it in turn (two depths separate d0 from d1), for at most
# `_MAX_LEARNING_STEPS` steps (a drafter that rarely drafts, say lookup that finds nothing,
# leaves the fit to its later proposals) and only where drafting could pay at all.
_MIN_DRAFT_OBSERVATIONS = 4
_MAX_LEARNING_STEPS = 16
# The planner screens its offers all at once after this many in a row took nothing, while at
# least `_SCREEN_MIN` are left (fewer cost less than a screen; fewer requests than that are
# tabled as lists too): see `_hopeless` and `_tables`
_SCREEN_AFTER = 8
_SCREEN_MIN = 24
# A request's own counts against its workload's prior: the prior weighs as this many trials
# (`acceptance`, `expected_sizes` and their tables, `_shrunk`)
_OWN_STRENGTH = 4.0


class StepCostModel:
    """Step time against tokens fed. Two curves: one calibrated at start-up (bare forwards of N
    tokens over the grid the engine may reach) and one measured from the engine's own steps
    (which include scheduling, sampling and verification). Inside the range the engine has
    visited, the measured curve answers; outside it, the calibrated curve's shape scaled to the
    nearest measured point."""

    def __init__(self, smoothing: float = 0.2) -> None:
        self.calibration = _Curve(1.0)
        self.measured = _Curve(smoothing)
        # what `predict` needs of the curves, kept between observations (the controller asks
        # a few hundred times a step, often the same number of tokens): the measured span and,
        # for each side of it, the measured point nearest and the calibrated time there; and
        # the answers given
        self._frame: tuple | None = None
        self._answers: dict[float, float] = {}

    def calibrate(self, num_tokens: int, seconds: float) -> None:
        self.calibration.observe(num_tokens, seconds)
        self._frame = None
        self._answers.clear()

    def observe(self, num_tokens: int, seconds: float) -> None:
        if num_tokens > 0 and seconds > 0:
            self.measured.observe(num_tokens, seconds)
            self._frame = None
            self._answers.clear()

    @property
    def calibrated(self) -> bool:
        return bool(self.calibration) or bool(self.measured)

    def _make_frame(self) -> tuple:
        if not self.measured:
            return (None,)
        pts = self.measured.points()
        lo, hi = pts[0], pts[-1]
        return (lo[0], hi[0], lo, self.calibration(lo[0]), hi, self.calibration(hi[0]))

    def predict(self, num_tokens: float) -> float:
        seconds = self._answers.get(num_tokens)
        if seconds is None:
            seconds = self._answers[num_tokens] = self._predict(num_tokens)
        return seconds

    def predict_many(self, num_tokens: np.ndarray) -> np.ndarray:
        """`predict` at each of `num_tokens`, in one pass (the same figures)."""
        frame = self._frame if self._frame is not None else self._make_frame()
        self._frame = frame
        x = np.asarray(num_tokens, dtype=np.float64)
        if frame[0] is None:
            return self.calibration.many(x)
        lo, hi, below, below_base, above, above_base = frame
        if not self.calibration:
            return self.measured.many(x)
        inside = (lo <= x) & (x <= hi) if hi > lo else np.zeros(x.shape, dtype=bool)
        out = self.measured.many(x) if inside.any() else np.zeros_like(x)
        if inside.all():
            return out
        cal = self.calibration.many(x)
        low = x <= lo
        y = np.where(low, below[1], above[1])
        base = np.where(low, below_base, above_base)
        with np.errstate(divide="ignore", invalid="ignore"):
            scaled = np.where(base > 0, cal * (y / base), y)
        return np.where(inside, out, scaled)

    def _predict(self, num_tokens: float) -> float:
        frame = self._frame if self._frame is not None else self._make_frame()
        self._frame = frame
        if frame[0] is None:
            return self.calibration(num_tokens)
        lo, hi, below, below_base, above, above_base = frame
        if (lo <= num_tokens <= hi and hi > lo) or not self.calibration:
            return self.measured(num_tokens)
        # outside the measured span (or at its one point): the calibrated curve's shape,
        # scaled to the measured point nearest
        (_, y), base = (below, below_base) if num_tokens <= lo else (above, above_base)
        return self.calibration(num_tokens) * (y / base) if base > 0 else y


class DraftCostModel:
    """Drafting time = d0 + d1 * depth + d2 * catch-up, by a forgetting least-squares fit over
    the recent proposals: `depth` summed over the drafting requests, `catch-up` the tokens the
    drafter had to process before it could draft (a draft model's prefill, or an EAGLE head's
    run, of what the target committed while the request was not drafting; 0 for Medusa and
    n-gram lookup)."""

    def __init__(self, window: int = 64) -> None:
        self._obs: deque[tuple[float, float, float]] = deque(maxlen=window)
        self._coef: tuple[float, float, float] | None = None  # fitted on demand, then cached

    def observe(self, depth_sum: int, seconds: float, catch_up: int = 0) -> None:
        if depth_sum > 0:
            self._obs.append((float(depth_sum), float(catch_up), seconds))
            self._coef = None

    def __len__(self) -> int:
        return len(self._obs)

    def coefficients(self) -> tuple[float, float, float]:
        if self._coef is None:
            if not self._obs:
                return 0.0, 0.0, 0.0
            rows = [(1.0, x, c) for x, c, _ in self._obs]
            d0, d1, d2 = _fit(rows, [y for *_, y in self._obs])
            self._coef = (d0, d1, d2)
        return self._coef

    def predict(self, depth_sum: int, catch_up: float = 0.0) -> float:
        if depth_sum <= 0:
            return 0.0
        d0, d1, d2 = self.coefficients()
        return d0 + d1 * depth_sum + d2 * catch_up

    def predict_many(self, depth_sums: np.ndarray) -> np.ndarray:
        """`predict` at each of `depth_sums` (no catch-up), in one pass."""
        d0, d1, _ = self.coefficients()
        x = np.asarray(depth_sums, dtype=np.float64)
        return np.where(x > 0, d0 + d1 * x, 0.0)

    def catch_up_seconds(self, tokens: float) -> float:
        return self.coefficients()[2] * tokens if tokens > 0 else 0.0


def _fit(rows: list[tuple[float, ...]], ys: list[float]) -> list[float]:
    """Non-negative least squares for a few columns (the first an intercept): ordinary least
    squares (lightly ridged, so a column that never varies stays near 0), then any negative
    slope is dropped and the rest refitted. A model with no intercept falls back to the mean
    time per unit of the first slope."""
    a, y = np.asarray(rows, dtype=np.float64), np.asarray(ys, dtype=np.float64)
    cols = list(range(a.shape[1]))
    while True:
        sub = a[:, cols]
        scale = np.maximum(np.abs(sub).max(axis=0), 1e-12)
        x = sub / scale
        gram = x.T @ x + 1e-6 * len(y) * np.eye(len(cols))
        coef = np.linalg.solve(gram, x.T @ y) / scale
        negative = [c for c, v in zip(cols, coef, strict=True) if v < 0]
        if not negative:
            out = [0.0] * a.shape[1]
            for c, v in zip(cols, coef, strict=True):
                out[c] = float(v)
            return out
        if 0 in negative:  # no intercept: time proportional to the first slope's column
            cols = [c for c in cols if c != 0]
        else:
            cols = [c for c in cols if c not in negative]
        if not cols:
            return [0.0] * a.shape[1]


@dataclass
class AcceptanceCounts:
    """Decayed per-depth counts: trials[d] verifications that drafted depth d+1 after
    accepting depth d, hits[d] of them accepted it."""

    decay: float
    trials: list[float] = field(default_factory=list)
    hits: list[float] = field(default_factory=list)

    def record(self, depth: int, accepted: int) -> None:
        if depth <= 0:
            return
        self.trials[:] = [t * self.decay for t in self.trials]
        self.hits[:] = [h * self.decay for h in self.hits]
        while len(self.trials) < depth:
            self.trials.append(0.0)
            self.hits.append(0.0)
        for d in range(min(accepted + 1, depth)):
            self.trials[d] += 1.0
            self.hits[d] += 1.0 if d < accepted else 0.0

    def rate(self, d: int, prior: float, strength: float) -> float:
        """Conditional acceptance of depth d+1, shrunk towards `prior` with `strength`."""
        t = self.trials[d] if d < len(self.trials) else 0.0
        h = self.hits[d] if d < len(self.hits) else 0.0
        return (h + strength * prior) / (t + strength)

    def rates(self, priors: list[float], strength: float) -> list[float]:
        """`rate` for d = 0..len(priors)-1, each towards its own prior (the same figures, in
        one pass: the controller asks for every depth of every request each step)."""
        t, h, short = self.trials, self.hits, len(priors) - len(self.trials)
        if short > 0:  # (depths never counted: the prior's share alone)
            t, h = t + [0.0] * short, h + [0.0] * short
        pairs = zip(h, t, priors, strict=False)  # (counts past the priors' depths: unused)
        return [(hd + strength * p) / (td + strength) for hd, td, p in pairs]


def _column_sums(rows: list[list[float]], start: float) -> list[float]:
    """Each column's sum from `start`, added row by row (in the order a loop over the rows
    adds them: the same figures)."""
    return reduce(lambda acc, row: list(map(add, acc, row)), rows, [start] * len(rows[0]))


def workload_key(seq: Sequence) -> str:
    """Requests of one temperature class share an acceptance prior."""
    t = seq.params.temperature
    if t == 0:
        return "greedy"
    return "t<=0.7" if t <= 0.7 else "t<=1" if t <= 1.0 else "t>1"


class GoodputController:
    def __init__(
        self,
        policy: str,
        max_depth: int,
        nodes_for_depth,
        disable_by_batch_size: int | None = None,
        hysteresis: float = 0.03,
        probe_interval: int = 64,
        shadow_interval: int = 4,
        shadow_capable: bool = False,
        needs_probes: bool | None = None,
        probe_share: float = 0.02,
        min_gain: float = 0.1,
        catch_up_horizon: float = 0.5,
        lite_depth: int = 0,
        variable_size: bool = False,
    ) -> None:
        if policy not in POLICIES:
            raise InvalidRequestError(
                f"unknown speculative policy {policy!r}; choose from {', '.join(POLICIES)}"
            )
        self.policy = policy
        self.max_depth = max_depth
        self.nodes_for_depth = nodes_for_depth  # depth -> draft nodes (expected_nodes)
        self.disable_by_batch_size = disable_by_batch_size
        self.hysteresis = hysteresis
        self.probe_interval = probe_interval
        self.shadow_interval = shadow_interval
        self.shadow_capable = shadow_capable  # the drafter can propose without side effects
        # real one-token probes for idle requests: drafters whose shadows do not show what
        # their real drafts would do (a head with a lookup branch shadows its lookup only)
        self.needs_probes = not shadow_capable if needs_probes is None else needs_probes
        self.probe_share = probe_share  # of the time, at most, spent on probes
        # Drafting starts only where the plan is predicted to beat plain decoding by this share:
        # at compute-bound batch sizes the cost model's predictions are off by 5-10% (measured:
        # Qwen 1.5B, 32 requests, predicted +7%, realised -4%), and a draft model's catch-up is
        # paid before the gain it is priced on comes in.
        self.min_gain = min_gain
        # a catch-up must pay back within this share of the request's expected remaining steps
        self.catch_up_horizon = catch_up_horizon
        # depth of the drafter's lite mode (its shadow verified alone; 0: none), see above
        self.lite_depth = lite_depth
        # shadows are the lite mode's drafts (a head's lookup branch: not what the head drafts)
        self._lite_shadows = bool(lite_depth) and self.needs_probes
        # proposals may be shorter than their budget: acceptance counts their yield, and the
        # nodes they feed are learnt (`record_proposal`)
        self.variable_size = variable_size
        self._size_requests: dict[int, AcceptanceCounts] = {}
        self._size_workloads: dict[str, AcceptanceCounts] = {}
        # the same for lite drafts: a lookup, often shorter than its budget or empty
        self._lite_size_requests: dict[int, AcceptanceCounts] = {}
        self._lite_size_workloads: dict[str, AcceptanceCounts] = {}
        self._probe_credit = 0.0  # seconds of probing earned and not yet spent
        self._probe_charged: float | None = None  # the predicted cost of this step's probe
        self._probe_wait = 0  # steps before asking again whether a probe could pay
        self.shadow_requests: list[Sequence] = []  # to draft in shadow this step
        self._shadows: dict[int, tuple] = {}  # seq_id -> (output length, tokens, children,
        # depth, the depth its outcome is recorded at)
        self.step_cost = StepCostModel()
        self.draft_cost = DraftCostModel()
        self._requests: dict[int, AcceptanceCounts] = {}
        self._workloads: dict[str, AcceptanceCounts] = {}
        self._lite_requests: dict[int, AcceptanceCounts] = {}
        self._lite_workloads: dict[str, AcceptanceCounts] = {}
        self._last_plan: dict[int, int] = {}
        self._idle_steps: dict[int, int] = {}
        # steps in a row in which no request drafted: requests shorter than `probe_interval`
        # steps are never idle that long themselves, and without this a controller that
        # stopped drafting early (on a noisy calibration, say) would never look again
        self._quiet_steps = 0
        self._shadow_idle: dict[int, int] = {}
        # what the last step decided, for /metrics and logs
        self.last_budgets: list[int] = []
        self.last_predicted_gain: float = 1.0
        self.num_decisions = 0  # (request, step) pairs decided
        self.num_drafting = 0  # of which drafted
        self.num_lite = 0  # lite drafts verified (requests x steps)
        self._learning_steps = 0  # plans made before the draft-cost fit had its observations
        self._hopeful = True  # whether any drafting could pay this step (`_could_pay_at_all`)

    # ---- estimates -----------------------------------------------------------------------------

    def _counts(self, lite: bool):
        if lite:
            return self._lite_requests, self._lite_workloads
        return self._requests, self._workloads

    def acceptance(self, seq: Sequence, lite: bool = False, cache=None) -> list[float]:
        """a(d) for d = 1..max_depth (lite: 1..lite_depth, of the lite drafts): the request's
        own counts shrunk towards its workload's, and the workload's towards 0.5 (optimistic
        enough to try)."""
        requests, workloads = self._counts(lite)
        priors = self._priors(workloads, workload_key(seq), lite, 0.5, cache)
        own = requests.get(seq.seq_id)
        return own.rates(priors, _OWN_STRENGTH) if own else list(priors)

    def _priors(self, workloads, key: str, lite: bool, default: float, cache) -> list[float]:
        """A workload's rates by depth, shrunk towards `default` (`cache`: a dict kept for
        one plan, where every request of a workload shares them)."""
        slot = (id(workloads), key)
        if cache is not None and slot in cache:
            return cache[slot]
        wl = workloads.get(key)
        n = self.lite_depth if lite else self.max_depth
        priors = wl.rates([default] * n, 2.0) if wl else [default] * n
        if cache is not None:
            cache[slot] = priors
        return priors

    def expected_sizes(
        self, seq: Sequence, full: list[float] | None = None, cache=None, lite: bool = False
    ) -> list[float]:
        """Draft nodes a budget of depth k feeds, for k = 0..max_depth: `nodes_for_depth`
        (`full`, if already listed), or for a variable-size drafter what `seq`'s proposals held
        (shrunk towards its workload's, and that towards the full budget: an unmeasured depth
        is priced at its k nodes). `lite`: the same for lite drafts (k = 0..lite_depth), a
        chain of at most k nodes."""
        if lite:
            full = [float(k) for k in range(self.lite_depth + 1)]
        elif full is None:
            full = [0.0] + [float(self.nodes_for_depth(k)) for k in range(1, self.max_depth + 1)]
        if not (self.variable_size or lite):
            return full
        requests, workloads = self._size_counts(lite)
        priors = self._priors(workloads, workload_key(seq), lite, 1.0, cache)
        own = requests.get(seq.seq_id)
        rates = own.rates(priors, _OWN_STRENGTH) if own else priors
        yields = accumulate(accumulate(rates, mul))
        return [0.0, *map(min, yields, full[1:])]

    def _size_counts(self, lite: bool):
        if lite:
            return self._lite_size_requests, self._lite_size_workloads
        return self._size_requests, self._size_workloads

    def record_proposal(self, seq: Sequence, budget: int, nodes: int, lite: bool = False) -> None:
        """A variable-size drafter (`lite`: the lite mode) proposed `nodes` draft nodes for
        `seq` under `budget`."""
        if not (self.variable_size or lite) or budget <= 0:
            return
        requests, workloads = self._size_counts(lite)
        own = requests.setdefault(seq.seq_id, AcceptanceCounts(decay=0.9))
        own.record(budget, min(nodes, budget))
        key = workload_key(seq)
        wl = workloads.setdefault(key, AcceptanceCounts(decay=0.995))
        wl.record(budget, min(nodes, budget))

    @staticmethod
    def expected_tokens(rates: list[float], k: int) -> float:
        total, run = 1.0, 1.0
        for a in rates[:k]:
            run *= a
            total += run
        return total

    def goodput(
        self,
        base_tokens: int,
        rates: list[list[float]],
        plan: list[int],
        catch_up: list[float] | None = None,
        lite_rates: list[list[float]] | None = None,
        sizes: list[list[float]] | None = None,
        lite_sizes: list[list[float]] | None = None,
    ) -> float:
        """Expected tokens per second of `plan` (negative depths: lite drafts, priced with
        `lite_rates` and no drafting time, at `lite_sizes` nodes, else one node a level;
        `sizes`: each request's nodes by depth, `expected_sizes`, else `nodes_for_depth`)."""
        return self._rate(
            *self._totals(base_tokens, rates, plan, catch_up, lite_rates, sizes, lite_sizes)
        )

    def _totals(
        self, base_tokens, rates, plan, catch_up=None, lite_rates=None, sizes=None, lite_sizes=None
    ):
        """What `goodput` prices `plan` on: (expected tokens, tokens fed, draft levels run,
        catch-up seconds)."""
        tokens, fed, levels = 0.0, base_tokens, 0.0
        for i, k in enumerate(plan):
            if k >= 0:
                tokens += self.expected_tokens(rates[i], k)
                if k:
                    fed += sizes[i][k] if sizes is not None else self.nodes_for_depth(k)
                    levels += self._levels(sizes, i, k)
            else:
                tokens += self.expected_tokens((lite_rates or rates)[i], -k)
                fed += lite_sizes[i][-k] if lite_sizes is not None else -k
        extra = sum(c for c, k in zip(catch_up, plan, strict=True) if k > 0) if catch_up else 0.0
        return tokens, fed, levels, extra

    def _levels(self, sizes, i: int, k: int) -> float:
        """Draft levels a budget of k costs to draft: k, or for a variable-size drafter the
        nodes it is expected to propose (its draft-cost fit counts what it really drafted, in
        nodes, see `Drafter.drafted_depth`: a lookup that finds two tokens under a budget of 16
        drafted two)."""
        if not k:
            return 0.0
        return sizes[i][k] if self.variable_size and sizes is not None else float(k)

    def _rate(self, tokens: float, fed: float, depth: float, extra: float = 0.0) -> float:
        """Expected tokens per second of a step feeding `fed` tokens with `depth` draft levels
        (and `extra` seconds of catch-up)."""
        t = self.step_cost.predict(fed) + self.draft_cost.predict(depth) + extra
        return tokens / t if t > 0 else 0.0

    def _rate_many(self, tokens, fed, depth, extra: float = 0.0) -> np.ndarray:
        """`_rate` at each of a few arrays' entries, in one pass (the same figures)."""
        t = self.step_cost.predict_many(fed) + self.draft_cost.predict_many(depth) + extra
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where(t > 0, tokens / t, 0.0)

    def _tables(self, seqs: list[Sequence], full: list[float], cache: dict, lite=False) -> tuple:
        """Each request's `acceptance`, `expected_sizes` (at most `full`), the running
        products of its acceptance (from 1.0: `reach`) and their running sums
        (`expected_tokens` at each depth), one row each, formed in the order those form them
        (the same figures); `lite`: of its lite drafts. Many requests at once as arrays
        (`_SCREEN_MIN`: fewer cost less as lists)."""
        n, top = len(seqs), self.lite_depth if lite else self.max_depth
        varies = lite or self.variable_size
        if n < _SCREEN_MIN:
            rates = [self.acceptance(s, lite, cache) for s in seqs]
            sizes = [full] * n  # (one list unless they vary)
            if varies:
                sizes = [self.expected_sizes(s, full, cache, lite) for s in seqs]
            reach = [[1.0, *accumulate(r, mul)] for r in rates]
            return rates, sizes, reach, [list(accumulate(row)) for row in reach]
        # (`AcceptanceCounts.rates`, `expected_sizes`: the same operations, row by row)
        rates = self._shrunk(seqs, False, lite, 0.5, cache)
        sizes = np.broadcast_to(np.array(full), (n, top + 1))
        if varies:
            holds = self._shrunk(seqs, True, lite, 1.0, cache)
            sizes = np.zeros((n, top + 1))
            sizes[:, 1:] = np.minimum(np.cumsum(np.cumprod(holds, axis=1), axis=1), full[1:])
        reach = np.ones((n, top + 1))
        reach[:, 1:] = np.cumprod(rates, axis=1)
        cum = np.cumsum(reach, axis=1)
        return rates.tolist(), sizes.tolist(), reach.tolist(), cum.tolist()

    def _shrunk(self, seqs: list[Sequence], sizes: bool, lite: bool, default: float, cache):
        """`acceptance` (`sizes`: the chances `expected_sizes` multiplies) of every request,
        one row each: its decayed counts shrunk towards its workload's priors."""
        requests, workloads = self._size_counts(lite) if sizes else self._counts(lite)
        top = self.lite_depth if lite else self.max_depth
        trials, hits = np.zeros((len(seqs), top)), np.zeros((len(seqs), top))
        priors = []
        for i, s in enumerate(seqs):
            priors.append(self._priors(workloads, workload_key(s), lite, default, cache))
            own = requests.get(s.seq_id)
            if own is not None and own.trials:
                m = min(len(own.trials), top)
                trials[i, :m], hits[i, :m] = own.trials[:m], own.hits[:m]
        return (hits + _OWN_STRENGTH * np.array(priors)) / (trials + _OWN_STRENGTH)

    def _hopeless(self, heap, reach, sizes, levels, cost, totals, best: float) -> set[int]:
        """The requests among the greedy's `heap` of offers (request i's next level k) none of
        whose depths k..max_depth would raise the step's goodput above `best` at `totals`
        (tokens, fed, draft levels, catch-up seconds): what a pop of each would find, for all
        at once."""
        rows = np.array([i for _, i, _ in heap])
        ks = np.array([k for _, _, k in heap])
        pick = (np.arange(len(rows)), ks - 1)  # the level already planned
        prefix = np.cumsum(reach[rows], axis=1)
        add_t = prefix - prefix[pick][:, None]
        add_t[np.arange(reach.shape[1])[None, :] < ks[:, None]] = -np.inf  # (planned levels)
        add_f = sizes[rows] - sizes[rows][pick][:, None]
        add_d = levels[rows] - levels[rows][pick][:, None]
        add_x = np.where(ks == 1, cost[rows], 0.0)[:, None]
        out = self._cannot_win(add_t, add_f, add_d, add_x, totals, best)
        return set(rows[out].tolist())

    def _cannot_win(self, add_t, add_f, add_d, add_x, totals, best: float) -> np.ndarray:
        """Rows none of whose columns (tokens, fed, draft levels and catch-up seconds each
        would add to `totals`) would raise the step's goodput above `best`. A margin keeps it
        to those that clearly cannot (its sums are formed in another order than the
        planner's)."""
        tokens, fed, depth, paid = totals
        g = self._rate_many(tokens + add_t, fed + add_f, depth + add_d, paid + add_x)
        return g.max(axis=1) < best * (1 - 1e-9)

    def _catch_up_costs(
        self, seqs: list[Sequence], expected: list[float], catch_up: list[int]
    ) -> list[float]:
        """Seconds of catch-up per request, spread over `catch_up_horizon` of the steps it is
        expected to have left (at `expected` tokens a step, full depth; at most 256 tokens
        ahead): the request may end early or stop drafting, so the catch-up is priced to pay
        back well before its end."""
        out = []
        for s, e, n in zip(seqs, expected, catch_up, strict=True):
            if n <= 0:
                out.append(0.0)
                continue
            left = 256
            if s.params.max_tokens is not None:
                left = min(left, s.params.max_tokens - len(s.output_token_ids))
            steps = max(1.0, self.catch_up_horizon * left / e)
            out.append(self.draft_cost.catch_up_seconds(n) / steps)
        return out

    # ---- decisions -----------------------------------------------------------------------------

    def plan(
        self,
        seqs: list[Sequence],
        base_tokens: int,
        num_running: int,
        catch_up: list[int] | None = None,
        caps: list[int] | None = None,
    ) -> list[int]:
        """Draft depth for each decoding sequence. `base_tokens`: the decode tokens the step
        feeds without drafts (one root per decoding request; prefill chunks are left out, see
        the engine); `num_running`: requests in the batch; `catch_up`: tokens the drafter
        would have to process for each before drafting (the drafter's `catch_up_tokens`);
        `caps`: the deepest draft each can take (its context, max_tokens and cache slots), so
        that what is recorded as drafted (depths, idle steps, probes) is what will run."""
        catch_up = catch_up or [0] * len(seqs)
        caps = caps if caps is not None else [self.max_depth] * len(seqs)
        limit = self.disable_by_batch_size
        capped = limit is not None and num_running > limit
        if self.policy != "adaptive" or capped:
            self.last_predicted_gain = 1.0  # no plan of the controller's: none predicted
        if self.policy == "off" or not seqs or capped:
            budgets = [0] * len(seqs)
        elif self.policy == "static":
            budgets = [self.max_depth] * len(seqs)
        else:
            self._hopeful = not self.step_cost.calibrated or self._could_pay_at_all(
                base_tokens, len(seqs)
            )
            budgets = self._adaptive(seqs, base_tokens, catch_up)
        budgets = [min(k, c) if k > 0 else k for k, c in zip(budgets, caps, strict=True)]
        for s, k in zip(seqs, budgets, strict=True):
            if k < 0:  # verified now: a pending shadow would count the same tokens again
                self._shadows.pop(s.seq_id, None)
            self._last_plan[s.seq_id] = max(k, 0)  # the head's plan: lite drafts hold no state
            self._idle_steps[s.seq_id] = 0 if k > 0 else self._idle_steps.get(s.seq_id, 0) + 1
            self._shadow_idle[s.seq_id] = 0 if k else self._shadow_idle.get(s.seq_id, 0) + 1
        self.shadow_requests = []
        self._probe_charged = None
        if self.policy == "adaptive" and not capped:
            budgets = self._explore(seqs, budgets, catch_up, base_tokens, caps)
        self._quiet_steps = 0 if any(budgets) else self._quiet_steps + 1
        self.last_budgets = budgets
        self.num_decisions += len(budgets)
        self.num_drafting += sum(1 for k in budgets if k)
        return budgets

    def _explore(
        self,
        seqs: list[Sequence],
        plan: list[int],
        catch_up: list[int],
        base_tokens: int,
        caps: list[int],
    ) -> list[int]:
        """Keep the estimates of requests that are not drafting fresh. With a drafter whose
        proposals have no side effects (n-gram lookup), a shadow draft every `shadow_interval`
        idle steps is scored later against the tokens the request really produced: for
        deterministic drafts that is exactly the verification outcome, at no verification cost.
        A head with a lookup branch shadows its lookup alone; that is not what it drafts, so it
        gets probes too, and a shadow that matched brings the next one forward. Other drafters
        get a real one-token probe, one request per step at most, paid from a
        credit that grows by `probe_share` of every step's time: however many requests are
        idle, probes (a draft model's catch-up included) take at most that share of the time.
        A probe is charged its predicted cost, corrected by its measured one (`record_draft`).
        No probe runs where drafting could not win even if every draft were accepted (a
        compute-bound batch): what it would learn could not change a decision."""
        plan = list(plan)
        probed = False
        step_s = self.step_cost.predict(base_tokens) if self.step_cost.calibrated else 0.0
        grow = self.probe_share * step_s
        self._probe_credit = min(self._probe_credit + grow, 4 * self.probe_interval * grow)
        worth: bool | None = None  # whether a perfect acceptance could pay, decided once
        engine_quiet = 0 if any(k > 0 for k in plan) else self._quiet_steps + 1  # this one too
        self._probe_wait -= 1
        for i, s in enumerate(seqs):
            idle = self._idle_steps.get(s.seq_id, 0)
            if plan[i] > 0:
                continue
            pending = s.seq_id in self._shadows
            # (no shadows either where no drafting could pay: what they would learn could not
            # change a decision; they resume when the batch shrinks)
            # (lite rows are verified, not shadowed)
            if self.shadow_capable and not pending and plan[i] == 0 and self._hopeful:
                if self._shadow_idle.get(s.seq_id, 0) >= self.shadow_interval:
                    self.shadow_requests.append(s)
                    self._shadow_idle[s.seq_id] = 0
                    continue
            quiet = max(idle, engine_quiet)  # (the request's, or the whole engine's)
            probe = self.needs_probes and not probed and caps[i] > 0  # (room for one draft)
            if probe and quiet >= self.probe_interval:
                cost = self.draft_cost.catch_up_seconds(catch_up[i]) + self.draft_cost.predict(1)
                if cost > self._probe_credit:
                    continue
                if worth is None:
                    worth = self._probe_wait <= 0 and self._could_pay(
                        seqs, plan, base_tokens, catch_up, i
                    )
                    if not worth and self._probe_wait <= 0:  # asked again a few steps on
                        self._probe_wait = max(1, self.probe_interval // 4)
                if not worth:
                    continue
                self._probe_credit -= cost
                self._probe_charged = cost
                plan[i] = 1
                probed = True
                self._idle_steps[s.seq_id] = 0
        return plan

    def _could_pay(
        self, seqs: list[Sequence], plan: list[int], base_tokens: int, catch_up: list[int], i: int
    ) -> bool:
        """Whether drafting would beat plain decoding by `min_gain` if every draft were
        accepted: request i alone at some depth, or every request at one depth (a draft
        model's fixed cost is shared by the batch). Catch-ups are priced as in planning."""
        ones = [[1.0] * self.max_depth for _ in seqs]
        cost = self._catch_up_costs(seqs, [self.max_depth + 1.0] * len(seqs), catch_up)
        plain = self.goodput(base_tokens, ones, [0] * len(seqs))
        target = plain * (1 + self.min_gain)
        alone = [max(k, 0) if j != i else 0 for j, k in enumerate(plan)]  # the head alone
        for k in range(1, self.max_depth + 1):
            alone[i] = k
            if self.goodput(base_tokens, ones, alone, cost) >= target:
                return True
            if self.goodput(base_tokens, ones, [k] * len(seqs), cost) >= target:
                return True
        return False

    def _could_pay_at_all(self, base_tokens: int, n: int) -> bool:
        """Whether any drafting by `n` decoding requests could beat plain decoding by
        `min_gain`, every draft accepted and drafting free: x draft nodes in all (lite drafts
        too) yield at most x tokens, and at most `max(max_depth, lite_depth)` a request, so
        the step yields at most n + min(x, n * depth) tokens in the time of base + x. The step
        time is piecewise linear in x (a curve may drop just past a knot, where a point
        measured below its predecessor), so that bound is monotone between the curves' knots:
        its ends and both sides of each knot decide."""
        depth = max(self.max_depth, self.lite_depth)
        top = n * max(float(self.nodes_for_depth(self.max_depth)), float(self.lite_depth))
        xs = {1.0, min(top, float(n * depth))}
        for curve in (self.step_cost.measured, self.step_cost.calibration):
            for x, _ in curve.points():
                if 0 < x - base_tokens < top:
                    xs.update((x - base_tokens, x - base_tokens + 1e-6))
        target = self._rate(n, base_tokens, 0) * (1 + self.min_gain)
        return any(self._rate(n + min(x, n * depth), base_tokens + x, 0) >= target for x in xs)

    def _could_pay_free(self, base_tokens: int, n: int, k: int) -> bool:
        """Whether `n` requests drafting depth k, every draft accepted and drafting free, would
        beat plain decoding by `min_gain` (the step-cost curve alone decides)."""
        fed = base_tokens + n * self.nodes_for_depth(k)
        drafting = self._rate(n * (1 + k), fed, 0)  # depth 0: no drafting time
        return drafting >= self._rate(n, base_tokens, 0) * (1 + self.min_gain)

    def add_shadow(
        self, seq: Sequence, tokens: list[int], children: list[list[int]], budget: int = 0
    ) -> None:
        """A draft tree proposed for `seq` under `budget` but not verified: scored when its
        tokens are known (a variable-size drafter's empty proposal at once: it yields none)."""
        depth, node, stack = 0, 0, [(0, 0)]
        while stack:  # the tree's depth
            node, d = stack.pop()
            depth = max(depth, d)
            stack += [(c, d + 1) for c in children[node]]
        counted = depth  # the depth its outcome is recorded at
        if self.variable_size and budget > 0:
            self.record_proposal(seq, budget, len(tokens) - 1)
            counted = budget
            if not depth and not self.needs_probes:
                self._record(seq, budget, 0)
        elif self._lite_shadows and budget > 0:  # the lite mode's draft, as for lookups
            self.record_proposal(seq, budget, len(tokens) - 1, lite=True)
            counted = budget
            if not depth:
                self._record(seq, budget, 0, lite=True)
        if depth:
            start = len(seq.output_token_ids)
            self._shadows[seq.seq_id] = (start, tokens, children, depth, counted)

    def resolve_shadows(self, seq: Sequence) -> None:
        """Score `seq`'s shadow draft once the tokens it guessed are known: the accepted length
        is how far the real output follows the tree (what verification would have kept)."""
        shadow = self._shadows.get(seq.seq_id)
        if shadow is None:
            return
        start, tokens, children, depth, counted = shadow
        produced = seq.output_token_ids[start:]
        if len(produced) < depth and seq.finish_reason is None:
            return
        del self._shadows[seq.seq_id]
        node, accepted = 0, 0
        for y in produced[:depth]:
            nxt = next((c for c in children[node] if tokens[c] == y), None)
            if nxt is None:
                break
            node, accepted = nxt, accepted + 1
        if accepted == depth or len(produced) > accepted:  # else it ended undecided
            if not self.needs_probes:  # the shadow is what the drafter would have drafted
                self._record(seq, counted, accepted)
            elif self.lite_depth:  # it is what the lite mode would have drafted
                self._record(seq, counted, accepted, lite=True)
            if self.needs_probes and accepted >= 2 and seq.seq_id in self._idle_steps:
                # part of the drafter's drafts, and it would have paid: bring the next real
                # probe forward
                self._idle_steps[seq.seq_id] = max(
                    self._idle_steps[seq.seq_id], self.probe_interval
                )

    def _adaptive(self, seqs: list[Sequence], base_tokens: int, catch_up: list[int]) -> list[int]:
        if not self.step_cost.calibrated:
            return [self.max_depth] * len(seqs)
        learning = len(self.draft_cost) < _MIN_DRAFT_OBSERVATIONS
        if learning and self._learning_steps < _MAX_LEARNING_STEPS:
            self._learning_steps += 1
            k = self.max_depth if len(self.draft_cost) % 2 == 0 else max(1, self.max_depth // 2)
            if not self._could_pay_free(base_tokens, len(seqs), k):
                k = 0  # a compute-bound batch: not even free drafts, all accepted, would pay
            return [k] * len(seqs)
        # A compute-bound batch (and no drafting plan to keep): no estimate could make any plan
        # pay, so none is weighed (at 128 requests that is most of a plan's time)
        if not self._hopeful and not any(self._last_plan.get(s.seq_id, 0) for s in seqs):
            return [0] * len(seqs)
        n, top = len(seqs), self.max_depth
        cache: dict = {}  # the workloads' priors, shared by their requests
        full = [0.0] + [float(self.nodes_for_depth(k)) for k in range(1, top + 1)]
        # reach[i][k]: the chance that request i's first k drafts are all accepted, i.e. the
        # expected tokens its level k adds; its running sum is E_i(k) (`expected_tokens`)
        rates, sizes, reach, cum = self._tables(seqs, full, cache)
        cost = self._catch_up_costs(seqs, [c[top] for c in cum], catch_up)
        # the levels each depth costs to draft (`_levels`)
        levels = sizes if self.variable_size else [[float(k) for k in range(top + 1)]] * n
        plan = [0] * n

        # Add draft levels best first: each request offers its next level, ranked by expected
        # tokens per fed node (a heap, so levels that add no nodes follow their parent level).
        # Totals are kept as levels are added, so each trial costs O(1), not O(batch).
        def offer(i: int, k: int) -> tuple[float, int, int] | None:
            if k > top:
                return None
            return (-reach[i][k] / max(1.0, sizes[i][k] - sizes[i][k - 1]), i, k)

        heap = [o for i in range(n) if (o := offer(i, 1)) is not None]
        heapq.heapify(heap)
        tokens, fed, depth, paid = float(n), base_tokens, 0.0, 0.0  # paid: catch-up s
        rate = self._rate
        best = plain = rate(tokens, fed, depth)
        arrays = None  # the tables as arrays, for screening
        # Requests that cannot win at the current totals, found for all of them at once
        # (`_hopeless`); valid until a level is taken. Screened at the start and again after
        # a few pops in a row took nothing: a batch where drafting does not pay is
        # screened once, one where every pop takes is not screened again.
        hopeless: set[int] | None = None
        misses = _SCREEN_AFTER
        while heap:
            if hopeless is None and misses >= _SCREEN_AFTER and len(heap) >= _SCREEN_MIN:
                arrays = arrays or tuple(np.array(t) for t in (reach, sizes, levels, cost))
                hopeless = self._hopeless(heap, *arrays, (tokens, fed, depth, paid), best)
            _, i, k = heapq.heappop(heap)
            if hopeless is not None and i in hopeless:
                continue
            # Take this level together with as many deeper ones as pay best: a draft step has a
            # fixed part (the drafter's catch-up), so one level alone can lose where four win.
            add_t, add_f, take, g_take = 0.0, 0, 0, best
            add_x = cost[i] if k == 1 else 0.0  # a request's first level pays its catch-up
            below = levels[i][k - 1]  # (levels already planned for i)
            row, size, lv = reach[i], sizes[i], levels[i]
            for j in range(k, top + 1):
                add_t, add_f = add_t + row[j], add_f + (size[j] - size[j - 1])
                add_d = lv[j] - below
                g = rate(tokens + add_t, fed + add_f, depth + add_d, paid + add_x)
                if g > g_take:
                    g_take, take, t_take, f_take, d_take = g, j, add_t, add_f, add_d
            if take:
                best, plan[i] = g_take, take
                tokens, fed, depth = tokens + t_take, fed + f_take, depth + d_take
                paid += add_x
                nxt = offer(i, take + 1)
                if nxt is not None:
                    heapq.heappush(heap, nxt)
                hopeless, misses = None, 0
            else:
                misses += 1
        # The greedy adds one request at a time, so a fixed part of the draft cost (a draft
        # model runs its forwards whatever the batch) can stop it at the first request where
        # all of them together would win: weigh every uniform depth too (the sums `goodput`
        # forms, from the tables above; one request's were all weighed above).
        extra = sum(cost)
        if n > 1:
            u_tokens, u_fed = _column_sums(cum, 0.0), _column_sums(sizes, base_tokens)
            u_levels = _column_sums(levels, 0.0)
            for k in range(1, top + 1):
                g = rate(u_tokens[k], u_fed[k], u_levels[k], extra)
                if g > best:
                    best, plan = g, [k] * n
        if any(plan) and best < plain * (1 + self.min_gain):
            plan, best = [0] * len(seqs), plain  # too close to call: plain decoding
        previous = [self._last_plan.get(s.seq_id, p) for s, p in zip(seqs, plan, strict=True)]
        if previous != plan:
            kept = self.goodput(base_tokens, rates, previous, cost, sizes=sizes)
            # hysteresis, except that a drafting plan no longer predicted to beat plain ends
            if (kept >= plain or not any(previous)) and best < kept * (1 + self.hysteresis):
                plan, best = previous, kept
        if self.lite_depth and not all(plan):
            plan, best = self._add_lite(seqs, base_tokens, rates, cost, plan, best, sizes, cache)
        self.last_predicted_gain = best / plain if plain > 0 else 1.0
        return plan

    def _add_lite(
        self,
        seqs: list[Sequence],
        base_tokens: int,
        rates: list[list[float]],
        cost: list[float],
        plan: list[int],
        best: float,
        sizes: list[list[float]],
        cache: dict | None = None,
    ) -> tuple[list[int], float]:
        """Lite drafts for the requests `plan` keeps plain, best first: each takes the depth
        that raises the step's goodput most (lite drafts cost verification only), and the lot
        is kept only if it beats `plan` by `min_gain`. No hysteresis: switching them on or off
        touches no state."""
        idle = [i for i, k in enumerate(plan) if k == 0]
        full = [float(k) for k in range(self.lite_depth + 1)]
        lite, nodes, reach, _ = self._tables([seqs[i] for i in idle], full, cache or {}, True)
        adds = [list(accumulate(row[1:])) for row in reach]  # the tokens each depth adds
        order = sorted(range(len(idle)), key=lambda r: -lite[r][0])
        tokens, fed, depth, paid = self._totals(base_tokens, rates, plan, cost, sizes=sizes)
        out, g_best = list(plan), best
        hopeless, misses, arrays = None, _SCREEN_AFTER, None  # as in `_adaptive`
        for done, r in enumerate(order):
            left = len(order) - done
            if hopeless is None and misses >= _SCREEN_AFTER and left >= _SCREEN_MIN:
                arrays = arrays or (np.array(adds), np.array(nodes)[:, 1:])
                totals = (tokens, fed, depth, paid)
                hopeless = self._cannot_win(*arrays, 0.0, 0.0, totals, g_best)
            if hopeless is not None and hopeless[r]:
                continue
            take = 0
            for j in range(1, self.lite_depth + 1):
                g = self._rate(tokens + adds[r][j - 1], fed + nodes[r][j], depth, paid)
                if g > g_best:
                    g_best, take, t_take = g, j, adds[r][j - 1]
            if take:
                out[idle[r]], tokens, fed = -take, tokens + t_take, fed + nodes[r][take]
                hopeless, misses = None, 0
            else:
                misses += 1
        if g_best < best * (1 + self.min_gain):
            return plan, best
        return out, g_best

    # ---- learning ------------------------------------------------------------------------------

    def record_verification(
        self, seq: Sequence, depth: int, accepted: int, lite: bool = False
    ) -> None:
        """A verified draft of `depth` of which `accepted` were kept (lite: a lite draft)."""
        self.num_lite += 1 if lite else 0
        self._record(seq, depth, accepted, lite)

    def record_empty(self, seq: Sequence, budget: int, lite: bool = False) -> None:
        """A lookup (or lite draft) under `budget` proposed nothing, or nothing the grammar
        allows: nothing was verified, and it counts as a miss at depth 1 (see the module)."""
        self._record(seq, budget, 0, lite)

    def _record(self, seq: Sequence, depth: int, accepted: int, lite: bool = False) -> None:
        requests, workloads = self._counts(lite)
        own = requests.setdefault(seq.seq_id, AcceptanceCounts(decay=0.9))
        own.record(depth, accepted)
        key = workload_key(seq)
        workloads.setdefault(key, AcceptanceCounts(decay=0.995)).record(depth, accepted)

    def predict_step_time(self, num_tokens: int) -> float | None:
        """A target step's time for `num_tokens` fed, once the step-cost curve has points."""
        return self.step_cost.predict(num_tokens) if self.step_cost.calibrated else None

    def record_step(self, num_tokens: int, seconds: float) -> None:
        self.step_cost.observe(num_tokens, seconds)

    def record_draft(self, depth_sum: int, seconds: float, catch_up: int = 0) -> None:
        self.draft_cost.observe(depth_sum, seconds, catch_up)
        if self._probe_charged is not None and depth_sum == 1:  # the probe alone drafted
            self._probe_credit -= seconds - self._probe_charged  # charge what it really cost
        self._probe_charged = None

    def release(self, seq: Sequence) -> None:
        self._requests.pop(seq.seq_id, None)
        self._lite_requests.pop(seq.seq_id, None)
        self._size_requests.pop(seq.seq_id, None)
        self._lite_size_requests.pop(seq.seq_id, None)
        self._last_plan.pop(seq.seq_id, None)
        self._idle_steps.pop(seq.seq_id, None)
        self._shadow_idle.pop(seq.seq_id, None)
        self._shadows.pop(seq.seq_id, None)

    def summary(self) -> dict:
        b = self.last_budgets
        return {
            "policy": self.policy,
            "mean_budget": sum(abs(k) for k in b) / len(b) if b else 0.0,
            "lite_fraction": sum(1 for k in b if k < 0) / len(b) if b else 0.0,  # planned
            "speculating_fraction": sum(1 for k in b if k) / len(b) if b else 0.0,
            "predicted_gain": self.last_predicted_gain,
            "workload_acceptance": {  # a copy: /metrics reads this from another thread
                k: [round(v.rate(d, 0.5, 2.0), 3) for d in range(len(list(v.trials)))]
                for k, v in list(self._workloads.items())
            },
        }
