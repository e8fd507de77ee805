"""The tier store benchmark runs end to end on tiny inputs."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import bench_tier_stores  # noqa: E402


def test_bench_runs_on_tiny_inputs(redis_url, tmp_path, capsys):
    rows = bench_tier_stores.main(
        ["--block-bytes", "4096", "--batch", "4", "--repeats", "2", "--redis", redis_url, "--disk-dir", str(tmp_path)]
    )
    names = [name.split(":")[0] for name, _put, _get in rows]
    assert names == ["entry codec only (encode / decode)", "disk", "disk", "redis", "redis"]
    assert all(put > 0 and get > 0 for _name, put, get in rows)
    assert "| disk: DiskStore put_many/get_many |" in capsys.readouterr().out
