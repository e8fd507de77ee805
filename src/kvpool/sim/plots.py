"""PNG plots of a simulation: KV usage, queue and time to first token over time; the miss-ratio curve.

Needs matplotlib (the ``sim`` extra); it is imported when a plot is drawn, with
the non-interactive Agg backend, so plotting works on machines with no screen.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["plot_hit_rate_curve", "plot_timeline", "plot_usage"]


def _pyplot() -> Any:  # matplotlib.pyplot (matplotlib is untyped here)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_usage(timeline: Sequence[tuple[float, float]], path: Path, *, title: str) -> Path:
    """KV cache usage (fraction of blocks in use) against simulated time."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 3.5), dpi=120)
    times = [t for t, _ in timeline]
    usage = [u * 100 for _, u in timeline]
    ax.plot(times, usage, lw=1.2, color="#0f6b63")
    ax.set_xlabel("simulated time (s)")
    ax.set_ylabel("KV blocks in use (%)")
    ax.set_ylim(0, 105)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_hit_rate_curve(
    capacities: Sequence[int],
    curves: Mapping[str, Sequence[float]],
    path: Path,
    *,
    title: str,
    capacity_label: str = "cache size (blocks)",
) -> Path:
    """Token hit rate against cache size: one line per policy, the optimum dashed."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    for name, rates in curves.items():
        style = {"ls": "--", "color": "black", "lw": 1.5} if name == "optimum" else {"marker": "o", "lw": 1.5}
        ax.plot(capacities, [r * 100 for r in rates], label=name, **style)
    ax.set_xscale("log")
    ax.set_xlabel(capacity_label)
    ax.set_ylabel("token hit rate (%)")
    ax.set_title(title)
    ax.grid(alpha=0.3, which="both")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_timeline(
    usage: Sequence[tuple[float, float]],
    queue: Sequence[tuple[float, int]],
    ttft: Sequence[tuple[float, float]],
    path: Path,
    *,
    title: str,
) -> Path:
    """Three panels over simulated time: KV usage, requests waiting, and each request's time to first token."""
    plt = _pyplot()
    fig, (ax_usage, ax_queue, ax_ttft) = plt.subplots(3, 1, figsize=(8, 7.5), dpi=120, sharex=True)
    ax_usage.plot([t for t, _ in usage], [u * 100 for _, u in usage], lw=1.2, color="#0f6b63")
    ax_usage.set_ylabel("KV blocks in use (%)")
    ax_usage.set_ylim(0, 105)
    ax_usage.set_title(title)
    ax_queue.plot([t for t, _ in queue], [n for _, n in queue], lw=1.2, color="#8a4f0f")
    ax_queue.set_ylabel("requests waiting")
    ax_ttft.scatter([t for t, _ in ttft], [s for _, s in ttft], s=2, color="#2f3f8f", alpha=0.5)
    ax_ttft.set_ylabel("time to first token (s)")
    if ttft and min(s for _, s in ttft) > 0:
        ax_ttft.set_yscale("log")
    ax_ttft.set_xlabel("simulated time (s), at the first token")
    for ax in (ax_usage, ax_queue, ax_ttft):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
