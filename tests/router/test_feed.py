"""A replica's event stream into the index: catch-up, gaps repaired through replay, lost batches, resets.

The publisher here is written by hand on the wire format (``kvpool.kv_events.encode_batch``
payloads, vLLM's three frames, vLLM's replay protocol) so that a test decides exactly
which batches are delivered live and which the replay buffer still holds.
"""

from __future__ import annotations

import asyncio
import re
import threading
from collections.abc import Iterator

import pytest
import zmq
import zmq.auth

from kvpool.errors import ConfigError
from kvpool.events import AllBlocksCleared, BlockRemoved, BlockStored
from kvpool.hashing import BlockHasher
from kvpool.kv_events import END_OF_REPLAY, CurveServer, CurveTrust, KVEventPublisher, describe_events, encode_batch
from kvpool.router.feed import EventFeed
from kvpool.router.index import MemoryIndex
from kvpool.router.replicas import EventsInfo
from tests.router.fakes import wait_for

R = "http://replica:1"
H = [bytes([i]) * 32 for i in range(12)]


def stored(*hashes: bytes) -> BlockStored:
    return BlockStored(
        block_hashes=hashes,
        parent_block_hash=None,
        token_ids=tuple(range(16 * len(hashes))),
        block_size=16,
        lora_name=None,
        extra_keys=(None,) * len(hashes),
    )


class HandPublisher:
    """PUB and replay sockets whose buffer and live sends the test controls batch by batch."""

    def __init__(self) -> None:
        self.context = zmq.Context()
        self.pub = self.context.socket(zmq.PUB)
        self.port = self.pub.bind_to_random_port("tcp://127.0.0.1")  # bound, then the port read back
        # bound here, used only by the replay thread from then on
        self._replay = self.context.socket(zmq.ROUTER)
        self.replay_port = self._replay.bind_to_random_port("tcp://127.0.0.1")
        self.buffer: dict[int, bytes] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve_replays, daemon=True)
        self._thread.start()

    @property
    def info(self) -> EventsInfo:
        return EventsInfo(
            endpoint=f"tcp://127.0.0.1:{self.port}",
            replay_endpoint=f"tcp://127.0.0.1:{self.replay_port}",
            hash_algorithm="kvpool_sha256",
            hash_seed="kvpool-default",
            block_size=16,
        )

    def keep(self, seq: int, *events: object) -> bytes:
        """Put a batch in the replay buffer only (as if its live message were lost)."""
        payload = encode_batch(events)  # type: ignore[arg-type]  # kvpool events
        self.buffer[seq] = payload
        return payload

    def send(self, seq: int, *events: object) -> None:
        """Buffer a batch and send it live."""
        self.pub.send_multipart([b"", seq.to_bytes(8, "big"), self.keep(seq, *events)])

    def _serve_replays(self) -> None:
        router = self._replay
        while not self._stop.is_set():
            if not router.poll(50):
                continue
            client, _, start = router.recv_multipart()
            first = int.from_bytes(start, "big")
            for seq in sorted(self.buffer):
                if seq >= first:
                    router.send_multipart([client, b"", b"", seq.to_bytes(8, "big"), self.buffer[seq]])
            router.send_multipart([client, b"", b"", END_OF_REPLAY.to_bytes(8, "big", signed=True), b""])
        router.close(0)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.pub.close(0)
        self.context.term()


class Loop:
    """An event loop on a thread: the feed applies what it receives there, as in the router."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()


@pytest.fixture
def loop() -> Iterator[Loop]:
    running = Loop()
    yield running
    running.close()


@pytest.fixture
def publisher() -> Iterator[HandPublisher]:
    hand = HandPublisher()
    yield hand
    hand.close()


def follow(publisher: HandPublisher, index: MemoryIndex, loop: Loop) -> EventFeed:
    feed = EventFeed(R, publisher.info, index)
    feed.start(loop.loop)
    return feed


def deliver_until(publisher: HandPublisher, feed: EventFeed, batches: int, seq: int, *events: object) -> None:
    """Send batch ``seq`` live until the feed has applied ``batches`` (its SUB socket may still be joining;
    repeats of the same sequence number are dropped as duplicates)."""

    def applied() -> bool:
        if feed.batches >= batches:
            return True
        publisher.send(seq, *events)
        return False

    wait_for(applied, f"batch {seq} applied", timeout=15)


def test_a_new_feed_catches_up_from_the_replay_buffer(publisher: HandPublisher, loop: Loop) -> None:
    publisher.keep(0, stored(*H[:4]))
    publisher.keep(1, BlockRemoved(block_hashes=(H[3],)), stored(H[6]))
    index = MemoryIndex()
    feed = follow(publisher, index, loop)
    try:
        wait_for(lambda: feed.batches == 2, "the buffered batches")
        assert index.match(H[:4], [R]) == [3] and index.num_blocks(R) == 4
    finally:
        feed.stop()


def test_a_gap_is_repaired_through_replay(publisher: HandPublisher, loop: Loop) -> None:
    publisher.keep(0, stored(*H[:2]))
    index = MemoryIndex()
    feed = follow(publisher, index, loop)
    try:
        wait_for(lambda: feed.batches == 1, "the catch-up")
        publisher.keep(1, stored(*H[2:4]))  # missed live: only the replay buffer has them
        publisher.keep(2, stored(*H[4:6]))
        deliver_until(publisher, feed, 4, 3, stored(*H[6:8]))
        assert feed.batches == 4 and feed.resets == 0
        assert index.match(H[:8], [R]) == [8]
    finally:
        feed.stop()


def test_batches_gone_from_the_buffer_clear_the_replica(publisher: HandPublisher, loop: Loop) -> None:
    publisher.keep(0, stored(*H[:2]))
    index = MemoryIndex()
    feed = follow(publisher, index, loop)
    try:
        wait_for(lambda: feed.batches == 1, "the catch-up")
        publisher.keep(2, stored(H[9]))  # batch 1 is lost for good: perhaps it removed H[0]
        deliver_until(publisher, feed, 3, 3, stored(H[10]))
        wait_for(lambda: feed.resets == 1 and feed.batches == 3, "the reset")
        # what came before the loss is forgotten; what came after is kept
        assert index.match(H[:2], [R]) == [0] and index.num_blocks(R) == 2
    finally:
        feed.stop()


def test_a_cache_reset_event_clears_the_replica(loop: Loop) -> None:
    index = MemoryIndex()
    index.store("http://other:2", H[:3])
    with KVEventPublisher("bind:tcp://127.0.0.1:0", replay_endpoint="bind:tcp://127.0.0.1:0") as pub:
        pub.publish([stored(*H[:3])])
        pub.publish([AllBlocksCleared(), stored(H[5])])
        info = EventsInfo(
            endpoint=pub.endpoint,
            replay_endpoint=pub.replay_endpoint,
            hash_algorithm="kvpool_sha256",
            hash_seed=None,
            block_size=16,
        )
        feed = EventFeed(R, info, index)
        feed.start(loop.loop)
        try:
            wait_for(lambda: feed.batches == 2, "both batches")
            assert index.match(H[:3], [R, "http://other:2"]) == [0, 3]
            assert index.num_blocks(R) == 1
        finally:
            feed.stop()


@pytest.fixture
def certs(tmp_path) -> dict[str, str]:
    made = {}
    for name in ("replica", "router", "stranger"):
        (tmp_path / name).mkdir()
        public, secret = zmq.auth.create_certificates(tmp_path / name, name)
        made[name], made[name + ".key"] = str(secret), str(public)
    return made


def announcement(pub: KVEventPublisher) -> dict[str, object]:
    return describe_events(
        BlockHasher(16),
        endpoint=pub.endpoint,
        replay_endpoint=pub.replay_endpoint,
        curve_public_key=pub.curve_public_key,
    )


def test_the_router_follows_a_curve_protected_replica(loop: Loop, certs: dict[str, str]) -> None:
    server = CurveServer.load(certs["replica"], certs["router.key"])
    index = MemoryIndex()
    with KVEventPublisher("bind:tcp://127.0.0.1:0", replay_endpoint="bind:tcp://127.0.0.1:0", curve=server) as pub:
        pub.publish([stored(*H[:3])])
        # what the router reads at GET /kv-events, checked against the replica keys it trusts
        trust = CurveTrust.load(certs["router"], certs["replica.key"])
        info = EventsInfo.from_json(announcement(pub), "http://127.0.0.1:8001", trust)
        assert info.curve is not None
        feed = EventFeed(R, info, index)
        feed.start(loop.loop)
        try:
            wait_for(lambda: feed.batches == 1, "the catch-up over CURVE")
            for seq in range(1, 200):  # live batches, until the subscription is heard
                pub.publish([stored(H[seq % 4 + 4])])
                if feed.batches > 1:
                    break
            wait_for(lambda: feed.batches > 1, "a live batch over CURVE")
            assert index.match(H[:3], [R]) == [3]
        finally:
            feed.stop()


def test_the_router_refuses_replica_streams_it_cannot_trust(certs: dict[str, str]) -> None:
    trust = CurveTrust.load(certs["router"], certs["replica.key"])
    server = CurveServer.load(certs["stranger"], certs["router.key"])
    with KVEventPublisher("bind:tcp://127.0.0.1:0", curve=server) as stranger:
        with pytest.raises(ConfigError, match=re.escape(f"{stranger.curve_public_key!r}, which is not trusted")):
            EventsInfo.from_json(announcement(stranger), "http://127.0.0.1:8001", trust)
        with pytest.raises(ConfigError, match="--kv-events-server-keys"):
            EventsInfo.from_json(
                announcement(stranger), "http://127.0.0.1:8001"
            )  # a CURVE replica, a router without keys
    with KVEventPublisher("bind:tcp://127.0.0.1:0") as plain:
        with pytest.raises(ConfigError, match="without CURVE"):
            EventsInfo.from_json(announcement(plain), "http://127.0.0.1:8001", trust)
        assert EventsInfo.from_json(announcement(plain), "http://127.0.0.1:8001").curve is None
        # a loopback-only stream cannot be followed from another host
        with pytest.raises(ConfigError, match="loopback interface only"):
            EventsInfo.from_json(announcement(plain), "http://10.0.0.5:8001")
