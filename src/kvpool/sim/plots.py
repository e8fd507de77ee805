"""PNG plots of a simulation: KV usage over time and the miss-ratio curve.

Needs matplotlib (the ``sim`` extra); it is imported when a plot is drawn, with
the non-interactive Agg backend, so plotting works on machines with no screen.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["plot_hit_rate_curve", "plot_usage"]


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
