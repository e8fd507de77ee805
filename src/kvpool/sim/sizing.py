"""The operator's sizing question: the fewest replicas whose time to first token meets an objective.

:func:`fewest_replicas` replays the trace at growing replica counts (1, 2, 4, ...)
until the ``percentile`` of time to first token is at most ``slo_s``, then bisects
between the last count that missed and the first that met it. The search assumes
that more replicas never make that percentile worse, which holds for every routing
rule here as long as each replica's pool is the same size (more replicas means
less queueing and no less cache). Each count is replayed once; the figures of every
count tried are kept, so the answer can be checked.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from kvpool.checks import check_int
from kvpool.errors import ConfigError
from kvpool.sim.simulator import SimulationConfig, SimulationResult, simulate, ttft_quantile
from kvpool.sim.traces import TraceRequest

__all__ = ["SizingResult", "fewest_replicas"]


@dataclass(frozen=True, slots=True, kw_only=True)
class SizingResult:
    """The answer for one routing rule.

    ``replicas`` is the fewest count that meets the objective, or None when
    ``max_replicas`` does not. ``ttft_by_replicas`` maps every count tried to its
    time to first token at the percentile, and ``overloaded_by_replicas`` to
    whether the offered prefill rate exceeded what that many replicas can serve.
    """

    routing: str
    slo_s: float
    percentile: float
    max_replicas: int
    replicas: int | None
    ttft_by_replicas: dict[int, float]
    overloaded_by_replicas: dict[int, bool]
    token_hit_rate_by_replicas: dict[int, float]


def fewest_replicas(
    trace: Sequence[TraceRequest],
    config: SimulationConfig,
    *,
    slo_s: float,
    percentile: float,
    max_replicas: int = 64,
    run: Callable[[SimulationConfig], SimulationResult] | None = None,
) -> SizingResult:
    """The fewest replicas (at most ``max_replicas``) whose TTFT at ``percentile`` is at most ``slo_s``.

    ``config.replicas`` is ignored; its routing rule is the one sized. ``run``
    replays one configuration (default: :func:`simulate` over ``trace``), e.g.
    to show progress.
    """
    if isinstance(slo_s, bool) or not isinstance(slo_s, int | float) or not 0 < slo_s < float("inf"):
        raise ConfigError(f"the time-to-first-token objective must be a finite number of seconds > 0, got {slo_s!r}")
    if isinstance(percentile, bool) or not isinstance(percentile, int | float) or not 0 < percentile < 100:
        raise ConfigError(f"percentile must be a number between 0 and 100 (exclusive), got {percentile!r}")
    check_int("max_replicas", max_replicas)
    replay = run if run is not None else (lambda c: simulate(trace, c))
    ttft: dict[int, float] = {}
    overloaded: dict[int, bool] = {}
    hit_rate: dict[int, float] = {}

    def meets(n: int) -> bool:
        result = replay(replace(config, replicas=n))
        ttft[n] = ttft_quantile(result, percentile)
        overloaded[n] = result.overloaded
        hit_rate[n] = result.token_hit_rate
        return ttft[n] <= slo_s

    missed, n = 0, 1
    while not meets(n):
        missed = n
        if n == max_replicas:
            return SizingResult(
                routing=config.routing.value,
                slo_s=slo_s,
                percentile=percentile,
                max_replicas=max_replicas,
                replicas=None,
                ttft_by_replicas=ttft,
                overloaded_by_replicas=overloaded,
                token_hit_rate_by_replicas=hit_rate,
            )
        n = min(2 * n, max_replicas)
    met = n
    while met - missed > 1:  # invariant: `missed` misses (0 trivially), `met` meets
        middle = (missed + met) // 2
        if meets(middle):
            met = middle
        else:
            missed = middle
    return SizingResult(
        routing=config.routing.value,
        slo_s=slo_s,
        percentile=percentile,
        max_replicas=max_replicas,
        replicas=met,
        ttft_by_replicas=dict(sorted(ttft.items())),
        overloaded_by_replicas=dict(sorted(overloaded.items())),
        token_hit_rate_by_replicas=dict(sorted(hit_rate.items())),
    )
