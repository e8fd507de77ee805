"""Per-request cost of kvpool's manager against the number of cached blocks (10^3 .. 10^7).

For each size N: a pool of N + 1 blocks (block 0 is the null block) is
filled with N cached free blocks, then a fixed batch of requests runs one at
a time. The cost of a request must depend on the blocks it touches, never on
the pool size or on how many blocks are cached.

Filling: requests of up to 65,536 blocks with distinct tokens, each allocated
in one ``allocate_slots`` call (which hashes and caches every block) and
freed; after that every block of the pool is free and cached, and every
later allocation evicts a cached block. Only the public API is used, so the
fill costs what caching N blocks costs (about 2 s per million blocks here).

The batch: ``--batch`` requests of 128 blocks (2,048 tokens): the first 64
blocks are the first 64 blocks of the last fill request (a prefix hit out of
the full cache), the other 64 are new and evict 64 cached blocks. Per
request: ``hash_request``, ``get_computed_blocks`` (64 hits),
``allocate_slots`` (64 new blocks, 64 evictions, 64 blocks cached), ``free``.
The batch runs ``--repeats`` times with new tokens; the table gives medians
per request. Memory is the process's peak resident set so far (sizes run in
increasing order, so the last column grows with the largest pool built yet).

On a shared machine the load drifts over the minutes the large sizes take,
so right after each size the same batch also runs on a fresh pool of 1,000
cached blocks (the control); the "x control" column is the size's total over
the control's, measured under the same load.

Run::

    python benchmarks/bench_scaling.py                      # 10^3 .. 10^7 cached blocks
    python benchmarks/bench_scaling.py --max-exp 6 --plot scaling.png
"""

from __future__ import annotations

import argparse
import gc
import resource
import statistics
import sys
import time
from array import array
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from kvpool import KVCacheManager, Request  # noqa: E402

BLOCK_SIZE = 16
FILL_CHUNK_BLOCKS = 65_536
REQUEST_BLOCKS = 128
HIT_BLOCKS = 64
PHASES = ("hash", "lookup", "allocate", "free")
CONTROL_BLOCKS = 1_000


def fill(mgr: KVCacheManager, num_blocks: int, token_base: int = 0) -> tuple[float, array]:
    """Cache ``num_blocks`` distinct blocks and free them all; seconds taken, and the last fill prompt."""
    start = time.perf_counter()
    done = i = 0
    tokens = array("I")
    while done < num_blocks:
        count = min(FILL_CHUNK_BLOCKS, num_blocks - done)
        first = token_base + done * BLOCK_SIZE
        tokens = array("I", range(first, first + count * BLOCK_SIZE))
        request = Request(f"fill{i}", tokens)
        if mgr.allocate_slots(request, len(tokens)) is None:
            raise RuntimeError(f"the fill request of {count} blocks did not fit")
        request.num_computed_tokens = len(tokens)
        mgr.free(request)
        done += count
        i += 1
    return time.perf_counter() - start, tokens


def run_batch(mgr: KVCacheManager, hot: array, num_requests: int, token_base: int) -> dict[str, list[int]]:
    """Nanoseconds per phase, one entry per request; checks every request hit the hot prefix."""
    clock = time.perf_counter_ns
    ns: dict[str, list[int]] = {k: [] for k in PHASES}
    new_tokens = (REQUEST_BLOCKS - HIT_BLOCKS) * BLOCK_SIZE
    for i in range(num_requests):
        base = token_base + i * new_tokens
        request = Request(f"b{token_base}-{i}", hot + array("I", range(base, base + new_tokens)))
        t0 = clock()
        mgr.hash_request(request)
        t1 = clock()
        hit, num_hit = mgr.get_computed_blocks(request)
        t2 = clock()
        new = mgr.allocate_slots(request, request.num_tokens - num_hit, num_hit, hit)
        t3 = clock()
        if new is None:
            raise RuntimeError("a batch request did not fit")
        request.num_computed_tokens = request.num_tokens
        t4 = clock()
        mgr.free(request)
        t5 = clock()
        if num_hit != HIT_BLOCKS * BLOCK_SIZE:
            raise RuntimeError(f"expected a hit of {HIT_BLOCKS} blocks, got {num_hit} tokens")
        for phase, value in zip(PHASES, (t1 - t0, t2 - t1, t3 - t2, t5 - t4)):
            ns[phase].append(value)
    return ns


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def measure(num_cached: int, batch: int, repeats: int) -> dict:
    gc.collect()
    mgr = KVCacheManager(num_cached + 1, BLOCK_SIZE)
    fill_s, last = fill(mgr, num_cached)
    if mgr.num_free_blocks != num_cached:
        raise RuntimeError(f"after the fill {mgr.num_free_blocks} blocks are free, expected {num_cached}")
    hot = last[: HIT_BLOCKS * BLOCK_SIZE]
    token_base = 2**31  # above every fill token
    per_run = []
    gc.collect()
    for r in range(repeats):
        ns = run_batch(mgr, hot, batch, token_base + r * batch * REQUEST_BLOCKS * BLOCK_SIZE)
        per_run.append({k: statistics.median(v) / 1e3 for k, v in ns.items()})
    out = {k: statistics.median(run[k] for run in per_run) for k in PHASES}
    out["total"] = statistics.median(sum(run[k] for k in PHASES) for run in per_run)
    out["fill_s"] = fill_s
    out["rss_mib"] = peak_rss_mib()
    out["free_after"] = mgr.num_free_blocks
    del mgr
    gc.collect()
    return out


def plot(rows: list[tuple[int, dict]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = [n for n, _ in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    for phase in (*PHASES, "total"):
        ax.plot(sizes, [r[phase] for _, r in rows], marker="o", label=phase)
    ax.set_xscale("log")
    ax.set_xlabel("cached blocks in the pool")
    ax.set_ylabel("us per request (median)")
    ax.set_title(f"kvpool: {REQUEST_BLOCKS}-block requests, {HIT_BLOCKS} hit, {REQUEST_BLOCKS - HIT_BLOCKS} evicting")
    ax.set_ylim(bottom=0)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot written to {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--min-exp", type=int, default=3, help="smallest size: 10^min-exp cached blocks")
    parser.add_argument("--max-exp", type=int, default=7, help="largest size: 10^max-exp cached blocks")
    parser.add_argument("--batch", type=int, default=500, help="requests per timed batch")
    parser.add_argument("--repeats", type=int, default=3, help="batches per size; medians are reported")
    parser.add_argument("--plot", metavar="PATH", help="also save a plot (needs matplotlib)")
    args = parser.parse_args()
    if args.min_exp < 3 or args.max_exp < args.min_exp:
        parser.error("need 3 <= --min-exp <= --max-exp (the smallest pool must hold a 128-block request)")

    print(
        f"kvpool, {REQUEST_BLOCKS}-block requests ({HIT_BLOCKS} hit, {REQUEST_BLOCKS - HIT_BLOCKS} new, each "
        f"evicting a cached block), {args.batch} per batch, medians of {args.repeats} batches; us per request"
    )
    header = (
        f"{'cached blocks':>14}"
        + "".join(f"{p:>10}" for p in (*PHASES, "total"))
        + f"{'fill s':>9}{'peak RSS MiB':>14}{'control':>10}{'x control':>11}"
    )
    print(header)
    rows = []
    for exp in range(args.min_exp, args.max_exp + 1):
        n = 10**exp
        r = measure(n, args.batch, args.repeats)
        control = measure(CONTROL_BLOCKS, args.batch, args.repeats)
        r["control"] = control["total"]
        rows.append((n, r))
        print(
            f"{n:>14,}"
            + "".join(f"{r[p]:>10.1f}" for p in (*PHASES, "total"))
            + f"{r['fill_s']:>9.1f}{r['rss_mib']:>14,.0f}"
            f"{control['total']:>10.1f}{r['total'] / control['total']:>11.2f}",
            flush=True,
        )
    first, last = rows[0][1]["total"], rows[-1][1]["total"]
    print(f"total per request at {rows[-1][0]:,} cached blocks / at {rows[0][0]:,}: {last / first:.2f}x")
    if args.plot:
        plot(rows, args.plot)


if __name__ == "__main__":
    main()
