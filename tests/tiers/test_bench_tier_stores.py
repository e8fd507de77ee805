"""The tier store benchmark runs end to end on tiny inputs."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import bench_tier_stores  # noqa: E402


def test_bench_runs_on_tiny_inputs(redis_url, tmp_path, capsys):
    figures = bench_tier_stores.main(
        ["--block-bytes", "65536", "--batch", "4", "--repeats", "2", "--redis", redis_url, "--disk-dir", str(tmp_path)]
    )
    assert list(figures) == [
        ("cpu", "KVTransferWorker"),
        ("cpu", "raw memcpy"),
        ("disk", "raw files"),
        ("disk", "DiskStore"),
        ("disk", "DiskStore signed"),
        ("redis", "raw SET/MGET"),
        ("redis", "RedisStore"),
        ("redis", "RedisStore signed"),
    ]
    assert all(put > 0 and get > 0 for put, get in figures.values())
    assert "| disk | DiskStore signed |" in capsys.readouterr().out
