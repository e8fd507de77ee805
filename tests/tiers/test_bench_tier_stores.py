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
        ("cpu", "memmove (ctypes)"),
        ("disk", "raw files"),
        ("disk", "DiskStore"),
        ("disk", "DiskStore signed"),
        ("redis", "raw SET/MGET"),
        ("redis", "RedisStore"),
        ("redis", "RedisStore signed"),
    ]
    assert all(put > 0 and get > 0 for put, get in figures.values())
    out = capsys.readouterr().out
    assert "| disk | DiskStore signed |" in out and "| disk: DiskStore signed |" in out


def test_kind_rows_sign_with_every_other_kind(tmp_path, capsys):
    from kvpool.tiers import EntryCodec
    from kvpool.tiers.entry import Signature

    args = ["--block-bytes", "65536", "--batch", "2", "--repeats", "1", "--no-redis", "--no-cpu", "--kind-rows"]
    figures = bench_tier_stores.main([*args, "--disk-dir", str(tmp_path)])
    probe = EntryCodec(bench_tier_stores.layout(1), bench_tier_stores.SECRET)
    others = [
        f"DiskStore signed {name}"
        for kind, name in bench_tier_stores.KIND_NAMES.items()
        if kind is not Signature.best_available() and probe.can_verify(kind)
    ]
    assert others and [variant for _tier, variant in figures][3:] == others
    out = capsys.readouterr().out
    assert all(f"| disk: {variant} |" in out for variant in others)
