"""The emulated replica's clock: where its steps' modelled time passes.

An emulated step computes nothing; it lasts the time its cost profile gives. The
engine asks a :class:`StepClock` the time and to wait until a step's end, so the
same engine runs at the modelled pace on a wall clock (:class:`WallClock`) or
instantly on a clock that only moves when it is told to (:class:`ManualClock`,
for tests and offline replays): a test then reads the modelled time of every
token and never waits for it.
"""

from __future__ import annotations

import threading
import time
from typing import Protocol

__all__ = ["ManualClock", "StepClock", "WallClock"]


class StepClock(Protocol):
    """Seconds on a monotonic clock, and a wait until a given time on it."""

    def now(self) -> float: ...

    def sleep_until(self, deadline: float) -> None: ...


class WallClock:
    """The process's monotonic clock; :meth:`sleep_until` sleeps the engine thread."""

    __slots__ = ()

    def now(self) -> float:
        return time.monotonic()

    def sleep_until(self, deadline: float) -> None:
        left = deadline - time.monotonic()
        if left > 0:
            time.sleep(left)


class ManualClock:
    """A clock that stands still until a wait moves it: :meth:`sleep_until` sets the time, at once.

    Thread-safe (the engine thread moves it; a test reads it from another).
    """

    __slots__ = ("_now", "_lock")

    def __init__(self, start: float = 0.0) -> None:
        self._now = float(start)
        self._lock = threading.Lock()

    def now(self) -> float:
        with self._lock:
            return self._now

    def sleep_until(self, deadline: float) -> None:
        with self._lock:
            self._now = max(self._now, deadline)
