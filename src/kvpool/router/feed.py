"""One replica's KV events, from its ZeroMQ stream into the block index.

The stream and its repair are :mod:`kvpool.kv_events`' :class:`KVEventSubscriber`
(vLLM's wire format; a skipped sequence number is fetched again from the replica's
replay socket). A feed adds what a router needs on top:

* it starts with everything the replica still buffers (``replay(0)``): the replica
  may have served for hours before this router started, and its cache with it;
* events are applied to the index on the router's event loop, the only place the
  index is touched; the subscriber's blocking socket work runs on a thread of its own;
* what cannot be repaired clears the replica's entries: batches gone from the replay
  buffer (:class:`LostBatches`) or a sequence that starts over
  (:class:`PublisherRestarted`, which also follows the catch-up when live batches
  published during it arrive after it). Cleared entries err towards misses, never
  towards claims, and the batches that follow rebuild them. A replica that
  advertises a snapshot (``GET /kv-events/snapshot``) is loaded from it instead,
  after such a loss and at a start whose replay buffer no longer reaches back to
  batch 0 (:mod:`kvpool.router.snapshot_loader`: the snapshot at ``S``, then only
  batches after ``S``);
* any other fault of the stream (a message that does not decode, a wrong number of
  frames, nesting too deep, a socket error) is counted in :attr:`EventFeed.errors` and
  logged in one line; the feed then clears the replica's entries (what was read with
  the bad message cannot be trusted), waits a little (doubling from
  :data:`RETRY_FIRST_S` to :data:`RETRY_MAX_S` while faults repeat) and subscribes
  again, catching up from the replay buffer. A feed stops only when told to.

A replica that goes away altogether is the health monitor's business: it marks the
replica down (its entries cleared, its feed stopped) and starts a new feed when the
replica answers again.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from kvpool.errors import ConfigError
from kvpool.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from kvpool.router.index import WHOLE, BlockIndex, Group
from kvpool.router.replicas import EventsInfo
from kvpool.router.snapshot_loader import LoadedSnapshot, SnapshotLoader

if TYPE_CHECKING:
    from kvpool.kv_events import KVEventSubscriber, Received

__all__ = ["EventFeed", "apply_events"]

log = logging.getLogger("kvpool.route")

#: Seconds a feed's thread waits for a message before it checks whether it should stop.
POLL_S = 0.2
#: Seconds before subscribing again after a fault; doubled while faults repeat, up to RETRY_MAX_S.
RETRY_FIRST_S = 0.1
RETRY_MAX_S = 5.0


#: Layer kinds whose group needs only the last block of a prefix (the state at its end).
_LAST_BLOCK_KINDS = frozenset({"mamba", "mamba2", "linear_attention", "short_conv", "gdn_attention"})


def group_of(event: BlockStored, known: dict[int, Group]) -> Group:
    """The index's :class:`Group` for a stored batch: its group id and what of a prefix that group needs.

    A sliding-window group needs the blocks its window covers (``ceil(window / block_size)``),
    a Mamba-like group the last block, any other (full attention, MLA, a kind this router
    does not know) every block: an unknown kind errs towards misses. ``known`` remembers
    each group's need from its ``BlockStored`` for the ``BlockRemoved`` that only name the id.
    """
    kind = event.spec_kind
    if kind == "sliding_window" and event.sliding_window:
        tail: int | None = max(1, -(-event.sliding_window // event.block_size))
    elif kind in _LAST_BLOCK_KINDS:
        tail = 1
    else:
        tail = None
    group = WHOLE if event.group_id == 0 and tail is None else Group(event.group_id, tail)
    known[event.group_id] = group
    return group


def apply_events(
    index: BlockIndex, replica: str, events: Sequence[KVCacheEvent], groups: dict[int, Group] | None = None
) -> int:
    """Apply one batch of a replica's events to its entries in ``index``, in order; returns the blocks stored.

    ``groups``: what the replica's groups need, learnt from earlier batches (updated here).
    """
    known = {} if groups is None else groups
    stored = 0
    for event in events:
        if isinstance(event, BlockStored):
            index.store(replica, event.block_hashes, event.medium, group_of(event, known))
            stored += len(event.block_hashes)
        elif isinstance(event, BlockRemoved):
            index.remove(replica, event.block_hashes, event.medium, known.get(event.group_id, Group(event.group_id)))
        elif isinstance(event, AllBlocksCleared):
            index.clear(replica)
    return stored


class EventFeed:
    """Follows one replica's events until :meth:`stop`; its figures say how the stream went.

    ``snapshot``: fetches the replica's snapshot body (blocking, on the feed's
    thread; :func:`~kvpool.router.snapshot_loader.http_snapshot`); None: the
    replica has none, and a lost stream leaves its entries cleared.
    """

    def __init__(
        self, replica: str, info: EventsInfo, index: BlockIndex, *, snapshot: Callable[[], bytes] | None = None
    ) -> None:
        self.replica = replica
        self.info = info
        self.index = index
        self.batches = 0  # batches applied
        self.stored = 0  # blocks the replica said it stored (BlockStored), over all batches applied
        self.gaps = 0  # breaks in the sequence that could not be replayed (LostBatches)
        self.lost = 0  # batches lost in those gaps
        self.restarts = 0  # times the replica's sequence started over (a new publisher)
        self.lag = 0.0  # seconds between the newest applied batch's timestamp and its application
        self.last_applied: float | None = None  # time.time() of the last batch applied
        self._groups: dict[int, Group] = {}
        self.resets = 0  # times the replica's entries were cleared for a stream fault
        self.snapshots = 0  # snapshots loaded (after a loss the replay buffer could not cover)
        self.snapshot_blocks = 0  # blocks the last snapshot loaded claimed
        self._loader = SnapshotLoader(replica, snapshot)
        self.errors = 0  # faults of the stream itself (bad messages, socket errors); each one starts it over
        self.last_error: str | None = None
        self.on_applied: Callable[[], None] | None = None  # tests wait on it
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Subscribe on a thread of its own; what arrives is applied on ``loop``."""
        self._loop = loop
        self._thread = threading.Thread(target=self._follow, name=f"kv-events {self.replica}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop applying at once; the thread closes its sockets within :data:`POLL_S`."""
        self._stopping.set()

    @property
    def alive(self) -> bool:
        """Whether the feed's thread still runs (it ends only after :meth:`stop`)."""
        return self._thread is not None and self._thread.is_alive()

    @property
    def snapshot_errors(self) -> int:
        """Snapshots that could not be fetched, decoded or joined to the stream (the entries stayed cleared)."""
        return self._loader.errors

    def figures(self) -> dict[str, object]:
        """The stream's figures, as the router's verbose health shows them."""
        return {
            "batches": self.batches,
            "stored": self.stored,
            "resets": self.resets,
            "gaps": self.gaps,
            "lost": self.lost,
            "restarts": self.restarts,
            "lag_s": round(self.lag, 4),
            "errors": self.errors,
            "last_error": self.last_error,
            "snapshots": self.snapshots,
            "snapshot_blocks": self.snapshot_blocks,
            "snapshot_errors": self.snapshot_errors,
            "last_snapshot_error": self._loader.last_error,
        }

    def _follow(self) -> None:
        """The thread: follow the stream; after a fault, clear the replica's entries and start over."""
        delay = RETRY_FIRST_S
        while not self._stopping.is_set():
            started = time.monotonic()
            try:
                subscriber = self._subscribe()
            except ConfigError as exc:  # the advertised endpoint is wrong, and will stay so
                self._fault(exc, "cannot follow its KV events")
                return
            except Exception as exc:  # noqa: BLE001 - a socket that cannot open now may open later
                self._fault(exc, "cannot subscribe to its KV events")
            else:
                try:
                    self._follow_with(subscriber)
                    return  # stopped
                except Exception as exc:  # noqa: BLE001 - whatever the stream sends, the feed goes on
                    self._fault(exc, "KV event stream fault")
                finally:
                    subscriber.close()
            if time.monotonic() - started > 2 * RETRY_MAX_S:
                delay = RETRY_FIRST_S  # it ran well for a while: this fault is not a repeat
            if self._stopping.wait(delay):
                return
            delay = min(2 * delay, RETRY_MAX_S)

    def _fault(self, exc: Exception, what: str) -> None:
        """Count and log a fault, and have the replica's entries cleared (on the loop, in order)."""
        self.errors += 1
        self.last_error = f"{type(exc).__name__}: {exc}"[:300]
        log.warning(
            "%s: %s (fault %d), its index entries are rebuilt: %s", self.replica, what, self.errors, self.last_error
        )
        if self._loop is not None and not self._stopping.is_set():
            self._loop.call_soon_threadsafe(self._clear)

    def _clear(self) -> None:
        if not self._stopping.is_set():
            self.index.clear(self.replica)

    def _subscribe(self) -> KVEventSubscriber:
        from kvpool.kv_events import KVEventSubscriber

        return KVEventSubscriber(self.info.endpoint, replay_endpoint=self.info.replay_endpoint, curve=self.info.curve)

    def _follow_with(self, subscriber: KVEventSubscriber) -> None:
        """Catch up from the replay buffer, then apply what arrives until stopped; any fault propagates."""
        from kvpool.kv_events import EventStreamError, SequencedBatch

        try:
            buffered: list[SequencedBatch] = subscriber.replay(0)
        except EventStreamError as exc:
            log.warning("%s: no catch-up from the replay buffer: %s", self.replica, exc)
            buffered = []
        if buffered:
            subscriber.last_seq = buffered[-1].seq
        caught_up = self._loader.start(subscriber, buffered)
        if caught_up:
            self._hand_over(caught_up)
        while not self._stopping.is_set():
            received = subscriber.receive(POLL_S)
            if received:
                self._hand_over(self._loader.screen(subscriber, received))

    def _hand_over(self, received: Sequence[Received | LoadedSnapshot]) -> None:
        if self._loop is not None and not self._stopping.is_set():
            self._loop.call_soon_threadsafe(self._apply, received)

    def _apply(self, received: Sequence[Received | LoadedSnapshot]) -> None:
        """On the event loop: apply batches; clear the replica's entries where the stream broke."""
        from kvpool.kv_events import LostBatches, PublisherRestarted

        if self._stopping.is_set():
            return  # the replica went down after these were read: its entries stay cleared
        for item in received:
            if isinstance(item, LostBatches | PublisherRestarted):
                self.resets += 1
                if isinstance(item, LostBatches):
                    self.gaps += 1
                    self.lost += item.last - item.first + 1
                else:
                    self.restarts += 1
                log.info("%s: KV event stream broke (%s): its index entries are rebuilt", self.replica, item)
                self.index.clear(self.replica)
            elif isinstance(item, LoadedSnapshot):
                self.index.clear(self.replica)  # what the snapshot says, and nothing from before it
                self.snapshot_blocks = apply_events(self.index, self.replica, item.snapshot.batch.events, self._groups)
                self.snapshots += 1
                log.info(
                    "%s: snapshot after batch %d loaded: %d blocks",
                    self.replica,
                    item.snapshot.seq,
                    self.snapshot_blocks,
                )
            else:
                self.stored += apply_events(self.index, self.replica, item.batch.events, self._groups)
                self.batches += 1
                now = time.time()
                self.last_applied = now
                if not item.replayed:  # a replayed batch is old by design: its age is not lag
                    self.lag = max(0.0, now - item.batch.ts)
        if self.on_applied is not None:
            self.on_applied()
