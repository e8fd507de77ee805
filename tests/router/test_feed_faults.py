"""A replica's event stream that sends garbage: the feed counts it, starts over, and keeps the good batches."""

from __future__ import annotations

import pytest

from kvpool.router.feed import EventFeed
from kvpool.router.index import MemoryIndex
from tests.router.fakes import wait_for
from tests.router.test_feed import H, HandPublisher, Loop, R, stored

GARBAGE = {
    "two frames": [b"", b"\x00" * 8],
    "four frames": [b"", b"\x00" * 8, b"x", b"y"],
    "not msgpack": [b"", (7).to_bytes(8, "big"), b"\xc1\xc1\xc1"],
    "nested too deep": [b"", (7).to_bytes(8, "big"), b"\x91" * 200_000 + b"\xc0"],
    "the wrong shape": [b"", (7).to_bytes(8, "big"), b"\x93\xa1x\xa1y\xa1z"],
}


@pytest.mark.parametrize("frames", GARBAGE.values(), ids=GARBAGE.keys())
def test_garbage_on_the_stream_does_not_stop_the_feed(
    frames: list[bytes], publisher: HandPublisher, loop: Loop
) -> None:
    publisher.keep(0, stored(*H[:4]))
    index = MemoryIndex()
    feed = EventFeed(R, publisher.info, index)
    feed.start(loop.loop)
    try:
        wait_for(lambda: feed.batches == 1, "the catch-up")

        def garbage_read() -> bool:
            publisher.pub.send_multipart(frames)  # again until read: the SUB socket may still be joining
            return feed.errors >= 1

        wait_for(garbage_read, "the garbage to be read", timeout=15)
        assert feed.alive and feed.last_error

        def good_applied() -> bool:
            publisher.send(1, stored(*H[4:6]))
            return index.match(H[:6], [R]) == [6]

        # the feed starts over: its catch-up and the live batch give the replica's whole cache back
        wait_for(good_applied, "the good batches after the garbage", timeout=30)
        assert feed.alive and index.num_blocks(R) == 6
        assert feed.figures()["errors"] == feed.errors >= 1
    finally:
        feed.stop()
