"""The charts and facts of a study, from plain data: one replay, several routing rules, a sizing search, a curve.

:func:`study_sections` takes what ``kvpool simulate --json`` prints (its ``simulation``,
``routing``, ``sizing``, ``curve`` and ``sequential`` objects) and a :class:`StudySetup`
saying what was simulated; it returns :class:`~kvpool.sim.report.Section` records whose
charts ``--plot-dir`` writes as PNG and ``--report`` as one page. Sweeps' records go
through :mod:`kvpool.sim.sweep_charts`.

Needs matplotlib (the ``sim`` extra) for the charts.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvpool.sim import plots
from kvpool.sim.report import Chart, Section

__all__ = ["StudySetup", "study_sections"]

_SUMMARY_COLUMNS = ("token_hit_rate", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "request_imbalance", "work_imbalance")


@dataclass(frozen=True, slots=True, kw_only=True)
class StudySetup:
    """What a study simulated, for titles: its label (the trace and its requests) and the pool as configured.

    ``pool_blocks`` excludes the null block (0 when only the curve was asked for); ``bytes_per_token``
    is the model's KV bytes per token, or None when no model says it; ``load`` the first replay's load
    facts as the command's table words them (the load line, why requests queue), and ``overloaded``
    whether it was: its load line is then drawn on the timeline.
    """

    label: str
    block_size: int
    pool_blocks: int
    policy: str
    tiers: tuple[str, ...] = ()
    bytes_per_token: int | None = None
    load: tuple[tuple[str, str], ...] = ()
    overloaded: bool = False
    ttft_points: tuple[tuple[float, float], ...] = ()

    @property
    def verdict(self) -> str | None:
        """The load line to draw on the timeline: the first replay's, when it was overloaded."""
        return dict(self.load).get("load") if self.overloaded else None


def _percent(x: float) -> str:
    return f"{100 * x:.2f}%"


def _replay_facts(s: Mapping[str, Any], setup: StudySetup) -> list[tuple[str, str]]:
    facts = [
        ("simulated", plots.describe_run(s, setup.tiers)),
        ("token hit rate", _percent(s["token_hit_rate"])),
        ("block hit rate", _percent(s["block_hit_rate"])),
        (
            "time to first token",
            f"p50 {s['ttft_p50_s']:.3f} s, p90 {s['ttft_p90_s']:.3f} s, p99 {s['ttft_p99_s']:.3f} s",
        ),
        ("queue time", f"p50 {s['queue_p50_s']:.3f} s, p90 {s['queue_p90_s']:.3f} s"),
        ("evictions, preemptions", f"{s['evictions']:,}, {s['preemptions']:,}"),
        ("peak KV usage", _percent(s["peak_usage"])),
    ]
    if len(s.get("hit_tokens_by_tier", {})) > 1:
        facts.append(("hit tokens by tier", ", ".join(f"{k} {v:,}" for k, v in s["hit_tokens_by_tier"].items())))
    facts.extend(setup.load)
    return facts


def _timeline(s: Mapping[str, Any], setup: StudySetup) -> Chart:
    usage = [(float(t), float(u)) for t, u in s["usage_timeline"]]
    queue = [(float(t), int(n)) for t, n in s["queue_timeline"]]
    title = f"{setup.label}\n{plots.describe_run(s, setup.tiers)}"
    fig = plots.timeline_figure(usage, queue, setup.ttft_points, title=title, verdict=setup.verdict)
    rows: list[tuple[Any, ...]] = [("kv_usage", t, u) for t, u in usage]
    rows += [("requests_waiting", t, n) for t, n in queue]
    rows += [("ttft_s", t, v) for t, v in setup.ttft_points]
    caption = "KV usage, requests waiting and each request's time to first token over simulated time"
    return Chart(name="usage", figure=fig, columns=("series", "time_s", "value"), rows=rows, caption=caption)


def _routing(rules: Mapping[str, Mapping[str, Any]], setup: StudySetup) -> Section:
    first = next(iter(rules.values()))
    title = (
        f"Routing rules compared, {setup.label}\n{plots.describe_run({**first, 'routing': 'each rule'}, setup.tiers)}"
    )
    rows = [(rule, *(s[c] for c in _SUMMARY_COLUMNS), bool(s.get("overloaded"))) for rule, s in rules.items()]
    columns = ("rule", *_SUMMARY_COLUMNS, "overloaded")
    chart = Chart(
        name="routing",
        figure=plots.routing_figure(rules, title=title),
        columns=columns,
        rows=rows,
        caption="token hit rate and time to first token per routing rule, same trace and fleet",
    )
    return Section(title="Routing rules side by side", table=(columns, rows), charts=[chart])


def _sizing(sizing: Mapping[str, Mapping[str, Any]], setup: StudySetup) -> Section:
    first = next(iter(sizing.values()))
    slo, percentile = float(first["slo_s"]), float(first["percentile"])
    ttft = {rule: {int(n): float(t) for n, t in a["ttft_by_replicas"].items()} for rule, a in sizing.items()}
    heavy = {rule: {int(n): bool(v) for n, v in a["overloaded_by_replicas"].items()} for rule, a in sizing.items()}
    fewest = {rule: a["replicas"] for rule, a in sizing.items()}
    pool = f"pool {setup.pool_blocks:,} blocks x {setup.block_size} tokens per replica, policy {setup.policy}"
    tiers = f"tiers {', '.join(setup.tiers)}" if setup.tiers else "no tier"
    title = f"Fewest replicas meeting p{percentile:g} TTFT <= {slo:g} s, {setup.label}\n{pool}, {tiers}"
    fig = plots.sizing_figure(ttft, fewest, slo_s=slo, percentile=percentile, title=title, overloaded=heavy)
    rows = [(rule, n, t, heavy[rule][n], n == fewest[rule]) for rule, points in ttft.items() for n, t in points.items()]
    columns = ("rule", "replicas", f"ttft_p{percentile:g}_s", "overloaded", "fewest_meeting_objective")
    met = {rule: n for rule, n in fewest.items() if n is not None}
    cheapest = (
        f"{min(met.values())} replicas ({', '.join(r for r, n in met.items() if n == min(met.values()))})"
        if met
        else f"none up to {first['max_replicas']} replicas"
    )
    facts = [
        ("objective", f"p{percentile:g} time to first token <= {slo:g} s"),
        ("cheapest fleet meeting it", cheapest),
    ]
    facts += [(f"fewest, {rule}", "none" if n is None else f"{n} replicas") for rule, n in fewest.items()]
    chart = Chart(name="sizing", figure=fig, columns=columns, rows=rows, caption="every count the search replayed")
    return Section(title="Sizing: the fewest replicas that meet the objective", facts=facts, charts=[chart])


def _curve(curve: Mapping[str, Any], setup: StudySetup) -> Section:
    sizes = [int(n) for n in curve["sizes"]]
    rates: dict[str, Sequence[float]] = curve["token_hit_rate"]
    title = (
        f"Token hit rate against cache size, {setup.label}\n"
        f"sequential model, {setup.block_size}-token blocks, {', '.join(rates)}"
    )
    fig = plots.hit_rate_curve_figure(
        sizes, rates, title=title, block_size=setup.block_size, bytes_per_token=setup.bytes_per_token
    )
    rows = [(p, n, n * setup.block_size, r[i]) for p, r in rates.items() for i, n in enumerate(sizes)]
    chart = Chart(
        name="hit_rate_curve",
        figure=fig,
        columns=("policy", "blocks", "tokens", "token_hit_rate"),
        rows=rows,
        caption="one request at a time, each policy against the offline optimum",
    )
    return Section(title="Hit rate against cache size", charts=[chart])


def study_sections(output: Mapping[str, Any], setup: StudySetup) -> list[Section]:
    """The sections of what ``kvpool simulate --json`` printed (``output``), in the order a reader asks."""
    sections = []
    if "simulation" in output:
        s = output["simulation"]
        facts = _replay_facts(s, setup)
        title = "The replay" if "routing" not in output else f"The replay, routing {s['routing']} (the first rule)"
        sections.append(Section(title=title, facts=facts, charts=[_timeline(s, setup)]))
    if "routing" in output:
        sections.append(_routing(output["routing"], setup))
    if output.get("sizing"):
        sections.append(_sizing(output["sizing"], setup))
    if "sequential" in output:
        seq = output["sequential"]
        facts = [(key.replace("_", " "), f"{v:,}" if isinstance(v, int) else str(v)) for key, v in seq.items()]
        sections.append(Section(title="Sequential replay (one request at a time)", facts=facts))
    if "curve" in output:
        sections.append(_curve(output["curve"], setup))
    return sections
