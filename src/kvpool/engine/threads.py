"""How many threads a CPU step uses: fixed, or following the cores other processes leave free.

A step on the CPU is a chain of small parallel regions (one per matrix product
and per elementwise kernel), each ending in a barrier where every thread waits
for the slowest. When another process holds one of the cores, the thread
placed there runs only part of the time and every barrier waits for it: with
two threads on two cores, one of them shared, a step takes several times as
long as with one thread on the free core. So the thread count should follow
the cores that are free, not the cores that exist.

:class:`ThreadGovernor` measures, between steps and at most once per
``interval_s``, how much CPU time the other processes took on the cores this
process may run on (``/proc/stat`` minus this process's own ``/proc/self/stat``),
and sets torch's thread count to the cores left (:func:`choose_threads`): a busy
machine then costs throughput in proportion to the cores it takes. Where
``/proc`` cannot be read (not Linux) the count stays at the most allowed.

``"auto"`` is the engine's default (:data:`DEFAULT_THREADS`). The engine starts
it with a ceiling of :func:`auto_ceiling`: never more threads than torch was set
to use when the engine started (``OMP_NUM_THREADS``, ``torch.set_num_threads``,
or torch's own default of the physical cores), nor than the cores this process
may run on; so on a quiet machine ``"auto"`` runs at the count torch's own
setting gives, and a count pinned before the engine starts stays pinned. A
fixed count (an int) is set once and kept: what a caller that needs one
reduction order throughout a run passes. ``None`` leaves torch's setting alone.
Torch's count is one per process: engines in one process share it, so an engine
started after another's governor lowered it starts from that lower ceiling.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvpool.checks import DEFAULT_THREADS, THREADS_AUTO, parse_threads
from kvpool.errors import ConfigError

__all__ = [
    "AUTO",
    "DEFAULT_THREADS",
    "CpuTimes",
    "ThreadGovernor",
    "auto_ceiling",
    "available_cores",
    "choose_threads",
    "parse_threads",
    "read_cpu_times",
]

#: ``threads="auto"``: follow the free cores (see the module docstring). The option's words, its
#: default and :func:`parse_threads` live in :mod:`kvpool.checks`, so the commands that only name
#: them (``kvpool route`` among them) import no engine.
AUTO = THREADS_AUTO


def available_cores() -> int:
    """Cores this process may run on (its affinity mask), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not Linux
        return max(1, os.cpu_count() or 1)


def auto_ceiling(torch_threads: int) -> int:
    """The most threads ``"auto"`` uses: torch's count at start (``torch_threads``), at most the cores allowed.

    Torch's count is what ``OMP_NUM_THREADS`` or ``torch.set_num_threads`` asked
    for, or torch's default (the physical cores, which leaves hyper-threads idle).
    """
    return max(1, min(available_cores(), torch_threads))


def choose_threads(cores: int, busy_elsewhere: float) -> int:
    """Threads for ``cores`` cores of which other processes keep ``busy_elsewhere`` (in cores) busy.

    The cores left, rounded to the nearest whole core, at least 1 and at most ``cores``.
    """
    return max(1, min(cores, int(cores - busy_elsewhere + 0.5)))


@dataclass(frozen=True, slots=True, kw_only=True)
class CpuTimes:
    """Cumulative CPU time in clock ticks: all work on the allowed cores, and this process's own."""

    busy: int
    total: int
    own: int


def read_cpu_times(cores: frozenset[int] | None = None) -> CpuTimes | None:
    """Current counters from ``/proc`` for the given CPUs (default: this process's affinity); None off Linux."""
    try:
        allowed = cores if cores is not None else frozenset(os.sched_getaffinity(0))
        busy = total = 0
        with open("/proc/stat") as stat:
            for line in stat:
                if not line.startswith("cpu") or line.startswith("cpu "):
                    continue
                name, *fields = line.split()
                if int(name[3:]) not in allowed:
                    continue
                ticks = [int(f) for f in fields[:8]]
                total += sum(ticks)
                busy += sum(ticks) - ticks[3] - ticks[4]  # all but idle and iowait
        with open("/proc/self/stat") as own_stat:
            # Fields after the command name (which may hold spaces); utime and stime are fields 14 and 15.
            rest = own_stat.read().rsplit(")", 1)[1].split()
        own = int(rest[11]) + int(rest[12])
    except (AttributeError, OSError, ValueError, IndexError):
        return None
    return CpuTimes(busy=busy, total=total, own=own)


class ThreadGovernor:
    """Sets the thread count before a step: fixed, or from the cores other processes leave free.

    Args:
        threads: a thread count, or ``"auto"``.
        set_threads: applies a count (``torch.set_num_threads``).
        cores: the most threads ``"auto"`` uses; default: :func:`available_cores`.
        interval_s: ``"auto"`` measures at most this often.
        read_times: the counter source (tests pass their own).
        clock: monotonic seconds.

    Attributes:
        threads: the count set last.
    """

    def __init__(
        self,
        threads: int | str,
        set_threads: Callable[[int], None],
        *,
        cores: int | None = None,
        interval_s: float = 0.5,
        read_times: Callable[[], CpuTimes | None] = read_cpu_times,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        parsed = parse_threads(threads)
        if parsed is None:
            raise ConfigError("ThreadGovernor needs a thread count or 'auto', got None")
        self._auto = parsed == AUTO
        self._cores = available_cores() if cores is None else cores
        self._set = set_threads
        self._interval = interval_s
        self._read = read_times
        self._clock = clock
        self.threads = self._cores if self._auto else int(parsed)
        self._set(self.threads)
        self._last = read_times() if self._auto else None
        self._last_at = clock()

    def before_step(self) -> int:
        """Adjust the count if it is time to; returns the count in force."""
        if not self._auto or self._clock() - self._last_at < self._interval:
            return self.threads
        now = self._read()
        last, self._last, self._last_at = self._last, now, self._clock()
        if now is None or last is None or now.total <= last.total:
            return self.threads
        per_core = (now.total - last.total) / self._cores
        elsewhere = max(0, (now.busy - last.busy) - (now.own - last.own)) / per_core
        wanted = choose_threads(self._cores, elsewhere)
        if wanted != self.threads:
            self.threads = wanted
            self._set(wanted)
        return self.threads
