"""Sweep files: each bad grid refused by name before anything runs; results kept as jobs finish; resuming; progress."""

from __future__ import annotations

import io
import json
import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from kvpool.cli.commands import cli
from kvpool.errors import ConfigError
from kvpool.routing import DEFAULT_LOAD_COST
from kvpool.sim.progress import ProgressLines
from kvpool.sim.sweep import Sweep, SweepJob
from kvpool.sim.sweep_executors import SerialExecutor
from kvpool.sim.sweep_results import SweepResults, read_results
from kvpool.sim.sweep_runner import run_sweep

ROOT = Path(__file__).resolve().parents[2]
BASE = {"trace": "synthetic:multi_turn", "requests": 12, "kv_blocks": 200}


class Clock:
    """Seconds that pass only when the test says so."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def no_job_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(self: SweepJob) -> dict[str, object]:
        raise AssertionError("a job ran before the grid was checked")

    monkeypatch.setattr(SweepJob, "run", refuse)


@pytest.mark.parametrize(
    ("grid", "named"),
    [
        ({"replica": [1, 2]}, ["unknown key 'replica'"]),
        ({"kv-blocks": []}, ["kv-blocks = []"]),
        ({"kv-blocks": 100}, ["kv-blocks must be a list", "100"]),
        ({"kv-blocks": [100, 100]}, ["kv-blocks lists 100 twice"]),
        ({"kv-blocks": [100, 0]}, ["kv-blocks = 0", "--kv-blocks"]),
        ({"kv-blocks": [100, "big"]}, ["kv-blocks = 'big'", "--kv-blocks"]),
        ({"policy": ["lru", "lfu"]}, ["policy = 'lfu'", "unknown eviction policy 'lfu'"]),
        ({"routing": ["prefix", "nearest"]}, ["routing = 'nearest'"]),
        ({"tier": [[], ["tape:1GiB"]]}, ["tier = ['tape:1GiB']"]),
        ({"arrival-rate-scale": [1.0, -2.0]}, ["arrival-rate-scale = -2.0", "--arrival-rate-scale"]),
        ({"ttft-slo": [1.0], "replicas": [1, 2]}, ["ttft-slo = 1.0, replicas = 2", "--ttft-slo"]),
        ({"replicas": [{"a": 1}]}, ["replicas value", "is a table"]),
        ({}, ["names no key"]),
    ],
)
def test_a_bad_grid_is_refused_by_name_before_anything_runs(
    grid: dict[str, object], named: list[str], no_job_runs: None
) -> None:
    with pytest.raises(ConfigError) as refused:
        Sweep.from_grid(grid, BASE, source="grid.toml")
    message = str(refused.value)
    assert message.startswith("grid.toml: ")
    for words in named:
        assert words in message, message


def test_keys_take_the_flag_spelling_or_the_field_spelling() -> None:
    dashes = Sweep.from_grid({"kv-blocks": [100, 200]}, BASE)
    underscores = Sweep.from_grid({"kv_blocks": [100, 200]}, BASE)
    assert [j.key for j in dashes.jobs] == [j.key for j in underscores.jobs]
    assert [j.options().num_blocks for j in dashes.jobs] == [101, 201]


def test_the_grid_is_the_cross_product_in_file_order() -> None:
    sweep = Sweep.from_grid({"replicas": [1, 2], "routing": ["prefix", "round-robin"], "tier": [[], "cpu:1GiB"]}, BASE)
    configs = [job.config.to_json() for job in sweep.jobs]
    assert len(configs) == 8 and [job.index for job in sweep.jobs] == list(range(8))
    assert configs[0] == {"replicas": 1, "routing": "prefix", "tier": []}
    assert configs[1] == {"replicas": 1, "routing": "prefix", "tier": "cpu:1GiB"}
    assert sweep.jobs[1].options().tier == ("cpu:1GiB",)
    assert len({job.key for job in sweep.jobs}) == 8


def test_a_file_that_is_not_toml_is_refused_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text("replicas = [1, 2\n")
    with pytest.raises(ConfigError, match="bad.toml.*not a TOML file"):
        Sweep.from_file(path, BASE)


def test_the_cli_refuses_a_bad_grid_and_writes_nothing(tmp_path: Path) -> None:
    grid, out = tmp_path / "grid.toml", tmp_path / "out.jsonl"
    grid.write_text('kv-blocks = [100]\npolicy = ["lru", "lfu"]\n')
    result = CliRunner().invoke(
        cli, ["simulate", "synthetic:multi_turn", "--sweep", str(grid), "--sweep-out", str(out), "--workers", "1"]
    )
    assert result.exit_code != 0
    assert "policy = 'lfu'" in result.output and "unknown eviction policy" in result.output
    assert not out.exists()


def test_results_are_kept_and_a_rerun_skips_what_is_done(tmp_path: Path) -> None:
    sweep = Sweep.from_grid({"kv-blocks": [100, 200, 400]}, BASE)
    out = tmp_path / "out.jsonl"
    run_sweep(Sweep(source="part", jobs=sweep.jobs[:2]), SerialExecutor(), SweepResults(out))  # stopped after two
    assert [r["index"] for r in read_results(out)] == [0, 1]
    with out.open("a") as f:
        f.write('{"index": 2, "key": "cut sho')  # the sweep stopped while writing the third
    stream = io.StringIO()
    summary = run_sweep(sweep, SerialExecutor(), SweepResults(out), ProgressLines(stream, clock=Clock()))
    assert (summary.total, summary.ran, summary.skipped) == (3, 1, 2)
    assert f"sweep: 2 of 3 configurations already in {out}, skipped; running the other 1" in stream.getvalue()
    records = read_results(out)
    assert [r["index"] for r in records] == [0, 1, 2]
    assert [r["config"] for r in records] == [{"kv-blocks": 100}, {"kv-blocks": 200}, {"kv-blocks": 400}]
    whole = Path(tmp_path / "whole.jsonl")
    run_sweep(sweep, SerialExecutor(), SweepResults(whole))
    assert [r["figures"] for r in read_results(whole)] == [r["figures"] for r in records]


def test_a_different_base_is_not_taken_for_done(tmp_path: Path) -> None:
    out = tmp_path / "out.jsonl"
    run_sweep(Sweep.from_grid({"kv-blocks": [100]}, BASE), SerialExecutor(), SweepResults(out))
    other = Sweep.from_grid({"kv-blocks": [100]}, {**BASE, "requests": 13})
    assert run_sweep(other, SerialExecutor(), SweepResults(out)).ran == 1


def test_a_results_file_with_a_foreign_line_is_refused(tmp_path: Path) -> None:
    out = tmp_path / "out.jsonl"
    out.write_text('{"not": "a result"}\n')
    with pytest.raises(ConfigError, match="line 1 is not a sweep result"):
        SweepResults(out)


LINE = re.compile(r"^sweep: (\d+) of 4 \((\d+)%\), (\d+) s(, about (\d+) s left)?$")


def test_progress_lines_give_done_total_elapsed_and_remaining(tmp_path: Path) -> None:
    sweep = Sweep.from_grid({"kv-blocks": [100, 200, 300, 400]}, BASE)
    clock, stream = Clock(), io.StringIO()

    class Ticking(SerialExecutor):
        def run(self, jobs: Sequence[SweepJob]) -> Iterator[tuple[SweepJob, dict[str, Any]]]:
            for job, figures in super().run(jobs):
                clock.now += 10.0  # each configuration takes ten (simulated) seconds
                yield job, figures

    run_sweep(
        sweep,
        Ticking(),
        SweepResults(tmp_path / "out.jsonl"),
        ProgressLines(stream, every_items=1, every_s=None, clock=clock, remaining=True),
    )
    lines = [LINE.match(line) for line in stream.getvalue().splitlines()]
    assert all(lines), stream.getvalue()
    got = [(int(m[1]), int(m[3]), m[5]) for m in lines if m]
    assert got == [(1, 10, "30"), (2, 20, "20"), (3, 30, "10"), (4, 40, None)]


def test_the_cli_writes_progress_lines_when_stderr_is_not_a_terminal(tmp_path: Path) -> None:
    grid, out = tmp_path / "grid.toml", tmp_path / "out.jsonl"
    grid.write_text("kv-blocks = [100, 200]\n")
    args = ["simulate", "synthetic:multi_turn", "--requests", "12", "--sweep", str(grid), "--sweep-out", str(out)]
    result = CliRunner().invoke(cli, [*args, "--workers", "1"])
    assert result.exit_code == 0, result.output
    assert "sweep: 2 of 2 (100%)" in result.output
    assert f"2 configurations, 2 run now, 0 already done; results in {out}" in result.output
    again = CliRunner().invoke(cli, [*args, "--workers", "1", "--json"])
    assert again.exit_code == 0, again.output
    body = json.loads(again.stdout)
    assert [r["config"] for r in body["results"]] == [{"kv-blocks": 100}, {"kv-blocks": 200}]


def test_the_cli_refuses_workers_without_a_sweep() -> None:
    result = CliRunner().invoke(cli, ["simulate", "synthetic:multi_turn", "--kv-blocks", "100", "--workers", "2"])
    assert result.exit_code != 0 and "--workers and --ray run the configurations of a --sweep" in result.output


def test_the_shipped_example_sweep_runs(tmp_path: Path) -> None:
    out = tmp_path / "out.jsonl"
    example = ROOT / "examples" / "sweep.toml"
    args = ["simulate", "synthetic:multi_turn", "--requests", "12", "--sweep", str(example), "--sweep-out", str(out)]
    result = CliRunner().invoke(cli, [*args, "--workers", "1"])
    assert result.exit_code == 0, result.output
    assert len(read_results(out)) == len(Sweep.from_file(example, {"trace": "synthetic:multi_turn"}).jobs) == 8


def test_arrival_rate_scale_divides_the_arrival_times() -> None:
    from kvpool.sim.options import SimulateOptions
    from kvpool.sim.study import load_requests

    plain = load_requests(SimulateOptions(**BASE))
    faster = load_requests(SimulateOptions(**BASE, arrival_rate_scale=4.0))
    assert [r.arrival_ms / 4 for r in plain] == [r.arrival_ms for r in faster]
    assert [r.prompt_token_ids() for r in plain] == [r.prompt_token_ids() for r in faster]
    with pytest.raises(ConfigError, match="--arrival-rate-scale must be a finite number > 0, got 0"):
        SimulateOptions(**BASE, arrival_rate_scale=0)


def test_the_prefix_rule_weight_can_be_swept_and_its_default_is_the_routers(tmp_path: Path) -> None:
    base = {**BASE, "requests": 40, "kv_blocks": 400, "replicas": 2}
    sweep = Sweep.from_grid({"routing": ["prefix"], "routing-load-cost": [DEFAULT_LOAD_COST, 1e-6, 1e3]}, base)
    run_sweep(sweep, SerialExecutor(), SweepResults(tmp_path / "out.jsonl"))
    figures = [r["figures"]["routing"]["prefix"] for r in read_results(tmp_path / "out.jsonl")]
    default = Sweep.from_grid({"routing": ["prefix"]}, base).jobs[0].run()["routing"]["prefix"]
    assert figures[0] == default
    assert figures[1] != figures[2]  # sticking to cached blocks against balancing the queues
    with pytest.raises(ConfigError, match="routing-load-cost = 0"):
        Sweep.from_grid({"routing-load-cost": [0]}, base)


def test_the_cli_writes_a_sweeps_report_page_from_its_results(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    grid, out, page = tmp_path / "grid.toml", tmp_path / "out.jsonl", tmp_path / "report"
    grid.write_text('kv-blocks = [100, 200]\npolicy = ["lru", "frequency"]\n')
    args = ["simulate", "synthetic:multi_turn", "--requests", "12", "--sweep", str(grid), "--sweep-out", str(out)]
    result = CliRunner().invoke(cli, [*args, "--workers", "1", "--report", str(page)])
    assert result.exit_code == 0, result.output
    assert f"report: {page / 'index.html'}" in result.output
    charts = json.loads((page / "figures.json").read_text())
    assert charts and all(axes["xlabel"] and axes["ylabel"] for chart in charts for axes in chart["axes"]), charts
    assert "results (a configuration under one routing rule each)" in (page / "index.html").read_text()
