"""Prometheus metrics for `/metrics`. Engine counters are read at scrape time; the spec-decode
ones carry vLLM's names (`vllm:spec_decode_num_drafts`, `..._num_draft_tokens`,
`..._num_accepted_tokens`, `..._num_accepted_tokens_per_pos{position}`), so dashboards built for
vLLM read them unchanged. The controller's decisions are under `specdecode:`."""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from specdecode.serving.async_engine import AsyncLLMEngine

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)


class _EngineCollector:
    def __init__(self, engine: AsyncLLMEngine, model_name: str) -> None:
        self.engine = engine
        self.labels = {"model_name": model_name}

    def _family(self, cls, name: str, doc: str, value: float, **extra):
        labels = {**self.labels, **extra}
        fam = cls(name, doc, labels=list(labels))
        fam.add_metric(list(labels.values()), value)
        return fam

    def collect(self):
        e = self.engine.engine
        counter = lambda n, d, v: self._family(CounterMetricFamily, n, d, v)  # noqa: E731
        gauge = lambda n, d, v: self._family(GaugeMetricFamily, n, d, v)  # noqa: E731
        sched, manager = e.scheduler, e.manager
        yield gauge(
            "vllm:num_requests_running", "Requests in the running batch.", len(sched.running)
        )
        yield gauge("vllm:num_requests_waiting", "Requests waiting to run.", len(sched.waiting))
        used = 1 - manager.num_free_blocks / max(1, manager.num_blocks - 1)
        yield gauge("vllm:kv_cache_usage_perc", "Fraction of KV-cache blocks in use.", used)
        yield counter(
            "vllm:num_preemptions", "Preemptions (recomputed later).", sched.num_preemptions
        )
        yield counter(
            "vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
            manager.prefix_queries,
        )  # fmt: skip
        yield counter(
            "vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.",
            manager.prefix_hits,
        )  # fmt: skip
        yield counter("vllm:prompt_tokens", "Prompt tokens received.", e.num_prompt_tokens)
        yield counter("vllm:generation_tokens", "Tokens generated.", e.num_generated_tokens)
        yield counter(
            "vllm:request_success", "Requests finished.", self.engine.num_finished_requests
        )
        yield counter(
            "specdecode:request_failures", "Requests ended by an error: an internal failure, "
            "or a grammar the vocabulary cannot complete (a 400 for that request).",
            self.engine.num_failed_requests,
        )  # fmt: skip
        yield counter(
            "specdecode:structured_forced_tokens", "Tokens a grammar forced (jump-ahead, no "
            "model choice).", e.num_forced_tokens,
        )  # fmt: skip
        stats = e.spec_stats
        yield counter(
            "vllm:spec_decode_num_drafts", "Verification steps with drafts.", stats.num_drafts
        )
        yield counter(
            "vllm:spec_decode_num_draft_tokens", "Draft tokens proposed.", stats.num_draft_tokens
        )
        yield counter(
            "vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.",
            stats.num_accepted_tokens,
        )  # fmt: skip
        per_pos = CounterMetricFamily(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted at each depth.",
            labels=[*self.labels, "position"],
        )
        for pos, n in enumerate(stats.accepted_per_position):
            per_pos.add_metric([*self.labels.values(), str(pos)], n)
        yield per_pos
        branch = getattr(e.drafter, "branch_stats", None)  # prompt_lookup_tokens on a head
        if branch is not None:
            yield counter(
                "specdecode:lookup_branch_accepted_tokens", "Accepted tokens the prompt-lookup "
                "branch added beyond the head's own drafts.", branch.accepted,
            )  # fmt: skip
            yield counter(
                "specdecode:lookup_branch_head_skipped", "Drafts where lookup matched and the "
                "head was not run (it was not paying for its time).", branch.head_skipped,
            )  # fmt: skip
        drafter = e.drafter
        corpus = getattr(getattr(drafter, "source", drafter), "corpus", None)  # suffix decoding
        if corpus is not None:
            yield gauge(
                "specdecode:suffix_corpus_requests", "Earlier answers suffix decoding drafts "
                "from (suffix_decoding_max_cached_requests at most).", len(corpus),
            )  # fmt: skip
            yield gauge(
                "specdecode:suffix_corpus_tokens", "Tokens of those answers "
                "(suffix_decoding_corpus_tokens at most).", corpus.num_tokens,
            )  # fmt: skip
        ctrl = e.controller.summary()
        yield self._family(
            GaugeMetricFamily, "specdecode:speculative_policy", "The policy in force (1).", 1,
            policy=ctrl["policy"],
        )  # fmt: skip
        yield gauge(
            "specdecode:speculative_budget", "Mean draft depth the controller gave decoding "
            "requests in the last step.", ctrl["mean_budget"],
        )  # fmt: skip
        yield gauge(
            "specdecode:speculating_fraction", "Fraction of decoding requests that drafted in "
            "the last step.", ctrl["speculating_fraction"],
        )  # fmt: skip
        yield gauge(
            "specdecode:lookup_alone_fraction", "Fraction of decoding requests planned to "
            "verify their lookup branch without the head (lite drafts) in the last step.",
            ctrl["lite_fraction"],
        )  # fmt: skip
        yield gauge(
            "specdecode:predicted_speedup", "The controller's predicted goodput of its plan over "
            "plain decoding, last step (1 when it does not plan: policy off or static, or over "
            "--speculative-disable-by-batch-size).", ctrl["predicted_gain"],
        )  # fmt: skip


class ServerMetrics:
    def __init__(self, engine: AsyncLLMEngine, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine, model_name))
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds", "Time to first token.", ["model_name"],
            buckets=_LATENCY_BUCKETS, registry=self.registry,
        )  # fmt: skip
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds", "Request latency, arrival to finish.",
            ["model_name"], buckets=_LATENCY_BUCKETS, registry=self.registry,
        )  # fmt: skip
        self.model_name = model_name
        engine.on_finish.append(self._finished)

    def _finished(self, seq, ttft: float, e2e: float) -> None:
        self.ttft.labels(self.model_name).observe(ttft)
        self.e2e.labels(self.model_name).observe(e2e)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
