"""A short run of benchmarks/bench_serve_load.py: concurrent streaming clients, disconnects, nothing leaks."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import bench_serve_load  # noqa: E402
from bench_timing_leak import serving  # noqa: E402


@pytest.mark.slow
def test_short_load_with_disconnects_leaves_no_block_owned() -> None:
    flags = ["--max-waiting", "4", "--kv-cache-memory", "64MiB", "--max-model-len", "1024"]
    with serving(flags, threads=1) as server:
        # A count of requests, not a duration: the same work however busy the machine is.
        result = bench_serve_load.run(server.url, clients=8, duration=None, disconnect=0.3, seed=2, requests=3)
    assert result["failures"] == []
    assert result["completed"] + result["disconnected"] == 8 * 3
    assert result["completed"] > 0 and result["disconnected"] > 0
    assert result["blocks_owned_after"] == 0
    assert result["invariants_after"] == "ok"
    assert result["prefix_hit_rate"] > 0  # the shared prefixes were found
