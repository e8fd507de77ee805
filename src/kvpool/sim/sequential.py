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
``capacity_blocks + 1`` blocks (plus block 0, which is never handed out).

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

from kvpool.checks import check_int
from kvpool.errors import CapacityError
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
    #: Hit tokens by where they were found: ``gpu``, then each tier by name (only ``gpu`` without tiers).
    hit_tokens_by_tier: dict[str, int] = field(default_factory=dict)

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
        hash_algo: :attr:`HashAlgo.SHA256` (default) or ``"xxh3_128"`` (faster; every hit
            is verified against the block's content, so hit rates are equal).
        lookahead: how many following requests to announce as waiting before
            each request (0: none).
        progress: called with the number of requests done since its last call: about every 1,000, and at the end.

    Returns:
        A :class:`SequentialResult`. Deterministic: the same inputs give an
        equal result (``elapsed_s`` aside).

    Cost: hashing every prompt block once, plus the manager's O(1) work per
    block looked up, allocated and freed (and the policy's per-block cost).
    """
    check_int("capacity_blocks", capacity_blocks)
    check_int("lookahead", lookahead, minimum=0)
    name, factory = resolve_policy(policy)
    manager = KVCacheManager(capacity_blocks + 1, block_size, hash_algo=hash_algo, eviction_policy=factory)
    algo = manager.hasher.algo.value
    num_requests = prompt_tokens = hit_tokens = cacheable = oversized = reported = 0
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
        if progress is not None and num_requests - reported >= 1000:  # oversized ones are counted at the next
            progress(num_requests - reported)
            reported = num_requests
    elapsed = time.perf_counter() - start
    if progress is not None and num_requests > reported:
        progress(num_requests - reported)
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
        hit_tokens_by_tier={"gpu": hit_tokens},
    )
