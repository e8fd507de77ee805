"""Where a long study reports its progress: nowhere, or as plain lines for a log.

A study (:func:`kvpool.sim.study.run_study`) opens a bar per replay with
:meth:`Progress.bar` and advances it by counts; :meth:`Progress.note` is a line
about a finished replay. :class:`Progress` says nothing; :class:`ProgressLines`
writes a plain line now and then, for a stream that is not a terminal (a log
file, CI, a pipe), where a redrawn bar would be one unreadable line or nothing::

    replaying: 3,000 of 12,000 (25%), 41 s

and, with ``remaining`` (a sweep's lines), an estimate of the time left at the rate so far::

    sweep: 3 of 12 (25%), 41 s, about 123 s left

``kvpool simulate`` draws a bar on a terminal and writes these lines otherwise.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator
from typing import TextIO

from kvpool.checks import check_int
from kvpool.errors import ConfigError

__all__ = ["Progress", "ProgressLines"]


class Progress:
    """Where a study reports its progress; this one says nothing (override both methods to show it)."""

    @contextlib.contextmanager
    def bar(self, label: str, total: int) -> Iterator[Callable[[int], None]]:
        """A bar of ``total`` steps named ``label``; the callable advances it by a count."""
        yield lambda _n: None

    def note(self, text: str) -> None:
        """A line about a finished replay (the sizing search's tries)."""


class ProgressLines(Progress):
    """Progress as plain lines on ``stream``: one each time another share of a bar is done, and at its end.

    ``every_fraction``: a line each time this share of the bar's total is done (0.1: every 10%).
    ``every_items``: a line every this many steps instead. ``every_s``: a line also when this many
    seconds have passed since the last one (checked when the bar advances; None: never by time).
    ``clock`` gives the seconds the lines show (and ``every_s`` measures). ``remaining``: also the
    seconds left, estimated from the rate so far (until the bar is done).
    """

    def __init__(
        self,
        stream: TextIO,
        *,
        every_fraction: float = 0.1,
        every_items: int | None = None,
        every_s: float | None = 60.0,
        clock: Callable[[], float] = time.monotonic,
        remaining: bool = False,
    ) -> None:
        if (
            isinstance(every_fraction, bool)
            or not isinstance(every_fraction, int | float)
            or not 0 < every_fraction <= 1
        ):
            raise ConfigError(f"every_fraction must be a number in (0, 1], got {every_fraction!r}")
        if every_items is not None:
            check_int("every_items", every_items)
        if every_s is not None and (
            isinstance(every_s, bool) or not isinstance(every_s, int | float) or not 0 < every_s < math.inf
        ):
            raise ConfigError(f"every_s must be a finite number of seconds > 0 or None, got {every_s!r}")
        self._stream = stream
        self._every_fraction = float(every_fraction)
        self._every_items = every_items
        self._every_s = every_s
        self._clock = clock
        self._remaining = remaining

    @contextlib.contextmanager
    def bar(self, label: str, total: int) -> Iterator[Callable[[int], None]]:
        start = self._clock()
        step = self._every_items or max(1, math.ceil(total * self._every_fraction))
        done = 0
        next_mark = step
        last_line_at, last_line_done = start, 0

        def line(now: float) -> None:
            nonlocal last_line_at, last_line_done
            share = f" ({100 * done // total}%)" if total > 0 else ""
            left = ""
            if self._remaining and 0 < done < total:
                left = f", about {(now - start) / done * (total - done):.0f} s left"
            self._stream.write(f"{label}: {done:,} of {total:,}{share}, {now - start:.0f} s{left}\n")
            self._stream.flush()
            last_line_at, last_line_done = now, done

        def advance(n: int) -> None:
            nonlocal done, next_mark
            done += n
            due = done >= next_mark
            if due:
                next_mark = (done // step + 1) * step
            now = self._clock()
            if due or (self._every_s is not None and now - last_line_at >= self._every_s):
                line(now)

        yield advance
        if done != last_line_done:
            line(self._clock())  # where it ended, when no line said so yet

    def note(self, text: str) -> None:
        self._stream.write(text + "\n")
        self._stream.flush()
