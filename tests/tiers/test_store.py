"""The BlockStore contract, run against every store, and the specs open_store takes."""

from __future__ import annotations

import dataclasses
import uuid

import pytest

from kvpool.checks import parse_size as checks_parse_size
from kvpool.errors import ConfigError, KVPoolError
from kvpool.tiers import (
    BlockStore,
    CpuTarget,
    DiskStore,
    DiskTarget,
    EntryCodec,
    RedisStore,
    RedisTarget,
    TierKind,
    open_store,
    parse_size,
    parse_spec,
)
from tests.tiers.conftest import LAYOUT, block_key


@pytest.fixture(params=["disk", "redis"])
def store(request, tmp_path) -> BlockStore:
    codec = EntryCodec(dataclasses.replace(LAYOUT, hash_seed=uuid.uuid4().hex), b"a secret of sixteen bytes")
    if request.param == "disk":
        return open_store(f"disk:{tmp_path / 'kv'}:1MiB", codec)
    return open_store(request.getfixturevalue("redis_url"), codec)


def test_contract(store):
    keys = [block_key(i) for i in range(5)]
    assert store.contains_prefix([]) == 0 and store.get_many([]) == [] and store.put_many([]) == 0
    assert store.get_many(keys[:2]) == [None, None]
    assert store.put_many([(k, bytes([i]) * 1000) for i, k in enumerate(keys[:3])]) == 3
    assert store.put_many([(keys[3], memoryview(b"view"))]) == 1
    assert store.contains_prefix(keys) == 4
    assert store.contains_prefix(keys[4:] + keys[:4]) == 0
    assert store.get_many(keys) == [b"\0" * 1000, b"\1" * 1000, b"\2" * 1000, b"view", None]
    snapshot = store.stats
    assert (snapshot.hits, snapshot.misses, snapshot.corrupt, snapshot.errors) == (4, 3, 0, 0)
    store.get_many(keys[:1])
    assert snapshot.hits == 4 and store.stats.hits == 5  # stats is a snapshot
    assert store.name in {"disk", "redis"}
    store.close()


def test_open_store_kinds(tmp_path, codec):
    disk = open_store(f"disk:{tmp_path}/with:colon:500MB", codec)
    assert isinstance(disk, DiskStore) and disk.capacity_bytes == 500 * 10**6
    assert disk.root.parent == tmp_path / "with:colon"
    for url in ["redis://h:1/0", "rediss://h:1/0", "unix:///tmp/r.sock", "redis+cluster://h:1", "rediss+cluster://h:1"]:
        assert isinstance(open_store(url, codec), RedisStore)
    assert open_store("redis://h:1/0?ttl=30", codec).ttl_s == 30  # type: ignore[attr-defined]  # a RedisStore


def test_parse_spec_checks_without_opening(tmp_path):
    target = parse_spec(f"disk:{tmp_path}/never/made:2GiB")
    assert target == DiskTarget(f"{tmp_path}/never/made", 2 * 2**30) and target.kind is TierKind.DISK
    assert not (tmp_path / "never").exists()
    redis_target = parse_spec("rediss+cluster://:pw@h:7000?ttl=5&ssl_ca_certs=/ca.pem")
    assert redis_target == RedisTarget("rediss://:pw@h:7000?ssl_ca_certs=%2Fca.pem", True, 5, "rediss+cluster://h:7000")
    assert redis_target.kind is TierKind.REDIS
    assert parse_spec("cpu:4GiB") == CpuTarget(4 * 2**30) and CpuTarget.kind is TierKind.CPU


def test_open_store_leaves_host_memory_to_the_engine(codec):
    with pytest.raises(ConfigError, match="'cpu:4GiB' is host memory"):
        open_store("cpu:4GiB", codec)


@pytest.mark.parametrize(
    "spec",
    [
        "disk:/tmp/kv",
        "disk::1GiB",
        "disk:/tmp/kv:lots",
        "disk:/tmp/kv:0",
        "disk:/tmp/kv:-5GiB",
        "disk:/tmp/kv:4G",
        "http://127.0.0.1:6379",
        "redis:/127.0.0.1",
        "",
    ],
)
def test_bad_specs_name_the_value(spec, codec):
    for check in (parse_spec, lambda spec: open_store(spec, codec)):
        with pytest.raises(ConfigError) as info:
            check(spec)
        assert repr(spec) in str(info.value)


def test_a_spec_that_is_not_a_string(codec):
    with pytest.raises(KVPoolError, match="42"):
        open_store(42, codec)  # type: ignore[arg-type]  # the wrong type on purpose


@pytest.mark.parametrize(
    ("text", "expected"),
    [("1", 1), ("4096", 4096), ("50GiB", 50 * 2**30), ("500MB", 500 * 10**6), ("74.5GiB", 79_993_765_888)],
)
def test_sizes_use_the_one_size_rule(text, expected):
    assert parse_size(text) == expected == checks_parse_size(text)


@pytest.mark.parametrize("text", ["", "GiB", "5 G", "1.2.3GB", "-1", "0", "0.1B", "5 parsecs"])
def test_bad_sizes(text):
    with pytest.raises(ConfigError, match="size"):
        parse_size(text, field="size")
