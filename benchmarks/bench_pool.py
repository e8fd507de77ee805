"""Build a 1,000,000-block pool and report the time and memory it costs.

Run::

    python benchmarks/bench_pool.py            # kvpool
    python benchmarks/bench_pool.py --vs-vllm  # and vLLM's BlockPool, side by side

Each figure is the median of several builds in a fresh process state
(garbage collected between builds); memory is the peak traced by tracemalloc
during the build.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from kvpool import KVCacheManager  # noqa: E402


def build_kvpool(num_blocks: int):
    return KVCacheManager(num_blocks, 16)


def build_vllm(num_blocks: int):
    from vllm.v1.core.block_pool import BlockPool

    return BlockPool(num_blocks, enable_caching=True, hash_block_size=16)


def measure(build, num_blocks: int, repeats: int) -> tuple[float, float]:
    seconds, peaks = [], []
    for _ in range(repeats):
        gc.collect()
        start = time.perf_counter()
        pool = build(num_blocks)
        seconds.append(time.perf_counter() - start)
        del pool
        gc.collect()
        tracemalloc.start()
        pool = build(num_blocks)
        peaks.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
        del pool
    return statistics.median(seconds), statistics.median(peaks) / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description="Time and memory of building a large pool.")
    parser.add_argument("--blocks", type=int, default=1_000_000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--vs-vllm", action="store_true")
    args = parser.parse_args()
    rows = [("kvpool", build_kvpool)] + ([("vllm", build_vllm)] if args.vs_vllm else [])
    print(f"{'':10}{'build s':>12}{'peak MiB':>12}   ({args.blocks:,} blocks, median of {args.repeats})")
    for name, build in rows:
        seconds, mib = measure(build, args.blocks, args.repeats)
        print(f"{name:10}{seconds:>12.6f}{mib:>12.3f}")


if __name__ == "__main__":
    main()
