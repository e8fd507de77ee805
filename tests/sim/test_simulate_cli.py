"""``kvpool simulate`` with tiers, replicas, routing, sizing and the timeline plot."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from kvpool.cli.commands import cli


def invoke(*args: str, requests: int = 60):
    return CliRunner().invoke(
        cli, ["simulate", "synthetic:multi_turn", "--requests", str(requests), "--kv-blocks", "300", *args]
    )


@pytest.mark.slow
def test_tiers_report_hits_per_tier_and_their_links(tmp_path):
    # 16-token blocks of 131,072 B per token (the default): 2 MiB each; 600 and 2,000 blocks
    disk_spec = f"disk:{tmp_path}:4000MiB"
    result = invoke("--tier", "cpu:1200MiB", "--tier", disk_spec, "--tier-bandwidth", "disk=2", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    sim = data["simulation"]
    assert set(sim["hit_tokens_by_tier"]) == {"gpu", "cpu", "disk"}
    assert sum(sim["hit_tokens_by_tier"].values()) == sim["prefill_tokens_saved"]
    assert sim["hit_tokens_by_tier"]["cpu"] > 0 and sim["tier_load_seconds"] > 0
    assert data["tiers"][0]["capacity_blocks"] == 600 and data["tiers"][0]["write"] == "write-through"
    disk = data["tiers"][1]
    assert disk["kind"] == "disk" and disk["bandwidth_gb_per_s"] == 2.0 and disk["latency_us"] == 100.0
    assert disk["capacity_blocks"] == 2000 and not any(tmp_path.iterdir())  # nothing written: keys only
    plain = json.loads(invoke("--json").stdout)["simulation"]
    assert sim["token_hit_rate"] > plain["token_hit_rate"]


@pytest.mark.slow
def test_the_table_compares_each_tier_load_with_the_recompute():
    result = invoke(
        "--tier", "redis://127.0.0.1:1/0", "--tier-bandwidth", "redis=0.01", "--kv-tier-write", "write-back"
    )
    assert result.exit_code == 0, result.output
    assert "tier redis (write-back): unbounded (shared by every replica)" in result.stdout
    assert "SLOWER than recomputing it" in result.stdout and "hits by tier" in result.stdout


def test_replicas_compare_every_routing_rule():
    result = invoke("--replicas", "3", "--json", requests=40)
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert set(data["routing"]) == {"prefix", "round-robin", "least-loaded", "expected-ttft", "threshold"}
    for rule, sim in data["routing"].items():
        assert sim["replicas"] == 3 and sim["routing"] == rule
        assert len(sim["per_replica"]) == 3 and sim["request_imbalance"] >= 1.0
    table = invoke("--replicas", "3", "--routing", "prefix", "--routing", "round-robin", requests=20)
    assert "routing over 3 replicas" in table.stdout and "prefix over round-robin" in table.stdout


@pytest.mark.slow
def test_sizing_answers_per_rule(tmp_path):
    result = invoke("--ttft-slo", "500ms", "--ttft-slo-percentile", "50", "--max-replicas", "4", "--json", requests=30)
    assert result.exit_code == 0, result.output
    sizing = json.loads(result.stdout)["sizing"]
    assert set(sizing) == {"prefix", "round-robin", "least-loaded", "expected-ttft", "threshold"}
    for answer in sizing.values():
        assert answer["slo_s"] == 0.5 and answer["percentile"] == 50
        if answer["replicas"] is not None:
            assert answer["ttft_by_replicas"][str(answer["replicas"])] <= 0.5
    assert "sizing prefix: 1 replicas" in result.stderr


def test_an_overloaded_replay_says_so_with_both_rates():
    result = CliRunner().invoke(
        cli,
        [
            "simulate",
            "synthetic:shared_prefix",
            "--requests",
            "60",
            "--kv-blocks",
            "2000",
            "--prefill-us-per-token",
            "2000",
        ],
    )
    assert result.exit_code == 0, result.output
    line = next(line for line in result.stdout.splitlines() if "OVERLOADED" in line)
    assert "prefill tokens/s offered" in line and "prefill tokens/s servable" in line


@pytest.mark.slow
def test_plot_draws_the_timeline(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "timeline.png"
    result = invoke("--plot", str(path))
    assert result.exit_code == 0, result.output
    assert path.stat().st_size > 1000


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--tier", "gpu:5GiB"], "unknown tier spec 'gpu:5GiB'"),
        (["--tier", "cpu=40000"], "unknown tier spec 'cpu=40000'"),  # the engine's grammar, and only it
        (["--tier", "cpu:-5GiB"], "'cpu:-5GiB'"),
        (["--tier", "cpu:100B"], "holds no block of 2097152 bytes"),
        (["--tier", "cpu:1GiB", "--tier", "cpu:2GiB"], "KV tier 'cpu' is given twice"),
        (["--tier", "cpu:1GiB", "--tier-bandwidth", "disk=3"], "no --tier of kind 'disk'"),
        (["--tier", "cpu:1GiB", "--tier-bandwidth", "cpu=0"], "finite number > 0"),
        (["--tier", "cpu:1GiB", "--tier-latency", "cpu=nan"], "finite number >= 0"),
        (["--tier", "cpu:1GiB", "--kv-tier-write", "sideways"], "--kv-tier-write"),
        (["--sequential", "--tier", "cpu:1GiB"], "--sequential replays one pool alone"),
        (["--ttft-slo", "soon"], "is not a duration"),
        (["--ttft-slo", "-2s"], "--ttft-slo"),
        (["--ttft-slo", "2s", "--ttft-slo-percentile", "100"], "--ttft-slo-percentile"),
        (["--replicas", "0"], "--replicas"),
        (["--routing", "random"], "--routing"),
        (["--sequential", "--replicas", "2"], "--sequential replays one pool"),
        (["--ttft-slo", "2s", "--replicas", "3"], "drop --replicas 3"),
    ],
)
def test_bad_flags_exit_2_naming_the_value(args, message):
    result = invoke(*args)
    assert result.exit_code == 2, result.output
    assert message in result.stderr and "Traceback" not in result.output


def test_tier_loads_are_sized_from_the_model_or_the_flag():
    from kvpool.model_config import load_model_config
    from kvpool.model_layers import layer_specs_from_config
    from kvpool.specs import group_layers, pool_block_bytes

    block = pool_block_bytes(group_layers(layer_specs_from_config(load_model_config("smollm2-135m"), block_size=16)))
    sized = json.loads(invoke("--tier", "cpu:1GiB", "--model", "smollm2-135m", "--json", requests=5).stdout)
    assert sized["tiers"][0]["load_ms_per_block"] == pytest.approx((10e-6 + block / 25e9) * 1e3)
    given = json.loads(invoke("--tier", "cpu:1MiB", "--kv-bytes-per-token", "1000", "--json", requests=5).stdout)
    assert given["tiers"][0]["load_ms_per_block"] == pytest.approx((10e-6 + 16_000 / 25e9) * 1e3)


@pytest.mark.slow
def test_always_load_turns_the_load_or_compute_rule_off():
    slow = ("--tier", "redis://127.0.0.1:6379/0", "--tier-latency", "redis=50000", "--json")
    decided = json.loads(invoke(*slow).stdout)["simulation"]
    always = json.loads(invoke(*slow, "--kv-tier-always-load").stdout)["simulation"]
    assert decided["tier_blocks_computed"]["redis"] > 0 and decided["hit_tokens_by_tier"].get("redis", 0) == 0
    assert not always["tier_blocks_computed"] and always["hit_tokens_by_tier"]["redis"] > 0
    assert always["ttft_p90_s"] > decided["ttft_p90_s"]  # 50 ms a fetch is slower than computing
