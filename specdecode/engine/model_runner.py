"""Owns every tensor of a step: builds inputs and attention metadata, runs the model once for the
whole batch (prefill chunks, plain decodes and draft trees together), samples or verifies."""

from __future__ import annotations

import torch

from specdecode.cache import BlockManager, KVCache, keep_path
from specdecode.core import Sequence
from specdecode.drafters.base import DraftProposal
from specdecode.engine.scheduler import ScheduledBatch
from specdecode.models.attention import build_metadata
from specdecode.models.llama import LlamaModel
from specdecode.processors import apply as apply_penalties
from specdecode.processors import has_penalties, mask_stops, paths
from specdecode.sampling import position_draws, warp
from specdecode.verify import DraftBatch, VerifyResult, verify, verify_choices


class ModelRunner:
    def __init__(self, model: LlamaModel, cache: KVCache, manager: BlockManager) -> None:
        self.model = model
        self.cache = cache
        self.manager = manager
        self.device = model.norm.weight.device
        self._generators: dict[int, torch.Generator | None] = {}
        self._seeds: dict[int, int] = {}
        self.accepted_nodes: dict[int, list[int]] = {}
        # Target features, for drafters that read them (Medusa, EAGLE) and for data generation:
        # None = not captured; () = the final feature (input of the LM head); layer indices =
        # the residual streams entering those layers, concatenated (EAGLE-3), then the final.
        self.feature_layers: tuple[int, ...] | None = None
        # batch index -> [m, F] features of the m tokens this step committed to the cache, in
        # position order (a prefill chunk's tokens, a decode token, or a tree's accepted path)
        self.features: dict[int, torch.Tensor] = {}
        self.num_fed_tokens = 0  # tokens the last step fed to the model
        self.grammar = None  # () -> GrammarCompiler, set by the engine (structured output)
        # batch index -> per new token (logprob, top-n) for requests that ask for logprobs
        self.logprobs: dict[int, list] = {}
        self.eos_token_ids: set[int] = set()  # the stop tokens min_tokens holds back (set by
        # the engine; a request's own stop_token_ids are added)

    def generator(self, seq: Sequence) -> torch.Generator | None:
        if seq.seq_id not in self._generators:
            self._generators[seq.seq_id] = seq.params.make_generator(self.device)
        return self._generators[seq.seq_id]

    def sample_seed(self, seq: Sequence) -> int:
        """The request's seed, or one drawn once from the global RNG (seeded by the engine)."""
        if seq.seq_id not in self._seeds:
            seed = seq.params.seed
            if seed is None:
                seed = int(torch.randint(0, 2**62, (1,)))
            self._seeds[seq.seq_id] = seed
        return self._seeds[seq.seq_id]

    def release(self, seq: Sequence) -> None:
        self._generators.pop(seq.seq_id, None)
        self._seeds.pop(seq.seq_id, None)

    @torch.inference_mode()
    def run(
        self,
        batch: ScheduledBatch,
        proposals: list[DraftProposal | None] | None = None,
        samples_drafts: bool = False,
    ) -> list[list[int] | None]:
        """Feed each sequence its scheduled tokens, or its draft tree where `proposals[i]` is
        set. Return the tokens each sequence gains this step (None while a prompt is still being
        prefilled in chunks). The accepted draft nodes of the last step are in
        `self.accepted_nodes` (batch index -> node indices)."""
        proposals = proposals or [None] * len(batch)
        ids, positions, num_new, trees = [], [], [], []
        for seq, n, prop in zip(batch.seqs, batch.num_new, proposals, strict=True):
            start = seq.blocks.length
            if prop is None:
                ids += seq.token_ids(start, start + n)
                positions += range(start, start + n)
                num_new.append(n)
                trees.append(None)
            else:
                ids += prop.tokens
                positions += [start + d for d in prop.shape.depths]
                num_new.append(len(prop.tokens))
                trees.append(None if prop.shape.is_chain() else prop.shape.ancestor_mask())
        self.num_fed_tokens = len(ids)
        blocks = [s.blocks for s in batch.seqs]
        meta = build_metadata(self.cache.kv, self.manager, blocks, num_new, trees)
        out = self.model(
            torch.tensor(ids, device=self.device),
            torch.tensor(positions, device=self.device),
            meta,
            self.feature_layers or (),
        )
        self._prompt_logprobs(batch, proposals, num_new, out.hidden)
        result = self._postprocess(batch, proposals, num_new, out.hidden, samples_drafts)
        self.features = {}
        if self.feature_layers is not None:
            feats = torch.cat([*out.captured, out.hidden], -1) if out.captured else out.hidden
            start = 0
            for i, n in enumerate(num_new):
                rows = feats[start : start + n]
                if proposals[i] is not None:
                    rows = rows[[0, *self.accepted_nodes[i]]]
                self.features[i] = rows
                start += n
        return result

    def _prompt_logprobs(self, batch, proposals, num_new, hidden) -> None:
        """Where a prefill chunk's request wants its prompt's logprobs: each fed position's
        distribution scores the prompt token after it (positions already scored, before a
        preemption, are not scored again), a few hundred rows at a time."""
        start_row = 0
        for seq, n, prop in zip(batch.seqs, num_new, proposals, strict=True):
            rows, start_row = range(start_row, start_row + n), start_row + n
            if prop is not None or not seq.wants_prompt_logprobs:
                continue
            start = seq.blocks.length
            # position p scores prompt token p + 1; tokens 1..len(prompt_logprobs) are done
            first = max(start, len(seq.prompt_logprobs))
            last = min(start + n, len(seq.prompt_token_ids) - 1)
            for lo in range(first, last, 256):
                hi = min(last, lo + 256)
                picked = [rows[p - start] for p in range(lo, hi)]
                logits = self.model.compute_logits(hidden[picked])
                targets = seq.prompt_token_ids[lo + 1 : hi + 1]
                seq.prompt_logprobs += _logprobs(logits, targets, seq.params.prompt_logprobs)

    def _postprocess(self, batch, proposals, num_new, hidden, samples_drafts):
        offsets = [0]
        for n in num_new:
            offsets.append(offsets[-1] + n)
        result: list[list[int] | None] = [None] * len(batch)
        self.accepted_nodes = {}
        plain = [
            i
            for i, (s, n, p) in enumerate(zip(batch.seqs, num_new, proposals, strict=True))
            if p is None and s.blocks.length + n == s.num_tokens
        ]
        spec = [i for i, p in enumerate(proposals) if p is not None]
        rows = [offsets[i + 1] - 1 for i in plain]
        rows += [r for i in spec for r in range(offsets[i], offsets[i + 1])]
        logits = self.model.compute_logits(hidden[rows]) if rows else None
        # logprobs are reported from the raw distributions, before penalties or a grammar
        raw = logits
        if logits is not None and any(
            (s.matcher is not None or has_penalties(s.params) or s.params.min_tokens)
            and s.params.logprobs is not None
            for s in batch.seqs
        ):
            raw = logits.clone()
        self._penalise(batch, plain, spec, proposals, num_new, logits)
        node_masks = self._constrain(batch, plain, spec, proposals, num_new, logits)
        self._min_tokens(batch, plain, spec, proposals, num_new, logits)
        self.logprobs = {}
        argmax = None
        for j, i in enumerate(plain):
            seq = batch.seqs[i]
            if seq.params.greedy:  # one argmax over all greedy rows, computed once
                if argmax is None:
                    argmax = logits[: len(plain)].argmax(-1).tolist()
                result[i] = [argmax[j]]
            else:
                result[i] = [self._sample(seq, logits[j : j + 1])]
            if batch.seqs[i].params.logprobs is not None:
                self.logprobs[i] = _logprobs(
                    raw[j : j + 1], result[i], batch.seqs[i].params.logprobs
                )
        for seq, n, prop in zip(batch.seqs, num_new, proposals, strict=True):
            if prop is None:
                seq.blocks.length += n
        if spec:
            sizes = [num_new[i] for i in spec]
            spec_logits = logits[len(plain) :].split(sizes)
            spec_raw = raw[len(plain) :].split(sizes)
            verified = self._verify(
                [batch.seqs[i] for i in spec],
                [proposals[i] for i in spec],
                spec_logits,
                samples_drafts,
                [node_masks.get(i) for i in spec],
            )
            for j, i in enumerate(spec):
                result[i] = verified.tokens[j]
                self.accepted_nodes[i] = verified.accepted[j]
                if batch.seqs[i].params.logprobs is not None:  # rows that emitted the tokens
                    rows = spec_raw[j][[0, *verified.accepted[j]]]
                    self.logprobs[i] = _logprobs(rows, result[i], batch.seqs[i].params.logprobs)
        return result

    def _verify(
        self,
        seqs: list[Sequence],
        proposals: list[DraftProposal],
        logits: list[torch.Tensor],
        samples_drafts: bool,
        masks: list[torch.Tensor | None] | None = None,
    ) -> VerifyResult:
        # Rows with drafts sampled from q take the rejection sampler; the others (deterministic
        # drafts: a head's, a lookup's, a sampling drafter's lite or grafted ones; and greedy
        # requests, whose p is one-hot, so both rules agree) follow the target's choices.
        sampled = [
            j
            for j, (s, p) in enumerate(zip(seqs, proposals, strict=True))
            if samples_drafts and p.draft_probs is not None and not s.params.greedy
        ]
        if not sampled:
            return self._verify_choices(seqs, proposals, logits)
        if len(sampled) == len(seqs):
            return self._verify_sampled(seqs, proposals, logits, masks)
        chosen = sorted(set(range(len(seqs))) - set(sampled))
        parts = [
            (sampled, self._verify_sampled(*_pick(sampled, seqs, proposals, logits, masks))),
            (chosen, self._verify_choices(*_pick(chosen, seqs, proposals, logits))),
        ]
        accepted: list[list[int]] = [[] for _ in seqs]
        tokens: list[list[int]] = [[] for _ in seqs]
        for rows, res in parts:
            for j, a, t in zip(rows, res.accepted, res.tokens, strict=True):
                accepted[j], tokens[j] = a, t
        return VerifyResult(accepted, tokens)

    def _verify_choices(self, seqs, proposals, logits) -> VerifyResult:
        """Deterministic drafts (or greedy requests): follow the target's choices."""
        choices = []
        for seq, prop, lg in zip(seqs, proposals, logits, strict=True):
            if seq.params.greedy:
                choices.append(lg.argmax(-1).tolist())
                continue
            positions = [seq.num_tokens + d for d in prop.shape.depths]
            choices.append(position_draws(warp(lg, seq.params), self.sample_seed(seq), positions))
        shapes, tokens = [p.shape for p in proposals], [p.tokens for p in proposals]
        result = verify_choices(shapes, tokens, choices)
        self._keep_accepted(seqs, result)
        return result

    def _verify_sampled(self, seqs, proposals, logits, masks) -> VerifyResult:
        """Drafts sampled from q: modified rejection sampling (`verify`)."""
        probs = [warp(lg, s.params) for s, lg in zip(seqs, logits, strict=True)]
        n = max(p.shape[0] for p in probs)
        target = torch.zeros(len(seqs), n, probs[0].shape[-1], device=self.device)
        for i, p in enumerate(probs):
            target[i, : p.shape[0]] = p
        q = [p.draft_probs for p in proposals]
        if masks:  # a constrained request: q under the same grammar masks
            for j, m in enumerate(masks):
                if m is not None:
                    qm = q[j] * m[: q[j].shape[0]].to(q[j].device)  # masks are built on CPU
                    q[j] = qm / qm.sum(-1, keepdim=True).clamp_min(1e-30)
        drafts = DraftBatch.from_trees(
            [p.shape for p in proposals], [p.tokens for p in proposals], q
        )
        result = verify(target, drafts, [self.generator(s) for s in seqs])
        self._keep_accepted(seqs, result)
        return result

    def _rows(self, batch, plain, spec, proposals, num_new, want):
        """(seq, its rows of the step's logits, the drafts each row follows) for each request
        `want(seq)` picks: a plain row follows none, a draft node its path from the root."""
        offset = len(plain)
        for j, i in enumerate(plain):
            if want(batch.seqs[i]):
                yield batch.seqs[i], slice(j, j + 1), [[]]
        for i in spec:
            n = num_new[i]
            if want(batch.seqs[i]):
                prop = proposals[i]
                yield (
                    batch.seqs[i],
                    slice(offset, offset + n),
                    paths(prop.shape.parents, prop.tokens),
                )
            offset += n

    def _penalise(self, batch, plain, spec, proposals, num_new, logits) -> None:
        """Logit bias and penalties, in place (see processors.py)."""
        if logits is None:
            return
        for seq, rows, history in self._rows(
            batch, plain, spec, proposals, num_new, lambda s: has_penalties(s.params)
        ):
            apply_penalties(logits[rows], seq, history)

    def _min_tokens(self, batch, plain, spec, proposals, num_new, logits) -> None:
        """min_tokens: stop tokens masked until the request has that many (after a grammar)."""
        if logits is None:
            return
        for seq, rows, history in self._rows(
            batch, plain, spec, proposals, num_new,
            lambda s: len(s.output_token_ids) < s.params.min_tokens,
        ):  # fmt: skip
            mask_stops(logits[rows], seq, [len(h) for h in history], self.eos_token_ids)

    def _constrain(self, batch, plain, spec, proposals, num_new, logits) -> dict:
        """Structured output: mask each constrained row to what the request's grammar allows
        (in place). Returns, per speculating constrained request, its tree's [n, V] masks."""
        seqs = batch.seqs
        if logits is None or all(seqs[i].matcher is None for i in plain + spec):
            return {}
        from specdecode.structured import bitmask_to_bool, node_masks

        compiler = self.grammar()
        out = {}
        for j, i in enumerate(plain):
            m = seqs[i].matcher
            if m is None or getattr(m, "reasoning", False):  # (no grammar yet: no mask)
                continue
            bitmask = seqs[i].next_bitmask
            if bitmask is None:
                bitmask = compiler.new_bitmask(1)
                m.fill_next_token_bitmask(bitmask, 0)
            allowed = bitmask_to_bool(bitmask, compiler.vocab_size)[0]
            self._mask_row(seqs[i], logits[j], allowed)
        offset = len(plain)
        for i in spec:
            n = num_new[i]
            if seqs[i].matcher is not None:
                prop = proposals[i]
                masks = node_masks(seqs[i].matcher, compiler, prop.tokens, prop.shape.children)
                for r in range(n):
                    self._mask_row(seqs[i], logits[offset + r], masks[r], root=r == 0)
                out[i] = masks
            offset += n
        return out

    @staticmethod
    def _mask_row(seq: Sequence, row: torch.Tensor, allowed: torch.Tensor, root: bool = True):
        allowed = allowed.to(row.device)  # the grammar's masks are built on CPU
        if allowed.any():
            row[: allowed.shape[0]].masked_fill_(~allowed, float("-inf"))
            row[allowed.shape[0] :] = float("-inf")  # padded vocabulary rows
        elif root:  # nothing the grammar allows is a token of this vocabulary
            from specdecode.structured import DEAD_END

            seq.error = DEAD_END

    def _keep_accepted(self, seqs, result: VerifyResult) -> None:
        for seq, acc in zip(seqs, result.accepted, strict=True):
            keep_path(self.manager, self.cache, seq.blocks, [0] + acc)

    def _sample(self, seq: Sequence, logits: torch.Tensor) -> int:
        if seq.params.greedy:
            return int(logits.argmax(-1))
        return position_draws(warp(logits, seq.params), self.sample_seed(seq), [seq.num_tokens])[0]


def _logprobs(rows: torch.Tensor, tokens: list[int], n: int | None) -> list:
    """(logprob, top-n, rank) of each of `tokens` under the raw distributions `rows` [n, V]:
    its rank in the whole vocabulary (1 = the likeliest), as vLLM gives it, top-n or not."""
    logp = rows.float().log_softmax(-1)
    picked = logp.gather(1, torch.tensor(tokens, device=logp.device)[:, None])
    ranks = ((logp > picked).sum(-1) + 1).tolist()  # (all rows at once: one transfer each)
    lps = picked[:, 0].tolist()
    tops: list[list] = [[] for _ in tokens]
    if n:
        vals, idx = logp.topk(n, dim=-1)
        tops = [
            list(zip(i, v, strict=True)) for i, v in zip(idx.tolist(), vals.tolist(), strict=True)
        ]
    return list(zip(lps, tops, ranks, strict=True))


def _pick(rows: list[int], *columns):
    """The given rows of each per-request list (None stays None)."""
    return tuple(None if c is None else [c[j] for j in rows] for c in columns)
