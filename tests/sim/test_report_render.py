"""The HTML report renders in headless Chromium with no console error, every chart drawn and its axes labelled.

Chromium is driven over the DevTools protocol (``tests/chromium.py``): the test hears every console
error, uncaught exception and failed resource load while the page loads, then asks the rendered
DOM for each chart's size and text. Without chromium it skips, naming it; under ``CI=true`` it fails.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvpool.cli.commands import cli
from tests.chromium import Chromium, chromium_binary

pytest.importorskip("matplotlib")
pytest.importorskip("numpy")

#: Per chart on the page: its name, its rendered size, and the text its SVG draws.
RENDERED = """JSON.stringify([...document.querySelectorAll("figure[data-chart]")].map(f => {
  const svg = f.querySelector("svg"), box = svg ? svg.getBoundingClientRect() : {width: 0, height: 0};
  return {name: f.dataset.chart, width: box.width, height: box.height,
          texts: svg ? [...svg.querySelectorAll("text")].map(t => t.textContent.trim()) : []};
}))"""


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    with Chromium(chromium_binary(), tmp_path_factory.mktemp("chromium-profile")) as chromium:
        yield chromium


def _report(directory: Path, *args: str) -> Path:
    base = ["simulate", "synthetic:multi_turn", "--requests", "20", "--kv-blocks", "300", "--report", str(directory)]
    result = CliRunner().invoke(cli, [*base, *args])
    assert result.exit_code == 0, result.output
    return directory


def check_rendered(browser: Chromium, directory: Path) -> list[str]:
    session, errors = browser.open((directory / "index.html").as_uri())
    assert errors == [], errors
    rendered = {chart["name"]: chart for chart in json.loads(browser.evaluate(session, RENDERED))}
    figures = json.loads((directory / "figures.json").read_text())
    assert [f["name"] for f in figures] == list(rendered)
    for figure in figures:
        chart = rendered[figure["name"]]
        assert chart["width"] > 200 and chart["height"] > 150, chart  # drawn, not an empty box
        for axes in figure["axes"]:
            labels = [axes["xlabel"]] if axes["kind"] == "secondary" else [axes["xlabel"], axes["ylabel"]]
            for label in labels:
                assert label and label in chart["texts"], (figure["name"], label)
    return list(rendered)


def test_the_report_of_replicas_and_a_curve_renders_labelled(browser, tmp_path):
    page = _report(tmp_path, "--replicas", "2", "--routing", "prefix", "--routing", "round-robin", "--curve", "100,300")
    assert check_rendered(browser, page) == ["usage", "routing", "hit_rate_curve"]


def test_the_report_of_a_sizing_search_renders_labelled(browser, tmp_path):
    page = _report(
        tmp_path, "--ttft-slo", "30s", "--max-replicas", "2", "--routing", "prefix", "--model", "llama-3.1-8b"
    )
    assert check_rendered(browser, page) == ["sizing"]


def test_the_report_of_sweep_records_renders_labelled(browser, tmp_path):
    from kvpool.sim.sweep_charts import write_sweep_report
    from tests.sim.test_report import _record

    records = [_record(replicas=n, routing=r, ttft_slo=1.0) for n in (1, 2, 4) for r in ("prefix", "round-robin")]
    records += [_record(kv_blocks=b, policy=p) for b in (500, 2000) for p in ("lru", "frequency")]
    write_sweep_report(records, tmp_path)
    assert check_rendered(browser, tmp_path)[0] == "sweep_cheapest"


def test_the_check_hears_console_errors_and_missing_files(browser, tmp_path):
    """The control: a page that logs an error, throws and names a missing image is caught on all three."""
    page = tmp_path / "broken.html"
    page.write_text('<!doctype html><img src="absent.png"><script>console.error("boom"); missing();</script>')
    _, errors = browser.open(page.as_uri())
    assert any("ERR_FILE_NOT_FOUND" in e for e in errors) and "console: boom" in errors
    assert any(e.startswith("exception: ReferenceError") for e in errors)


def test_the_documented_report_and_screenshot_commands_run(browser, tmp_path, monkeypatch):
    """docs/simulator.md's two commands, as pasted: the report, then chromium's screenshot of it."""
    import re
    import shlex
    import subprocess

    text = (Path(__file__).resolve().parents[2] / "docs" / "simulator.md").read_text()
    (block,) = re.findall(r"test_report_render\.py -->\n```sh\n(.*?)^```", text, re.M | re.S)
    report_line, screenshot_line = block.splitlines()
    monkeypatch.chdir(tmp_path)
    args = shlex.split(report_line)
    assert args[:2] == ["kvpool", "simulate"]
    result = CliRunner().invoke(cli, args[1:])
    assert result.exit_code == 0, result.output
    assert check_rendered(browser, tmp_path / "report") == ["usage", "routing", "hit_rate_curve"]
    screenshot = shlex.split(screenshot_line)
    assert screenshot[0] == "chromium"
    profile = f"--user-data-dir={tmp_path / 'profile'}"
    subprocess.run([chromium_binary(), profile, *screenshot[1:]], check=True, capture_output=True, timeout=120)
    assert (tmp_path / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
