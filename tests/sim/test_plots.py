"""The plots say what was simulated, label every axis, and keep coinciding lines visible (read from the Figures)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from kvpool.cli.commands import cli

pytest.importorskip("matplotlib")

from kvpool.sim import plots  # noqa: E402

SUMMARY = {"num_blocks": 301, "block_size": 16, "policy": "lru", "replicas": 3, "routing": "prefix"}


def _labels(fig):
    return [(ax.get_xlabel(), ax.get_ylabel()) for ax in fig.axes]


def _close(fig):
    import matplotlib.pyplot as plt

    plt.close(fig)


def test_a_run_is_described_by_its_pool_block_size_policy_tiers_and_rule():
    assert plots.describe_run(SUMMARY, ("cpu:4GiB",)) == (
        "pool 300 blocks x 16 tokens, policy lru, tiers cpu:4GiB, 3 replicas, routing prefix"
    )
    assert plots.describe_run({**SUMMARY, "replicas": 1}).endswith("no tier, 1 replica")


def test_identical_policies_get_distinct_styles_and_the_legend_says_so():
    curves = {"lru": [0.1, 0.5], "frequency": [0.2, 0.6], "waiting": [0.2, 0.6], "optimum": [0.3, 0.7]}
    fig = plots.hit_rate_curve_figure([100, 1000], curves, title="t", block_size=16, bytes_per_token=131072)
    main = fig.axes[0]
    lines = {line.get_label(): line for line in main.get_lines()}
    assert set(lines) == {"lru", "frequency", "waiting (same as frequency)", "optimum"}
    styles = {(line.get_marker(), str(line.get_linestyle()), line.get_markersize()) for line in lines.values()}
    assert len(styles) == 4  # no line can hide under another one's exact style
    assert main.get_xlabel() == "cache size (blocks of 16 tokens)" and main.get_ylabel() == "token hit rate (%)"
    others = {child.get_xlabel() for child in main.child_axes}
    assert "cache size (tokens)" in others and "cache size (GiB, 131,072 B of KV per token)" in others
    _close(fig)
    fig = plots.hit_rate_curve_figure([100, 1000], curves, title="t", block_size=16)
    assert {c.get_xlabel() for c in fig.axes[0].child_axes} == {"cache size (tokens)"}  # no GiB without the model
    _close(fig)


def test_the_timeline_draws_the_overloaded_verdict_and_labels_every_panel():
    fig = plots.timeline_figure([(0, 0.1), (1, 0.5)], [(0, 0), (1, 3)], [(1, 0.2)], title="t", verdict="OVERLOADED: x")
    assert all(x and y for x, y in _labels(fig))
    assert any(t.get_text() == "OVERLOADED: x" for t in fig.axes[0].texts)
    _close(fig)


def test_the_sizing_chart_draws_the_objective_and_names_the_fewest():
    fig = plots.sizing_figure({"prefix": {1: 9.0, 2: 1.5, 4: 0.4}}, {"prefix": 4}, slo_s=0.5, percentile=90, title="t")
    (ax,) = fig.axes
    labels = [line.get_label() for line in ax.get_lines()]
    assert "prefix: 4 replicas" in labels and "objective: p90 <= 0.5 s" in labels
    assert ax.get_xlabel().startswith("replicas") and ax.get_ylabel() == "p90 time to first token (s)"
    _close(fig)


def _run(tmp_path, *args: str, requests: int = 30):
    base = ["simulate", "synthetic:multi_turn", "--requests", str(requests), "--kv-blocks", "300"]
    result = CliRunner().invoke(cli, [*base, "--plot-dir", str(tmp_path), "--json", *args])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_replicas_plot_the_timeline_of_the_first_rule_and_compare_the_rules(tmp_path, monkeypatch):
    titles: list[str] = []
    real = plots.close

    def record(fig):  # each chart is closed once written
        titles.append(fig.axes[0].get_title() or fig.get_suptitle())
        real(fig)

    monkeypatch.setattr(plots, "close", record)
    data = _run(tmp_path, "--replicas", "2", "--routing", "round-robin", "--routing", "prefix", requests=20)
    assert (tmp_path / "usage.png").is_file() and data["routing_plot"] == str(tmp_path / "routing.png")
    timeline, routing = titles
    assert "pool 300 blocks x 16 tokens" in timeline and "2 replicas, routing round-robin" in timeline
    assert "policy lru" in routing and "Routing rules compared" in routing


def test_ttft_slo_with_plot_dir_writes_the_sizing_chart(tmp_path):
    data = _run(tmp_path, "--ttft-slo", "30s", "--max-replicas", "2", "--routing", "prefix", requests=20)
    assert data["sizing_plot"] == str(tmp_path / "sizing.png")
    assert (tmp_path / "sizing.png").stat().st_size > 1000
