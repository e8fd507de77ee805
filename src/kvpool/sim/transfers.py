"""KV tiers in the simulator: the engine's own tier hierarchy, with a worker that only keeps time.

The simulator drives :class:`~kvpool.tiers.hierarchy.TierHierarchyConnector`, the
connector the engine uses, through the same :class:`~kvpool.scheduler.Scheduler`;
every lookup, load, save, spill and write policy decision is the engine's. Only the
worker differs: :class:`TimingWorker` moves no bytes. It keeps the keys a disk or
Redis tier holds (:class:`KeyStore`, least recently used first, bounded in blocks)
and accounts each transfer's time over the tier's :class:`TierLink`. The CPU tier's
bookkeeping is the connector's own :class:`~kvpool.tiers.hierarchy.HostTier`.

Tiers are the engine's specs (``cpu:4GiB``, ``disk:/path:50GiB``,
``redis://host:6379/0``, :func:`kvpool.tiers.store.parse_specs`); a size in bytes
becomes blocks through the block's bytes (``block_size x kv_bytes_per_token``).
A Redis spec bounds nothing (Redis evicts by its own policy), so the simulated
Redis tier is unbounded, and one store serves every replica.

Load or compute: each replica's connector takes the engine's rule
(:class:`~kvpool.tiers.load_or_compute.LoadOrCompute`) when :func:`build_tiers`
is given the replica's prefill rate. Its measurement is fed as the engine's is:
the timing worker notes each step's fetch from each tier (blocks, bytes, the
link's seconds), the replica each step's prefill tokens and seconds.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvpool.connector import ConnectorMetadata, TransferResult
from kvpool.errors import ConfigError
from kvpool.manager import KVCacheManager
from kvpool.tiers.disk import DiskTarget
from kvpool.tiers.hierarchy import ByteTier, HostTier, Tier, TierHierarchyConnector
from kvpool.tiers.kinds import CpuTarget, TierKind, WritePolicy
from kvpool.tiers.load_or_compute import LinkPrior, LoadOrCompute, TransferCosts
from kvpool.tiers.store import BACKENDS, TierTarget

__all__ = ["DEFAULT_LINKS", "KeyStore", "TierLink", "TimingWorker", "build_tiers", "capacity_blocks"]


@dataclass(frozen=True, slots=True, kw_only=True)
class TierLink:
    """What one transfer to or from a tier costs: one latency, then the bytes at the bandwidth."""

    bandwidth_bytes_per_s: float
    latency_s: float

    def __post_init__(self) -> None:
        bandwidth, latency = self.bandwidth_bytes_per_s, self.latency_s
        if isinstance(bandwidth, bool) or not isinstance(bandwidth, int | float) or not 0 < bandwidth < math.inf:
            raise ConfigError(f"a tier bandwidth must be a finite number > 0, got {bandwidth!r}")
        if isinstance(latency, bool) or not isinstance(latency, int | float) or not 0 <= latency < math.inf:
            raise ConfigError(f"a tier latency must be a finite number >= 0, got {latency!r}")

    def seconds(self, num_blocks: int, block_bytes: int) -> float:
        """One transfer of ``num_blocks`` blocks (0.0 for none)."""
        if num_blocks == 0:
            return 0.0
        return self.latency_s + num_blocks * block_bytes / self.bandwidth_bytes_per_s


#: Default links, from each backend's registry line: PCIe copies from pinned host memory, a local
#: NVMe drive, a Redis server over 10 Gb/s.
DEFAULT_LINKS: dict[TierKind, TierLink] = {
    kind: TierLink(bandwidth_bytes_per_s=backend.link[0], latency_s=backend.link[1])
    for kind, backend in BACKENDS.items()
}


def capacity_blocks(target: TierTarget, block_bytes: int) -> int | None:
    """Blocks of ``block_bytes`` a tier holds (None: unbounded, Redis); ConfigError if it holds none."""
    if isinstance(target, CpuTarget | DiskTarget):
        blocks = target.capacity_bytes // block_bytes
        if blocks < 1:
            raise ConfigError(
                f"the {target.kind.value} tier of {target.capacity_bytes} bytes holds no block of {block_bytes} bytes"
            )
        return blocks
    return None


class KeyStore:
    """The keys a byte tier holds, least recently used first; at most ``capacity`` (None: no bound). O(1) each."""

    def __init__(self, name: str, capacity: int | None) -> None:
        self.name = name
        self.capacity = capacity
        self._lru: OrderedDict[bytes, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._lru)

    def contains_prefix(self, keys: Sequence[bytes]) -> int:
        count = 0
        for key in keys:
            if key not in self._lru:
                break
            count += 1
        return count

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """An empty payload for each key held (now the most recent), None for a miss."""
        out: list[bytes | None] = []
        for key in keys:
            if key in self._lru:
                self._lru.move_to_end(key)
                out.append(b"")
            else:
                out.append(None)
        return out

    def put_many(self, keys: Sequence[bytes]) -> int:
        lru = self._lru
        for key in keys:
            lru[key] = None
            lru.move_to_end(key)
            if self.capacity is not None and len(lru) > self.capacity:
                lru.popitem(last=False)
        return len(keys)


class TimingWorker:
    """A :class:`~kvpool.connector.KVConnectorWorker` that moves nothing and accounts the time it would take.

    Per step and tier, a load (or a save) costs its link's latency plus its
    blocks' bytes at the link's bandwidth. A load whose key a byte tier no
    longer holds fails, as in the engine, and the scheduler computes it.
    ``take_load_seconds`` / ``take_save_seconds`` drain the time since the
    last call; ``blocks_loaded`` / ``blocks_saved`` count blocks by tier.
    ``costs`` (optional): the load-or-compute measurement, told each fetch.
    """

    def __init__(
        self,
        stores: Mapping[str, KeyStore],
        links: Mapping[str, TierLink],
        *,
        block_size: int,
        block_bytes: int,
        costs: TransferCosts | None = None,
    ) -> None:
        self.stores = dict(stores)
        self.block_size = block_size
        self.links = dict(links)
        self.block_bytes = block_bytes
        self.costs = costs
        self.blocks_loaded = dict.fromkeys(self.links, 0)
        self.blocks_saved = dict.fromkeys(self.links, 0)
        self._load_s = 0.0
        self._save_s = 0.0
        self._loaded: set[str] = set()
        self._saved: set[str] = set()
        self._failed: dict[str, int] = {}

    def start_load(self, meta: ConnectorMetadata) -> None:
        if meta.spills:
            self.save(ConnectorMetadata(saves=meta.spills))
        if not meta.loads:
            return
        first_failed: dict[str, int] = {}
        for load in meta.loads:
            store = self.stores.get(load.tier)
            if store is not None and store.get_many([load.key]) == [None]:
                first_failed[load.request_id] = min(first_failed.get(load.request_id, load.position), load.position)
        by_tier: dict[str, int] = {}
        for load in meta.loads:
            failed = first_failed.get(load.request_id)
            if failed is None or load.position < failed:
                by_tier[load.tier] = by_tier.get(load.tier, 0) + 1
        for tier, blocks in by_tier.items():
            seconds = self.links[tier].seconds(blocks, self.block_bytes)
            self.blocks_loaded[tier] += blocks
            self._load_s += seconds
            if self.costs is not None:
                self.costs.note_load(tier, blocks, blocks * self.block_bytes, seconds)
        self._loaded.update(load.request_id for load in meta.loads)
        for rid, position in first_failed.items():
            self._failed[rid] = position * self.block_size  # the tokens in place, from position 0

    def wait_for_layer_load(self, layer: int) -> None:
        """Nothing to wait for: a simulated load is complete when it starts."""

    def save(self, meta: ConnectorMetadata) -> None:
        by_tier: dict[str, list[bytes]] = {}
        for save in meta.saves:
            for tier in save.tiers:
                by_tier.setdefault(tier, []).append(save.key)
        for tier, keys in by_tier.items():
            store = self.stores.get(tier)
            if store is not None:
                store.put_many(keys)
            self.blocks_saved[tier] += len(keys)
            self._save_s += self.links[tier].seconds(len(keys), self.block_bytes)
        self._saved.update(s.request_id for s in meta.saves if s.request_id is not None)

    def get_finished(self) -> TransferResult:
        result = TransferResult(frozenset(self._loaded), frozenset(self._saved), dict(self._failed))
        self._loaded.clear()
        self._saved.clear()
        self._failed.clear()
        return result

    def take_load_seconds(self) -> float:
        seconds, self._load_s = self._load_s, 0.0
        return seconds

    def take_save_seconds(self) -> float:
        seconds, self._save_s = self._save_s, 0.0
        return seconds


def build_tiers(
    targets: Sequence[TierTarget],
    manager: KVCacheManager,
    *,
    block_bytes: int,
    write: WritePolicy,
    links: Mapping[TierKind, TierLink],
    shared: dict[TierKind, KeyStore],
    prefill_tokens_per_s: float | None = None,
    window_aware_saves: bool = False,
) -> tuple[TierHierarchyConnector, TimingWorker]:
    """The engine's connector over ``targets`` for one simulated replica, and its timing worker.

    A fleet-wide tier's store (Redis) is taken from (or put in) ``shared``: one for every replica.
    ``prefill_tokens_per_s``: the replica's prefill rate, the prior of the connector's
    load-or-compute rule (its links' priors are ``links``); None: every hit is loaded.
    ``window_aware_saves``: a hybrid model's window groups save only blocks still read (the connector's).
    """
    tiers: list[Tier] = []
    stores: dict[str, KeyStore] = {}
    for target in targets:
        capacity = capacity_blocks(target, block_bytes)
        if isinstance(target, CpuTarget):
            tiers.append(HostTier(capacity or 1))
            continue
        if BACKENDS[target.kind].fleet_wide:
            store = shared.setdefault(target.kind, KeyStore(target.kind.value, capacity))
        else:
            store = KeyStore(target.kind.value, capacity)
        stores[store.name] = store
        tiers.append(ByteTier(store))
    links_by_name = {t.kind.value: links[t.kind] for t in targets}
    costs = chooser = None
    if prefill_tokens_per_s is not None:
        priors = {
            name: LinkPrior(bandwidth_bytes_per_s=link.bandwidth_bytes_per_s, latency_s=link.latency_s)
            for name, link in links_by_name.items()
        }
        costs = TransferCosts(priors, block_bytes=block_bytes, prefill_tokens_per_s=prefill_tokens_per_s)
        # A simulated link never changes, so a declined tier is never probed: a probe would only cost time.
        chooser = LoadOrCompute(costs, block_size=manager.block_size, probe_every=None)
    connector = TierHierarchyConnector(
        manager, tiers, write=write, allow_fast_hash=True, chooser=chooser, window_aware_saves=window_aware_saves
    )
    worker = TimingWorker(stores, links_by_name, block_size=manager.block_size, block_bytes=block_bytes, costs=costs)
    return connector, worker
