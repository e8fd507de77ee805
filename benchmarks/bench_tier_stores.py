"""Save and load throughput of the tier stores (GB/s of block payload), beside the raw backend.

Run::

    python benchmarks/bench_tier_stores.py                   # disk in a temporary directory, a private redis-server
    python benchmarks/bench_tier_stores.py --redis redis://127.0.0.1:6379/0 --disk-dir /var/cache/kvpool-bench
    python benchmarks/bench_tier_stores.py --secret           # entries signed with an HMAC

Each figure is the median of ``--repeats`` batches of ``--batch`` blocks of ``--block-bytes``
random bytes (1 MiB by default; SmolLM2-135M's 16-token block is 360 KiB), every batch under
fresh keys, so saves really write and loads really read. The rows take turns on each batch, so
whatever else the machine is doing weighs on all of them alike. ``put_many``/``get_many``
include encoding and verifying entries (one SHA-256 pass over each payload, one copy); the
"raw" rows do the same I/O without entries (files written with os.replace, Redis SET/MGET), so
the ratio is what the entry format and bookkeeping cost. Disk loads come from the page cache
when the machine has the memory for it (they do here), so they measure the store's
own cost, not the device's.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from kvpool.tiers import DiskStore, EntryCodec, LayoutFingerprint, RedisStore  # noqa: E402

LAYOUT = LayoutFingerprint("LlamaForCausalLM", 30, 3, 64, "bfloat16", 16, "sha256", "bench", "namespace:bench")

Batch = list[tuple[bytes, bytes]]


def one_batch(batch: int, block_bytes: int) -> Batch:
    """``batch`` blocks of random bytes under fresh random keys."""
    noise = os.urandom(block_bytes + batch)
    return [(os.urandom(32), noise[i : i + block_bytes]) for i in range(batch)]


def timed(fn: Callable[[Batch], object], batch: Batch) -> float:
    start = time.perf_counter()
    fn(batch)
    return time.perf_counter() - start


def raw_disk(root: Path) -> tuple[Callable[[Batch], object], Callable[[Batch], object]]:
    root.mkdir(parents=True, exist_ok=True)

    def save(batch: Batch) -> None:
        for key, payload in batch:
            path = root / key.hex()
            tmp = root / f".{key.hex()}.tmp"
            tmp.write_bytes(payload)
            os.replace(tmp, path)

    def load(batch: Batch) -> None:
        for key, payload in batch:
            assert len((root / key.hex()).read_bytes()) == len(payload)

    return save, load


def raw_redis(url: str) -> tuple[Callable[[Batch], object], Callable[[Batch], object]]:
    import redis

    client = redis.Redis.from_url(url)

    def save(batch: Batch) -> None:
        pipe = client.pipeline(transaction=False)
        for key, payload in batch:
            pipe.set(b"raw:" + key, payload)
        pipe.execute()

    def load(batch: Batch) -> None:
        values = client.mget([b"raw:" + key for key, _p in batch])
        assert all(v is not None for v in values)

    return save, load


@contextmanager
def private_redis() -> Iterator[str]:
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server is not installed; pass --redis URL")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as directory:
        args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        process = subprocess.Popen([*args, "--dir", directory], stdout=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 10
            while True:
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)
            yield f"redis://127.0.0.1:{port}/0"
        finally:
            process.kill()
            process.wait()


Row = tuple[str, Callable[[Batch], object], Callable[[Batch], object]]


def rows_to_measure(args: argparse.Namespace, redis_url: str | None, disk_dir: Path) -> list[Row]:
    codec = EntryCodec(LAYOUT, b"bench secret" if args.secret else None)
    encoded: dict[bytes, bytes] = {}

    def checked_get(store: DiskStore | RedisStore) -> Callable[[Batch], object]:
        def load(batch: Batch) -> None:
            got = store.get_many([k for k, _p in batch])
            assert all(g is not None for g in got), store.stats

        return load

    capacity = 2 * args.repeats * args.batch * (args.block_bytes + 4096)
    disk = DiskStore(disk_dir / "store", capacity, codec)
    rows: list[Row] = [
        (
            "entry codec only (encode / decode)",
            lambda batch: encoded.update((k, codec.encode(k, p)) for k, p in batch),
            lambda batch: [codec.decode(k, encoded.pop(k)) for k, _p in batch],
        ),
        ("disk: DiskStore put_many/get_many", disk.put_many, checked_get(disk)),
        ("disk: raw files (no entries)", *raw_disk(disk_dir / "raw")),
    ]
    if redis_url is not None:
        redis_store = RedisStore(redis_url, codec)
        rows.append(("redis: RedisStore put_many/get_many", redis_store.put_many, checked_get(redis_store)))
        rows.append(("redis: raw SET/MGET (no entries)", *raw_redis(redis_url)))
    return rows


def run(args: argparse.Namespace, redis_url: str | None, disk_dir: Path) -> list[tuple[str, float, float]]:
    """Median save and load GB/s per row; the rows take turns on each batch, so load on the machine hits all alike."""
    rows = rows_to_measure(args, redis_url, disk_dir)
    saves: dict[str, list[float]] = {name: [] for name, _s, _l in rows}
    loads: dict[str, list[float]] = {name: [] for name, _s, _l in rows}
    size = args.batch * args.block_bytes
    for repeat in range(args.repeats):
        batch = one_batch(args.batch, args.block_bytes)
        for name, save, load in rows:
            saves[name].append(timed(save, batch))
            loads[name].append(timed(load, batch))
        print(f"  batch {repeat + 1}/{args.repeats} done", file=sys.stderr, flush=True)
    return [
        (name, size / statistics.median(saves[name]) / 1e9, size / statistics.median(loads[name]) / 1e9)
        for name, _s, _l in rows
    ]


def main(argv: Sequence[str] | None = None) -> list[tuple[str, float, float]]:
    parser = argparse.ArgumentParser(description="Save and load throughput of the tier stores.")
    parser.add_argument("--block-bytes", type=int, default=2**20)
    parser.add_argument("--batch", type=int, default=64, help="blocks per put_many/get_many")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--redis", default=None, help="a Redis URL (default: start a private redis-server)")
    parser.add_argument("--no-redis", action="store_true")
    parser.add_argument("--disk-dir", type=Path, default=None, help="default: a temporary directory")
    parser.add_argument("--secret", action="store_true", help="sign entries with an HMAC")
    args = parser.parse_args(argv)
    print(
        f"{args.repeats} batches of {args.batch} x {args.block_bytes:,}-byte blocks"
        f"{', signed' if args.secret else ''}; median GB/s of payload",
        file=sys.stderr,
    )
    with tempfile.TemporaryDirectory(dir=args.disk_dir) as directory:
        if args.no_redis:
            rows = run(args, None, Path(directory))
        elif args.redis:
            rows = run(args, args.redis, Path(directory))
        else:
            with private_redis() as url:
                rows = run(args, url, Path(directory))
    print("| store | save GB/s | load GB/s |")
    print("|---|---:|---:|")
    for name, put, get in rows:
        print(f"| {name} | {put:.2f} | {get:.2f} |")
    return rows


if __name__ == "__main__":
    main()
