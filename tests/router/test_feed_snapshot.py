"""A stream that lost more than the replay buffer holds: the feed loads the replica's snapshot, then batches after it.

The sequence rule (:mod:`kvpool.router.snapshot_loader`) is pinned on a fake subscriber,
item for item; the feed tests run it over real sockets (tests/router/test_feed.py's
hand-written publisher), with batches sent while the snapshot is being fetched.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import msgspec
import pytest

from kvpool.events import AllBlocksCleared, BlockRemoved, KVCacheEvent
from kvpool.kv_events import EventBatch, LostBatches, PublisherRestarted, SequencedBatch
from kvpool.kv_events.snapshot import decode_snapshot, encode_snapshot
from kvpool.router.feed import EventFeed
from kvpool.router.index import MemoryIndex
from kvpool.router.snapshot_loader import SNAPSHOT_TRIES, LoadedSnapshot, SnapshotLoader
from tests.router.fakes import wait_for
from tests.router.test_feed import H, HandPublisher, Loop, R, stored


def removed(*hashes: bytes) -> BlockRemoved:
    return BlockRemoved(block_hashes=hashes)


def batch(seq: int, *events: KVCacheEvent) -> SequencedBatch:
    return SequencedBatch(seq, EventBatch(0.0, events, 0))


class FakeSubscriber:
    """What the loader asks of a subscriber: the replay buffer, from a sequence number on."""

    def __init__(self, *buffered: SequencedBatch) -> None:
        self.buffered = list(buffered)

    def replay(self, start: int) -> list[SequencedBatch]:
        return [b for b in self.buffered if b.seq >= start]


def answers(*bodies: bytes) -> Callable[[], bytes]:
    """A snapshot fetch answering ``bodies`` in turn (the last one again after that)."""
    left = list(bodies)

    def fetch() -> bytes:
        return left.pop(0) if len(left) > 1 else left[0]

    return fetch


def seqs(out: Sequence[object]) -> list[object]:
    """Each item as its kind: a batch as its seq, a snapshot as ("S", seq), a loss as ("lost", first, last)."""
    shown: list[object] = []
    for item in out:
        if isinstance(item, SequencedBatch):
            shown.append(item.seq)
        elif isinstance(item, LoadedSnapshot):
            shown.append(("S", item.snapshot.seq))
        elif isinstance(item, LostBatches):
            shown.append(("lost", item.first, item.last))
        else:
            shown.append(item)
    return shown


# -- the sequence rule, item by item -------------------------------------------------------


def test_after_a_loss_the_snapshot_comes_then_only_batches_after_it() -> None:
    loader = SnapshotLoader(R, answers(encode_snapshot([stored(H[0])], 6)))
    got = loader.screen(FakeSubscriber(), [batch(2), LostBatches(3, 4), batch(5), batch(6), batch(7)])
    assert seqs(got) == [2, ("lost", 3, 4), ("S", 6), 7]
    # batches that arrived while it was fetched, and a loss it covers, are dropped; later ones pass
    assert seqs(loader.screen(FakeSubscriber(), [batch(6), LostBatches(3, 6), batch(8)])) == [8]
    assert loader.errors == 0


def test_a_start_whose_buffer_does_not_reach_batch_0_loads_the_snapshot() -> None:
    loader = SnapshotLoader(R, answers(encode_snapshot([stored(H[0])], 5)))
    assert seqs(loader.start(FakeSubscriber(), [batch(0), batch(1)])) == [0, 1]  # whole history: no snapshot
    assert seqs(loader.start(FakeSubscriber(), [batch(4), batch(5), batch(6)])) == [("S", 5), 6]
    assert seqs(loader.start(FakeSubscriber(), [])) == [("S", 5)]  # nothing buffered (or no replay socket)
    # the first batch after it must be 6: a later one is a hole, and a newer snapshot is asked for;
    # this one answers 5 again, SNAPSHOT_TRIES times, which never meets batch 8: cleared, as today
    assert seqs(loader.screen(FakeSubscriber(), [batch(5), batch(8)])) == [("lost", 6, 7), 8]
    assert loader.errors == 1 and loader.floor is None
    assert SnapshotLoader(R, None).start(FakeSubscriber(), [batch(4)]) == [batch(4)]  # no snapshot: as today


def test_batches_between_an_older_snapshot_and_the_stream_are_replayed() -> None:
    loader = SnapshotLoader(R, answers(encode_snapshot([], 5)))
    buffer = FakeSubscriber(batch(6), batch(7), batch(8))
    assert seqs(loader.screen(buffer, [LostBatches(2, 7), batch(8)])) == [("lost", 2, 7), ("S", 5), 6, 7, 8]


def test_when_the_replay_lacks_them_too_a_newer_snapshot_is_fetched_a_bounded_number_of_times() -> None:
    calls: list[int] = []
    bodies = [encode_snapshot([], 5), encode_snapshot([], 9)]

    def fetch() -> bytes:
        calls.append(1)
        return bodies[min(len(calls), 2) - 1]

    loader = SnapshotLoader(R, fetch)
    got = loader.screen(FakeSubscriber(batch(8)), [LostBatches(2, 7), batch(8)])
    assert seqs(got) == [("lost", 2, 7), ("S", 9)] and len(calls) == 2
    stale = SnapshotLoader(R, answers(encode_snapshot([], 5)))
    got = stale.screen(FakeSubscriber(), [LostBatches(2, 7), batch(8)])
    assert seqs(got) == [("lost", 2, 7), 8] and stale.errors == 1  # cleared, then rebuilt from batch 8
    assert f"{SNAPSHOT_TRIES} snapshots" in (stale.last_error or "")


def test_a_restarted_publisher_lifts_the_snapshots_floor() -> None:
    loader = SnapshotLoader(R, answers(encode_snapshot([], 50)))
    loader.screen(FakeSubscriber(), [LostBatches(0, 49), batch(50)])
    assert seqs(loader.screen(FakeSubscriber(), [PublisherRestarted(0), batch(0)])) == [PublisherRestarted(0), 0]


BAD_BODIES = {
    "not msgpack": (b"\xc1", "not a msgpack event snapshot"),
    "not an array": (msgspec.msgpack.encode({"seq": 3}), "an event snapshot is an array"),
    "a seq that is text": (msgspec.msgpack.encode(["7", [0.0, []]]), "seq is an integer from -1, got '7'"),
    "a seq below -1": (msgspec.msgpack.encode([-2, [0.0, []]]), "got -2"),
    "a bad batch": (msgspec.msgpack.encode([3, [0.0, [{"type": "Nope"}]]]), "unknown event type 'Nope'"),
    "a removal": (encode_snapshot([removed(H[0])], 3), "event 0 of an event snapshot is a BlockRemoved"),
    "a clear": (encode_snapshot([AllBlocksCleared()], 3), "is a AllBlocksCleared, not a BlockStored"),
}


@pytest.mark.parametrize(("body", "error"), BAD_BODIES.values(), ids=BAD_BODIES.keys())
def test_a_bad_snapshot_is_refused_naming_the_value_and_the_entries_stay_cleared(body: bytes, error: str) -> None:
    with pytest.raises(ValueError, match="snapshot|event"):
        decode_snapshot(body)
    loader = SnapshotLoader(R, answers(body))
    got = loader.screen(FakeSubscriber(), [LostBatches(2, 4), batch(5)])
    assert seqs(got) == [("lost", 2, 4), 5]  # no snapshot: the loop clears, batch 5 rebuilds
    assert loader.errors == 1 and error in (loader.last_error or ""), loader.last_error


def test_a_snapshot_names_a_bad_seq_when_encoded() -> None:
    with pytest.raises(ValueError, match="seq must be an integer from -1.*got True"):
        encode_snapshot([], True)  # type: ignore[arg-type]


# -- the feed, over sockets ---------------------------------------------------------------


def claims(index: MemoryIndex) -> set[bytes]:
    return {h for h in H if index.match([h], [R]) == [1]}


def test_a_feed_whose_buffer_lost_its_start_ends_with_exactly_the_replicas_blocks(
    publisher: HandPublisher, loop: Loop
) -> None:
    # batches 0..4 are gone; the pool after batch 7 holds H1..H6; batch 8 (sent while the
    # snapshot is fetched, after it was taken) removes H3
    publisher.keep(5, stored(H[4]))
    publisher.keep(6, removed(H[0]))
    fetching, sent = threading.Event(), threading.Event()

    def fetch() -> bytes:  # on the feed's thread: the test's thread sends batches 7 and 8 meanwhile
        body = encode_snapshot([stored(*H[1:7])], 7)
        fetching.set()
        assert sent.wait(10)
        return body

    index = MemoryIndex()
    feed = EventFeed(R, publisher.info, index, snapshot=fetch)
    feed.start(loop.loop)
    try:
        assert fetching.wait(10)
        publisher.send(7, stored(H[6]))  # in the snapshot: dropped when it arrives
        publisher.send(8, removed(H[3]))  # after it: applied
        sent.set()

        def whole() -> bool:
            if feed.snapshots == 1 and claims(index) == {H[1], H[2], H[4], H[5], H[6]}:
                return True
            publisher.send(8, removed(H[3]))  # again, until the SUB socket has joined (a repeat is a duplicate)
            return False

        wait_for(whole, "the snapshot and batch 8", timeout=15)
        figures = feed.figures()
        assert figures["snapshots"] == 1 and figures["snapshot_blocks"] == 6 and figures["snapshot_errors"] == 0
        assert index.num_blocks(R) == 5 and feed.batches == 1  # batch 8 only
    finally:
        feed.stop()


def test_a_feed_that_lost_batches_midstream_loads_the_snapshot(publisher: HandPublisher, loop: Loop) -> None:
    publisher.keep(0, stored(*H[:4]))
    publisher.keep(1, stored(H[4]))
    snapshot = encode_snapshot([stored(H[0], H[1], *H[5:9])], 5)  # after batch 5: H0, H1, H5..H8
    index = MemoryIndex()
    feed = EventFeed(R, publisher.info, index, snapshot=lambda: snapshot)
    feed.start(loop.loop)
    try:
        wait_for(lambda: feed.batches == 2, "the catch-up from batch 0 (no snapshot needed)")
        assert feed.snapshots == 0 and claims(index) == set(H[:5])
        # batches 2..4 never reach the router nor stay in the buffer; batch 5 reveals the loss
        publisher.keep(5, stored(H[8]))

        def loaded() -> bool:
            if feed.snapshots == 1:
                return True
            publisher.send(5, stored(H[8]))
            return False

        wait_for(loaded, "the loss and the snapshot", timeout=15)
        assert feed.gaps == 1 and claims(index) == {H[0], H[1], *H[5:9]}

        def removal_applied() -> bool:
            if H[0] not in claims(index):
                return True
            publisher.send(6, removed(H[0]))
            return False

        wait_for(removal_applied, "batch 6", timeout=15)
        assert claims(index) == {H[1], *H[5:9]} and feed.snapshots == 1
    finally:
        feed.stop()


def test_a_feed_given_a_bad_snapshot_stays_cleared_and_says_why(publisher: HandPublisher, loop: Loop) -> None:
    publisher.keep(3, stored(H[0], H[1]))  # batches 0..2 are gone
    index = MemoryIndex()
    feed = EventFeed(R, publisher.info, index, snapshot=lambda: msgspec.msgpack.encode(["7", [0.0, []]]))
    feed.start(loop.loop)
    try:
        wait_for(lambda: feed.batches == 1, "the buffered batch, applied as today")
        figures = feed.figures()
        assert figures["snapshots"] == 0 and figures["snapshot_errors"] == 1
        assert "got '7'" in str(figures["last_snapshot_error"])
        assert claims(index) == {H[0], H[1]}  # what the stream said, and nothing a bad body claimed
    finally:
        feed.stop()
