"""The engine's side of the KV tiers: host memory, bytes, and the copies to and from the KV cache.

``--kv-tier`` specs, in lookup order::

    cpu:4GiB                          host memory, sized in bytes (real tensor copies)
    disk:/var/cache/kvpool:50GiB      a directory (kvpool.tiers.DiskStore)
    redis://127.0.0.1:6379/0          a Redis server shared by replicas (rediss:// for TLS)

:func:`build_kv_tiers` parses them once (:func:`kvpool.tiers.store.parse_specs`) and
turns them into the two halves of a connector:
:class:`~kvpool.tiers.hierarchy.TierHierarchyConnector` (decisions, torch-free,
with its :class:`~kvpool.tiers.kinds.WritePolicy`) and :class:`KVTransferWorker`
(this module), which implements :class:`~kvpool.connector.KVConnectorWorker`:

* the CPU tier is one host tensor ``[host blocks, layers, 2, block_size,
  kv_heads, head_dim]`` (pinned on CUDA); a host block holds one pool block's
  KV for every layer, at the slot :class:`~kvpool.tiers.hierarchy.HostTier`
  names;
* a write-back spill (a block the pool evicted this step) is copied out at
  the start of :meth:`KVTransferWorker.start_load`, before loads and the
  forward pass write that block again;
* a byte tier (disk, Redis) receives that same block as bytes through the
  :class:`kvpool.tiers.store.BlockStore` protocol, which wraps it in an entry
  that cannot lie (layout fingerprint with the weights' digest, checksum,
  optional MAC);
* loads are copied into the pool's blocks before the forward pass reads them:
  on CUDA on a side stream, one event per layer, which the runner waits for
  just before that layer (:meth:`KVTransferWorker.wait_for_layer_load`); on
  the CPU at once;
* with transfer threads (:class:`~kvpool.tiers.transfer_threads.TransferThreads`,
  the default), byte tiers never run on the step: a request's disk or Redis
  blocks are fetched on a load thread into memory of its own while the batch
  steps on, and copied into the pool by :meth:`KVTransferWorker.get_finished`
  once they are all there. A fetch reads its blocks in pieces, in order, and its
  request waits only as long as computing them would take
  (:meth:`~kvpool.tiers.load_or_compute.TransferCosts.load_wait`, within the fixed
  load deadline): past that it takes the blocks that arrived and computes the
  rest, whose late bytes are never copied; a fetch that fails is a failed load
  from its first missing block, and the request computes those tokens. Saves to byte tiers are
  copied out of the pool on the step and stored by the save thread; one that
  finds the save queue full is dropped and counted;
* a byte tier that misses, fails or returns a payload of the wrong size makes
  that block and the request's later ones a failed load: the scheduler has
  them computed (in the same step for a synchronous load). Faults never stop
  serving.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from kvpool.connector import BlockLoad, BlockSave, ConnectorMetadata, TransferResult
from kvpool.engine.kv_cache import KVCaches
from kvpool.engine.memory import format_bytes
from kvpool.errors import ConfigError
from kvpool.manager import KVCacheManager
from kvpool.secret_files import read_secret_file
from kvpool.tiers.hierarchy import ByteTier, HostTier, TierHierarchyConnector
from kvpool.tiers.kinds import CpuTarget, TierKind, WritePolicy
from kvpool.tiers.load_or_compute import LoadOrCompute, TransferCosts, registry_links
from kvpool.tiers.piece_fetch import DeadlineMiss, PieceFetch, tier_runs
from kvpool.tiers.store import TierTarget, check_tier_trust, parse_specs
from kvpool.tiers.transfer_threads import DEFAULT_LOAD_DEADLINE_S, TransferThreads
from kvpool.tiers.weights import tier_weights

if TYPE_CHECKING:
    from kvpool.scheduler import Scheduler, SchedulerOutput
    from kvpool.tiers.store import BlockStore

__all__ = ["KVTiers", "KVTransferWorker", "TierFigures", "build_kv_tiers", "check_tier_specs", "tier_weights"]

_LOGGER = logging.getLogger("kvpool.engine")


_CPU = TierKind.CPU.value

#: The prefill rate load or compute assumes until the first step is measured (tokens/s), on the CPU
#: and on CUDA: a guess of the right order that the first prefill replaces.
_PREFILL_PRIOR = {False: 2_000.0, True: 20_000.0}


def check_tier_specs(specs: Sequence[str]) -> tuple[str, ...]:
    """The tier specs as a tuple of strings (EngineOptions asks, then parses them once: ``kv_tier_targets``)."""
    if isinstance(specs, str) or not isinstance(specs, Sequence):
        raise ConfigError(f"kv_tiers must be a list of tier specs such as 'cpu:4GiB', got {specs!r}")
    return tuple(specs)


def _block_major(kv_caches: KVCaches) -> torch.Tensor | None:
    """A ``[blocks, layers, 2, bs, heads, dim]`` view of the pool's one buffer, if its tensors are views of it."""
    first = kv_caches.key_caches[0]
    if not first.is_contiguous():
        return None
    per_block = first[0].numel()
    n = kv_caches.num_blocks
    layer_stride = 2 * n * per_block
    for layer, pair in enumerate(zip(kv_caches.key_caches, kv_caches.value_caches)):
        for kv, tensor in enumerate(pair):
            offset = layer * layer_stride + kv * n * per_block
            if not tensor.is_contiguous() or tensor.storage_offset() != first.storage_offset() + offset:
                return None
            if tensor.untyped_storage().data_ptr() != first.untyped_storage().data_ptr():
                return None
    inner = first.shape[1:]
    strides = (per_block, layer_stride, n * per_block, *first.stride()[1:])
    return first.as_strided((n, kv_caches.num_layers, 2, *inner), strides)


def _row_views(staging: torch.Tensor, rows: Sequence[int]) -> list[memoryview]:
    """Writable byte views of ``rows`` of a contiguous CPU tensor of blocks (no copy)."""
    raw: Any = staging.view(torch.uint8).reshape(staging.shape[0], -1).numpy()
    flat = memoryview(raw.reshape(-1))
    size = raw.shape[1]
    return [flat[row * size : (row + 1) * size] for row in rows]


def _runs(src: Sequence[int], dst: Sequence[int]) -> list[tuple[int, int, int]]:
    """``(first source, first destination, length)`` of the runs where both indices step by one."""
    runs: list[tuple[int, int, int]] = []
    for a, b in zip(src, dst):
        if runs:
            a0, b0, k = runs[-1]
            if a == a0 + k and b == b0 + k:
                runs[-1] = (a0, b0, k + 1)
                continue
        runs.append((a, b, 1))
    return runs


def _one_pair_per_layer(kv_caches: KVCaches) -> bool:
    """Whether layer ``i`` keeps its own tensor pair ``i`` (no layers sharing slots)."""
    slots = kv_caches.layer_slots
    return not slots or tuple(slots) == tuple(range(kv_caches.num_layers))


@dataclass(slots=True)
class _AsyncFetch:
    """One request's byte-tier blocks, fetched on a load thread into ``staging`` (row ``i``: ``loads[i]``).

    ``fetch`` (:class:`~kvpool.tiers.piece_fetch.PieceFetch`) reads them in pieces and says how long
    the request waits and what it keeps; rows before its ``landed`` are verified and never written again.
    """

    request_id: str
    loads: tuple[BlockLoad, ...]
    staging: torch.Tensor
    fetch: PieceFetch
    #: Byte views of the staging rows, made on the caller's thread (no torch on a load thread).
    views: list[memoryview] = field(default_factory=list)


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
    timed_out_loads: int = 0  # blocks abandoned by fetches past their deadline (counted in failed_loads too)
    deadline_misses: int = 0  # fetches past their deadline
    kept_at_deadline: int = 0  # blocks such fetches had brought, used (counted in blocks_loaded too)
    dropped_saves: int = 0  # blocks not saved because the save queue was full

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
        threads: where byte-tier fetches and stores run (None: on the caller's thread, in the step).
        costs: told every fetch's size and time (load or compute decides by them); None: nobody.
    """

    def __init__(
        self,
        kv_caches: KVCaches,
        host_blocks: int,
        stores: Sequence[BlockStore],
        threads: TransferThreads | None = None,
        costs: TransferCosts | None = None,
    ) -> None:
        if not _one_pair_per_layer(kv_caches):
            raise ConfigError("KV tiers need one KV tensor pair per layer (models with one layer group)")
        spec = kv_caches.spec
        self.kv_caches = kv_caches
        self.block_size = spec.block_size
        #: One block's KV for every layer, as a byte tier stores it.
        self.block_shape = (spec.num_layers, 2, spec.block_size, spec.num_kv_heads, spec.head_dim)
        self.block_bytes = spec.block_bytes
        self.device = kv_caches.device
        self._cuda = self.device.type == "cuda"
        self.host: torch.Tensor | None = None
        if host_blocks:
            # Block-major, [host blocks, layers, 2, bs, heads, dim], as a byte tier's payload: a host block
            # is one contiguous run, so a run of blocks is one copy. Never read before written.
            self.host = torch.empty((host_blocks, *self.block_shape), dtype=spec.dtype, pin_memory=self._cuda)
        # The pool's blocks seen block-major ([blocks, layers, 2, bs, heads, dim]) over its one buffer, for
        # copies of whole blocks on the CPU; None where the caches are not laid out that way.
        self._blocks = None if self._cuda else _block_major(kv_caches)
        self.stores = {store.name: store for store in stores}
        self.figures: dict[str, TierFigures] = {
            name: TierFigures(name) for name in ([_CPU] if host_blocks else []) + list(self.stores)
        }
        cuda: Any = torch.cuda  # its Stream and Event constructors carry no annotations
        self._stream = cuda.Stream(self.device) if self._cuda else None
        self._new_event: Callable[[], Any] = cuda.Event
        self._events: list[Any] | None = None
        # Byte tiers' blocks on their way in and out, kept between steps (fresh pages cost more than the copy).
        self._buffers: dict[str, torch.Tensor] = {}
        self._loaded: set[str] = set()
        self._saved: set[str] = set()
        self._failed: dict[str, int] = {}
        self.threads = threads
        self.costs = costs
        self._fetches: dict[int, _AsyncFetch] = {}  # ticket -> what it fetches
        self._fetching: dict[str, int] = {}  # request -> the first position of its asynchronous loads
        self._late: list[_AsyncFetch] = []  # abandoned fetches whose thread still reads a piece: timed when done

    def _rows(self, purpose: str, n: int) -> torch.Tensor:
        """``n`` blocks of host staging for ``purpose`` (``"load"`` or ``"save"``), grown on demand."""
        buffer = self._buffers.get(purpose)
        if buffer is None or buffer.shape[0] < n:
            size = max(n, 2 * buffer.shape[0]) if buffer is not None else n
            buffer = torch.empty((size, *self.block_shape), dtype=self.kv_caches.spec.dtype, pin_memory=self._cuda)
            self._buffers[purpose] = buffer
        return buffer[:n]

    def _host(self) -> torch.Tensor:
        if self.host is None:
            raise ConfigError("a CPU-tier transfer was planned, but this worker has no CPU tier")
        return self.host

    # -- loads ------------------------------------------------------------------------

    def start_load(self, meta: ConnectorMetadata) -> None:
        self._events = None
        if meta.spills:
            self.save(ConnectorMetadata(saves=meta.spills))  # before anything writes those blocks again
        if not meta.loads:
            return
        later = [load for load in meta.loads if load.asynchronous]
        if later:
            self._start_async(later)
            now = tuple(load for load in meta.loads if not load.asynchronous)
            if not now:
                return
            meta = dataclasses.replace(meta, loads=now)
        failed: dict[str, int] = {}  # request -> first block position that did not arrive
        byte_loads = [i for i, load in enumerate(meta.loads) if load.tier != _CPU]
        staging = self._rows("load", len(byte_loads))
        row_of: dict[int, int] = {}  # index in meta.loads -> its staging row, once verified there
        by_tier: dict[str, list[int]] = {}
        for row, i in enumerate(byte_loads):
            by_tier.setdefault(meta.loads[i].tier, []).append(row)
        for tier, rows in by_tier.items():
            started = time.perf_counter()
            loads = [meta.loads[byte_loads[row]] for row in rows]
            for row, load, arrived in zip(rows, loads, self._fetch_into(tier, loads, _row_views(staging, rows))):
                if arrived:
                    row_of[byte_loads[row]] = row
                else:
                    failed[load.request_id] = min(failed.get(load.request_id, 1 << 62), load.position)
            seconds = time.perf_counter() - started
            self.figures[tier].load_seconds += seconds
            if self.costs is not None:
                self.costs.note_load(tier, len(rows), len(rows) * self.block_bytes, seconds)
        from_host: list[BlockLoad] = []
        from_bytes: list[tuple[BlockLoad, int]] = []
        for i, load in enumerate(meta.loads):
            first_failed = failed.get(load.request_id)
            if first_failed is not None and load.position >= first_failed:
                self.figures[load.tier].failed_loads += 1
                continue  # computed instead, with every later block of the request
            if load.tier == _CPU:
                from_host.append(load)
            else:
                from_bytes.append((load, row_of[i]))
        started = time.perf_counter()
        self._copy_in(from_host, from_bytes, staging)
        seconds = (time.perf_counter() - started) / max(1, len(from_host) + len(from_bytes))
        for load in (*from_host, *(load for load, _ in from_bytes)):
            figures = self.figures[load.tier]
            figures.blocks_loaded += 1
            figures.bytes_loaded += self.block_bytes
            figures.load_seconds += seconds
        self._loaded.update(load.request_id for load in meta.loads)
        for rid, position in failed.items():
            self._failed[rid] = position * self.block_size

    def _start_async(self, loads: Sequence[BlockLoad]) -> None:
        """Begin asynchronous loads: host blocks are copied now, each request's byte-tier blocks fetched off the step."""
        threads = self.threads
        by_request: dict[str, list[BlockLoad]] = {}
        for load in loads:
            by_request.setdefault(load.request_id, []).append(load)
        for rid, mine in by_request.items():
            self._fetching[rid] = min(load.position for load in mine)
            from_host = [load for load in mine if load.tier == _CPU]
            fetched = tuple(load for load in mine if load.tier != _CPU)
            if from_host:
                self._copy_in_now(from_host, [], None)
                self._count_loaded(from_host, 0.0)
            if not fetched:
                self._loaded.add(rid)  # nothing to wait for (a match of the CPU tier only)
                del self._fetching[rid]
                continue
            staging = torch.empty((len(fetched), *self.block_shape), dtype=self.kv_caches.spec.dtype)
            tiers = [load.tier for load in fetched]
            wait = None
            if threads is not None and self.costs is not None:  # waited for only as long as computing takes
                wait = self.costs.load_wait(tier_runs(tiers), block_size=self.block_size, cap_s=threads.load_deadline_s)
            fetch = PieceFetch(tiers, wait, fixed_deadline_s=self._fixed_deadline(), clock=self._clock())
            job = _AsyncFetch(rid, fetched, staging, fetch, _row_views(staging, range(len(fetched))))
            if threads is None:  # no threads: the fetch runs here, and is reported at the next get_finished
                self._land(job, self._fetch(job), None)
                continue
            deadline = None if wait is None else fetch.deadline_s
            self._fetches[threads.submit_load(functools.partial(self._fetch, job), deadline=deadline)] = job

    def _fetch(self, job: _AsyncFetch) -> list[bool]:
        """On a load thread: every byte-tier block of one request into its staging rows, piece by piece, in order.

        Stops before the next piece once the caller abandoned the fetch (its request stopped waiting).
        """

        def read(tier: str, start: int, stop: int) -> list[bool]:
            began = time.perf_counter()
            got = self._fetch_into(tier, job.loads[start:stop], job.views[start:stop])
            self.figures[tier].load_seconds += time.perf_counter() - began
            return got

        return job.fetch.run(read)

    def _land(self, job: _AsyncFetch, arrived: list[bool] | None, reason: str | None) -> None:
        """On the caller's thread: copy what a fetch brought into the pool, up to its first miss, and report it.

        ``arrived`` None: the fetch raised or ran past its deadline; the whole pieces that landed
        before (a leading run of blocks) are used, the rest computed.
        """
        rid = job.request_id
        self._fetching.pop(rid, None)
        timed_out = reason == "timed out"
        if arrived is None:
            given = job.fetch.abandon(timed_out=timed_out)  # the thread reads no piece after this one
            self._note_costs(given.timings)
            kept = given.kept
            if timed_out and given.miss is None:
                reason, timed_out = None, False  # it all landed just as its deadline passed: a load in time
            elif given.miss is not None:
                self._missed(job, kept, given.miss)
            if given.running:
                self._late.append(job)  # its piece's real time is measured when the thread is done with it
            if reason is not None:
                _LOGGER.warning(
                    "KV tier load for request %s: %s; %d of its %d blocks arrived, the rest are computed",
                    rid, reason, kept, len(job.loads),
                )  # fmt: skip
        else:
            self._note_costs(job.fetch.take_timings())
            kept = 0
            while kept < len(arrived) and arrived[kept]:
                kept += 1
        if kept:
            self._copy_in_now([], [(load, row) for row, load in enumerate(job.loads[:kept])], job.staging)
            self._count_loaded(job.loads[:kept], 0.0)
        for load in job.loads[kept:]:
            figures = self.figures[load.tier]
            figures.failed_loads += 1
            if timed_out:
                figures.timed_out_loads += 1
        self._loaded.add(rid)
        if kept < len(job.loads):
            self._failed[rid] = job.loads[kept].position * self.block_size

    def _missed(self, job: _AsyncFetch, kept: int, miss: DeadlineMiss) -> None:
        """A fetch ran past its deadline with ``kept`` blocks in: counted, and told to the measurement."""
        self.figures[miss.tier].deadline_misses += 1
        for load in job.loads[:kept]:
            self.figures[load.tier].kept_at_deadline += 1
        if self.costs is not None:
            miss.tell(self.costs)

    def _clock(self) -> Callable[[], float]:
        """The clock deadlines are kept by (the transfer threads'), which a late piece is timed by too."""
        return time.monotonic if self.threads is None else self.threads.clock

    def _fixed_deadline(self) -> float:
        return self.threads.load_deadline_s if self.threads is not None else DEFAULT_LOAD_DEADLINE_S

    def _note_costs(self, timings: Sequence[tuple[str, int, float]]) -> None:
        """Tell the measurement what a fetch's pieces took."""
        costs = self.costs
        if costs is not None:
            for tier, blocks, seconds in timings:
                costs.note_load(tier, blocks, blocks * self.block_bytes, seconds)

    def _note_late(self) -> None:
        """Measure the pieces abandoned fetches were reading, now that their threads are done with them."""
        late = []
        for job in self._late:
            done, owed, timings = job.fetch.late_done()
            if done:
                self._note_costs(timings)
                if owed is not None and self.costs is not None:
                    self.costs.note_late_piece_done(owed)
            else:
                late.append(job)
        self._late = late

    def _copy_in_now(
        self, from_host: list[BlockLoad], from_bytes: list[tuple[BlockLoad, int]], staging: torch.Tensor | None
    ) -> None:
        """Copy loads into the pool outside the forward pass's layer waits (ordered before later work on CUDA)."""
        events = self._events
        self._copy_in(from_host, from_bytes, staging)  # type: ignore[arg-type]  # staging is read only for byte loads
        if self._stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self._stream)
        self._events = events

    def _count_loaded(self, loads: Sequence[BlockLoad], seconds: float) -> None:
        for load in loads:
            figures = self.figures[load.tier]
            figures.blocks_loaded += 1
            figures.bytes_loaded += self.block_bytes
            figures.load_seconds += seconds

    def drop_async_loads(self) -> dict[str, int]:
        """Forget every asynchronous load in flight (their late bytes are never copied); request -> its first token.

        What the engine reports as failed loads, when what it planned is void.
        """
        dropped = {rid: position * self.block_size for rid, position in self._fetching.items()}
        for job in self._fetches.values():
            job.fetch.stop()  # its thread reads no further piece
        self._fetches.clear()
        self._fetching.clear()
        return dropped

    @property
    def num_fetching(self) -> int:
        """Requests whose asynchronous loads are in flight."""
        return len(self._fetching)

    @property
    def num_late(self) -> int:
        """Fetches their requests stopped waiting for, whose threads still read a piece (measured when done)."""
        return len(self._late)

    def wait_for_fetches(self, timeout: float) -> None:
        """Block until a fetch in flight ends or reaches its deadline, at most ``timeout`` seconds."""
        if self.threads is not None and self._fetches:
            self.threads.wait_for_loads(timeout)

    def _fetch_into(self, tier: str, loads: Sequence[BlockLoad], buffers: list[memoryview]) -> list[bool]:
        """Read the blocks from a byte tier straight into their staging rows' ``buffers``; whether each arrived, verified."""
        try:
            return [bool(ok) for ok in self.stores[tier].get_many_into([load.key for load in loads], buffers)]
        except Exception as exc:  # noqa: BLE001  # a store should not raise; if it does, these are misses
            _LOGGER.warning("KV tier %s: a load failed (%s); those tokens are computed instead", tier, exc)
            return [False] * len(loads)

    def _copy_in(
        self, from_host: list[BlockLoad], from_bytes: list[tuple[BlockLoad, int]], staging: torch.Tensor
    ) -> None:
        """Write the loaded blocks into the pool: runs of whole blocks on the CPU, layer by layer on CUDA."""
        if not from_host and not from_bytes:
            return
        host_src = [load.host_slot - 1 for load in from_host]  # type: ignore[operator]  # CPU-tier loads name their host slot
        host_dst = [load.block_id for load in from_host]
        rows = [row for _, row in from_bytes]
        bytes_dst = [load.block_id for load, _ in from_bytes]
        blocks = self._blocks
        if blocks is not None:  # one copy per run of consecutive blocks, every layer at once
            host = self.host
            for src, dst, k in _runs(host_src, host_dst):
                blocks[dst : dst + k].copy_(host[src : src + k])  # type: ignore[index]  # CPU-tier loads only with a host buffer
            for src, dst, k in _runs(rows, bytes_dst):
                blocks[dst : dst + k].copy_(staging[src : src + k])
            return
        self._copy_in_by_layer(host_src, host_dst, rows, bytes_dst, staging)

    def _copy_in_by_layer(
        self, host_src: list[int], host_dst: list[int], rows: list[int], bytes_dst: list[int], staging: torch.Tensor
    ) -> None:
        """Loads layer by layer (on CUDA on a side stream, one event per layer the forward pass waits for)."""
        caches = self.kv_caches
        device = self.device
        host_index = torch.tensor(host_src, dtype=torch.int64)
        host_to = torch.tensor(host_dst, dtype=torch.int64)
        rows_index = torch.tensor(rows, dtype=torch.int64)
        bytes_to = torch.tensor(bytes_dst, dtype=torch.int64)
        host = self.host
        stream = self._stream
        events: list[Any] = []
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(device))  # the blocks' last readers first
            host_to, bytes_to = host_to.to(device), bytes_to.to(device)
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            for layer in range(caches.num_layers):
                pair = (caches.key_caches[layer], caches.value_caches[layer])
                if host_src:
                    stored = host[:, layer].index_select(0, host_index)  # type: ignore[index]  # CPU-tier loads only with a host buffer
                    for kv in (0, 1):
                        pair[kv].index_copy_(0, host_to, stored[:, kv].to(device, non_blocking=True))
                if rows:
                    staged = staging[:, layer].index_select(0, rows_index)
                    for kv in (0, 1):
                        pair[kv].index_copy_(0, bytes_to, staged[:, kv].to(device, non_blocking=True))
                if stream is not None:
                    event = self._new_event()
                    event.record(stream)
                    events.append(event)
        self._events = events or None

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
        to_host = [j for j, s in enumerate(saves) if _CPU in s.tiers]
        to_bytes = [j for j, s in enumerate(saves) if any(t != _CPU for t in s.tiers)]
        threads = self.threads
        if threads is None or not to_bytes:
            staging = self._rows("save", len(to_bytes))
        else:  # the save thread reads it later: its own memory, not the reused staging rows
            staging = torch.empty((len(to_bytes), *self.block_shape), dtype=self.kv_caches.spec.dtype)
        self._copy_out(saves, to_host, to_bytes, staging)
        copied = (time.perf_counter() - started) / len(saves)
        by_tier: dict[str, list[int]] = {}
        for row, j in enumerate(to_bytes):
            for tier in saves[j].tiers:
                if tier != _CPU:
                    by_tier.setdefault(tier, []).append(row)
        if to_host:
            figures = self.figures[_CPU]
            figures.blocks_saved += len(to_host)
            figures.bytes_saved += len(to_host) * self.block_bytes
            figures.save_seconds += copied * len(to_host)
        # Each tier's (key, view of its staging row) pairs, made here: no torch on the save thread.
        jobs = [
            (tier, list(zip([saves[to_bytes[row]].key for row in rows], _row_views(staging, rows))))
            for tier, rows in by_tier.items()
        ]
        if threads is None:
            self._store_rows(jobs, copied)
        elif jobs and not threads.submit_save(functools.partial(self._store_rows, jobs, copied, staging)):
            for tier, items in jobs:
                self.figures[tier].dropped_saves += len(items)
        # Reported done once copied out: the pool's blocks are free to go, whatever the store does later.
        self._saved.update(s.request_id for s in saves if s.request_id is not None)  # a spill has none

    def _store_rows(
        self,
        jobs: Sequence[tuple[str, list[tuple[bytes, memoryview]]]],
        copied: float,
        staging: torch.Tensor | None = None,
    ) -> None:
        """Put staged rows into their byte tiers (on the save thread, or here without threads).

        ``staging`` only keeps the rows' memory alive until they are written.
        """
        for tier, items in jobs:
            figures = self.figures[tier]
            started = time.perf_counter()
            stored = self._put(tier, items)
            figures.save_seconds += time.perf_counter() - started + copied * len(items)
            figures.blocks_saved += stored
            figures.bytes_saved += stored * self.block_bytes
            figures.failed_saves += len(items) - stored

    def _copy_out(
        self, saves: Sequence[BlockSave], to_host: list[int], to_bytes: list[int], staging: torch.Tensor
    ) -> None:
        """Copy the saved blocks out of the pool: into their host slots, and into staging rows for byte tiers."""
        host_slots = [saves[j].host_slot - 1 for j in to_host]  # type: ignore[operator]  # CPU-tier saves name their host slot
        host_from = [saves[j].block_id for j in to_host]
        bytes_from = [saves[j].block_id for j in to_bytes]
        host = self.host
        blocks = self._blocks
        if blocks is not None:  # one copy per run of consecutive blocks, every layer at once
            for src, dst, k in _runs(host_from, host_slots):
                host[dst : dst + k].copy_(blocks[src : src + k])  # type: ignore[index]  # CPU-tier saves only with a host buffer
            for src, dst, k in _runs(bytes_from, range(len(to_bytes))):
                staging[dst : dst + k].copy_(blocks[src : src + k])
            return
        caches = self.kv_caches
        host_ids = torch.tensor(host_from, dtype=torch.int64, device=self.device)
        bytes_ids = torch.tensor(bytes_from, dtype=torch.int64, device=self.device)
        slots = torch.tensor(host_slots, dtype=torch.int64)
        for layer in range(caches.num_layers):
            for kv, cache in enumerate((caches.key_caches[layer], caches.value_caches[layer])):
                if to_host:
                    host[:, layer, kv].index_copy_(0, slots, cache.index_select(0, host_ids).cpu())  # type: ignore[index]  # CPU-tier saves only with a host buffer
                if to_bytes:
                    staging[:, layer, kv].copy_(cache.index_select(0, bytes_ids))

    def _put(self, tier: str, items: list[tuple[bytes, memoryview]]) -> int:
        """``items``: keys and views of their staging rows (no copy)."""
        try:
            return int(self.stores[tier].put_many(items))
        except Exception as exc:  # noqa: BLE001  # a store should not raise; if it does, the blocks are unsaved
            _LOGGER.warning("KV tier %s: a save failed (%s)", tier, exc)
            return 0

    def get_finished(self) -> TransferResult:
        threads = self.threads
        if self._late:
            self._note_late()
        if threads is not None and self._fetches:
            for outcome in threads.finished_loads():
                job = self._fetches.pop(outcome.ticket, None)
                if job is None:
                    continue  # dropped meanwhile
                if outcome.ok:
                    self._land(job, outcome.value, None)  # type: ignore[arg-type]  # _fetch returns list[bool]
                else:
                    self._land(job, None, "timed out" if outcome.timed_out else f"failed ({outcome.error!r})")
        result = TransferResult(frozenset(self._loaded), frozenset(self._saved), dict(self._failed))
        self._loaded.clear()
        self._saved.clear()
        self._failed.clear()
        return result

    def close(self) -> None:
        if self.threads is not None:
            self.threads.close(drain_timeout=30.0)
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
    #: Load or compute: which tier hits are worth loading, by the measured costs (None: every hit loads).
    chooser: LoadOrCompute | None = None
    #: The threads disk and Redis are looked up on, off the step (None: on the step).
    lookup_threads: TransferThreads | None = None

    def note_step(self, num_tokens: int, seconds: float) -> None:
        """A forward pass computed ``num_tokens`` tokens in ``seconds``: the prefill rate load or compute weighs."""
        if self.chooser is not None:
            self.chooser.costs.note_prefill(num_tokens, seconds)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.connector.tiers)

    def poll(self, scheduler: Scheduler) -> None:
        """Before a step is planned: hand the scheduler the asynchronous loads that ended since the last step
        (and measure the late pieces of loads their requests stopped waiting for)."""
        if self.worker.num_fetching or self.worker.num_late:
            result = self.worker.get_finished()
            if result:
                scheduler.take_transfers(result)

    @property
    def busy(self) -> bool:
        """Whether a lookup or a load runs off the step (a request waits on it)."""
        return bool(self.worker.num_fetching or self.connector.num_looking)

    def wait_for_loads(self, timeout: float) -> None:
        """Nothing to compute: block until a lookup or load in flight ends (at most ``timeout`` s, to take new requests)."""
        if self.worker.num_fetching:
            self.worker.wait_for_fetches(timeout)
        elif self.lookup_threads is not None and self.connector.num_looking:
            self.lookup_threads.wait_for_loads(timeout)

    def before_forward(self, scheduler: Scheduler, plan: SchedulerOutput) -> SchedulerOutput:
        """Start the step's loads; the plan to run (failed loads are computed instead)."""
        meta = plan.connector_meta
        if meta is None or not (meta.loads or meta.spills):
            return plan
        self.worker.start_load(meta)
        return scheduler.apply_transfers(plan, self.worker.get_finished())

    def after_forward(
        self, scheduler: Scheduler, plan: SchedulerOutput, *, skip: frozenset[str] = frozenset()
    ) -> SchedulerOutput:
        """Send the step's saves, except those of the requests in ``skip`` (they failed), and report them."""
        meta = plan.connector_meta
        if meta is None or not meta.saves:
            return plan
        if skip:
            meta = dataclasses.replace(meta, saves=tuple(s for s in meta.saves if s.request_id not in skip))
        self.worker.save(meta)
        return scheduler.apply_transfers(plan, self.worker.get_finished())

    def drop_requests(self, plan: SchedulerOutput, request_ids: frozenset[str]) -> None:
        """The step of ``plan`` failed for ``request_ids``: their saves of it are never sent, nothing else changes.

        Host blocks reserved for those saves are forgotten (they were never
        written); no tier is reset and every other request's transfers go on.
        """
        meta = plan.connector_meta
        unwritten = frozenset(
            s.host_slot for s in (meta.saves if meta else ()) if s.request_id in request_ids and s.host_slot is not None
        )
        for rid in request_ids:
            self.connector.forget_request(rid, unwritten)

    def figures(self) -> dict[str, dict[str, Any]]:
        """Per tier: what the worker moved, what the connector decided, and the store's own counters."""
        out: dict[str, dict[str, Any]] = {}
        for name in self.names:
            row: dict[str, Any] = dict(self.worker.figures[name].as_dict())
            counters = self.connector.counters[name]
            row.update(hit_blocks=counters.hit_blocks, saved_blocks=counters.saved_blocks)
            row.update(lookup_errors=self.connector.lookup_errors().get(name, 0))
            store = self.worker.stores.get(name)
            if store is not None:
                stats = store.stats
                row.update(
                    hits=stats.hits, misses=stats.misses, corrupt=stats.corrupt, errors=stats.errors,
                    evictions=stats.evictions, removed=stats.removed, corrupt_by_kind=dict(stats.corrupt_by_kind),
                )  # fmt: skip
            out[name] = row
        return out

    def flush_saves(self, timeout: float | None = None) -> bool:
        """Block until the disk and Redis saves queued so far are written (at most ``timeout`` s); True if they are."""
        threads = self.worker.threads
        return True if threads is None else threads.drain_saves(timeout)

    def close(self) -> None:
        if self.lookup_threads is not None:
            self.lookup_threads.close()
        self.worker.close()


def build_kv_tiers(
    specs: Sequence[str],
    secret_file: str | os.PathLike[str] | None,
    kv_caches: KVCaches,
    manager: KVCacheManager,
    architecture: str,
    log: Callable[[str], None],
    *,
    model_folder: str | os.PathLike[str],
    namespace: str | None = None,
    write: WritePolicy = WritePolicy.WRITE_THROUGH,
    unauthenticated: bool = False,
    targets: Sequence[TierTarget] | None = None,
    async_loads: bool = True,
    load_deadline_s: float = DEFAULT_LOAD_DEADLINE_S,
    always_load: bool = False,
) -> KVTiers | None:
    """Open the tiers ``specs`` name, in lookup order, saving by the ``write`` policy; None when there are none.

    Disk and Redis entries carry a :class:`~kvpool.tiers.entry.LayoutFingerprint` that names the
    weights (:func:`tier_weights`: ``namespace``, else the digest of ``model_folder``'s files), so
    an engine never reads another model's entries. A disk or Redis tier is opened with
    ``secret_file``, or with ``unauthenticated`` (:func:`kvpool.tiers.store.check_tier_trust`).
    With ``async_loads``, disk and Redis transfers run on transfer threads, off the step, and a
    load that takes longer than ``load_deadline_s`` seconds is computed instead. Each tier hit is
    loaded only where that is measured to beat computing it, unless ``always_load``.
    """
    # ``targets``: ``specs`` already parsed (EngineOptions.kv_tier_targets); parsed here only when not given
    targets = parse_specs(specs) if targets is None else tuple(targets)
    specs = tuple(specs)
    if len(targets) != len(specs):
        raise ConfigError(f"{len(targets)} tier targets for {len(specs)} specs {list(specs)}")
    if not specs and secret_file is not None:
        raise ConfigError("kv_tier_secret_file is given but no KV tier is")
    check_tier_trust(
        targets,
        secret=secret_file is not None,
        unauthenticated=unauthenticated,
        secret_name="kv_tier_secret_file (--kv-tier-secret-file)",
        unauthenticated_name="kv_tier_unauthenticated (--kv-tier-unauthenticated)",
    )
    if not specs:
        return None
    from kvpool.tiers.entry import EntryCodec, LayoutFingerprint
    from kvpool.tiers.store import open_store

    if not _one_pair_per_layer(kv_caches) or len(manager.groups) != 1:
        kinds = [g.spec.kind.value for g in manager.groups]
        raise ConfigError(
            "KV tiers support models with one full-attention layer group in the engine: its transfer worker "
            f"copies one block table's pages for every layer, and this model's layer groups are {kinds}. "
            "The tiers' scheduler side serves full-attention plus sliding-window models (kvpool.tiers.windows; "
            "kvpool simulate --layer-groups)"
        )
    spec = kv_caches.spec
    secret = None if secret_file is None else read_secret_file(secret_file, purpose="KV tier secret")
    codec: EntryCodec | None = None
    if any(not isinstance(target, CpuTarget) for target in targets):  # host memory holds this model only
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
            weights=tier_weights(model_folder, namespace, log),
        )
        codec = EntryCodec(fingerprint, secret)
    tiers: list[HostTier | ByteTier] = []
    stores: list[BlockStore] = []
    host: HostTier | None = None
    try:
        for one, target in zip(specs, targets):
            if isinstance(target, CpuTarget):
                size = target.capacity_bytes
                blocks = size // spec.block_bytes
                if blocks < 1:
                    raise ConfigError(f"the CPU tier {one!r} holds no block of {spec.block_bytes} bytes")
                host = HostTier(blocks)
                tiers.append(host)
                log(
                    f"KV tier cpu: {blocks:,} blocks of {format_bytes(spec.block_bytes)} ({format_bytes(size)} of host memory)"
                )
                continue
            assert codec is not None  # built above for every byte tier
            store = open_store(target, codec)
            stores.append(store)
            tiers.append(ByteTier(store))
            shown = getattr(target, "display_url", one)  # a Redis URL's password is never logged
            log(f"KV tier {store.name}: {shown}" + ("" if secret is None else " (entries signed)"))
    except BaseException:
        for store in stores:
            store.close()
        raise
    threads = lookups = None
    if async_loads and stores:
        threads = TransferThreads("kv-tiers", load_deadline_s=load_deadline_s)
        lookups = TransferThreads("kv-lookups", load_deadline_s=load_deadline_s)
    costs = TransferCosts(
        registry_links(t.name for t in tiers),
        block_bytes=spec.block_bytes,
        prefill_tokens_per_s=_PREFILL_PRIOR[kv_caches.device.type == "cuda"],
    )
    chooser = None if always_load else LoadOrCompute(costs, block_size=spec.block_size)
    connector = TierHierarchyConnector(
        manager, tiers, write=write, async_loads=threads is not None, chooser=chooser, lookups=lookups
    )
    worker = KVTransferWorker(
        kv_caches, host.num_blocks if host is not None else 0, stores, threads, None if always_load else costs
    )
    return KVTiers(
        connector=connector,
        worker=worker,
        specs=specs,
        host=host,
        stores=tuple(stores),
        chooser=chooser,
        lookup_threads=lookups,
    )
