"""The prompt-lookup branch grafted onto a head's tree: hand-checked grafts, the head hearing
only its own nodes, room limits, and the config's checks."""

from __future__ import annotations

import pytest
import torch

from specdecode.config import SpeculativeConfig
from specdecode.core import Sequence
from specdecode.drafters.base import Drafter, DraftProposal
from specdecode.drafters.lookup_branch import LookupBranchDrafter, graft
from specdecode.errors import InvalidRequestError
from specdecode.sampling import SamplingParams
from specdecode.tree import TreeShape

# root 9; children 1 (node 1) and 2 (node 2); node 1 has children 3 (node 3) and 4 (node 4)
HEAD = DraftProposal(TreeShape((-1, 0, 0, 1, 1)), [9, 1, 2, 3, 4])


def test_graft_follows_shared_nodes_then_appends():
    out = graft(HEAD, [1, 4, 7, 8])
    assert out.tokens == [9, 1, 2, 3, 4, 7, 8]
    assert out.shape.parents == (-1, 0, 0, 1, 1, 4, 5)


def test_graft_of_a_new_first_token_hangs_off_the_root():
    out = graft(HEAD, [5, 1])
    assert out.tokens == [9, 1, 2, 3, 4, 5, 1]
    assert out.shape.parents == (-1, 0, 0, 1, 1, 0, 5)


def test_graft_inside_the_tree_or_empty_changes_nothing():
    assert graft(HEAD, [1, 3]) is HEAD
    assert graft(HEAD, []) is HEAD
    chain = graft(DraftProposal.empty(9), [4, 4, 4])
    assert chain.shape.parents == (-1, 0, 1, 2) and chain.tokens == [9, 4, 4, 4]


def test_siblings_stay_distinct_after_a_graft():
    out = graft(HEAD, [2, 2, 2])
    for kids in out.shape.children:
        toks = [out.tokens[c] for c in kids]
        assert len(toks) == len(set(toks))


class _FixedHead(Drafter):
    """Proposes HEAD's tree for every request; records what it hears."""

    def __init__(self):
        self.heard = []

    def max_nodes(self, k: int) -> int:
        return 4

    def propose(self, seqs, budgets):
        return [
            DraftProposal(HEAD.shape, [s.last_token] + HEAD.tokens[1:])
            if k
            else DraftProposal.empty(s.last_token)
            for s, k in zip(seqs, budgets, strict=True)
        ]

    def on_verified(self, seqs, proposals, accepted):
        self.heard.append(([len(p.tokens) for p in proposals], accepted))


def _seq(tokens: list[int]) -> Sequence:
    return Sequence(tokens, SamplingParams(temperature=0))


def test_the_head_hears_only_its_own_nodes_and_the_branch_is_counted():
    head = _FixedHead()
    drafter = LookupBranchDrafter(head, num_tokens=3, prompt_lookup_min=2, prompt_lookup_max=2)
    # "5 6" occurred before, followed by 1 4 8: the branch shares 1 -> 4 with the head, adds 8
    seq = _seq([5, 6, 1, 4, 8, 0, 5, 6])
    (prop,) = drafter.propose([seq], [3])
    assert prop.tokens == [6, 1, 2, 3, 4, 8]
    assert drafter.max_nodes(3) == 7
    drafter.on_verified([seq], [prop], [[1, 4, 5]])  # 1, 4 (the head's), then 8 (grafted)
    assert head.heard == [([5], [[1, 4]])]
    assert drafter.branch_stats.as_dict() == {
        "steps": 1,
        "drafted": 1,
        "accepted": 1,
        "head_skipped": 0,
    }
    drafter.release(seq)
    assert drafter.tracked_ids() == set()


def test_no_branch_without_a_budget_and_within_the_room():
    head = _FixedHead()
    drafter = LookupBranchDrafter(head, 5, 1, 3, room=lambda seq, k: min(k, 2))
    seq = _seq([7, 1, 2, 3, 7])
    (prop,) = drafter.propose([seq], [0])
    assert prop.tokens == [7]
    (prop,) = drafter.propose([seq], [2])  # 7 was followed by 1 2 3: the room allows 1 2
    assert prop.tokens == [7, 1, 2, 3, 4, 2]  # 1 is the head's node 1; 2 goes under it
    assert prop.shape.parents == (-1, 0, 0, 1, 1, 1)
    drafter.release(seq)
    assert drafter.tracked_ids() == set()


def test_a_short_cache_cuts_the_branch_before_the_heads_tree():
    """A request given fewer cache slots than the head's tree and the whole branch keeps the
    head's depth and a branch cut to what the tree leaves (it drafted nothing before)."""
    head = _FixedHead()  # a tree of 4 nodes at every depth
    drafter = LookupBranchDrafter(head, num_tokens=3, prompt_lookup_min=2, prompt_lookup_max=2)
    assert drafter.fit(3, 7) == 3 and drafter.fit(3, 5) == 3 and drafter.fit(3, 3) == 0
    seq = _seq([5, 6, 1, 4, 8, 0, 5, 6])  # the branch: 1 -> 4 (the head's nodes), then 8
    for slots, tokens in ((7, [6, 1, 2, 3, 4, 8]), (6, [6, 1, 2, 3, 4]), (4, [6, 1, 2, 3, 4])):
        drafter.slots = {seq.seq_id: slots}
        (prop,) = drafter.propose([seq], [3])
        assert prop.tokens == tokens and prop.num_drafts <= slots
    drafter.release(seq)


class _Clock:
    """The drafter's clock in these tests: it moves only when a fake head says it drafted, so
    the skip decisions do not depend on how loaded the machine is."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self):
        return self.now


@pytest.fixture(autouse=True)
def clock(monkeypatch):
    c = _Clock()
    monkeypatch.setattr("specdecode.drafters.lookup_branch.time", c)
    _CountingHead.clock = c
    return c


class _CountingHead(_FixedHead):
    clock: _Clock

    def __init__(self):
        super().__init__()
        self.budgets = []

    def propose(self, seqs, budgets):
        self.budgets.append(list(budgets))
        self.clock.now += 0.002 * sum(1 for k in budgets if k)  # the head's time: 2 ms a request
        return super().propose(seqs, budgets)


def _run(drafter, seq, steps, path_of, bonus=5):
    """Propose, verify (`path_of`: the nodes kept), append what the step emitted: the kept
    tokens and the target's own next token."""
    for _ in range(steps):
        (prop,) = drafter.propose([seq], [3])
        path = path_of(prop)
        drafter.on_verified([seq], [prop], [path])
        seq.output_token_ids.extend([prop.tokens[n] for n in path] + [bonus])


@pytest.fixture
def fixed_lookup(monkeypatch):
    """Lookup always continues with 6 7 8 9 (none of it in the head's tree), whatever the
    steps appended: these tests are about when the head runs, not about lookup."""
    fixed = [6, 7, 8, 9]
    monkeypatch.setattr(
        "specdecode.drafters.lookup_branch.lookup", lambda ctx, lo, hi, k: fixed[:k]
    )


def test_the_head_is_skipped_while_lookup_alone_does_as_well_and_still_probed(fixed_lookup):
    head = _CountingHead()
    # a 10 ms target step: the head's ~2 ms must add more than a fifth of what lookup gives
    drafter = LookupBranchDrafter(head, 4, 1, 2, step_time=lambda n: 0.010)
    seq = _seq([5, 6, 7, 8, 9, 5])  # lookup: 5 -> 6 7 8 9, none of it the head's tree

    def grafted(prop):  # the branch's nodes (tokens 6-9; the head's are 1-4), all kept
        return [n for n, t in enumerate(prop.tokens) if n and t in (6, 7, 8, 9)]

    _run(drafter, seq, 40, grafted)
    ran = [b[0] > 0 for b in head.budgets]
    assert ran[0]  # nothing measured yet: the head runs
    skipped = ran[10:].count(False)
    assert skipped >= 24 and ran[10:].count(True) >= 3  # mostly skipped, probed every 8th
    assert drafter.branch_stats.head_skipped == ran.count(False)
    # a new request starts from what the earlier one measured: no first run of the head (for
    # a draft model, a prefill of the whole prompt) where copying has been the rule
    head.budgets.clear()
    _run(drafter, _seq([5, 6, 7, 8, 9, 5]), 3, grafted)
    assert [b[0] for b in head.budgets] == [0, 0, 0]
    # skipped, the head leaves the branch every slot: 4 of them hold the whole chain (beside
    # the head's 4-node tree it would have had none)
    short = _seq([5, 6, 7, 8, 9, 5])
    drafter.slots = {short.seq_id: 4}
    (prop,) = drafter.propose([short], [3])
    assert head.budgets[-1] == [0] and prop.tokens == [5, 6, 7, 8, 9]
    drafter.slots = None

    # the head's path wins every step instead: it keeps running
    head2 = _CountingHead()
    drafter = LookupBranchDrafter(head2, 4, 1, 2, step_time=lambda n: 0.010)
    _run(drafter, seq, 20, lambda prop: [1, 3])  # the head's nodes 1 -> 3, the branch missed
    _run(drafter, _seq([5, 6, 7, 8, 9, 5]), 3, lambda prop: [1, 3])  # and for a new request
    assert len(head2.budgets) == 23 and all(b[0] > 0 for b in head2.budgets)
    assert drafter.branch_stats.head_skipped == 0


def test_config_accepts_the_branch_for_heads_and_draft_models():
    for method in ("eagle3", "draft_model"):
        cfg = SpeculativeConfig(method=method, prompt_lookup_tokens=8)
        assert cfg.prompt_lookup_tokens == 8
    with pytest.raises(InvalidRequestError, match="methods draft_model, medusa, eagle, eagle3"):
        SpeculativeConfig(method="ngram", prompt_lookup_tokens=4)
    for bad in (0, -1, 2.5, True):
        with pytest.raises(InvalidRequestError, match="positive integer"):
            SpeculativeConfig(method="eagle", prompt_lookup_tokens=bad)
    cfg = SpeculativeConfig(method="eagle3", prompt_lookup_tokens=8, prompt_lookup_method="suffix")
    assert cfg.prompt_lookup_method == "suffix"
    with pytest.raises(InvalidRequestError, match="'ngram' or 'suffix'"):
        SpeculativeConfig(method="eagle3", prompt_lookup_tokens=8, prompt_lookup_method="tree")
    with pytest.raises(InvalidRequestError, match="needs prompt_lookup_tokens"):
        SpeculativeConfig(method="eagle3", prompt_lookup_method="suffix")
    with pytest.raises(InvalidRequestError, match="min_token_prob"):
        SpeculativeConfig(
            method="eagle3",
            prompt_lookup_tokens=8,
            prompt_lookup_method="suffix",
            suffix_decoding_min_token_prob=-0.1,
        )


class _SamplingHead(_CountingHead):
    """A drafter that samples its drafts (a draft model): HEAD's tree with a q row per node."""

    samples_drafts = True

    def propose(self, seqs, budgets):
        props = super().propose(seqs, budgets)
        return [
            DraftProposal(p.shape, p.tokens, torch.full((len(p.tokens), 16), 1 / 16))
            if p.num_drafts
            else p
            for p in props
        ]


def test_a_sampling_drafter_takes_the_branch_on_greedy_rows_and_runs_alone_otherwise(
    fixed_lookup,
):
    """Drafts sampled from q take no deterministic sibling: a sampled request's step verifies
    the drafter's own proposal (q kept) or, once the lookup does as well for the time, the
    lookup chain alone (no q); a greedy request's is grafted (q dropped: argmax verification)."""
    head = _SamplingHead()
    drafter = LookupBranchDrafter(head, 4, 1, 2, step_time=lambda n: 0.010)
    assert drafter.samples_drafts and drafter.lite_depth == 4
    tokens = [5, 6, 7, 8, 9, 5]  # lookup: 5 -> 6 7 8 9, none of it the head's tree
    hot, cold = Sequence(tokens, SamplingParams(temperature=1.0)), _seq(tokens)
    p_hot, p_cold = drafter.propose([hot, cold], [3, 3])
    assert p_hot.tokens == [5, 1, 2, 3, 4] and p_hot.draft_probs is not None
    assert p_cold.tokens == [5, 1, 2, 3, 4, 6, 7, 8, 9] and p_cold.draft_probs is None
    # the greedy row keeps the lookup's tokens (the grafted nodes); the sampled row keeps two
    # of its drafts (1, 3), and the target's own token is not the lookup's either
    drafter.on_verified([hot, cold], [p_hot, p_cold], [[1, 3], [5, 6, 7, 8]])
    hot.output_token_ids.extend([1, 3, 0])
    cold.output_token_ids.extend([6, 7, 8, 9, 5])
    assert head.heard[-1] == ([5, 5], [[1, 3], []])
    # from then on its drafts keep being rejected, and the target emits the lookup's tokens
    # (all four accepted where the lookup chain is verified alone): the drafter stops
    # running for it (probing now and then) and the lookup runs alone
    seen = []
    for _ in range(16):
        (prop,) = drafter.propose([hot], [3])
        sampled = prop.draft_probs is not None
        seen.append((head.budgets[-1] == [3], prop.tokens, sampled))
        drafter.on_verified([hot], [prop], [[] if sampled else [1, 2, 3, 4]])
        hot.output_token_ids.extend([6] if sampled else [6, 7, 8, 9, 5])
    ran = [r for r, _, _ in seen]
    assert ran[0] and ran.count(False) >= 8 and ran[8:].count(True) >= 1
    assert drafter._req[hot.seq_id].alone > 4  # the lookup alone emits ~5 tokens a step
    for r, tokens, has_q in seen:
        assert (tokens[1:], has_q) == (([1, 2, 3, 4], True) if r else ([6, 7, 8, 9], False))
    assert drafter.branch_stats.head_skipped == ran.count(False)


def test_the_shadow_is_the_lookup_alone_and_leaves_no_state():
    """What the controller scores for a request it keeps plain: the branch's chain, the head
    not run, nothing remembered (a later real step is unaffected)."""
    head = _FixedHead()
    drafter = LookupBranchDrafter(head, num_tokens=3, prompt_lookup_min=2, prompt_lookup_max=2)
    assert drafter.shadow_capable and not drafter.stateless
    seq, other = _seq([5, 6, 1, 4, 8, 0, 5, 6]), _seq([1, 2, 3])
    shadow, none = drafter.shadow([seq, other], [3, 3])
    assert shadow.tokens == [6, 1, 4, 8] and shadow.shape.parents == (-1, 0, 1, 2)
    assert none.tokens == [3] and none.num_drafts == 0
    assert drafter.tracked_ids() == set() and drafter.branch_stats.as_dict()["head_skipped"] == 0
    (prop,) = drafter.propose([seq], [3])
    assert prop.tokens == [6, 1, 2, 3, 4, 8]


def test_stateful_drafters_cannot_shadow():
    with pytest.raises(NotImplementedError, match="shadow"):
        _FixedHead().shadow([_seq([1, 2])], [2])


def test_a_sampled_step_is_scored_against_the_tokens_it_emitted(fixed_lookup):
    """Where a draft model's sampled chain ran without the graft, what the lookup alone would
    have kept is read from the tokens the step emitted (a draw from the target's distribution
    either way), the target's own last token included: a rejected draft followed by the
    lookup's token counts for the lookup, not for the drafter. A request's first observation
    replaces the drafter-wide prior it started from; later ones are averaged in."""
    head = _SamplingHead()
    drafter = LookupBranchDrafter(head, 4, 1, 2, step_time=lambda n: 1.0)  # the head pays
    seq = Sequence([5, 6, 7, 8, 9, 5], SamplingParams(temperature=1.0))
    (prop,) = drafter.propose([seq], [3])
    assert prop.draft_probs is not None and prop.tokens[1:] == [1, 2, 3, 4]
    drafter.on_verified([seq], [prop], [[1, 3]])  # drafts 1, 3 kept ...
    st = drafter._req[seq.seq_id]
    assert (st.alone, st.head_gain) == (1.0, 1.0)  # scored once the tokens are appended
    seq.output_token_ids.extend([1, 3, 6])  # ... then the target's 6: the lookup kept nothing
    (prop,) = drafter.propose([seq], [3])
    assert (st.alone, st.head_gain) == (1.0, 2.0)  # the first observation, as it came
    assert prop.draft_probs is not None
    drafter.on_verified([seq], [prop], [[]])  # every draft rejected ...
    seq.output_token_ids.extend([6, 7])  # the target's token: the lookup's first (+ a forced one)
    (prop,) = drafter.propose([seq], [3])
    assert st.alone == pytest.approx(1.0 + 0.3 * (2 - 1.0))  # the lookup alone: 1 kept, 2 emitted
    assert st.head_gain == pytest.approx(2.0 + 0.3 * (-1 - 2.0))  # the draft model: 1 fewer
    assert prop.draft_probs is not None  # (1.1 tokens for its time: it still pays)
    drafter.on_verified([seq], [prop], [[1]])
    seq.output_token_ids.extend([1, 6])
    before = (st.alone, st.head_gain)
    drafter.release(seq)  # a finished request's last step is scored too
    assert st.alone == pytest.approx(before[0] + 0.3 * (1 - before[0]))
    assert st.head_gain == pytest.approx(before[1] + 0.3 * (1 - before[1]))
    assert drafter.tracked_ids() == set()
    # a new request starts from the prior; a step whose tokens never came (the request
    # failed) is not scored
    seq2 = Sequence([5, 6, 7, 8, 9, 5], SamplingParams(temperature=1.0))
    (prop,) = drafter.propose([seq2], [3])
    st2 = drafter._req[seq2.seq_id]
    prior = (drafter._prior.alone, drafter._prior.head_gain)
    assert (st2.alone, st2.head_gain) == prior != (1.0, 1.0)
    drafter.on_verified([seq2], [prop], [[]])
    drafter.propose([seq2], [3])
    assert (st2.alone, st2.head_gain) == prior


def test_a_lookup_miss_without_the_head_runs_the_head_next(fixed_lookup):
    """A request that starts from code traffic's prior (lookup alone does as well) skips the
    head on its first lookup step; once the lookup alone keeps nothing, the head runs on the
    next, and what it adds there, not the prior, decides the steps after."""
    head = _CountingHead()
    drafter = LookupBranchDrafter(head, 4, 1, 2, step_time=lambda n: 0.010)
    drafter._head_seconds = 0.002  # measured on earlier requests
    drafter._prior.alone, drafter._prior.head_gain = 6.0, 0.0
    seq = _seq([5, 6, 7, 8, 9, 5])
    (prop,) = drafter.propose([seq], [3])
    assert head.budgets[-1] == [0] and prop.tokens[1:] == [6, 7, 8, 9]  # the prior: skipped
    drafter.on_verified([seq], [prop], [[]])
    seq.output_token_ids.append(0)  # the lookup's first token rejected
    (prop,) = drafter.propose([seq], [3])
    assert head.budgets[-1] == [3]  # a miss: the head runs
    drafter.on_verified([seq], [prop], [[1, 3]])  # and its drafts are kept
    seq.output_token_ids.extend([1, 3, 0])
    drafter.propose([seq], [3])
    assert head.budgets[-1] == [3]
    st = drafter._req[seq.seq_id]
    assert (st.alone, st.head_gain) == (1.0, 2.0)  # its own observations, not the prior's
    # a request whose lookup keeps a token a step (no miss): the head is taken to add what the
    # lookup falls short of earlier requests' total (6 tokens a step), and runs
    seq2 = _seq([5, 6, 7, 8, 9, 5])
    drafter._prior.alone, drafter._prior.head_gain = 6.0, 0.0
    (prop,) = drafter.propose([seq2], [3])
    assert head.budgets[-1] == [0]  # the prior: skipped
    drafter.on_verified([seq2], [prop], [[1]])
    seq2.output_token_ids.extend([6, 0])
    drafter.propose([seq2], [3])
    assert head.budgets[-1] == [3]
    # the same request on code-like traffic (the lookup kept as much as before): skipped again
    seq3 = _seq([5, 6, 7, 8, 9, 5])
    drafter._prior.alone, drafter._prior.head_gain = 5.0, 0.0
    (prop,) = drafter.propose([seq3], [3])
    drafter.on_verified([seq3], [prop], [[1, 2, 3, 4]])
    seq3.output_token_ids.extend([6, 7, 8, 9, 5])
    drafter.propose([seq3], [3])
    assert head.budgets[-2:] == [[0], [0]]


def test_a_censored_or_cut_short_step(fixed_lookup):
    """A sampled step whose every emitted token matched the lookup: the chain alone would have
    gone on, so the running estimate stands in for what the step did not show; a step cut short
    by a stop is not scored."""
    head = _SamplingHead()
    drafter = LookupBranchDrafter(head, 4, 1, 2, step_time=lambda n: 1.0)
    seq = Sequence([5, 6, 7, 8, 9, 5], SamplingParams(temperature=1.0))
    (prop,) = drafter.propose([seq], [3])
    st = drafter._req[seq.seq_id]
    st.alone, st.seen_alone = 4.0, 3  # the lookup alone has been emitting 4 tokens a step
    drafter.on_verified([seq], [prop], [[]])  # the draft rejected, the target's token is 6
    seq.output_token_ids.append(6)
    drafter.propose([seq], [3])
    assert st.alone == pytest.approx(4.0)  # seen: >= 1 kept; taken: 3 kept, 4 emitted
    assert st.head_gain == pytest.approx(0 - 3)  # the draft model: 3 fewer (first own measure)
    st.head_gain = 5.0  # (so that the draft model runs)
    (prop,) = drafter.propose([seq], [3])
    before = (st.alone, st.head_gain)
    assert prop.draft_probs is not None
    drafter.on_verified([seq], [prop], [[1, 3]])
    seq.output_token_ids.extend([1])  # a stop after its first token
    drafter.release(seq)
    assert (st.alone, st.head_gain) == before


def test_the_chain_is_cut_where_its_next_node_no_longer_pays(monkeypatch):
    """A step costs 10 ms + 2 ms a fed token, so a chain node pays while P(kept) > 2/12. The
    target keeps the first 2 of the lookup's 6 tokens: the chain is cut to 2. Scored against
    what the steps emitted, the cut chain still learns when its next token starts to hold,
    and grows back; a chain the target keeps whole is never cut."""
    chain = [6, 7, 8, 9, 10, 11]
    monkeypatch.setattr(
        "specdecode.drafters.lookup_branch.lookup", lambda ctx, lo, hi, k: chain[:k]
    )

    def step(n):
        return 0.010 + 0.002 * n

    def run(drafter, seq, steps, keep, bonus):
        lengths = []
        for _ in range(steps):
            (prop,) = drafter.propose([seq], [3])
            lengths.append(sum(1 for t in prop.tokens[1:] if t in chain))
            path = [n for n, t in enumerate(prop.tokens) if n and t in chain[:keep]]
            drafter.on_verified([seq], [prop], [path])
            seq.output_token_ids.extend([prop.tokens[n] for n in path] + [bonus])
        return lengths

    drafter = LookupBranchDrafter(_FixedHead(), 6, 1, 2, step_time=step)
    seq = _seq([5, 6, 5])
    got = run(drafter, seq, 10, keep=2, bonus=5)  # the third token is never the target's
    assert got[0] == 6 and got[-1] == 2, got  # nothing measured: the whole chain
    got = run(drafter, seq, 10, keep=2, bonus=8)  # now the target's next token is the chain's
    assert got[0] == 2 and got[-1] == 6, got
    assert drafter.chain_rates(seq, 3)[2] > 0.5

    drafter = LookupBranchDrafter(_FixedHead(), 6, 1, 2, step_time=step)
    assert run(drafter, _seq([5, 6, 5]), 10, keep=6, bonus=5) == [6] * 10
    # without a step-cost curve nothing is cut
    drafter = LookupBranchDrafter(_FixedHead(), 6, 1, 2)
    assert run(drafter, _seq([5, 6, 5]), 10, keep=2, bonus=5) == [6] * 10


def test_a_chain_not_worth_verifying_alone_does_not_skip_the_head(fixed_lookup):
    """Each fed token costs 50 ms against a 60 ms step, so a chain node pays only where the
    target keeps it more than 5 times in 6; it keeps lookup's first token every other step.
    The head adds nothing (its nodes are never kept), so the skip rule alone would skip it, and
    the chain cut to nothing would leave the step without drafts: the head runs instead. Every
    16th cut chain is verified whole (the cost curve at the sizes cut steps no longer visit)."""
    head = _CountingHead()
    drafter = LookupBranchDrafter(head, 4, 1, 2, step_time=lambda n: 0.010 + 0.050 * n)
    seq = _seq([5, 6, 7, 8, 9, 5])
    grafted, drafts, steps = [], [], [0]

    def half(prop):  # the chain's first token, kept every other step
        steps[0] += 1
        drafts.append(prop.num_drafts)
        grafted.append(sum(1 for t in prop.tokens[1:] if t in (6, 7, 8, 9)))
        first = [n for n, t in enumerate(prop.tokens) if n and t == 6]
        return first if steps[0] % 2 else []

    _run(drafter, seq, 40, half)
    assert min(drafts) > 0, (drafts, grafted)  # never a step without drafts
    assert all(b[0] > 0 for b in head.budgets[5:])  # the head runs once the chain is cut
    assert grafted[0] == 4  # nothing measured yet: the whole chain
    whole = [i for i, n in enumerate(grafted) if i and n == 4]
    assert whole == [16, 32] and all(n <= 1 for i, n in enumerate(grafted[1:], 1) if i not in whole)
