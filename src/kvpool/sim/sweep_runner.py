"""Running a sweep: the jobs its results file does not hold yet, on an executor, each line kept as it finishes.

:func:`run_sweep` skips the jobs already in the results file (saying so in a progress note), runs the
rest on the executor, appends each job's line the moment it finishes and advances the progress bar
(``sweep: 3 of 12 (25%), 41 s, about 123 s left`` where stderr is not a terminal).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpool.sim.progress import Progress
from kvpool.sim.sweep import Sweep
from kvpool.sim.sweep_executors import SweepExecutor
from kvpool.sim.sweep_results import SweepResults

__all__ = ["SweepSummary", "run_sweep"]


@dataclass(frozen=True, slots=True, kw_only=True)
class SweepSummary:
    """What a run of a sweep did: configurations in the grid, run now, and skipped as already done."""

    total: int
    ran: int
    skipped: int


def run_sweep(
    sweep: Sweep, executor: SweepExecutor, results: SweepResults, progress: Progress | None = None
) -> SweepSummary:
    """Run ``sweep``'s jobs that ``results`` does not hold, appending each one's line as it finishes."""
    progress = progress or Progress()
    todo = [job for job in sweep.jobs if not results.done(job)]
    total, skipped = len(sweep.jobs), len(sweep.jobs) - len(todo)
    if skipped:
        progress.note(
            f"sweep: {skipped:,} of {total:,} configurations already in {results.path}, skipped; "
            f"running the other {len(todo):,}"
        )
    ran = 0
    try:
        with progress.bar("sweep", len(todo)) as advance:
            for job, figures in executor.run(todo):
                results.append(job, figures)
                ran += 1
                advance(1)
    finally:
        results.close()
    return SweepSummary(total=total, ran=ran, skipped=skipped)
