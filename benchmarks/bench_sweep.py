"""Sweep throughput: configurations per hour, serial against a process pool against Ray on one node.

The same grid (``kvpool simulate TRACE --sweep``'s jobs, built by :class:`kvpool.sim.sweep.Sweep`)
runs on each executor ``--repeats`` times; each run writes its own results file, and the results of
every run are checked identical, bit for bit (the figures of each configuration, in grid order),
to the first serial run. Reported per executor: the median wall seconds of a run, configurations
per hour, and the speed-up over serial. Ray is started once (``ray.init(num_cpus=WORKERS)``, its
start timed apart) and its runs measure the tasks alone; the pool's runs include starting its
processes. The load average is read before and after, since a shared machine's other work shows
in the figures.

The grid (8 configurations by default): kv-blocks x policy x arrival-rate-scale over the first
``--requests`` requests of the trace, one replica each.

    PYTHONPATH=src python benchmarks/bench_sweep.py --trace /work/shared/traces/conversation_trace.jsonl \\
        --requests 250 --repeats 3 --workers 2
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from kvpool.sim.sweep import Sweep
from kvpool.sim.sweep_executors import PoolExecutor, RayExecutor, SerialExecutor, SweepExecutor
from kvpool.sim.sweep_results import SweepResults, read_results
from kvpool.sim.sweep_runner import run_sweep

GRID: dict[str, list[Any]] = {
    "kv-blocks": [4000, 16000],
    "policy": ["lru", "frequency"],
    "arrival-rate-scale": [1.0, 2.0],
}


def _cpu_seconds() -> float:
    """CPU seconds of this process and of its children that have ended (the pool's workers, once it shuts down)."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


def timed_run(
    sweep: Sweep, executor: SweepExecutor, folder: Path, name: str
) -> tuple[float, float, list[dict[str, Any]]]:
    """Wall and CPU seconds of one whole sweep on ``executor`` (Ray's workers' CPU is not seen), and its results."""
    out = folder / f"{name}.jsonl"
    start, cpu = time.perf_counter(), _cpu_seconds()
    run_sweep(sweep, executor, SweepResults(out))
    seconds, cpu = time.perf_counter() - start, _cpu_seconds() - cpu
    return seconds, cpu, [{"config": r["config"], "figures": r["figures"]} for r in read_results(out)]


def measure(sweep: Sweep, executors: dict[str, SweepExecutor], repeats: int, folder: Path) -> dict[str, list[float]]:
    """Each executor's run times, interleaved run by run; every run's results checked against the first."""
    times: dict[str, list[float]] = {name: [] for name in executors}
    reference: list[dict[str, Any]] | None = None
    for repeat in range(repeats):
        for name, executor in executors.items():
            seconds, cpu, results = timed_run(sweep, executor, folder, f"{name}-{repeat}")
            if reference is None:
                reference = results
            elif json.dumps(results, sort_keys=True) != json.dumps(reference, sort_keys=True):
                raise SystemExit(f"{name} run {repeat}: results differ from the first serial run")
            times[name].append(seconds)
            cpu_text = "" if name == "ray" else f", {cpu:.1f} CPU s"
            print(
                f"  {name:<8} run {repeat}: {seconds:.1f} s{cpu_text}  (load average {os.getloadavg()[0]:.2f})",
                flush=True,
            )
    return times


def report(times: dict[str, list[float]], configurations: int, workers: int) -> None:
    serial = statistics.median(times["serial"])
    print(f"{'executor':<10}{'median s':>10}{'configs/hour':>14}{'speed-up':>10}   runs")
    for name, runs in times.items():
        median = statistics.median(runs)
        runs_text = ", ".join(f"{t:.1f}" for t in runs)
        print(f"{name:<10}{median:>10.1f}{configurations * 3600 / median:>14.0f}{serial / median:>9.2f}x   {runs_text}")
    pool = statistics.median(times["pool"])
    efficiency = serial / pool / workers
    per_config = serial / configurations
    print(
        f"16-core estimate: {16 * efficiency * 3600 / per_config:.0f} configurations/hour "
        f"(16 workers at the {workers}-worker efficiency {efficiency:.2f}, {per_config:.1f} s a configuration)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", default="/work/shared/traces/conversation_trace.jsonl")
    parser.add_argument("--requests", type=int, default=250, help="the first N requests of the trace")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--no-ray", action="store_true", help="leave Ray out")
    args = parser.parse_args()
    sweep = Sweep.from_grid(GRID, {"trace": args.trace, "requests": args.requests}, source="bench_sweep")
    executors: dict[str, SweepExecutor] = {"serial": SerialExecutor(), "pool": PoolExecutor(args.workers)}
    print(f"{len(sweep.jobs)} configurations of {args.requests} requests of {args.trace}; {args.workers} workers")
    print(f"load average before: {', '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if not args.no_ray:
        import ray

        start = time.perf_counter()
        ray.init(num_cpus=args.workers, include_dashboard=False, log_to_driver=False)
        print(f"ray.init(num_cpus={args.workers}): {time.perf_counter() - start:.1f} s (not in the runs)")
        executors["ray"] = RayExecutor("auto")  # Ray is initialised: its runs use this node
    try:
        with tempfile.TemporaryDirectory() as folder:
            times = measure(sweep, executors, args.repeats, Path(folder))
    finally:
        if not args.no_ray:
            ray.shutdown()
    print(f"load average after: {', '.join(f'{x:.2f}' for x in os.getloadavg())}")
    report(times, len(sweep.jobs), args.workers)
    print("results: identical, bit for bit, across every run of every executor")


if __name__ == "__main__":
    main()
