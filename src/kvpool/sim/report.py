"""One static HTML page of a study's answers: what ``kvpool simulate ... --report DIR`` writes.

The page, ``DIR/index.html``, needs nothing but itself: every chart is inline SVG (its text kept
as text, so it reads offline, searches, and its axis labels can be checked), no script, no
stylesheet or font from elsewhere. Beside it, each chart's data is ``NAME.csv`` and ``NAME.json``
(the JSON also holds the chart's title and axis labels as drawn), and ``figures.json`` lists
every chart with its labels::

    DIR/index.html      the page
    DIR/figures.json    [{"name", "title", "axes": [{"xlabel", "ylabel", "title"}, ...]}, ...]
    DIR/NAME.csv        one chart's points, a header row first
    DIR/NAME.json       the same points, with the chart's title and axes

Pages are built from :class:`Section` records, each of facts (label, value) and
:class:`Chart` records; two builders make them from plain data, never from live objects:

* :func:`kvpool.sim.study_charts.study_sections`: what ``kvpool simulate --json`` prints.
* :func:`kvpool.sim.study_charts.sweep_sections`: result records, one per configuration
  (its settings and the simulate summary), as a sweep writes them in JSON lines.

Standard library only, but building a :class:`Chart` needs matplotlib (the ``sim`` extra).
"""

from __future__ import annotations

import csv
import html
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvpool.errors import ConfigError

__all__ = ["Chart", "Section", "axes_labels", "prepare_report_dir", "write_report"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Chart:
    """One figure of a page: a matplotlib ``Figure``, and the points it draws as a table.

    ``name`` is its file stem (letters, digits, ``_`` and ``-``); ``columns`` head ``rows``.
    """

    name: str
    figure: Any
    columns: tuple[str, ...]
    rows: list[tuple[Any, ...]]
    caption: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class Section:
    """A heading, its facts (label, value), a table (header, rows) and charts."""

    title: str
    facts: list[tuple[str, str]] = field(default_factory=list)
    table: tuple[tuple[str, ...], list[tuple[Any, ...]]] | None = None
    charts: list[Chart] = field(default_factory=list)


def prepare_report_dir(directory: Path, flag: str = "--report") -> Path:
    """``directory``, created if needed; a path that is a file, or cannot be made, is refused by name."""
    if directory.exists() and not directory.is_dir():
        raise ConfigError(f"{flag} {str(directory)!r} is a file, not a folder: give a folder for the page")
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"{flag} {str(directory)!r} cannot be created: {exc.strerror or exc}") from exc
    return directory


def axes_labels(fig: Any) -> list[dict[str, str]]:
    """Every axes of ``fig`` (secondary axes after their parent): its title and x and y labels, as drawn."""
    found = []
    for ax in fig.axes:
        found.append({"title": ax.get_title(), "xlabel": ax.get_xlabel(), "ylabel": ax.get_ylabel(), "kind": "main"})
        for child in ax.child_axes:
            label = {"title": "", "xlabel": child.get_xlabel(), "ylabel": child.get_ylabel(), "kind": "secondary"}
            found.append(label)
    return found


def _chart_title(fig: Any) -> str:
    suptitle = fig.get_suptitle() if hasattr(fig, "get_suptitle") else ""
    return str(suptitle or (fig.axes[0].get_title() if fig.axes else ""))


def _write_data(directory: Path, chart: Chart, meta: dict[str, Any]) -> None:
    with (directory / f"{chart.name}.csv").open("w", newline="") as out:
        writer = csv.writer(out)
        writer.writerow(chart.columns)
        writer.writerows(chart.rows)
    points = [dict(zip(chart.columns, row, strict=True)) for row in chart.rows]
    (directory / f"{chart.name}.json").write_text(json.dumps({**meta, "points": points}, indent=1) + "\n")


_STYLE = """
body { font: 15px/1.45 system-ui, sans-serif; max-width: 1100px; margin: 2em auto; padding: 0 1em; color: #1d1d1d; }
h1 { font-size: 1.45em; } h2 { font-size: 1.2em; margin-top: 2em; border-bottom: 1px solid #ccc; }
dl { display: grid; grid-template-columns: max-content auto; gap: .2em 1.2em; }
dt { color: #555; } dd { margin: 0; font-variant-numeric: tabular-nums; }
table { border-collapse: collapse; font-variant-numeric: tabular-nums; }
td, th { padding: .2em .7em; border-bottom: 1px solid #ddd; text-align: right; }
th:first-child, td:first-child { text-align: left; }
figure { margin: 1.2em 0; } figure svg { max-width: 100%; height: auto; }
figcaption { color: #555; font-size: .9em; }
.overloaded { color: #b3261e; font-weight: 600; }
"""


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:,.4g}"
    return html.escape(str(value))


def _section_html(section: Section, figures: list[dict[str, Any]]) -> list[str]:
    from kvpool.sim.plots import svg_text

    parts = [f"<section><h2>{html.escape(section.title)}</h2>"]
    if section.facts:
        parts.append("<dl>")
        for label, value in section.facts:
            mark = ' class="overloaded"' if value.startswith("OVERLOADED") else ""
            parts.append(f"<dt>{html.escape(label)}</dt><dd{mark}>{html.escape(value)}</dd>")
        parts.append("</dl>")
    if section.table is not None:
        header, rows = section.table
        parts.append("<table><tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in header) + "</tr>")
        parts.extend("<tr>" + "".join(f"<td>{_cell(v)}</td>" for v in row) + "</tr>" for row in rows)
        parts.append("</table>")
    for chart in section.charts:
        meta = {"name": chart.name, "title": _chart_title(chart.figure), "axes": axes_labels(chart.figure)}
        figures.append(meta)
        links = f'data: <a href="{chart.name}.csv">{chart.name}.csv</a>, <a href="{chart.name}.json">JSON</a>'
        caption = f"{html.escape(chart.caption)} ({links})" if chart.caption else f"({links})"
        svg = svg_text(chart.figure)
        parts.append(f'<figure id="{chart.name}" data-chart="{chart.name}">{svg}<figcaption>{caption}</figcaption>')
        parts.append("</figure>")
    parts.append("</section>")
    return parts


def write_report(directory: Path, *, title: str, sections: Sequence[Section], intro: str = "") -> Path:
    """Write the page and its data files to ``directory`` (made if needed); returns the page's path.

    Each chart's figure is closed once drawn. Chart names must be unique on the page.
    """
    names = [chart.name for section in sections for chart in section.charts]
    if len(set(names)) != len(names):
        raise ConfigError(f"chart names repeat on one page: {sorted(n for n in names if names.count(n) > 1)}")
    prepare_report_dir(directory)
    figures: list[dict[str, Any]] = []
    body = [f"<h1>{html.escape(title)}</h1>"]
    if intro:
        body.append(f"<p>{html.escape(intro)}</p>")
    for section in sections:
        body.extend(_section_html(section, figures))
    meta = {f["name"]: f for f in figures}
    for section in sections:
        for chart in section.charts:
            _write_data(directory, chart, meta[chart.name])
    page = (
        '<!doctype html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>{html.escape(title)}</title><style>{_STYLE}</style></head><body>\n"
        + "\n".join(body)
        + "\n</body></html>\n"
    )
    (directory / "figures.json").write_text(json.dumps(figures, indent=1) + "\n")
    path = directory / "index.html"
    path.write_text(page)
    return path
