"""Tier transfers off the step: loads on a pool of threads with a deadline each, saves in a bounded queue.

The engine's step (and, inside vLLM, its scheduler and worker) must never wait on
a disk or a Redis server. :class:`TransferThreads` runs the slow half of every
transfer, the store's ``get_many`` or ``put_many``, away from the caller:

* **Loads** run on a small pool of threads. The caller submits a callable and
  gets a ticket; :meth:`TransferThreads.finished_loads` (never blocking) hands
  back each ticket once, when its callable returned, raised, or ran past the
  load deadline. A load past its deadline is reported ``timed_out`` at once and
  its late result, if one ever comes, is dropped: the request it served
  computes instead, and only that request waited. A tier that stalls for good
  ties up at most the pool's threads; later loads time out behind them. A load
  may bring its own, shorter deadline (``submit_load(fetch, deadline=...)``): a
  callable asked, on the caller's thread, each time the load is checked, so it
  may move as the load makes progress (the engine's: bounded by the compute the
  arrived blocks save, :class:`kvpool.tiers.load_or_compute.LoadWait`).
* **Saves** go to one thread in submission order, through a queue of bounded
  length. A save that finds the queue full is dropped and counted
  (:attr:`TransferFigures.saves_dropped`): a slow tier then loses blocks it
  would have kept, and no step ever waits for it.

The callables are the caller's: a load fetches bytes into memory the caller
owns and is copied into the KV cache by the caller, on its own thread, only if
the ticket came back in time. Nothing here knows what a block is.
"""

from __future__ import annotations

import dataclasses
import math
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from kvpool.checks import check_int
from kvpool.errors import ConfigError

__all__ = ["DEFAULT_LOAD_DEADLINE_S", "LoadOutcome", "TransferFigures", "TransferThreads", "check_load_deadline"]

#: How long a load may take before its request computes instead (seconds).
DEFAULT_LOAD_DEADLINE_S = 2.0


def check_load_deadline(value: object, name: str = "load_deadline_s") -> float:
    """``value`` as seconds when it is a finite number > 0 (not a bool); ConfigError naming ``name`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < math.inf:
        raise ConfigError(f"{name} must be a finite number of seconds > 0, got {value!r}")
    return float(value)


@dataclass(frozen=True, slots=True)
class LoadOutcome:
    """How one submitted load ended: its value, or the error it raised, or ``timed_out``."""

    ticket: int
    value: object = None
    error: BaseException | None = None
    timed_out: bool = False
    #: From submission to completion (to the deadline, for a load that timed out).
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.error is None and not self.timed_out


@dataclass(slots=True)
class TransferFigures:
    """Counts since start: what ran off the step and how it ended."""

    loads_submitted: int = 0
    loads_failed: int = 0
    loads_timed_out: int = 0
    saves_submitted: int = 0
    saves_done: int = 0
    saves_failed: int = 0
    saves_dropped: int = 0

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


_STOP = object()


class TransferThreads:
    """A pool of load threads and one save thread for one connector (see the module docstring).

    Args:
        name: names the threads (``kvpool-<name>-load``, ``kvpool-<name>-save``).
        load_threads: loads that may be in flight at once.
        max_queued_saves: saves that may wait for the save thread; one more is dropped.
        load_deadline_s: seconds from submission after which a load is reported timed out.
        clock: the time source of the deadlines.
    """

    def __init__(
        self,
        name: str,
        *,
        load_threads: int = 2,
        max_queued_saves: int = 64,
        load_deadline_s: float = DEFAULT_LOAD_DEADLINE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not isinstance(name, str) or not name:
            raise ConfigError(f"a transfer thread's name is a non-empty string, got {name!r}")
        check_int("load_threads", load_threads)
        check_int("max_queued_saves", max_queued_saves)
        deadline = check_load_deadline(load_deadline_s)
        if not callable(clock):
            raise ConfigError(f"clock must be callable, got {clock!r}")
        self.name = name
        self.load_deadline_s = deadline
        self.figures = TransferFigures()
        self._clock = clock
        self._loads = ThreadPoolExecutor(max_workers=load_threads, thread_name_prefix=f"kvpool-{name}-load")
        self._pending: dict[int, tuple[Future[object], float, Callable[[], float] | None]] = {}
        self._next_ticket = 0
        self._load_done = threading.Condition()
        self._saves: queue.Queue[object] = queue.Queue(maxsize=max_queued_saves)
        self._idle = threading.Condition()
        self._unfinished_saves = 0
        self._closed = False
        self._saver = threading.Thread(target=self._save_loop, name=f"kvpool-{name}-save", daemon=True)
        self._saver.start()

    # -- loads -----------------------------------------------------------------------

    def submit_load(self, fetch: Callable[[], object], *, deadline: Callable[[], float] | None = None) -> int:
        """Run ``fetch`` on a load thread; returns the ticket :meth:`finished_loads` reports it by.

        ``deadline``: the seconds from submission this load may take, asked each time it is
        checked (it may grow as the load progresses); the threads' own deadline bounds it.
        """
        if not callable(fetch):
            raise ConfigError(f"a load is a callable, got {fetch!r}")
        if deadline is not None and not callable(deadline):
            raise ConfigError(f"a load's deadline is a callable answering seconds, got {deadline!r}")
        if self._closed:
            raise ConfigError(f"transfer threads {self.name!r} are closed")
        ticket = self._next_ticket
        self._next_ticket += 1
        future = self._loads.submit(fetch)
        self._pending[ticket] = (future, self._clock(), deadline)
        self.figures.loads_submitted += 1
        future.add_done_callback(self._wake)
        return ticket

    def _wake(self, _future: Future[object]) -> None:
        with self._load_done:
            self._load_done.notify_all()

    @property
    def clock(self) -> Callable[[], float]:
        """The time source of the deadlines (what a caller measures its own waits by)."""
        return self._clock

    @property
    def loads_in_flight(self) -> int:
        """Loads submitted and not yet handed back by :meth:`finished_loads`."""
        return len(self._pending)

    def _deadline(self, deadline: Callable[[], float] | None) -> float:
        """A load's deadline now, in seconds from its submission: its own, within the threads' one."""
        if deadline is None:
            return self.load_deadline_s
        return min(self.load_deadline_s, max(0.0, float(deadline())))

    def finished_loads(self) -> list[LoadOutcome]:
        """The loads that ended, or ran past their deadline, since the last call; each ticket once. Never blocks."""
        if not self._pending:
            return []
        now = self._clock()
        out: list[LoadOutcome] = []
        for ticket, (future, started, deadline) in list(self._pending.items()):
            if future.done():
                error = future.exception()
                value = None if error is not None else future.result()
                if error is not None:
                    self.figures.loads_failed += 1
                out.append(LoadOutcome(ticket, value, error, False, now - started))
            elif now - started >= (limit := self._deadline(deadline)):
                future.cancel()  # not started yet: never runs; running: its result is dropped
                self.figures.loads_timed_out += 1
                out.append(LoadOutcome(ticket, None, None, True, limit))
            else:
                continue
            del self._pending[ticket]
        return out

    def wait_for_loads(self, timeout: float | None = None) -> bool:
        """Block until a pending load has ended or reached its deadline (at most ``timeout`` s); True if one did.

        A deadline that moved later meanwhile (its load progressed) may leave :meth:`finished_loads` with
        nothing yet: the caller asks again.
        """
        if not self._pending:
            return False
        now = self._clock()
        first_deadline = min(started + self._deadline(deadline) for _, started, deadline in self._pending.values())
        wait = max(0.0, first_deadline - now)
        if timeout is not None:
            wait = min(wait, timeout)
        with self._load_done:
            if not any(future.done() for future, _, _ in self._pending.values()):
                self._load_done.wait(wait)
        return any(future.done() for future, _, _ in self._pending.values()) or self._clock() >= first_deadline

    # -- saves -----------------------------------------------------------------------

    def submit_save(self, store: Callable[[], object]) -> bool:
        """Queue ``store`` for the save thread; False (counted as dropped) when the queue is full."""
        if not callable(store):
            raise ConfigError(f"a save is a callable, got {store!r}")
        if self._closed:
            raise ConfigError(f"transfer threads {self.name!r} are closed")
        with self._idle:
            try:
                self._saves.put_nowait(store)
            except queue.Full:
                self.figures.saves_dropped += 1
                return False
            self._unfinished_saves += 1
        self.figures.saves_submitted += 1
        return True

    def _save_loop(self) -> None:
        while True:
            job = self._saves.get()
            if job is _STOP:
                return
            try:
                job()  # type: ignore[operator]  # only callables are queued besides _STOP
            except Exception:  # a failed save loses its blocks, never the thread
                self.figures.saves_failed += 1
            else:
                self.figures.saves_done += 1
            with self._idle:
                self._unfinished_saves -= 1
                self._idle.notify_all()

    def drain_saves(self, timeout: float | None = None) -> bool:
        """Block until every queued save has run (at most ``timeout`` s); True if none is left."""
        with self._idle:
            return self._idle.wait_for(lambda: self._unfinished_saves == 0, timeout)

    # -- end ---------------------------------------------------------------------------

    def close(self, *, drain_timeout: float | None = 5.0) -> None:
        """Run what is queued (up to ``drain_timeout`` s), then stop the threads; pending loads are dropped."""
        if self._closed:
            return
        self._closed = True
        self.drain_saves(drain_timeout)
        try:
            self._saves.put(_STOP, timeout=drain_timeout)
        except queue.Full:  # the save thread is stuck in a store: it is a daemon, left behind
            pass
        else:
            self._saver.join(drain_timeout)  # gone before the caller's process may exit
        for future, _, _ in self._pending.values():
            future.cancel()
        self._pending.clear()
        self._loads.shutdown(wait=False, cancel_futures=True)
