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
        result = bench_serve_load.run(server.url, clients=8, duration=10, disconnect=0.3, seed=2)
    assert result["failures"] == []
    assert result["completed"] > 0 and result["disconnected"] > 0
    assert result["blocks_owned_after"] == 0
    assert result["invariants_after"] == "ok"
    assert result["prefix_hit_rate"] > 0  # the shared prefixes were found
