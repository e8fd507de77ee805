"""Every key kvpool writes to Redis is printable ASCII, so redis-cli, Redis Insight and scripts show it as is."""

from __future__ import annotations

import pytest

from kvpool.router.index import Group, RedisIndex
from kvpool.tiers import RedisStore
from tests.services import RedisServer, under_ci
from tests.tiers.conftest import block_key

try:
    import redis
except ImportError:  # the tiers extra: CI installs it, so there a missing client fails the run
    if under_ci():
        raise
    pytest.skip("the redis client is not installed (pip install -e '.[tiers]')", allow_module_level=True)


def printable(name: bytes) -> bool:
    return name.isascii() and name.decode().isprintable()


# Hashes whose bytes are anything but text: zeros, newlines, bytes past ASCII.
AWKWARD = [b"\x00" * 32, b"\n\r\t " * 8, bytes(range(224, 256)), block_key(7)]


def test_the_tier_stores_blocks_under_printable_keys(redis_server: RedisServer, codec) -> None:
    store = RedisStore(redis_server.url, codec)
    assert store.put_many([(key, b"KV" * 512) for key in AWKWARD]) == len(AWKWARD)
    client = redis.Redis.from_url(redis_server.url)
    names = sorted(client.scan_iter())  # the test's own server: nothing else writes here
    assert len(names) == len(AWKWARD)
    assert [name for name in names if not printable(name)] == []
    assert names == sorted(f"kvpool:{codec.namespace}:{key.hex()}".encode() for key in AWKWARD)
    assert store.get_many(AWKWARD) == [b"KV" * 512] * len(AWKWARD)  # and read back under them
    store.close()


def test_the_router_index_keeps_printable_keys_and_members(redis_server: RedisServer) -> None:
    client = redis.Redis.from_url(redis_server.url)
    index = RedisIndex(client)
    index.store("http://10.0.0.1:8000", [*AWKWARD, 2**64 - 1, -5])
    index.store("http://10.0.0.2:8000", AWKWARD[:2], medium="CPU", group=Group(1, tail=4))
    names = sorted(client.scan_iter())
    assert len(names) == (len(AWKWARD) + 2) + 2 + 2  # blocks, each replica's medium, each replica's media
    assert [name for name in names if not printable(name)] == []
    members = [m for name in names for m in client.smembers(name)]  # the hashes a medium holds, the holders
    assert [m for m in members if not printable(m)] == []
    assert index.match([*AWKWARD, 2**64 - 1, -5], ["http://10.0.0.1:8000", "http://10.0.0.2:8000"]) == [6, 2]
    index.clear("http://10.0.0.1:8000")
    assert index.match(AWKWARD, ["http://10.0.0.1:8000", "http://10.0.0.2:8000"]) == [0, 2]
