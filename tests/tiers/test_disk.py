"""The disk tier: bounded LRU, restart-safe, shared by processes, and a full disk that stops saves only."""

from __future__ import annotations

import errno
import logging
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from kvpool.tiers import DiskStore, EntryCodec
from kvpool.tiers.entry import CorruptKind
from tests.tiers.conftest import LAYOUT, block_key

ROOT = Path(__file__).resolve().parents[2]
BLOCK = 4096
ENTRY = len(EntryCodec(LAYOUT).encode(block_key(0), bytes(BLOCK)))


def payload(i: int) -> bytes:
    return bytes([i % 251]) * BLOCK


def items(ids) -> list[tuple[bytes, bytes]]:
    return [(block_key(i), payload(i)) for i in ids]


def in_another_process(code: str) -> str:
    """Run ``code`` in a fresh interpreter (with LAYOUT, block_key, payload and DiskStore imported); its stdout."""
    prelude = (
        "from kvpool.tiers import DiskStore, EntryCodec\n"
        "from tests.tiers.conftest import LAYOUT, block_key\n"
        "from tests.tiers.test_disk import payload\n"
    )
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}"}
    done = subprocess.run(
        [sys.executable, "-c", prelude + code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_round_trip_and_prefix(tmp_path, codec):
    store = DiskStore(tmp_path, 100 * ENTRY, codec)
    assert store.put_many(items([0, 1, 2])) == 3
    assert store.contains_prefix([block_key(0), block_key(1), block_key(2), block_key(3)]) == 3
    assert store.contains_prefix([block_key(3), block_key(0)]) == 0
    assert store.get_many([block_key(1), block_key(5), block_key(0)]) == [payload(1), None, payload(0)]
    stats = store.stats
    assert (stats.hits, stats.misses, stats.corrupt, stats.errors) == (2, 1, 0, 0)
    assert stats.bytes_written == 3 * ENTRY and stats.bytes_read == 2 * ENTRY
    assert store.put_many(items([0])) == 1  # already stored: counts, not rewritten
    assert store.stats.bytes_written == 3 * ENTRY


def test_lru_stays_under_its_size(tmp_path, codec):
    store = DiskStore(tmp_path, 3 * ENTRY + ENTRY // 2, codec)
    store.put_many(items([0, 1, 2]))
    store.get_many([block_key(0)])  # 1 is now least recently used
    store.put_many(items([3]))
    assert store.contains_prefix([block_key(1)]) == 0
    assert store.get_many([block_key(i) for i in (0, 2, 3)]) == [payload(i) for i in (0, 2, 3)]
    for i in range(4, 40):
        store.put_many(items([i]))
        assert store.used_bytes <= store.capacity_bytes
        on_disk = sum(p.stat().st_size for p in store.root.rglob("*.kv"))
        assert on_disk == store.used_bytes
    assert store.stats.evictions == 37
    assert len(list(store.root.rglob("*.kv"))) == 3


def test_a_second_process_gets_hits_after_a_restart(tmp_path, codec):
    store = DiskStore(tmp_path, 100 * ENTRY, codec)
    store.put_many(items(range(5)))
    store.close()
    out = in_another_process(
        f"s = DiskStore({str(tmp_path)!r}, {100 * ENTRY}, EntryCodec(LAYOUT))\n"
        "got = s.get_many([block_key(i) for i in range(6)])\n"
        "print(sum(g == payload(i) for i, g in enumerate(got)), s.stats.hits, s.stats.misses)\n"
        "s.put_many([(block_key(9), payload(9))])\n"
    )
    assert out.split() == ["5", "5", "1"]
    later = DiskStore(tmp_path, 100 * ENTRY, codec)  # and this process sees what the other one wrote
    assert later.get_many([block_key(9)]) == [payload(9)]
    assert later.used_bytes == 6 * ENTRY


def test_recency_survives_a_restart(tmp_path, codec):
    store = DiskStore(tmp_path, 3 * ENTRY, codec)
    store.put_many(items([0, 1, 2]))
    os.utime(store.root / block_key(0).hex()[:2] / f"{block_key(0).hex()}.kv", (1, 1))  # 0 oldest...
    os.utime(store.root / block_key(1).hex()[:2] / f"{block_key(1).hex()}.kv", (2, 2))  # ...then 1...
    os.utime(store.root / block_key(2).hex()[:2] / f"{block_key(2).hex()}.kv", (3, 3))
    store.close()
    reopened = DiskStore(tmp_path, 3 * ENTRY, codec)
    reopened.get_many([block_key(0)])  # ...but a hit after the restart makes 0 the most recent
    reopened.put_many(items([3]))
    assert [reopened.contains_prefix([block_key(i)]) for i in range(4)] == [1, 0, 1, 1]
    smaller = DiskStore(tmp_path, 2 * ENTRY, codec)  # a smaller bound on restart evicts the oldest at once
    assert smaller.used_bytes == 2 * ENTRY and smaller.stats.evictions == 1


def test_layouts_sharing_a_directory_stay_apart(tmp_path, codec):
    import dataclasses

    other = EntryCodec(dataclasses.replace(LAYOUT, dtype="float16"))
    DiskStore(tmp_path, 100 * ENTRY, other).put_many([(block_key(0), b"other model")])
    store = DiskStore(tmp_path, 100 * ENTRY, codec)
    assert store.get_many([block_key(0)]) == [None] and store.stats.corrupt == 0
    store.put_many(items([0]))
    assert DiskStore(tmp_path, 100 * ENTRY, other).get_many([block_key(0)]) == [b"other model"]


def entry_path(store: DiskStore, i: int) -> Path:
    return store.root / block_key(i).hex()[:2] / f"{block_key(i).hex()}.kv"


@pytest.mark.parametrize("damage", ["truncated", "bit flip", "foreign layout", "foreign key", "unsigned", "garbage"])
def test_damaged_files_are_counted_misses_and_removed(tmp_path, signed_codec, codec, damage, caplog):
    import dataclasses

    store = DiskStore(tmp_path, 100 * ENTRY, signed_codec)
    store.put_many(items([0, 1]))
    path = entry_path(store, 0)
    data = path.read_bytes()
    if damage == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif damage == "bit flip":
        path.write_bytes(data[:-10] + bytes([data[-10] ^ 0x20]) + data[-9:])
    elif damage == "foreign layout":
        foreign = EntryCodec(dataclasses.replace(LAYOUT, num_layers=2), b"a shared tier secret")
        path.write_bytes(foreign.encode(block_key(0), payload(0)))
    elif damage == "foreign key":
        path.write_bytes(entry_path(store, 1).read_bytes())
    elif damage == "unsigned":
        path.write_bytes(codec.encode(block_key(0), payload(0)))
    else:
        path.write_bytes(os.urandom(len(data)))
    with caplog.at_level(logging.WARNING, logger="kvpool.tiers"):
        assert store.get_many([block_key(0), block_key(1)]) == [None, payload(1)]
        assert store.get_many([block_key(0)]) == [None]
    stats = store.stats
    assert stats.corrupt == 1 and stats.misses == 2 and stats.hits == 1
    kind = {"bit flip": "checksum", "garbage": "malformed"}.get(damage, damage)
    assert stats.corrupt_by_kind == {CorruptKind(kind).value: 1}
    assert not path.exists() and store.contains_prefix([block_key(0)]) == 0
    assert len([r for r in caplog.records if "refused" in r.getMessage()]) == 1


def test_each_kind_of_corruption_warns_once(tmp_path, codec, caplog):
    store = DiskStore(tmp_path, 100 * ENTRY, codec)
    with caplog.at_level(logging.WARNING, logger="kvpool.tiers"):
        for _ in range(3):
            store.put_many(items([0, 1]))
            entry_path(store, 0).write_bytes(b"short")
            entry_path(store, 1).write_bytes(entry_path(store, 1).read_bytes()[:-1] + b"\0")
            assert store.get_many([block_key(0), block_key(1)]) == [None, None]
    assert store.stats.corrupt == 6
    assert store.stats.corrupt_by_kind == {"truncated": 3, "checksum": 3}
    assert len(caplog.records) == 2


def test_a_file_another_process_removed_is_a_miss(tmp_path, codec):
    mine = DiskStore(tmp_path, 100 * ENTRY, codec)
    theirs = DiskStore(tmp_path, 100 * ENTRY, codec)
    mine.put_many(items([0, 1]))
    assert theirs.contains_prefix([block_key(0), block_key(1)]) == 2  # found by name and adopted
    assert theirs.get_many([block_key(1)]) == [payload(1)]
    entry_path(mine, 0).unlink()
    assert mine.get_many([block_key(0), block_key(1)]) == [None, payload(1)]
    assert mine.stats.corrupt == 0 and mine.contains_prefix([block_key(0)]) == 0


@pytest.mark.slow
def test_concurrent_writers_never_corrupt_each_other(tmp_path, codec):
    """Two processes and two threads write the same keys into one directory; every read is whole and right."""
    capacity = 24 * ENTRY  # small enough that the writers evict each other's files all the time
    writer = (
        f"s = DiskStore({str(tmp_path)!r}, {capacity}, EntryCodec(LAYOUT))\n"
        "for r in range(15):\n"
        "    s.put_many([(block_key(i), payload(i)) for i in range(40)])\n"
        "    got = s.get_many([block_key(i) for i in range(40)])\n"
        "    assert all(g is None or g == payload(i) for i, g in enumerate(got))\n"
        "print(s.stats.corrupt, s.stats.errors)\n"
    )
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}"}
    prelude = (
        "from kvpool.tiers import DiskStore, EntryCodec\n"
        "from tests.tiers.conftest import LAYOUT, block_key\n"
        "from tests.tiers.test_disk import payload\n"
    )
    procs = [
        subprocess.Popen([sys.executable, "-c", prelude + writer], cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    store = DiskStore(tmp_path, capacity, codec)
    wrong: list[int] = []

    def work() -> None:
        for _ in range(15):
            store.put_many(items(range(40)))
            got = store.get_many([block_key(i) for i in range(40)])
            wrong.extend(i for i, g in enumerate(got) if g is not None and g != payload(i))

    threads = [threading.Thread(target=work) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    outputs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert outputs == ["0 0\n", "0 0\n"]
    assert wrong == [] and store.stats.corrupt == 0 and store.stats.errors == 0
    assert not list(tmp_path.rglob("*.tmp"))


def test_an_entry_bigger_than_the_tier_is_not_stored(tmp_path, codec):
    store = DiskStore(tmp_path, ENTRY - 1, codec)
    assert store.put_many(items([0])) == 0
    assert store.get_many([block_key(0)]) == [None]
    assert store.used_bytes == 0 and store.stats.errors == 0


def test_a_full_disk_stops_saves_not_loads(tmp_path, codec, monkeypatch, caplog):
    now = [0.0]
    store = DiskStore(tmp_path, 100 * ENTRY, codec, retry_after_s=5.0, clock=lambda: now[0])
    store.put_many(items([0, 1]))
    real_replace = os.replace
    calls = []

    def full(src, dst, **dir_fds):
        calls.append(dst)
        if len(calls) > 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        real_replace(src, dst, **dir_fds)

    monkeypatch.setattr(os, "replace", full)
    with caplog.at_level(logging.WARNING, logger="kvpool.tiers"):
        assert store.put_many(items([0, 2, 3, 4])) == 2  # 0 was there, 2 fits, 3 hits the full disk, 4 is skipped
        assert store.put_many(items([5])) == 0  # saves are paused: not even tried
        assert len(calls) == 2
        assert store.get_many([block_key(i) for i in range(4)]) == [payload(0), payload(1), payload(2), None]
        now[0] = 6.0
        assert store.put_many(items([6])) == 0  # tried again after the pause; still full
    assert len(calls) == 3
    assert store.stats.errors == 2
    assert len([r for r in caplog.records if "No space left" in r.getMessage()]) == 1  # warned once
    assert not list(tmp_path.rglob("*.tmp"))  # the failed writes left nothing behind
    monkeypatch.setattr(os, "replace", real_replace)
    now[0] = 20.0
    caplog.set_level(logging.WARNING, logger="kvpool.tiers")
    assert store.put_many(items([7])) == 1 and store.get_many([block_key(7)]) == [payload(7)]
    assert any("work again" in r.getMessage() for r in caplog.records)
    assert store.used_bytes == 4 * ENTRY


def test_an_unreadable_file_is_a_counted_miss(tmp_path, codec, monkeypatch):
    store = DiskStore(tmp_path, 100 * ENTRY, codec)
    store.put_many(items([0]))
    real_open = os.open

    def failing_open(path, *args, **kwargs):
        if str(path).endswith(".kv"):
            raise OSError(errno.EIO, "Input/output error")
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", failing_open)
    assert store.get_many([block_key(0)]) == [None]
    assert store.stats.errors == 1 and store.stats.misses == 1


def test_stale_temp_files_are_cleaned_and_unknown_files_ignored(tmp_path, codec):
    store = DiskStore(tmp_path, 100 * ENTRY, codec)
    store.put_many(items([0]))
    stale = store.root / "ab" / ".abcd.123.tmp"
    stale.parent.mkdir(exist_ok=True)
    stale.write_bytes(b"half an entry")
    os.utime(stale, (1, 1))
    fresh = store.root / "ab" / ".abcd.456.tmp"
    fresh.write_bytes(b"being written now")
    (store.root / "ab" / "notes.txt").write_text("not ours")
    (store.root / "ab" / "zz.kv").write_text("not a hex name")
    reopened = DiskStore(tmp_path, 100 * ENTRY, codec)
    assert not stale.exists() and fresh.exists()
    assert reopened.used_bytes == ENTRY


def test_bad_arguments(tmp_path, codec):
    from kvpool.errors import ConfigError

    with pytest.raises(ConfigError, match="capacity_bytes"):
        DiskStore(tmp_path, 0, codec)
    blocker = tmp_path / "a file"
    blocker.write_text("x")
    with pytest.raises(ConfigError, match="a file"):
        DiskStore(blocker / "sub", 10, codec)
