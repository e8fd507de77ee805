"""Several routers in front of one fleet, with the shared load board and without it, against one router.

In one process: ``Router`` objects (no HTTP, no replicas running) on one Redis, each with
the replicas marked up and described (precise mode, sha256 blocks), choosing and sending
exactly as the relay does (``bookkeeping.choose``, then ``sent``, ``accepted``, the first
token and ``ended``). What it measures is the choices; the replicas' speed is a model.

``--burst``: ``--requests`` requests of one system prompt (a question of their own after it)
sent round-robin over ``--routers`` routers in front of ``--replicas`` replicas, none ending
during the burst; reported: max/mean requests in flight per replica, median over
``--repeats`` runs, for one router, for the routers sharing the board, and for the routers
each on its own loads (no board). Two cases: ``cold`` (no replica holds the prompt) and
``published`` (replica 0's events said it holds the system prompt).

``--replay``: ``--count`` requests of the conversation trace (``benchmarks/fleet_workload.py``,
one conversation in ``--conversations``), keyed by the trace's block ids (512-token
blocks), arriving at the trace's times, against a model of each replica: its first token
``uncached_tokens / --prefill-rate`` seconds after arrival (then its blocks are in its cache
and its events publish them to the shared index), its end ``--decode-step`` seconds per
output token later; caches never evict. Reported: the share of prompt tokens the chosen
replica held cached, for one router and for ``--routers`` routers with the board and without
it (the replay is deterministic: one run is its median).

    redis-server --port 0 --unixsocket /tmp/board.sock --daemonize yes --save "" --appendonly no
    python benchmarks/bench_load_board.py --redis unix:///tmp/board.sock --burst --replay
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
import statistics
import uuid
from collections.abc import Sequence
from pathlib import Path

from kvpool.hashing import BlockHash
from kvpool.router import RouteOptions, Router
from kvpool.router.index import RedisIndex
from kvpool.router.load_board import NoBoard
from kvpool.router.ranking import PromptKeys
from kvpool.router.replica_config import parse_replica
from kvpool.routing import Routing
from kvpool.tenancy import SaltPolicy

BLOCK = 512  # the trace's block; the replicas here use it too


def fleet(
    url: str, routers: int, replicas: int, *, board: bool = True, routing: Routing = Routing.PREFIX
) -> list[Router]:
    """``routers`` routers on one fresh Redis prefix, in front of the same described replicas."""
    import redis

    specs = tuple(
        parse_replica(f"http://127.0.0.1:{port},events=tcp://127.0.0.1:{port + 1},block-size={BLOCK},hash=sha256")
        for port in range(9100, 9100 + 10 * replicas, 10)
    )
    options = RouteOptions(replicas=specs, tokenizer=None, keys=None, salts=SaltPolicy.shared(), routing=routing)
    prefix = f"bench:board:{uuid.uuid4().hex}"
    out = []
    for _ in range(routers):
        router = Router(options, RedisIndex(redis.Redis.from_url(url), prefix=prefix))
        for replica in router.replicas:
            replica.up, replica.events = True, replica.described
        if not board:
            router.bookkeeping.board = NoBoard()
        out.append(router)
    return out


def keys_for(router: Router, blocks: Sequence[int], tokens: int) -> PromptKeys:
    """A prompt of ``tokens`` tokens whose full blocks are ``blocks`` (ids that name a prefix, as the trace's do)."""
    hashing = router.replicas[0].events.hashing  # type: ignore[union-attr]
    return PromptKeys(tokens=tokens, hashes={hashing: [BlockHash(b) for b in blocks]})


def send(router: Router, keys: PromptKeys) -> tuple[int, int]:
    """Choose and send as the relay does: the replica's position and the blocks the ranker credited there."""
    replica, cached = router.bookkeeping.choose(keys)[0]
    router.bookkeeping.sent(replica, keys, cached)
    router.bookkeeping.accepted(replica, keys, cached)
    return router.replicas.index(replica), cached


def burst(args: argparse.Namespace, routers: int, *, board: bool, published: bool) -> float:
    """One burst (see the module): max/mean requests in flight per replica."""
    replicas, requests = args.replicas, args.requests
    group = fleet(args.redis, routers, replicas, board=board, routing=Routing(args.routing))
    system = list(range(1, args.system_blocks + 1))
    if published:
        group[0].index.store(group[0].replicas[0].url, system)
    for i in range(requests):
        router = group[i % routers]
        send(router, keys_for(router, [*system, 10_000 + i], (args.system_blocks + 1) * BLOCK + 7))
    loads = [sum(r.replicas[j].in_flight for r in group) for j in range(replicas)]
    return max(loads) / (sum(loads) / replicas)


def run_bursts(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for published in (False, True):
        case = "published" if published else "cold"
        runs = {
            "1 router": [],
            f"{args.routers} routers, board": [],
            f"{args.routers} routers, no board": [],
        }
        for _ in range(args.repeats):
            for name, board in ((f"{args.routers} routers, board", True), (f"{args.routers} routers, no board", False)):
                runs[name].append(burst(args, args.routers, board=board, published=published))
            runs["1 router"].append(burst(args, 1, board=True, published=published))
        out[case] = {name: round(statistics.median(v), 3) for name, v in runs.items()}
    return out


def replay(routers: int, trace: Sequence[object], args: argparse.Namespace, *, board: bool = True) -> float:
    """The trace against the replica model (see the module): the share of prompt tokens served from cache."""
    replicas = args.replicas
    group = fleet(args.redis, routers, replicas, board=board, routing=Routing(args.routing))
    held: list[set[int]] = [set() for _ in range(replicas)]  # what each replica's cache holds (its events said)
    events: list[tuple[float, int, str, object]] = []  # (time, order, what, payload)
    order = itertools.count()
    cached_tokens = prompt_tokens = 0
    for i, request in enumerate(trace):
        heapq.heappush(events, (request.arrival_s, next(order), "arrive", (i, request)))  # type: ignore[attr-defined]
    while events:
        now, _, what, payload = heapq.heappop(events)
        if what == "arrive":
            i, request = payload  # type: ignore[misc]
            router = group[i % routers]
            blocks = list(request.hash_ids[: request.input_length // BLOCK])
            keys = keys_for(router, blocks, request.input_length)
            j, _ = send(router, keys)
            run = next((n for n, b in enumerate(blocks) if b not in held[j]), len(blocks))
            hit = min(run * BLOCK, ((request.input_length - 1) // BLOCK) * BLOCK)
            cached_tokens += hit
            prompt_tokens += request.input_length
            ttft = now + (request.input_length - hit) / args.prefill_rate
            heapq.heappush(events, (ttft, next(order), "first", (router, j, keys, blocks)))
            end = ttft + request.output_length * args.decode_step
            heapq.heappush(events, (end, next(order), "end", (router, j, keys)))
        elif what == "first":
            router, j, keys, blocks = payload  # type: ignore[misc]
            router.bookkeeping.first_token(keys)
            held[j].update(blocks)
            router.index.store(router.replicas[j].url, blocks)  # its events, to the shared index
        else:
            router, j, keys = payload  # type: ignore[misc]
            router.bookkeeping.ended(router.replicas[j], keys)
    return 100.0 * cached_tokens / max(1, prompt_tokens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--redis", required=True, help="the Redis the routers share, e.g. unix:///tmp/board.sock")
    parser.add_argument("--burst", action="store_true")
    parser.add_argument("--replay", action="store_true")
    parser.add_argument("--routers", type=int, default=4)
    parser.add_argument("--replicas", type=int, default=8)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--system-blocks", type=int, default=8, help="the burst's shared prompt, in 512-token blocks")
    parser.add_argument("--routing", default="prefix", choices=[r.value for r in Routing])
    parser.add_argument("--count", type=int, default=300)
    parser.add_argument("--trace", type=Path, default=None, help="default: fleet_workload's trace")
    parser.add_argument("--conversations", type=int, default=40)
    parser.add_argument("--prefill-rate", type=float, default=20_000.0, help="tokens per second per replica")
    parser.add_argument("--decode-step", type=float, default=0.02, help="seconds per output token")
    args = parser.parse_args()
    report: dict[str, object] = {}
    if args.burst:
        report["burst max/mean in flight (median)"] = run_bursts(args)
    if args.replay:
        from fleet_workload import DEFAULT_TRACE, read_trace

        path = DEFAULT_TRACE if args.trace is None else args.trace
        trace = read_trace(path, count=args.count, conversations=args.conversations)
        report["replay % prompt tokens cached"] = {
            "1 router": round(replay(1, trace, args), 2),
            f"{args.routers} routers, board": round(replay(args.routers, trace, args), 2),
            f"{args.routers} routers, no board": round(replay(args.routers, trace, args, board=False), 2),
            "requests": len(trace),
        }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
