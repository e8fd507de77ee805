"""The block index: one contract, run on the in-memory index and on the Redis one."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from kvpool.errors import ConfigError
from kvpool.router.index import BlockIndex, Group, MemoryIndex, RedisIndex, index_from_url
from kvpool.router.index_guard import GuardedIndex, guarded

A, B, C = "http://a:1", "http://b:2", "http://c:3"
H = [bytes([i]) * 32 for i in range(10)]


@pytest.fixture(params=["memory", "redis"])
def index(request: pytest.FixtureRequest) -> Iterator[BlockIndex]:
    if request.param == "memory":
        yield MemoryIndex()
        return
    url = request.getfixturevalue("redis_url")
    shared = index_from_url(url, prefix=f"test:{uuid.uuid4().hex}")
    assert isinstance(shared, RedisIndex) and isinstance(guarded(shared), GuardedIndex)  # routed by load if it dies
    yield shared


def test_match_counts_leading_blocks_per_replica(index: BlockIndex) -> None:
    index.store(A, H[:6])
    index.store(B, H[:2])
    index.store(C, H[3:6])  # holds later blocks but not the first: no prefix
    assert index.match(H[:8], [A, B, C]) == [6, 2, 0]
    assert index.match(H[:4], [B, A]) == [2, 4]
    assert index.match([], [A]) == [0]
    assert index.match(H[7:], [A, B, C]) == [0, 0, 0]
    assert [index.num_blocks(r) for r in (A, B, C)] == [6, 2, 3]


def test_a_hole_ends_the_prefix(index: BlockIndex) -> None:
    index.store(A, H[:6])
    index.remove(A, [H[2]])  # a removal the replica made in the middle of a chain
    assert index.match(H[:6], [A]) == [2]
    index.remove(A, [H[2], b"\xff" * 32])  # again, and an unknown hash: ignored
    assert index.num_blocks(A) == 5


def test_a_block_stays_while_any_medium_holds_it(index: BlockIndex) -> None:
    index.store(A, H[:3], "GPU")
    index.store(A, H[:3], "CPU")  # offloaded as well
    index.remove(A, H[:3], "GPU")  # evicted from the GPU: still in the CPU tier
    assert index.match(H[:3], [A]) == [3]
    index.remove(A, H[:1], "CPU")
    assert index.match(H[:3], [A]) == [0]
    assert index.num_blocks(A) == 2


def test_match_media_names_where_each_matched_block_is_held(index: BlockIndex) -> None:
    index.store(A, H[:2], "GPU")
    index.store(A, H[:4], "CPU")
    index.store(A, H[3:5], "STORAGE")
    index.store(B, H[:1])  # a claim that names no medium: the main pool
    index.store(C, H[:1], "GPU")
    index.store(C, H[:1], "CPU", Group(1, tail=1))  # a second group's claim: its medium is the same word
    gpu, cpu, storage = "GPU", "CPU", "STORAGE"
    assert index.match_media(H[:6], [A, B, C]) == [
        ((frozenset({gpu, cpu}), 2), (frozenset({cpu}), 1), (frozenset({cpu, storage}), 1), (frozenset({storage}), 1)),
        ((frozenset({None}), 1),),
        ((frozenset({gpu, cpu}), 1),),
    ]
    depths = [sum(n for _, n in runs) for runs in index.match_media(H[:6], [A, B, C])]
    assert depths == index.match(H[:6], [A, B, C])
    assert index.match_media([], [A]) == [()]
    assert index.match_media(H[6:], [A, B]) == [(), ()]


def test_clear_drops_one_replica_only(index: BlockIndex) -> None:
    index.store(A, H[:4], "GPU")
    index.store(A, H[:2], "CPU")
    index.store(B, H[:4])
    index.clear(A)
    assert index.match(H[:4], [A, B]) == [0, 4]
    assert index.num_blocks(A) == 0
    index.clear(A)  # twice: nothing left to drop
    index.store(A, H[:1])  # a new stream rebuilds it
    assert index.match(H[:4], [A, B]) == [1, 4]


def test_integer_hashes_and_byte_hashes_are_distinct(index: BlockIndex) -> None:
    index.store(A, [7, 8])
    assert index.match([7, 8], [A]) == [2]
    assert index.match([b"7", b"8"], [A]) == [0]
    with pytest.raises(ConfigError, match="bytes or an int"):
        index.store(A, ["7"])  # type: ignore[list-item]  # a str is refused by name


def test_two_routers_share_one_redis_index(redis_url: str) -> None:
    prefix = f"test:{uuid.uuid4().hex}"
    first, second = index_from_url(redis_url, prefix=prefix), index_from_url(redis_url, prefix=prefix)
    first.store(A, H[:5])
    second.store(A, H[:5])  # both routers apply the same event: idempotent
    second.store(B, H[:3])
    assert first.match(H[:5], [A, B]) == [5, 3]
    first.remove(A, H[3:5])
    assert second.match(H[:5], [A, B]) == [3, 3]
    second.clear(B)
    assert first.match(H[:5], [A, B]) == [3, 0]


def test_a_bad_redis_url_is_refused_by_name() -> None:
    with pytest.raises(ConfigError, match="not a Redis URL"):
        index_from_url("http://nowhere")
    with pytest.raises(ConfigError, match="does not answer"):
        index_from_url("redis://127.0.0.1:1/0")
