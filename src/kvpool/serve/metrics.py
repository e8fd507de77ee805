"""Prometheus metrics under vLLM's names, so a vLLM dashboard reads kvpool with a prefix change.

Every metric lives in the server's own ``CollectorRegistry`` (no global
state: two servers in one process count apart) and carries a ``model_name``
label, as vLLM's do. Names are the prefix (``kvpool:`` by default,
``--metrics-prefix vllm:`` for vLLM's) followed by vLLM's suffix:

======================================  =========  ===================================================
suffix                                  type       what
======================================  =========  ===================================================
``num_requests_running``                gauge      requests in the running batch
``num_requests_waiting``                gauge      requests waiting for admission (or preempted)
``kv_cache_usage_perc``                 gauge      fraction of KV blocks in use, 0..1
``prefix_cache_queries_total``          counter    prompt tokens looked up in the prefix cache
``prefix_cache_hits_total``             counter    of those, tokens found cached
``prefix_cache_hits_by_tier_total``     counter    prompt tokens taken from each source, by ``tier``
                                                   (``gpu``: the pool; then each KV offload tier)
``num_preemptions_total``               counter    requests preempted (their blocks taken back)
``prompt_tokens_total``                 counter    prompt tokens of finished requests
``generation_tokens_total``             counter    tokens generated
``request_success_total``               counter    finished requests, by ``finished_reason``
``time_to_first_token_seconds``         histogram  arrival to first token
``inter_token_latency_seconds``         histogram  between consecutive tokens of a request
``request_time_per_output_token_seconds`` histogram  a request's mean time per token after the first
``e2e_request_latency_seconds``         histogram  arrival to finish
``request_queue_time_seconds``          histogram  arrival to first scheduled
======================================  =========  ===================================================

The engine thread updates them after every step (``prometheus_client`` is
thread-safe); the HTTP side only renders them.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvpool.errors import ConfigError

if TYPE_CHECKING:
    from kvpool.engine.llm_engine import LLMEngine
    from kvpool.engine.outputs import RequestDelta, RequestOutput

__all__ = ["DEFAULT_PREFIX", "ServerMetrics", "check_prefix"]

DEFAULT_PREFIX = "kvpool:"

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0)
_TOKEN_BUCKETS = (0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0)
_E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 300.0)


def check_prefix(prefix: str) -> str:
    """A metric name prefix: letters, digits, ``_`` and ``:``, not starting with a digit."""
    ok = (
        isinstance(prefix, str)
        and bool(prefix)
        and not prefix[0].isdigit()
        and all(c.isascii() and (c.isalnum() or c in "_:") for c in prefix)
    )
    if not ok:
        raise ConfigError(f"a metrics prefix is letters, digits, '_' and ':' (e.g. 'vllm:'), got {prefix!r}")
    return prefix


class ServerMetrics:
    """The server's metrics; :meth:`after_step` is the engine loop's step hook."""

    def __init__(self, model_name: str, prefix: str = DEFAULT_PREFIX) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        prefix = check_prefix(prefix)
        self.registry = CollectorRegistry(auto_describe=True)
        labels = ("model_name",)
        registry = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(prefix + name, doc, labels, registry=registry, multiprocess_mode="livesum").labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(prefix + name, doc, labels, registry=registry).labels(model_name)

        def histogram(name: str, doc: str, buckets: Sequence[float]) -> Histogram:
            return Histogram(prefix + name, doc, labels, registry=registry, buckets=buckets).labels(model_name)

        self.running = gauge("num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("num_requests_waiting", "Requests waiting for admission.")
        self.usage = gauge("kv_cache_usage_perc", "Fraction of KV cache blocks in use (1 means 100 percent).")
        self.queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.preemptions = counter("num_preemptions", "Requests preempted.")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self._success = Counter(
            prefix + "request_success",
            "Finished requests, by finish reason.",
            ("model_name", "finished_reason"),
            registry=registry,
        )
        self._by_tier = Counter(
            prefix + "prefix_cache_hits_by_tier",
            "Prompt tokens taken from each cache tier (gpu: the pool, then each KV offload tier).",
            ("model_name", "tier"),
            registry=registry,
        )
        self._model_name = model_name
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.", _LATENCY_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between consecutive tokens.", _TOKEN_BUCKETS)
        self.tpot = histogram(
            "request_time_per_output_token_seconds", "A request's mean time per output token.", _TOKEN_BUCKETS
        )
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to finish.", _E2E_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds", "Arrival to first scheduled.", _E2E_BUCKETS)
        self._queries_seen = 0
        self._hits_seen = 0
        self._preemptions_seen = 0
        self._tier_seen: dict[str, int] = {}
        self._last_token: dict[str, float] = {}

    def after_step(self, engine: LLMEngine, deltas: Sequence[RequestDelta]) -> None:
        """Bring every figure up to date after one engine step (engine thread)."""
        now = time.monotonic()
        scheduler = engine.scheduler
        self.running.set(scheduler.num_running)
        self.waiting.set(scheduler.num_waiting)
        self.usage.set(engine.manager.usage)
        stats = engine.manager.prefix_cache_stats
        queries = stats.queries + stats.preempted_queries
        hits = stats.hits + stats.preempted_hits
        self.queries.inc(queries - self._queries_seen)
        self.hits.inc(hits - self._hits_seen)
        self._queries_seen, self._hits_seen = queries, hits
        self.preemptions.inc(scheduler.num_preemptions - self._preemptions_seen)
        self._preemptions_seen = scheduler.num_preemptions
        for tier, tokens in engine.cached_tokens_by_tier.items():
            seen = self._tier_seen.get(tier, 0)
            if tokens != seen:
                self._by_tier.labels(self._model_name, tier).inc(tokens - seen)
                self._tier_seen[tier] = tokens
        last_token = self._last_token
        for delta in deltas:
            self.generation_tokens.inc(len(delta.token_ids))
            previous = last_token.get(delta.request_id)
            if previous is not None:
                self.itl.observe(now - previous)
            if delta.output is not None:
                last_token.pop(delta.request_id, None)
                self._finished(delta.output)
            else:
                last_token[delta.request_id] = now
        if len(last_token) > scheduler.num_running + scheduler.num_waiting:
            # aborted requests send no last delta: forget the ones the engine no longer knows
            live = set(scheduler.running_ids()) | set(scheduler.waiting_ids())
            for request_id in [r for r in last_token if r not in live]:
                del last_token[request_id]

    def _finished(self, output: RequestOutput) -> None:
        self.prompt_tokens.inc(output.num_prompt_tokens)
        self._success.labels(self._model_name, output.finish_reason.value).inc()
        if output.time_to_first_token is not None:
            self.ttft.observe(output.time_to_first_token)
            if output.latency is not None and output.num_output_tokens > 1:
                self.tpot.observe((output.latency - output.time_to_first_token) / (output.num_output_tokens - 1))
        if output.latency is not None:
            self.e2e.observe(output.latency)
        if output.queue_time is not None:
            self.queue_time.observe(output.queue_time)

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type."""
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST
