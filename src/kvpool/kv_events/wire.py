"""One event batch as bytes, in vLLM 0.33's msgpack format, both ways.

The payload is what vLLM's ``KVEventBatch`` encodes to: an array
``[ts, events, data_parallel_rank]`` whose events are maps tagged
``{"type": "BlockStored" | "BlockRemoved" | "AllBlocksCleared", ...}``, fields
in vLLM's order, fields with a ``None`` default left out when ``None``.

What a ``BlockStored`` carries beyond its hashes is chosen once, by
:class:`EventContent`: everything vLLM publishes (``FULL``), or nothing taken
from a request but its block hashes (``HASHES``: ``token_ids`` empty,
``lora_name`` and ``extra_keys`` null, which vLLM's decoder and kvpool's read
as they read any batch).

Decoding never trusts the payload: whatever the bytes, :func:`decode_batch`
returns a batch or raises :class:`EventStreamError`. kvpool's own checks walk
a fixed number of levels (batch, event, extra keys, key), and msgspec refuses
nesting deeper than the interpreter's recursion limit without crashing.
"""

from __future__ import annotations

import enum
import functools
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from types import ModuleType, SimpleNamespace
from typing import Any

from kvpool.errors import ConfigError, ExternalDataError
from kvpool.events import MEDIUM_GPU, AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from kvpool.hashing import BlockHash, ExtraKey

__all__ = [
    "EventBatch",
    "EventContent",
    "EventStreamError",
    "batch_of",
    "decode_batch",
    "encode_batch",
    "import_extra",
    "shown",
]

# kvpool layer kinds under the names vLLM's events use (``KVCacheSpecKind``).
_WIRE_KIND = {"chunked_local": "chunked_local_attention", "mla": "mla_attention"}
_KIND_FROM_WIRE = {wire: kind for kind, wire in _WIRE_KIND.items()}


class EventStreamError(ExternalDataError):
    """A message on the event stream is not a vLLM-format KV event batch (bad data from the publisher)."""


class EventContent(enum.Enum):
    """What a published ``BlockStored`` says about the request whose blocks it stored.

    ``FULL``: vLLM's fields as vLLM fills them: the blocks' token IDs, the LoRA
    name and the extra keys (LoRA name, media identifiers, the cache salt).
    ``HASHES``: the block hashes, parent hash, block size, group, layer kind
    and medium only; ``token_ids`` is an empty list, ``lora_name`` and
    ``extra_keys`` are null. A prefix router needs no more; a subscriber
    cannot read prompts, nor the salts that make the hashes unguessable.
    """

    FULL = "full"
    HASHES = "hashes"

    @classmethod
    def for_tenants(cls, *, isolated: bool, include_token_ids: bool) -> EventContent:
        """What a server's events may carry: :attr:`HASHES` under isolated tenants, else :attr:`FULL`.

        Token IDs and extra keys would show every subscriber each tenant's
        prompts and the salts that keep their hashes unguessable, so isolated
        tenants get :attr:`FULL` only when the operator trusts every subscriber
        (``include_token_ids``). Shared tenants have no secret to keep.
        """
        return cls.FULL if include_token_ids or not isolated else cls.HASHES


@dataclass(frozen=True, slots=True)
class EventBatch:
    """One published message: events recorded together, with their wall-clock time."""

    ts: float
    events: tuple[KVCacheEvent, ...]
    data_parallel_rank: int | None = None


def import_extra(module: str) -> ModuleType:
    """``module`` (msgspec or zmq), or a :class:`ConfigError` naming the extra that brings it."""
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
    import_extra("msgspec")  # a missing extra is named
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


def _wire_event(wire: SimpleNamespace, event: KVCacheEvent, full: bool) -> object:
    if type(event) is BlockStored:
        return wire.BlockStored(
            block_hashes=event.block_hashes,
            parent_block_hash=event.parent_block_hash,
            token_ids=event.token_ids if full else (),
            block_size=event.block_size,
            lora_id=None,
            medium=event.medium,
            lora_name=event.lora_name if full else None,
            extra_keys=[_wire_extra_keys(keys) for keys in event.extra_keys] if full and event.extra_keys else None,
            group_idx=event.group_id,
            kv_cache_spec_kind=None if event.spec_kind is None else _WIRE_KIND.get(event.spec_kind, event.spec_kind),
            kv_cache_spec_sliding_window=event.sliding_window,
        )
    if type(event) is BlockRemoved:
        return wire.BlockRemoved(block_hashes=event.block_hashes, medium=event.medium, group_idx=event.group_id)
    if type(event) is AllBlocksCleared:
        return wire.AllBlocksCleared()
    raise ConfigError(f"not a KV cache event: {event!r}")


class Encoder:
    """Encodes batches to vLLM's msgpack payload (one msgspec encoder, reused), with ``content`` chosen once."""

    __slots__ = ("_encode", "_full", "_wire", "content")

    def __init__(self, content: EventContent = EventContent.FULL) -> None:
        if not isinstance(content, EventContent):
            raise ConfigError(f"content must be an EventContent, got {content!r}")
        self.content = content
        self._full = content is EventContent.FULL
        self._wire = _wire_types()
        self._encode: Callable[[object], bytes] = import_extra("msgspec").msgpack.Encoder().encode

    def __call__(self, events: Iterable[KVCacheEvent], ts: float, data_parallel_rank: int | None) -> bytes:
        return self._encode(self.batch(events, ts, data_parallel_rank))

    def batch(self, events: Iterable[KVCacheEvent], ts: float, data_parallel_rank: int | None) -> object:
        """The batch as the msgspec struct :meth:`__call__` encodes (for a message that embeds a batch)."""
        wire, full = self._wire, self._full
        return wire.Batch(ts, [_wire_event(wire, e, full) for e in events], data_parallel_rank)

    def encode(self, value: object) -> bytes:
        """Any msgspec-encodable value (a batch from :meth:`batch` inside it) as msgpack bytes."""
        return self._encode(value)


def encode_batch(
    events: Iterable[KVCacheEvent],
    *,
    ts: float | None = None,
    data_parallel_rank: int | None = 0,
    content: EventContent = EventContent.FULL,
) -> bytes:
    """The msgpack payload vLLM's ``KVEventBatch`` would encode these events to (``ts``: now when None)."""
    return Encoder(content)(events, time.time() if ts is None else ts, data_parallel_rank)


# -- decoding ---------------------------------------------------------------------------


def shown(value: object) -> str:
    """A short description of a decoded value: scalars in full (cut at 80 characters), containers by type and size.

    Never the ``repr`` of a container: a hostile payload can nest deeply enough
    for ``repr`` to recurse past the interpreter's limit.
    """
    if isinstance(value, list | tuple | dict):
        return f"a {type(value).__name__} of {len(value)}"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _hash(value: object, where: str) -> BlockHash:
    if isinstance(value, bytes):
        return BlockHash(value)
    if type(value) is int and 0 <= value < 2**64:  # vLLM's VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES
        return BlockHash(value.to_bytes(8, "big"))
    raise EventStreamError(f"{where}: a block hash must be bytes or a 64-bit integer, got {shown(value)}")


def _tagged_extra_keys(entry: object, lora_name: str | None, where: str) -> tuple[ExtraKey, ...] | None:
    """One block's untagged wire keys back in kvpool's tagged form."""
    if entry is None:
        return None
    if not isinstance(entry, list | tuple):
        raise EventStreamError(f"{where}: extra keys must be a list or null, got {shown(entry)}")
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
            raise EventStreamError(f"{where}: unknown extra key {shown(key)}")
    return tuple(keys)


def _field(event: dict[Any, Any], name: str, kind: type | tuple[type, ...], where: str, default: object = ...) -> Any:
    value = event.get(name, default)
    if value is ...:
        raise EventStreamError(f"{where}: missing field {name!r}")
    if value is not None and (not isinstance(value, kind) or isinstance(value, bool)):
        raise EventStreamError(f"{where}: field {name!r} has the wrong type: {shown(value)}")
    return value


def _token_ids(event: dict[Any, Any], where: str) -> tuple[int, ...]:
    tokens = _field(event, "token_ids", list, where)
    if tokens is None or not all(type(t) is int for t in tokens):
        raise EventStreamError(f"{where}: token_ids must be a list of integers")
    return tuple(tokens)


def _event(event: object, where: str) -> KVCacheEvent:
    if not isinstance(event, dict):
        raise EventStreamError(f"{where}: an event must be a tagged map, got {shown(event)}")
    tag = event.get("type")
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    if tag not in ("BlockStored", "BlockRemoved"):
        raise EventStreamError(f"{where}: unknown event type {shown(tag)}")
    hashes = tuple(_hash(h, where) for h in _field(event, "block_hashes", list, where) or ())
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
    block_size = _field(event, "block_size", int, where)
    if block_size is None:
        raise EventStreamError(f"{where}: block_size must be an integer, got None")
    return BlockStored(
        block_hashes=hashes,
        parent_block_hash=None if parent is None else _hash(parent, where),
        token_ids=_token_ids(event, where),
        block_size=block_size,
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
    bytes; an empty ``token_ids`` (a stream published with
    :attr:`EventContent.HASHES`) is read as any other. Raises
    :class:`EventStreamError`, and nothing else, on any other input.
    """
    return batch_of(decode_msgpack(payload, "event batch"))


def decode_msgpack(payload: object, what: str) -> object:
    """``payload`` decoded as msgpack into plain values; :class:`EventStreamError` naming ``what`` when it is not."""
    msgspec = import_extra("msgspec")
    if not isinstance(payload, bytes | bytearray | memoryview):
        raise EventStreamError(f"an {what} is bytes, got {type(payload).__name__}")
    try:
        return msgspec.msgpack.decode(payload)
    except msgspec.DecodeError as exc:
        raise EventStreamError(f"not a msgpack {what}: {exc}") from None
    except RecursionError:
        raise EventStreamError(f"not an {what}: its msgpack nests deeper than any batch does") from None


def batch_of(raw: object) -> EventBatch:
    """A decoded msgpack value (``[ts, events, data_parallel_rank]``) checked as an event batch, as kvpool's.

    Raises :class:`EventStreamError`, and nothing else, when it is not one.
    """
    if not isinstance(raw, list) or len(raw) not in (2, 3) or not isinstance(raw[1], list):
        raise EventStreamError(f"an event batch is an array [ts, events, data_parallel_rank], got {shown(raw)}")
    ts, events = raw[0], raw[1]
    rank = raw[2] if len(raw) == 3 else None
    if not isinstance(ts, int | float) or isinstance(ts, bool) or (rank is not None and type(rank) is not int):
        raise EventStreamError(f"bad batch header: ts={shown(ts)}, data_parallel_rank={shown(rank)}")
    return EventBatch(float(ts), tuple(_event(e, f"event {i}") for i, e in enumerate(events)), rank)
