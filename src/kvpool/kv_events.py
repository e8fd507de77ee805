"""KV cache events on the wire, in vLLM 0.33's format, for routers that follow a fleet.

A :class:`KVEventPublisher` sends each batch of :mod:`kvpool.events` as one
ZeroMQ PUB message of three frames::

    topic (UTF-8) | sequence number (8 bytes, big-endian) | msgpack EventBatch

The payload is what vLLM's ``KVEventBatch`` encodes to: an array
``[ts, events, data_parallel_rank]`` whose events are maps tagged
``{"type": "BlockStored" | "BlockRemoved" | "AllBlocksCleared", ...}``, fields
in vLLM's order, fields with a ``None`` default left out when ``None``. A
subscriber written for vLLM decodes it with vLLM's own classes.

With a replay endpoint the publisher also binds a ROUTER socket that keeps the
last ``buffer_steps`` messages: a subscriber that missed sequence numbers sends
``[b"", start]`` (``start`` as 8 big-endian bytes) and receives every buffered
message from ``start`` on as ``[b"", topic, seq, payload]``, then the end
marker ``[b"", b"", seq=-1, b""]``. :class:`KVEventSubscriber` does this by
itself when it sees a gap, and reports what could not be repaired.

``msgspec`` and ``pyzmq`` come with the ``events`` extra and are imported
only when used.
"""

from __future__ import annotations

import functools
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from types import ModuleType, SimpleNamespace
from typing import Any, cast

from kvpool.errors import ConfigError, KVPoolError
from kvpool.events import MEDIUM_GPU, AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from kvpool.hashing import BlockHash, BlockHasher, ExtraKey

__all__ = [
    "END_OF_REPLAY",
    "EventBatch",
    "EventStreamError",
    "KVEventPublisher",
    "KVEventSubscriber",
    "LostBatches",
    "PublisherRestarted",
    "Received",
    "SequencedBatch",
    "decode_batch",
    "describe_events",
    "encode_batch",
]

#: The sequence number of the replay socket's end marker.
END_OF_REPLAY = -1
_END_SEQ = END_OF_REPLAY.to_bytes(8, "big", signed=True)

# kvpool layer kinds under the names vLLM's events use (``KVCacheSpecKind``).
_WIRE_KIND = {"chunked_local": "chunked_local_attention", "mla": "mla_attention"}
_KIND_FROM_WIRE = {wire: kind for kind, wire in _WIRE_KIND.items()}


class EventStreamError(KVPoolError):
    """A message on the event stream is not a vLLM-format KV event batch."""


@dataclass(frozen=True, slots=True)
class EventBatch:
    """One published message: events recorded together, with their wall-clock time."""

    ts: float
    events: tuple[KVCacheEvent, ...]
    data_parallel_rank: int | None = None


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


def _import(module: str) -> ModuleType:
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        package = {"zmq": "pyzmq"}.get(module, module)
        raise ConfigError(
            f"KV events on the wire need {package}, which comes with kvpool's 'events' extra: "
            "pip install 'kvpool[events]'"
        ) from None


# -- encoding ---------------------------------------------------------------------------


def _wire_extra_keys(keys: tuple[ExtraKey, ...] | None) -> tuple[object, ...] | None:
    """One block's extra keys as vLLM publishes them: bare names and salts, ``(identifier, offset)`` pairs."""
    if keys is None:
        return None
    return tuple(key[1:] if key[0] == "mm" else key[1] for key in keys)


@functools.cache
def _wire_types() -> SimpleNamespace:
    """msgspec structs laid out as vLLM's (field order, tags, omitted defaults), so the bytes are vLLM's bytes."""
    _import("msgspec")  # a missing extra is named
    import msgspec

    class WireEvent(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
        pass

    class BlockStored(WireEvent):
        block_hashes: Sequence[bytes]
        parent_block_hash: bytes | None
        token_ids: Sequence[int]
        block_size: int
        lora_id: int | None
        medium: str | None
        lora_name: str | None
        extra_keys: list[tuple[object, ...] | None] | None = None
        group_idx: int | None = None
        kv_cache_spec_kind: str | None = None
        kv_cache_spec_sliding_window: int | None = None
        # Never set by kvpool; declared so that the map header has vLLM's width.
        locality: str | None = None
        ownership: str | None = None
        session_id: str | None = None
        lookahead_token_ids: list[list[int]] | None = None

    class BlockRemoved(WireEvent):
        block_hashes: Sequence[bytes]
        medium: str | None
        group_idx: int | None = None
        locality: str | None = None
        ownership: str | None = None

    class AllBlocksCleared(WireEvent):
        pass

    class Batch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
        ts: float
        events: list[object]
        data_parallel_rank: int | None = None

    return SimpleNamespace(
        BlockStored=BlockStored, BlockRemoved=BlockRemoved, AllBlocksCleared=AllBlocksCleared, Batch=Batch
    )


def _wire_event(wire: SimpleNamespace, event: KVCacheEvent) -> object:
    if type(event) is BlockStored:
        return wire.BlockStored(
            block_hashes=event.block_hashes,
            parent_block_hash=event.parent_block_hash,
            token_ids=event.token_ids,
            block_size=event.block_size,
            lora_id=None,
            medium=event.medium,
            lora_name=event.lora_name,
            extra_keys=[_wire_extra_keys(keys) for keys in event.extra_keys] if event.extra_keys else None,
            group_idx=event.group_id,
            kv_cache_spec_kind=None if event.spec_kind is None else _WIRE_KIND.get(event.spec_kind, event.spec_kind),
            kv_cache_spec_sliding_window=event.sliding_window,
        )
    if type(event) is BlockRemoved:
        return wire.BlockRemoved(block_hashes=event.block_hashes, medium=event.medium, group_idx=event.group_id)
    if type(event) is AllBlocksCleared:
        return wire.AllBlocksCleared()
    raise ConfigError(f"not a KV cache event: {event!r}")


class _Encoder:
    """Encodes batches to vLLM's msgpack payload (one msgspec encoder, reused)."""

    __slots__ = ("_encode", "_wire")

    def __init__(self) -> None:
        self._wire = _wire_types()
        self._encode: Callable[[object], bytes] = _import("msgspec").msgpack.Encoder().encode

    def __call__(self, events: Iterable[KVCacheEvent], ts: float, data_parallel_rank: int | None) -> bytes:
        wire = self._wire
        return self._encode(wire.Batch(ts, [_wire_event(wire, e) for e in events], data_parallel_rank))


def encode_batch(
    events: Iterable[KVCacheEvent], *, ts: float | None = None, data_parallel_rank: int | None = 0
) -> bytes:
    """The msgpack payload vLLM's ``KVEventBatch`` would encode these events to (``ts``: now when None)."""
    return _Encoder()(events, time.time() if ts is None else ts, data_parallel_rank)


# -- decoding ---------------------------------------------------------------------------


def _hash(value: object, where: str) -> BlockHash:
    if isinstance(value, bytes):
        return BlockHash(value)
    if type(value) is int and 0 <= value < 2**64:  # vLLM's VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES
        return BlockHash(value.to_bytes(8, "big"))
    raise EventStreamError(f"{where}: a block hash must be bytes or a 64-bit integer, got {value!r}")


def _tagged_extra_keys(entry: object, lora_name: str | None, where: str) -> tuple[ExtraKey, ...] | None:
    """One block's untagged wire keys back in kvpool's tagged form."""
    if entry is None:
        return None
    if not isinstance(entry, list | tuple):
        raise EventStreamError(f"{where}: extra keys must be a list or null, got {entry!r}")
    keys: list[ExtraKey] = []
    for i, key in enumerate(entry):
        if i == 0 and lora_name is not None and key == lora_name:
            keys.append(("lora", lora_name))
        elif isinstance(key, list | tuple) and len(key) == 2 and isinstance(key[0], str) and type(key[1]) is int:
            keys.append(("mm", key[0], key[1]))
        elif isinstance(key, str):
            keys.append(("cache_salt", key))
        elif isinstance(key, bytes):
            keys.append(("prompt_embeds", key.hex()))
        else:
            raise EventStreamError(f"{where}: unknown extra key {key!r}")
    return tuple(keys)


def _field(event: dict[Any, Any], name: str, kind: type | tuple[type, ...], where: str, default: object = ...) -> Any:
    value = event.get(name, default)
    if value is ...:
        raise EventStreamError(f"{where}: missing field {name!r}")
    if value is not None and not isinstance(value, kind):
        raise EventStreamError(f"{where}: field {name!r} has the wrong type: {value!r}")
    return value


def _event(event: object, where: str) -> KVCacheEvent:
    if not isinstance(event, dict):
        raise EventStreamError(f"{where}: an event must be a tagged map, got {event!r}")
    tag = event.get("type")
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    if tag not in ("BlockStored", "BlockRemoved"):
        raise EventStreamError(f"{where}: unknown event type {tag!r}")
    hashes = tuple(_hash(h, where) for h in _field(event, "block_hashes", list, where))
    medium = _field(event, "medium", str, where) or MEDIUM_GPU
    group = _field(event, "group_idx", int, where, None) or 0
    if tag == "BlockRemoved":
        return BlockRemoved(block_hashes=hashes, group_id=group, medium=medium)
    parent = event.get("parent_block_hash")
    lora_name = _field(event, "lora_name", str, where)
    wire_keys = _field(event, "extra_keys", list, where, None)
    if wire_keys is not None and len(wire_keys) != len(hashes):
        raise EventStreamError(f"{where}: {len(wire_keys)} extra-key entries for {len(hashes)} blocks")
    kind = _field(event, "kv_cache_spec_kind", str, where, None)
    return BlockStored(
        block_hashes=hashes,
        parent_block_hash=None if parent is None else _hash(parent, where),
        token_ids=tuple(_field(event, "token_ids", list, where)),
        block_size=_field(event, "block_size", int, where),
        lora_name=lora_name,
        extra_keys=tuple(_tagged_extra_keys(k, lora_name, where) for k in wire_keys)
        if wire_keys is not None
        else (None,) * len(hashes),
        group_id=group,
        medium=medium,
        spec_kind=None if kind is None else _KIND_FROM_WIRE.get(kind, kind),
        sliding_window=_field(event, "kv_cache_spec_sliding_window", int, where, None),
    )


def decode_batch(payload: bytes) -> EventBatch:
    """A vLLM-format msgpack ``EventBatch`` (from kvpool or vLLM) as kvpool events.

    Fields kvpool has no use for (``lora_id``, ``locality``, ``session_id``,
    ...) are ignored; integer block hashes come back as their 8 big-endian
    bytes. Raises :class:`EventStreamError` on anything else.
    """
    msgspec = _import("msgspec")
    try:
        raw = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError as exc:
        raise EventStreamError(f"not a msgpack event batch: {exc}") from None
    if not isinstance(raw, list) or len(raw) not in (2, 3) or not isinstance(raw[1], list):
        raise EventStreamError(f"an event batch is an array [ts, events, data_parallel_rank], got {raw!r:.200}")
    ts, events = raw[0], raw[1]
    rank = raw[2] if len(raw) == 3 else None
    if not isinstance(ts, int | float) or isinstance(ts, bool) or (rank is not None and type(rank) is not int):
        raise EventStreamError(f"bad batch header: ts={ts!r}, data_parallel_rank={rank!r}")
    return EventBatch(float(ts), tuple(_event(e, f"event {i}") for i, e in enumerate(events)), rank)


# -- the publisher ----------------------------------------------------------------------


def _binds(endpoint: str) -> bool:
    """vLLM's rule: wildcard hosts and ipc/inproc endpoints are bound, others connected to."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def _check_endpoint(name: str, endpoint: object) -> str:
    if not isinstance(endpoint, str) or not endpoint.startswith(("tcp://", "ipc://", "inproc://")):
        raise ConfigError(f"{name} must be a ZeroMQ endpoint such as 'tcp://*:5557', got {endpoint!r}")
    return endpoint


class KVEventPublisher:
    """Publishes KV event batches on a ZeroMQ PUB socket in vLLM's format, with optional replay.

    Usable without a server: build one, hand it ``manager.take_events()``
    after each step, close it at the end (or use it as a context manager).

    Args:
        endpoint: PUB endpoint. A wildcard host (``tcp://*:5557``) or an
            ipc/inproc endpoint is bound; any other is connected to (a
            forwarder), as vLLM does. ``tcp://*:0`` binds a free port:
            :attr:`endpoint` then tells which.
        replay_endpoint: ROUTER endpoint (always bound) serving missed
            batches; None: no replay.
        topic: first frame of every message.
        buffer_steps: batches kept for replay.
        hwm: send high-water mark of the PUB socket (slow subscribers lose
            messages beyond it, and repair them through replay).
        data_parallel_rank: stamped on every batch.

    Sockets live on one background thread: :meth:`publish` encodes on the
    caller's thread and returns the batch's sequence number at once.
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
    ) -> None:
        _check_endpoint("endpoint", endpoint)
        if replay_endpoint is not None:
            _check_endpoint("replay_endpoint", replay_endpoint)
        if not isinstance(topic, str):
            raise ConfigError(f"topic must be a string, got {topic!r}")
        for name, value in (("buffer_steps", buffer_steps), ("hwm", hwm)):
            if type(value) is not int or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if type(data_parallel_rank) is not int or data_parallel_rank < 0:
            raise ConfigError(f"data_parallel_rank must be a non-negative integer, got {data_parallel_rank!r}")
        zmq = _import("zmq")
        self._encode = _Encoder()
        self._zmq = zmq
        self._topic = topic.encode("utf-8")
        self.topic = topic
        self.data_parallel_rank = data_parallel_rank
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(hwm)
        self._replay = None
        try:
            self.endpoint = self._attach(self._pub, endpoint, bind=_binds(endpoint))
            self.replay_endpoint: str | None = None
            if replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.SNDHWM, 2 * (buffer_steps + 1))  # a whole replay and its marker
                self.replay_endpoint = self._attach(self._replay, replay_endpoint, bind=True)
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

    def _attach(self, sock: Any, endpoint: str, *, bind: bool) -> str:
        if not bind:
            sock.connect(endpoint)
            return endpoint
        sock.bind(endpoint)
        bound = cast(str, sock.getsockopt_string(self._zmq.LAST_ENDPOINT))
        # Keep the wildcard the caller asked for; report the port the OS chose.
        if endpoint.startswith("tcp://") and bound.startswith("tcp://"):
            return endpoint.rsplit(":", 1)[0] + ":" + bound.rsplit(":", 1)[1]
        return bound or endpoint

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
        endpoint: the publisher's PUB endpoint to connect to.
        replay_endpoint: its replay endpoint (None: gaps are reported, not repaired).
        topic: topic prefix to subscribe to.
        last_seq: the last sequence number already seen (resume after a
            reconnect); None: take the stream from the first message that
            arrives.
        replay_timeout: seconds to wait for a replay's end marker.

    :meth:`receive` returns, in sequence order, :class:`SequencedBatch` items
    and, where batches were lost for good, :class:`LostBatches`; a sequence
    that starts over yields :class:`PublisherRestarted`. A gap is repaired
    within the call (waiting up to ``replay_timeout`` for the replay socket);
    when the replay socket does not answer, the gap is reported as lost.
    """

    def __init__(
        self,
        endpoint: str,
        *,
        replay_endpoint: str | None = None,
        topic: str = "",
        last_seq: int | None = None,
        replay_timeout: float = 2.0,
    ) -> None:
        _check_endpoint("endpoint", endpoint)
        if replay_endpoint is not None:
            _check_endpoint("replay_endpoint", replay_endpoint)
        if last_seq is not None and (type(last_seq) is not int or last_seq < -1):
            raise ConfigError(f"last_seq must be None or an integer >= -1, got {last_seq!r}")
        zmq = _import("zmq")
        _import("msgspec")
        self._zmq = zmq
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.replay_timeout = replay_timeout
        self.last_seq = last_seq
        self._ctx = zmq.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode("utf-8"))
        self._sub.connect(endpoint)

    def close(self) -> None:
        self._sub.close(linger=0)
        self._ctx.term()

    def __enter__(self) -> KVEventSubscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def receive(self, timeout: float = 0.0, max_messages: int = 1000) -> list[Received]:
        """What arrived, waiting up to ``timeout`` seconds for the first message."""
        out: list[Received] = []
        sub = self._sub
        if not sub.poll(int(timeout * 1000)):
            return out
        for _ in range(max_messages):
            try:
                _, seq_bytes, payload = sub.recv_multipart(self._zmq.NOBLOCK)
            except self._zmq.Again:
                break
            self._accept(int.from_bytes(seq_bytes, "big"), payload, out)
        return out

    def _accept(self, seq: int, payload: bytes, out: list[Received]) -> None:
        last = self.last_seq
        if last is not None and seq == last:
            return  # a duplicate
        if last is not None and seq < last:
            out.append(PublisherRestarted(seq))
            last = -1  # the new publisher's batches before this one
        if last is not None and seq > last + 1:
            self._repair(last + 1, seq, out)
        out.append(SequencedBatch(seq, decode_batch(payload)))
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
        """Every batch the publisher still buffers from ``start`` on (empty without a replay endpoint)."""
        if self.replay_endpoint is None:
            return []
        zmq = self._zmq
        sock = self._ctx.socket(zmq.DEALER)
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
                if len(frames) != 4:
                    raise EventStreamError(f"replay sent {len(frames)} frames, expected 4")
                seq = int.from_bytes(frames[2], "big", signed=True)
                if seq == END_OF_REPLAY:
                    return batches
                batches.append(SequencedBatch(seq, decode_batch(frames[3]), replayed=True))
        finally:
            sock.close(linger=0)


def describe_events(
    hasher: BlockHasher,
    *,
    endpoint: str | None,
    replay_endpoint: str | None = None,
    topic: str = "",
    data_parallel_rank: int = 0,
) -> dict[str, object]:
    """What ``GET /kv-events`` answers: where this replica's events are and how its blocks are hashed.

    A router needs nothing else to follow the replica and to compute the
    same block hashes from a prompt (``BlockHasher(block_size, hash_algorithm)``
    with the seed named by ``hash_seed``).
    """
    return {
        "enabled": endpoint is not None,
        "endpoint": endpoint,
        "replay_endpoint": replay_endpoint,
        "topic": topic,
        "format": "vllm-0.33-msgpack",
        "data_parallel_rank": data_parallel_rank,
        "hash_algorithm": hasher.algo.value,
        "hash_seed": hasher.seed_name,
        "block_size": hasher.block_size,
    }
