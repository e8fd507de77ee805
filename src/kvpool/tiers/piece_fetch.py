"""One request's fetch from the disk and Redis tiers, read in pieces off the step: the drivers' one home.

A load from a byte tier runs on a load thread (:class:`~kvpool.tiers.transfer_threads.TransferThreads`)
while the step goes on; its request waits for it only as long as
:class:`~kvpool.tiers.load_or_compute.LoadWait` says: the compute the blocks still to come would
save. :class:`PieceFetch` is that fetch's state, shared by the thread that reads it and the
caller that waits for it, and the rule of what an ended fetch gives, whoever drives it (the
engine's :class:`~kvpool.engine.kv_transfer.KVTransferWorker`, the vLLM connector's
:class:`~kvpool.integrations.vllm.blocks.TierWorker`):

* the load thread calls :meth:`PieceFetch.run` with the driver's ``read`` (one store call for
  one piece, into memory the driver owns); the pieces are read in order, each timed, and after
  each whole piece :attr:`PieceFetch.landed` moves to its end. A piece with a block missing ends
  the fetch there: the request computes from its first missing block;
* the transfer threads ask :meth:`PieceFetch.deadline_s` each time they check the load (it grows
  as pieces land); past it the caller calls :meth:`PieceFetch.abandon`, which stops the thread
  before its next piece and answers what to use (:class:`Abandoned`: the leading blocks that
  landed, the miss to count and to tell the measurement, :class:`DeadlineMiss`);
* the piece being read when the request stopped waiting is owed by its tier
  (:meth:`~kvpool.tiers.load_or_compute.TransferCosts.owes`) until the thread is done with it:
  :meth:`PieceFetch.late_done` answers its real time then, once.

Torch-free and store-free: the driver's ``read`` moves the bytes; nothing here reads a store,
and nothing reads a clock but the one given (the transfer threads'), so tests move it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvpool.errors import ConfigError
from kvpool.tiers.load_or_compute import LoadWait, TransferCosts

__all__ = ["Abandoned", "DeadlineMiss", "PieceFetch", "tier_runs"]

#: A piece's timing: (tier, blocks, seconds its store call took).
Timing = tuple[str, int, float]


def tier_runs(tiers: Sequence[str]) -> tuple[tuple[str, int], ...]:
    """``(tier, blocks)`` of each run of consecutive blocks from one tier, in order (``tiers``: each block's)."""
    runs: list[tuple[str, int]] = []
    for tier in tiers:
        if runs and runs[-1][0] == tier:
            runs[-1] = (tier, runs[-1][1] + 1)
        else:
            runs.append((tier, 1))
    return tuple(runs)


@dataclass(frozen=True, slots=True)
class DeadlineMiss:
    """A fetch its request stopped waiting for: its piece of ``late_blocks`` from ``tier`` had not arrived
    after ``seconds``, and ``abandoned_blocks`` of that tier's blocks are computed instead; ``reading``:
    the piece was being read (the tier owes it), else it never started (it queued behind other loads)."""

    tier: str
    late_blocks: int
    abandoned_blocks: int
    seconds: float
    reading: bool

    def tell(self, costs: TransferCosts) -> None:
        """Into the measurement (:meth:`~kvpool.tiers.load_or_compute.TransferCosts.note_deadline_miss`)."""
        costs.note_deadline_miss(
            self.tier,
            late_blocks=self.late_blocks,
            abandoned_blocks=self.abandoned_blocks,
            seconds=self.seconds,
            reading=self.reading,
        )


@dataclass(frozen=True, slots=True)
class Abandoned:
    """What a fetch gives once its request stopped waiting (:meth:`PieceFetch.abandon`).

    ``kept``: its leading blocks that landed, to be used (the rest are computed); ``timings``: the
    pieces read by then, not yet told to the measurement; ``miss``: the deadline miss (None: the
    fetch failed rather than ran late, or everything landed just as its deadline passed);
    ``running``: its thread is still in a store call (:meth:`PieceFetch.late_done` answers it later).
    """

    kept: int
    timings: tuple[Timing, ...]
    miss: DeadlineMiss | None
    running: bool


class PieceFetch:
    """One fetch of ``tiers`` (each block's tier, in the order the request uses them), read in pieces.

    ``wait``: its pieces and deadlines (:meth:`~kvpool.tiers.load_or_compute.TransferCosts.load_wait`
    of this fetch's runs); None, or one whose pieces are not these blocks' runs, reads one piece
    per run and is waited for ``fixed_deadline_s``. ``clock``: the transfer threads' clock, which
    a late piece is timed by. Thread-safe: the load thread runs :meth:`run`; the caller the rest.
    """

    def __init__(
        self,
        tiers: Sequence[str],
        wait: LoadWait | None,
        *,
        fixed_deadline_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not tiers or not all(isinstance(t, str) for t in tiers):
            raise ConfigError(f"a fetch reads one or more blocks, each from a named tier, got {tiers!r}")
        self.tiers = tuple(tiers)
        runs = tier_runs(self.tiers)
        if wait is not None and not self._fits(wait, runs):
            wait = None  # made for other blocks (a stale or garbled plan): the fixed deadline, one piece a run
        self.wait = wait
        self.pieces: tuple[tuple[str, int], ...] = runs if wait is None else wait.pieces
        self.fixed_deadline_s = fixed_deadline_s
        self._clock = clock
        self._lock = threading.Lock()
        self.landed = 0  # leading blocks in, verified, never written again
        self._current: tuple[str, int, float] | None = None  # the piece being read: tier, blocks, began
        self._timings: list[Timing] = []
        self._told = 0
        self._started = self._abandoned = self._finished = False
        self._late_tier: str | None = None

    @staticmethod
    def _fits(wait: object, runs: tuple[tuple[str, int], ...]) -> bool:
        """Whether ``wait`` reads exactly ``runs``, in pieces (each piece within one run, in order)."""
        if not isinstance(wait, LoadWait):
            return False
        pieces = [(tier, n) for tier, n in wait.pieces if type(n) is int and n > 0]
        return len(pieces) == len(wait.pieces) and tier_runs([t for t, n in pieces for _ in range(n)]) == runs

    @property
    def num_blocks(self) -> int:
        return len(self.tiers)

    def deadline_s(self) -> float:
        """Seconds from submission its request waits now: the compute the blocks to come save (asked by the threads)."""
        if self.wait is None:
            return self.fixed_deadline_s
        return self.wait.deadline_s(self.landed)

    # -- the load thread -------------------------------------------------------------------------

    def run(self, read: Callable[[str, int, int], Sequence[bool]]) -> list[bool]:
        """On a load thread: ``read(tier, start, stop)`` each piece in order (whether each block arrived).

        Stops before the next piece once the fetch is abandoned, and after a piece with a block
        missing; answers whether each block arrived (False from the first one that did not).
        """
        arrived: list[bool] = []
        start = 0
        with self._lock:
            self._started = True
        try:
            for tier, blocks in self.pieces:
                stop = start + blocks
                with self._lock:
                    if self._abandoned:
                        break
                    self._current = (tier, blocks, self._clock())
                began = time.perf_counter()
                got = [bool(ok) for ok in read(tier, start, stop)][:blocks]
                got += [False] * (blocks - len(got))  # a short answer: the blocks it left out did not arrive
                seconds = time.perf_counter() - began
                whole = all(got)
                arrived.extend(got)
                with self._lock:
                    self._timings.append((tier, blocks, seconds))
                    self._current = None
                    if whole:
                        self.landed = stop
                if not whole:
                    break
                start = stop
        finally:
            with self._lock:
                self._finished = True
        kept = 0
        while kept < len(arrived) and arrived[kept]:
            kept += 1
        return [True] * kept + [False] * (self.num_blocks - kept)

    # -- the caller --------------------------------------------------------------------------------

    def take_timings(self) -> list[Timing]:
        """The pieces' timings not yet taken (for a fetch that ended: all of them), each once."""
        with self._lock:
            out, self._told = self._timings[self._told :], len(self._timings)
        return out

    def abandon(self, *, timed_out: bool) -> Abandoned:
        """Its request stops waiting (the fetch raised, or ran past :meth:`deadline_s` when ``timed_out``).

        The thread reads no piece after the one it is in; the leading blocks that landed are kept.
        """
        with self._lock:
            self._abandoned = True
            kept, current = self.landed, self._current
            timings = tuple(self._timings[self._told :])
            self._told = len(self._timings)
            running = self._started and not self._finished
        miss = None
        if timed_out and kept < self.num_blocks:
            miss = self._miss(kept, current)
            if miss.reading:
                self._late_tier = miss.tier
        return Abandoned(kept, timings, miss, running)

    def stop(self) -> None:
        """Its request went away: the thread reads no further piece, and nothing is counted."""
        with self._lock:
            self._abandoned = True

    def _miss(self, kept: int, current: tuple[str, int, float] | None) -> DeadlineMiss:
        rest = self.tiers[kept:]
        if current is not None:  # the piece being read had not arrived after this long
            tier, blocks, began = current
            seconds = max(0.0, self._clock() - began)
        else:  # it never started (queued behind other loads): none of its blocks came in the whole wait
            tier = rest[0]
            blocks = rest.count(tier)
            seconds = self.deadline_s() if self.wait is not None else self.fixed_deadline_s
        return DeadlineMiss(tier, blocks, rest.count(tier), seconds, current is not None)

    def late_done(self) -> tuple[bool, str | None, list[Timing]]:
        """For an abandoned fetch whose thread was running: ``(done, owed tier, timings)``.

        Until its thread is done, ``(False, None, [])``; then, once, True with the tier whose late
        piece has now been read (None if none was owed:
        :meth:`~kvpool.tiers.load_or_compute.TransferCosts.note_late_piece_done`) and the timings
        taken since (the late piece's real time among them).
        """
        with self._lock:
            if not self._finished:
                return False, None, []
            timings = self._timings[self._told :]
            self._told = len(self._timings)
        owed, self._late_tier = self._late_tier, None
        return True, owed, timings
