"""Progress where stderr is not a terminal: plain lines now and then, not a bar that only a terminal draws."""

from __future__ import annotations

import io
import json
import re

import pytest
from click.testing import CliRunner

from kvpool.cli.commands import cli
from kvpool.errors import ConfigError
from kvpool.sim.options import SimulateOptions
from kvpool.sim.progress import ProgressLines
from kvpool.sim.sequential import replay_sequential
from kvpool.sim.study import load_requests, run_study

LINE = re.compile(r"^(?P<label>[^:]+): (?P<done>[\d,]+) of (?P<total>[\d,]+) \((?P<share>\d+)%\), (?P<s>\d+) s$")


class Clock:
    """Seconds that pass only when the test says so."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def parsed(text: str) -> list[dict[str, str]]:
    lines = [LINE.match(line) for line in text.splitlines()]
    assert all(lines), text
    return [m.groupdict() for m in lines if m]


def test_a_replay_writes_a_line_every_n_requests_and_at_its_end() -> None:
    out = io.StringIO()
    options = SimulateOptions(trace="synthetic:multi_turn", requests=40, kv_blocks=300)
    report = run_study(options, load_requests(options), ProgressLines(out, every_items=10, every_s=None, clock=Clock()))
    lines = parsed(out.getvalue())
    assert report.results and {line["label"] for line in lines} == {"replaying"}
    done = [int(line["done"]) for line in lines]
    assert len(done) >= 4 and done == sorted(set(done)) and done[-1] == 40
    assert all(line["total"] == "40" for line in lines) and lines[-1]["share"] == "100"
    assert all(d >= 10 * (i + 1) for i, d in enumerate(done[:-1]))  # one line per 10 done, no more


def test_by_default_a_line_every_tenth_and_one_when_the_seconds_pass() -> None:
    out, clock = io.StringIO(), Clock()
    with ProgressLines(out, every_s=30, clock=clock).bar("replaying", 12_000) as advance:
        advance(1_199)  # short of 10%: nothing yet
        assert out.getvalue() == ""
        advance(1)
        assert out.getvalue() == "replaying: 1,200 of 12,000 (10%), 0 s\n"
        clock.now += 41
        advance(600)  # 15%: no tenth crossed, but 41 s since the last line
        assert out.getvalue().splitlines()[-1] == "replaying: 1,800 of 12,000 (15%), 41 s"
        advance(1_200)  # past 20%
    assert out.getvalue().splitlines() == [  # and nothing more at the end: the last line said where it ended
        "replaying: 1,200 of 12,000 (10%), 0 s",
        "replaying: 1,800 of 12,000 (15%), 41 s",
        "replaying: 3,000 of 12,000 (25%), 41 s",
    ]


def test_a_bar_left_early_says_where_it_ended_once() -> None:
    out = io.StringIO()
    with ProgressLines(out, every_items=5, every_s=None, clock=Clock()).bar("hit-rate curve", 12) as advance:
        for _ in range(7):
            advance(1)
    assert out.getvalue().splitlines() == ["hit-rate curve: 5 of 12 (41%), 0 s", "hit-rate curve: 7 of 12 (58%), 0 s"]


def test_the_sequential_replay_counts_each_request_once() -> None:
    options = SimulateOptions(trace="synthetic:shared_prefix", requests=2_500, kv_blocks=2_000)
    counts: list[int] = []
    replay_sequential(load_requests(options), 2_000, progress=counts.append)
    assert counts == [1000, 1000, 500]


def test_kvpool_simulate_writes_lines_when_stderr_is_captured() -> None:
    args = ["simulate", "synthetic:multi_turn", "--requests", "60", "--kv-blocks", "300"]
    result = CliRunner().invoke(cli, args)  # CliRunner's stderr is no terminal
    assert result.exit_code == 0, result.output
    lines = parsed(result.stderr)
    assert len(lines) >= 5 and lines[-1]["done"] == "60" and lines[-1]["share"] == "100"
    assert "replaying" not in result.stdout  # the figures stay alone on stdout
    as_json = CliRunner().invoke(cli, [*args, "--json"])
    assert as_json.exit_code == 0, as_json.output
    assert parsed(as_json.stderr)[-1]["done"] == "60"  # --json keeps the lines on stderr
    assert json.loads(as_json.stdout)["simulation"]["requests"] == 60  # and stdout stays one JSON document


@pytest.mark.parametrize(
    ("option", "value"),
    [("every_fraction", 0), ("every_fraction", 1.5), ("every_items", 0), ("every_s", -1.0), ("every_s", True)],
)
def test_a_bad_interval_is_refused_by_name(option: str, value: object) -> None:
    with pytest.raises(ConfigError, match=f"{option} must be .*got {value!r}"):
        ProgressLines(io.StringIO(), **{option: value})  # type: ignore[arg-type]
