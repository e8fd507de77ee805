"""The event stream: a PUB socket in vLLM's format with a replay socket, and a subscriber that repairs gaps.

A :class:`KVEventPublisher` sends each batch of :mod:`kvpool.events` as one
ZeroMQ PUB message of three frames::

    topic (UTF-8) | sequence number (8 bytes, big-endian) | msgpack EventBatch

(the payload is :mod:`kvpool.kv_events.wire`'s). With a replay endpoint the
publisher also binds a ROUTER socket that keeps the last ``buffer_steps``
messages: a subscriber that missed sequence numbers sends ``[b"", start]``
(``start`` as 8 big-endian bytes) and receives every buffered message from
``start`` on as ``[b"", topic, seq, payload]``, then the end marker
``[b"", b"", seq=-1, b""]``. :class:`KVEventSubscriber` does this by itself
when it sees a gap, and reports what could not be repaired.

Endpoints follow :mod:`kvpool.kv_events.transport`'s rule (``bind:``/
``connect:`` markers, else vLLM's); both sockets can require CURVE.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

from kvpool.errors import ConfigError
from kvpool.events import KVCacheEvent
from kvpool.hashing import BlockHasher
from kvpool.kv_events.transport import (
    Attach,
    CurveClient,
    CurveServer,
    Endpoint,
    parse_publisher_endpoint,
    parse_replay_endpoint,
    parse_subscriber_endpoint,
)
from kvpool.kv_events.wire import Encoder, EventBatch, EventContent, EventStreamError, decode_batch, import_extra

__all__ = [
    "END_OF_REPLAY",
    "KVEventPublisher",
    "KVEventSubscriber",
    "LostBatches",
    "PublisherRestarted",
    "Received",
    "SequencedBatch",
    "describe_events",
]

#: The sequence number of the replay socket's end marker.
END_OF_REPLAY = -1
_END_SEQ = END_OF_REPLAY.to_bytes(8, "big", signed=True)


@dataclass(frozen=True, slots=True)
class SequencedBatch:
    """A batch as a subscriber receives it; ``replayed`` when it came from the replay socket."""

    seq: int
    batch: EventBatch
    replayed: bool = False


@dataclass(frozen=True, slots=True)
class LostBatches:
    """Batches ``first .. last`` (inclusive) were missed and could not be replayed.

    The subscriber's view of the publisher's cache is incomplete from here on:
    a router should drop what it knows of that replica (later events rebuild it).
    """

    first: int
    last: int


@dataclass(frozen=True, slots=True)
class PublisherRestarted:
    """The sequence went back to ``seq``: a new publisher (its cache starts empty)."""

    seq: int


#: What :meth:`KVEventSubscriber.receive` returns, item by item.
Received = SequencedBatch | LostBatches | PublisherRestarted


class KVEventPublisher:
    """Publishes KV event batches on a ZeroMQ PUB socket in vLLM's format, with optional replay.

    Usable without a server: build one, hand it ``manager.take_events()``
    after each step, close it at the end (or use it as a context manager).

    Args:
        endpoint: PUB endpoint: ``bind:tcp://127.0.0.1:5557`` binds that
            interface, ``connect:...`` connects to a forwarder, an unmarked
            one follows vLLM's rule (a wildcard host such as ``tcp://*:5557``
            or an ipc/inproc endpoint is bound, any other connected to); see
            :mod:`kvpool.kv_events.transport`. Port 0 binds a free port:
            :attr:`endpoint` then tells which.
        replay_endpoint: ROUTER endpoint (always bound) serving missed
            batches; None: no replay.
        topic: first frame of every message.
        buffer_steps: batches kept for replay.
        hwm: send high-water mark of the PUB socket (slow subscribers lose
            messages beyond it, and repair them through replay).
        data_parallel_rank: stamped on every batch.
        content: what a ``BlockStored`` says about its request
            (:class:`EventContent`; ``HASHES`` leaves out token IDs, LoRA
            name and extra keys).
        curve: CURVE keys: both sockets encrypt, and only the allowed
            client keys may connect; None: plain TCP, open to anyone who
            reaches the endpoint.

    :attr:`endpoint` and :attr:`replay_endpoint` are the addresses
    subscribers use (no marker). Sockets live on one background thread:
    :meth:`publish` encodes on the caller's thread and returns the batch's
    sequence number at once.
    """

    def __init__(
        self,
        endpoint: str,
        *,
        replay_endpoint: str | None = None,
        topic: str = "",
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        data_parallel_rank: int = 0,
        content: EventContent = EventContent.FULL,
        curve: CurveServer | None = None,
    ) -> None:
        where = parse_publisher_endpoint(endpoint, "endpoint")
        replay_where = None if replay_endpoint is None else parse_replay_endpoint(replay_endpoint, "replay_endpoint")
        if not isinstance(topic, str):
            raise ConfigError(f"topic must be a string, got {topic!r}")
        for name, value in (("buffer_steps", buffer_steps), ("hwm", hwm)):
            if type(value) is not int or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if type(data_parallel_rank) is not int or data_parallel_rank < 0:
            raise ConfigError(f"data_parallel_rank must be a non-negative integer, got {data_parallel_rank!r}")
        if curve is not None and not isinstance(curve, CurveServer):
            raise ConfigError(f"curve must be a CurveServer, got {curve!r}")
        zmq = import_extra("zmq")
        self._encode = Encoder(content)
        self.content = content
        self.curve = curve
        self.attach = where.attach
        self._zmq = zmq
        self._topic = topic.encode("utf-8")
        self.topic = topic
        self.data_parallel_rank = data_parallel_rank
        self._ctx = zmq.Context()
        # The ZAP handler runs before a CURVE socket binds: it answers every handshake.
        self._authenticator = None if curve is None else curve.start_authenticator(self._ctx)
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(hwm)
        self._replay = None
        try:
            self.endpoint = self._attach(self._pub, where)
            self.replay_endpoint: str | None = None
            if replay_where is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.SNDHWM, 2 * (buffer_steps + 1))  # a whole replay and its marker
                self.replay_endpoint = self._attach(self._replay, replay_where)
        except zmq.ZMQError as exc:
            self._close_sockets()
            raise ConfigError(f"cannot open KV event endpoint: {exc}") from None
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        # Batches reach the socket thread over an in-process pair of sockets, so that
        # one poll waits on them and on replay requests alike (no wake-ups when idle).
        inbox = f"inproc://kv-event-publisher-{id(self)}"
        self._outbox_in = self._ctx.socket(zmq.PAIR)
        self._outbox_in.set_hwm(0)
        self._outbox_in.bind(inbox)
        self._outbox = self._ctx.socket(zmq.PAIR)
        self._outbox.set_hwm(0)
        self._outbox.connect(inbox)
        self._next_seq = 0
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kv-event-publisher", daemon=True)
        self._thread.start()

    @property
    def curve_public_key(self) -> str | None:
        """The publisher's CURVE public key (Z85), which subscribers must name; None without CURVE."""
        return None if self.curve is None else self.curve.keys.public_key.decode("ascii")

    def _attach(self, sock: Any, where: Endpoint) -> str:
        if self.curve is not None:
            self.curve.secure(sock, self._zmq)
        address = where.address
        if where.attach is Attach.CONNECT:
            sock.connect(address)
            return address
        sock.bind(address)
        bound = cast(str, sock.getsockopt_string(self._zmq.LAST_ENDPOINT))
        # Keep the host the caller asked for (a wildcard stays one); report the port the OS chose.
        if address.startswith("tcp://") and bound.startswith("tcp://"):
            return address.rsplit(":", 1)[0] + ":" + bound.rsplit(":", 1)[1]
        return bound or address

    @property
    def next_seq(self) -> int:
        """The sequence number the next batch will get."""
        return self._next_seq

    def publish(self, events: Sequence[KVCacheEvent], *, ts: float | None = None) -> int:
        """Send ``events`` as one batch (even an empty one); returns its sequence number."""
        if self._closed:
            raise ConfigError("this KV event publisher is closed")
        payload = self._encode(events, time.time() if ts is None else ts, self.data_parallel_rank)
        with self._lock:
            if self._closed:
                raise ConfigError("this KV event publisher is closed")
            seq = self._next_seq
            self._next_seq += 1
            self._outbox.send_multipart((seq.to_bytes(8, "big"), payload))
        return seq

    def close(self, timeout: float = 2.0) -> None:
        """Send what is queued, then close the sockets (waits up to ``timeout`` seconds)."""
        if self._closed:
            return
        with self._lock:
            self._closed = True
            self._outbox.send(b"")  # the end: one frame
        self._thread.join(timeout)
        self._close_sockets()

    def _close_sockets(self) -> None:
        for name in ("_pub", "_replay", "_outbox", "_outbox_in"):
            sock = getattr(self, name, None)
            if sock is not None:
                sock.close(linger=0)
        if self._authenticator is not None:
            self._authenticator.stop()  # its ZAP socket is the context's last
        self._ctx.term()

    def __enter__(self) -> KVEventPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run(self) -> None:
        """Own the sockets: send queued batches, serve replay requests."""
        zmq = self._zmq
        pub, replay, inbox, topic, buffer = self._pub, self._replay, self._outbox_in, self._topic, self._buffer
        poller = zmq.Poller()
        poller.register(inbox, zmq.POLLIN)
        if replay is not None:
            poller.register(replay, zmq.POLLIN)
        while True:
            ready = dict(poller.poll())
            # Batches first: a replay asked for after publish() returned includes that batch.
            while inbox in ready:
                try:
                    frames = inbox.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                if len(frames) == 1:
                    return
                seq_bytes, payload = frames
                pub.send_multipart((topic, seq_bytes, payload))
                buffer.append((int.from_bytes(seq_bytes, "big"), payload))
            if replay is not None and replay in ready:
                self._serve_replay(replay)

    def _serve_replay(self, replay: Any) -> None:
        frames = replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            return  # not a replay request: ignore it, as vLLM does
        client, _, start_bytes = frames
        start = int.from_bytes(start_bytes, "big")
        for seq, payload in self._buffer:
            if seq >= start:
                replay.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"), payload))
        replay.send_multipart((client, b"", b"", _END_SEQ, b""))


# -- the subscriber ---------------------------------------------------------------------


class KVEventSubscriber:
    """Follows one publisher's stream, in order, repairing gaps through its replay socket.

    Args:
        endpoint: the publisher's PUB endpoint to connect to (``connect:``
            may mark it; ``bind:`` and wildcard hosts are refused).
        replay_endpoint: its replay endpoint (None: gaps are reported, not repaired).
        topic: topic prefix to subscribe to.
        last_seq: the last sequence number already seen (resume after a
            reconnect); None: take the stream from the first message that
            arrives.
        replay_timeout: seconds to wait for a replay's end marker.
        curve: this subscriber's CURVE keys and the publisher's public key
            (a CURVE publisher answers nothing without them; with them, a
            publisher holding another key is never heard).
        max_message_bytes: a larger message drops the connection (ZeroMQ's
            ``MAXMSGSIZE``) before it is read into memory.

    :meth:`receive` returns, in sequence order, :class:`SequencedBatch` items
    and, where batches were lost for good, :class:`LostBatches`; a sequence
    that starts over yields :class:`PublisherRestarted`. A gap is repaired
    within the call (waiting up to ``replay_timeout`` for the replay socket);
    when the replay socket does not answer, the gap is reported as lost.

    A malformed message (wrong frame count, a sequence number that is not 8
    bytes, a payload that is not a batch) raises :class:`EventStreamError`
    from the call that reads it, or from the next call when batches read
    before it are returned first; nothing else escapes, and it is counted in
    :attr:`malformed`. Its sequence number (if it had one) is not taken as
    seen, so the next good batch reveals it as a gap: repaired, or reported
    lost.
    """

    def __init__(
        self,
        endpoint: str,
        *,
        replay_endpoint: str | None = None,
        topic: str = "",
        last_seq: int | None = None,
        replay_timeout: float = 2.0,
        curve: CurveClient | None = None,
        max_message_bytes: int = 64 << 20,
    ) -> None:
        address = parse_subscriber_endpoint(endpoint, "endpoint")
        replay = None if replay_endpoint is None else parse_subscriber_endpoint(replay_endpoint, "replay_endpoint")
        if last_seq is not None and (type(last_seq) is not int or last_seq < -1):
            raise ConfigError(f"last_seq must be None or an integer >= -1, got {last_seq!r}")
        if curve is not None and not isinstance(curve, CurveClient):
            raise ConfigError(f"curve must be a CurveClient, got {curve!r}")
        if type(max_message_bytes) is not int or max_message_bytes < 1:
            raise ConfigError(f"max_message_bytes must be a positive integer, got {max_message_bytes!r}")
        zmq = import_extra("zmq")
        import_extra("msgspec")
        self._zmq = zmq
        self.endpoint = address
        self.replay_endpoint = replay
        self.replay_timeout = replay_timeout
        self.last_seq = last_seq
        self.curve = curve
        self.max_message_bytes = max_message_bytes
        self.malformed = 0  # messages refused, live or replayed
        self._pending: EventStreamError | None = None
        self._ctx = zmq.Context()
        self._sub = self._socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode("utf-8"))
        self._sub.connect(address)

    def _socket(self, kind: int) -> Any:
        sock = self._ctx.socket(kind)
        sock.setsockopt(self._zmq.MAXMSGSIZE, self.max_message_bytes)
        if self.curve is not None:
            self.curve.secure(sock, self._zmq)
        return sock

    def close(self) -> None:
        self._sub.close(linger=0)
        self._ctx.term()

    def __enter__(self) -> KVEventSubscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def receive(self, timeout: float = 0.0, max_messages: int = 1000) -> list[Received]:
        """What arrived, waiting up to ``timeout`` seconds for the first message."""
        if self._pending is not None:
            error, self._pending = self._pending, None
            raise error
        out: list[Received] = []
        sub = self._sub
        if not sub.poll(int(timeout * 1000)):
            return out
        for _ in range(max_messages):
            try:
                frames = sub.recv_multipart(self._zmq.NOBLOCK)
            except self._zmq.Again:
                break
            try:
                out.extend(self.accept(frames))
            except EventStreamError as exc:
                if not out:
                    raise
                self._pending = exc  # what came before it is returned first
                break
        return out

    def accept(self, frames: Sequence[bytes]) -> list[Received]:
        """One live message, as :meth:`receive` reads it off the socket: what it adds to the stream.

        Raises :class:`EventStreamError` (and counts it) when the frames are
        not ``topic | 8-byte sequence number | batch``.
        """
        try:
            if len(frames) != 3:
                raise EventStreamError(f"a KV event message has 3 frames, this one {len(frames)}")
            _, seq_bytes, payload = frames
            if not isinstance(seq_bytes, bytes) or len(seq_bytes) != 8:
                raise EventStreamError("a KV event message's sequence number is 8 bytes")
            batch = decode_batch(payload)
        except EventStreamError:
            self.malformed += 1
            raise
        out: list[Received] = []
        self._accept(int.from_bytes(seq_bytes, "big"), batch, out)
        return out

    def _accept(self, seq: int, batch: EventBatch, out: list[Received]) -> None:
        last = self.last_seq
        if last is not None and seq == last:
            return  # a duplicate
        if last is not None and seq < last:
            out.append(PublisherRestarted(seq))
            last = -1  # the new publisher's batches before this one
        if last is not None and seq > last + 1:
            self._repair(last + 1, seq, out)
        out.append(SequencedBatch(seq, batch))
        self.last_seq = seq

    def _repair(self, first: int, stop: int, out: list[Received]) -> None:
        """Fetch batches ``first .. stop-1`` from the replay socket; report what it no longer holds."""
        got: list[SequencedBatch] = []
        if self.replay_endpoint is not None:
            try:
                got = [b for b in self.replay(first) if b.seq < stop]
            except EventStreamError:
                got = []  # no answer or a bad one: the gap stays, and is reported
        expected = first
        for batch in got:
            if batch.seq < expected:
                continue
            if batch.seq > expected:
                out.append(LostBatches(expected, batch.seq - 1))
            out.append(batch)
            expected = batch.seq + 1
        if expected < stop:
            out.append(LostBatches(expected, stop - 1))

    def replay(self, start: int) -> list[SequencedBatch]:
        """Every batch the publisher still buffers from ``start`` on (empty without a replay endpoint).

        Raises :class:`EventStreamError` when the replay socket does not finish
        within ``replay_timeout`` (a CURVE publisher that refuses this
        subscriber's keys never answers) or sends a malformed message.
        """
        if self.replay_endpoint is None:
            return []
        if type(start) is not int or not 0 <= start < 2**64:
            raise ConfigError(f"start must be a sequence number (an integer from 0), got {start!r}")
        zmq = self._zmq
        sock = self._socket(zmq.DEALER)
        try:
            sock.connect(self.replay_endpoint)
            sock.send_multipart((b"", start.to_bytes(8, "big")))
            batches: list[SequencedBatch] = []
            deadline = time.monotonic() + self.replay_timeout
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not sock.poll(int(left * 1000)):
                    raise EventStreamError(
                        f"replay from {self.replay_endpoint} did not finish within {self.replay_timeout} s"
                    )
                frames = sock.recv_multipart()
                try:
                    if len(frames) != 4 or len(frames[2]) != 8:
                        raise EventStreamError(
                            f"a replayed message is [b'', topic, seq (8 bytes), batch]: {len(frames)} frames"
                        )
                    seq = int.from_bytes(frames[2], "big", signed=True)
                    if seq == END_OF_REPLAY:
                        return batches
                    batches.append(SequencedBatch(seq, decode_batch(frames[3]), replayed=True))
                except EventStreamError:
                    self.malformed += 1
                    raise
        finally:
            sock.close(linger=0)


def describe_events(
    hasher: BlockHasher,
    *,
    endpoint: str | None,
    replay_endpoint: str | None = None,
    topic: str = "",
    data_parallel_rank: int = 0,
    content: EventContent = EventContent.FULL,
    curve_public_key: str | None = None,
    num_blocks: int | None = None,
    snapshot: str | None = None,
) -> dict[str, object]:
    """What ``GET /kv-events`` answers: where this replica's events are and how its blocks are hashed.

    A router needs nothing else to follow the replica and to compute the
    same block hashes from a prompt (``BlockHasher(block_size, hash_algorithm)``
    with the seed named by ``hash_seed``). ``content`` says whether
    ``BlockStored`` carries token IDs and extra keys (``"full"``) or hashes
    only (``"hashes"``); ``curve_public_key`` (Z85), when set, is the key a
    subscriber must name, and a subscriber checks it against keys it trusts
    rather than believing it. ``num_blocks``, when given, is the most blocks
    the replica can hold over all its media: a router keeps no more of its
    claims than that. ``snapshot``, when set, is the path (on the same HTTP
    server) answering :mod:`kvpool.kv_events.snapshot`'s message: a router
    that lost more batches than the replay buffer holds loads it.
    """
    return {
        "enabled": endpoint is not None,
        "endpoint": endpoint,
        "replay_endpoint": replay_endpoint,
        "topic": topic,
        "format": "vllm-0.33-msgpack",
        "data_parallel_rank": data_parallel_rank,
        "content": content.value,
        "curve_public_key": curve_public_key,
        "num_blocks": num_blocks,
        "snapshot": snapshot,
        "hash_algorithm": hasher.algo.value,
        "hash_seed": hasher.seed_name,
        "block_size": hasher.block_size,
    }
