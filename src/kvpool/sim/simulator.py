"""Replay a trace through the real KV cache manager and scheduler, in simulated time.

Nothing is faked on the cache side: requests enter the same
:class:`~kvpool.scheduler.Scheduler` and :class:`~kvpool.KVCacheManager` an
engine uses, with the chosen eviction policy. Only the model is simulated: a
:class:`CostModel` turns each step's work into seconds, the simulated clock
advances by that much, and "sampling" appends the trace's own output tokens.
Arrival times are honoured on the simulated clock (an idle engine jumps to the
next arrival), so queueing, time to first token and throughput can be
estimated along with hit rates, evictions and preemptions.

Decisions never read a wall clock, so a replay is bit-for-bit repeatable.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from kvpool.checks import check_int
from kvpool.errors import CapacityError, ConfigError
from kvpool.manager import KVCacheManager
from kvpool.request import Request
from kvpool.scheduler import ChunkDetail, Scheduler, SchedulerConfig, StopConditions
from kvpool.sim.traces import TraceRequest

if TYPE_CHECKING:
    from kvpool.eviction import FreeQueueFactory

__all__ = ["CostModel", "SimulationConfig", "SimulationResult", "policy_factory", "simulate"]


@dataclass(frozen=True, slots=True, kw_only=True)
class CostModel:
    """Seconds a step takes: a fixed overhead, plus prefill work per token, plus decode work per sequence.

    The defaults are of the order of an 8B model on one H100-class GPU
    (about 20k prefill tokens/s, a 10 ms decode step at small batch).
    """

    step_overhead_s: float = 0.010
    prefill_s_per_token: float = 50e-6
    decode_s_per_seq: float = 0.1e-3

    def __post_init__(self) -> None:
        for name in ("step_overhead_s", "prefill_s_per_token", "decode_s_per_seq"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < math.inf:
                raise ConfigError(f"cost model {name} must be a finite number >= 0, got {value!r}")

    def step_seconds(self, prefill_tokens: int, decode_seqs: int) -> float:
        return self.step_overhead_s + self.prefill_s_per_token * prefill_tokens + self.decode_s_per_seq * decode_seqs


@dataclass(frozen=True, slots=True, kw_only=True)
class SimulationConfig:
    """What to simulate: the pool, the policy, the scheduler limits and the cost model."""

    num_blocks: int
    block_size: int = 16
    policy: str = "lru"
    hash_algo: str = "sha256"
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    cost: CostModel = field(default_factory=CostModel)
    usage_interval_s: float = 1.0

    def __post_init__(self) -> None:
        check_int("num_blocks", self.num_blocks, minimum=2)
        interval = self.usage_interval_s
        if isinstance(interval, bool) or not isinstance(interval, int | float) or not 0 < interval < math.inf:
            raise ConfigError(f"usage_interval_s must be a finite number > 0, got {interval!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class SimulationResult:
    """Figures of one replay. Times are simulated seconds unless named wall_."""

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

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["usage_timeline"] = [list(p) for p in self.usage_timeline]
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


class _Live:
    """A request on its way through the simulated engine."""

    __slots__ = ("request", "outputs", "first_hit")

    def __init__(self, request: Request, outputs: Sequence[int]) -> None:
        self.request = request
        self.outputs = outputs
        self.first_hit: int | None = None


def simulate(
    trace: Iterable[TraceRequest],
    config: SimulationConfig,
    *,
    progress: Callable[[int], None] | None = None,
) -> SimulationResult:
    """Replay ``trace`` (sorted by arrival) and return the figures.

    A request that could never fit in the pool, even alone, is not admitted:
    it counts in ``rejected`` and the replay goes on. ``progress`` is called
    with the number of requests that finished since the last call.
    """
    started = time.perf_counter()
    requests = sorted(trace, key=lambda r: r.arrival_ms)
    manager = KVCacheManager(
        config.num_blocks,
        config.block_size,
        hash_algo=config.hash_algo,
        eviction_policy=policy_factory(config.policy),
    )
    clock = [0.0]
    scheduler = Scheduler(
        manager,
        SchedulerConfig(
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_num_seqs=config.max_num_seqs,
            chunk_detail=ChunkDetail.COUNTS,
        ),
        clock=lambda: clock[0],
    )
    cost = config.cost
    live: dict[str, _Live] = {}
    hits: list[int] = []
    full_blocks = hit_blocks = 0
    ttfts: list[float] = []
    queues: list[float] = []
    prompt_tokens = output_tokens = rejected = saved = computed_prefill = 0
    timeline: list[tuple[float, float]] = [(0.0, 0.0)]
    next_sample = config.usage_interval_s
    peak = 0.0
    first_arrival = requests[0].arrival_ms / 1000 if requests else 0.0
    clock[0] = first_arrival
    i = 0
    while i < len(requests) or scheduler.has_unfinished_requests():
        while i < len(requests) and requests[i].arrival_ms / 1000 <= clock[0]:
            trace_request = requests[i]
            i += 1
            request = Request(
                trace_request.request_id,
                trace_request.prompt_token_ids(),
                cache_salt=trace_request.cache_salt,
                lora_name=trace_request.lora_name,
            )
            stop = StopConditions(max_tokens=max(1, trace_request.output_length))
            try:
                scheduler.add_request(request, stop, arrival_time=trace_request.arrival_ms / 1000)
            except CapacityError:
                rejected += 1
                if progress is not None:
                    progress(1)
                continue
            live[request.request_id] = _Live(request, trace_request.output_token_ids())
            prompt_tokens += request.num_prompt_tokens
        if not scheduler.has_unfinished_requests():
            if i == len(requests):  # the last arrivals were all rejected
                break
            clock[0] = max(clock[0], requests[i].arrival_ms / 1000)
            continue
        output = scheduler.schedule()
        if output.is_empty:
            raise CapacityError(
                "the simulated engine cannot make progress: the pool is too small for any waiting request"
            )
        prefill_tokens = decode_seqs = 0
        sampled = {}
        for chunk in output.chunks:
            entry = live[chunk.request_id]
            if entry.first_hit is None:
                entry.first_hit = chunk.num_cached_tokens
                hits.append(chunk.num_cached_tokens)
                full = entry.request.num_prompt_tokens // config.block_size
                full_blocks += full
                hit_blocks += min(full, chunk.num_cached_tokens // config.block_size)
            saved += chunk.num_cached_tokens
            if chunk.start_position + chunk.num_tokens <= entry.request.num_prompt_tokens or chunk.num_tokens > 1:
                prefill_tokens += chunk.num_tokens
            else:
                decode_seqs += 1
            if chunk.sample:
                n = entry.request.num_output_tokens
                outputs = entry.outputs
                sampled[chunk.request_id] = outputs[n] if n < len(outputs) else 0
        computed_prefill += prefill_tokens
        clock[0] += cost.step_seconds(prefill_tokens, decode_seqs)
        usage = manager.usage
        peak = max(peak, usage)
        if clock[0] >= next_sample:
            timeline.append((clock[0] - first_arrival, usage))
            next_sample = clock[0] + config.usage_interval_s
        done = scheduler.update(output, sampled)
        for metrics in done:
            del live[metrics.request_id]
            scheduler.forget(metrics.request_id)
            output_tokens += metrics.num_output_tokens
            if metrics.time_to_first_token is not None:
                ttfts.append(metrics.time_to_first_token)
            if metrics.queue_time is not None:
                queues.append(metrics.queue_time)
        if done and progress is not None:
            progress(len(done))
    span = max(clock[0] - first_arrival, 1e-9)
    hit_tokens = sum(hits)
    return SimulationResult(
        policy=config.policy,
        num_blocks=config.num_blocks,
        block_size=config.block_size,
        requests=len(requests),
        rejected=rejected,
        prompt_tokens=prompt_tokens,
        hit_tokens=hit_tokens,
        token_hit_rate=hit_tokens / prompt_tokens if prompt_tokens else 0.0,
        block_hit_rate=hit_blocks / full_blocks if full_blocks else 0.0,
        prefill_tokens_computed=computed_prefill,
        prefill_tokens_saved=saved,
        evictions=manager.pool.num_evictions,
        preemptions=scheduler.num_preemptions,
        output_tokens=output_tokens,
        simulated_seconds=span,
        output_tokens_per_s=output_tokens / span,
        prompt_tokens_per_s=prompt_tokens / span,
        ttft_p50_s=_quantile(sorted(ttfts), 0.50),
        ttft_p90_s=_quantile(sorted(ttfts), 0.90),
        ttft_p99_s=_quantile(sorted(ttfts), 0.99),
        queue_p50_s=_quantile(sorted(queues), 0.50),
        queue_p90_s=_quantile(sorted(queues), 0.90),
        peak_usage=peak,
        usage_timeline=tuple(timeline),
        wall_seconds=time.perf_counter() - started,
    )
