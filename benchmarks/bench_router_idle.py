"""The router's idle CPU in front of an emulated fleet: its health checks and event feeds, before any request.

One emulated fleet (``kvpool serve --emulate PROFILE --replicas N``) is started; then, in turn, the router of
each revision named (``--before``, a git revision, read with ``git archive`` into a temporary folder; and this
checkout, "after") is started in front of it ``--runs`` times. Each run waits until every replica is up and
its event feed followed (``/health`` says ``prefix_mode: precise``), lets it settle, and reads the router
process's user + system CPU (``/proc/<pid>/stat``) over ``--seconds``. Printed: each revision's median CPU,
as a fraction of one core, and per replica.

    python benchmarks/bench_router_idle.py --replicas 32 --before 61b64d5

Session 36, 2 shared cores: before (61b64d5, every check through httpx) 0.171 of a core, 5.34 ms a second
per replica; after (checks skipped after a sign of life, the rest on a kept raw connection) 0.017, 0.53 ms.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_fleet  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def progress(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (its threads included) from ``/proc/<pid>/stat``."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def source_of(revision: str, tmp: Path) -> Path:
    """``src/`` of a git revision, extracted into ``tmp`` (the checkout itself is left alone)."""
    folder = tmp / f"src-{revision}"
    folder.mkdir()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", revision, "src"], check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", str(folder)], input=archive.stdout, check=True)
    return folder / "src"


def one_run(urls: list[str], src: Path | None, args: argparse.Namespace, tmp: Path, tag: str) -> float:
    """The router's CPU, in cores, over ``args.seconds`` once every replica is up and followed."""
    log = tmp / f"router-{tag}.log"
    cmd = ["route", "--port", "0", "--routing", "precise", "--model", bench_fleet.MODEL]
    cmd += ["--tenant-secret-file", str(tmp / "secret"), *[a for u in urls for a in ("--replica", u)]]
    env = dict(os.environ)
    if src is not None:
        env["PYTHONPATH"] = f"{src}{os.pathsep}{env['PYTHONPATH']}" if env.get("PYTHONPATH") else str(src)
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-c", "import kvpool, sys; print('kvpool from', kvpool.__file__, flush=True); "
             "from kvpool.cli import main; main()", *cmd],
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env,
        )  # fmt: skip
    try:
        (url,) = bench_fleet._wait_for_lines(proc, log, r"routing on (http://[0-9.:]+)", 1, timeout=300)
        bench_fleet._wait_http(
            f"{url}/health",
            lambda body: '"prefix_mode":"precise"' in body.replace(" ", "") and f'"replicas_up":{len(urls)}' in body,
            tag,
        )
        time.sleep(args.settle)  # the bring-up's work (feeds subscribing, replays) is not idle CPU
        start = cpu_seconds(proc.pid)
        time.sleep(args.seconds)
        cores = (cpu_seconds(proc.pid) - start) / float(args.seconds)
        where = log.read_text(errors="replace").splitlines()[0]
        progress(f"{tag}: {cores:.4f} of a core ({where})")
        return cores
    finally:
        bench_fleet._stop(proc)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", type=int, default=32)
    parser.add_argument("--profile", default="llama-3.1-8b-h100")
    parser.add_argument("--before", default="61b64d5", help="git revision of the 'before' router (empty: none)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=30.0, help="CPU is read over this long")
    parser.add_argument("--settle", type=float, default=3.0, help="seconds after every replica is up")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-router-idle-"))
    (tmp / "secret").write_text(os.urandom(32).hex() + "\n")
    fleet_args = argparse.Namespace(
        profile=args.profile, replicas=args.replicas, kv_cache_memory="8GiB", max_model_len=131072, time_scale=1.0
    )
    progress(f"starting {args.replicas} emulated replicas ({args.profile}); logs in {tmp}")
    fleet = bench_fleet.start_fleet(fleet_args, tmp, "idle")
    results: dict[str, list[float]] = {}
    try:
        sources: list[tuple[str, Path | None]] = [("after", None)]
        if args.before:
            sources.insert(0, (f"before ({args.before})", source_of(args.before, tmp)))
        for name, src in sources:
            results[name] = [one_run(fleet.urls, src, args, tmp, f"{name} run {i + 1}") for i in range(args.runs)]
    finally:
        fleet.stop()
    print(f"router idle CPU in front of {args.replicas} emulated replicas ({args.profile}), over {args.seconds:g} s:")
    for name, runs in results.items():
        median = statistics.median(runs)
        each = ", ".join(f"{r:.4f}" for r in runs)
        print(
            f"  {name:24s} median {median:.4f} of a core, {1000 * median / args.replicas:.2f} ms a second per "
            f"replica (runs: {each})"
        )


if __name__ == "__main__":
    main()
