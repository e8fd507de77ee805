"""The in-memory index is bounded: a flood of claims keeps it at its caps, oldest claims dropped, routing intact."""

from __future__ import annotations

import pytest

from kvpool.errors import ConfigError
from kvpool.router.feed import EventFeed
from kvpool.router.index import MemoryIndex
from tests.router.fakes import wait_for
from tests.router.test_feed import HandPublisher, Loop, R, stored


def chain(name: str, n: int) -> list[bytes]:
    return [f"{name}:{i}".encode().ljust(32, b".") for i in range(n)]


def test_a_flood_of_claims_stays_at_the_per_replica_cap() -> None:
    index = MemoryIndex(max_blocks_per_replica=100)
    for k in range(200):
        index.store(R, chain(f"flood{k}", 50))
    assert index.num_blocks(R) == 100
    assert index.figures()["claims"] == 100 and index.figures()["dropped"] == 200 * 50 - 100
    assert index.match(chain("flood199", 50), [R]) == [50]  # the newest claims are kept whole
    assert index.match(chain("flood0", 50), [R]) == [0]  # the oldest are gone: a miss, never a false claim


def test_the_global_cap_bounds_all_replicas_together() -> None:
    index = MemoryIndex(max_blocks=250, max_blocks_per_replica=200)
    for replica in ("a", "b", "c"):
        index.store(replica, chain(replica, 200))
    assert index.figures()["claims"] == 250 == sum(index.num_blocks(r) for r in "abc")
    assert max(index.num_blocks(r) for r in "abc") - min(index.num_blocks(r) for r in "abc") <= 1  # from the largest


def test_a_prefix_in_use_outlives_the_claims_around_it() -> None:
    index = MemoryIndex(max_blocks_per_replica=10)
    hot, cold, new = chain("hot", 5), chain("cold", 5), chain("new", 5)
    index.store(R, hot)
    index.store(R, cold)
    assert index.match(hot, [R]) == [5]  # a request used it: it is now the newest
    index.store(R, new)
    assert index.match(hot, [R]) == [5] and index.match(new, [R]) == [5] and index.match(cold, [R]) == [0]


def test_a_chain_loses_its_leaves_before_its_root() -> None:
    index = MemoryIndex(max_blocks_per_replica=8)
    index.store(R, chain("c", 10))  # one batch longer than the cap
    assert index.match(chain("c", 10), [R]) == [8]


def test_a_replica_that_says_how_much_it_holds_is_capped_there() -> None:
    index = MemoryIndex(max_blocks_per_replica=100)
    index.store(R, chain("x", 50))
    index.limit(R, 20)
    assert index.num_blocks(R) == 20 and index.match(chain("x", 50), [R]) == [20]
    index.limit(R, None)
    index.store(R, chain("y", 70))
    assert index.num_blocks(R) == 90


@pytest.mark.parametrize("field", ["max_blocks", "max_blocks_per_replica"])
@pytest.mark.parametrize("value", [0, -1, 1.5, None])
def test_a_bad_cap_is_refused_by_name(field: str, value: object) -> None:
    with pytest.raises(ConfigError, match=f"{field} .*{value!r}"):
        MemoryIndex(**{field: value})  # type: ignore[arg-type]  # the bad values under test


def test_a_replica_claiming_a_flood_through_its_events_is_capped_and_still_routed(
    publisher: HandPublisher, loop: Loop
) -> None:
    index = MemoryIndex(max_blocks_per_replica=1000)
    publisher.keep(0, stored(*chain("flood", 50_000)))
    publisher.keep(1, stored(*chain("real", 20)))
    feed = EventFeed(R, publisher.info, index)
    feed.start(loop.loop)
    try:
        wait_for(lambda: feed.batches == 2, "both batches", timeout=30)
        assert index.num_blocks(R) == 1000 and index.figures()["dropped"] == 50_020 - 1000
        assert index.match(chain("real", 20), [R, "http://other:1"]) == [20, 0]
    finally:
        feed.stop()
