"""The protocol every drafter implements.

A drafter proposes, for each request that is decoding, a draft tree rooted at the request's last
decided token (see `tree.py`), optionally with the draft distribution q its tokens were drawn
from (for lossless verification of sampled drafts; None means deterministic drafts, e.g. argmax
or top-k candidates). After verification it hears what was accepted, so it can roll back its own
state (a draft model's KV cache) or learn (an n-gram table).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from specdecode.core import Sequence
from specdecode.processors import apply, has_penalties
from specdecode.tree import TreeShape


def penalize(
    logits: torch.Tensor,
    seqs: list[Sequence],
    histories: list[list[list[int]]],
    columns: torch.Tensor | None = None,
) -> torch.Tensor:
    """Draft logits under each request's logit bias and penalties, as the target's rows will be
    (`processors.apply`): the rows of `seqs[i]` come next, one per `histories[i]` entry (the
    drafts the row follows). `columns`: a draft vocabulary's (`processors.columns_of`). The
    logits are changed in place and returned; requests without penalties cost nothing."""
    r = 0
    for seq, hist in zip(seqs, histories, strict=True):
        if has_penalties(seq.params):
            apply(logits[r : r + len(hist)], seq, hist, columns)
        r += len(hist)
    return logits


@dataclass
class DraftProposal:
    shape: TreeShape
    tokens: list[int]  # [n] token at each node; tokens[0] is the root (the last decided token)
    draft_probs: torch.Tensor | None = None  # [n, V] q at each node for its children

    @property
    def num_drafts(self) -> int:
        return len(self.tokens) - 1

    @classmethod
    def empty(cls, root: int) -> DraftProposal:
        return cls(TreeShape.chain(0), [root])


class Drafter(ABC):
    """Proposes draft trees for a batch of decoding sequences."""

    #: True when proposals carry q (sampled drafts); False for deterministic drafts.
    samples_drafts: bool = False
    #: True when `propose` has no side effects (no state to roll back): the controller may then
    #: draft in shadow for requests that are not speculating and score the drafts later.
    stateless: bool = False
    #: True when `shadow` gives side-effect-free proposals (stateless drafters: `propose`).
    shadow_capable: bool = False
    #: > 0 when the shadow is a drafter in its own right, verified alone up to this depth
    #: (lite drafts: a head's lookup branch without the head; see the controller).
    lite_depth: int = 0
    #: True when proposals are often shorter than their budget or empty (lookup drafters):
    #: the controller then learns what a budget feeds and yields instead of pricing k nodes.
    variable_size: bool = False
    #: Target features this drafter reads (see `ModelRunner.feature_layers`); None: none.
    feature_layers: tuple[int, ...] | None = None
    #: Whether finished requests' answers are added to what it drafts from (a suffix corpus);
    #: benchmarks turn it off where the answers are those of prompts they measure next.
    learning: bool = True

    #: Cache slots each request's proposal may fill this step (seq_id -> slots), set by the
    #: engine before `propose`: a short cache gives fewer than `max_nodes` (see `fit`).
    slots: dict[int, int] | None = None

    def max_nodes(self, k: int) -> int:
        """Cache slots a proposal of depth at most k may need (beyond the root)."""
        return k

    def fit(self, k: int, slots: int) -> int:
        """The deepest draft, at most k levels, whose proposal fits `slots` cache slots (a
        cache short of blocks gives a request fewer than the full tree's)."""
        while k > 0 and self.max_nodes(k) > slots:
            k -= 1
        return k

    def depth_room(self, seq: Sequence, k: int) -> int:
        """The deepest draft, at most k, this drafter can propose for `seq` (its own limits:
        a draft model's context); the controller plans no deeper."""
        return k

    def expected_nodes(self, k: int) -> float:
        """Draft nodes a proposal of depth k feeds on average: what the controller prices a
        request's drafts at (`max_nodes` unless a drafter's trees vary in size)."""
        return self.max_nodes(k)

    def drafted_depth(self, seq: Sequence, proposal: DraftProposal) -> int:
        """The depth this drafter spent drafting time on for `proposal` (its draft-cost model's
        input): the tree's depth unless part of it cost nothing to draft (a variable-size
        drafter's unit is what the controller prices its budgets in: see `_levels` there)."""
        return max(proposal.shape.depths)

    @abstractmethod
    def propose(self, seqs: list[Sequence], budgets: list[int]) -> list[DraftProposal]:
        """One proposal per sequence, no deeper than `budgets[i]` (0: no drafts) and with at
        most `max_nodes(k)` drafts. The root is `seq.last_token`; any other state the drafter
        needs is its own."""

    def shadow(self, seqs: list[Sequence], budgets: list[int]) -> list[DraftProposal]:
        """Proposals for requests that are not drafting this step, with no side effects: the
        controller scores them later against the real output (`shadow_capable` drafters), or
        has them verified as lite drafts (`lite_depth`); the drafter does not hear about
        those (`on_verified`)."""
        if not self.stateless:  # a drafter with state must say what its shadow is
            raise NotImplementedError(f"{type(self).__name__} cannot draft in shadow")
        return self.propose(seqs, budgets)

    def catch_up_tokens(self, seq: Sequence) -> int:
        """Tokens this drafter would process for `seq` before its first draft token, beyond
        the root (a draft model's prefill of what it has not seen); priced by the controller."""
        return 0

    def observe(self, seqs: list[Sequence], features: list[torch.Tensor]) -> None:
        """Every step (drafting or not; none under policy `off`, which captures no
        features), for drafters with `feature_layers`: `features[i]`
        [m, F] are the target's features at the m tokens sequence i committed to the cache
        this step, which sit at positions `seqs[i].blocks.length - m ...`."""

    def on_verified(
        self, seqs: list[Sequence], proposals: list[DraftProposal], accepted: list[list[int]]
    ) -> None:
        """`accepted[i]`: the draft nodes of proposal i the target kept, in path order."""

    def release(self, seq: Sequence) -> None:
        """The sequence finished or was aborted: drop its state."""

    def preempt(self, seq: Sequence) -> None:
        """The sequence was preempted and will be recomputed: drop what the recompute
        rebuilds (by default everything), keep what it must continue (a seeded random
        stream: restarting it would draw again the numbers its earlier drafts used)."""
        self.release(seq)

    def clear_history(self) -> None:
        """Forget what finished requests taught the drafter (a suffix corpus); most drafters
        keep nothing across requests."""

    def tracked_ids(self) -> set[int]:
        """Sequences this drafter holds state for (leak checks)."""
        return set()
