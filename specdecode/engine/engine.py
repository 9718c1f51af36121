"""The engine loop: schedule, run, append outputs. Requests can join between any two steps."""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from specdecode.cache import BlockManager, KVCache, SeqBlocks
from specdecode.config import EngineConfig, SpeculativeConfig
from specdecode.core import Sequence
from specdecode.drafters.base import Drafter, DraftProposal
from specdecode.engine.controller import GoodputController
from specdecode.engine.model_runner import ModelRunner
from specdecode.engine.output import OutputProcessor
from specdecode.engine.scheduler import Scheduler
from specdecode.errors import InvalidRequestError
from specdecode.metrics import SpecDecodeStats
from specdecode.models.attention import build_metadata
from specdecode.models.loader import load_model, load_tokenizer
from specdecode.sampling import SamplingParams

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(device: str) -> torch.device:
    """`auto`: CUDA if present, else CPU. A bare `cuda` under torchrun (LOCAL_RANK set) is the
    rank's own GPU, as `torchrun --nproc-per-node N` expects, not every rank on GPU 0."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        wanted = torch.device(device)
    except (RuntimeError, TypeError):
        raise InvalidRequestError(
            f"unknown device {device!r}; choose from auto, cpu, cuda, cuda:N"
        ) from None
    if wanted.type == "cuda" and not torch.cuda.is_available():
        raise InvalidRequestError(f"--device {device}: no CUDA device is available here")
    if wanted.type == "cuda" and (wanted.index or 0) >= torch.cuda.device_count():
        raise InvalidRequestError(
            f"--device {device}: only {torch.cuda.device_count()} CUDA device(s) are visible"
        )
    rank = int(os.environ.get("LOCAL_RANK", 0))
    if device == "cuda" and rank and rank < torch.cuda.device_count():  # (one visible GPU a
        device = f"cuda:{rank}"  # rank, CUDA_VISIBLE_DEVICES: that one is cuda)
    return torch.device(device)


def resolve_dtype(dtype: str) -> torch.dtype:
    if dtype not in _DTYPES:
        raise InvalidRequestError(f"unknown dtype {dtype!r}; choose from {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


class LLMEngine:
    def __init__(self, config: EngineConfig, share_model_with: LLMEngine | None = None) -> None:
        """`share_model_with`: reuse that engine's loaded target (same model, dtype, device and
        kernels; benchmarks compare several drafters on one copy of a large target)."""
        self.config = config
        torch.manual_seed(config.seed)
        if config.kernels not in ("auto", "off"):
            raise InvalidRequestError(f"kernels must be 'auto' or 'off', got {config.kernels!r}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            value = getattr(config, name)
            if not isinstance(value, int) or value < 1:  # 0 would schedule nothing, ever
                raise InvalidRequestError(f"{name} must be a positive integer, got {value!r}")
        if config.max_model_len is not None and config.max_model_len < 2:
            raise InvalidRequestError(f"max_model_len must be >= 2, got {config.max_model_len}")
        dtype, device = resolve_dtype(config.dtype), resolve_device(config.device)
        if config.quantization is not None and (
            torch.device(device).type != "cpu"
            or config.kernels != "auto"
            or dtype not in (torch.float32, torch.bfloat16)
        ):  # (before the model loads)
            raise InvalidRequestError(_quantization_unavailable(config.quantization))
        if share_model_with is not None:
            other = share_model_with
            keys = ("model", "dtype", "device", "kernels", "quantization")
            if any(getattr(other.config, k) != getattr(config, k) for k in keys):
                raise ValueError(
                    "share_model_with needs the same model, dtype, device, kernels, quantization"
                )
            self.model, self.model_config = other.model, other.model_config
            self.model_path, self.tokenizer = other.model_path, other.tokenizer
        else:
            loaded = load_model(
                config.model, dtype=dtype, device=device, allow_pickle=config.allow_pickle
            )
            self.model, self.model_config = loaded.model, loaded.config
            self.model_path = loaded.path
            if config.kernels == "auto":
                from specdecode.models.fast import accelerate

                weights = {"int8": torch.int8, "int4": torch.int4}.get(config.quantization)
                if not accelerate(self.model, weights) and weights is not None:
                    raise InvalidRequestError(_quantization_unavailable(config.quantization))

            self.tokenizer = load_tokenizer(loaded.path)
        self.chat_template = _load_chat_template(config.chat_template)
        mc = self.model_config
        self.max_model_len = min(
            config.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings
        )
        kv_dtype = self.model.activation_dtype
        self.spec_config = _speculative_config(config.speculative_config)
        self.drafter: Drafter | None = None
        fraction = config.gpu_memory_utilization
        if fraction is not None and torch.device(device).type == "cuda":
            # vLLM's --gpu-memory-utilization: the fraction holds the weights and every cache.
            # The drafter loads first (its weights, and its cache sized as a share of what the
            # target's weights leave); the target's cache takes what remains.
            from specdecode.config import kv_budget_gb

            total = torch.cuda.get_device_properties(device).total_memory
            gb = kv_budget_gb(total, torch.cuda.memory_allocated(device), fraction)
            config = self.config = dataclasses.replace(config, kv_cache_memory_gb=gb)
            self._build_drafter()
            gb = kv_budget_gb(total, torch.cuda.memory_allocated(device), fraction)
            config = self.config = dataclasses.replace(config, kv_cache_memory_gb=gb)
        num_blocks = KVCache.num_blocks_for(
            mc, kv_dtype, config.kv_cache_memory_gb, config.block_size
        )
        self.manager = BlockManager(num_blocks, config.block_size)
        self.cache = KVCache(mc, num_blocks, config.block_size, kv_dtype, device)
        self.scheduler = Scheduler(
            self.manager, config.max_num_seqs, config.max_num_batched_tokens,
            config.scheduling_policy,
        )  # fmt: skip
        self.runner = ModelRunner(self.model, self.cache, self.manager)
        self.output = OutputProcessor(self.tokenizer, self._eos_ids(), self.max_model_len)
        self.runner.eos_token_ids = self.output.eos_token_ids
        # Called after every step with (sequences, their committed target features) when
        # `runner.feature_layers` is set: feature-reading drafters, data generation.
        self.feature_observers: list = []
        if self.drafter is None:
            self._build_drafter()
        if self.drafter is not None:
            self.scheduler.on_preempt.append(self.drafter.preempt)
        self.spec_stats = SpecDecodeStats()
        # Prefix caching: a request computes only what no earlier one did (a cached prefix has
        # no target features: an EAGLE head attends from where they begin)
        self.manager.prefix_caching = config.enable_prefix_caching
        depth = self.spec_config.num_speculative_tokens if self.spec_config else 0
        self.controller = GoodputController(
            config.speculative_policy if self.drafter else "off",
            depth,
            self.drafter.expected_nodes if self.drafter else (lambda k: 0),
            disable_by_batch_size=(
                self.spec_config.disable_by_batch_size if self.spec_config else None
            ),
            shadow_capable=bool(
                self.drafter and (self.drafter.stateless or self.drafter.shadow_capable)
            ),
            needs_probes=bool(self.drafter and not self.drafter.stateless),
            lite_depth=self.drafter.lite_depth if self.drafter else 0,
            variable_size=bool(self.drafter and self.drafter.variable_size),
        )
        self._feed_drafter(self.controller.policy != "off")
        # A request must fit the KV cache alone: otherwise it would be preempted and recomputed
        # forever. The context is what the cache can hold, if less. Its draft slots are not
        # reserved: drafts give way to tokens (the scheduler's `draft_slots`), so a request
        # that fills the cache decodes on without them, as on a plain engine.
        fits = self.manager.capacity_tokens - 1
        if fits < 2:
            raise InvalidRequestError("the KV cache is too small; raise --kv-cache-memory-gb")
        if fits < self.max_model_len:
            log.warning("the KV cache holds %d tokens: the context is cut to that", fits)
            self.max_model_len = self.output.max_model_len = fits
        self.num_steps = 0
        self.last_batch: list[Sequence] = []
        self._grammar = None
        self._grammar_lock = threading.Lock()
        # tokens a decoding request feeds at most in a step (its own and its draft tree), and
        # the most a step's decodes feed: how far the step-cost curve is timed
        k = self.spec_config.num_speculative_tokens if self.spec_config else 0
        self.tokens_per_decode = 1 + (self.drafter.max_nodes(k) if self.drafter else 0)
        self._calibration_top = min(
            config.max_num_batched_tokens, config.max_num_seqs * self.tokens_per_decode
        )
        self._calibrated_to = 0  # tokens a step feeds that the step-cost curve was timed for
        self.runner.grammar = self.grammar_compiler
        self.num_forced_tokens = 0  # structured output: tokens appended by jump-ahead
        self.num_generated_tokens = 0
        self.num_prompt_tokens = 0

    @property
    def speculation_enabled(self) -> bool:
        return self.controller.policy != "off"

    def set_policy(self, policy: str) -> None:
        """Switch `adaptive|static|off` between steps (benchmarks compare them on one engine)."""
        if policy != "off" and self.drafter is None:
            raise InvalidRequestError("no speculative method is configured")
        if policy not in ("adaptive", "static", "off"):
            raise InvalidRequestError(f"unknown speculative policy {policy!r}")
        self.controller.policy = policy
        self._feed_drafter(policy != "off")

    def _feed_drafter(self, on: bool) -> None:
        """Capture the target features a drafter reads (EAGLE, Medusa) while it may draft.
        Under policy `off` nothing is captured and the drafter hears nothing, so plain decoding
        on a drafter's engine costs what it does on a plain engine (a head's feature copies, and
        with prefix caching its run over each finished request's history, would otherwise go
        on). Switched back, a request admitted under `off` drafts from the features it then
        gets (an EAGLE head as after a cached prefix); an EAGLE head that had begun before has
        a gap in its features and drafts no more for that request, and Medusa waits for its
        last token's feature (lossless, just slower)."""
        d = self.drafter
        if d is None or d.feature_layers is None:
            return
        reading = d.observe in self.feature_observers
        if on and not reading:
            self.feature_observers.append(d.observe)
            self.runner.feature_layers = d.feature_layers
        elif not on and reading:
            self.feature_observers.remove(d.observe)
            if not self.feature_observers:  # (data generation may be recording its own)
                self.runner.feature_layers = None

    def _eos_ids(self) -> set[int]:
        ids = set(self.model_config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids

    def make_sequence(
        self, prompt_token_ids: list[int], params: SamplingParams, request_id: str = "",
        priority: int = 0,
    ) -> Sequence:  # fmt: skip
        """Check a request and wrap it; touches no engine state (any thread may call it).
        `priority`: under the priority scheduling policy, lower runs first (vLLM's)."""
        if not prompt_token_ids:
            raise InvalidRequestError("the prompt is empty")
        if type(priority) is not int:
            raise InvalidRequestError(f"priority must be an integer, got {priority!r}", "priority")
        if priority and self.config.scheduling_policy != "priority":
            raise InvalidRequestError(
                "a request priority needs the priority scheduling policy (serve "
                "--scheduling-policy priority or --enable-priority-scheduling; "
                'LLM(..., scheduling_policy="priority")); this engine runs requests in '
                "arrival order",
                "priority",
            )
        if params.n != 1:  # (LLM and the server expand n into n requests)
            raise InvalidRequestError("an engine request is one choice: n must be 1 here")
        if len(prompt_token_ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"the prompt has {len(prompt_token_ids)} tokens; the context holds "
                f"{self.max_model_len}, leaving no room to generate"
            )
        vocab = self.model_config.vocab_size
        if not all(type(t) is int for t in prompt_token_ids):
            raise InvalidRequestError("prompt token ids must be integers")
        if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= vocab:
            raise InvalidRequestError(f"prompt token ids must be in [0, {vocab})")
        if params.logit_bias and max(params.logit_bias) >= vocab:
            raise InvalidRequestError(f"logit_bias token ids must be in [0, {vocab})", "logit_bias")
        if params.stop_token_ids and max(params.stop_token_ids) >= vocab:
            raise InvalidRequestError(f"stop_token_ids must be in [0, {vocab})", "stop_token_ids")
        if len(prompt_token_ids) + 1 > self.manager.capacity_tokens:
            raise InvalidRequestError(
                f"a prompt of {len(prompt_token_ids)} tokens does not fit the KV cache "
                f"({self.manager.capacity_tokens} tokens)"
            )
        seq = Sequence(list(prompt_token_ids), params, request_id=request_id, priority=priority)
        if params.structured_output is not None:
            seq.matcher = self.grammar_compiler().matcher(
                params.structured_output, after=params.reasoning_end
            )
        return seq

    def render_chat(
        self,
        messages: list[dict],
        instead: str,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template: str | None = None,
        chat_template_kwargs: dict | None = None,
        documents: list[dict] | None = None,
        tools: list[dict] | None = None,
    ) -> str:
        """Chat messages -> prompt text, with `chat_template`, else --chat-template, else the
        tokenizer's template (vLLM's options: `continue_final_message` leaves the last
        assistant message open instead of starting a new one; `chat_template_kwargs` go to
        the template as variables; `documents` to templates that read them, as in
        transformers), `tools` (OpenAI's function tools, for templates that describe them).
        `instead`: what to use when the model has none (named in the error)."""
        extra = dict(chat_template_kwargs or {})
        reserved = sorted(set(extra) & _render_arguments(type(self.tokenizer)))
        if reserved:  # apply_chat_template's own arguments, not template variables
            raise InvalidRequestError(
                f"chat_template_kwargs cannot set {', '.join(reserved)}: "
                + ("give it as an option of its own" if set(reserved) <= _RENDER_OPTIONS
                   else "not a template variable"),
                param="chat_template_kwargs",
            )  # fmt: skip
        template = chat_template or self.chat_template
        if not (template or getattr(self.tokenizer, "chat_template", None)):
            raise InvalidRequestError(f"this model has no chat template; use {instead}")
        if add_generation_prompt and continue_final_message:
            raise InvalidRequestError(
                "continue_final_message continues the last message: it needs "
                "add_generation_prompt=False",
                param="continue_final_message",
            )
        try:
            return self.tokenizer.apply_chat_template(
                messages, chat_template=template, tokenize=False,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, documents=documents,
                tools=tools, **extra,
            )  # fmt: skip
        except Exception as e:  # noqa: BLE001 - templates raise on roles they do not accept
            raise InvalidRequestError(
                f"the chat template rejected the messages: {e}", param="messages"
            ) from e

    def grammar_compiler(self):
        """The structured-output compiler for this tokenizer (built on first use)."""
        with self._grammar_lock:
            if self._grammar is None:
                from specdecode.structured import GrammarCompiler

                self._grammar = GrammarCompiler(
                    self.tokenizer, self.model_config.vocab_size, sorted(self._eos_ids())
                )
            return self._grammar

    def add_sequence(self, seq: Sequence) -> Sequence:
        self.scheduler.add(seq)
        self.num_prompt_tokens += len(seq.prompt_token_ids)
        return seq

    def add_request(
        self, prompt_token_ids: list[int], params: SamplingParams, request_id: str = "",
        priority: int = 0,
    ) -> Sequence:  # fmt: skip
        return self.add_sequence(self.make_sequence(prompt_token_ids, params, request_id, priority))

    def preempt(self, seq: Sequence) -> None:
        """Send a running request back to the queue; it is recomputed later (nothing is lost)."""
        if seq in self.scheduler.running:
            self.scheduler.preempt(seq)

    def num_tracked(self) -> int:
        """Requests any part of the engine still holds state for (0 when idle: nothing leaks)."""
        ids = set(self.runner._seeds) | set(self.runner._generators)
        ids |= set(self.controller._requests) | set(self.controller._last_plan)
        ids |= set(self.controller._lite_requests) | set(self.controller._size_requests)
        ids |= set(self.controller._lite_size_requests)
        if self.drafter:
            ids |= self.drafter.tracked_ids()
        return len(ids) + len(self.scheduler.waiting) + len(self.scheduler.running)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[Sequence]:
        """Run one forward for the scheduled batch; return the sequences that received tokens."""
        ctrl = self.controller
        self.last_batch = []
        # (the bare-forward curve, even where steps run under another policy already measured
        # some points: plain steps alone measure one token, and the curve drawn through them
        # priced every draft as compute-bound, so an engine switched to adaptive never drafted)
        if self._calibrated_to < self._calibration_top:
            # as far as the requests here can reach (a larger batch later times more)
            n = len(self.scheduler.running) + len(self.scheduler.waiting)
            self.ensure_calibrated(min(n, self.config.max_num_seqs) * self.tokens_per_decode)
        k = self.spec_config.num_speculative_tokens if ctrl.policy != "off" else 0
        lookahead = self.drafter.max_nodes(k) if k else 0
        t0 = time.perf_counter()
        batch = self.scheduler.schedule(num_lookahead=lookahead)
        self.last_batch = batch.seqs
        if not batch.seqs:
            return []
        t1 = time.perf_counter()
        proposals = self._propose(batch, k)
        t2 = time.perf_counter()
        samples = self.drafter.samples_drafts if self.drafter else False
        new_tokens = self.runner.run(batch, proposals, samples)
        t3 = time.perf_counter()
        spec = [i for i, p in enumerate(proposals) if p is not None]
        if self.drafter:
            # the drafter hears about every proposal it made, in its own node numbering; one
            # the grammar pruned to nothing was not verified and keeps nothing (lite drafts
            # came from its shadow, which holds no state)
            heard = spec + [i for i in self._pruned if proposals[i] is None]
            heard = [i for i in heard if i not in self._lite]
            originals, accepted = [], []
            for i in heard:
                prop, keep = self._pruned.get(i, (proposals[i], None))
                nodes = self.runner.accepted_nodes.get(i, [])
                originals.append(prop)
                accepted.append(nodes if keep is None else [keep[n] for n in nodes])
            if heard:
                self.drafter.on_verified([batch.seqs[i] for i in heard], originals, accepted)
        verified = {}  # batch row -> (drafts, depth, accepted): counted once appended
        for i in spec:
            depth, accepted = max(proposals[i].shape.depths), len(self.runner.accepted_nodes[i])
            lite = i in self._lite
            # a variable-size drafter's outcome (and a lite draft's) counts against its budget
            # (see the controller)
            counted = self._budget_of.get(i, depth)
            ctrl.record_verification(batch.seqs[i], counted, accepted, lite=lite)
            verified[i] = (proposals[i].num_drafts, depth, accepted)
        for i, budget in self._budget_of.items():  # proposed nothing (or nothing the grammar
            if proposals[i] is None:  # allows): a miss at depth 1
                ctrl.record_empty(batch.seqs[i], budget, lite=i in self._lite)
        # the depth each drafted for (its drafting time), read before a request finishes and
        # the drafter drops its state; lite drafts cost no drafting time
        depths = [
            0 if i in self._lite else self.drafter.drafted_depth(batch.seqs[i], proposals[i])
            for i in spec
        ]
        self.spec_stats.drafted_levels += sum(depths)
        t4 = time.perf_counter()
        if self.runner.features:
            feats = [self.runner.features[i] for i in range(len(batch))]
            for observe in self.feature_observers:
                observe(batch.seqs, feats)
        updated = []
        released = 0.0  # seconds of finishing requests: not the forward's cost
        for i, (seq, tokens) in enumerate(zip(batch.seqs, new_tokens, strict=True)):
            self.manager.truncate(seq.blocks, seq.blocks.length)  # unused lookahead slots
            if tokens is None:
                self.manager.register(seq.blocks, seq.token_ids, seq.num_tokens)
                continue
            before = len(seq.output_token_ids)
            if seq.error is None:
                dead_end, forced, entries = False, [], self.runner.logprobs.get(i)
                if seq.matcher is not None:
                    tokens, dead_end, forced = self._accept_grammar(seq, tokens)
                if forced and entries:  # as plain decoding's jump-ahead gives them
                    entries = list(entries)
                    for j in forced:
                        entries[j] = _forced_entry(tokens[j], seq.params.logprobs)
                self.output.append(seq, tokens, entries)
                if forced:
                    emitted = len(seq.output_token_ids) - before
                    n = sum(1 for j in forced if j < emitted)
                    seq.num_forced_tokens += n
                    self.num_forced_tokens += n
                if dead_end and seq.finish_reason is None:
                    from specdecode.structured import DEAD_END

                    seq.error = DEAD_END  # where plain decoding ends, one step later
            if seq.matcher is not None and seq.error is None:
                # (a forced run that began among this step's drafts counts towards the bound)
                run = 0
                while run < len(forced) and forced[-1 - run] == len(tokens) - 1 - run:
                    run += 1
                self._advance_grammar(seq, _JUMP_AHEAD - run)
            if seq.error is not None and seq.finish_reason is None:
                seq.finish_reason = "error"
            self.num_generated_tokens += len(seq.output_token_ids) - before
            if i in verified and seq.error is None:  # (an errored row emitted nothing)
                # the statistics count the drafts the request kept: those accepted past a stop
                # (max_tokens, a stop token or string, the grammar's end) were never emitted
                # (the controller above heard them all: they measure the drafter)
                drafts, depth, accepted = verified[i]
                kept = min(accepted, len(seq.output_token_ids) - before)
                self.spec_stats.record(drafts, depth, kept)
                seq.spec.record(drafts, depth, kept)
            ctrl.resolve_shadows(seq)
            self.manager.register(seq.blocks, seq.token_ids, seq.num_tokens)
            if seq.finish_reason is not None:
                t = time.perf_counter()
                self._finish(seq)  # (a drafter's release: a head's catch-up, a corpus update)
                released += time.perf_counter() - t
            updated.append(seq)
        t5 = time.perf_counter()
        self.num_steps += 1
        if all(n == 1 for n in batch.num_new):  # decode and verify steps only: a prefill
            # chunk's tokens cost far less each and would skew the curve drafts are priced on
            # (lite drafts' lookups are part of the step: they are priced as verification)
            seconds = (t1 - t0) + (t3 - t2) + (t5 - t4 - released) + self._lite_time
            ctrl.record_step(self.runner.num_fed_tokens, seconds)
        if spec:
            # catch-up of the requests the drafter really ran for (a lookup branch may have
            # skipped the head, whose catch-up then waits)
            caught = sum(
                self._catch_up.get(batch.seqs[i].seq_id, 0)
                for i, d in zip(spec, depths, strict=True)
                if d
            )
            ctrl.record_draft(sum(depths), (t2 - t1) - self._shadow_time + (t4 - t3), caught)
        return updated

    def _propose(self, batch, k: int) -> list[DraftProposal | None]:
        proposals: list[DraftProposal | None] = [None] * len(batch)
        self._last_budgets: list[int] = []
        self._pruned: dict[int, tuple[DraftProposal, list[int]]] = {}
        self._shadow_time = 0.0  # shadows and lite drafts: not the drafter's drafting time
        self._lite_time = 0.0  # lite drafts' lookups: part of the step's time instead
        self._lite: set[int] = set()  # batch rows verifying lite drafts
        self._catch_up: dict[int, int] = {}  # seq_id -> tokens to catch up, drafting requests
        self._budget_of: dict[int, int] = {}  # batch row -> budget (lookups, lite drafts)
        if not self.drafter or k == 0:
            return proposals
        decoding = [
            i
            for i, (s, n) in enumerate(zip(batch.seqs, batch.num_new, strict=True))
            if n == 1 and s.num_uncommitted == 1 and batch.draft_slots.get(s.seq_id, 0) > 0
        ]
        if not decoding:
            return proposals
        seqs = [batch.seqs[i] for i in decoding]
        # Drafts are priced against the decode part of the step only: a prefill chunk is work
        # the step does anyway, and pricing drafts on top of it would make them look cheap
        # relative to the tokens it yields (on a compute-bound CPU they are not).
        decode_tokens = sum(1 for n in batch.num_new if n == 1)
        catch_up = [self.drafter.catch_up_tokens(s) for s in seqs]
        slots = [batch.draft_slots[s.seq_id] for s in seqs]
        caps = [  # (the drafter's own limits too: a draft model's context)
            self.drafter.fit(self.drafter.depth_room(s, self.draft_room(s, k)), n)
            for s, n in zip(seqs, slots, strict=True)
        ]
        plan = self.controller.plan(seqs, decode_tokens, len(batch), catch_up, caps)
        budgets = [max(b, 0) for b in plan]  # (the plan is within caps; lite rows draft none)
        # a lite draft is a chain: a node a level
        lite = [
            (j, min(self.draft_room(seqs[j], -b), slots[j])) for j, b in enumerate(plan) if b < 0
        ]
        lite = [(j, b) for j, b in lite if b > 0]
        self._last_budgets = budgets
        self._catch_up = {
            s.seq_id: n for s, n, b in zip(seqs, catch_up, budgets, strict=True) if b and n
        }
        shadows = self.controller.shadow_requests
        t0 = time.perf_counter()
        if shadows:  # drafts scored later against the real output (see GoodputController)
            depth = self.drafter.lite_depth or k  # a lite mode's shadow is its lite draft
            drafts = self.drafter.shadow(shadows, [depth] * len(shadows))
            for seq, prop in zip(shadows, drafts, strict=True):
                self.controller.add_shadow(seq, prop.tokens, prop.shape.children, depth)
        drafted: list[tuple[int, DraftProposal]] = []
        if lite:  # the drafter's shadow, verified (see GoodputController)
            t_lite = time.perf_counter()
            props = self.drafter.shadow([seqs[j] for j, _ in lite], [b for _, b in lite])
            drafted = [(decoding[j], p) for (j, _), p in zip(lite, props, strict=True)]
            self._lite = {i for i, _ in drafted}
            for (j, b), p in zip(lite, props, strict=True):  # what the budgets fed, as lookups
                self.controller.record_proposal(seqs[j], b, p.num_drafts, lite=True)
                self._budget_of[decoding[j]] = b
            self._lite_time = time.perf_counter() - t_lite
        self._shadow_time = time.perf_counter() - t0  # not the real drafts' cost
        if any(budgets):  # (a lite row's budget is 0: its own proposal is empty)
            self.drafter.slots = {s.seq_id: n for s, n in zip(seqs, slots, strict=True)}
            own = list(zip(decoding, self.drafter.propose(seqs, budgets), strict=True))
            drafted += [(i, p) for i, p in own if i not in self._lite]
            if self.drafter.variable_size:  # what the budgets fed: the controller learns it
                for (i, p), s, b in zip(own, seqs, budgets, strict=True):
                    if b > 0:
                        self.controller.record_proposal(s, b, p.num_drafts)
                        self._budget_of[i] = b
        for i, prop in drafted:
            if prop.num_drafts and batch.seqs[i].matcher is not None:
                prop = self._prune(i, batch.seqs[i], prop)
            proposals[i] = prop if prop.num_drafts > 0 else None
        return proposals

    def _prune(self, i: int, seq: Sequence, prop: DraftProposal) -> DraftProposal:
        """Keep only the draft nodes the request's grammar allows (see structured.py)."""
        from specdecode.structured import prune
        from specdecode.tree import TreeShape

        shape = prop.shape
        keep = prune(prop.tokens, shape.children, seq.matcher)
        if len(keep) == len(prop.tokens):
            return prop
        index = {old: new for new, old in enumerate(keep)}
        ranks = tuple(shape.ranks[k] for k in keep) if shape.ranks else ()
        pruned = DraftProposal(
            TreeShape(tuple(-1 if k == 0 else index[shape.parents[k]] for k in keep), ranks),
            [prop.tokens[k] for k in keep],
            prop.draft_probs[keep] if prop.draft_probs is not None else None,
        )
        self._pruned[i] = (prop, keep)  # the drafter hears about its own node numbering
        return pruned

    def _build_drafter(self) -> None:
        if self.spec_config is not None:
            from specdecode.drafters.factory import build_drafter

            self.drafter = build_drafter(self.spec_config, self)

    @torch.inference_mode()
    def ensure_calibrated(self, upto: int | None = None) -> None:
        """Time the step-cost curve where the adaptive policy needs it, as far as `upto` tokens
        (None: as far as a step can reach), once per size: `serve` times the whole curve while
        it loads; a step times what its requests can reach (one request's tree: ~0.3 s, where
        the whole curve takes ~3 s), and a later, larger batch extends it."""
        if self.controller.policy != "adaptive":
            return
        full = self._calibration_top
        want = full if upto is None else min(upto, full)
        if want > self._calibrated_to:
            self.calibrate(upto=want, after=self._calibrated_to)
            self._calibrated_to = want

    def calibrate(
        self, time_budget_s: float = 3.0, context: int = 32, upto: int | None = None,
        after: int = 0,
    ) -> None:  # fmt: skip
        """Time bare forwards (and LM heads) of N tokens, N = 1, 2, 4, ... up to what a step can
        feed (or `upto`; only the sizes past `after`, timed before), spread over up to
        `max_num_seqs` sequences of `context` cached tokens each: the start of the
        controller's step-cost curve. Stops early when the budget is spent."""
        cfg = self.config
        top = min(cfg.max_num_batched_tokens, upto or cfg.max_num_seqs * self.tokens_per_decode)
        start = time.perf_counter()
        n = 1
        while n <= after:
            n *= 2
        while n < 2 * top and time.perf_counter() - start < time_budget_s:
            n = min(n, top)
            b = min(n, cfg.max_num_seqs)
            nums = [n // b + (1 if i < n % b else 0) for i in range(b)]
            blocks = [SeqBlocks() for _ in range(b)]
            try:
                if not all(
                    self.manager.allocate(sb, context + m)
                    for sb, m in zip(blocks, nums, strict=True)
                ):
                    break
                for sb in blocks:
                    sb.length = context
                ids = torch.zeros(n, dtype=torch.long, device=self.runner.device)
                pos = torch.tensor(
                    [context + j for m in nums for j in range(m)], device=self.runner.device
                )
                best = float("inf")
                for _ in range(3):  # a warm-up and two timed runs
                    t0 = time.perf_counter()
                    meta = build_metadata(self.cache.kv, self.manager, blocks, nums)
                    out = self.model(ids, pos, meta, ())
                    self.model.compute_logits(out.hidden)
                    if self.runner.device.type == "cuda":  # launches are asynchronous there
                        torch.cuda.synchronize(self.runner.device)
                    best = min(best, time.perf_counter() - t0)
                self.controller.step_cost.calibrate(n, best)
            finally:
                for sb in blocks:
                    self.manager.free(sb)
            n *= 2
        log.info("calibrated the step-cost curve up to %d tokens", n // 2)

    def abort(self, seq: Sequence) -> None:
        """Drop a request wherever it is (queued or running) and free its memory."""
        if seq.finished:
            return
        self.scheduler.finish(seq)
        seq.finish_reason = seq.finish_reason or "abort"
        self._release(seq)

    def draft_room(self, seq: Sequence, k: int) -> int:
        """Draft depth worth proposing: none past the context, none past max_tokens."""
        room = self.max_model_len - seq.num_tokens - 1  # (the step's own token takes one)
        if seq.params.max_tokens is not None:
            room = min(room, seq.params.max_tokens - len(seq.output_token_ids) - 1)
        return max(0, min(k, room))

    def _accept_grammar(
        self, seq: Sequence, tokens: list[int]
    ) -> tuple[list[int], bool, list[int]]:
        """Feed the step's tokens to the request's grammar; the ones it takes, whether it
        stopped at a dead end, and which of them the grammar forced (the only token it allowed
        there: accepted drafts that plain decoding's jump-ahead would have appended, with its
        placeholder logprob and counted as forced). A step that accepted the grammar's stop
        token (a draft node) keeps nothing after it: plain decoding would have ended there, and
        the bonus token drawn past it is unconstrained (only visible with ignore_eos, where the
        stop token does not end the request). An accepted draft node after which the grammar
        allows no token of the vocabulary (its row could not be masked) keeps nothing after it
        either: plain decoding would emit up to it and then end with the dead end's error."""
        from specdecode.structured import bitmask_to_bool, single_allowed

        m = seq.matcher
        compiler = self.grammar_compiler() if len(tokens) > 1 else None
        forced = []
        for j, tok in enumerate(tokens):
            if m.is_terminated():
                return tokens[:j], False, forced
            # (the step's first token never is: the last step's jump-ahead took those; nor is
            # one while a reply still reasons: the grammar does not constrain it yet)
            reasoning = getattr(m, "reasoning", False)
            if j > 0 and not reasoning and single_allowed(m, compiler)[0] == tok:
                forced.append(j)
            if not m.accept_token(tok):
                compiler = self.grammar_compiler()
                bitmask = compiler.new_bitmask(1)
                m.fill_next_token_bitmask(bitmask, 0)
                if j > 0 and not bitmask_to_bool(bitmask, compiler.vocab_size).any():
                    return tokens[:j], True, forced
                # p and q were masked: this cannot happen
                raise RuntimeError(f"the grammar refused token {tok} it had allowed")
        return tokens, False, forced

    def _advance_grammar(self, seq: Sequence, bound: int) -> None:
        """Append the tokens the request's grammar forces after the step's (jump-ahead), at
        most `bound` (a forced run longer than `_JUMP_AHEAD` goes on with a model step: the
        token after the bound gets the model's logprob, with speculation or without)."""
        from specdecode.structured import single_allowed

        m = seq.matcher
        seq.next_bitmask = None
        compiler = self.grammar_compiler()
        for _ in range(bound):  # jump-ahead, bounded per step
            if seq.finish_reason is not None or m.is_terminated():
                break
            if getattr(m, "reasoning", False):  # (a reply still reasoning: no grammar yet)
                break
            forced, bitmask = single_allowed(m, compiler)
            if forced is None:
                seq.next_bitmask = bitmask  # the next step's mask: no second fill
                break
            # no model choice: probability 1 under the grammar (and no forward at its position
            # yet to give a raw figure); an entry all the same, so logprobs stay aligned
            n = seq.params.logprobs
            entry = None if n is None else [_forced_entry(forced, n)]
            self.output.append(seq, [forced], entry)
            if not m.accept_token(forced):
                raise RuntimeError(f"the grammar refused token {forced} it forced")
            seq.num_forced_tokens += 1
            self.num_forced_tokens += 1
        if seq.finish_reason is None and m.is_terminated():
            seq.finish_reason = "stop"  # the grammar is complete (its stop token was emitted)

    def _finish(self, seq: Sequence) -> None:
        self.scheduler.finish(seq)
        self._release(seq)

    def _release(self, seq: Sequence) -> None:
        self.runner.release(seq)
        self.controller.release(seq)
        if self.drafter:
            self.drafter.release(seq)

    def run_to_completion(self) -> Iterator[list[Sequence]]:
        while self.has_unfinished():
            yield self.step()


# options of a chat rendering that a request gives as fields of their own
_RENDER_OPTIONS = {
    "chat_template", "add_generation_prompt", "continue_final_message", "documents", "tools"
}  # fmt: skip


@functools.cache
def _render_arguments(tokenizer_class: type) -> frozenset[str]:
    """The keyword arguments of a tokenizer class's `apply_chat_template` (whatever else it
    is given goes to the template as a variable); read once per class."""
    import inspect

    params = inspect.signature(tokenizer_class.apply_chat_template).parameters.values()
    named = {p.name for p in params if p.kind is not p.VAR_KEYWORD}
    return frozenset((named - {"self"}) | {"conversation", "messages"})


_JUMP_AHEAD = 256  # forced tokens a step appends at most, counted from a run's first


def _forced_entry(token: int, n: int | None) -> tuple:
    """The logprobs entry of a token the grammar forced: probability 1, no model figure."""
    return (0.0, [(token, 0.0)] if n else [], 1)


def _speculative_config(raw) -> SpeculativeConfig | None:
    if raw is None or isinstance(raw, SpeculativeConfig):
        return raw
    return SpeculativeConfig.from_dict(raw)


def _load_chat_template(given: str | None) -> str | None:
    """`--chat-template`: a file holding a Jinja template, or the template itself (as vLLM
    reads it); checked for syntax here, not at the first chat request."""
    if given is None:
        return None
    path = Path(given).expanduser()
    if path.is_file():
        try:
            template = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise InvalidRequestError(f"cannot read the chat template {given!r}: {e}") from None
    elif any(c in given for c in "{}\n"):
        template = given
    else:
        raise InvalidRequestError(f"chat template file {given!r} not found")
    import jinja2

    try:
        jinja2.Environment().parse(template)
    except jinja2.TemplateSyntaxError as e:
        raise InvalidRequestError(f"the chat template is not valid Jinja: {e}") from None
    return template


def _quantization_unavailable(kind: str) -> str:
    what = "an x86 CPU with AVX-512 or AVX2" if kind == "int8" else "a CPU with AVX512_VNNI"
    return (
        f"quantization {kind} runs on the CPU kernels: it needs {what}, --kernels auto, the "
        "model on the CPU, in float32 or bfloat16"
    )
