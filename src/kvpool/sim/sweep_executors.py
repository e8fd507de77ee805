"""Where a sweep's jobs run: here one after another, in a local process pool, or as Ray tasks.

Each executor takes the jobs of a :class:`~kvpool.sim.sweep.Sweep` and yields each job with its
figures as it finishes (in any order). A job is a pure function of its own fields, so the figures
are the same whichever executor ran it and however many workers it had. The pool starts its workers
with ``spawn``, as Ray does, so nothing a job computes can lean on state inherited from this process.
Ray is the ``ray`` extra, imported only when a :class:`RayExecutor` runs.
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from typing import Any, Protocol

from kvpool.checks import check_int
from kvpool.errors import ConfigError
from kvpool.sim.sweep import SweepJob

__all__ = ["PoolExecutor", "RayExecutor", "SerialExecutor", "SweepExecutor", "default_workers", "executor_for"]

Finished = tuple[SweepJob, dict[str, Any]]


class SweepExecutor(Protocol):
    """Runs jobs; yields each with its figures as it finishes."""

    def run(self, jobs: Sequence[SweepJob]) -> Iterator[Finished]: ...


def default_workers() -> int:
    """The CPUs this process may use (the pool's default size)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _run_job(job: SweepJob) -> dict[str, Any]:
    return job.run()


class SerialExecutor:
    """Every job here, one after another, in grid order (``--workers 1``)."""

    def run(self, jobs: Sequence[SweepJob]) -> Iterator[Finished]:
        for job in jobs:
            yield job, job.run()


class PoolExecutor:
    """Jobs in a pool of ``workers`` local processes (started with ``spawn``); yielded as each finishes."""

    def __init__(self, workers: int) -> None:
        self.workers = check_int("--workers", workers)

    def run(self, jobs: Sequence[SweepJob]) -> Iterator[Finished]:
        if not jobs:
            return
        context = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(max_workers=min(self.workers, len(jobs)), mp_context=context) as pool:
            pending = {pool.submit(_run_job, job): job for job in jobs}
            try:
                while pending:
                    finished, _ = wait(pending, return_when=FIRST_COMPLETED)
                    for future in sorted(finished, key=lambda f: pending[f].index):
                        yield pending.pop(future), future.result()
            finally:
                for future in pending:
                    future.cancel()


class RayExecutor:
    """Jobs as Ray tasks (one CPU each) on the cluster at ``address``.

    ``address``: a cluster's address, ``auto`` (the cluster this machine belongs to), or ``local``
    (start a Ray on this machine with ``num_cpus``, shut down after). When Ray is already initialised
    in this process (a test's), its cluster is used and left running.
    """

    def __init__(self, address: str, *, num_cpus: int | None = None) -> None:
        if not isinstance(address, str) or not address.strip():
            raise ConfigError(f"--ray must be a cluster address, auto or local, got {address!r}")
        self.address = address.strip()
        self.num_cpus = None if num_cpus is None else check_int("--workers", num_cpus)

    def _start(self, ray: Any) -> bool:
        """Initialise Ray unless it is; whether this call started it (and so shuts it down)."""
        if ray.is_initialized():
            return False
        if self.address == "local":
            ray.init(num_cpus=self.num_cpus, include_dashboard=False, log_to_driver=False)
        else:
            ray.init(address=self.address, log_to_driver=False)
        return True

    def run(self, jobs: Sequence[SweepJob]) -> Iterator[Finished]:
        try:
            import ray
        except ImportError:
            raise ConfigError("--ray needs Ray: pip install 'kvpool[ray]'") from None
        started = self._start(ray)
        try:
            task = ray.remote(num_cpus=1)(_run_job)
            pending = {task.remote(job): job for job in jobs}
            while pending:
                finished, _ = ray.wait(list(pending), num_returns=1)
                for ref in finished:
                    yield pending.pop(ref), ray.get(ref)
        finally:
            if started:
                ray.shutdown()


def executor_for(*, workers: int | None, ray: str | None) -> SweepExecutor:
    """``--ray ADDRESS`` (with ``--workers`` its CPUs when it starts a local Ray), else ``--workers N``."""
    if ray is not None:
        return RayExecutor(ray, num_cpus=workers)
    count = default_workers() if workers is None else check_int("--workers", workers)
    return SerialExecutor() if count == 1 else PoolExecutor(count)
