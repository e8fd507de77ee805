"""``kvpool simulate``'s charts: PNGs (``--plot-dir``, ``--plot``) and the HTML page (``--report``).

The study's figures, as ``--json`` prints them, become sections and charts
(:func:`kvpool.sim.study_charts.study_sections`); this module only says where each goes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

if TYPE_CHECKING:
    from kvpool.sim.options import SimulateOptions
    from kvpool.sim.study import StudyReport
    from kvpool.sim.study_charts import StudySetup

__all__ = ["Drawn", "draw"]


@dataclass(frozen=True)
class Drawn:
    """Where the charts go: PNGs to a folder (``--plot-dir``), the timeline to a file (``--plot``), a page."""

    plot_dir: Path | None
    plot_path: Path | None
    report_dir: Path | None
    load: tuple[tuple[str, str], ...]  # the first replay's load line (and why requests queue), as the table says
    overloaded: bool  # whether that replay was overloaded: its load line is then drawn on the timeline


def _setup(report: StudyReport, options: SimulateOptions, label: str, drawn: Drawn) -> StudySetup:
    from kvpool.sim.study_charts import StudySetup

    first = report.results[options.rules[0]] if report.results else None
    known = options.model is not None or options.kv_bytes_per_token is not None
    return StudySetup(
        label=label,
        block_size=options.block_size,
        pool_blocks=max(options.num_blocks - 1, 0),
        policy=options.policy,
        tiers=options.tier,
        bytes_per_token=options.cost.kv_bytes_per_token if known else None,
        load=drawn.load,
        overloaded=drawn.overloaded,
        ttft_points=first.ttft_points if first is not None else (),
    )


def draw(
    report: StudyReport, options: SimulateOptions, label: str, output: dict[str, Any], drawn: Drawn, show: bool
) -> None:
    """Each chart of the study as PNG (``--plot-dir``, ``--plot``) and all of them on one page (``--report``)."""
    from kvpool.sim import plots
    from kvpool.sim.report import write_report
    from kvpool.sim.study_charts import study_sections

    sections = study_sections(output, _setup(report, options, label, drawn))
    written: list[tuple[str, Path]] = []
    for chart in (c for section in sections for c in section.charts):
        if drawn.plot_dir is not None:
            written.append((chart.name, drawn.plot_dir / f"{chart.name}.png"))
            chart.figure.savefig(written[-1][1])
        if drawn.plot_path is not None and chart.name == "usage":
            written.append((chart.name, drawn.plot_path))
            chart.figure.savefig(drawn.plot_path)
        if drawn.report_dir is None:
            plots.close(chart.figure)
    for name, key in (("usage", "usage_plot"), ("routing", "routing_plot"), ("sizing", "sizing_plot")):
        paths = [str(p) for n, p in written if n == name]
        if paths:
            output[key] = paths[0]
    if "curve" in output and any(n == "hit_rate_curve" for n, _ in written):
        output["curve"]["plot"] = next(str(p) for n, p in written if n == "hit_rate_curve")
    if drawn.report_dir is not None:
        page = write_report(drawn.report_dir, title=f"kvpool simulate {label}", sections=sections)
        output["report"] = str(page)
        written.append(("report", page))
    if show:
        for name, path in written:
            click.echo(f"  {name + ' plot' if name != 'report' else 'report':<22} {path}")
