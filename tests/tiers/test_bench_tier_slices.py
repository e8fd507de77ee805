"""The tier store benchmark's rows take turns on slices of each batch, and every block is moved once per row."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import bench_tier_stores  # noqa: E402


def _recording_rows(log: list[tuple[str, str, tuple[bytes, ...]]]) -> list[bench_tier_stores.Row]:
    def op(name: str, what: str) -> bench_tier_stores.Op:
        return lambda items: log.append((name, what, tuple(key for key, _payload in items)))

    return [(tier, variant, op(variant, "save"), op(variant, "load")) for tier, variant in bench_tiers_rows()]


def bench_tiers_rows() -> list[tuple[str, str]]:
    return [("cpu", "worker"), ("disk", "unsigned"), ("disk", "signed")]


def test_rows_take_turns_on_slices_and_move_every_block_once(monkeypatch):
    batches: list[list[tuple[bytes, bytes]]] = []
    real = bench_tier_stores.one_batch

    def one_batch(batch: int, block_bytes: int) -> list[tuple[bytes, bytes]]:
        batches.append(real(batch, block_bytes))
        return batches[-1]

    monkeypatch.setattr(bench_tier_stores, "one_batch", one_batch)
    log: list[tuple[str, str, tuple[bytes, ...]]] = []
    args = argparse.Namespace(batch=6, block_bytes=8, repeats=2, slice_blocks=4, sync=False)
    figures = bench_tier_stores.run(_recording_rows(log), args)
    assert set(figures) == set(bench_tiers_rows())
    assert all(put > 0 and get > 0 for put, get in figures.values())
    for repeat, batch in enumerate(batches):
        keys = tuple(key for key, _payload in batch)
        calls = log[repeat * 10 : (repeat + 1) * 10]  # the CPU row once, each disk row twice (4 + 2 blocks)
        for variant in ("unsigned", "signed"):
            for what in ("save", "load"):
                moved = [k for name, w, ks in calls if name == variant and w == what for k in ks]
                assert tuple(moved) == keys
        assert [ks for name, w, ks in calls if name == "worker"] == [keys, keys]
        # The disk rows take turns on each slice: both move the first 4 blocks before either moves the last 2.
        disk = [(name, len(ks)) for name, w, ks in calls if name != "worker" and w == "save"]
        assert sorted(disk[:2]) == [("signed", 4), ("unsigned", 4)]
        assert sorted(disk[2:]) == [("signed", 2), ("unsigned", 2)]
    assert len(log) == 20


def test_slice_blocks_below_one_is_refused(capsys):
    with pytest.raises(SystemExit):
        bench_tier_stores.main(["--slice-blocks", "0", "--no-redis", "--no-cpu"])
    assert "--slice-blocks must be at least 1, got 0" in capsys.readouterr().err
