"""Reference prefix-cache hit rates of a trace: LRU and the offline optimum (MIN).

Model (the one the simulator's reference numbers use)::

    for each request, in order:
        look up its cacheable blocks from the first: block i hits only if
        blocks 0..i all hit (the prefix rule); stop at the first miss
        then insert all of the request's blocks before the next request
    capacity is counted in blocks

A block is identified by its whole prefix (a chained key), so equal keys mean
equal prefixes. Keys here are small integers, never cryptographic hashes:

* Mooncake requests (every request a single hash-block segment, no salt or
  LoRA, ``512 % block_size == 0``): block ``b`` of a request is sub-block
  ``j = b % S`` of hash ID ``h = hash_ids[b // S]`` (``S = 512 // block_size``)
  and its key is ``h * S + j`` -- exact, because the trace's IDs are chained.
* Anything else: prompts are materialised and each block is interned by
  ``(parent key, token bytes)``, with a root per ``(cache_salt, lora_name)``.

Only full blocks are cacheable unless ``include_partial_blocks=True``, which
also looks up and inserts each prompt's trailing partial block (what the
512-token reference table of the Mooncake trace counts). Token hit rate is
``sum(min(hits_r * block_size, prompt_length_r)) / sum(prompt_length_r)``.

This module needs numpy (the ``sim`` extra) for the key and next-use arrays.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Container, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any

from kvpool.checks import check_int
from kvpool.errors import ConfigError
from kvpool.sim.traces import MOONCAKE_BLOCK_TOKENS, TraceRequest

if TYPE_CHECKING:
    import numpy as np

__all__ = [
    "BlockTrace",
    "HitRateResult",
    "Policy",
    "build_block_trace",
    "lru_hit_rate",
    "optimal_hit_rate",
]

DEFAULT_BLOCK_SIZE = 16


class Policy(Enum):
    """Replacement policy of a :class:`HitRateResult`."""

    LRU = "lru"
    MIN = "min"


@dataclass(frozen=True, slots=True)
class HitRateResult:
    """Hit statistics of one replay.

    ``lookups`` counts cacheable blocks looked up (full blocks, plus trailing
    partial blocks when ``include_partial_blocks``); ``hits`` the prefix hits;
    ``hit_tokens`` is ``sum(min(hits_r * block_size, prompt_length_r))``.
    """

    policy: Policy
    capacity_blocks: int
    block_size: int
    include_partial_blocks: bool
    requests: int
    lookups: int
    hits: int
    prompt_tokens: int
    hit_tokens: int

    @property
    def block_hit_rate(self) -> float:
        """``hits / lookups`` (0.0 when nothing was looked up)."""
        return self.hits / self.lookups if self.lookups else 0.0

    @property
    def token_hit_rate(self) -> float:
        """``hit_tokens / prompt_tokens`` (0.0 for empty prompts)."""
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


@dataclass(frozen=True, slots=True, eq=False)
class BlockTrace:
    """A trace reduced to block keys, reusable across policies and capacities.

    ``keys`` (int64) holds every request's cacheable block keys in order;
    request ``r`` owns ``keys[offsets[r]:offsets[r + 1]]``. Keys lie in
    ``[0, key_space)`` and equal keys mean equal prefixes. Build it with
    :func:`build_block_trace`.
    """

    block_size: int
    include_partial_blocks: bool
    keys: np.ndarray
    offsets: np.ndarray
    prompt_lengths: np.ndarray
    key_space: int

    @property
    def num_requests(self) -> int:
        return len(self.prompt_lengths)


def _check_block_size(block_size: object) -> int:
    return check_int("block_size", block_size)


def _hash_fast_path_ok(requests: Sequence[TraceRequest], block_size: int) -> bool:
    """True when every request is a bare hash-block prompt and the IDs are chained.

    Chained: each ID always sits at the same position after the same parent (the
    Mooncake loader enforces it; hand-built requests may not), so an ID and a
    sub-block index name a whole prefix. O(total hash IDs).
    """
    if MOONCAKE_BLOCK_TOKENS % block_size or not all(
        r.hash_ids is not None and r.cache_salt is None and r.lora_name is None for r in requests
    ):
        return False
    seen: dict[int, tuple[int, int]] = {}
    for r in requests:
        parent = -1
        for pos, h in enumerate(r.hash_ids or ()):
            if seen.setdefault(h, (pos, parent)) != (pos, parent):
                return False
            parent = h
    return True


def _hash_id_keys(requests: Sequence[TraceRequest], block_size: int, partial: bool) -> tuple[list[Any], int]:
    """Keys from hash IDs: full sub-block j of id h -> h*S + j; partials interned above."""
    import numpy as np

    per_block = MOONCAKE_BLOCK_TOKENS // block_size
    max_id = max((max(r.hash_ids or (0,)) for r in requests), default=0)
    base = (max_id + 1) * per_block
    sub = np.arange(per_block, dtype=np.int64)
    partial_keys: dict[tuple[int, int], int] = {}
    chunks: list[Any] = []
    for r in requests:
        ids = np.asarray(r.hash_ids, dtype=np.int64)
        full = r.prompt_length // block_size
        keys = (ids[:, None] * per_block + sub).ravel()[:full]
        if partial and r.prompt_length % block_size:
            tail = (r.hash_ids[-1], r.prompt_length - MOONCAKE_BLOCK_TOKENS * (len(ids) - 1))  # type: ignore[index]  # hash-ID keys: every request has hash IDs
            keys = np.append(keys, base + partial_keys.setdefault(tail, len(partial_keys)))
        chunks.append(keys)
    return chunks, base + len(partial_keys)


def _token_keys(requests: Sequence[TraceRequest], block_size: int, partial: bool) -> tuple[list[Any], int]:
    """Keys from materialised tokens: each block interned by (parent key, token bytes)."""
    import numpy as np

    intern: dict[tuple[Any, ...], int] = {}
    step = 4 * block_size
    chunks: list[Any] = []
    for r in requests:
        data = r.prompt_token_ids().tobytes()
        parent = intern.setdefault(("root", r.cache_salt, r.lora_name), len(intern))
        keys: list[int] = []
        full = r.prompt_length // block_size
        ends = [(b + 1) * step for b in range(full)]
        if partial and r.prompt_length % block_size:
            ends.append(len(data))
        start = 0
        for end in ends:
            parent = intern.setdefault((parent, data[start:end]), len(intern))
            keys.append(parent)
            start = end
        chunks.append(np.asarray(keys, dtype=np.int64))
    return chunks, len(intern)


def build_block_trace(
    requests: Sequence[TraceRequest], block_size: int = DEFAULT_BLOCK_SIZE, *, include_partial_blocks: bool = False
) -> BlockTrace:
    """Reduce ``requests`` to block keys (see the module docstring for the keys).

    O(total blocks) with the hash-ID fast path (numpy per request); otherwise
    O(total prompt tokens) to materialise and intern every block, with memory
    O(distinct blocks).
    """
    import numpy as np

    block_size = _check_block_size(block_size)
    requests = list(requests)
    if _hash_fast_path_ok(requests, block_size):
        chunks, key_space = _hash_id_keys(requests, block_size, include_partial_blocks)
    else:
        chunks, key_space = _token_keys(requests, block_size, include_partial_blocks)
    offsets = np.zeros(len(chunks) + 1, dtype=np.int64)
    np.cumsum([len(c) for c in chunks], out=offsets[1:])
    keys = np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.int64)
    lengths = np.asarray([r.prompt_length for r in requests], dtype=np.int64)
    return BlockTrace(block_size, include_partial_blocks, keys.astype(np.int64), offsets, lengths, max(key_space, 1))


def _as_block_trace(
    requests: Sequence[TraceRequest] | BlockTrace, block_size: int | None, include_partial_blocks: bool | None
) -> BlockTrace:
    if isinstance(requests, BlockTrace):
        if block_size is not None and block_size != requests.block_size:
            raise ConfigError(f"block_size {block_size} differs from the BlockTrace's {requests.block_size}")
        if include_partial_blocks not in (None, requests.include_partial_blocks):
            raise ConfigError(f"include_partial_blocks={include_partial_blocks} differs from the BlockTrace's")
        return requests
    size = DEFAULT_BLOCK_SIZE if block_size is None else block_size
    return build_block_trace(requests, size, include_partial_blocks=bool(include_partial_blocks))


def _check_capacity(capacity_blocks: object) -> int:
    return check_int("capacity_blocks", capacity_blocks, minimum=0)


def _result(policy: Policy, trace: BlockTrace, capacity: int, hits_per_request: list[int]) -> HitRateResult:
    lengths = trace.prompt_lengths.tolist()
    bs = trace.block_size
    return HitRateResult(
        policy=policy,
        capacity_blocks=capacity,
        block_size=bs,
        include_partial_blocks=trace.include_partial_blocks,
        requests=trace.num_requests,
        lookups=int(trace.offsets[-1]),
        hits=sum(hits_per_request),
        prompt_tokens=sum(lengths),
        hit_tokens=sum(min(h * bs, n) for h, n in zip(hits_per_request, lengths, strict=True)),
    )


def _prefix_hits(keys: list[int], cache: Container[int]) -> int:
    """How many of ``keys`` hit, from the first, before the first miss (the prefix rule)."""
    hits = 0
    for key in keys:
        if key not in cache:
            break
        hits += 1
    return hits


def lru_hit_rate(
    requests: Sequence[TraceRequest] | BlockTrace,
    capacity_blocks: int,
    block_size: int | None = None,
    *,
    include_partial_blocks: bool | None = None,
) -> HitRateResult:
    """Prefix hit rate of an LRU cache of ``capacity_blocks`` blocks.

    After each lookup the request's blocks are touched (inserted if absent,
    evicting the least recently used block when full) from last to first, so a
    request's first block ends up most recent and parents outlive children, as
    when a manager frees a request's blocks tail first. ``block_size`` defaults
    to 16 (or the BlockTrace's own). O(total blocks) time; O(capacity) memory
    beyond the block trace.
    """
    capacity = _check_capacity(capacity_blocks)
    trace = _as_block_trace(requests, block_size, include_partial_blocks)
    cache: OrderedDict[int, None] = OrderedDict()
    touch, evict = cache.move_to_end, cache.popitem
    offsets = trace.offsets.tolist()
    hits_per_request: list[int] = []
    for r in range(trace.num_requests):
        keys = trace.keys[offsets[r] : offsets[r + 1]].tolist()
        hits_per_request.append(_prefix_hits(keys, cache))
        if capacity == 0:
            continue
        for key in reversed(keys):
            if key in cache:
                touch(key)
            else:
                if len(cache) >= capacity:
                    evict(last=False)
                cache[key] = None
    return _result(Policy.LRU, trace, capacity, hits_per_request)


def _priorities(trace: BlockTrace) -> np.ndarray:
    """Eviction rank of each block after its access, as ``rank * key_space + key``.

    ``rank`` is the position of the key's next access in the flattened trace
    (one stable argsort instead of a Python backward pass), or ``n + depth``
    when it is never used again, so that, among blocks never used again, deeper
    ones rank farther. Within a request positions grow with depth, so ranks
    order blocks by (next request, depth). O(n log n).
    """
    import numpy as np

    keys, n = trace.keys, len(trace.keys)
    if (2 * n + 1) * trace.key_space >= 2**63:
        raise ConfigError(f"trace too large for 64-bit eviction ranks: {n} blocks, {trace.key_space} keys")
    order = np.argsort(keys, kind="stable")
    same = keys[order[1:]] == keys[order[:-1]]
    rank = np.arange(n, dtype=np.int64) - np.repeat(trace.offsets[:-1], np.diff(trace.offsets)) + n
    rank[order[:-1][same]] = order[1:][same]
    priorities: np.ndarray = rank * trace.key_space + keys
    return priorities


def optimal_hit_rate(
    requests: Sequence[TraceRequest] | BlockTrace,
    capacity_blocks: int,
    block_size: int | None = None,
    *,
    include_partial_blocks: bool | None = None,
) -> HitRateResult:
    """Offline-optimal prefix hit rate: Belady's MIN with bypass.

    After a request's lookup, its cached blocks take their new next-use ranks;
    then each missed block, first to last, is inserted if there is room, else
    either the cached block used farthest in the future is evicted for it or,
    when the new block is itself the farthest, it is not inserted (bypass).
    Ties (blocks never used again) go to the deepest block.

    Why no policy of the same capacity gets more prefix hits in this model:

    1. *Relaxation.* Count a block as a hit whenever it is cached at lookup,
       ignoring the prefix rule. Any policy's prefix hits are at most its
       relaxed hits.
    2. *MIN is optimal for the relaxation.* Between requests the cache may
       become any ``capacity``-subset of (cache + the request's blocks); MIN
       keeps the ones needed soonest. The classic exchange argument applies:
       a schedule keeping ``x`` instead of a ``y`` needed sooner can keep ``y``
       instead until ``y``'s next use, gaining that hit before it can lose
       ``x``'s, and then resynchronise.
    3. *MIN's cache is prefix-closed, so its relaxed hits are prefix hits.*
       A block's ancestors occur in every request that contains it, earlier,
       so a parent's next use is never later than its child's, and ties are
       broken towards the deeper block: the block MIN evicts (or bypasses)
       never has a cached child. By induction every cached block's parent is
       cached, so the cached blocks of a request form a prefix of it.

    Hence MIN's prefix hits = its relaxed hits >= any policy's relaxed hits >=
    any policy's prefix hits. (The tests check this against an exhaustive
    search on small random traces.)

    Complexity: O(n log n) for next-use ranks (numpy), then O(n log capacity)
    with a heap of ``rank * key_space + key`` integers and lazy deletion
    (stale entries are skipped when popped; the heap is rebuilt from the cache
    whenever it outgrows twice the capacity). Memory O(n) for the ranks.
    """
    capacity = _check_capacity(capacity_blocks)
    trace = _as_block_trace(requests, block_size, include_partial_blocks)
    space = trace.key_space
    entries = _priorities(trace)
    offsets = trace.offsets.tolist()
    cache: dict[int, int] = {}  # key -> its current heap entry (rank * space + key)
    heap: list[int] = []  # negated entries: a max-heap of ranks
    push, pop = heapq.heappush, heapq.heappop
    hits_per_request: list[int] = []
    for r in range(trace.num_requests):
        a, b = offsets[r], offsets[r + 1]
        keys = trace.keys[a:b].tolist()
        hits_per_request.append(_prefix_hits(keys, cache))
        if capacity == 0:
            continue
        missed = []
        for key, entry in zip(keys, entries[a:b].tolist(), strict=True):
            if key in cache:
                cache[key] = entry
                push(heap, -entry)
            else:
                missed.append(entry)
        for entry in missed:
            if len(cache) < capacity:
                cache[entry % space] = entry
                push(heap, -entry)
                continue
            while cache.get((-heap[0]) % space) != -heap[0]:
                pop(heap)  # stale: the block was evicted or has a newer rank
            farthest = -heap[0]
            if entry > farthest:
                continue  # bypass: the new block is the one needed last
            pop(heap)
            del cache[farthest % space]
            cache[entry % space] = entry
            push(heap, -entry)
        if len(heap) > 2 * capacity + 64:
            heap = [-e for e in cache.values()]
            heapq.heapify(heap)
    return _result(Policy.MIN, trace, capacity, hits_per_request)
