"""A sweep's answers from its result records: the cheapest fleet per load level, hit rate per policy, rules, tiers.

A record is one configuration's result, a plain mapping as a sweep writes it in JSON lines::

    {"settings": {"replicas": 4, "routing": "prefix", "kv_blocks": 20000, "policy": "lru",
                  "tier": ["cpu:16GiB"], "rate_scale": 2.0, "ttft_slo": 2.0},
     "summary": {... the keys of kvpool simulate --json's "simulation" object ...}}

(``"simulation"`` is read where ``"summary"`` is absent, and a record with neither is taken as
the summary itself; without a ``"settings"`` object, the values beside a nested summary are the
settings). The summary says the pool, block size, policy, replicas and rule it ran;
``settings`` adds what a summary cannot: the tiers as given, the arrival-rate scale (the load
level, 1.0 when absent) and the TTFT objective. :func:`sweep_sections` draws what the records
vary; a chart whose axis they do not vary is left out. Where several records share a chart's
point (the same policy and pool at two load levels, say), the point is their mean, and the
chart's caption says so.

Needs matplotlib (the ``sim`` extra) for the charts.
"""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvpool.errors import ConfigError
from kvpool.sim import plots
from kvpool.sim.report import Chart, Section

__all__ = ["SweepPoint", "load_records", "records_of_results", "sweep_points", "sweep_sections", "write_sweep_report"]

_METRICS = ("token_hit_rate", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s")
_MEAN = "each point the mean over the records that share it"


@dataclass(frozen=True, slots=True, kw_only=True)
class SweepPoint:
    """One record, read: what it ran and what it measured."""

    pool_blocks: int
    block_size: int
    policy: str
    replicas: int
    routing: str
    tiers: str
    load: float
    ttft_slo: float | None
    overloaded: bool
    metrics: dict[str, float]


def load_records(path: Path) -> list[dict[str, Any]]:
    """The records of a JSON-lines file (blank lines skipped); a line that is not a JSON object is named."""
    records = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path}:{number} is not JSON: {exc.msg}") from exc
        if not isinstance(record, dict):
            raise ConfigError(f"{path}:{number} is not a JSON object (a record), got {type(record).__name__}")
        records.append(record)
    return records


def _point(index: int, record: Mapping[str, Any]) -> SweepPoint:
    summary = record.get("summary") or record.get("simulation") or record
    # the settings: their own object, or the record's top-level values beside a nested summary
    settings = record.get("settings") or (
        {k: v for k, v in record.items() if k not in {"summary", "simulation"}} if summary is not record else {}
    )
    try:
        tiers = settings.get("tier", settings.get("tiers"))
        if tiers is None:
            tiers = [t for t in summary.get("hit_tokens_by_tier", {}) if t != "gpu"]
        slo = settings.get("ttft_slo")
        return SweepPoint(
            pool_blocks=int(summary["num_blocks"]) - 1,
            block_size=int(summary["block_size"]),
            policy=str(summary["policy"]),
            replicas=int(summary.get("replicas", 1)),
            routing=str(summary.get("routing", "prefix")),
            tiers=(", ".join(tiers) if isinstance(tiers, list | tuple) else str(tiers)) or "no tier",
            load=float(settings.get("rate_scale", 1.0)),
            ttft_slo=None if slo is None else float(slo),
            overloaded=bool(summary.get("overloaded", False)),
            metrics={key: float(summary[key]) for key in _METRICS},
        )
    except KeyError as exc:
        raise ConfigError(f"sweep record {index} has no {exc.args[0]!r}: a record holds the simulate summary") from exc
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"sweep record {index} holds a value of the wrong kind: {exc}") from exc


def sweep_points(records: Iterable[Mapping[str, Any]]) -> list[SweepPoint]:
    """Every record read (numbered from 0 in errors); at least one."""
    points = [_point(i, r) for i, r in enumerate(records)]
    if not points:
        raise ConfigError("a sweep report needs at least one record")
    return points


def _mean_by(points: Sequence[SweepPoint], key: Any, metric: str) -> dict[Any, float]:
    groups: dict[Any, list[float]] = defaultdict(list)
    for p in points:
        groups[key(p)].append(p.metrics[metric])
    return {k: statistics.fmean(v) for k, v in sorted(groups.items())}


def _cheapest(points: Sequence[SweepPoint], slo_s: float | None) -> Section | None:
    """Per load level and rule: the fewest replicas whose p90 TTFT meets the objective (a record's, else ``slo_s``)."""
    objective = {id(p): p.ttft_slo if p.ttft_slo is not None else slo_s for p in points}
    asked = [p for p in points if objective[id(p)] is not None]
    if not asked:
        return None
    fewest: dict[str, dict[float, int]] = defaultdict(dict)
    for p in sorted(asked, key=lambda p: p.replicas):
        meets = p.metrics["ttft_p90_s"] <= (objective[id(p)] or 0.0)
        if meets and p.load not in fewest[p.routing]:
            fewest[p.routing][p.load] = p.replicas
    loads = sorted({p.load for p in asked})
    slos = [f"{v:g}" for v in sorted({objective[id(p)] or 0.0 for p in asked})]
    rows = [(load, rule, fewest[rule].get(load)) for load in loads for rule in sorted({p.routing for p in asked})]
    facts = []
    for load in loads:
        met = {rule: n for rule, by_load in fewest.items() if (n := by_load.get(load)) is not None}
        best = f"{min(met.values())} replicas ({', '.join(r for r, n in met.items() if n == min(met.values()))})"
        facts.append((f"load x{load:g}", best if met else "no configuration tried meets it"))
    series = {rule: sorted(by_load.items()) for rule, by_load in fewest.items() if by_load}
    fig = plots.lines_figure(
        {rule: [(x, float(y)) for x, y in s] for rule, s in series.items()},
        title=f"Cheapest fleet meeting p90 TTFT <= {' or '.join(slos)} s, per load level",
        xlabel="arrival-rate scale (load level)",
        ylabel="fewest replicas meeting the objective",
    )
    chart = Chart(name="sweep_cheapest", figure=fig, columns=("load", "routing", "fewest_replicas"), rows=rows)
    return Section(title="The cheapest fleet meeting the objective, per load level", facts=facts, charts=[chart])


def _by_pool(points: Sequence[SweepPoint]) -> Section | None:
    """Hit rate and p90 TTFT against pool size, one line per policy."""
    if len({p.pool_blocks for p in points}) < 2:
        return None
    block_size = points[0].block_size
    charts = []
    for metric, label, scale in (("token_hit_rate", "token hit rate (%)", 100.0), ("ttft_p90_s", "p90 TTFT (s)", 1.0)):
        series = {}
        for policy in sorted({p.policy for p in points}):
            means = _mean_by([p for p in points if p.policy == policy], lambda p: p.pool_blocks, metric)
            series[policy] = [(float(x), y * scale) for x, y in means.items()]
        fig = plots.lines_figure(
            series,
            title=f"{label} against pool size, per eviction policy ({block_size}-token blocks)",
            xlabel=f"pool size per replica (blocks of {block_size} tokens)",
            ylabel=label,
            logx=True,
        )
        rows = [(policy, int(x), y) for policy, s in series.items() for x, y in s]
        name = f"sweep_{metric}_by_pool"
        charts.append(Chart(name=name, figure=fig, columns=("policy", "pool_blocks", metric), rows=rows, caption=_MEAN))
    return Section(title="Hit rate and TTFT against pool size, per policy", charts=charts)


def _compared(points: Sequence[SweepPoint], key: Any, name: str, xlabel: str, title: str) -> Section | None:
    """One group of bars per value of ``key`` (a rule, a tier set-up): hit rate and TTFT means."""
    values = sorted({key(p) for p in points})
    if len(values) < 2:
        return None
    summaries = {
        str(v): {m: _mean_by([p for p in points if key(p) == v], lambda p: 0, m)[0] for m in _METRICS} for v in values
    }
    rows = [(v, *(s[m] for m in _METRICS)) for v, s in summaries.items()]
    fig = plots.routing_figure(summaries, title=title, xlabel=xlabel)
    chart = Chart(name=name, figure=fig, columns=(xlabel, *_METRICS), rows=rows, caption=_MEAN)
    return Section(title=title, table=((xlabel, *_METRICS), rows), charts=[chart])


def sweep_sections(records: Iterable[Mapping[str, Any]], *, slo_s: float | None = None) -> list[Section]:
    """The sections a sweep's records support; ``slo_s`` is the objective where records carry none."""
    points = sweep_points(records)
    overview = Section(
        title="The sweep",
        facts=[
            ("results (a configuration under one routing rule each)", f"{len(points):,}"),
            ("overloaded", f"{sum(p.overloaded for p in points):,} (their TTFT measures the backlog)"),
        ],
    )
    fleets = [p for p in points if p.replicas > 1]
    found = [
        overview,
        _cheapest(points, slo_s),
        _by_pool([p for p in points if p.replicas == 1] or points),
        _compared(fleets, lambda p: p.routing, "sweep_routing", "routing rule", "Routing rules side by side"),
        _compared(points, lambda p: p.tiers, "sweep_tiers", "tiers", "Tier benefit: hit rate and TTFT per tier set-up"),
    ]
    return [s for s in found if s is not None]


def records_of_results(results: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """A sweep's result lines (:mod:`kvpool.sim.sweep_results`) as records: one per configuration and rule.

    A line holds the configuration in the sweep file's spelling and the figures of each
    routing rule it ran; a sequential replay (no routing figures) gives no record.
    """
    records = []
    for line in results:
        config = {str(k).replace("_", "-"): v for k, v in line["config"].items()}
        settings: dict[str, Any] = {"rate_scale": config.get("arrival-rate-scale", 1.0)}
        for key, name in (("tier", "tier"), ("ttft-slo", "ttft_slo")):
            if key in config:
                settings[name] = config[key]
        for summary in line["figures"].get("routing", {}).values():
            records.append({"settings": settings, "summary": summary})
    return records


def write_sweep_report(
    records: Iterable[Mapping[str, Any]], directory: Path, *, slo_s: float | None = None, title: str = "kvpool sweep"
) -> Path:
    """The page of a sweep's records (:func:`sweep_sections`), written by :func:`kvpool.sim.report.write_report`."""
    from kvpool.sim.report import write_report

    return write_report(directory, title=title, sections=sweep_sections(records, slo_s=slo_s))
