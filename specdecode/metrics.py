"""Speculative-decoding counters, per request and in aggregate (named as vLLM's metrics)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodeStats:
    num_drafts: int = 0  # verification steps that had at least one draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # [k] accepted at depth i+1
    drafted_per_position: list[int] = field(default_factory=list)  # [k] steps reaching depth i+1
    # levels the drafter ran (what its drafting time is spent on, `Drafter.drafted_depth`): a
    # dynamic tree runs deeper than it keeps, a lookup branch verified alone runs none
    drafted_levels: int = 0

    def record(self, num_drafted: int, depth: int, num_accepted: int) -> None:
        """One verification: `num_drafted` nodes in a tree of `depth`, `num_accepted` kept."""
        if num_drafted == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        for lst, n in (
            (self.drafted_per_position, depth),
            (self.accepted_per_position, num_accepted),
        ):
            if len(lst) < depth:
                lst.extend([0] * (depth - len(lst)))
            for i in range(n):
                lst[i] += 1

    def merge(self, other: SpecDecodeStats) -> None:
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        self.drafted_levels += other.drafted_levels
        for mine, theirs in (
            (self.accepted_per_position, other.accepted_per_position),
            (self.drafted_per_position, other.drafted_per_position),
        ):
            if len(mine) < len(theirs):
                mine.extend([0] * (len(theirs) - len(mine)))
            for i, n in enumerate(theirs):
                mine[i] += n

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens / drafted tokens."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """tau: tokens emitted per verification step (accepted + the recovered/bonus one)."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    def as_dict(self) -> dict:
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "acceptance_rate": self.acceptance_rate,
            "mean_acceptance_length": self.mean_acceptance_length,
            # vLLM's: accepted at depth i+1 over all drafting steps (it falls with depth, as
            # tau = 1 + its sum)
            "acceptance_by_position": [
                a / self.num_drafts if self.num_drafts else 0.0 for a in self.accepted_per_position
            ],
            # over the steps that drafted that deep (an adaptive depth drafts some shallower):
            # how good the drafts at that depth were, where there were any
            "acceptance_by_position_when_drafted": [
                a / d if d else 0.0
                for a, d in zip(self.accepted_per_position, self.drafted_per_position, strict=True)
            ],
        }
