"""Replay a trace through the real KV cache manager and scheduler, in simulated time.

Nothing is faked on the cache side: requests enter the same
:class:`~kvpool.scheduler.Scheduler` and :class:`~kvpool.KVCacheManager` an
engine uses, with the chosen eviction policy. Only the model is simulated: a
:class:`~kvpool.cost_model.CostProfile` turns each step's work into seconds
(``cost``, the built-in ``round-8b-h100`` unless another is given), the simulated clock
advances by that much, and "sampling" appends the trace's own output tokens.
Arrival times are honoured on the simulated clock (an idle engine jumps to the
next arrival), so queueing, time to first token and throughput can be
estimated along with hit rates, evictions and preemptions.

Offload tiers (``tiers``: the engine's specs, ``cpu:4GiB``...) sit below each
replica's GPU pool through the engine's own connector
(:class:`~kvpool.tiers.hierarchy.TierHierarchyConnector`, with the
``tier_write`` policy) and a worker that only keeps time
(:mod:`kvpool.sim.transfers`): the tokens each tier serves are the engine's. A
step that loads blocks from a tier takes that load's time on top of its compute
(loads are not overlapped with compute: a conservative model); saves are
accounted apart (``tier_save_seconds``), as they can overlap the next step.
A replica loads a tier's blocks only where that is faster than computing them
(``load_or_compute``, on by default): the engine's rule
(:class:`~kvpool.tiers.load_or_compute.LoadOrCompute`), measuring the links'
simulated times and the replica's own steps, from the links and the cost
model's prefill rate as priors. ``tier_blocks_computed`` counts the blocks a
tier held that were computed instead, ``load_decisions`` the requests decided
each way.

Several replicas (``replicas``): each has its own pool, scheduler and clock
(private tiers too; a shared tier, Redis, is one store for all). Each arrival is
routed by a rule of :mod:`kvpool.routing`, asked as ``kvpool route`` asks it
(:func:`~kvpool.routing.fleet_chooser`), seeing what a router that follows the
replicas' KV events would: each replica's cached prefix of the request (the
prompt's leading full blocks in its GPU pool or a tier, then those its requests
in flight are computing: :func:`~kvpool.routing.held_or_computing`) and its
requests in flight. The ``prefix`` rule weighs one request in flight at
``routing_load_cost`` blocks of 16 tokens (the router's ``--load-cost``, 8 unless
told), so a simulated fleet predicts the one behind ``kvpool route``.
The figure laws (``expected-ttft``, ``threshold``) see each replica as
:class:`~kvpool.routing.RoutingFigures` built from its own state: the same cached
prefix tokens, its requests in flight, the prompt tokens it has still to prefill
(those of a step still running at the arrival included), the cost profile's
prefill rate at a full batch and, as the decode step, the profile's step overhead
plus its requests in flight decoding (one sequence each).
The busy replica with the earliest clock steps next, and an arrival is routed
once every busy replica's clock has passed it: routing sees an idle replica as it
is, and a busy one as it will be when its current step ends (its load still
counts that step's requests and prefill tokens). A replica whose step begins at
the arrival's instant (one an earlier arrival of that instant woke) has started
it: requests that arrive together reach a replica's next step one after another,
as they reach a live server that began its step with the first of them.

Decisions never read a wall clock, so a replay is bit-for-bit repeatable.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from kvpool.checks import check_flag, check_int
from kvpool.connector import GPU
from kvpool.cost_model import CostProfile, default_profile
from kvpool.errors import CapacityError, ConfigError
from kvpool.hashing import BlockHash, HashAlgo
from kvpool.manager import KVCacheManager
from kvpool.request import Request
from kvpool.routing import DEFAULT_LOAD_COST, DEFAULT_ROUTING, Routing, RoutingFigures, fleet_chooser, held_or_computing
from kvpool.scheduler import ChunkDetail, RequestMetrics, Scheduler, SchedulerConfig, SchedulerOutput, StopConditions
from kvpool.sim.traces import TraceRequest
from kvpool.sim.transfers import DEFAULT_LINKS, KeyStore, TierLink, TimingWorker, build_tiers
from kvpool.specs import KVCacheGroup
from kvpool.tiers.hierarchy import TierHierarchyConnector
from kvpool.tiers.kinds import TierKind, WritePolicy
from kvpool.tiers.load_or_compute import LoadOrCompute
from kvpool.tiers.store import TierTarget

if TYPE_CHECKING:
    from kvpool.eviction import FreeQueueFactory

__all__ = [
    "ReplicaFigures",
    "RequestFigures",
    "SimulationConfig",
    "SimulationResult",
    "policy_factory",
    "simulate",
    "ttft_quantile",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class SimulationConfig:
    """What to simulate: the pool, its tiers, the replicas, the policy, the scheduler limits and the cost model."""

    num_blocks: int
    block_size: int = 16
    policy: str = "lru"
    hash_algo: str = HashAlgo.SHA256.value
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    #: Seconds a step takes (:mod:`kvpool.cost_model`); the default is its ``DEFAULT_PROFILE``.
    cost: CostProfile = field(default_factory=default_profile)
    usage_interval_s: float = 1.0
    tiers: tuple[TierTarget, ...] = ()
    tier_write: WritePolicy = WritePolicy.WRITE_THROUGH
    tier_links: Mapping[TierKind, TierLink] = field(default_factory=lambda: dict(DEFAULT_LINKS))
    replicas: int = 1
    routing: Routing = DEFAULT_ROUTING
    #: Load a tier's blocks only where that is faster than computing them (the engine's rule); False: always load.
    load_or_compute: bool = True
    #: The model's layer groups (a hybrid model's); empty: one full-attention group.
    groups: tuple[KVCacheGroup, ...] = ()
    #: A window group saves only the blocks a request can still read (default False: every full block).
    window_aware_saves: bool = False
    #: The prefix rule's weight of one request in flight, in cached blocks of 16 tokens (``kvpool route
    #: --load-cost``); None: :data:`~kvpool.routing.DEFAULT_LOAD_COST`.
    routing_load_cost: float | None = None

    def __post_init__(self) -> None:
        check_int("num_blocks", self.num_blocks, minimum=2)
        cost_ok = self.routing_load_cost is None or (
            not isinstance(self.routing_load_cost, bool)
            and isinstance(self.routing_load_cost, int | float)
            and 0 < self.routing_load_cost < math.inf
        )
        if not cost_ok:
            raise ConfigError(f"routing_load_cost must be a finite number > 0 or None, got {self.routing_load_cost!r}")
        check_flag("load_or_compute", self.load_or_compute)
        check_flag("window_aware_saves", self.window_aware_saves)
        if not isinstance(self.cost, CostProfile):
            raise ConfigError(f"cost must be a CostProfile, got {self.cost!r}")
        if not isinstance(self.groups, tuple) or not all(isinstance(g, KVCacheGroup) for g in self.groups):
            raise ConfigError(f"groups must be a tuple of KVCacheGroup, got {self.groups!r}")
        check_int("replicas", self.replicas)
        interval = self.usage_interval_s
        if isinstance(interval, bool) or not isinstance(interval, int | float) or not 0 < interval < math.inf:
            raise ConfigError(f"usage_interval_s must be a finite number > 0, got {interval!r}")
        kinds = [t.kind for t in self.tiers]
        if len(set(kinds)) != len(kinds):
            raise ConfigError(f"each tier kind may appear once, got {[k.value for k in kinds]}")
        if not isinstance(self.tier_write, WritePolicy):
            raise ConfigError(f"tier_write must be a WritePolicy, got {self.tier_write!r}")
        missing = [k.value for k in kinds if k not in self.tier_links]
        if missing:
            raise ConfigError(f"tier_links has no link for the tiers {missing}")
        if not isinstance(self.routing, Routing):
            raise ConfigError(f"routing must be a Routing, got {self.routing!r}")

    @property
    def block_bytes(self) -> int:
        return self.block_size * self.cost.kv_bytes_per_token


@dataclass(frozen=True, slots=True, kw_only=True)
class ReplicaFigures:
    """What one replica did."""

    requests: int
    prompt_tokens: int
    hit_tokens: int
    prefill_tokens_computed: int
    busy_seconds: float  # simulated time spent in steps


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestFigures:
    """What one finished request met: where it ran, the prompt tokens it found cached, its first token.

    ``cached_tokens`` is counted at its first admission, as a server's ``usage.prompt_tokens_details.cached_tokens``
    reports it (a preempted request keeps its first count); ``replica`` is its replica's index.
    """

    request_id: str
    replica: int
    prompt_tokens: int
    cached_tokens: int
    arrival_s: float
    ttft_s: float | None


@dataclass(frozen=True, slots=True, kw_only=True)
class SimulationResult:
    """Figures of one replay. Times are simulated seconds unless named wall_.

    ``hit_tokens_by_tier``: where the cached tokens of every admission were
    found (``gpu``, then each tier), as the engine's scheduler counts them
    (``LLMEngine.cached_tokens_by_tier``); they add up to ``prefill_tokens_saved``. ``request_imbalance`` and
    ``work_imbalance``: the busiest replica's requests and prefill tokens computed,
    over the mean (1.0 is perfectly even). ``offered_prefill_tokens_per_s``: the
    prompt tokens not served from cache over the trace's arrival span (None when
    every request arrives at once); ``servable_prefill_tokens_per_s``: what the
    replicas compute at most (full prefill batches, no decode); ``overloaded`` when
    the first exceeds the second, and the queue then grows for as long as that lasts.
    """

    policy: str
    num_blocks: int
    block_size: int
    requests: int
    rejected: int  # requests larger than the whole pool
    prompt_tokens: int
    hit_tokens: int  # cached tokens at each request's first admission
    token_hit_rate: float
    block_hit_rate: float
    prefill_tokens_computed: int  # recomputation after preemption included
    prefill_tokens_saved: int  # cached tokens over all admissions
    evictions: int
    preemptions: int
    output_tokens: int
    simulated_seconds: float
    output_tokens_per_s: float
    prompt_tokens_per_s: float
    ttft_p50_s: float
    ttft_p90_s: float
    ttft_p99_s: float
    queue_p50_s: float
    queue_p90_s: float
    peak_usage: float
    usage_timeline: tuple[tuple[float, float], ...]
    wall_seconds: float
    replicas: int = 1
    routing: str = DEFAULT_ROUTING.value
    hit_tokens_by_tier: dict[str, int] = field(default_factory=dict)
    tier_load_seconds: float = 0.0
    tier_save_seconds: float = 0.0
    per_replica: tuple[ReplicaFigures, ...] = ()
    request_imbalance: float = 1.0
    work_imbalance: float = 1.0
    offered_prefill_tokens_per_s: float | None = None
    servable_prefill_tokens_per_s: float = 0.0
    overloaded: bool = False
    #: (time, requests waiting over all replicas), sampled with the usage.
    queue_timeline: tuple[tuple[float, int], ...] = ()
    #: (time of the first token, time to first token) of every finished request, in finishing order.
    ttft_points: tuple[tuple[float, float], ...] = ()
    #: Per tier, blocks it held that load or compute computed instead (empty when the rule is off).
    tier_blocks_computed: dict[str, int] = field(default_factory=dict)
    #: Admitted requests the tiers offered blocks, by the rule's decision (``loaded``, ``cut``, ``computed``,
    #: ``probed``; empty when the rule is off).
    load_decisions: dict[str, int] = field(default_factory=dict)
    #: Every finished request's figures, in finishing order (a benchmark's per-request comparison).
    request_figures: tuple[RequestFigures, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        del out["ttft_points"]  # one pair per request: for plots, not for the JSON summary
        del out["request_figures"]  # likewise
        out["usage_timeline"] = [list(p) for p in self.usage_timeline]
        out["queue_timeline"] = [list(p) for p in self.queue_timeline]
        return out


def policy_factory(name: str) -> FreeQueueFactory:
    """The free-block structure of an eviction policy, by name (see ``kvpool.eviction``)."""
    from kvpool.eviction import resolve_policy

    return resolve_policy(name)[1]


def _quantile(values: Sequence[float], q: float) -> float:
    if not values:
        return 0.0
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[round(q * 100) - 1]


def ttft_quantile(result: SimulationResult, percentile: float) -> float:
    """The time to first token at ``percentile`` (0 < p < 100) of the finished requests, interpolated; 0.0 with none."""
    if isinstance(percentile, bool) or not isinstance(percentile, int | float) or not 0 < percentile < 100:
        raise ConfigError(f"percentile must be a number between 0 and 100 (exclusive), got {percentile!r}")
    values = sorted(t for _, t in result.ttft_points)
    if not values:
        return 0.0
    position = (len(values) - 1) * percentile / 100
    low = math.floor(position)
    high = min(low + 1, len(values) - 1)
    return values[low] + (values[high] - values[low]) * (position - low)


class _Live:
    """A request on its way through a simulated replica."""

    __slots__ = ("request", "outputs", "first_hit", "to_prefill", "prompt_blocks")

    def __init__(self, request: Request, outputs: Sequence[int], prompt_blocks: Sequence[BlockHash]) -> None:
        self.request = request
        self.outputs = outputs
        self.first_hit: int | None = None
        self.to_prefill = request.num_prompt_tokens  # prompt tokens not yet computed or found cached
        self.prompt_blocks = prompt_blocks  # what a router counts as computing here while it is in flight


class _Replica:
    """One simulated engine: a pool (with its tiers), a scheduler, a clock, and its counters."""

    def __init__(self, config: SimulationConfig, shared: dict[TierKind, KeyStore], start: float) -> None:
        self.config = config
        self.manager = KVCacheManager(
            config.num_blocks,
            config.block_size,
            groups=config.groups or None,
            hash_algo=config.hash_algo,
            eviction_policy=policy_factory(config.policy),
        )
        self.connector: TierHierarchyConnector | None = None
        self.worker: TimingWorker | None = None
        if config.tiers:
            per_token = config.cost.prefill_rate(config.max_num_batched_tokens)  # a block computed in a full batch
            self.connector, self.worker = build_tiers(
                config.tiers,
                self.manager,
                block_bytes=config.block_bytes,
                write=config.tier_write,
                links=config.tier_links,
                shared=shared,
                prefill_tokens_per_s=1 / per_token if config.load_or_compute and per_token > 0 else None,
                window_aware_saves=config.window_aware_saves,
            )
        self.clock = start
        self.scheduler = Scheduler(
            self.manager,
            SchedulerConfig(
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_num_seqs=config.max_num_seqs,
                chunk_detail=ChunkDetail.COUNTS,
            ),
            clock=lambda: self.clock,
            connector=self.connector,
        )
        self.live: dict[str, _Live] = {}
        self.computing: dict[BlockHash, int] = {}  # prompt blocks of the requests in flight -> how many hold each
        self.first_hits: dict[str, int] = {}  # finished request -> its cached tokens at its first admission
        self.pending_prefill = 0  # prompt tokens still to prefill here, the step in flight excluded
        self.in_flight_prefill = 0  # prefill tokens of the step that ends at `clock`
        self.ending = 0  # requests that step finished: in flight until it ends
        self.requests = self.prompt_tokens = self.hit_tokens = self.computed = self.saved = 0
        self.full_blocks = self.hit_blocks = 0
        self.load_seconds = self.save_seconds = self.busy_seconds = 0.0

    @property
    def busy(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def in_flight(self, now: float) -> int:
        """The requests in flight here a router sees at ``now``: those live, and those the running step ends."""
        return len(self.live) + (self.ending if self.clock > now else 0)

    def load(self, now: float) -> int:
        """The load a router sees at ``now``: prompt tokens still to prefill, the step still running included."""
        return self.pending_prefill + (self.in_flight_prefill if self.clock > now else 0)

    def routed_prefix_tokens(self, request: Request) -> int:
        """What a router following this replica's events counts of the request's prefix here, in tokens.

        The prompt's leading full blocks held in the GPU pool or a tier, then each next one a
        request in flight here is computing (:func:`~kvpool.routing.held_or_computing`, the
        router's rule); changes nothing.
        """
        self.manager.hash_request(request)
        _, num_hit = self.manager.coordinator.find_longest_cache_hit(request, request.num_tokens)
        if self.connector is not None:
            num_hit += self.connector.preview_match(request, num_hit).num_tokens
        bs = self.config.block_size
        return held_or_computing(request.block_hashes, num_hit // bs, self.computing) * bs

    def add(self, trace_request: TraceRequest, request: Request) -> bool:
        """Queue a request; False when it could never fit in this pool."""
        stop = StopConditions(max_tokens=max(1, trace_request.output_length))
        try:
            self.scheduler.add_request(request, stop, arrival_time=trace_request.arrival_ms / 1000)
        except CapacityError:
            return False
        # An idle replica's clock jumps to the arrival; a busy one's is already past it (see simulate).
        self.clock = max(self.clock, trace_request.arrival_ms / 1000)
        blocks: list[BlockHash] = []
        if self.config.replicas > 1:  # only routing reads them
            self.manager.hash_request(request)
            blocks = request.block_hashes
            for h in blocks:
                self.computing[h] = self.computing.get(h, 0) + 1
        self.live[request.request_id] = _Live(request, trace_request.output_token_ids(), blocks)
        self.requests += 1
        self.prompt_tokens += request.num_prompt_tokens
        self.pending_prefill += request.num_prompt_tokens
        return True

    def _before_forward(self, output: SchedulerOutput) -> SchedulerOutput:
        """The engine's order: spills out, then loads in (failed ones computed), before the forward pass."""
        meta, worker = output.connector_meta, self.worker
        if meta is None or worker is None or not (meta.loads or meta.spills):
            return output
        worker.start_load(meta)
        return self.scheduler.apply_transfers(output, worker.get_finished())

    def _after_forward(self, output: SchedulerOutput) -> SchedulerOutput:
        meta, worker = output.connector_meta, self.worker
        if meta is None or worker is None or not meta.saves:
            return output
        worker.save(meta)
        return self.scheduler.apply_transfers(output, worker.get_finished())

    def step(self) -> list[RequestMetrics]:
        """Plan, time and apply one step; the finished requests' figures."""
        config, scheduler = self.config, self.scheduler
        output = scheduler.schedule()
        if output.is_empty:
            raise CapacityError(
                "the simulated engine cannot make progress: the pool is too small for any waiting request"
            )
        output = self._before_forward(output)
        for rid in output.preempted:  # its prompt will be computed again (less what it then finds cached)
            entry = self.live[rid]
            self.pending_prefill += entry.request.num_prompt_tokens - entry.to_prefill
            entry.to_prefill = entry.request.num_prompt_tokens
        prefill_tokens = decode_seqs = context_tokens = 0
        sampled = {}
        bs = config.block_size
        for chunk in output.chunks:
            entry = self.live[chunk.request_id]
            request = entry.request
            if entry.first_hit is None:
                entry.first_hit = chunk.num_cached_tokens
                self.hit_tokens += chunk.num_cached_tokens
                full = request.num_prompt_tokens // bs
                self.full_blocks += full
                self.hit_blocks += min(full, chunk.num_cached_tokens // bs)
            self.saved += chunk.num_cached_tokens
            context_tokens += chunk.start_position  # the KV this chunk's attention reads
            end = chunk.start_position + chunk.num_tokens
            left = max(0, request.num_prompt_tokens - end)
            self.pending_prefill -= entry.to_prefill - left
            entry.to_prefill = left
            if end <= request.num_prompt_tokens or chunk.num_tokens > 1:
                prefill_tokens += chunk.num_tokens
            else:
                decode_seqs += 1
            if chunk.sample:
                n = request.num_output_tokens
                outputs = entry.outputs
                sampled[chunk.request_id] = outputs[n] if n < len(outputs) else 0
        output = self._after_forward(output)
        self.computed += prefill_tokens
        self.in_flight_prefill = prefill_tokens
        seconds = config.cost.step_seconds(prefill_tokens, decode_seqs, context_tokens=context_tokens)
        if self.worker is not None:
            if self.worker.costs is not None:
                self.worker.costs.note_prefill(prefill_tokens, seconds)
            load = self.worker.take_load_seconds()
            self.load_seconds += load
            self.save_seconds += self.worker.take_save_seconds()
            seconds += load
        self.clock += seconds
        self.busy_seconds += seconds
        done = scheduler.update(output, sampled)
        self.ending = len(done)
        for metrics in done:
            entry = self.live.pop(metrics.request_id)
            self.first_hits[metrics.request_id] = entry.first_hit or 0
            for h in entry.prompt_blocks:
                n = self.computing[h] - 1
                if n:
                    self.computing[h] = n
                else:
                    del self.computing[h]
            scheduler.forget(metrics.request_id)
        return done

    def decisions(self) -> dict[str, Any]:
        """The load-or-compute rule's figures (:meth:`LoadOrCompute.figures`), or {} without it."""
        chooser = self.connector.chooser if self.connector is not None else None
        return chooser.figures() if isinstance(chooser, LoadOrCompute) else {}

    def figures(self) -> ReplicaFigures:
        return ReplicaFigures(
            requests=self.requests,
            prompt_tokens=self.prompt_tokens,
            hit_tokens=self.hit_tokens,
            prefill_tokens_computed=self.computed,
            busy_seconds=self.busy_seconds,
        )


def _imbalance(values: Sequence[float]) -> float:
    mean = sum(values) / len(values)
    return max(values) / mean if mean else 1.0


def simulate(
    trace: Iterable[TraceRequest],
    config: SimulationConfig,
    *,
    progress: Callable[[int], None] | None = None,
) -> SimulationResult:
    """Replay ``trace`` (sorted by arrival) and return the figures.

    A request that could never fit in a replica's pool, even alone, is not
    admitted: it counts in ``rejected`` and the replay goes on. ``progress`` is
    called with the number of requests that finished since the last call.
    """
    started = time.perf_counter()
    requests = sorted(trace, key=lambda r: r.arrival_ms)
    first_arrival = requests[0].arrival_ms / 1000 if requests else 0.0
    shared: dict[TierKind, KeyStore] = {}
    replicas = [_Replica(config, shared, first_arrival) for _ in range(config.replicas)]
    load_cost = DEFAULT_LOAD_COST if config.routing_load_cost is None else config.routing_load_cost
    rule = fleet_chooser(config.routing, load_cost=load_cost)
    by_figures = config.routing in (Routing.EXPECTED_TTFT, Routing.THRESHOLD)
    wants_prefixes = config.routing is Routing.PREFIX and len(replicas) > 1
    cost = config.cost
    chunk = config.max_num_batched_tokens
    prefill_rate = 1.0 / cost.prefill_rate(chunk)
    no_prefixes = [0] * len(replicas)
    ttfts: list[float] = []
    queues: list[float] = []
    ttft_points: list[tuple[float, float]] = []
    request_figures: list[RequestFigures] = []
    output_tokens = rejected = 0
    timeline: list[tuple[float, float]] = [(0.0, 0.0)]
    queue_timeline: list[tuple[float, int]] = [(0.0, 0)]
    next_sample = first_arrival + config.usage_interval_s
    peak = 0.0
    i = 0
    while True:
        busy = [r for r in replicas if r.busy]
        stepping = min(busy, key=lambda r: r.clock) if busy else None
        if i < len(requests) and (stepping is None or requests[i].arrival_ms / 1000 < stepping.clock):
            trace_request = requests[i]
            i += 1
            request = Request(
                trace_request.request_id,
                trace_request.prompt_token_ids(),
                cache_salt=trace_request.cache_salt,
                lora_name=trace_request.lora_name,
            )
            if len(replicas) == 1:
                target = replicas[0]
            elif by_figures:
                now = trace_request.arrival_ms / 1000
                figures = [
                    RoutingFigures(
                        cached_tokens=r.routed_prefix_tokens(request),
                        in_flight=r.in_flight(now),
                        prefill_pending=r.load(now),
                        prefill_tokens_per_s=prefill_rate,
                        decode_step_s=cost.step_overhead_s + cost.decode_s_per_seq * len(r.live),
                        chunk_tokens=chunk,
                    )
                    for r in replicas
                ]
                target = replicas[rule.pick(figures, request.num_prompt_tokens)]
            else:
                cached = [r.routed_prefix_tokens(request) for r in replicas] if wants_prefixes else no_prefixes
                now = trace_request.arrival_ms / 1000
                target = replicas[rule.choose(cached, [r.in_flight(now) for r in replicas])]
            if not target.add(trace_request, request):
                rejected += 1
                if progress is not None:
                    progress(1)
            continue
        if stepping is None:
            break
        done = stepping.step()
        now = stepping.clock
        usage = sum(r.manager.usage for r in replicas) / len(replicas)
        peak = max(peak, stepping.manager.usage)
        if now >= next_sample:
            timeline.append((now - first_arrival, usage))
            queue_timeline.append((now - first_arrival, sum(r.scheduler.num_waiting for r in replicas)))
            next_sample = now + config.usage_interval_s
        for metrics in done:
            output_tokens += metrics.num_output_tokens
            request_figures.append(
                RequestFigures(
                    request_id=metrics.request_id,
                    replica=replicas.index(stepping),
                    prompt_tokens=metrics.num_prompt_tokens,
                    cached_tokens=stepping.first_hits.pop(metrics.request_id),
                    arrival_s=metrics.arrival_time,
                    ttft_s=metrics.time_to_first_token,
                )
            )
            if metrics.time_to_first_token is not None:
                ttfts.append(metrics.time_to_first_token)
                ttft_points.append(
                    (metrics.arrival_time + metrics.time_to_first_token - first_arrival, metrics.time_to_first_token)
                )
            if metrics.queue_time is not None:
                queues.append(metrics.queue_time)
        if done and progress is not None:
            progress(len(done))
    end = max(r.clock for r in replicas)
    span = max(end - first_arrival, 1e-9)
    prompt_tokens = sum(r.prompt_tokens for r in replicas)
    hit_tokens = sum(r.hit_tokens for r in replicas)
    full_blocks = sum(r.full_blocks for r in replicas)
    by_tier = {GPU: 0} | {target.kind.value: 0 for target in config.tiers}
    for r in replicas:
        for name, tokens in r.scheduler.cached_tokens_by_tier.items():
            by_tier[name] += tokens
    arrival_span = (requests[-1].arrival_ms / 1000 - first_arrival) if requests else 0.0
    offered = (prompt_tokens - hit_tokens) / arrival_span if arrival_span > 0 else None
    servable = len(replicas) * config.cost.servable_prefill_tokens_per_s(config.max_num_batched_tokens)
    blocks_computed, decisions = _decisions(replicas)
    ttfts.sort()
    queues.sort()
    return SimulationResult(
        policy=config.policy,
        num_blocks=config.num_blocks,
        block_size=config.block_size,
        requests=len(requests),
        rejected=rejected,
        prompt_tokens=prompt_tokens,
        hit_tokens=hit_tokens,
        token_hit_rate=hit_tokens / prompt_tokens if prompt_tokens else 0.0,
        block_hit_rate=sum(r.hit_blocks for r in replicas) / full_blocks if full_blocks else 0.0,
        prefill_tokens_computed=sum(r.computed for r in replicas),
        prefill_tokens_saved=sum(r.saved for r in replicas),
        evictions=sum(r.manager.pool.num_evictions for r in replicas),
        preemptions=sum(r.scheduler.num_preemptions for r in replicas),
        output_tokens=output_tokens,
        simulated_seconds=span,
        output_tokens_per_s=output_tokens / span,
        prompt_tokens_per_s=prompt_tokens / span,
        ttft_p50_s=_quantile(ttfts, 0.50),
        ttft_p90_s=_quantile(ttfts, 0.90),
        ttft_p99_s=_quantile(ttfts, 0.99),
        queue_p50_s=_quantile(queues, 0.50),
        queue_p90_s=_quantile(queues, 0.90),
        peak_usage=peak,
        usage_timeline=tuple(timeline),
        wall_seconds=time.perf_counter() - started,
        replicas=len(replicas),
        routing=config.routing.value,
        hit_tokens_by_tier=by_tier,
        tier_load_seconds=sum(r.load_seconds for r in replicas),
        tier_save_seconds=sum(r.save_seconds for r in replicas),
        per_replica=tuple(r.figures() for r in replicas),
        request_imbalance=_imbalance([r.requests for r in replicas]),
        work_imbalance=_imbalance([r.computed for r in replicas]),
        offered_prefill_tokens_per_s=offered,
        servable_prefill_tokens_per_s=servable,
        overloaded=offered is not None and offered > servable,
        queue_timeline=tuple(queue_timeline),
        ttft_points=tuple(ttft_points),
        tier_blocks_computed=blocks_computed,
        load_decisions=decisions,
        request_figures=tuple(request_figures),
    )


def _decisions(replicas: Sequence[_Replica]) -> tuple[dict[str, int], dict[str, int]]:
    """The load-or-compute rule's decisions over ``replicas``: per tier the blocks computed, per way the requests."""
    blocks: dict[str, int] = {}
    requests: dict[str, int] = {}
    for replica in replicas:
        figures = replica.decisions()
        for name, tier in figures.get("tiers", {}).items():
            blocks[name] = blocks.get(name, 0) + tier["blocks_computed"]
        for way, count in figures.get("requests", {}).items():
            requests[way] = requests.get(way, 0) + count
    return blocks, requests
