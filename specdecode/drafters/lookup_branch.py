"""A prompt-lookup branch grafted onto a head's draft tree (`prompt_lookup_tokens`).

Heads and prompt lookup fail in different places. A head predicts the next few tokens from the
target's features, and its acceptance falls off quickly with depth; lookup proposes long runs
but only where the answer copies its context (a function repeated with its signature and
docstring, a code edit, extraction). Every step this drafter asks the head for its tree, looks
the request's last n-gram up in its prompt and output (`ngram.lookup`), and grafts the
continuation onto the tree as a path from the root: where the head already proposed the same
tokens the path follows its nodes, from the first difference on it adds new ones. The target
verifies the union in its one forward, so each step keeps whichever proposal the target agrees
with further; when lookup finds nothing the step is the head's alone.

Heads draft deterministically (no q), and the graft keeps sibling tokens distinct, so the union
is verified with the deterministic-drafts rule: lossless. A draft model samples its drafts at
temperature > 0 (q given). A deterministic sibling cannot join drafts drawn from q under the
multi-round rule, and verifying the union by the target's choice instead would accept each
sampled draft with probability p(x), not min(1, p(x) / q(x)); so its sampled requests get no
graft: each step verifies either the draft model's chain (with q) or, where the lookup has done
as well for the time, the lookup chain alone (deterministic). Greedy requests are grafted like
a head's (their drafts are argmaxes, and greedy verification follows the target's argmax
through any tree), and so is a draft model's static top-k tree at any temperature.

The head hears about its own nodes only (the accepted path up to where it leaves the head's
tree); heads that read target features catch up from the features of whatever was committed. On
a CPU target a verification of up to ~16 tokens costs about one decoding step, so the extra
nodes are nearly free there; on a compute-bound batch the controller prices them like any other
node, and the chain itself is cut where its next node no longer pays: node i (1-based) is
verified while P(the chain's first i tokens are kept) x (a plain step's time per request) is
above the time one more fed token adds to the step (the engine's step-cost curve), with the
chain's acceptance by position measured per request against what the steps emitted (shrunk to
the drafter-wide figures). Nodes the head already proposed cost nothing extra. On an AVX2 CPU
one more token of verification costs a sixth to a quarter of a plain step, and a chat
request's lookup rarely holds past its first few tokens.

The same idea, choosing per step between a suffix tree and a head by a score, is Arctic
Inference's hybrid of suffix decoding and its speculator (Snowflake, 2025); here both proposals
are verified together instead. With `prompt_lookup_method: "suffix"` the branch is that: the
likeliest path of suffix decoding's tree (`suffix.SuffixDrafter.chain`), from the request's own
text and the corpus of earlier answers, in place of the most recent n-gram match.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch

from specdecode.core import Sequence
from specdecode.drafters.base import Drafter, DraftProposal
from specdecode.drafters.ngram import context_ids, lookup
from specdecode.drafters.suffix import SuffixDrafter
from specdecode.engine.controller import AcceptanceCounts
from specdecode.tree import TreeShape


def graft(prop: DraftProposal, chain: list[int]) -> DraftProposal:
    """`prop` with `chain` added as a path from the root: shared prefixes follow existing nodes
    (a child with the same token), the rest is appended after the existing nodes."""
    if not chain:
        return prop
    parents = list(prop.shape.parents)
    tokens = list(prop.tokens)
    kids = {n: {tokens[c]: c for c in cs} for n, cs in enumerate(prop.shape.children)}
    node = 0
    for tok in chain:
        nxt = kids.get(node, {}).get(tok)
        if nxt is None:
            nxt = len(tokens)
            parents.append(node)
            tokens.append(tok)
            kids.setdefault(node, {})[tok] = nxt
        node = nxt
    if len(tokens) == len(prop.tokens):
        return prop  # the head had proposed it all
    return DraftProposal(TreeShape(tuple(parents)), tokens)


@dataclass
class BranchStats:
    steps: int = 0  # verifications whose tree held grafted lookup nodes
    drafted: int = 0  # grafted nodes verified
    accepted: int = 0  # accepted tokens on grafted nodes (beyond what the head proposed)
    head_skipped: int = 0  # proposals where lookup matched and the head was not run

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class _Request:
    """Per request, over the steps where lookup found a match (moving averages)."""

    alone: float = 1.0  # tokens a step would emit with the lookup branch alone
    head_gain: float = 1.0  # tokens the head's nodes added on top of the branch
    # own observations of each: until the first, the estimates are the drafter-wide prior's,
    # which the first replaces (a chat request after code traffic must not inherit code's
    # copying for more than one step)
    seen_alone: int = 0
    seen_gain: int = 0
    missed: bool = False  # the last step verified without the head kept none of the lookup's
    prior_total: float = 2.0  # tokens a lookup step emitted with the head, on earlier requests
    skipped: int = 0  # lookup steps in a row without the head
    cut_short: int = 0  # lookup steps whose chain was cut
    chain: list[int] | None = None  # this step's lookup continuation
    head_ran: bool = True
    # a verified step not yet scored: (chain, head ran, output length before it, drafts kept);
    # scored against the tokens the step emitted once they are appended (next propose)
    pending: tuple[list[int], bool, int, int] | None = None
    # the lookup chain's acceptance by position, scored as `alone` is (the full chain, also
    # where a cut one was verified: the emitted tokens say whether its next ones would hold)
    positions: AcceptanceCounts = field(default_factory=lambda: AcceptanceCounts(decay=0.9))


_SMOOTHING = 0.3
_PRIOR_SMOOTHING = 0.1
_EXPLORE_EVERY = 8  # while the head is skipped, run it every this many lookup steps anyway
_EXPLORE_CUTS = 16  # of a request's cut chains, verify every this many whole anyway
_POSITION_STRENGTH = 2.0  # a request's chain acceptance, shrunk to the drafter-wide one by this


class LookupBranchDrafter(Drafter):
    """See the module docstring. When lookup matches, the head is only run if what it has been
    adding pays for its time: for each request, on its lookup steps, `head_gain` tokens per
    step against `alone` tokens per step without it, so the head pays when head_gain / alone >
    (head's drafting time per request) / (target step time per request). Both times are
    measured (`step_time`: the engine's step-cost curve); until they are, the head always runs.
    While skipped, it still runs every few lookup steps, so a request whose copying stops
    finds out, and at once after a step whose lookup alone kept nothing. A new request starts
    from the average of earlier requests' estimates (so a request on copy-heavy traffic can
    skip a draft model's first run, a prefill of its whole prompt); its first own observation
    replaces that prior."""

    def __init__(
        self,
        head: Drafter,
        num_tokens: int,
        prompt_lookup_min: int = 2,
        prompt_lookup_max: int = 5,
        room: Callable[[Sequence, int], int] | None = None,
        step_time: Callable[[int], float | None] | None = None,
        source: SuffixDrafter | None = None,
    ) -> None:
        if num_tokens < 1 or not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError("need num_tokens >= 1 and 1 <= prompt_lookup_min <= max")
        self.head = head
        self.samples_drafts = head.samples_drafts  # a draft model's q, where it ran alone
        self.num_tokens = num_tokens
        self.min_n, self.max_n = prompt_lookup_min, prompt_lookup_max
        self.room = room or (lambda seq, k: k)
        self.source = source  # suffix decoding's chains instead of the last n-gram's match
        self.step_time = step_time
        self.stateless = False  # propose keeps per-request state (a shadow draft would skew it)
        # but the lookup alone drafts in shadow: while the controller keeps a request plain
        # (a head that does not pay), a request that starts copying its context is seen
        self.shadow_capable = True
        # and is verified alone where the head does not pay but lookup does (lite drafts)
        self.lite_depth = num_tokens
        self.feature_layers = head.feature_layers
        self.branch_stats = BranchStats()
        self._own: dict[int, DraftProposal] = {}  # seq_id -> the head's own last proposal
        self._req: dict[int, _Request] = {}
        self._head_seconds: float | None = None  # head drafting time per request (average)
        self._proposals = 0  # proposals with drafts verified
        # over every request's lookup steps: where a new request's estimates start (a draft
        # model's first run prefills the whole prompt, worth skipping where copying is the rule)
        self._prior = _Request()
        self._prior.positions = AcceptanceCounts(decay=0.995)

    def _lookup(self, seq: Sequence, n: int) -> list[int]:
        context = context_ids(seq)
        if self.source is not None:
            return self.source.chain(context, n)
        return lookup(context, self.min_n, self.max_n, n)

    @property  # type: ignore[override]
    def learning(self) -> bool:
        return self.source.learning if self.source is not None else False

    @learning.setter
    def learning(self, on: bool) -> None:
        if self.source is not None:
            self.source.learning = on

    def clear_history(self) -> None:
        if self.source is not None:
            self.source.clear_history()

    def max_nodes(self, k: int) -> int:
        return self.head.max_nodes(k) + self.num_tokens

    def fit(self, k: int, slots: int) -> int:
        """The head's depth that fits `slots`; the branch takes what its tree leaves (`propose`
        cuts it to `slots`), so a short cache drops the branch's tail before the head's levels."""
        return self.head.fit(k, slots)

    def expected_nodes(self, k: int) -> float:
        """The head's nodes plus the grafted nodes verified per proposal so far (the branch's
        full length is only a bound: on traffic that does not copy it is rarely there)."""
        grafted = self.branch_stats.drafted / self._proposals if self._proposals else 0.0
        return self.head.expected_nodes(k) + grafted

    def drafted_depth(self, seq: Sequence, proposal: DraftProposal) -> int:
        own = self._own.get(seq.seq_id)  # the head's tree: the branch cost no drafting time
        if own is None:
            return max(proposal.shape.depths)
        return self.head.drafted_depth(seq, own) if own.num_drafts else 0

    def _head_pays(self, st: _Request, batch: int, k: int) -> bool:
        if self._head_seconds is None or self.step_time is None or st.missed:
            return True  # (after a miss: measure what the head adds here, not on the prior)
        step = self.step_time(batch * (1 + self.max_nodes(k)))
        if not step or step <= 0:
            return True
        gain = st.head_gain
        if not st.seen_gain:  # no own measure yet: the drafter is taken to add what the lookup
            # falls short here of the total earlier requests got (the prior's alone + gain)
            gain = max(gain, st.prior_total - st.alone)
        if gain / max(st.alone, 1.0) > self._head_seconds / (step / batch):
            return True
        return st.skipped % _EXPLORE_EVERY == _EXPLORE_EVERY - 1

    def propose(self, seqs: list[Sequence], budgets: list[int]) -> list[DraftProposal]:
        chains, alone_cuts, head_budgets = [], [], []
        probing = False  # a probe after skipped steps catches up on their features: not typical
        costs: tuple[float, float] | None = None
        costs_read = False  # (the step-cost curve is read only where some request has a chain)
        for seq, k in zip(seqs, budgets, strict=True):
            self._score(seq)
            n = self.room(seq, self.num_tokens) if k > 0 else 0
            limit = self.slots.get(seq.seq_id) if self.slots is not None else None
            if limit is not None:  # the cache slots this step gives the request
                n = min(n, limit)
            chain: list[int] = []
            if n > 0:
                chain = self._lookup(seq, n)
            alone: list[int] = []  # the chain's prefix worth verifying without the head's tree
            if chain:
                st = self._req.get(seq.seq_id)
                if st is None:  # a new request starts from what earlier ones measured
                    prior = self._prior
                    st = self._req[seq.seq_id] = _Request(prior.alone, prior.head_gain)
                    st.prior_total = prior.alone + prior.head_gain
                if not costs_read:
                    costs, costs_read = self._node_costs(len(seqs), max(budgets)), True
                # the head is skipped only for a chain worth verifying alone: one cut to nothing
                # would leave the step without drafts
                alone = self._cut(seq, chain, DraftProposal.empty(seq.last_token), costs)
                st.chain, st.head_ran = chain, not alone or self._head_pays(st, len(seqs), k)
                probing |= st.head_ran and st.skipped > 0
                st.skipped = 0 if st.head_ran else st.skipped + 1
                if not st.head_ran:
                    self.branch_stats.head_skipped += 1
                    k = 0
            elif seq.seq_id in self._req:
                self._req[seq.seq_id].chain = None
            if k > 0 and limit is not None:  # grafted: what the head's tree leaves
                chain = chain[: max(0, limit - self.head.max_nodes(k))]
            chains.append(chain)
            alone_cuts.append(alone)
            head_budgets.append(k)
        # nor is a drafter's first run for a request, or one after steps it missed: its
        # catch-up (for a draft model, the whole prompt) is more than a step's tokens
        probing |= any(
            self.head.catch_up_tokens(seq) > self.num_tokens + 1
            for seq, k in zip(seqs, head_budgets, strict=True)
            if k > 0
        )
        t0 = time.perf_counter()
        props = self.head.propose(seqs, head_budgets)
        ran = sum(1 for k in head_budgets if k > 0)
        if ran and not probing:
            per = (time.perf_counter() - t0) / ran
            old = self._head_seconds
            self._head_seconds = per if old is None else old + _SMOOTHING * (per - old)
        out = []
        for seq, chain, alone, prop in zip(seqs, chains, alone_cuts, props, strict=True):
            self._own[seq.seq_id] = prop
            if prop.num_drafts and self.samples_drafts and not seq.params.greedy:
                out.append(prop)  # drafts sampled from q take no deterministic sibling
                continue
            # (without the head's nodes the cut is the one already made)
            cut = self._cut(seq, chain, prop, costs) if prop.num_drafts else alone
            st = self._req.get(seq.seq_id)
            if len(cut) < len(chain) and st is not None:
                # now and then the whole chain: the cut rests on the step-cost curve at sizes
                # that cut steps no longer visit, where a slow spell's points would stay
                st.cut_short += 1
                if st.cut_short % _EXPLORE_CUTS == 0:
                    cut = chain
            out.append(graft(prop, cut))  # (a graft drops q: verified by the argmax)
        return out

    def _node_costs(self, batch: int, k: int) -> tuple[float, float] | None:
        """(a plain step's time per request, the time one more fed token adds to this step),
        from the engine's step-cost curve; None until it has points."""
        if self.step_time is None or batch == 0:
            return None
        plain = self.step_time(batch)
        fed = max(1, round(batch * (1 + self.expected_nodes(k))))
        lo, hi = self.step_time(fed), self.step_time(fed + 4)
        if not plain or lo is None or hi is None:
            return None
        return plain / batch, max(0.0, (hi - lo) / 4)

    def chain_rates(self, seq: Sequence, n: int) -> list[float]:
        """P(the lookup chain's token i is kept | its first i-1 were), i = 1..n, for `seq`: its
        own counts shrunk to the drafter-wide ones (which start at 1: nothing cut unmeasured)."""
        st = self._req.get(seq.seq_id)
        wide = self._prior.positions
        out = []
        for d in range(n):
            prior = wide.rate(d, 1.0, 1.0)
            out.append(st.positions.rate(d, prior, _POSITION_STRENGTH) if st else prior)
        return out

    def _cut(self, seq: Sequence, chain: list[int], prop: DraftProposal, costs) -> list[int]:
        """The chain's prefix worth verifying: the length that maximises, over its nodes,
        P(kept) x a plain step's time per request - the time the node adds to the step (none
        for a node the head's tree already holds)."""
        if not chain or costs is None:
            return chain
        value, extra = costs
        kids = {n: {prop.tokens[c]: c for c in cs} for n, cs in enumerate(prop.shape.children)}
        node, reach, total, best, best_len = 0, 1.0, 0.0, 0.0, 0
        rates = self.chain_rates(seq, len(chain))
        for i, (tok, rate) in enumerate(zip(chain, rates, strict=True)):
            node = kids.get(node, {}).get(tok) if node is not None else None
            reach *= rate
            total += reach * value - (0.0 if node is not None else extra)
            if total > best:
                best, best_len = total, i + 1
        return chain[:best_len]

    def shadow(self, seqs: list[Sequence], budgets: list[int]) -> list[DraftProposal]:
        """The lookup branch alone, at most `budgets[i]` deep, no state touched (the head does
        not run): what the controller scores for a request it keeps plain, or has verified as
        lite drafts."""
        out = []
        for seq, k in zip(seqs, budgets, strict=True):
            n = self.room(seq, min(k, self.num_tokens)) if k > 0 else 0
            chain = self._lookup(seq, n) if n > 0 else []
            out.append(DraftProposal(TreeShape.chain(len(chain)), [seq.last_token] + chain))
        return out

    def on_verified(
        self, seqs: list[Sequence], proposals: list[DraftProposal], accepted: list[list[int]]
    ) -> None:
        own_props, own_accepted = [], []
        self._proposals += len(proposals)
        for seq, prop, path in zip(seqs, proposals, accepted, strict=True):
            st = self._req.get(seq.seq_id)
            if st is not None and st.chain:
                st.pending = (st.chain, st.head_ran, len(seq.output_token_ids), len(path))
                st.chain = None
            own = self._own.get(seq.seq_id, prop)  # kept for drafted_depth, next propose
            n = len(own.tokens)
            if len(prop.tokens) > n:  # grafted nodes come after the head's, numbered as its
                self.branch_stats.steps += 1
                self.branch_stats.drafted += len(prop.tokens) - n
                self.branch_stats.accepted += sum(1 for node in path if node >= n)
                cut = next((j for j, node in enumerate(path) if node >= n), len(path))
                prop, path = own, path[:cut]
            own_props.append(prop)
            own_accepted.append(path)
        self.head.on_verified(seqs, own_props, own_accepted)

    def catch_up_tokens(self, seq: Sequence) -> int:
        return self.head.catch_up_tokens(seq)

    def observe(self, seqs: list[Sequence], features: list[torch.Tensor]) -> None:
        self.head.observe(seqs, features)

    def _score(self, seq: Sequence) -> None:
        """Score a request's last verified lookup step against the tokens it emitted: the
        lookup chain alone would have emitted its leading matches plus one token (the target's
        own at the first mismatch), the step emitted its kept drafts plus one. Where the chain
        was grafted, the emitted tokens past its matches were the target's choice against it;
        where it was not (a sampled draft model's chain, verified with q) they are a draw from
        the target's distribution all the same, so the count estimates what verifying the chain
        alone would have kept, up to the step's length: where every emitted token matched the
        chain, the chain alone would have gone on (censored), and the request's running
        estimate stands in for the part not seen. A step cut short by a stop is not scored."""
        st = self._req.get(seq.seq_id)
        if st is None or st.pending is None:
            return
        chain, head_ran, start, kept = st.pending
        st.pending = None
        emitted = seq.output_token_ids[start : start + kept + 1]
        if len(emitted) < kept + 1:
            return  # not appended (the request failed) or cut short (a stop, max_tokens)
        n = 0
        while n < min(len(emitted), len(chain)) and emitted[n] == chain[n]:
            n += 1
        # by position: kept up to n, rejected at n where the step emitted past it
        seen = len(chain) if n < len(emitted) else n
        for counts in (st.positions, self._prior.positions):
            counts.record(seen, n)
        alone = float(n)
        if n == len(emitted) < len(chain):  # censored: at least this many (sampled rows only)
            alone = max(alone, min(float(len(chain)), st.alone - 1))
        st.missed = not head_ran and alone == 0
        st.alone += (_SMOOTHING if st.seen_alone else 1.0) * (alone + 1 - st.alone)
        st.seen_alone += 1
        self._prior.alone += _PRIOR_SMOOTHING * (alone + 1 - self._prior.alone)
        if head_ran:  # (below 0 where the chain alone would have gone further)
            gain = len(emitted) - 1 - alone
            st.head_gain += (_SMOOTHING if st.seen_gain else 1.0) * (gain - st.head_gain)
            st.seen_gain += 1
            self._prior.head_gain += _PRIOR_SMOOTHING * (gain - self._prior.head_gain)

    def release(self, seq: Sequence) -> None:
        self._drop(seq)
        self.head.release(seq)
        if self.source is not None:  # (an answer for the corpus, unless learning is off)
            self.source.release(seq)

    def preempt(self, seq: Sequence) -> None:
        self._drop(seq)
        self.head.preempt(seq)

    def _drop(self, seq: Sequence) -> None:
        self._score(seq)
        self._own.pop(seq.seq_id, None)
        self._req.pop(seq.seq_id, None)

    def tracked_ids(self) -> set[int]:
        return self.head.tracked_ids() | set(self._own) | set(self._req)
