"""The disk tier in a directory it cannot trust: FIFOs, links, sparse and oversized files, foreign names.

Whatever sits at an entry's path, a read never blocks, never takes more than the longest entry the
layout allows, never returns another block, and the store's index and byte count stay right.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from unittest import mock

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvpool.tiers import DiskStore, EntryCodec
from tests.tiers.conftest import LAYOUT, block_key

CODEC = EntryCodec(LAYOUT)
CAP = CODEC.max_entry_bytes(len(block_key(0)))
ENTRY = len(CODEC.encode(block_key(0), bytes(2048)))


def payload(i: int) -> bytes:
    return bytes([i % 251]) * 2048


def entry_path(store: DiskStore, i: int) -> Path:
    name = block_key(i).hex()
    return store.root / name[:2] / f"{name}.kv"


class Reads:
    """Bytes ``os.read`` returned while counting (the store reads entries with os.read)."""

    def __init__(self) -> None:
        self.total = 0


@contextmanager
def counting_reads() -> Iterator[Reads]:
    reads = Reads()
    real = os.read

    def read(fd: int, n: int) -> bytes:
        data = real(fd, n)
        reads.total += len(data)
        return data

    with mock.patch("os.read", read):
        yield reads


def get_in_thread(store: DiskStore, keys: list[bytes]) -> list[bytes | None]:
    """``store.get_many(keys)`` on another thread: a read that blocks fails the test instead of hanging it."""
    result: list[list[bytes | None]] = []
    worker = threading.Thread(target=lambda: result.append(store.get_many(keys)), daemon=True)
    worker.start()
    worker.join(timeout=60)
    assert not worker.is_alive(), "the read blocked"
    return result[0]


def test_the_read_counter_sees_entry_reads(tmp_path):
    store = DiskStore(tmp_path, 100 * ENTRY, CODEC)
    store.put_many([(block_key(0), payload(0))])
    with counting_reads() as reads:
        assert store.get_many([block_key(0)]) == [payload(0)]
    assert reads.total == ENTRY  # the counter the bounded-read checks rely on is not blind


def test_a_fifo_at_an_entry_path_never_blocks(tmp_path):
    store = DiskStore(tmp_path, 100 * ENTRY, CODEC)
    store.put_many([(block_key(0), payload(0))])
    path = entry_path(store, 0)
    path.unlink()
    os.mkfifo(path)
    assert get_in_thread(store, [block_key(0)]) == [None]
    assert store.stats.corrupt_by_kind == {"not a file": 1}
    assert not path.exists() and store.used_bytes == 0
    store.check_invariants()
    assert store.put_many([(block_key(0), payload(0))]) == 1 and store.get_many([block_key(0)]) == [payload(0)]


def test_links_are_never_followed(tmp_path):
    store = DiskStore(tmp_path, 100 * ENTRY, CODEC)
    store.put_many([(block_key(i), payload(i)) for i in range(3)])
    entry_path(store, 0).unlink()
    entry_path(store, 0).symlink_to("/dev/zero")
    entry_path(store, 1).unlink()
    entry_path(store, 1).symlink_to(entry_path(store, 2))  # another block's valid entry
    with counting_reads() as reads:
        got = get_in_thread(store, [block_key(0), block_key(1), block_key(2)])
    assert got == [None, None, payload(2)]
    assert reads.total == ENTRY  # block 2's entry, nothing through the links
    assert store.stats.corrupt_by_kind == {"not a file": 2}
    assert not entry_path(store, 0).is_symlink() and not entry_path(store, 1).is_symlink()
    store.check_invariants()


def test_sparse_and_oversized_files_are_refused_unread(tmp_path):
    store = DiskStore(tmp_path, 100 * ENTRY, CODEC)
    store.put_many([(block_key(i), payload(i)) for i in range(2)])
    with open(entry_path(store, 0), "r+b") as f:
        f.truncate(1 << 40)  # a terabyte of holes
    entry_path(store, 1).write_bytes(CODEC.encode(block_key(1), payload(1)) + bytes(CAP))
    reopened = DiskStore(tmp_path, 100 * ENTRY, CODEC)
    assert reopened.used_bytes == 0  # neither is indexed: no entry is that long
    with counting_reads() as reads:
        assert reopened.get_many([block_key(0), block_key(1)]) == [None, None]
    assert reads.total == 0
    assert reopened.stats.corrupt_by_kind == {"oversized": 2}
    assert not entry_path(store, 0).exists() and not entry_path(store, 1).exists()
    reopened.check_invariants()


def test_a_directory_at_an_entry_path_costs_that_entry_only(tmp_path):
    store = DiskStore(tmp_path, 100 * ENTRY, CODEC)
    store.put_many([(block_key(0), payload(0))])
    entry_path(store, 0).unlink()
    entry_path(store, 0).mkdir()
    (entry_path(store, 0) / "inside").write_text("x")
    assert store.get_many([block_key(0)]) == [None]
    assert store.stats.corrupt_by_kind == {"not a file": 1} and store.used_bytes == 0
    assert store.put_many([(block_key(i), payload(i)) for i in range(3)]) == 2  # 0 cannot be written; saves go on
    assert store.stats.errors == 1
    assert store.get_many([block_key(1), block_key(2)]) == [payload(1), payload(2)]
    store.check_invariants()


def test_a_linked_shard_is_replaced_never_followed(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    store = DiskStore(tmp_path / "tier", 100 * ENTRY, CODEC)
    shard = entry_path(store, 0).parent
    shard.symlink_to(elsewhere, target_is_directory=True)
    shutil.copy(Path(__file__), elsewhere / "bait")
    assert store.get_many([block_key(0)]) == [None] and store.contains_prefix([block_key(0)]) == 0
    assert store.put_many([(block_key(0), payload(0))]) == 1
    assert not shard.is_symlink() and os.listdir(elsewhere) == ["bait"]  # nothing written through the link
    assert store.get_many([block_key(0)]) == [payload(0)]
    store.check_invariants()


def test_foreign_names_are_neither_counted_nor_touched(tmp_path):
    store = DiskStore(tmp_path, 100 * ENTRY, CODEC)
    k = 0xABCDEF  # hex digits with letters, so that another spelling is another name
    store.put_many([(block_key(k), payload(k))])
    good = entry_path(store, k)
    name = block_key(k).hex()
    foreign = [
        good.parent / f"{name.upper()}.kv",  # another spelling of the same key
        store.root / "ff" / f"{name}.kv",  # in the wrong shard
        good.parent / f"{name}0.kv",  # an odd number of hex digits
        good.parent / f"{name[:-2]}.kv.bak",
        store.root / "zz" / "anything.kv",
    ]
    for path in foreign:
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(good.read_bytes())
    (good.parent / f"{block_key(5).hex()}.kv").symlink_to(good)  # a link under an entry's own name
    reopened = DiskStore(tmp_path, 100 * ENTRY, CODEC)
    assert reopened.keys_by_recency() == [block_key(k)] and reopened.used_bytes == ENTRY
    reopened.check_invariants()
    small = DiskStore(tmp_path, ENTRY, CODEC)  # evicting what it knows removes its own files only
    small.put_many([(block_key(1), payload(1))])
    assert all(p.exists() for p in foreign) and not good.exists()
    assert small.keys_by_recency() == [block_key(1)] and small.used_bytes == ENTRY
    small.check_invariants()


# -- random directory contents ---------------------------------------------------------------

KEYS = st.integers(0, 7)
JUNK = st.sampled_from(
    ["fifo", "dev-zero", "link-to-entry", "sparse", "truncated", "oversized", "random", "directory", "foreign-entry"]
)
OTHER = EntryCodec(dataclasses.replace(LAYOUT, weights="sha256:" + "77" * 32))  # same shapes, other weights


class HostileDirectory(RuleBasedStateMachine):
    """Puts, gets and restarts while junk appears at entry paths; the store's answers are always right."""

    def __init__(self) -> None:
        super().__init__()
        self.directory = Path(tempfile.mkdtemp(prefix="kvpool-hostile-"))
        self.capacity = 6 * ENTRY
        self.store = DiskStore(self.directory, self.capacity, CODEC)
        self.planted = False  # junk the store has not looked at since the last restart

    def teardown(self) -> None:
        self.store.close()
        shutil.rmtree(self.directory, ignore_errors=True)

    def _path(self, i: int) -> Path:
        return entry_path(self.store, i)

    @rule(ids=st.lists(KEYS, max_size=4))
    def put(self, ids: list[int]) -> None:
        self.store.put_many([(block_key(i), payload(i)) for i in ids])

    @rule(ids=st.lists(KEYS, min_size=1, max_size=4))
    def get(self, ids: list[int]) -> None:
        with counting_reads() as reads:
            got = get_in_thread(self.store, [block_key(i) for i in ids])
        assert reads.total <= CAP * len(ids)
        for i, g in zip(ids, got):
            assert g is None or g == payload(i)  # never another block, never junk
            if g is None:
                assert block_key(i) not in self.store.keys_by_recency()

    @rule(ids=st.lists(KEYS, max_size=4))
    def prefix(self, ids: list[int]) -> None:
        assert 0 <= self.store.contains_prefix([block_key(i) for i in ids]) <= len(ids)

    @rule(i=KEYS, junk=JUNK, other=KEYS)
    def plant(self, i: int, junk: str, other: int) -> None:
        path = self._path(i)
        path.parent.mkdir(exist_ok=True)
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.exists() or path.is_symlink():
            path.unlink()
        if junk == "fifo":
            os.mkfifo(path)
        elif junk == "dev-zero":
            path.symlink_to("/dev/zero")
        elif junk == "link-to-entry":
            path.symlink_to(self._path(other))
        elif junk == "sparse":
            with open(path, "wb") as f:
                f.truncate(1 << 36)
        elif junk == "truncated":
            path.write_bytes(CODEC.encode(block_key(i), payload(i))[:-100])
        elif junk == "oversized":
            path.write_bytes(CODEC.encode(block_key(i), payload(i)) + bytes(CAP))
        elif junk == "random":
            path.write_bytes(os.urandom(ENTRY))
        elif junk == "directory":
            path.mkdir()
        else:  # a valid entry of other weights, or another block's entry copied under this name
            codec, key = (OTHER, i) if other % 2 else (CODEC, other)
            path.write_bytes(codec.encode(block_key(key), payload(key)))
        self.planted = True

    @rule()
    def restart(self) -> None:
        self.store.close()
        self.store = DiskStore(self.directory, self.capacity, CODEC)
        self.planted = False

    @invariant()
    def consistent(self) -> None:
        self.store.check_invariants(exclusive=not self.planted)


HostileDirectory.TestCase.settings = settings(max_examples=40, stateful_step_count=25, deadline=None)
TestHostileDirectory = pytest.mark.slow(HostileDirectory.TestCase)
