"""Token trees: parent lists -> ancestor masks, positions, root-to-leaf paths, children tables.

A draft tree for one request has n nodes in topological order (every parent before its children).
Node 0 is the root: the last token already decided (sampled but not yet in the KV cache). Nodes
1..n-1 are draft tokens. A chain of k drafts is the tree with parents [-1, 0, 1, ..., k-1].

Static trees come as Medusa/EAGLE-1 choice lists: each choice is the path of child ranks from
the root, e.g. [[0], [1], [0, 0]] = two children of the root (its top-1 and top-2 candidates)
and the top-1 child of the first.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch


@dataclass(frozen=True)
class TreeShape:
    """The structure of a draft tree, independent of its tokens."""

    parents: tuple[int, ...]  # [n] parent index, -1 for the root
    ranks: tuple[int, ...] = ()  # [n] for static trees: which top-k candidate fills the node

    def __post_init__(self) -> None:
        if not self.parents or self.parents[0] != -1:
            raise ValueError("node 0 must be the root (parent -1)")
        for i, p in enumerate(self.parents[1:], start=1):
            if not 0 <= p < i:
                raise ValueError(f"node {i} has parent {p}: parents must come before children")

    @classmethod
    def chain(cls, k: int) -> TreeShape:
        """A root and k drafts in a line."""
        return cls(tuple(range(-1, k)), tuple([0] * (k + 1)))

    @classmethod
    def from_choices(cls, choices: list[list[int]]) -> TreeShape:
        """Medusa/EAGLE-1 choice lists. Every prefix of a choice must itself be a choice."""
        ordered = sorted({tuple(c) for c in choices}, key=lambda c: (len(c), c))
        index = {(): 0}
        parents, ranks = [-1], [0]
        for c in ordered:
            if not c or any(r < 0 for r in c):
                raise ValueError(f"invalid tree choice {list(c)}")
            if c[:-1] not in index:
                raise ValueError(f"tree choice {list(c)} lacks its parent {list(c[:-1])}")
            index[c] = len(parents)
            parents.append(index[c[:-1]])
            ranks.append(c[-1])
        return cls(tuple(parents), tuple(ranks))

    def __len__(self) -> int:
        return len(self.parents)

    # Derived structure is computed once per shape (shapes are reused every step); callers must
    # not modify what these return.
    @cached_property
    def depths(self) -> list[int]:
        d = [0] * len(self.parents)
        for i, p in enumerate(self.parents[1:], start=1):
            d[i] = d[p] + 1
        return d

    @cached_property
    def children(self) -> list[list[int]]:
        kids: list[list[int]] = [[] for _ in self.parents]
        for i, p in enumerate(self.parents[1:], start=1):
            kids[p].append(i)
        return kids

    def ancestor_mask(self) -> torch.Tensor:  # [n, n] bool: node i may attend node j
        return self._ancestor_mask

    @cached_property
    def _ancestor_mask(self) -> torch.Tensor:
        n = len(self.parents)
        mask = torch.zeros(n, n, dtype=torch.bool)
        for i, p in enumerate(self.parents):
            if p >= 0:
                mask[i] = mask[p]
            mask[i, i] = True
        return mask

    def paths(self) -> list[list[int]]:
        """Root-to-leaf node lists."""
        kids = self.children
        out = []
        for leaf in (i for i in range(len(self.parents)) if not kids[i]):
            path, j = [], leaf
            while j >= 0:
                path.append(j)
                j = self.parents[j]
            out.append(path[::-1])
        return out

    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parents))
