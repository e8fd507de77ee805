"""Offload tiers in the simulator: LRU stores of block hashes below the GPU pool, and a manager that uses them.

The model (what a KV connector with CPU, disk and Redis tiers does, reduced to bookkeeping)::

    GPU pool (the real KVCacheManager, its own eviction policy)
      | evicted block (hash)                     ^ lookup continues the GPU hit, block by block
      v                                          | hit: the block is loaded into a new GPU block
    tier 0 (e.g. cpu)   LRU, capacity in blocks  |
      | its least recently used block            |
      v                                          |
    tier 1 (e.g. disk)  ...                      |
      v
    (dropped)

* **Exclusive**: a block lives in one level. A GPU eviction puts its hash at the
  most recent end of tier 0; a tier's overflow moves its least recent hash to the
  next tier; a hit moves the block up into the GPU pool (out of the tier). A
  ``shared`` tier (Redis, shared by every replica) keeps its copy on a hit, since
  other replicas may want it, and only refreshes its recency.
* **Lookup**: after the GPU's longest prefix hit, the following blocks are looked
  up by their chained hash in the tiers (the first tier that holds each), up to
  the manager's own limit of ``num_tokens - 1`` tokens; the run stops at the first
  block no tier holds. Hashes carry salt and LoRA, so tenants stay apart in every tier.
* **Load**: the run found is written into fresh GPU blocks and cached there, as a
  computed prefix would be, through the manager's public calls (a load request of
  the prefix is allocated, marked computed and freed); the request then finds the
  whole prefix in the GPU pool. The blocks loaded from each tier are recorded for
  the cost model (:meth:`TierSpec.load_seconds`) and for per-tier hit counts.

Why an LRU tier below an LRU pool equals one LRU pool of the combined size: the
GPU's free queue followed by the tier's recency order is one list, ordered by last
use. A hit moves a block to the most recent end of the GPU in both; an eviction
from the GPU's least recent end lands at the tier's most recent end, which is
exactly where that block stands in the combined list. So the same hashes are held
at every moment, and every lookup finds the same prefix (the tests check this hit
for hit, with one and with two tiers).

The one exception is a duplicate. When a block-aligned prompt is fully cached, its
last block is recomputed (the last token must be) and cached a second time. The
single pool keeps both copies, in two slots; when the older copy sits in a tier,
the recomputed one is the only copy in the GPU, and the tier merges the two when
it comes down. The tiered
pool then holds one more distinct block, in a different recency order, so hit
rates differ a little, in either direction (0 to 10% of hits on small synthetic
traces whose every prompt is block-aligned). Prompts that are not block-aligned
never recompute a cached block, and the two agree exactly, provided every request
fits in the GPU pool alone (a larger one is refused there but admitted by the
single pool of the combined size).
"""

from __future__ import annotations

import enum
import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvpool.checks import check_int
from kvpool.errors import ConfigError
from kvpool.events import BlockRemoved
from kvpool.hashing import BlockHash
from kvpool.manager import HitBlocks, KVCacheManager
from kvpool.request import Request

__all__ = ["DEFAULT_LINKS", "TierKind", "TierSpec", "TierStore", "TieredManager", "chain", "parse_tier"]


class TierKind(enum.Enum):
    """The tiers the offload connector knows, by their command-line names."""

    CPU = "cpu"
    DISK = "disk"
    REDIS = "redis"


#: Default bandwidth (bytes/s) and latency (s) of a load, per tier: PCIe host-to-device copies from
#: pinned memory, a local NVMe drive, a Redis server over a 10 Gb/s network.
DEFAULT_LINKS: dict[TierKind, tuple[float, float]] = {
    TierKind.CPU: (25e9, 10e-6),
    TierKind.DISK: (4e9, 100e-6),
    TierKind.REDIS: (1.25e9, 300e-6),
}


@dataclass(frozen=True, slots=True, kw_only=True)
class TierSpec:
    """One tier: its kind, its capacity in blocks, and the link a load crosses.

    ``shared``: one store serves every replica (the default for Redis).
    """

    kind: TierKind
    capacity_blocks: int
    bandwidth_bytes_per_s: float
    latency_s: float
    shared: bool = False

    def __post_init__(self) -> None:
        check_int(f"{self.kind.value} tier capacity_blocks", self.capacity_blocks)
        bandwidth, latency = self.bandwidth_bytes_per_s, self.latency_s
        if isinstance(bandwidth, bool) or not isinstance(bandwidth, int | float) or not 0 < bandwidth < math.inf:
            raise ConfigError(f"{self.kind.value} tier bandwidth must be a finite number > 0, got {bandwidth!r}")
        if isinstance(latency, bool) or not isinstance(latency, int | float) or not 0 <= latency < math.inf:
            raise ConfigError(f"{self.kind.value} tier latency must be a finite number >= 0, got {latency!r}")

    @property
    def name(self) -> str:
        return self.kind.value

    def load_seconds(self, num_blocks: int, block_bytes: int) -> float:
        """One load of ``num_blocks`` consecutive blocks: one latency, then the bytes at the link's bandwidth."""
        if num_blocks == 0:
            return 0.0
        return self.latency_s + num_blocks * block_bytes / self.bandwidth_bytes_per_s


def parse_tier(text: str, *, bandwidth_gb_per_s: float | None = None, latency_us: float | None = None) -> TierSpec:
    """``"cpu=40000"`` (kind=capacity in blocks) as a :class:`TierSpec` with the kind's default link."""
    kind_name, sep, capacity = text.partition("=")
    try:
        kind = TierKind(kind_name.strip())
    except ValueError:
        raise ConfigError(
            f"tier {text!r}: unknown kind {kind_name.strip()!r}; choose one of {[k.value for k in TierKind]}"
        ) from None
    try:
        blocks = int(capacity) if sep else None
    except ValueError:
        blocks = None
    if blocks is None or blocks < 1:
        raise ConfigError(f"tier {text!r}: give KIND=BLOCKS with a positive number of blocks, e.g. cpu=40000")
    bandwidth, latency = DEFAULT_LINKS[kind]
    return TierSpec(
        kind=kind,
        capacity_blocks=blocks,
        bandwidth_bytes_per_s=bandwidth if bandwidth_gb_per_s is None else bandwidth_gb_per_s * 1e9,
        latency_s=latency if latency_us is None else latency_us / 1e6,
        shared=kind is TierKind.REDIS,
    )


class TierStore:
    """The hashes one tier holds, least recently used first. O(1) per put, take and lookup."""

    __slots__ = ("spec", "below", "_lru", "num_stored", "num_evicted")

    def __init__(self, spec: TierSpec, below: TierStore | None = None) -> None:
        self.spec = spec
        self.below = below
        self._lru: OrderedDict[BlockHash, None] = OrderedDict()
        self.num_stored = 0  # hashes put here (demotions and refreshes)
        self.num_evicted = 0  # hashes pushed out (to the tier below, or dropped)

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self._lru

    def __len__(self) -> int:
        return len(self._lru)

    def put(self, block_hash: BlockHash) -> None:
        """Store (or refresh) ``block_hash`` as the most recent; the overflow moves to the tier below."""
        lru = self._lru
        self.num_stored += 1
        if block_hash in lru:
            lru.move_to_end(block_hash)
            return
        lru[block_hash] = None
        if len(lru) > self.spec.capacity_blocks:
            oldest, _ = lru.popitem(last=False)
            self.num_evicted += 1
            if self.below is not None:
                self.below.put(oldest)

    def take(self, block_hash: BlockHash) -> None:
        """A hit loaded into the GPU: a private tier lets the block go, a shared one refreshes it."""
        if self.spec.shared:
            self._lru.move_to_end(block_hash)
        else:
            del self._lru[block_hash]


def chain(specs: Sequence[TierSpec], shared: dict[TierKind, TierStore] | None = None) -> tuple[TierStore, ...]:
    """Stores for ``specs`` in lookup order, each spilling into the next; shared kinds come from ``shared``."""
    stores: list[TierStore] = []
    for spec in reversed(specs):
        below = stores[0] if stores else None
        if spec.shared and shared is not None:
            store = shared.get(spec.kind)
            if store is None:
                store = shared[spec.kind] = TierStore(spec, below)
        else:
            store = TierStore(spec, below)
        stores.insert(0, store)
    return tuple(stores)


class TieredManager(KVCacheManager):
    """A :class:`KVCacheManager` whose evicted blocks go down to offload tiers and whose lookups load them back.

    Args: those of :class:`KVCacheManager`, plus ``tiers``: the stores in lookup
    order (see :func:`chain`). Events are recorded internally to see evictions, and
    drained before every tier lookup: evictions happen only in allocations, so the
    tiers are current whenever they are read.

    ``loaded`` holds, per request ID, the tokens loaded for it from each tier
    (in the order of ``tiers``); ``take_loads`` drains the loads since the last
    call, as ``(tier index, blocks)`` pairs, one per tier per lookup.
    """

    def __init__(self, num_blocks: int, block_size: int = 16, *, tiers: Sequence[TierStore] = (), **kwargs: Any):
        if kwargs.get("groups"):
            raise ConfigError("the simulated tiers model one full-attention group; do not pass groups")
        super().__init__(num_blocks, block_size, enable_events=bool(tiers), **kwargs)
        self.tiers = tuple(tiers)
        self.loaded: dict[str, list[int]] = {}
        self._loads: list[tuple[int, int]] = []
        self._num_loads = 0

    # -- what a router sees --------------------------------------------------------

    def cached_prefix_tokens(self, request: Request) -> int:
        """Tokens of the request's prefix held here, in the GPU pool or a tier; changes nothing."""
        self.hash_request(request)
        self.demote_evicted()
        _, num_hit = self.coordinator.find_longest_cache_hit(request, request.num_tokens - 1)
        return num_hit + len(self._tier_run(request, num_hit)) * self.block_size

    # -- the connector's half -------------------------------------------------------

    def _tier_run(self, request: Request, num_hit: int) -> list[int]:
        """Tier index of each block after the GPU hit that some tier holds, up to the first that none does."""
        tiers = self.tiers
        if not tiers:
            return []
        hashes = request.block_hashes
        limit = (request.num_tokens - 1) // self.block_size
        run: list[int] = []
        for k in range(num_hit // self.block_size, min(limit, len(hashes))):
            block_hash = hashes[k]
            for t, tier in enumerate(tiers):
                if block_hash in tier:
                    run.append(t)
                    break
            else:
                break
        return run

    def get_computed_blocks(self, request: Request) -> tuple[HitBlocks, int]:
        self.demote_evicted()
        hit, num_hit = super().get_computed_blocks(request)
        run = self._tier_run(request, num_hit)
        if not run:
            return hit, num_hit
        bs = self.block_size
        length = num_hit + len(run) * bs
        self._num_loads += 1
        loader = Request(
            f"{request.request_id}\x00load{self._num_loads}",
            request.all_token_ids[:length],
            cache_salt=request.cache_salt,
            lora_name=request.lora_name,
        )
        loader_hit, loader_num_hit = super().get_computed_blocks(loader)
        if self.allocate_slots(loader, length - loader_num_hit, loader_num_hit, loader_hit) is None:
            return hit, num_hit  # no free GPU blocks to load into: the request computes them
        # The run leaves the tiers before the evictions it caused come down, as hits never count as evictions.
        hashes = request.block_hashes
        first = num_hit // bs
        per_tier = [0] * len(self.tiers)
        for k, t in enumerate(run):
            self.tiers[t].take(hashes[first + k])
            per_tier[t] += 1
        loader.num_computed_tokens = length
        self.free(loader)
        self.demote_evicted()
        counts = self.loaded.setdefault(request.request_id, [0] * len(self.tiers))
        for t, blocks in enumerate(per_tier):
            if blocks:
                counts[t] += blocks * bs
                self._loads.append((t, blocks))
        return super().get_computed_blocks(request)

    def demote_evicted(self) -> None:
        """Blocks the GPU evicted since the last call go to tier 0's most recent end, in eviction order.

        Called before every tier lookup, so the tiers are current whenever this manager reads
        them; a simulator whose tier is shared with other managers calls it after each step.
        """
        if not self.tiers:
            return
        top = self.tiers[0]
        for event in self.pool.take_events():
            if isinstance(event, BlockRemoved):
                for block_hash in event.block_hashes:
                    top.put(block_hash)

    def take_loads(self) -> list[tuple[int, int]]:
        loads, self._loads = self._loads, []
        return loads
