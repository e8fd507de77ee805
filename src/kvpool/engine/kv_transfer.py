"""The engine's side of the KV tiers: host memory, bytes, and the copies to and from the KV cache.

``--kv-tier`` specs, in lookup order::

    cpu:4GiB                          host memory, sized in bytes (real tensor copies)
    disk:/var/cache/kvpool:50GiB      a directory (kvpool.tiers.DiskStore)
    redis://127.0.0.1:6379/0          a Redis server shared by replicas (rediss:// for TLS)

:func:`build_kv_tiers` turns them into the two halves of a connector:
:class:`~kvpool.connector.TierHierarchyConnector` (decisions, in the core) and
:class:`KVTransferWorker` (this module), which implements
:class:`~kvpool.connector.KVConnectorWorker`:

* the CPU tier is one host tensor ``[host blocks, layers, 2, block_size,
  kv_heads, head_dim]`` (pinned on CUDA); a host block holds one pool block's
  KV for every layer, at the slot the core's :class:`~kvpool.connector.HostTier`
  names;
* a byte tier (disk, Redis) receives that same block as bytes through the
  :class:`kvpool.tiers.store.BlockStore` protocol, which wraps it in an entry
  that cannot lie (layout fingerprint, checksum, optional HMAC);
* loads are copied into the pool's blocks before the forward pass reads them:
  on CUDA on a side stream, one event per layer, which the runner waits for
  just before that layer (:meth:`KVTransferWorker.wait_for_layer_load`); on
  the CPU at once;
* a byte tier that misses, fails or returns a payload of the wrong size makes
  that block and the request's later ones a failed load: the scheduler has
  them computed in the same step. Faults never stop serving.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from kvpool.connector import (
    BlockLoad,
    BlockSave,
    ByteTier,
    ConnectorMetadata,
    HostTier,
    TierHierarchyConnector,
    TransferResult,
)
from kvpool.engine.kv_cache import KVCaches
from kvpool.engine.memory import format_bytes
from kvpool.errors import ConfigError, KVPoolError
from kvpool.manager import KVCacheManager
from kvpool.planner import parse_size

if TYPE_CHECKING:
    from kvpool.scheduler import Scheduler, SchedulerOutput
    from kvpool.tiers.store import BlockStore

__all__ = ["KVTiers", "KVTransferWorker", "TierFigures", "build_kv_tiers", "check_tier_specs"]

_LOGGER = logging.getLogger("kvpool.engine")

#: Schemes of the Redis tier specs (the stores' module parses the rest).
_REDIS_PREFIXES = ("redis://", "rediss://", "redis+cluster://", "rediss+cluster://", "unix://")


def _cpu_bytes(spec: str) -> int | None:
    """The size of a ``cpu:SIZE`` spec, None for another kind of tier."""
    if not spec.startswith("cpu:"):
        return None
    size = parse_size(spec[len("cpu:") :], field=f"CPU tier size in {spec!r}")
    if size <= 0:
        raise ConfigError(f"the CPU tier size in {spec!r} must be positive")
    return size


def check_tier_specs(specs: Sequence[str]) -> tuple[str, ...]:
    """The tier specs, checked as far as it is possible without opening anything (EngineOptions asks)."""
    if isinstance(specs, str) or not isinstance(specs, Sequence):
        raise ConfigError(f"kv_tiers must be a list of tier specs such as 'cpu:4GiB', got {specs!r}")
    kinds: list[str] = []
    for spec in specs:
        if not isinstance(spec, str) or not spec.strip():
            raise ConfigError(f"a KV tier spec must be a non-empty string, got {spec!r}")
        if _cpu_bytes(spec) is not None:
            kind = "cpu"
        elif spec.startswith("disk:"):
            kind = "disk"
        elif spec.startswith(_REDIS_PREFIXES):
            kind = "redis"
        else:
            raise ConfigError(
                f"unknown KV tier {spec!r}: expected cpu:SIZE, disk:PATH:SIZE, redis://HOST:PORT/DB or rediss://..."
            )
        if kind in kinds:
            raise ConfigError(f"KV tier {kind!r} is given twice ({spec!r}); each kind of tier appears once")
        kinds.append(kind)
    return tuple(specs)


def _one_pair_per_layer(kv_caches: KVCaches) -> bool:
    """Whether layer ``i`` keeps its own tensor pair ``i`` (no layers sharing slots)."""
    slots = kv_caches.layer_slots
    return not slots or tuple(slots) == tuple(range(kv_caches.num_layers))


@dataclass(slots=True)
class TierFigures:
    """What the worker moved through one tier (cumulative)."""

    name: str
    blocks_loaded: int = 0
    blocks_saved: int = 0
    bytes_loaded: int = 0
    bytes_saved: int = 0
    load_seconds: float = 0.0
    save_seconds: float = 0.0
    failed_loads: int = 0  # blocks promised but not delivered (miss, fault, bad payload): computed instead
    failed_saves: int = 0  # blocks the store did not take

    def as_dict(self) -> dict[str, float | int]:
        figures: dict[str, float | int] = dataclasses.asdict(self)
        del figures["name"]
        return figures


class KVTransferWorker:
    """Copies blocks between the engine's KV cache and the tiers (see the module docstring).

    Args:
        kv_caches: the pool's memory; one tensor pair per layer (no shared slots).
        host_blocks: blocks of the CPU tier (0: none).
        stores: the byte tiers, by their ``name``.
    """

    def __init__(self, kv_caches: KVCaches, host_blocks: int, stores: Sequence[BlockStore]) -> None:
        if not _one_pair_per_layer(kv_caches):
            raise ConfigError("KV tiers need one KV tensor pair per layer (models with one layer group)")
        spec = kv_caches.spec
        self.kv_caches = kv_caches
        self.block_size = spec.block_size
        self.block_shape = (spec.num_layers, 2, spec.block_size, spec.num_kv_heads, spec.head_dim)
        self.block_bytes = spec.block_bytes
        self.device = kv_caches.device
        self._cuda = self.device.type == "cuda"
        self.host: torch.Tensor | None = None
        if host_blocks:
            # Never read before written: a host block is read only after a save filled it.
            self.host = torch.empty((host_blocks, *self.block_shape), dtype=spec.dtype, pin_memory=self._cuda)
        self.stores = {store.name: store for store in stores}
        self.figures: dict[str, TierFigures] = {
            name: TierFigures(name) for name in (["cpu"] if host_blocks else []) + list(self.stores)
        }
        cuda: Any = torch.cuda  # its Stream and Event constructors carry no annotations
        self._stream = cuda.Stream(self.device) if self._cuda else None
        self._new_event: Callable[[], Any] = cuda.Event
        self._events: list[Any] | None = None
        self._staging: torch.Tensor | None = None  # kept alive until the side stream has copied it
        self._loaded: set[str] = set()
        self._saved: set[str] = set()
        self._failed: dict[str, int] = {}

    # -- loads ------------------------------------------------------------------------

    def start_load(self, meta: ConnectorMetadata) -> None:
        self._events = None
        if not meta.loads:
            return
        sources: dict[int, torch.Tensor] = {}  # index in meta.loads -> that block's KV, [layers, 2, bs, heads, dim]
        failed: dict[str, int] = {}
        by_tier: dict[str, list[int]] = {}
        for i, load in enumerate(meta.loads):
            by_tier.setdefault(load.tier, []).append(i)
        for tier, indices in by_tier.items():
            figures = self.figures[tier]
            started = time.perf_counter()
            loads = [meta.loads[i] for i in indices]
            if tier == "cpu":
                host = self._host()
                for i, load in zip(indices, loads):
                    sources[i] = host[load.host_slot - 1]  # type: ignore[operator]  # CPU-tier loads name their host slot
            else:
                for i, load, block in zip(indices, loads, self._fetch(tier, loads)):
                    if block is None:
                        failed[load.request_id] = min(failed.get(load.request_id, 1 << 62), load.position)
                    else:
                        sources[i] = block
            figures.load_seconds += time.perf_counter() - started
        kept: list[tuple[BlockLoad, torch.Tensor]] = []
        for i, load in enumerate(meta.loads):
            first_failed = failed.get(load.request_id)
            if first_failed is not None and load.position >= first_failed:
                self.figures[load.tier].failed_loads += 1
                continue  # computed instead, with every later block of the request
            kept.append((load, sources[i]))
        if kept:
            self._copy_in(kept)
        for load, _ in kept:
            figures = self.figures[load.tier]
            figures.blocks_loaded += 1
            figures.bytes_loaded += self.block_bytes
        self._loaded.update(load.request_id for load in meta.loads)
        for rid, position in failed.items():
            self._failed[rid] = position * self.block_size

    def _host(self) -> torch.Tensor:
        if self.host is None:
            raise ConfigError("a CPU-tier transfer was planned, but this worker has no CPU tier")
        return self.host

    def _fetch(self, tier: str, loads: Sequence[BlockLoad]) -> list[torch.Tensor | None]:
        """The blocks' KV from a byte tier; None where it misses, fails or returns the wrong size."""
        store = self.stores[tier]
        try:
            payloads = store.get_many([load.key for load in loads])
        except Exception as exc:  # noqa: BLE001  # a store should not raise; if it does, these are misses
            _LOGGER.warning("KV tier %s: a load failed (%s); those tokens are computed instead", tier, exc)
            return [None] * len(loads)
        blocks: list[torch.Tensor | None] = []
        dtype = self.kv_caches.spec.dtype
        for payload in payloads:
            if payload is None or len(payload) != self.block_bytes:
                blocks.append(None)
                continue
            raw = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
            blocks.append(raw.view(dtype).view(self.block_shape))
        return blocks

    def _copy_in(self, kept: list[tuple[BlockLoad, torch.Tensor]]) -> None:
        """Write the loaded blocks into the pool, layer by layer (on CUDA on a side stream, one event per layer)."""
        staging = torch.stack([block for _, block in kept])  # [n, layers, 2, bs, heads, dim]
        ids = torch.tensor([load.block_id for load, _ in kept], dtype=torch.int64)
        caches = self.kv_caches
        if self._stream is None:
            for layer in range(caches.num_layers):
                caches.key_caches[layer].index_copy_(0, ids, staging[:, layer, 0])
                caches.value_caches[layer].index_copy_(0, ids, staging[:, layer, 1])
            return
        staging = staging.pin_memory()
        self._staging = staging
        events = []
        self._stream.wait_stream(torch.cuda.current_stream(self.device))  # the blocks' last readers first
        with torch.cuda.stream(self._stream):
            device_ids = ids.to(self.device, non_blocking=True)
            for layer in range(caches.num_layers):
                chunk = staging[:, layer].to(self.device, non_blocking=True)
                caches.key_caches[layer].index_copy_(0, device_ids, chunk[:, 0])
                caches.value_caches[layer].index_copy_(0, device_ids, chunk[:, 1])
                event = self._new_event()
                event.record(self._stream)
                events.append(event)
        self._events = events

    def wait_for_layer_load(self, layer: int) -> None:
        events = self._events
        if events is not None:
            torch.cuda.current_stream(self.device).wait_event(events[layer])

    # -- saves ------------------------------------------------------------------------

    def save(self, meta: ConnectorMetadata) -> None:
        saves = meta.saves
        if not saves:
            return
        started = time.perf_counter()
        caches = self.kv_caches
        ids = torch.tensor([s.block_id for s in saves], dtype=torch.int64, device=self.device)
        staging = torch.empty((len(saves), *self.block_shape), dtype=caches.spec.dtype, pin_memory=self._cuda)
        for layer in range(caches.num_layers):
            staging[:, layer, 0].copy_(caches.key_caches[layer].index_select(0, ids))
            staging[:, layer, 1].copy_(caches.value_caches[layer].index_select(0, ids))
        gathered = time.perf_counter() - started
        by_tier: dict[str, list[int]] = {}
        for j, save in enumerate(saves):
            for tier in save.tiers:
                by_tier.setdefault(tier, []).append(j)
        for tier, rows in by_tier.items():
            figures = self.figures[tier]
            started = time.perf_counter()
            if tier == "cpu":
                host = self._host()
                slots = torch.tensor([saves[j].host_slot - 1 for j in rows], dtype=torch.int64)  # type: ignore[operator]  # CPU-tier saves name their host slot
                host.index_copy_(0, slots, staging[rows])
                stored = len(rows)
            else:
                stored = self._put(tier, saves, rows, staging)
            figures.save_seconds += time.perf_counter() - started + gathered * len(rows) / len(saves)
            figures.blocks_saved += stored
            figures.bytes_saved += stored * self.block_bytes
            figures.failed_saves += len(rows) - stored
        self._saved.update(s.request_id for s in saves)

    def _put(self, tier: str, saves: Sequence[BlockSave], rows: list[int], staging: torch.Tensor) -> int:
        raw = staging.view(torch.uint8).reshape(len(saves), -1).numpy()
        items = [(saves[j].key, raw[j].tobytes()) for j in rows]
        try:
            return int(self.stores[tier].put_many(items))
        except Exception as exc:  # noqa: BLE001  # a store should not raise; if it does, the blocks are unsaved
            _LOGGER.warning("KV tier %s: a save failed (%s)", tier, exc)
            return 0

    def get_finished(self) -> TransferResult:
        result = TransferResult(frozenset(self._loaded), frozenset(self._saved), dict(self._failed))
        self._loaded.clear()
        self._saved.clear()
        self._failed.clear()
        return result

    def close(self) -> None:
        for store in self.stores.values():
            try:
                store.close()
            except Exception as exc:  # noqa: BLE001  # closing is best effort
                _LOGGER.warning("KV tier %s: close failed (%s)", store.name, exc)


@dataclass(eq=False)
class KVTiers:
    """The connector's two halves over one engine, and the step hooks that drive them."""

    connector: TierHierarchyConnector
    worker: KVTransferWorker
    specs: tuple[str, ...]
    host: HostTier | None = None
    stores: tuple[Any, ...] = field(default_factory=tuple)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.connector.tiers)

    def before_forward(self, scheduler: Scheduler, plan: SchedulerOutput) -> SchedulerOutput:
        """Start the step's loads; the plan to run (failed loads are computed instead)."""
        meta = plan.connector_meta
        if meta is None or not meta.loads:
            return plan
        self.worker.start_load(meta)
        return scheduler.apply_transfers(plan, self.worker.get_finished())

    def after_forward(self, scheduler: Scheduler, plan: SchedulerOutput) -> SchedulerOutput:
        """Send the step's saves and report them."""
        meta = plan.connector_meta
        if meta is None or not meta.saves:
            return plan
        self.worker.save(meta)
        return scheduler.apply_transfers(plan, self.worker.get_finished())

    def recover(self, scheduler: Scheduler, plan: SchedulerOutput) -> None:
        """After the step of ``plan`` failed: drop its transfers, so that no tier keeps what was never written."""
        self.worker.get_finished()  # whatever it had finished belongs to the failed step
        self.connector.reset()
        meta = plan.connector_meta
        if meta:
            rids = frozenset([*(t.request_id for t in meta.loads), *(t.request_id for t in meta.saves)])
            try:
                scheduler.apply_transfers(plan, TransferResult(finished_loads=rids, finished_saves=rids))
            except KVPoolError:
                pass  # the plan was already applied or superseded: nothing waits on it

    def figures(self) -> dict[str, dict[str, Any]]:
        """Per tier: what the worker moved, what the connector decided, and the store's own counters."""
        out: dict[str, dict[str, Any]] = {}
        for name in self.names:
            row: dict[str, Any] = dict(self.worker.figures[name].as_dict())
            counters = self.connector.counters[name]
            row.update(hit_blocks=counters.hit_blocks, saved_blocks=counters.saved_blocks)
            store = self.worker.stores.get(name)
            if store is not None:
                stats = store.stats
                row.update(
                    hits=stats.hits, misses=stats.misses, corrupt=stats.corrupt, errors=stats.errors,
                    evictions=stats.evictions, corrupt_by_kind=dict(stats.corrupt_by_kind),
                )  # fmt: skip
            out[name] = row
        return out

    def close(self) -> None:
        self.worker.close()


def read_secret(path: str | os.PathLike[str]) -> bytes:
    """The tier secret in the file at ``path`` (surrounding whitespace removed)."""
    try:
        secret = Path(path).read_bytes().strip()
    except OSError as exc:
        raise ConfigError(f"cannot read the KV tier secret file {str(path)!r}: {exc.strerror}") from None
    if not secret:
        raise ConfigError(f"the KV tier secret file {str(path)!r} is empty")
    return secret


def build_kv_tiers(
    specs: Sequence[str],
    secret_file: str | os.PathLike[str] | None,
    kv_caches: KVCaches,
    manager: KVCacheManager,
    architecture: str,
    log: Callable[[str], None],
) -> KVTiers | None:
    """Open the tiers ``specs`` name, in lookup order; None when there are none."""
    specs = check_tier_specs(specs)
    if not specs:
        if secret_file is not None:
            raise ConfigError("kv_tier_secret_file is given but no KV tier is")
        return None
    from kvpool.tiers.entry import EntryCodec, LayoutFingerprint
    from kvpool.tiers.store import open_store

    if not _one_pair_per_layer(kv_caches) or len(manager.groups) != 1:
        raise ConfigError("KV tiers support models with one full-attention layer group")
    spec = kv_caches.spec
    seed = manager.hasher.seed
    fingerprint = LayoutFingerprint(
        architecture=architecture,
        num_layers=spec.num_layers,
        num_kv_heads=spec.num_kv_heads,
        head_size=spec.head_dim,
        dtype=str(spec.dtype).removeprefix("torch."),
        block_size=spec.block_size,
        hash_algo=manager.hasher.algo.value,
        hash_seed=seed.hex() if isinstance(seed, bytes) else repr(seed),
    )
    secret = None if secret_file is None else read_secret(secret_file)
    codec = EntryCodec(fingerprint, secret)
    tiers: list[HostTier | ByteTier] = []
    stores: list[BlockStore] = []
    host: HostTier | None = None
    try:
        for one in specs:
            size = _cpu_bytes(one)
            if size is not None:
                blocks = size // spec.block_bytes
                if blocks < 1:
                    raise ConfigError(f"the CPU tier {one!r} holds no block of {spec.block_bytes} bytes")
                host = HostTier(blocks)
                tiers.append(host)
                log(
                    f"KV tier cpu: {blocks:,} blocks of {format_bytes(spec.block_bytes)} ({format_bytes(size)} of host memory)"
                )
                continue
            store = open_store(one, codec)
            stores.append(store)
            tiers.append(ByteTier(store))
            log(f"KV tier {store.name}: {one}" + ("" if secret is None else " (entries signed)"))
    except BaseException:
        for store in stores:
            store.close()
        raise
    connector = TierHierarchyConnector(manager, tiers)
    worker = KVTransferWorker(kv_caches, host.num_blocks if host is not None else 0, stores)
    return KVTiers(connector=connector, worker=worker, specs=specs, host=host, stores=tuple(stores))
