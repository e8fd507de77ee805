"""Plots of a simulation: the timeline, the hit-rate curve, routing rules side by side, the sizing search.

Each chart has a ``*_figure`` function that builds a matplotlib ``Figure`` from plain
figures (numbers, names, summary dicts as :meth:`SimulationResult.to_dict` writes them),
and :func:`save` writes one as PNG or SVG; the ``plot_*`` functions do both. Tests read
the figures' titles, labels and line styles from the ``Figure`` objects.

Every title says what was simulated (:func:`describe_run`: the pool, its block size, the
policy, the tiers, the replicas and their routing rule), every axis is labelled, and
lines that coincide stay visible: each policy has its own marker and line style, and the
legend says when two lines are the same.

Needs matplotlib (the ``sim`` extra); it is imported when a figure is built, with the
non-interactive Agg backend, so plotting works on machines with no screen.
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "GIB",
    "LINE_STYLES",
    "close",
    "describe_run",
    "hit_rate_curve_figure",
    "lines_figure",
    "plot_hit_rate_curve",
    "plot_routing",
    "plot_sizing",
    "plot_timeline",
    "routing_figure",
    "save",
    "sizing_figure",
    "svg_text",
    "timeline_figure",
]

GIB = 1 << 30
#: (marker, line style, marker size) per line, in order: hollow markers of different shapes and sizes, so a line
#: drawn over an identical one leaves the one below visible.
LINE_STYLES: tuple[tuple[str, Any, float], ...] = (
    ("o", "-", 9.0),
    ("s", "--", 6.5),
    ("^", ":", 5.0),
    ("D", "-.", 4.0),
    ("v", (0, (5, 1, 1, 1)), 3.5),  # a dash pattern, as matplotlib takes it
    ("P", (0, (1, 2)), 3.0),
)
_TITLE_WIDTH = 70  # characters a title line holds at the widths below, so no title is clipped
_SLO_COLOR = "#b3261e"


def _pyplot() -> Any:  # matplotlib.pyplot (matplotlib is untyped here)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _title(text: str, width: int = _TITLE_WIDTH) -> str:
    """``text`` wrapped onto lines that fit the figure (each given line wrapped on its own)."""
    return "\n".join(textwrap.fill(line, width) for line in text.splitlines())


def describe_run(summary: Mapping[str, Any], tiers: Sequence[str] = ()) -> str:
    """What a replay simulated, for a title: pool size, block size, policy, tiers, replicas and routing rule.

    ``summary`` holds :meth:`SimulationResult.to_dict`'s keys (``num_blocks`` counts the null block);
    ``tiers`` the tier specs as given (``cpu:4GiB``).
    """
    replicas = int(summary.get("replicas", 1))
    parts = [
        f"pool {int(summary['num_blocks']) - 1:,} blocks x {summary['block_size']} tokens",
        f"policy {summary['policy']}",
        f"tiers {', '.join(tiers)}" if tiers else "no tier",
        f"{replicas} replicas, routing {summary['routing']}" if replicas > 1 else "1 replica",
    ]
    return ", ".join(parts)


def save(fig: Any, path: Path) -> Path:
    """Write ``fig`` to ``path`` (its suffix picks the format: .png, .svg) and close it."""
    fig.savefig(path, metadata={"Date": None} if path.suffix == ".svg" else None)
    close(fig)
    return path


def _same_as(curves: Mapping[str, Sequence[float]]) -> dict[str, str]:
    """Each line's name -> the earlier line it is identical to, for the legend."""
    same: dict[str, str] = {}
    names = list(curves)
    for i, name in enumerate(names):
        for earlier in names[:i]:
            if list(curves[earlier]) == list(curves[name]) and earlier not in same:
                same[name] = earlier
                break
    return same


def _number(value: float) -> str:
    """A tick's number as people write it: ``1,000``, ``20,000``, ``0.5``."""
    return f"{value:,.0f}" if abs(value) >= 1 and float(value).is_integer() else f"{value:.3g}"


def _minor_label(value: float) -> str:
    """A minor tick's label on a log axis: only at 2 and 5 times a power of ten, so labels never crowd."""
    if value <= 0:
        return ""
    mantissa = value / 10 ** math.floor(math.log10(value))
    return _number(value) if round(mantissa, 6) in (2.0, 5.0) else ""


def _plain_ticks(*axes: Any) -> None:
    """Tick labels as plain numbers (``40``, ``0.5``, ``8``), not powers, on log-scaled axes too."""
    from matplotlib.ticker import FuncFormatter

    for axis in axes:
        axis.set_major_formatter(FuncFormatter(lambda v, _: _number(v)))
        axis.set_minor_formatter(FuncFormatter(lambda v, _: _minor_label(v)))


def _size_axes(ax: Any, block_size: int, bytes_per_token: int | None) -> None:
    """Secondary x axes beside the blocks: tokens above, and GiB below when a block's bytes are known."""
    tokens = ax.secondary_xaxis("top", functions=(lambda b: b * block_size, lambda t: t / block_size))
    tokens.set_xlabel("cache size (tokens)")
    _plain_ticks(ax.xaxis, tokens.xaxis)
    if bytes_per_token is not None:
        scale = block_size * bytes_per_token / GIB
        gib = ax.secondary_xaxis(-0.2, functions=(lambda b: b * scale, lambda g: g / scale))
        gib.set_xlabel(f"cache size (GiB, {bytes_per_token:,} B of KV per token)")
        _plain_ticks(gib.xaxis)


def hit_rate_curve_figure(
    capacities: Sequence[int],
    curves: Mapping[str, Sequence[float]],
    *,
    title: str,
    block_size: int,
    bytes_per_token: int | None = None,
) -> Any:
    """Token hit rate against cache size: one line per policy (each its own marker and style), the optimum dashed.

    The x axis is in blocks of ``block_size`` tokens, with tokens above it, and GiB above that when
    ``bytes_per_token`` (the model's KV bytes per token) is given.
    """
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 5.2 if bytes_per_token else 4.8), dpi=120, layout="constrained")
    same = _same_as(curves)
    styles = iter(LINE_STYLES * (1 + len(curves) // len(LINE_STYLES)))
    for name, rates in curves.items():
        label = f"{name} (same as {same[name]})" if name in same else name
        percent = [r * 100 for r in rates]
        if name == "optimum":
            ax.plot(capacities, percent, ls="--", color="black", lw=1.5, label=label)
            continue
        marker, ls, size = next(styles)
        ax.plot(capacities, percent, marker=marker, ls=ls, ms=size, mfc="none", mew=1.4, lw=1.5, label=label)
    ax.set_xscale("log")
    ax.set_xlabel(f"cache size (blocks of {block_size} tokens)")
    ax.set_ylabel("token hit rate (%)")
    _size_axes(ax, block_size, bytes_per_token)
    fig.suptitle(_title(title), fontsize=10)
    ax.grid(alpha=0.3, which="both")
    ax.legend()
    return fig


def plot_hit_rate_curve(
    capacities: Sequence[int],
    curves: Mapping[str, Sequence[float]],
    path: Path,
    *,
    title: str,
    block_size: int,
    bytes_per_token: int | None = None,
) -> Path:
    """:func:`hit_rate_curve_figure`, written to ``path``."""
    fig = hit_rate_curve_figure(capacities, curves, title=title, block_size=block_size, bytes_per_token=bytes_per_token)
    return save(fig, path)


def timeline_figure(
    usage: Sequence[tuple[float, float]],
    queue: Sequence[tuple[float, int]],
    ttft: Sequence[tuple[float, float]],
    *,
    title: str,
    verdict: str | None = None,
) -> Any:
    """Three panels over simulated time: KV usage, requests waiting, and each request's time to first token.

    ``verdict`` (e.g. the OVERLOADED line) is drawn in a red box across the top panel.
    """
    plt = _pyplot()
    fig, (ax_usage, ax_queue, ax_ttft) = plt.subplots(3, 1, figsize=(8, 8), dpi=120, sharex=True, layout="constrained")
    ax_usage.plot([t for t, _ in usage], [u * 100 for _, u in usage], lw=1.2, color="#0f6b63")
    ax_usage.set_ylabel("KV blocks in use (%)")
    ax_usage.set_ylim(0, 105)
    ax_usage.set_title(_title(title, 85), fontsize=10)
    ax_queue.plot([t for t, _ in queue], [n for _, n in queue], lw=1.2, color="#8a4f0f")
    ax_queue.set_ylabel("requests waiting")
    ax_ttft.scatter([t for t, _ in ttft], [s for _, s in ttft], s=2, color="#2f3f8f", alpha=0.5)
    ax_ttft.set_ylabel("time to first token (s)")
    if ttft and min(s for _, s in ttft) > 0:
        ax_ttft.set_yscale("log")
        _plain_ticks(ax_ttft.yaxis)
    for ax in (ax_usage, ax_queue, ax_ttft):
        ax.set_xlabel("simulated time (s)" if ax is not ax_ttft else "simulated time (s), at the first token")
        ax.grid(alpha=0.3)
    if verdict:
        ax_usage.text(
            0.5, 0.5, _title(verdict, 80), transform=ax_usage.transAxes, ha="center", va="center", fontsize=8.5,
            color="white", bbox={"boxstyle": "round", "facecolor": _SLO_COLOR, "alpha": 0.9},
        )  # fmt: skip
    return fig


def plot_timeline(
    usage: Sequence[tuple[float, float]],
    queue: Sequence[tuple[float, int]],
    ttft: Sequence[tuple[float, float]],
    path: Path,
    *,
    title: str,
    verdict: str | None = None,
) -> Path:
    """:func:`timeline_figure`, written to ``path``."""
    return save(timeline_figure(usage, queue, ttft, title=title, verdict=verdict), path)


def routing_figure(rules: Mapping[str, Mapping[str, Any]], *, title: str, xlabel: str = "routing rule") -> Any:
    """Routing rules side by side: token hit rate, and TTFT p50 / p90 / p99, one group of bars per rule.

    ``rules`` maps each rule to its replay's summary (:meth:`SimulationResult.to_dict`'s keys);
    an overloaded replay's name is marked ``(overloaded)``. Any other choice compares the same way
    (tier set-ups, say), named by ``xlabel``.
    """
    plt = _pyplot()
    fig, (ax_hit, ax_ttft) = plt.subplots(1, 2, figsize=(10, 4.6), dpi=120, layout="constrained")
    names = [f"{rule}\n(overloaded)" if s.get("overloaded") else rule for rule, s in rules.items()]
    positions = range(len(names))
    ax_hit.bar(positions, [s["token_hit_rate"] * 100 for s in rules.values()], color="#0f6b63")
    ax_hit.set_ylabel("token hit rate (%)")
    width = 0.27
    for k, (key, hatch) in enumerate((("ttft_p50_s", ""), ("ttft_p90_s", "//"), ("ttft_p99_s", ".."))):
        ax_ttft.bar(
            [p + (k - 1) * width for p in positions],
            [s[key] for s in rules.values()],
            width,
            label=key.removeprefix("ttft_").removesuffix("_s"),
            hatch=hatch,
            edgecolor="black",
        )
    ax_ttft.set_ylabel("time to first token (s)")
    tallest = max((s.get("ttft_p99_s", 0.0) for s in rules.values()), default=0.0)
    ax_ttft.set_ylim(0, tallest * 1.35 or 1.0)  # headroom: the legend never covers a bar
    ax_ttft.legend(title="percentile", loc="upper left", ncols=3)
    for ax in (ax_hit, ax_ttft):
        ax.set_xticks(list(positions), names, fontsize=8)
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3, axis="y")
    fig.suptitle(_title(title, 110), fontsize=10)
    return fig


def lines_figure(
    series: Mapping[str, Sequence[tuple[float, float]]],
    *,
    title: str,
    xlabel: str,
    ylabel: str,
    logx: bool = False,
    objective: tuple[float, str] | None = None,
) -> Any:
    """One line per series (each its own marker and style), ``objective`` (value, label) as a red line."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4.6), dpi=120, layout="constrained")
    styles = iter(LINE_STYLES * (1 + len(series) // len(LINE_STYLES)))
    same = _same_as({name: [y for _, y in points] for name, points in series.items()})
    for name, points in series.items():
        marker, ls, size = next(styles)
        label = f"{name} (same as {same[name]})" if name in same else name
        ax.plot([x for x, _ in points], [y for _, y in points], marker=marker, ls=ls, ms=size, mfc="none", label=label)
    if objective is not None:
        ax.axhline(objective[0], color=_SLO_COLOR, lw=1.5, label=objective[1])
    if logx:
        ax.set_xscale("log")
        _plain_ticks(ax.xaxis)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    ax.set_title(_title(title), fontsize=10)
    return fig


def plot_routing(rules: Mapping[str, Mapping[str, Any]], path: Path, *, title: str) -> Path:
    """:func:`routing_figure`, written to ``path``."""
    return save(routing_figure(rules, title=title), path)


def sizing_figure(
    ttft_by_replicas: Mapping[str, Mapping[int, float]],
    fewest: Mapping[str, int | None],
    *,
    slo_s: float,
    percentile: float,
    title: str,
    overloaded: Mapping[str, Mapping[int, bool]] | None = None,
) -> Any:
    """The sizing search: TTFT at ``percentile`` against replicas, one line per rule, the objective as a line.

    Each rule's fewest replicas meeting the objective (``fewest``; None where none does) is ringed and
    named in the legend; counts whose offered load exceeded what they serve are crossed (``overloaded``).
    """
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.8), dpi=120, layout="constrained")
    styles = iter(LINE_STYLES * (1 + len(ttft_by_replicas) // len(LINE_STYLES)))
    for rule, points in ttft_by_replicas.items():
        counts = sorted(points)
        marker, ls, size = next(styles)
        best = fewest.get(rule)
        label = f"{rule}: {best} replicas" if best is not None else f"{rule}: none meets it"
        (line,) = ax.plot(counts, [points[n] for n in counts], marker=marker, ls=ls, ms=size, mfc="none", label=label)
        if best is not None:
            ax.plot([best], [points[best]], "o", ms=14, mfc="none", mec=line.get_color(), mew=2)
        heavy = [n for n in counts if (overloaded or {}).get(rule, {}).get(n)]
        ax.plot(heavy, [points[n] for n in heavy], "x", color=line.get_color(), ms=8)
    ax.axhline(slo_s, color=_SLO_COLOR, lw=1.5, label=f"objective: p{percentile:g} <= {slo_s:g} s")
    ax.set_xlabel("replicas (x: overloaded)")
    ax.set_ylabel(f"p{percentile:g} time to first token (s)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(sorted({n for points in ttft_by_replicas.values() for n in points}))
    _plain_ticks(ax.xaxis, ax.yaxis)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    ax.set_title(_title(title, 85), fontsize=10)
    return fig


def plot_sizing(
    ttft_by_replicas: Mapping[str, Mapping[int, float]],
    fewest: Mapping[str, int | None],
    path: Path,
    *,
    slo_s: float,
    percentile: float,
    title: str,
    overloaded: Mapping[str, Mapping[int, bool]] | None = None,
) -> Path:
    """:func:`sizing_figure`, written to ``path``."""
    fig = sizing_figure(
        ttft_by_replicas, fewest, slo_s=slo_s, percentile=percentile, title=title, overloaded=overloaded
    )
    return save(fig, path)


def svg_text(fig: Any) -> str:
    """``fig`` as an ``<svg>`` element (text kept as text, no date, stable IDs), for a page to inline; closes it."""
    import io

    import matplotlib

    plt = _pyplot()
    buffer = io.StringIO()
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": "kvpool"}):
        fig.savefig(buffer, format="svg", metadata={"Date": None})
    plt.close(fig)
    text = buffer.getvalue()
    return text[text.index("<svg") :]


def close(fig: Any) -> None:
    """Release ``fig``'s memory (after its last save)."""
    _pyplot().close(fig)
