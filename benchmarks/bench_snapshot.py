"""A router that lost a replica's stream, made whole from the replica's snapshot: how long it takes.

The replica: a :class:`~kvpool.manager.KVCacheManager` of ``--blocks`` + 1 blocks filled by
requests of ``--prompt-blocks`` distinct blocks each, then ``--evicted`` requests more, so that
the oldest blocks are evicted (their hashes are what a stale router would still claim). Its
snapshot is what ``GET /kv-events/snapshot`` answers: ``manager.snapshot_events()`` and
:func:`~kvpool.kv_events.snapshot.encode_snapshot` (timed: the engine thread waits for it).

The router, timed per step, medians of ``--repeats`` runs:

* fetch: the body over loopback HTTP (a stdlib server on port 0) with the router's own
  :func:`~kvpool.router.snapshot_loader.http_snapshot`;
* decode: :func:`~kvpool.kv_events.snapshot.decode_snapshot`;
* clear: the replica's stale entries dropped (what the feed does when it sees the loss):
  the router held the pool's blocks from before the outage (all but the newest request's)
  and the evicted ones. The clear retires the replica's holder bit at once; the stale bits
  are swept afterwards, a few thousand with each later store (timed apart, as "sweep,
  afterwards": the index answers rightly before it, so it is not part of "whole again");
* apply: the snapshot's events applied to that :class:`~kvpool.router.index.MemoryIndex`
  (:func:`~kvpool.router.feed.apply_events`, what the feed runs on the router's loop).

"router: whole again" is clear + fetch + decode + apply, in wall seconds and in the
process's CPU seconds (``time.process_time``, the HTTP server's thread included): on a
machine shared with other work the CPU figure is the steadier one.

Checked after each run: every block the pool caches is claimed, the index holds no more
than those (``num_blocks``), no evicted block is claimed, and after the sweep the index's
own invariant checker (``MemoryIndex.check``) passes.

    python benchmarks/bench_snapshot.py --blocks 500000 --repeats 3
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from kvpool.hashing import BlockHash
from kvpool.kv_events.snapshot import decode_snapshot, encode_snapshot
from kvpool.manager import KVCacheManager
from kvpool.request import Request
from kvpool.router.feed import apply_events
from kvpool.router.index import MemoryIndex
from kvpool.router.snapshot_loader import http_snapshot

REPLICA = "http://replica:1"


def build_pool(
    blocks: int, prompt_blocks: int, evicted: int, block_size: int
) -> tuple[KVCacheManager, list[BlockHash]]:
    """A manager caching ``blocks`` blocks, and the hashes of the ``evicted`` requests it evicted first."""
    manager = KVCacheManager(blocks + 1, block_size)
    requests = -(-blocks // prompt_blocks) + evicted
    tokens_per = prompt_blocks * block_size
    first_hashes: list[BlockHash] = []
    for i in range(requests):
        request = Request(f"r{i}", range(i * tokens_per, (i + 1) * tokens_per))
        manager.hash_request(request)
        if manager.allocate_slots(request, tokens_per) is None:
            raise SystemExit(f"request {i} did not fit a pool of {blocks} blocks")
        if i < evicted:
            first_hashes.extend(request.block_hashes[:prompt_blocks])
        manager.free(request)
    return manager, first_hashes


class _Body(BaseHTTPRequestHandler):
    body = b""

    def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
        self.send_response(200)
        self.send_header("content-type", "application/vnd.msgpack")
        self.send_header("content-length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args: object) -> None:
        pass


def serve(body: bytes) -> tuple[ThreadingHTTPServer, str]:
    """A loopback server on port 0 answering ``body`` to every GET; its URL."""
    handler = type("Snapshot", (_Body,), {"body": body})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}/kv-events/snapshot"


def timed(fn: Callable[[], object]) -> tuple[float, object]:
    start = time.perf_counter()
    value = fn()
    return time.perf_counter() - start, value


def one_run(
    manager: KVCacheManager, url: str, evicted: list[BlockHash], truth: list[BlockHash], newest: int
) -> dict[str, float]:
    """One snapshot taken, fetched, decoded and applied over stale claims; its seconds per step."""
    index = MemoryIndex()
    index.store(REPLICA, evicted + truth[:-newest])  # what the router believed before it lost the stream
    take_s, body = timed(lambda: encode_snapshot(manager.snapshot_events(), 41))
    cpu = time.process_time()
    clear_s, _ = timed(lambda: index.clear(REPLICA))
    fetch_s, fetched = timed(http_snapshot(url, {}, 60.0))
    assert len(fetched) == len(body)  # the same pool (its timestamp aside)
    decode_s, snapshot = timed(lambda: decode_snapshot(fetched))
    apply_s, _ = timed(lambda: apply_events(index, REPLICA, snapshot.batch.events))  # type: ignore[attr-defined]
    cpu_s = time.process_time() - cpu
    sweep_s, _ = timed(index.sweep)  # the stale claims' bits, swept (a few thousand a store on a live router)
    index.check()
    held = index.match(truth, [REPLICA])  # one chain of every cached hash: all claimed, in order
    stale = sum(index.match([h], [REPLICA])[0] for h in evicted)
    assert held == [len(truth)], f"claimed {held} of {len(truth)} cached blocks"
    assert index.num_blocks(REPLICA) == len(truth), f"{index.num_blocks(REPLICA)} claims for {len(truth)} blocks"
    assert stale == 0, f"{stale} evicted blocks still claimed"
    return {
        "snapshot (replica)": take_s,
        "clear": clear_s,
        "fetch": fetch_s,
        "decode": decode_s,
        "apply": apply_s,
        "router: whole again": clear_s + fetch_s + decode_s + apply_s,
        "  its CPU seconds": cpu_s,
        "sweep, afterwards": sweep_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=500_000, help="blocks the replica's pool caches")
    parser.add_argument("--prompt-blocks", type=int, default=1000, help="distinct blocks per request")
    parser.add_argument("--evicted", type=int, default=10, help="requests whose blocks are evicted first")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    start = time.perf_counter()
    manager, evicted = build_pool(args.blocks, args.prompt_blocks, args.evicted, args.block_size)
    truth = manager.pool.indexes[0].hashes()
    print(f"pool: {len(truth):,} cached blocks, {len(evicted):,} evicted, built in {time.perf_counter() - start:.1f} s")
    body = encode_snapshot(manager.snapshot_events(), 41)
    server, url = serve(body)
    print(f"snapshot body: {len(body) / 1e6:.1f} MB")
    try:
        runs = [one_run(manager, url, evicted, truth, args.prompt_blocks) for _ in range(args.repeats)]
    finally:
        server.shutdown()
    print(f"\n{'step':<20} {'median s':>9}   runs")
    for step in runs[0]:
        values = [run[step] for run in runs]
        print(f"{step:<20} {statistics.median(values):>9.3f}   " + " ".join(f"{v:.3f}" for v in values))
    print("claims checked: every cached block claimed, no other claim, no evicted block claimed")


if __name__ == "__main__":
    main()
