"""SimulateOptions: every option stated and checked once; the study runs from it alone, the trace read once."""

from __future__ import annotations

import dataclasses
import json

import pytest
from click.testing import CliRunner

from kvpool.cli.commands import cli
from kvpool.errors import ConfigError
from kvpool.routing import Routing
from kvpool.sim import traces
from kvpool.sim.options import SimulateOptions
from kvpool.sim.simulator import SimulationConfig, simulate
from kvpool.sim.study import Progress, load_requests, run_study
from kvpool.sim.traces import TokenSegment, TraceRequest, write_trace
from kvpool.tiers import WritePolicy

SYNTHETIC = "synthetic:shared_prefix"


def test_derived_fields_are_fixed_at_construction():
    options = SimulateOptions(trace=SYNTHETIC, kv_blocks=100, tier=("cpu:1GiB",), kv_tier_write="write-back")
    assert options.num_blocks == 101  # the null block
    assert options.rules == (Routing.PREFIX,)
    assert options.kv_tier_write is WritePolicy.WRITE_BACK
    assert [t.kind.value for t in options.tier_targets] == ["cpu"]
    assert SimulateOptions(trace=SYNTHETIC, kv_blocks=100, replicas=2).rules == tuple(Routing)
    assert SimulateOptions(trace=SYNTHETIC, curve="50,100").curve == (50, 100)  # the curve alone needs no pool
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.replicas = 3  # type: ignore[misc]


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"kv_blocks": 0}, "0"),
        ({"kv_blocks": None}, "give --kv-blocks N"),
        ({"block_size": True}, "True"),
        ({"step_overhead_ms": float("nan")}, "nan"),
        ({"policy": "coin-flip"}, "coin-flip"),
        ({"hash_algo": "md5"}, "md5"),
        ({"tier": "cpu:1GiB"}, "'cpu:1GiB'"),
        ({"tier": ("cpu:1GiB",), "tier_bandwidth": ("disk=3",)}, "no --tier of kind 'disk'"),
        ({"kv_tier_write": "sideways"}, "sideways"),
        ({"routing": ("random",)}, "random"),
        ({"ttft_slo": -1.0}, "-1.0"),
        ({"ttft_slo_percentile": 100.0}, "100.0"),
        ({"ttft_slo": 2.0, "replicas": 3}, "drop --replicas 3"),
        ({"sequential": True, "replicas": 2}, "--sequential replays one pool alone"),
        ({"curve": "10,x"}, "'10,x'"),
        ({"curve": "0"}, "'0'"),
        ({"curve": "10", "curve_policies": ("lru", "nope")}, "nope"),
    ],
)
def test_a_bad_option_is_refused_naming_its_value(changes, named):
    with pytest.raises(ConfigError, match=None) as err:
        SimulateOptions(**{"trace": SYNTHETIC, "kv_blocks": 100, **changes})
    assert named in str(err.value)


def test_the_study_is_the_simulator_run_with_the_options(tmp_path):
    trace = [TraceRequest.create(f"r{i}", 10.0 * i, (TokenSegment.of([1] * 40 + [i] * 8),), 4) for i in range(12)]
    path = tmp_path / "t.jsonl"
    write_trace(trace, path)
    options = SimulateOptions(trace=str(path), kv_blocks=20, block_size=8)
    requests = load_requests(options)
    report = run_study(options, requests)
    expected = simulate(trace, SimulationConfig(num_blocks=21, block_size=8, hash_algo="xxh3_128"))
    got = report.results[Routing.PREFIX]
    assert dataclasses.replace(got, wall_seconds=0) == dataclasses.replace(expected, wall_seconds=0)
    assert got.hit_tokens > 0


def test_the_command_reads_the_trace_once_for_every_replay_and_the_curve(tmp_path, monkeypatch):
    pytest.importorskip("numpy")
    path = tmp_path / "t.jsonl"
    write_trace([TraceRequest.create(f"r{i}", 5.0 * i, (TokenSegment.of([7] * 32),), 2) for i in range(6)], path)
    reads = []
    real = traces.iter_trace

    def counted(*args, **kwargs):
        reads.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(traces, "iter_trace", counted)
    args = ["simulate", str(path), "--kv-blocks", "20", "--replicas", "2", "--curve", "4,8", "--json"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert set(out["routing"]) == {r.value for r in Routing} and out["curve"]["sizes"] == [4, 8]
    assert len(reads) == 1


def test_progress_is_reported_through_the_given_progress():
    seen = []

    class Recorder(Progress):
        def note(self, text):
            seen.append(text)

    options = SimulateOptions(trace=SYNTHETIC, requests=20, kv_blocks=400, ttft_slo=30.0, routing=(Routing.PREFIX,))
    report = run_study(options, load_requests(options), Recorder())
    assert report.sizing is not None and report.sizing["prefix"].replicas == 1
    assert seen and seen[0].startswith("sizing prefix: 1 replicas")
