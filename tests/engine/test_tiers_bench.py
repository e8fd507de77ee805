"""benchmarks/bench_tiers.py on tiny inputs: its throughput measurement moves real blocks and checks them."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import bench_tiers  # noqa: E402

pytestmark = pytest.mark.engine


@pytest.mark.parametrize("tier", ["cpu", "disk"])
def test_throughput_round_trips_blocks_through_a_tier(tier, tmp_path):
    spec = bench_tiers.tier_spec(tier, tmp_path, "redis://unused", "64MiB")
    row = bench_tiers.throughput(tier, spec, blocks=2, repeats=1)  # asserts that what loads is what was saved
    assert row["block_bytes"] == 30 * 2 * 16 * 3 * 64 * 4
    assert row["save_gbps"] > 0 and row["load_gbps"] > 0


def test_throughput_through_redis(redis_url):
    row = bench_tiers.throughput("redis", redis_url, blocks=2, repeats=1)
    assert row["save_gbps"] > 0 and row["load_gbps"] > 0


def test_the_ttft_sweep_compares_each_tier_with_no_tier(redis_url, tmp_path):
    from tests.engine.tiny_models import build_model, save_model

    folder = save_model(build_model("llama"), tmp_path / "llama")  # 256 positions: the 300-token size is capped
    options = bench_tiers.SweepOptions(
        sizes=(40, 300), repeats=1, delay_ms=1, trickle_bytes=64, trickle_pause_ms=0, throttled_max_tokens=300,
        trickle_max_tokens=40, other_loading_tokens=40, other_tokens=8, kv_cache_memory="2MiB", model=str(folder),
    )  # fmt: skip
    result = bench_tiers.sweep(options, redis_url, tmp_path)
    assert result["sizes"] == [40, 255] and result["context"] == 256
    tiers = result["tiers"]
    assert set(tiers) == set(bench_tiers.SWEEP_TIERS)
    assert set(tiers["redis-trickle"]) == {"40"}  # past --trickle-max-tokens: not measured
    for tier, by_size in tiers.items():
        for n, row in by_size.items():
            # whole blocks only, at most every one before the last token (fewer where computing them wins)
            assert row["tokens_loaded"] % 16 == 0 and 0 <= row["tokens_loaded"] <= (int(n) - 1) // 16 * 16, (tier, n)
            assert row["no_tier_s"] > 0 and row["loaded_s"] > 0 and row["slower"] in (0, 1)
    assert result["requests"] == 9 and 0 <= result["slower_requests"] <= 9
    assert result["other_request"]["other_with_tier_s"] > 0
