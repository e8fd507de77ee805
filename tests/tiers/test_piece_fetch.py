"""PieceFetch, the fetch both tier workers run: pieces in order, what an abandoned fetch keeps, what it owes.

The load thread is played by a thread the test gates piece by piece; the clock is a fake it moves.
"""

from __future__ import annotations

import threading

import pytest

from kvpool.errors import ConfigError
from kvpool.tiers.load_or_compute import LoadWait, TransferCosts, registry_links
from kvpool.tiers.piece_fetch import DeadlineMiss, PieceFetch, tier_runs


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def costs() -> TransferCosts:
    return TransferCosts(registry_links(["disk", "redis"]), block_bytes=4096, prefill_tokens_per_s=1_000.0)


def test_runs_group_consecutive_blocks_of_a_tier():
    assert tier_runs(["disk", "disk", "redis", "disk"]) == (("disk", 2), ("redis", 1), ("disk", 1))
    assert tier_runs([]) == ()


def test_a_fetch_reads_the_wait_s_pieces_and_a_wait_for_other_blocks_is_ignored():
    tiers = ["disk"] * 6 + ["redis"] * 4
    wait = costs().load_wait(tier_runs(tiers), block_size=4, cap_s=2.0)
    fetch = PieceFetch(tiers, wait, fixed_deadline_s=2.0)
    assert fetch.pieces == wait.pieces and len(fetch.pieces) > 2 and fetch.deadline_s() == wait.deadline_s(0)
    other = PieceFetch(["disk"] * 5, wait, fixed_deadline_s=2.0)
    assert other.wait is None and other.pieces == (("disk", 5),) and other.deadline_s() == 2.0
    bad = LoadWait((("disk", 0), ("disk", 6), ("redis", 4)), (0.1, 0.2, 0.3), 0.01, 2.0)
    assert PieceFetch(tiers, bad, fixed_deadline_s=2.0).wait is None  # an empty piece: not this fetch's
    with pytest.raises(ConfigError, match="one or more blocks"):
        PieceFetch([], None, fixed_deadline_s=2.0)


def test_a_fetch_abandoned_mid_piece_keeps_the_pieces_before_and_owes_the_one_it_reads():
    clock = Clock()
    tiers = ["redis"] * 8
    wait = costs().load_wait(tier_runs(tiers), block_size=4, cap_s=2.0)
    fetch = PieceFetch(tiers, wait, fixed_deadline_s=2.0, clock=clock)
    first = wait.pieces[0][1]
    in_second, release = threading.Event(), threading.Event()
    reads: list[tuple[str, int, int]] = []

    def read(tier: str, start: int, stop: int) -> list[bool]:
        reads.append((tier, start, stop))
        if start:
            in_second.set()
            assert release.wait(10)
        return [True] * (stop - start)

    thread = threading.Thread(target=fetch.run, args=(read,))
    thread.start()
    assert in_second.wait(10)
    assert fetch.landed == first and fetch.deadline_s() == wait.deadline_s(first)
    clock.now = 0.5
    given = fetch.abandon(timed_out=True)
    assert given.kept == first and given.running and [t[:2] for t in given.timings] == [("redis", first)]
    assert given.miss == DeadlineMiss("redis", wait.pieces[1][1], len(tiers) - first, 0.5, True)
    assert fetch.late_done() == (False, None, [])  # its thread is still in the store
    release.set()
    thread.join(10)
    done, owed, timings = fetch.late_done()
    assert done and owed == "redis" and [t[:2] for t in timings] == [("redis", wait.pieces[1][1])]
    assert fetch.late_done() == (True, None, [])  # once
    assert reads == [("redis", 0, first), ("redis", first, first + wait.pieces[1][1])]  # none after it
    c = costs()
    given.miss.tell(c)
    assert c.owes("redis") and c.figures()["tiers"]["redis"]["blocks_abandoned"] == len(tiers) - first


def test_a_fetch_that_never_started_misses_its_whole_wait_and_owes_nothing():
    fetch = PieceFetch(["disk", "disk"], None, fixed_deadline_s=2.0)
    given = fetch.abandon(timed_out=True)  # it queued behind other loads
    assert given.kept == 0 and not given.running and given.timings == ()
    assert given.miss == DeadlineMiss("disk", 2, 2, 2.0, False)
    assert fetch.run(lambda tier, start, stop: [True] * (stop - start)) == [False, False]  # abandoned: reads none


def test_a_missing_block_ends_the_fetch_at_it_and_a_failed_one_is_no_deadline_miss():
    fetch = PieceFetch(["disk"] * 3 + ["redis"] * 2, None, fixed_deadline_s=2.0)
    assert fetch.run(lambda tier, start, stop: [True, False, True][: stop - start]) == [True] + [False] * 4
    assert fetch.landed == 0  # the piece was not whole
    given = fetch.abandon(timed_out=False)
    assert given.miss is None and given.kept == 0
    whole = PieceFetch(["disk"] * 2, None, fixed_deadline_s=2.0)
    assert whole.run(lambda tier, start, stop: [True] * (stop - start)) == [True, True]
    assert whole.abandon(timed_out=True).miss is None  # everything landed as its deadline passed: in time
