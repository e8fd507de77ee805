"""A refused Redis entry is deleted, so its block is saved and loaded again; other models' keys are left alone."""

from __future__ import annotations

import dataclasses
import uuid

import pytest

from kvpool.tiers import EntryCodec, RedisStore, open_store
from tests.services import under_ci
from tests.tiers.conftest import LAYOUT, block_key

try:
    import redis
except ImportError:  # the tiers extra: CI installs it, so there a missing client fails the run
    if under_ci():
        raise
    pytest.skip("the redis client is not installed (pip install -e '.[tiers]')", allow_module_level=True)


def fresh_codec(secret: bytes | None = None, **change: str) -> EntryCodec:
    return EntryCodec(dataclasses.replace(LAYOUT, hash_seed=uuid.uuid4().hex, **change), secret)


def payload(i: int) -> bytes:
    return bytes([i]) * 1024


def test_a_refused_entry_is_deleted_and_the_block_stored_again(redis_url):
    codec = fresh_codec(b"the replicas' secret")
    store = open_store(redis_url, codec)
    assert isinstance(store, RedisStore)
    client = redis.Redis.from_url(redis_url)
    name = store.redis_key(block_key(0))
    planted = {
        "truncated": codec.encode(block_key(0), payload(0))[:-7],
        "bad signature": EntryCodec(codec.fingerprint, b"a guess at the secret").encode(block_key(0), payload(9)),
        "unsigned": EntryCodec(codec.fingerprint).encode(block_key(0), payload(9)),
        "foreign layout": fresh_codec(b"the replicas' secret").encode(block_key(0), payload(9)),
        "oversized": b"KVPE" + bytes(codec.max_entry_bytes(len(block_key(0)))),
    }
    for round_, (kind, value) in enumerate(planted.items(), start=1):
        client.set(name, value)
        assert store.contains_prefix([block_key(0)]) == (0 if kind == "oversized" else 1)
        assert store.get_many([block_key(0)]) == [None]
        assert not client.exists(name), kind  # deleted: nothing blocks the key any more
        assert store.stats.corrupt_by_kind[kind] == 1 and store.stats.removed == round_
        assert store.contains_prefix([block_key(0)]) == 0
        assert store.put_many([(block_key(0), payload(0))]) == 1
        assert store.get_many([block_key(0)]) == [payload(0)]
        client.delete(name)


def test_an_empty_value_is_not_offered(redis_url):
    store = open_store(redis_url, fresh_codec())
    assert isinstance(store, RedisStore)
    redis.Redis.from_url(redis_url).set(store.redis_key(block_key(1)), b"")
    assert store.contains_prefix([block_key(1)]) == 0  # so the block is computed and saved over it
    assert store.put_many([(block_key(1), payload(1))]) == 1
    assert store.get_many([block_key(1)]) == [payload(1)]


def test_another_models_keys_are_not_ours_to_delete(redis_url):
    shapes = dataclasses.replace(LAYOUT, hash_seed=uuid.uuid4().hex)
    ours = open_store(redis_url, EntryCodec(dataclasses.replace(shapes, weights="sha256:" + "01" * 32)))
    theirs = open_store(redis_url, EntryCodec(dataclasses.replace(shapes, weights="sha256:" + "02" * 32)))
    assert isinstance(ours, RedisStore) and isinstance(theirs, RedisStore)
    assert ours.prefix != theirs.prefix  # same shapes, other weights: another key namespace
    assert theirs.put_many([(block_key(i), payload(i)) for i in range(3)]) == 3
    assert ours.get_many([block_key(i) for i in range(3)]) == [None] * 3
    assert ours.stats.corrupt == 0 and ours.stats.removed == 0
    assert theirs.get_many([block_key(i) for i in range(3)]) == [payload(i) for i in range(3)]
