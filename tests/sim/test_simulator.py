"""The scheduler-driven simulator and the ``kvpool simulate`` command."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from click.testing import CliRunner

from kvpool.cli.commands import cli
from kvpool.cost_model import CostProfile
from kvpool.sim.simulator import SimulationConfig, simulate
from kvpool.sim.traces import SharedSegment, TraceRequest, UniqueSegment
from kvpool.sim.workloads import generate_workload


def two_requests(gap_ms: float) -> list[TraceRequest]:
    shared = SharedSegment(name="system", length=64)
    return [
        TraceRequest.create("a", 0.0, (shared, UniqueSegment(length=8)), 4),
        TraceRequest.create("b", gap_ms, (shared, UniqueSegment(length=8)), 4),
    ]


def test_a_later_request_hits_the_shared_prefix_and_time_follows_the_cost_model():
    cost = CostProfile.flat(step_overhead_s=0.01, prefill_s_per_token=0.001, decode_s_per_seq=0.002)
    result = simulate(two_requests(gap_ms=10_000), SimulationConfig(num_blocks=64, cost=cost))
    assert result.requests == 2 and result.rejected == 0
    assert result.hit_tokens == 64  # b finds a's 64-token system prompt (4 blocks of 16)
    assert result.token_hit_rate == pytest.approx(64 / 144)
    assert result.prefill_tokens_computed == 72 + 8
    assert result.output_tokens == 8
    # a: one prefill step (72 tokens) + 3 decode steps; b arrives 10 s later: prefill 8 tokens + 3 decodes.
    a_time = (0.01 + 0.072) + 3 * (0.01 + 0.002)
    b_time = (0.01 + 0.008) + 3 * (0.01 + 0.002)
    assert result.simulated_seconds == pytest.approx(10.0 + b_time)
    assert result.ttft_p50_s == pytest.approx((0.01 + 0.072 + 0.01 + 0.008) / 2)
    assert a_time < 10.0


def test_replays_are_repeatable_and_every_request_finishes():
    trace = generate_workload("mixed", num_requests=120, seed=3)
    config = SimulationConfig(num_blocks=1200, max_num_batched_tokens=1024)
    one, two = simulate(trace, config), simulate(trace, config)
    assert replace(one, wall_seconds=0) == replace(two, wall_seconds=0)
    assert one.output_tokens == sum(max(1, r.output_length) for r in trace)
    assert one.preemptions > 0 and one.evictions > 0  # a small pool is under pressure
    assert 0 < one.token_hit_rate < 1 and one.peak_usage <= 1.0


@pytest.mark.parametrize("policy", ["lru", "frequency", "waiting"])
def test_every_policy_replays_the_same_trace(policy):
    trace = generate_workload("multi_turn", num_requests=80, seed=1)
    result = simulate(trace, SimulationConfig(num_blocks=800, policy=policy))
    assert result.policy == policy
    assert result.output_tokens == sum(max(1, r.output_length) for r in trace)


def test_simulate_command_json(tmp_path):
    runner = CliRunner()
    result = runner.invoke(
        cli,
        [
            "simulate",
            "synthetic:shared_prefix",
            "--requests",
            "60",
            "--kv-blocks",
            "600",
            "--json",
            "--curve",
            "100,400",
            "--curve-policies",
            "lru,frequency",
            "--plot-dir",
            str(tmp_path),
        ],
    )
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    sim = data["simulation"]
    for key in (
        "token_hit_rate",
        "block_hit_rate",
        "prefill_tokens_saved",
        "evictions",
        "preemptions",
        "ttft_p50_s",
        "output_tokens_per_s",
        "usage_timeline",
    ):
        assert key in sim
    assert data["requests"] == 60
    curve = data["curve"]
    assert curve["sizes"] == [100, 400]
    assert set(curve["token_hit_rate"]) == {"lru", "frequency", "optimum"}
    for rates in zip(*curve["token_hit_rate"].values()):
        assert max(rates[:-1]) <= rates[-1] + 1e-9  # no policy beats the optimum
    assert (tmp_path / "usage.png").stat().st_size > 1000
    assert (tmp_path / "hit_rate_curve.png").stat().st_size > 1000


def test_simulate_command_sequential_table():
    result = CliRunner().invoke(
        cli, ["simulate", "synthetic:multi_turn", "--requests", "40", "--kv-blocks", "300", "--sequential"]
    )
    assert result.exit_code == 0, result.output
    assert "token_hit_rate" in result.stdout and "(sequential)" in result.stdout


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        (['{"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": [1]}', "{not json"], "line 2"),
        (['{"timestamp": 0, "output_length": 2, "hash_ids": [1]}'], "input_length"),
        (['{"timestamp": 0, "input_length": -3, "output_length": 2, "hash_ids": [1]}'], "input_length"),
        ([], "empty"),
    ],
)
def test_bad_traces_exit_2_naming_the_line_and_field(tmp_path, lines, message):
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + ("\n" if lines else ""))
    result = CliRunner().invoke(cli, ["simulate", str(path), "--kv-blocks", "100"])
    assert result.exit_code == 2
    assert message in result.stderr and "Traceback" not in result.output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["synthetic:mixed", "--kv-blocks", "100", "--policy", "clairvoyant"], "unknown eviction policy 'clairvoyant'"),
        (["synthetic:mixed"], "give --kv-blocks N"),
        (["synthetic:mixed", "--kv-blocks", "100", "--curve", "10,x"], "--curve must be comma-separated integers"),
        (["/no/such/trace.jsonl", "--kv-blocks", "100"], "no such trace file"),
    ],
)
def test_bad_options_exit_2(args, message):
    result = CliRunner().invoke(cli, ["simulate", *args])
    assert result.exit_code == 2
    assert message in result.stderr


def test_curve_alone_skips_the_single_run_and_passes_the_lookahead():
    result = CliRunner().invoke(
        cli,
        [
            "simulate",
            "synthetic:agent",
            "--requests",
            "80",
            "--curve",
            "200,800",
            "--curve-policies",
            "lru,waiting",
            "--lookahead",
            "8",
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert "simulation" not in data and "sequential" not in data
    assert data["curve"]["lookahead"] == 8
    assert len(data["curve"]["token_hit_rate"]["waiting"]) == 2
