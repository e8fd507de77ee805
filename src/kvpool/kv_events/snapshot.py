"""A replica's whole prefix cache as one message, for a subscriber whose stream cannot be repaired.

The replay buffer holds the last ``buffer_steps`` batches only: a router that
missed more, or that starts after the replica has served for a while, cannot
rebuild the replica's cache from the stream. A snapshot says what the pool
holds at one point of the stream::

    msgpack [seq, [ts, events, data_parallel_rank]]

``seq`` is the sequence number of the last batch published before the
snapshot was taken (-1: none yet), and the inner array is an event batch in
:mod:`kvpool.kv_events.wire`'s format whose events are ``BlockStored`` only.
The pool's state is exactly "the snapshot, then batches ``seq + 1, ...``":
a subscriber applies the snapshot and drops every batch at or below ``seq``.

A snapshot's ``BlockStored`` events are sets, not chains: the pool does not
record which cached block follows which, so each event holds every hash one
group caches (``parent_block_hash`` null, in the order the pool cached them),
and carries no token IDs, LoRA name nor extra keys (what
:attr:`EventContent.HASHES` leaves out: a prefix router needs the hashes
only). The hashes are the replica's own bytes, as its events carry them.
It holds the pool's blocks (``MEDIUM_GPU``) only: blocks held only in KV tiers
below it are left out, so a subscriber misses them rather than claims them.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from kvpool.events import BlockStored, KVCacheEvent
from kvpool.kv_events.wire import Encoder, EventBatch, EventContent, EventStreamError, batch_of, decode_msgpack, shown

__all__ = ["SNAPSHOT_PATH", "PoolSnapshot", "decode_snapshot", "encode_snapshot"]

#: Where ``kvpool serve`` answers its snapshot (``GET``), next to ``GET /kv-events``.
SNAPSHOT_PATH = "/kv-events/snapshot"

_MAX_SEQ = 2**63 - 1


@dataclass(frozen=True, slots=True)
class PoolSnapshot:
    """What a replica's pool caches after batch ``seq`` (-1: before any batch) was published."""

    seq: int
    batch: EventBatch

    @property
    def num_blocks(self) -> int:
        """The hashes the snapshot claims, over all its events."""
        return sum(len(e.block_hashes) for e in self.batch.events if isinstance(e, BlockStored))


def encode_snapshot(
    events: Sequence[KVCacheEvent], seq: int, *, ts: float | None = None, data_parallel_rank: int | None = 0
) -> bytes:
    """The snapshot message of ``events`` (the pool's ``BlockStored``) taken after batch ``seq``.

    Token IDs, LoRA names and extra keys are left out whatever the events
    hold (:attr:`EventContent.HASHES`). Raises :class:`ValueError` for a
    ``seq`` that is not an integer from -1.
    """
    if type(seq) is not int or not -1 <= seq <= _MAX_SEQ:
        raise ValueError(f"seq must be an integer from -1 (no batch published yet), got {seq!r}")
    encoder = Encoder(EventContent.HASHES)
    return encoder.encode([seq, encoder.batch(events, time.time() if ts is None else ts, data_parallel_rank)])


def decode_snapshot(body: object) -> PoolSnapshot:
    """A snapshot message back as a :class:`PoolSnapshot`; :class:`EventStreamError` naming the bad value.

    Only ``BlockStored`` events are taken: a snapshot holding a removal or a
    clear is not a snapshot, and is refused whole.
    """
    raw = decode_msgpack(body, "event snapshot")
    if not isinstance(raw, list) or len(raw) != 2:
        raise EventStreamError(f"an event snapshot is an array [seq, batch], got {shown(raw)}")
    seq, inner = raw
    if type(seq) is not int or not -1 <= seq <= _MAX_SEQ:
        raise EventStreamError(f"an event snapshot's seq is an integer from -1, got {shown(seq)}")
    batch = batch_of(inner)
    for i, event in enumerate(batch.events):
        if not isinstance(event, BlockStored):
            raise EventStreamError(f"event {i} of an event snapshot is a {type(event).__name__}, not a BlockStored")
    return PoolSnapshot(seq, batch)
