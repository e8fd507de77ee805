"""Copy-free reads: ``get_many_into`` places verified payloads in the caller's buffers, and nothing else."""

from __future__ import annotations

import os
from unittest import mock

import pytest

from kvpool.tiers import DiskStore, EntryCodec
from tests.tiers.conftest import LAYOUT, block_key
from tests.tiers.test_redis import fresh_codec

SIZE = 2048
CODEC = EntryCodec(LAYOUT, b"a shared tier secret")


def payload(i: int) -> bytes:
    return bytes([i % 251]) * SIZE


def buffers(n: int, size: int = SIZE) -> tuple[bytearray, list[memoryview]]:
    raw = bytearray(n * size)
    view = memoryview(raw)
    return raw, [view[i * size : (i + 1) * size] for i in range(n)]


def entry_path(store: DiskStore, i: int):
    name = block_key(i).hex()
    return store.root / name[:2] / f"{name}.kv"


def test_disk_reads_into_the_buffers(tmp_path):
    store = DiskStore(tmp_path, 1 << 20, CODEC)
    assert store.put_many([(block_key(i), memoryview(payload(i))) for i in range(3)]) == 3
    raw, out = buffers(4)
    assert store.get_many_into([block_key(i) for i in range(4)], out) == [True, True, True, False]
    assert raw[: 3 * SIZE] == payload(0) + payload(1) + payload(2)
    stats = store.stats
    assert stats.hits == 3 and stats.misses == 1 and stats.bytes_read == stats.bytes_written
    assert store.get_many([block_key(1)]) == [payload(1)]  # both read paths see the same entries
    store.check_invariants()


def test_disk_refuses_damage_and_a_payload_that_does_not_fill_the_buffer(tmp_path):
    store = DiskStore(tmp_path, 1 << 20, CODEC)
    store.put_many([(block_key(i), payload(i)) for i in range(2)] + [(block_key(2), b"short")])
    damaged = bytearray(entry_path(store, 0).read_bytes())
    damaged[-1] ^= 1
    entry_path(store, 0).write_bytes(bytes(damaged))
    _raw, out = buffers(3)
    assert store.get_many_into([block_key(i) for i in range(3)], out) == [False, True, False]
    assert store.stats.corrupt_by_kind == {"checksum": 1, "malformed": 1}
    assert not entry_path(store, 0).exists() and not entry_path(store, 2).exists()  # removed, to be saved again
    store.check_invariants()


def test_disk_reads_through_no_link_and_past_no_bound(tmp_path):
    store = DiskStore(tmp_path, 1 << 20, CODEC)
    store.put_many([(block_key(i), payload(i)) for i in range(3)])
    entry_path(store, 0).unlink()
    entry_path(store, 0).symlink_to("/dev/zero")
    with open(entry_path(store, 1), "r+b") as f:
        f.truncate(1 << 40)  # a terabyte of holes
    read = 0
    real_pread, real_preadv = os.pread, os.preadv

    def pread(fd, n, offset):
        nonlocal read
        data = real_pread(fd, n, offset)
        read += len(data)
        return data

    def preadv(fd, buffers, offset):
        nonlocal read
        n = real_preadv(fd, buffers, offset)
        read += n
        return n

    _raw, out = buffers(3)
    with mock.patch("os.pread", pread), mock.patch("os.preadv", preadv):
        assert store.get_many_into([block_key(i) for i in range(3)], out) == [False, False, True]
    assert read == len(CODEC.encode(block_key(2), payload(2)))  # block 2's entry, nothing through the others
    assert store.stats.corrupt_by_kind == {"not a file": 1, "oversized": 1}


def test_redis_reads_into_the_buffers_and_deletes_what_it_refuses(redis_url):
    import redis

    from kvpool.tiers import RedisStore

    codec = fresh_codec(b"a shared tier secret")
    store = RedisStore(redis_url, codec)
    assert store.put_many([(block_key(i), memoryview(payload(i))) for i in range(40)]) == 40  # several pipelines
    client = redis.Redis.from_url(redis_url)
    client.setrange(store.redis_key(block_key(5)), 200, b"\xff")  # damaged in place
    raw, out = buffers(41)
    got = store.get_many_into([block_key(i) for i in range(41)], out)
    assert got == [i != 5 for i in range(40)] + [False]
    assert all(raw[i * SIZE : (i + 1) * SIZE] == payload(i) for i in range(40) if i != 5)
    assert store.stats.corrupt_by_kind == {"checksum": 1} and not client.exists(store.redis_key(block_key(5)))
    with pytest.raises(ValueError, match="one buffer per key, got 1 for 2 keys"):
        store.get_many_into([block_key(0), block_key(1)], out[:1])
