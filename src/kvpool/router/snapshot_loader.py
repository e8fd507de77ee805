"""A replica's snapshot where its event stream lost history: what a feed's thread hands its loop instead.

A feed whose stream lost batches for good (:class:`LostBatches`), or that
starts while the replica's replay buffer no longer reaches back to batch 0,
cannot rebuild the replica's cache from events. A replica that advertises a
snapshot (``"snapshot"`` in its ``GET /kv-events``,
:mod:`kvpool.kv_events.snapshot`) tells what its pool caches after batch
``S``; :class:`SnapshotLoader` fetches it on the feed's thread and rewrites
what the subscriber received into what the loop applies, in order::

    LostBatches (entries cleared)  ->  LoadedSnapshot at S  ->  batches S+1, S+2, ...

* every batch at or below ``S`` is dropped, whether it arrived before the
  snapshot or while it was being fetched: the snapshot already holds it;
* a loss wholly at or below ``S`` is no loss (the snapshot covers it);
* when the first batch in hand is beyond ``S + 1``, batches ``S + 1 ..`` are
  replayed; when the replay buffer no longer holds them either, a newer
  snapshot is fetched, up to :data:`SNAPSHOT_TRIES` times in all.

A snapshot that cannot be fetched or does not decode is counted, logged with
what was wrong, and leaves the entries cleared: the feed then rebuilds from
the batches that follow, as a replica without a snapshot does (misses, never
claims). Nothing here touches the index; the loop applies what it is handed.
"""

from __future__ import annotations

import logging
import ssl
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvpool.errors import ExternalDataError

if TYPE_CHECKING:
    from kvpool.kv_events import KVEventSubscriber, Received, SequencedBatch
    from kvpool.kv_events.snapshot import PoolSnapshot

__all__ = ["MAX_SNAPSHOT_BYTES", "SNAPSHOT_TRIES", "LoadedSnapshot", "SnapshotLoader", "http_snapshot"]

log = logging.getLogger("kvpool.route")

#: Snapshots fetched for one loss before the feed settles for cleared entries.
SNAPSHOT_TRIES = 3
#: The largest snapshot body read (a million 32-byte hashes take about 35 MB).
MAX_SNAPSHOT_BYTES = 256 << 20


class SnapshotUnavailable(ExternalDataError):
    """The replica did not answer its snapshot (an HTTP error, a body past :data:`MAX_SNAPSHOT_BYTES`)."""


@dataclass(frozen=True, slots=True)
class LoadedSnapshot:
    """A snapshot for the loop to apply: the replica's entries cleared, then its events stored."""

    snapshot: PoolSnapshot


def http_snapshot(
    url: str, headers: dict[str, str], timeout: float, tls: ssl.SSLContext | None = None
) -> Callable[[], bytes]:
    """A blocking fetch of ``GET url`` (the feed's thread runs it): the body, at most :data:`MAX_SNAPSHOT_BYTES`.

    ``tls``: the certificates to verify an ``https`` replica against, made once per router and shared
    (None: httpx's defaults, loaded anew for each fetch, which costs tens of milliseconds of CPU).
    """

    def fetch() -> bytes:
        import httpx

        verify: ssl.SSLContext | bool = True if tls is None else tls
        with httpx.stream("GET", url, headers=headers, timeout=timeout, verify=verify) as response:
            if response.status_code != 200:
                raise SnapshotUnavailable(f"GET {url} answered {response.status_code}")
            body = bytearray()
            for chunk in response.iter_bytes():
                body += chunk
                if len(body) > MAX_SNAPSHOT_BYTES:
                    raise SnapshotUnavailable(f"GET {url}: a snapshot past {MAX_SNAPSHOT_BYTES} bytes")
            return bytes(body)

    return fetch


class SnapshotLoader:
    """On a feed's thread: what the subscriber received, with the replica's snapshot where history was lost.

    ``fetch`` returns the replica's snapshot body (blocking); None: the replica
    has none, and everything passes through as received. Figures are written
    here (the feed's thread) and read by the feed's :meth:`figures`.
    """

    def __init__(self, replica: str, fetch: Callable[[], bytes] | None) -> None:
        self.replica = replica
        self.fetch = fetch
        self.floor: int | None = None  # the seq of the snapshot in force: batches at or below it are in it
        self._expected: int | None = None  # the seq the first batch above the floor must have
        self.errors = 0  # snapshots that could not be fetched, decoded or joined to the stream
        self.last_error: str | None = None

    def start(
        self, subscriber: KVEventSubscriber, buffered: Sequence[SequencedBatch]
    ) -> list[Received | LoadedSnapshot]:
        """A feed's catch-up: ``buffered`` as is when it reaches back to batch 0, else after the snapshot."""
        self.floor = self._expected = None
        if self.fetch is None or (buffered and buffered[0].seq == 0):
            return list(buffered)
        return self._load(subscriber, buffered)

    def screen(self, subscriber: KVEventSubscriber, received: Sequence[Received]) -> list[Received | LoadedSnapshot]:
        """``received`` with what a snapshot covers dropped and a snapshot loaded after each loss it does not."""
        from kvpool.kv_events import LostBatches, PublisherRestarted, SequencedBatch

        out: list[Received | LoadedSnapshot] = []
        items = list(received)
        i = 0
        while i < len(items):
            item = items[i]
            i += 1
            if isinstance(item, PublisherRestarted):
                self.floor = self._expected = None  # a new publisher: its own sequence, its own cache
            elif isinstance(item, SequencedBatch) and self.floor is not None:
                if item.seq <= self.floor:
                    continue  # in the snapshot already
                if self._expected is not None and item.seq != self._expected:
                    item = LostBatches(self._expected, item.seq - 1)  # a hole between the snapshot and the stream
                    i -= 1  # the batch itself comes after the loss
                self._expected = None
            if isinstance(item, LostBatches):
                if self.floor is not None and item.last <= self.floor:
                    continue  # the snapshot holds what was lost
                out.append(item)  # the loop counts it and clears the replica's entries
                if self.fetch is not None:
                    j = i
                    while j < len(items) and isinstance(items[j], SequencedBatch):
                        j += 1
                    out.extend(self._load(subscriber, items[i:j]))  # type: ignore[arg-type]  # batches only
                    i = j
                continue
            out.append(item)
        return out

    def _load(
        self, subscriber: KVEventSubscriber, in_hand: Sequence[SequencedBatch]
    ) -> list[Received | LoadedSnapshot]:
        """The snapshot and the batches after it, in order; ``in_hand`` as is when no snapshot joins the stream."""
        from kvpool.kv_events.snapshot import decode_snapshot

        first = in_hand[0].seq if in_hand else None
        for _ in range(SNAPSHOT_TRIES):
            try:
                snapshot = decode_snapshot(self.fetch())  # type: ignore[misc]  # called only with a fetch
            except Exception as exc:  # noqa: BLE001 - whatever the replica answers, the feed goes on
                self._failed(f"{type(exc).__name__}: {exc}")
                return list(in_hand)
            bridge = self._bridge(subscriber, snapshot.seq + 1, first)
            if bridge is None:
                continue  # the batches after it are gone as well: a newer snapshot may meet the stream
            self.floor = snapshot.seq
            after = [batch for batch in in_hand if batch.seq > snapshot.seq]
            self._expected = None if bridge or after else snapshot.seq + 1
            return [LoadedSnapshot(snapshot), *bridge, *after]
        self._failed(f"{SNAPSHOT_TRIES} snapshots, none followed by batches the replay buffer still holds")
        return list(in_hand)

    @staticmethod
    def _bridge(subscriber: KVEventSubscriber, start: int, stop: int | None) -> list[SequencedBatch] | None:
        """Batches ``start .. stop - 1`` from the replay buffer (none needed: empty); None when it lacks any."""
        from kvpool.kv_events import EventStreamError

        if stop is None or stop <= start:
            return []
        try:
            got = [batch for batch in subscriber.replay(start) if batch.seq < stop]
        except EventStreamError:
            return None
        return got if [batch.seq for batch in got] == list(range(start, stop)) else None

    def _failed(self, error: str) -> None:
        self.floor = self._expected = None  # the entries are cleared: no snapshot is in force
        self.errors += 1
        self.last_error = error[:300]
        log.warning("%s: no snapshot loaded (%s): its index entries are rebuilt from new events", self.replica, error)
