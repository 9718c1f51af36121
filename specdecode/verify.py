"""Lossless verification of draft chains and trees, batched.

Notation (Leviathan et al. 2023; Chen et al. 2023): p is the TARGET distribution, q the DRAFT
distribution; both are `warp`ed with the request's own temperature, top-k and top-p.

Glossary
- accepted token: a draft token the target keeps.
- recovered (residual) token: after a rejection, a token drawn from the residual distribution,
  which makes up exactly for the mass the draft over-proposed.
- bonus token: when every draft on the way to a leaf is accepted, one more token drawn from p at
  the leaf. Every step therefore emits (accepted + 1) tokens.

Two rules, both lossless, chosen by whether the drafter reports q:
- sampled drafts (q given; siblings drawn i.i.d. from their parent's q): accept x with
  probability min(1, r(x) / q(x)); on rejection r <- normalize(max(r - q, 0)) and try the next
  sibling (SpecInfer's multi-round rejection sampling; for a chain this is the classic rule).
- deterministic drafts (q is None: argmax or top-k candidates, q treated as one-hot): accept x
  with probability r(x); on rejection r(x) <- 0, renormalize, try the next sibling.
r starts as p at the current node. If no child is accepted, the step ends with a token drawn from
r (recovered, or bonus at a leaf). Greedy requests need no special case: their p is one-hot on
the argmax, so both rules accept exactly the argmax child and otherwise emit the argmax.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdecode.sampling import sample
from specdecode.tree import TreeShape


@dataclass
class DraftBatch:
    """Draft trees of B requests, padded to N nodes and C children per node."""

    tokens: torch.Tensor  # [B, N] long, token at each node (node 0: the root, already decided)
    children: torch.Tensor  # [B, N, C] long, children in sibling order, -1 = none
    num_nodes: list[int]  # [B] real nodes per request
    draft_probs: torch.Tensor | None = None  # [B, N, V] q at each node for its children; None:
    # deterministic drafts

    @classmethod
    def from_trees(
        cls,
        shapes: list[TreeShape],
        tokens: list[list[int]],
        draft_probs: list[torch.Tensor] | None = None,
    ) -> DraftBatch:
        """Pad per-request trees (`draft_probs[i]`: [n_i, V]) into one batch."""
        b = len(shapes)
        n = max(len(s) for s in shapes)
        c = max(1, max(len(k) for s in shapes for k in s.children))
        tok = torch.zeros(b, n, dtype=torch.long)
        kids = torch.full((b, n, c), -1, dtype=torch.long)
        for i, (shape, t) in enumerate(zip(shapes, tokens, strict=True)):
            tok[i, : len(t)] = torch.tensor(t, dtype=torch.long)
            for node, ch in enumerate(shape.children):
                kids[i, node, : len(ch)] = torch.tensor(ch, dtype=torch.long)
        q = None
        if draft_probs is not None:
            v = draft_probs[0].shape[-1]
            q = torch.zeros(b, n, v, device=draft_probs[0].device)
            for i, probs in enumerate(draft_probs):
                q[i, : probs.shape[0]] = probs
        return cls(tok, kids, [len(s) for s in shapes], q)


@dataclass
class VerifyResult:
    accepted: list[list[int]]  # [B] accepted node indices, root excluded, in path order
    tokens: list[list[int]]  # [B] emitted tokens: accepted drafts + one recovered/bonus token

    @property
    def num_accepted(self) -> list[int]:
        return [len(a) for a in self.accepted]


def verify(
    target_probs: torch.Tensor,  # [B, N, V] p at every node (warped, as the request samples)
    drafts: DraftBatch,
    generators: list[torch.Generator | None] | None = None,  # [B] per-request RNG
) -> VerifyResult:
    b, n, v = target_probs.shape
    device = target_probs.device
    rows = torch.arange(b, device=device)
    children = drafts.children.to(device)
    tokens = drafts.tokens.to(device)
    q_all = drafts.draft_probs.to(device) if drafts.draft_probs is not None else None
    max_depth, c = n, children.shape[-1]
    uniforms = _uniforms(b, max_depth * c, generators, device).view(b, max_depth, c)

    cur = torch.zeros(b, dtype=torch.long, device=device)
    residual = target_probs[:, 0].clone()
    active = torch.ones(b, dtype=torch.bool, device=device)
    accepted: list[list[int]] = [[] for _ in range(b)]
    final = torch.zeros(b, dtype=torch.long, device=device)
    for depth in range(max_depth):
        chosen = torch.full((b,), -1, dtype=torch.long, device=device)
        q = q_all[rows, cur] if q_all is not None else None  # [B, V]
        for j in range(c):
            child = children[rows, cur, j]
            live = active & (child >= 0) & (chosen < 0)
            if not live.any():
                break
            x = tokens[rows, child.clamp(min=0)]
            rx = residual[rows, x]
            if q is None:
                accept_prob = rx
            else:
                qx = q[rows, x]
                accept_prob = torch.where(qx > 0, (rx / qx.clamp(min=1e-30)).clamp(max=1.0), 0.0)
            take = live & (uniforms[:, depth, j] < accept_prob)
            chosen = torch.where(take, child, chosen)
            reject = live & ~take
            if reject.any():
                residual = _reject(residual, reject, x, q)
        moved = chosen >= 0
        stop = active & ~moved
        if stop.any():
            final[stop] = _sample_rows(residual[stop], _subset(generators, stop))
        picked = chosen.tolist()  # (one device-to-host copy a depth, not one per row)
        for i in torch.nonzero(moved).flatten().tolist():
            accepted[i].append(picked[i])
        active = moved
        if not active.any():
            break
        cur = torch.where(moved, chosen, cur)
        residual = torch.where(moved[:, None], target_probs[rows, cur], residual)
    token_rows, finals = tokens.tolist(), final.tolist()  # (one copy each, not one a token)
    out_tokens = [[token_rows[i][node] for node in accepted[i]] + [finals[i]] for i in range(b)]
    return VerifyResult(accepted, out_tokens)


def verify_choices(
    shapes: list[TreeShape], tokens: list[list[int]], target_choice: list[list[int]]
) -> VerifyResult:
    """Verification of deterministic drafts by the target's own choice at each node
    (`target_choice[i][node]`): follow the child whose token the target chose, from the root;
    the first node with no such child (or a leaf) ends the path with the target's choice.

    - Greedy: the choice is the argmax. Identical to `verify` with one-hot p.
    - Sampling: the choice is a draw from p at the node whose randomness is that of the node's
      sequence position (`sampling.position_draws`). Every emitted token is then a draw
      from p at its position, so the output is distributed exactly as the target's; a child is
      accepted with probability p(child), as in the deterministic rule of `verify`. And because
      plain decoding draws with the same randomness, a seeded request gives the same tokens with
      or without speculation, whatever the batch or the draft depth the controller picked, as
      long as p agrees (fp32 here, to ~1e-5: the draw moves only where its two best scores are
      that close; a near-tie can flip in bf16)."""
    accepted, emitted = [], []
    for shape, toks, best in zip(shapes, tokens, target_choice, strict=True):
        kids = shape.children
        path, node = [], 0
        while True:
            nxt = next((c for c in kids[node] if toks[c] == best[node]), None)
            if nxt is None:
                break
            path.append(nxt)
            node = nxt
        accepted.append(path)
        emitted.append([toks[c] for c in path] + [best[node]])
    return VerifyResult(accepted, emitted)


def _reject(
    residual: torch.Tensor, rows: torch.Tensor, x: torch.Tensor, q: torch.Tensor | None
) -> torch.Tensor:
    """Residual after rejecting token x in the rows `rows`."""
    if q is None:
        new = residual.scatter(1, x[:, None], 0.0)
    else:
        new = (residual - q).clamp(min=0.0)
    total = new.sum(-1, keepdim=True)
    # A zero residual means r == q: rejection had probability 0; keep r (float safety only).
    new = torch.where(total > 0, new / total.clamp(min=1e-30), residual)
    return torch.where(rows[:, None], new, residual)


def _uniforms(b, k, generators, device) -> torch.Tensor:
    if generators is None or all(g is None for g in generators):
        return torch.rand(b, k, device=device)
    return torch.stack([torch.rand(k, generator=g, device=device) for g in generators])


def _subset(generators, mask: torch.Tensor):
    if generators is None:
        return None
    return [g for g, m in zip(generators, mask.tolist(), strict=True) if m]


def _sample_rows(probs: torch.Tensor, generators) -> torch.Tensor:
    """One draw per row; rows with their own generator draw from it."""
    if generators is None or all(g is None for g in generators):
        return sample(probs, None)
    return torch.cat([sample(p[None], g) for p, g in zip(probs, generators, strict=True)])
