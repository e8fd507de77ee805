"""KV connectors: KV that comes from, and goes to, somewhere other than the pool.

A connector has two halves, as vLLM's KV connectors do. The **scheduler side**
(:class:`KVConnector`, torch-free, this module) decides; the **worker side**
(:class:`KVConnectorWorker`, implemented by the engine, e.g.
:mod:`kvpool.engine.kv_transfer`) moves bytes. One step::

    scheduler.schedule()
      for each waiting request:
        hit, n = manager.get_computed_blocks(request)             # local prefix (GPU)
        match = connector.get_num_new_matched_tokens(request, n)   # what lies beyond it elsewhere
        manager.allocate_slots(request, todo, n, hit,
                               num_external_computed_tokens=match.num_tokens)
        connector.update_state_after_alloc(request, block_ids, n, match)
      meta = connector.build_meta([(request, end_position), ...])  # loads and saves of this step
    worker.start_load(meta)                  # begin copying external KV into the new blocks
    scheduler.apply_transfers(plan, worker.get_finished())   # failed loads -> compute those tokens
    runner.execute(plan.chunks)              # calls worker.wait_for_layer_load(i) before layer i
    worker.save(meta)                        # newly full blocks leave for the tiers
    scheduler.apply_transfers(plan, worker.get_finished())   # finished saves free held blocks
    scheduler.update(plan, sampled)          # connector.request_finished(...) may hold blocks

Contracts a connector must keep:

* ``get_num_new_matched_tokens`` answers a whole number of blocks, and never
  so many that the local and external tokens together reach the request's
  last token (the model computes at least that one to produce logits). It
  changes nothing: the allocation may still be refused, and then the same
  question is asked again in a later step.
* The tokens it promises are *loaded*, never computed: the request's first
  chunk starts after them. A load that fails is reported in
  :attr:`TransferResult.failed_loads` with the number of tokens, counted from
  position 0, whose KV is in place; the scheduler then moves that request's
  chunk back to start there, so the failed tokens are computed in the same
  step (the chunk grows past the token budget by that much).
* Blocks filled by a load are in the prefix cache as soon as they are
  allocated, like computed blocks; a load therefore completes (or is reported
  failed) before the step's forward pass reads them.
* ``request_finished`` returning True keeps a finished request's blocks out
  of the free queue until a later :class:`TransferResult` lists the request
  in ``finished_saves``.

Writing your own connector: implement the five scheduler-side methods of
:class:`KVConnector` (plain Python, no torch) and the four worker-side methods
of :class:`KVConnectorWorker`, then hand the first to
:class:`~kvpool.scheduler.Scheduler` (``connector=``) and call the second from
the engine step as above. :class:`TierHierarchyConnector` below is the one
kvpool ships: tiers looked up in order by the chained block hash.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from kvpool.block import KVBlock
from kvpool.block_pool import BlockPool
from kvpool.checks import check_int
from kvpool.errors import ConfigError, InvariantViolation
from kvpool.events import BlockRemoved, BlockStored, KVCacheEvent
from kvpool.groups.full_attention import FullAttentionManager
from kvpool.hashing import BlockHash
from kvpool.manager import KVCacheManager
from kvpool.request import Request

__all__ = [
    "NO_MATCH",
    "BlockLoad",
    "BlockSave",
    "ByteTier",
    "ConnectorMetadata",
    "ExternalMatch",
    "HostTier",
    "KVConnector",
    "KVConnectorWorker",
    "PrefixLookup",
    "TierCounters",
    "TierHierarchyConnector",
    "TierRun",
    "TransferResult",
]

_LOGGER = logging.getLogger("kvpool.connector")

#: The name of the local pool in per-tier figures.
GPU = "gpu"


# -- what the two halves exchange ---------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TierRun:
    """``num_tokens`` consecutive tokens whose KV one tier supplies."""

    tier: str
    num_tokens: int


@dataclass(frozen=True, slots=True)
class ExternalMatch:
    """What a connector can supply beyond the local prefix hit: runs of tokens, in position order."""

    runs: tuple[TierRun, ...] = ()

    @property
    def num_tokens(self) -> int:
        return sum(run.num_tokens for run in self.runs)

    def tokens_by_tier(self) -> dict[str, int]:
        by_tier: dict[str, int] = {}
        for run in self.runs:
            by_tier[run.tier] = by_tier.get(run.tier, 0) + run.num_tokens
        return by_tier

    def truncated(self, num_tokens: int) -> ExternalMatch:
        """The first ``num_tokens`` tokens of the match (what is left after a load failed there)."""
        runs = []
        left = num_tokens
        for run in self.runs:
            if left <= 0:
                break
            runs.append(TierRun(run.tier, min(run.num_tokens, left)))
            left -= run.num_tokens
        return ExternalMatch(tuple(runs))


#: Nothing beyond the local hit.
NO_MATCH = ExternalMatch()


@dataclass(frozen=True, slots=True)
class BlockLoad:
    """Copy the KV stored under ``key`` in ``tier`` into pool block ``block_id``.

    ``position`` is the block's index in the request (its tokens start at
    ``position * block_size``); ``host_slot`` is the CPU tier's host block
    holding it (None for byte tiers).
    """

    request_id: str
    position: int
    block_id: int
    key: bytes
    tier: str
    host_slot: int | None = None


@dataclass(frozen=True, slots=True)
class BlockSave:
    """Copy pool block ``block_id`` (now full, cached under ``key``) to each of ``tiers``.

    ``host_slot`` is the CPU tier's host block reserved for it when ``"cpu"``
    is among the tiers.
    """

    request_id: str
    block_id: int
    key: bytes
    tiers: tuple[str, ...]
    host_slot: int | None = None


@dataclass(frozen=True, slots=True)
class ConnectorMetadata:
    """One step's transfers, from the scheduler side to the worker side."""

    loads: tuple[BlockLoad, ...] = ()
    saves: tuple[BlockSave, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.loads or self.saves)


@dataclass(frozen=True, slots=True)
class TransferResult:
    """What the worker finished since it was last asked.

    ``failed_loads`` maps a request ID to the number of its tokens, from
    position 0, whose KV is in place (the rest of what was promised must be
    computed). ``finished_loads`` and ``finished_saves`` name requests whose
    loads or saves issued so far are all done (failed ones included).
    """

    finished_loads: frozenset[str] = frozenset()
    finished_saves: frozenset[str] = frozenset()
    failed_loads: Mapping[str, int] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.finished_loads or self.finished_saves or self.failed_loads)


# -- the two halves ------------------------------------------------------------------------


@runtime_checkable
class KVConnector(Protocol):
    """The scheduler side of a connector: decisions only, no tensors."""

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> ExternalMatch:
        """Tokens beyond the ``num_computed_tokens`` of the local hit that this connector can load.

        Whole blocks only, ending before the request's last token. Changes nothing.
        """
        ...

    def update_state_after_alloc(
        self, request: Request, block_ids: Sequence[int], num_local_tokens: int, match: ExternalMatch
    ) -> None:
        """The request was admitted: ``block_ids`` is its block table; load ``match`` into it after the local hit."""
        ...

    def build_meta(self, scheduled: Sequence[tuple[Request, int]]) -> ConnectorMetadata:
        """This step's loads and saves. ``scheduled``: each scheduled request and its end position after the step."""
        ...

    def update_finished(self, result: TransferResult) -> None:
        """The worker finished (or failed) these transfers."""
        ...

    def request_finished(self, request: Request, block_ids: Sequence[int]) -> bool:
        """The request finished; True keeps its blocks until its saves are reported finished."""
        ...


@runtime_checkable
class KVConnectorWorker(Protocol):
    """The engine side of a connector: it moves KV between the pool's memory and elsewhere."""

    def start_load(self, meta: ConnectorMetadata) -> None:
        """Begin this step's loads; a failure is reported by the next :meth:`get_finished`."""
        ...

    def wait_for_layer_load(self, layer: int) -> None:
        """Block until the loads of ``layer``'s KV are in place (called before the layer runs)."""
        ...

    def save(self, meta: ConnectorMetadata) -> None:
        """Send this step's saves (after the forward pass that filled the blocks)."""
        ...

    def get_finished(self) -> TransferResult:
        """Transfers finished or failed since the last call."""
        ...


# -- tiers -----------------------------------------------------------------------------------


@dataclass(slots=True)
class TierCounters:
    """Cumulative figures of one tier, as the connector sees it."""

    name: str
    hit_blocks: int = 0  # blocks promised from this tier at admission
    failed_blocks: int = 0  # promised blocks that were then computed (the load failed)
    saved_blocks: int = 0  # blocks sent to this tier
    lookup_errors: int = 0  # lookups that raised (a backend fault; counted as misses)


class HostTier:
    """The CPU tier's bookkeeping: host blocks in a :class:`~kvpool.block_pool.BlockPool` of their own.

    A host block holds one pool block's KV for every layer. The pool's prefix
    index maps a chained block hash to the host block holding it, and its
    free queue is the eviction order: a stored block rests in the queue as a
    cached block (least recently used first), a load or a save pins it for the
    step (reference count 1) and releases it to the back. The worker side owns
    the host memory and copies at the slots named here. O(1) per block.
    """

    name = "cpu"

    def __init__(self, num_blocks: int) -> None:
        check_int("CPU tier blocks", num_blocks)
        self.num_blocks = num_blocks
        # Host block 0 is the pool's null block, never used; the pool's events name the keys it evicts.
        self.pool = BlockPool(num_blocks + 1, enable_events=True)
        self._index = self.pool.indexes[0]

    def take_evicted(self) -> list[bytes]:
        """Keys evicted since the last call, oldest first (for the tier's ``BlockRemoved`` events)."""
        return [bytes(h) for e in self.pool.take_events() if isinstance(e, BlockRemoved) for h in e.block_hashes]

    def contains_prefix(self, keys: Sequence[bytes]) -> int:
        get = self._index.get
        count = 0
        for key in keys:
            if get(BlockHash(key)) is None:
                break
            count += 1
        return count

    def pin(self, key: bytes) -> int:
        """The host block holding ``key``, pinned until :meth:`release`."""
        block = self._index.get(BlockHash(key))
        if block is None:
            raise InvariantViolation(f"host block for key {key.hex()[:16]} was evicted between lookup and load")
        self.pool.touch([block])
        return block.block_id

    def reserve(self, key: bytes) -> int | None:
        """A host block to save ``key`` into, pinned and indexed; None if it is there already or all are pinned."""
        if self._index.get(BlockHash(key)) is not None or self.pool.num_free_blocks == 0:
            return None
        [block] = self.pool.get_new_blocks(1)  # evicts the least recently used cached block
        self._index.insert_run([block], 0, 1, [BlockHash(key)], None, 0)
        return block.block_id

    def release(self, slots: Sequence[int]) -> None:
        """Unpin host blocks: back of the queue, most recently used."""
        blocks: list[KVBlock] = [self.pool.block(slot) for slot in slots]
        self.pool.free_blocks(blocks)

    def discard(self, slots: Sequence[int]) -> None:
        """Unpin host blocks reserved for saves that will never be written, and forget their keys.

        No removal is announced: a reserved key is announced stored only once its save is done.
        """
        blocks: list[KVBlock] = [self.pool.block(slot) for slot in slots]
        for block in blocks:
            if block.block_hash is not None:
                self.pool.uncache(block)
        self.pool.take_events()  # only these removals since the last save was planned (take_evicted drains)
        self.pool.free_blocks(blocks)

    def clear(self) -> list[bytes]:
        """Forget every stored block and pin (after a step failed: a reserved block may never have been written).

        Returns the keys it forgot.
        """
        forgotten = [bytes(b.block_hash) for b in self.pool.blocks if b.block_hash is not None]
        self.pool = BlockPool(self.num_blocks + 1, enable_events=True)
        self._index = self.pool.indexes[0]
        return forgotten

    @property
    def num_stored(self) -> int:
        return len(self._index)


class PrefixLookup(Protocol):
    """The part of a :class:`kvpool.tiers.store.BlockStore` the scheduler side uses."""

    name: str

    def contains_prefix(self, keys: Sequence[bytes]) -> int: ...


class ByteTier:
    """A tier whose entries are bytes in a :class:`kvpool.tiers.store.BlockStore` (disk, Redis).

    Only the lookup is made here; the worker side reads and writes the store.
    A store that raises is a miss, logged once: faults never stop serving.
    """

    def __init__(self, store: PrefixLookup) -> None:
        name = getattr(store, "name", None)
        if not isinstance(name, str) or not callable(getattr(store, "contains_prefix", None)):
            raise ConfigError(f"a byte tier needs a BlockStore (name, contains_prefix, ...), got {store!r}")
        self.name = name
        self.store = store
        self._warned = False
        self.lookup_errors = 0

    def contains_prefix(self, keys: Sequence[bytes]) -> int:
        try:
            found = self.store.contains_prefix(keys)
        except Exception as exc:  # noqa: BLE001  # a backend fault is a miss; serving goes on
            self.lookup_errors += 1
            if not self._warned:
                _LOGGER.warning("KV tier %s: lookup failed (%s); treated as a miss", self.name, exc)
                self._warned = True
            return 0
        self._warned = False
        return found if type(found) is int and 0 <= found <= len(keys) else 0


Tier = HostTier | ByteTier


# -- the tier hierarchy ------------------------------------------------------------------------


class TierHierarchyConnector:
    """Offloading through tiers looked up in the user's order by the chained block hash.

    Lookup: after the local hit, each next block is taken from the first tier
    that holds it, as a run as long as that tier holds; the match ends at the
    first block no tier holds. Because the key is the request's chained block
    hash, cache salts and LoRA names isolate tenants in every tier as they do
    in the pool.

    Saves: every block that becomes full in a step (computed, or loaded from
    a lower tier) is sent to every tier above the one it came from (all tiers
    when computed), once. Blocks of the local hit are not sent again.

    Requires a single full-attention layer group and a cryptographic block
    hash (a fast hash would let two prompts share a key across processes).
    """

    def __init__(self, manager: KVCacheManager, tiers: Sequence[Tier]) -> None:
        if not isinstance(manager, KVCacheManager):
            raise ConfigError(f"manager must be a KVCacheManager, got {manager!r}")
        tiers = tuple(tiers)
        if not tiers:
            raise ConfigError("a tier hierarchy needs at least one tier")
        names = [t.name for t in tiers]
        if len(set(names)) != len(names) or GPU in names:
            raise ConfigError(f"tier names must be distinct and not {GPU!r}, got {names}")
        if not manager.enable_caching:
            raise ConfigError("KV tiers need prefix caching (blocks are found by their hash)")
        if not manager.hasher.algo.is_cryptographic:
            raise ConfigError(f"KV tiers need a cryptographic block hash, not {manager.hasher.algo.value!r}")
        if len(manager.groups) != 1 or type(manager.groups[0]) is not FullAttentionManager:
            raise ConfigError("KV tiers support models with one full-attention layer group")
        self.manager = manager
        self.tiers = tiers
        self.block_size = manager.block_size
        self.counters = {t.name: TierCounters(t.name) for t in tiers}
        self._host = next((t for t in tiers if isinstance(t, HostTier)), None)
        self._rank = {name: i for i, name in enumerate(names)}
        self._pending_loads: dict[str, list[BlockLoad]] = {}
        self._saved_upto: dict[str, int] = {}  # blocks of the request handled (hit, saved or skipped)
        self._origin: dict[str, dict[int, str]] = {}  # loaded block position -> its tier
        self._pinned: dict[str, list[int]] = {}  # host blocks pinned by in-flight transfers
        self._saving: set[str] = set()
        self._stored: dict[str, list[BlockStored]] = {}  # tier events of planned saves, published when done

    # -- lookup ---------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> ExternalMatch:
        bs = self.block_size
        first = num_computed_tokens // bs
        if first * bs != num_computed_tokens:
            return NO_MATCH  # a partial local hit cannot be extended by whole blocks
        keys = request.block_hashes[first : (request.num_tokens - 1) // bs]
        runs: list[TierRun] = []
        pos = 0
        while pos < len(keys):
            rest = keys[pos:]
            for tier in self.tiers:
                found = tier.contains_prefix(rest)
                if found:
                    runs.append(TierRun(tier.name, found * bs))
                    pos += found
                    break
            else:
                break
        return ExternalMatch(tuple(runs))

    def update_state_after_alloc(
        self, request: Request, block_ids: Sequence[int], num_local_tokens: int, match: ExternalMatch
    ) -> None:
        rid = request.request_id
        bs = self.block_size
        pos = num_local_tokens // bs
        self._saved_upto[rid] = pos
        origin: dict[int, str] = {}
        loads: list[BlockLoad] = []
        if match.runs:
            hashes = request.block_hashes
            for run in match.runs:
                counters = self.counters[run.tier]
                for _ in range(run.num_tokens // bs):
                    key = bytes(hashes[pos])
                    slot = None
                    if self._host is not None and run.tier == self._host.name:
                        slot = self._host.pin(key)
                        self._pinned.setdefault(rid, []).append(slot)
                    loads.append(BlockLoad(rid, pos, block_ids[pos], key, run.tier, slot))
                    origin[pos] = run.tier
                    counters.hit_blocks += 1
                    pos += 1
        self._origin[rid] = origin
        if loads:
            self._pending_loads[rid] = loads

    # -- a step ---------------------------------------------------------------------

    def build_meta(self, scheduled: Sequence[tuple[Request, int]]) -> ConnectorMetadata:
        loads = [load for batch in self._pending_loads.values() for load in batch]
        self._pending_loads.clear()
        saves: list[BlockSave] = []
        bs = self.block_size
        all_tiers = tuple(t.name for t in self.tiers)
        host = self._host
        for request, end in scheduled:
            rid = request.request_id
            done = self._saved_upto.get(rid)
            if done is None:
                continue
            full = end // bs
            if full <= done:
                continue
            hashes = request.block_hashes
            full = min(full, len(hashes))
            table = self.manager.get_block_ids(rid)[0]
            origin = self._origin.get(rid, {})
            tokens: Sequence[int] = ()
            for pos in range(done, full):
                source = origin.get(pos)
                tiers = all_tiers if source is None else all_tiers[: self._rank[source]]
                if not tiers:
                    continue
                key = bytes(hashes[pos])
                slot = None
                if host is not None and host.name in tiers:
                    slot = host.reserve(key)
                    if slot is None:  # already there (or every host block pinned this step)
                        tiers = tuple(t for t in tiers if t != host.name)
                    else:
                        self._pinned.setdefault(rid, []).append(slot)
                        self._record_removed(host.name, host.take_evicted())
                if tiers:
                    saves.append(BlockSave(rid, table[pos], key, tiers, slot))
                    for name in tiers:
                        self.counters[name].saved_blocks += 1
                    self._saving.add(rid)
                    if self.manager.pool.events is not None:
                        tokens = tokens or request.all_token_ids  # a copy: taken once per request
                        stored = self._stored.setdefault(rid, [])
                        stored.extend(self._stored_event(request, hashes, tokens, pos, t) for t in tiers)
            self._saved_upto[rid] = full
        return ConnectorMetadata(tuple(loads), tuple(saves))

    def update_finished(self, result: TransferResult) -> None:
        bs = self.block_size
        for rid, valid in result.failed_loads.items():
            for pos, tier in self._origin.get(rid, {}).items():
                if pos * bs >= valid:
                    self.counters[tier].failed_blocks += 1
        done = result.finished_loads | result.finished_saves
        for rid in done:
            if rid in result.finished_saves:
                self._saving.discard(rid)
                for event in self._stored.pop(rid, ()):
                    self._record(event)
            if rid not in self._saving and self._host is not None:
                slots = self._pinned.pop(rid, None)
                if slots:
                    self._host.release(slots)

    def request_finished(self, request: Request, block_ids: Sequence[int]) -> bool:
        rid = request.request_id
        self._saved_upto.pop(rid, None)
        self._origin.pop(rid, None)
        if self._pending_loads.pop(rid, None) is not None and rid not in self._saving:
            slots = self._pinned.pop(rid, None)  # loads never sent: nothing will report them
            if slots and self._host is not None:
                self._host.release(slots)
        return rid in self._saving

    def forget_request(self, request_id: str, unwritten_slots: Collection[int]) -> None:
        """Drop one failed request's transfers; nothing of any other request or tier changes.

        Its planned saves will not be sent: the host blocks reserved for them
        (``unwritten_slots``) are forgotten, the ones it pinned for loads are
        released. Call it before the scheduler finishes the request, which
        then frees its blocks at once (no save is awaited).
        """
        self._pending_loads.pop(request_id, None)
        self._saving.discard(request_id)
        self._stored.pop(request_id, None)
        slots = self._pinned.pop(request_id, None)
        if slots and self._host is not None:
            kept = [s for s in slots if s not in unwritten_slots]
            lost = [s for s in slots if s in unwritten_slots]
            if kept:
                self._host.release(kept)
            if lost:
                self._host.discard(lost)

    def reset(self) -> None:
        """Forget every transfer in flight and the CPU tier's contents (the engine's recovery after a failed step).

        A host block is indexed when its save is planned, so a step that failed
        before its saves ran may have left keys over blocks never written: the
        CPU tier starts empty again. Byte tiers are untouched: a store only
        holds what a completed save wrote.
        """
        self._pending_loads.clear()
        self._saved_upto.clear()
        self._origin.clear()
        self._pinned.clear()
        self._saving.clear()
        self._stored.clear()
        if self._host is not None:
            self._record_removed(self._host.name, self._host.clear())

    # -- events: what each tier holds, for a router (recorded when the manager records events) ---

    def _record(self, event: KVCacheEvent) -> None:
        events = self.manager.pool.events  # read each time: take_events() swaps the list
        if events is not None:
            events.append(event)

    def _record_removed(self, tier: str, keys: Sequence[bytes]) -> None:
        if keys:
            self._record(BlockRemoved(block_hashes=tuple(BlockHash(k) for k in keys), medium=tier.upper()))

    def _stored_event(
        self, request: Request, hashes: Sequence[BlockHash], tokens: Sequence[int], pos: int, tier: str
    ) -> BlockStored:
        """The event of block ``pos`` of ``request`` stored in ``tier`` (medium: the tier's name in capitals)."""
        bs = self.block_size
        kind, window = self.manager.pool.group_kinds[0]
        return BlockStored(
            block_hashes=(hashes[pos],),
            parent_block_hash=hashes[pos - 1] if pos else None,
            token_ids=tuple(tokens[pos * bs : (pos + 1) * bs]),
            block_size=bs,
            lora_name=request.lora_name,
            extra_keys=(request.extra_keys(pos * bs, (pos + 1) * bs),),
            medium=tier.upper(),
            spec_kind=kind,
            sliding_window=window,
        )

    # -- figures ---------------------------------------------------------------------

    def lookup_errors(self) -> dict[str, int]:
        return {t.name: t.lookup_errors for t in self.tiers if isinstance(t, ByteTier)}
