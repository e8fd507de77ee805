"""Sequential replay: a trace through the real :class:`~kvpool.KVCacheManager`, one request at a time.

Model (the one the trace README's reference numbers use, run on the real
manager)::

    for each request, in file order:
        hit, n = manager.get_computed_blocks(request)      # longest cached prefix
        manager.allocate_slots(request, prompt - n, n, hit) # the whole prompt at once
        manager.free(request)                              # tail first; before the next request

No output tokens are appended and no two requests overlap, so the only state
carried from one request to the next is the prefix cache and the free-queue
order: the eviction policy alone decides the hit rate. The pool has
``capacity_blocks + 1`` blocks (block 0 is the reserved null block).

How this differs from :func:`kvpool.sim.optimum.lru_hit_rate` (the key-level
model) with the default policy, all of it the real manager's behaviour:

* A lookup covers at most ``prompt - 1`` tokens (the last token is always
  computed), so a block-aligned prompt whose blocks are all cached misses its
  last block; the recomputed block is cached again under the same hash, a
  duplicate that occupies a second slot.
* A prompt's trailing partial block takes a pool block while the request runs
  and is then freed uncached to the front of the queue: that slot holds no
  cached data, so with ``capacity_blocks`` usable blocks at most
  ``capacity_blocks - 1`` hold cached blocks once any prompt had a partial
  block.

When no prompt is block-aligned (and some prompt has a partial block) the two
agree exactly, with the model given ``capacity_blocks - 1`` blocks; the tests
check this.

Waiting-queue hints (``lookahead > 0``): before each request the replay tells
the manager (:meth:`~kvpool.KVCacheManager.note_waiting`) that the next
``lookahead`` requests of the file are waiting, as a scheduler would with its
waiting queue. Policies without hint support ignore it. Each request is still
hashed exactly once.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from kvpool.errors import CapacityError, ConfigError
from kvpool.eviction import FreeQueueFactory, resolve_policy
from kvpool.hashing import HashAlgo
from kvpool.manager import KVCacheManager
from kvpool.request import Request
from kvpool.sim.traces import TraceRequest

__all__ = ["SequentialResult", "replay_sequential"]

DEFAULT_BLOCK_SIZE = 16


@dataclass(frozen=True, slots=True)
class SequentialResult:
    """Hit statistics of one sequential replay.

    ``prompt_tokens`` and ``hit_tokens`` sum over every request (``hit_tokens``
    is what the manager's lookups returned); ``cacheable_blocks`` counts full
    prompt blocks and ``hit_blocks`` the blocks the lookups covered;
    ``evictions`` counts hashes dropped from the prefix-cache index when their
    block was taken for new data; ``oversized`` counts requests larger than the
    whole pool (not admitted; their tokens count as misses). ``elapsed_s`` is
    wall-clock time of the replay, informational only (left out of equality).
    """

    policy: str
    capacity_blocks: int
    block_size: int
    hash_algo: str
    lookahead: int
    requests: int
    prompt_tokens: int
    hit_tokens: int
    cacheable_blocks: int
    hit_blocks: int
    evictions: int
    oversized: int
    elapsed_s: float = field(compare=False)

    @property
    def token_hit_rate(self) -> float:
        """``hit_tokens / prompt_tokens`` (0.0 when there are no tokens)."""
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def block_hit_rate(self) -> float:
        """``hit_blocks / cacheable_blocks`` (0.0 when no prompt has a full block)."""
        return self.hit_blocks / self.cacheable_blocks if self.cacheable_blocks else 0.0


def _to_request(trace_request: TraceRequest) -> Request:
    return Request(
        trace_request.request_id,
        trace_request.prompt_token_ids(),
        cache_salt=trace_request.cache_salt,
        lora_name=trace_request.lora_name,
    )


def _with_lookahead(requests: Iterable[TraceRequest], lookahead: int) -> Iterator[tuple[Request, deque[Request]]]:
    """Yield each request with the (up to) ``lookahead`` requests after it; each built once."""
    source = iter(requests)
    window: deque[Request] = deque()
    for trace_request in source:
        window.append(_to_request(trace_request))
        if len(window) > lookahead:
            break
    while window:
        current = window.popleft()
        for trace_request in source:
            window.append(_to_request(trace_request))
            break
        yield current, window


def replay_sequential(
    requests: Iterable[TraceRequest],
    capacity_blocks: int,
    *,
    block_size: int = DEFAULT_BLOCK_SIZE,
    policy: str | FreeQueueFactory = "lru",
    hash_algo: HashAlgo | str = HashAlgo.SHA256,
    lookahead: int = 0,
    progress: Callable[[int], None] | None = None,
) -> SequentialResult:
    """Replay ``requests`` in order through a real manager of ``capacity_blocks`` usable blocks.

    Args:
        requests: the trace, in file order (a list or a stream).
        capacity_blocks: usable pool blocks of ``block_size`` tokens (the pool
            gets one more, the null block).
        block_size: tokens per block.
        policy: a name from :data:`kvpool.eviction.POLICIES` or a free-queue
            factory.
        hash_algo: ``"sha256"`` (default) or ``"xxh3_128"`` (faster; every hit
            is verified against the block's content, so hit rates are equal).
        lookahead: how many following requests to announce as waiting before
            each request (0: none).
        progress: called with the number of requests done, every 1,000.

    Returns:
        A :class:`SequentialResult`. Deterministic: the same inputs give an
        equal result (``elapsed_s`` aside).

    Cost: hashing every prompt block once, plus the manager's O(1) work per
    block looked up, allocated and freed (and the policy's per-block cost).
    """
    if type(capacity_blocks) is not int or capacity_blocks < 1:
        raise ConfigError(f"capacity_blocks must be a positive integer, got {capacity_blocks!r}")
    if type(lookahead) is not int or lookahead < 0:
        raise ConfigError(f"lookahead must be a non-negative integer, got {lookahead!r}")
    name, factory = resolve_policy(policy)
    manager = KVCacheManager(capacity_blocks + 1, block_size, hash_algo=hash_algo, eviction_policy=factory)
    algo = manager.hasher.algo.value
    num_requests = prompt_tokens = hit_tokens = cacheable = oversized = 0
    start = time.perf_counter()
    for request, waiting in _with_lookahead(requests, lookahead):
        if lookahead:
            manager.note_waiting(waiting)
        num_tokens = request.num_tokens
        num_requests += 1
        prompt_tokens += num_tokens
        cacheable += num_tokens // block_size
        hit, num_hit = manager.get_computed_blocks(request)
        try:
            new = manager.allocate_slots(request, num_tokens - num_hit, num_hit, hit)
        except CapacityError:
            oversized += 1
            continue
        if new is None:  # pragma: no cover - every block is free between requests
            raise RuntimeError(f"request {request.request_id!r} found no room in an idle pool")
        hit_tokens += num_hit
        request.num_computed_tokens = num_tokens
        manager.free(request)
        if progress is not None and num_requests % 1000 == 0:
            progress(num_requests)
    elapsed = time.perf_counter() - start
    return SequentialResult(
        policy=name,
        capacity_blocks=capacity_blocks,
        block_size=block_size,
        hash_algo=algo,
        lookahead=lookahead,
        requests=num_requests,
        prompt_tokens=prompt_tokens,
        hit_tokens=hit_tokens,
        cacheable_blocks=cacheable,
        hit_blocks=hit_tokens // block_size,
        evictions=manager.pool.num_evictions,
        oversized=oversized,
        elapsed_s=elapsed,
    )


def _load(trace: str | None, kind: str | None, num_requests: int, seed: int) -> list[TraceRequest]:
    if (trace is None) == (kind is None):
        raise ConfigError("give exactly one of --trace and --workload")
    if trace is not None:
        from kvpool.sim.traces import load_trace

        return load_trace(trace)
    from kvpool.sim.workloads import generate_workload

    return generate_workload(kind, num_requests=num_requests, seed=seed)  # type: ignore[arg-type]


def main(argv: list[str] | None = None) -> int:
    """Command line: replay a trace or a synthetic workload; one JSON line per run.

    Example (the conversation trace at 10,000 x 512 tokens)::

        python -m kvpool.sim.sequential --trace ../shared/traces/conversation_trace.jsonl \\
            --capacity 320000 --policy lru frequency --reference
    """
    import argparse
    import json

    parser = argparse.ArgumentParser(prog="python -m kvpool.sim.sequential", description=main.__doc__)
    parser.add_argument("--trace", help="a trace file (Mooncake or token-level JSONL)")
    parser.add_argument("--workload", help="a synthetic workload kind instead of a trace")
    parser.add_argument("--requests", type=int, default=2000, help="synthetic requests (default 2000)")
    parser.add_argument("--seed", type=int, default=0, help="synthetic workload seed (default 0)")
    parser.add_argument("--capacity", type=int, nargs="+", required=True, help="usable blocks (one run per value)")
    parser.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE)
    parser.add_argument("--policy", nargs="+", default=["lru"], help="policy names (one run per name)")
    parser.add_argument("--lookahead", type=int, default=0, help="waiting requests announced before each request")
    parser.add_argument("--hash-algo", default="sha256", choices=[a.value for a in HashAlgo])
    parser.add_argument("--reference", action="store_true", help="also print the key-level LRU and optimum")
    args = parser.parse_args(argv)
    requests = _load(args.trace, args.workload, args.requests, args.seed)
    for capacity in args.capacity:
        if args.reference:
            from kvpool.sim.optimum import build_block_trace, lru_hit_rate, optimal_hit_rate

            keys = build_block_trace(requests, args.block_size)
            for model in (lru_hit_rate(keys, capacity), optimal_hit_rate(keys, capacity)):
                print(json.dumps({"model": model.policy.value, "capacity_blocks": capacity,
                                  "token_hit_rate": round(model.token_hit_rate, 4),
                                  "block_hit_rate": round(model.block_hit_rate, 4)}), flush=True)
        for name in args.policy:
            result = replay_sequential(
                requests, capacity, block_size=args.block_size, policy=name,
                hash_algo=args.hash_algo, lookahead=args.lookahead,
            )
            print(json.dumps({"policy": result.policy, "capacity_blocks": capacity, "lookahead": result.lookahead,
                              "hash_algo": result.hash_algo, "token_hit_rate": round(result.token_hit_rate, 4),
                              "block_hit_rate": round(result.block_hit_rate, 4), "evictions": result.evictions,
                              "requests": result.requests, "elapsed_s": round(result.elapsed_s, 1)}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
