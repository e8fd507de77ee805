"""A whole simulation study from :class:`~kvpool.sim.options.SimulateOptions`: what ``kvpool simulate`` runs.

:func:`load_requests` reads (or generates) the trace once; :func:`run_study`
replays it as the options ask (sequentially, once per routing rule, as a
sizing search, and the hit-rate curve) and returns a :class:`StudyReport`
that holds every figure; drawing and printing are the caller's. Progress goes
to a :class:`~kvpool.sim.progress.Progress`, silent by default.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, replace
from itertools import islice
from typing import Any

from kvpool.errors import ConfigError
from kvpool.routing import Routing
from kvpool.sim.options import SYNTHETIC_REQUESTS, SimulateOptions
from kvpool.sim.progress import Progress
from kvpool.sim.sequential import SequentialResult, replay_sequential
from kvpool.sim.simulator import SimulationConfig, SimulationResult, simulate, ttft_quantile
from kvpool.sim.sizing import SizingResult, fewest_replicas
from kvpool.sim.traces import TraceRequest
from kvpool.sim.transfers import capacity_blocks
from kvpool.tiers.store import BACKENDS

__all__ = ["CurveResult", "Progress", "StudyReport", "describe_tiers", "load_requests", "run_study"]


@dataclass(frozen=True, slots=True, kw_only=True)
class CurveResult:
    """Token hit rates of the sequential model per cache size: each policy's, and the optimum's."""

    sizes: tuple[int, ...]
    lookahead: int
    token_hit_rate: dict[str, list[float]]

    def to_dict(self) -> dict[str, Any]:
        return {"sizes": list(self.sizes), "lookahead": self.lookahead, "token_hit_rate": self.token_hit_rate}


@dataclass(frozen=True, slots=True, kw_only=True)
class StudyReport:
    """Every figure of a study; the fields its options did not ask for are empty or None."""

    requests: int
    tiers: list[dict[str, Any]] = field(default_factory=list)
    sequential: SequentialResult | None = None
    results: dict[Routing, SimulationResult] = field(default_factory=dict)
    sizing: dict[str, SizingResult] | None = None
    curve: CurveResult | None = None


def load_requests(options: SimulateOptions) -> list[TraceRequest]:
    """The requests to replay: generated for ``synthetic:KIND``, else read from the file, no further than needed."""
    kind = options.synthetic
    if kind is not None:
        from kvpool.sim.workloads import generate_workload

        count = SYNTHETIC_REQUESTS if options.requests is None else options.requests
        requests = generate_workload(kind, num_requests=count, seed=options.seed)
    else:
        from kvpool.sim.traces import iter_trace

        requests = list(islice(iter_trace(options.trace), options.requests))
    if not requests:
        raise ConfigError(f"trace {options.trace} holds no requests")
    scale = options.arrival_rate_scale
    if scale != 1.0:
        requests = [replace(r, arrival_ms=r.arrival_ms / scale) for r in requests]
    return requests


def describe_tiers(options: SimulateOptions) -> list[dict[str, Any]]:
    """Per tier: its capacity, write policy, link, and one block's load time against recomputing it."""
    cost = options.cost
    block_bytes = options.block_size * cost.kv_bytes_per_token
    recompute = options.block_size * cost.prefill_rate(options.max_num_batched_tokens)  # in a full batch
    described = []
    for target in options.tier_targets:
        link = options.tier_links[target.kind]
        load = link.seconds(1, block_bytes)
        described.append(
            {
                "kind": target.kind.value,
                "capacity_blocks": capacity_blocks(target, block_bytes),
                "write": options.kv_tier_write.value,
                "bandwidth_gb_per_s": link.bandwidth_bytes_per_s / 1e9,
                "latency_us": link.latency_s * 1e6,
                "shared": BACKENDS[target.kind].fleet_wide,
                "load_ms_per_block": load * 1e3,
                "recompute_ms_per_block": recompute * 1e3,
            }
        )
    return described


def _config(options: SimulateOptions) -> SimulationConfig:
    return SimulationConfig(
        num_blocks=options.num_blocks,
        block_size=options.block_size,
        policy=options.policy,
        hash_algo=options.block_hash,
        max_num_batched_tokens=options.max_num_batched_tokens,
        max_num_seqs=options.max_num_seqs,
        cost=options.cost,
        tiers=options.tier_targets,
        tier_write=options.kv_tier_write,
        load_or_compute=options.load_or_compute,
        tier_links=options.tier_links,
        replicas=options.replicas,
        routing=options.rules[0],
        groups=options.groups,
        window_aware_saves=options.window_aware_saves,
        routing_load_cost=options.routing_load_cost,
    )


def _replay(requests: list[TraceRequest], config: SimulationConfig, progress: Progress) -> SimulationResult:
    label = "replaying" if config.replicas == 1 else f"replaying ({config.routing.value}, {config.replicas} replicas)"
    with progress.bar(label, len(requests)) as advance:
        return simulate(requests, config, progress=advance)


def _size(
    requests: list[TraceRequest], options: SimulateOptions, config: SimulationConfig, progress: Progress
) -> dict[str, SizingResult]:
    percentile = options.ttft_slo_percentile
    assert options.ttft_slo is not None  # only called for a sizing study

    def run(c: SimulationConfig) -> SimulationResult:
        result = _replay(requests, c, progress)
        progress.note(
            f"sizing {c.routing.value}: {c.replicas} replicas -> p{percentile:g} TTFT "
            f"{ttft_quantile(result, percentile):.3f} s{' (overloaded)' if result.overloaded else ''}"
        )
        return result

    return {
        rule.value: fewest_replicas(
            requests,
            replace(config, routing=rule),
            slo_s=options.ttft_slo,
            percentile=percentile,
            max_replicas=options.max_replicas,
            run=run,
        )
        for rule in options.rules
    }


def _curve(requests: list[TraceRequest], options: SimulateOptions, progress: Progress) -> CurveResult:
    from kvpool.sim.optimum import optimal_hit_rate

    rates: dict[str, list[float]] = {p: [] for p in options.curve_policies}
    rates["optimum"] = []
    total = len(options.curve) * (len(options.curve_policies) + 1)
    with progress.bar("hit-rate curve", total) as advance:
        for size in options.curve:
            for policy in options.curve_policies:
                rates[policy].append(
                    replay_sequential(
                        requests,
                        size,
                        block_size=options.block_size,
                        policy=policy,
                        hash_algo=options.block_hash,
                        lookahead=options.lookahead,
                    ).token_hit_rate
                )
                advance(1)
            rates["optimum"].append(optimal_hit_rate(requests, size, options.block_size).token_hit_rate)
            advance(1)
    return CurveResult(sizes=options.curve, lookahead=options.lookahead, token_hit_rate=rates)


def run_study(options: SimulateOptions, requests: list[TraceRequest], progress: Progress | None = None) -> StudyReport:
    """Replay ``requests`` (from :func:`load_requests`) as ``options`` ask; every figure in one report."""
    progress = progress or Progress()
    report = StudyReport(requests=len(requests), tiers=describe_tiers(options))
    if options.curve_only:
        pass
    elif options.sequential:
        with progress.bar("replaying", len(requests)) as advance:
            sequential = replay_sequential(
                requests,
                options.num_blocks - 1,
                block_size=options.block_size,
                policy=options.policy,
                hash_algo=options.block_hash,
                lookahead=options.lookahead,
                progress=advance,
            )
        report = dataclasses.replace(report, sequential=sequential)
    elif options.ttft_slo is not None:
        report = dataclasses.replace(report, sizing=_size(requests, options, _config(options), progress))
    else:
        config = _config(options)
        results = {rule: _replay(requests, replace(config, routing=rule), progress) for rule in options.rules}
        report = dataclasses.replace(report, results=results)
    if options.curve:
        report = dataclasses.replace(report, curve=_curve(requests, options, progress))
    return report
