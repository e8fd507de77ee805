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
