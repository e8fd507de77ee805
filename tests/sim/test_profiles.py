"""The simulator takes its step time from a cost profile (kvpool.cost_model): named, from a file, overridden."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from kvpool.cli.commands import cli
from kvpool.cost_model import DEFAULT_PROFILE, CostProfile, load_profile
from kvpool.errors import ConfigError
from kvpool.sim.options import SimulateOptions
from kvpool.sim.simulator import SimulationConfig, simulate
from kvpool.sim.traces import SharedSegment, TraceRequest


def one_request(prompt: int = 64, output: int = 4) -> list[TraceRequest]:
    return [TraceRequest.create("a", 0.0, (SharedSegment(name="p", length=prompt),), output)]


def test_the_default_is_the_round_profile():
    assert SimulationConfig(num_blocks=64).cost == load_profile(DEFAULT_PROFILE) == load_profile("round-8b-h100")
    options = SimulateOptions(trace="synthetic:multi_turn", kv_blocks=64)
    assert options.cost == load_profile("round-8b-h100")


def test_decode_steps_pay_for_the_context_they_read():
    flat = CostProfile.flat(step_overhead_s=0.01, prefill_s_per_token=0.001, decode_s_per_seq=0.002)
    reading = flat.with_fields(s_per_context_token=1e-4)
    base = simulate(one_request(), SimulationConfig(num_blocks=64, cost=flat))
    more = simulate(one_request(), SimulationConfig(num_blocks=64, cost=reading))
    assert base.ttft_p50_s == more.ttft_p50_s == pytest.approx(0.01 + 0.064)  # the prefill reads no earlier KV
    # Three decode steps after the first token read 64, 65 and 66 tokens of context.
    assert more.simulated_seconds - base.simulated_seconds == pytest.approx(1e-4 * (64 + 65 + 66))


def test_prefill_rate_follows_the_chunk_size():
    points = CostProfile(
        name="chunky",
        source="test",
        step_overhead_s=0.0,
        prefill_s_per_token=((16, 2e-3), (64, 1e-3)),
        decode_s_per_seq=0.0,
        s_per_context_token=0.0,
        kv_bytes_per_token=1,
    )
    small = simulate(one_request(prompt=16, output=1), SimulationConfig(num_blocks=64, cost=points))
    large = simulate(one_request(prompt=64, output=1), SimulationConfig(num_blocks=64, cost=points))
    assert small.ttft_p50_s == pytest.approx(16 * 2e-3)
    assert large.ttft_p50_s == pytest.approx(64 * 1e-3)


def test_flags_override_the_named_profile_and_keep_the_rest():
    h100 = load_profile("llama-3.1-8b-h100")
    options = SimulateOptions(
        trace="synthetic:multi_turn", kv_blocks=64, profile="llama-3.1-8b-h100", step_overhead_ms=2.0
    )
    assert options.cost.step_overhead_s == 0.002
    assert options.cost.decode_s_per_seq == h100.decode_s_per_seq
    assert options.cost.s_per_context_token == h100.s_per_context_token


def test_a_profile_file_is_read_and_a_bad_one_is_refused_by_its_field(tmp_path):
    good = load_profile("round-8b-h100").with_fields(name="mine", decode_s_per_seq=0.5)
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(good.to_dict()))
    assert SimulateOptions(trace="synthetic:multi_turn", kv_blocks=64, profile=str(path)).cost == good
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**good.to_dict(), "decode_s_per_seq": -1}))
    with pytest.raises(ConfigError, match="decode_s_per_seq"):
        SimulateOptions(trace="synthetic:multi_turn", kv_blocks=64, profile=str(bad))
    with pytest.raises(ConfigError, match="'no-such-gpu' is neither a built-in profile"):
        SimulateOptions(trace="synthetic:multi_turn", kv_blocks=64, profile="no-such-gpu")


def test_the_command_takes_a_profile_and_refuses_a_bad_one():
    runner = CliRunner()
    args = ["simulate", "synthetic:multi_turn", "--kv-blocks", "2000", "--requests", "40", "--json"]
    default = json.loads(runner.invoke(cli, args).stdout)["simulation"]
    h100 = json.loads(runner.invoke(cli, [*args, "--profile", "llama-3.1-8b-h100"]).stdout)["simulation"]
    assert default["prompt_tokens"] == h100["prompt_tokens"]
    assert h100["ttft_p50_s"] < default["ttft_p50_s"]  # the derived H100 figures are faster than the round ones
    bad = runner.invoke(cli, [*args, "--profile", "no-such-gpu"])
    assert bad.exit_code != 0 and "no-such-gpu" in bad.output
