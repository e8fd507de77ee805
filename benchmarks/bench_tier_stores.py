"""Save and load throughput of the tiers (GB/s of block payload), each beside its raw floor.

Run::

    python benchmarks/bench_tier_stores.py                   # disk in a temporary directory, a private redis-server
    python benchmarks/bench_tier_stores.py --redis redis://127.0.0.1:6379/0 --disk-dir /var/cache/kvpool-bench
    python benchmarks/bench_tier_stores.py --hashes           # also: each checksum and keyed hash alone
    python benchmarks/bench_tier_stores.py --pipeline-sweep   # also: Redis blocks per pipeline
    python benchmarks/bench_tier_stores.py --kind-rows        # also: each store signing with every other kind
    python benchmarks/bench_tier_stores.py --sync             # flush dirty pages before each save (steadier saves)
    python benchmarks/bench_tier_stores.py --slice-blocks 64  # rows take turns per whole batch (default: every 16 blocks)

Each figure is the median of ``--repeats`` batches of ``--batch`` blocks of ``--block-bytes``
random bytes (1 MiB by default; SmolLM2-135M's 16-token block is 360 KiB), every batch under
fresh keys, so saves really write and loads really read. The rows take turns on each slice of 16
blocks of a batch (``--slice-blocks``), each batch starting one row later than the last, so whatever else the machine is doing (the writeback
of the row before included) weighs on all of them alike; the ratio to the raw row of the
same tier is the figure that matters on a busy machine. Every tier runs without a secret
(checksum only) and with one (entries signed with :meth:`Signature.best_available`: AES-256-GMAC
where ``cryptography`` is installed), in the same run; ``--kind-rows`` adds rows signing with each
other kind this process computes (keyed BLAKE3, HMAC-SHA256), ``--hmac-rows`` with HMAC-SHA256
only, to compare the kinds side by side. A last table gives each signed row over its tier's
unsigned one, the figure issue 26 asks to be at least 70%.

* cpu: :class:`~kvpool.engine.kv_transfer.KVTransferWorker` saving blocks from the engine's KV
  cache into its host tier and loading them back into other blocks; raw: one ``copy_`` of the
  same bytes between the engine's buffer and a host buffer (a plain memcpy), and the same bytes
  moved by ``ctypes.memmove`` (libc's memcpy, no torch). Needs torch.
* disk: ``DiskStore.put_many`` / ``get_many_into`` (the engine's path: payloads read straight
  into a reused buffer); raw: each block written to a file then ``os.replace``, read back with
  ``readinto`` into a reused buffer. Loads come from the page cache where the machine has the
  memory (they do here), so they measure the store's own cost, not the device's.
* redis: ``RedisStore.put_many`` / ``get_many_into``; raw: pipelined SET and one MGET, parsed by
  hiredis when it is installed (as the store's replies are).
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import hmac
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from kvpool.tiers import DiskStore, EntryCodec, LayoutFingerprint, RedisStore, redis_store  # noqa: E402
from kvpool.tiers.entry import Signature  # noqa: E402

Batch = list[tuple[bytes, bytes]]
Op = Callable[[Batch], object]
SECRET = b"a bench secret of 32 bytes......"


def layout(block_bytes: int) -> LayoutFingerprint:
    """A layout whose block is at least ``block_bytes`` (entries of up to one block are accepted)."""
    tokens = max(1, -(-block_bytes // (32 * 2 * 4 * 64 * 4)))
    return LayoutFingerprint("LlamaForCausalLM", 32, 4, 64, "float32", tokens, "sha256", "bench", "namespace:bench")


def one_batch(batch: int, block_bytes: int) -> Batch:
    """``batch`` blocks of random bytes under fresh random keys."""
    noise = os.urandom(block_bytes + batch)
    return [(os.urandom(32), noise[i : i + block_bytes]) for i in range(batch)]


def timed(fn: Op, batch: Batch) -> float:
    start = time.perf_counter()
    fn(batch)
    return time.perf_counter() - start


def raw_disk(root: Path, block_bytes: int, batch: int) -> tuple[Op, Op]:
    root.mkdir(parents=True, exist_ok=True)
    into = bytearray(block_bytes * batch)
    view = memoryview(into)

    def save(items: Batch) -> None:
        for key, payload in items:
            tmp = root / f".{key.hex()}.tmp"
            with open(tmp, "wb") as f:
                f.write(payload)
            os.replace(tmp, root / key.hex())

    def load(items: Batch) -> None:
        for i, (key, payload) in enumerate(items):
            with open(root / key.hex(), "rb", buffering=0) as f:
                assert f.readinto(view[i * block_bytes : (i + 1) * block_bytes]) == len(payload)

    return save, load


def raw_redis(url: str) -> tuple[Op, Op]:
    import redis

    client = redis.Redis.from_url(url)

    def save(items: Batch) -> None:
        pipe = client.pipeline(transaction=False)
        for key, payload in items:
            pipe.set(b"raw:" + key, payload)
        pipe.execute()

    def load(items: Batch) -> None:
        values = client.mget([b"raw:" + key for key, _p in items])
        assert all(v is not None for v in values)

    return save, load


def store_ops(store: DiskStore | RedisStore, block_bytes: int, batch: int) -> tuple[Op, Op]:
    into = bytearray(block_bytes * batch)
    view = memoryview(into)
    buffers = [view[i * block_bytes : (i + 1) * block_bytes] for i in range(batch)]

    def load(items: Batch) -> None:
        got = store.get_many_into([k for k, _p in items], buffers[: len(items)])
        assert all(got), store.stats

    return store.put_many, load


def cpu_rows(block_bytes: int, batch: int) -> list[tuple[str, str, Op, Op]]:
    """The CPU tier through the engine's worker, and a plain copy of the same bytes; [] without torch."""
    try:
        import torch

        from kvpool.connector import BlockLoad, BlockSave, ConnectorMetadata
        from kvpool.engine.kv_cache import KVCacheSpec, allocate_kv_caches
        from kvpool.engine.kv_transfer import KVTransferWorker
    except ImportError:
        return []
    torch.set_num_threads(1)
    tokens = max(1, block_bytes // (32 * 2 * 4 * 64 * 4))
    spec = KVCacheSpec(num_layers=32, num_kv_heads=4, head_dim=64, block_size=tokens, dtype=torch.float32)
    caches = allocate_kv_caches(spec, 2 * batch + 1)
    for cache in (*caches.key_caches, *caches.value_caches):
        cache.normal_()
    worker = KVTransferWorker(caches, batch, [])
    saves = tuple(BlockSave("r", 1 + i, b"k%d" % i, ("cpu",), 1 + i) for i in range(batch))
    loads = tuple(BlockLoad("r", i, batch + 1 + i, b"k%d" % i, "cpu", 1 + i) for i in range(batch))
    flat = caches.key_caches[0].untyped_storage()
    engine = torch.empty(0, dtype=torch.uint8).set_(flat).view(-1)  # the engine's whole KV buffer, as bytes
    host = torch.empty(batch * spec.block_bytes, dtype=torch.uint8)
    span = batch * spec.block_bytes
    memmove = ctypes.memmove
    at_engine, at_host = engine.data_ptr(), host.data_ptr()
    return [
        (
            "cpu",
            "KVTransferWorker",
            lambda _items: worker.save(ConnectorMetadata(saves=saves)),
            lambda _items: (worker.start_load(ConnectorMetadata(loads=loads)), worker.get_finished()),
        ),
        (
            "cpu",
            "raw memcpy",
            lambda _items: host.copy_(engine[:span]),
            lambda _items: engine[span : 2 * span].copy_(host),
        ),
        (
            "cpu",
            "memmove (ctypes)",
            lambda _items: memmove(at_host, at_engine, span),
            lambda _items: memmove(at_engine + span, at_host, span),
        ),
    ]


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


#: (tier, variant, save, load)
Row = tuple[str, str, Op, Op]


#: How the tables name each signature kind.
KIND_NAMES = {Signature.HMAC_SHA256: "HMAC-SHA256", Signature.BLAKE3_KEYED: "BLAKE3", Signature.GMAC_AES256: "GMAC"}


def other_kinds(args: argparse.Namespace) -> list[Signature]:
    """The kinds besides the default that get rows of their own: all this process computes, or HMAC-SHA256."""
    default = Signature.best_available()
    probe = EntryCodec(layout(1), SECRET)
    if args.kind_rows:
        return [kind for kind in KIND_NAMES if kind is not default and probe.can_verify(kind)]
    return [Signature.HMAC_SHA256] if args.hmac_rows and default is not Signature.HMAC_SHA256 else []


def rows_to_measure(args: argparse.Namespace, redis_url: str | None, disk_dir: Path) -> list[Row]:
    fingerprint = layout(args.block_bytes)
    codecs = {"": EntryCodec(fingerprint), " signed": EntryCodec(fingerprint, SECRET)}
    for kind in other_kinds(args):
        codecs[f" signed {KIND_NAMES[kind]}"] = EntryCodec(fingerprint, SECRET, signature=kind)
    capacity = 4 * args.repeats * args.batch * (args.block_bytes + 4096)
    rows: list[Row] = [] if args.no_cpu else cpu_rows(args.block_bytes, args.batch)
    rows.append(("disk", "raw files", *raw_disk(disk_dir / "raw", args.block_bytes, args.batch)))
    for suffix, codec in codecs.items():
        store = DiskStore(disk_dir / f"store{suffix.strip().replace(' ', '-')}", capacity, codec)
        rows.append(("disk", f"DiskStore{suffix}", *store_ops(store, args.block_bytes, args.batch)))
    if redis_url is not None:
        rows.append(("redis", "raw SET/MGET", *raw_redis(redis_url)))
        for suffix, codec in codecs.items():
            redis = RedisStore(redis_url, codec)
            rows.append(("redis", f"RedisStore{suffix}", *store_ops(redis, args.block_bytes, args.batch)))
    return rows


def run(rows: list[Row], args: argparse.Namespace) -> dict[tuple[str, str], tuple[float, float]]:
    """Median save and load GB/s per row; the rows take turns on each slice of a batch, so load hits all alike.

    A batch's time for a disk or Redis row is the sum of its slices' (``--slice-blocks`` blocks
    each, every row saving then loading one slice before the next row takes it); a CPU row moves
    its whole batch at once, in the first slice's turn. The page cache's cost per written page
    swings several times over within seconds on a shared machine (0.5 to 10 ms per MiB here), so
    rows that take turns every 64 MiB can land on different halves of a swing; turns every 16
    blocks put the rows being compared side by side. ``--slice-blocks`` equal to ``--batch`` is
    one turn per batch (the order before).
    """
    saves: dict[tuple[str, str], list[float]] = {(t, v): [] for t, v, _s, _l in rows}
    loads: dict[tuple[str, str], list[float]] = {(t, v): [] for t, v, _s, _l in rows}
    size = args.batch * args.block_bytes
    step = max(1, min(args.slice_blocks, args.batch))
    for repeat in range(args.repeats):
        batch = one_batch(args.batch, args.block_bytes)
        put = dict.fromkeys(saves, 0.0)
        got = dict.fromkeys(loads, 0.0)
        # Each batch starts one row later, so no row always follows the same one (and its dirty pages).
        start = repeat % len(rows)
        for first in range(0, args.batch, step):
            part = batch[first : first + step]
            for tier, variant, save, load in rows[start:] + rows[:start]:
                whole = tier == "cpu"  # the worker's rows move their whole batch, whatever the items
                if whole and first:
                    continue
                if args.sync:
                    os.sync()  # the rows before wrote their slices: their writeback lands before this row's clock starts
                put[tier, variant] += timed(save, batch if whole else part)
                got[tier, variant] += timed(load, batch if whole else part)
        for name in saves:
            saves[name].append(put[name])
            loads[name].append(got[name])
        print(f"  batch {repeat + 1}/{args.repeats} done", file=sys.stderr, flush=True)
    return {
        name: (size / statistics.median(saves[name]) / 1e9, size / statistics.median(loads[name]) / 1e9)
        for name in saves
    }


def hashes(block_bytes: int, repeats: int) -> list[tuple[str, float]]:
    """GB/s of each checksum and keyed hash over one block, beside a copy of it (medians)."""
    data = os.urandom(block_bytes)
    into = bytearray(block_bytes)
    candidates: list[tuple[str, Callable[[], object]]] = [
        ("memcpy (bytearray slice assignment)", lambda: into.__setitem__(slice(None), data)),
        ("CRC-32 (zlib)", lambda: zlib.crc32(data)),
        ("BLAKE2b", lambda: hashlib.blake2b(data).digest()),
        ("SHA-256", lambda: hashlib.sha256(data).digest()),
        ("keyed BLAKE2b", lambda: hashlib.blake2b(data, key=SECRET).digest()),
        ("keyed BLAKE2s", lambda: hashlib.blake2s(data, key=SECRET).digest()),
        ("HMAC-SHA256", lambda: hmac.digest(SECRET, data, "sha256")),
    ]
    try:
        import xxhash

        candidates.insert(1, ("XXH3-128 (xxhash)", lambda: xxhash.xxh3_128_digest(data)))
    except ImportError:
        pass
    try:
        import blake3

        key = blake3.blake3(SECRET, derive_key_context="kvpool bench keyed BLAKE3").digest()
        candidates.append(("keyed BLAKE3 (blake3, 1 thread)", lambda: blake3.blake3(data, key=key).digest()))
        candidates.append(
            (
                "keyed BLAKE3 (blake3, max_threads=AUTO)",
                lambda: blake3.blake3(data, key=key, max_threads=blake3.blake3.AUTO).digest(),
            )
        )
    except ImportError:
        pass
    try:
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM

        root = hmac.digest(SECRET, b"kvpool bench GMAC", "sha256")

        def gmac() -> bytes:  # as entries are signed: a key of its own from a fresh salt, the block as associated data
            entry_key = hmac.digest(root, os.urandom(16), "sha256")
            return AESGCM(entry_key).encrypt(bytes(12), bytes(104), data)[-16:]

        candidates.append(("AES-256-GMAC, a key per block (cryptography: what signs entries)", gmac))
    except ImportError:
        pass
    figures = []
    for name, fn in candidates:
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            for _ in range(20):
                fn()
            times.append((time.perf_counter() - start) / 20)
        figures.append((name, block_bytes / statistics.median(times) / 1e9))
    return figures


def pipeline_sweep(args: argparse.Namespace, redis_url: str) -> list[tuple[int, float, float]]:
    """RedisStore GB/s (unsigned) for several blocks per pipeline."""
    codec = EntryCodec(layout(args.block_bytes))
    store = RedisStore(redis_url, codec)
    save, load = store_ops(store, args.block_bytes, args.batch)
    out = []
    default = redis_store.PIPELINE_BLOCKS
    try:
        for blocks in (1, 4, 8, 16, 32, 64):
            redis_store.PIPELINE_BLOCKS = blocks
            puts, gets = [], []
            for _ in range(args.repeats):
                batch = one_batch(args.batch, args.block_bytes)
                puts.append(timed(save, batch))
                gets.append(timed(load, batch))
            size = args.batch * args.block_bytes
            out.append((blocks, size / statistics.median(puts) / 1e9, size / statistics.median(gets) / 1e9))
    finally:
        redis_store.PIPELINE_BLOCKS = default
    return out


def main(argv: Sequence[str] | None = None) -> dict[tuple[str, str], tuple[float, float]]:
    parser = argparse.ArgumentParser(description="Save and load throughput of the tiers, beside raw I/O.")
    parser.add_argument("--block-bytes", type=int, default=2**20)
    parser.add_argument("--batch", type=int, default=64, help="blocks per put_many/get_many_into")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--redis", default=None, help="a Redis URL (default: start a private redis-server)")
    parser.add_argument("--no-redis", action="store_true")
    parser.add_argument("--no-cpu", action="store_true", help="skip the CPU tier (it needs torch)")
    parser.add_argument("--disk-dir", type=Path, default=None, help="default: a temporary directory")
    parser.add_argument("--hashes", action="store_true", help="also: each checksum and keyed hash alone")
    parser.add_argument("--pipeline-sweep", action="store_true", help="also: Redis blocks per pipeline")
    parser.add_argument(
        "--hmac-rows",
        action="store_true",
        help="also: each store signing with HMAC-SHA256 (signed rows: the default kind)",
    )
    parser.add_argument(
        "--sync",
        action="store_true",
        help="flush every dirty page (os.sync) before each save, so no row's save pays for the writeback of another's",
    )
    parser.add_argument(
        "--slice-blocks",
        type=int,
        default=16,
        help="blocks per turn: the disk and Redis rows take turns on slices of this many blocks of each batch "
        "(--batch: one turn per batch)",
    )
    parser.add_argument(
        "--kind-rows",
        action="store_true",
        help="also: each store signing with every other kind this process computes",
    )
    args = parser.parse_args(argv)
    if args.slice_blocks < 1:
        parser.error(f"--slice-blocks must be at least 1, got {args.slice_blocks}")
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(
        f"{args.repeats} batches of {args.batch} x {args.block_bytes:,}-byte blocks, {os.cpu_count()} CPUs, "
        f"load average {load:.1f}; median GB/s of payload",
        file=sys.stderr,
    )
    with tempfile.TemporaryDirectory(dir=args.disk_dir) as directory, contextlib_redis(args) as url:
        figures = run(rows_to_measure(args, url, Path(directory)), args)
        sweep = pipeline_sweep(args, url) if args.pipeline_sweep and url is not None else []
    print(
        f"load average {load:.1f} on {os.cpu_count()} CPUs at the start; signed rows: {Signature.best_available().name}"
    )
    print("| tier | path | save GB/s | load GB/s | save / raw | load / raw |")
    print("|---|---|---:|---:|---:|---:|")
    raws = {tier: figures[tier, variant] for tier, variant in figures if variant.startswith("raw")}
    for (tier, variant), (put, get) in figures.items():
        raw_put, raw_get = raws[tier]
        print(f"| {tier} | {variant} | {put:.2f} | {get:.2f} | {put / raw_put:.0%} | {get / raw_get:.0%} |")
    print("\n| signed over unsigned, same run | save | load |\n|---|---:|---:|")
    for (tier, variant), (put, get) in figures.items():
        unsigned = figures.get((tier, variant.split(" signed")[0]))
        if " signed" in variant and unsigned is not None:
            print(f"| {tier}: {variant} | {put / unsigned[0]:.0%} | {get / unsigned[1]:.0%} |")
    if sweep:
        print("\n| blocks per pipeline | save GB/s | load GB/s |\n|---:|---:|---:|")
        for blocks, put, get in sweep:
            print(f"| {blocks} | {put:.2f} | {get:.2f} |")
    if args.hashes:
        print(f"\n| over one {args.block_bytes:,}-byte block | GB/s |\n|---|---:|")
        for name, rate in hashes(args.block_bytes, args.repeats):
            print(f"| {name} | {rate:.2f} |")
    return figures


@contextmanager
def contextlib_redis(args: argparse.Namespace) -> Iterator[str | None]:
    if args.no_redis:
        yield None
    elif args.redis:
        yield args.redis
    else:
        with private_redis() as url:
            yield url


if __name__ == "__main__":
    main()
