"""The tier hierarchy: a KV connector over tiers looked up in order by the chained block hash.

:class:`TierHierarchyConnector` is the scheduler side of kvpool's offloading
connector (:mod:`kvpool.connector` holds the interface): it decides, torch-free,
which blocks load from which tier and which go down, and when. The engine's
worker (:mod:`kvpool.engine.kv_transfer`) moves the bytes; the simulator's
(:mod:`kvpool.sim.transfers`) only accounts their time. Both drive this same
class through the same scheduler.

The tiers it looks in:

* :class:`HostTier`: host memory, whose bookkeeping is a
  :class:`~kvpool.block_pool.BlockPool` of host blocks (the pool's free queue is
  its LRU order, its prefix index the key lookup);
* :class:`ByteTier`: a :class:`~kvpool.tiers.store.BlockStore` (disk, Redis),
  of which only the lookup is made here.

When a block goes down is the :class:`~kvpool.tiers.kinds.WritePolicy`, chosen
once at construction: at fill (``WRITE_THROUGH``, :meth:`_save_on_fill`) or at
eviction from the GPU pool (``WRITE_BACK``, :meth:`_spill_evicted`).

Hybrid models (full attention plus sliding window, :mod:`kvpool.tiers.windows`):
each group's blocks have keys of their own (the block hash and the group's
tag), the hit is the one every group accepts (the device's rule over the pool
and the tiers), and a window group loads and saves only the blocks a request
can still read.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from kvpool.block import KVBlock
from kvpool.connector import (
    NO_MATCH,
    PENDING,
    BlockLoad,
    BlockSave,
    ConnectorMetadata,
    ExternalMatch,
    TierRun,
    TransferResult,
)
from kvpool.errors import ConfigError
from kvpool.events import BlockRemoved, BlockStored
from kvpool.hashing import BlockHash
from kvpool.manager import KVCacheManager
from kvpool.request import Request
from kvpool.tiers.kinds import WritePolicy
from kvpool.tiers.lookups import OffStepLookups
from kvpool.tiers.policy import ByteTier, HostTier, PrefixLookup, Tier, TierCounters, TierPolicy
from kvpool.tiers.store import event_medium
from kvpool.tiers.transfer_threads import TransferThreads
from kvpool.tiers.windows import TierGroup, common_hit, first_readable, tier_groups

# HostTier, ByteTier and the rest moved to kvpool.tiers.policy; importable here as before.
__all__ = ["ByteTier", "HostTier", "MatchChooser", "PrefixLookup", "Tier", "TierCounters", "TierHierarchyConnector"]


class MatchChooser(Protocol):
    """Decides how much of what the tiers hold is worth loading (:mod:`kvpool.tiers.load_or_compute`)."""

    def choose(self, match: ExternalMatch) -> ExternalMatch:
        """The leading part of ``match`` to load (the rest is computed). Changes nothing."""
        ...

    def count(self, offered: ExternalMatch, chosen: ExternalMatch) -> None:
        """An admitted request was offered ``offered`` by the tiers and loads ``chosen``."""
        ...

    def compute_seconds(self, num_tokens: int) -> float:
        """What computing ``num_tokens`` prompt tokens is estimated to take (how long a lookup is worth waiting)."""
        ...

    def note_lookup(self, num_keys: int, seconds: float) -> None:
        """A lookup of ``num_keys`` keys in the stores took ``seconds``."""
        ...

    def worth_looking_up(
        self, num_keys: int, num_tokens: int, deadline_s: float | None = None, tiers: Iterable[str] | None = None
    ) -> bool:
        """Whether asking the stores (``tiers``, when given) is expected to beat computing ``num_tokens`` and the
        lookup's deadline, and could lead to a load (counted; it may probe)."""
        ...


@dataclass(frozen=True, slots=True)
class _Resident:
    """A full block in the GPU pool that write-back will send down when the pool evicts it."""

    key: BlockHash
    origin: str | None  # the tier it was loaded from; None: computed here
    event: BlockStored | None  # its stored-block event (medium GPU), when events are recorded
    tier_key: bytes  # what names it in the tiers (the hash, and in a hybrid model its group's tag)


@dataclass(frozen=True, slots=True)
class _HybridPlan:
    """A hybrid request's match, block by block: each group's runs ``(tier, blocks)`` from its first block."""

    first: int  # the local hit, in blocks
    end: int  # the hit's end, in blocks
    starts: tuple[int, ...]  # each group's first block to load
    runs: tuple[tuple[tuple[str, int], ...], ...]  # each group's runs from its start to ``end``


class TierHierarchyConnector:
    """Offloading through tiers looked up in the user's order by the chained block hash.

    The lookup, where a block goes down and the host slot are
    :class:`~kvpool.tiers.policy.TierPolicy`'s rules (the vLLM connector asks the
    same); this class translates kvpool's requests and block tables into keys.
    Because the key is the request's chained block hash, cache salts and LoRA
    names isolate tenants in every tier as they do in the pool.

    Saves (``write``, a :class:`WritePolicy`): a block goes to the policy's
    destinations (every tier above the one it came from, all when computed), once. Write-through sends
    it when it becomes full in a step; write-back when the GPU pool evicts it,
    as a *spill* (:attr:`ConnectorMetadata.spills`) the worker copies out
    before the step's loads and forward pass reuse the block. Blocks of the
    local hit are not sent again.

    Serves full-attention and sliding-window layer groups (a hybrid model's
    blocks are named per group, :mod:`kvpool.tiers.windows`); a hybrid model
    looks disk and Redis up on the scheduler's thread and loads synchronously.
    ``window_aware_saves``: a window group saves only the blocks a request can
    still read when they fill (default False: every full block, which keeps
    hits of prefixes shared up to a point before the request's last window and
    measured faster first tokens on every workload tried; see docs/tiers.md,
    "Hybrid models", for what each costs).
    Requires, unless ``allow_fast_hash`` (a simulation, where no other process
    shares a key), a cryptographic block hash (a fast hash would let two
    prompts share a key across processes).
    """

    def __init__(
        self,
        manager: KVCacheManager,
        tiers: Sequence[Tier],
        *,
        write: WritePolicy = WritePolicy.WRITE_THROUGH,
        allow_fast_hash: bool = False,
        chooser: MatchChooser | None = None,
        async_loads: bool = False,
        lookups: TransferThreads | None = None,
        window_aware_saves: bool = False,
    ) -> None:
        if not isinstance(manager, KVCacheManager):
            raise ConfigError(f"manager must be a KVCacheManager, got {manager!r}")
        if not isinstance(write, WritePolicy):
            raise ConfigError(f"write must be a WritePolicy, got {write!r}")
        if type(async_loads) is not bool:
            raise ConfigError(f"async_loads must be True or False, got {async_loads!r}")
        if type(window_aware_saves) is not bool:
            raise ConfigError(f"window_aware_saves must be True or False, got {window_aware_saves!r}")
        policy = TierPolicy(tiers)
        if not manager.enable_caching:
            raise ConfigError("KV tiers need prefix caching (blocks are found by their hash)")
        if not manager.hasher.algo.is_cryptographic and not allow_fast_hash:
            raise ConfigError(f"KV tiers need a cryptographic block hash, not {manager.hasher.algo.value!r}")
        groups = tier_groups(manager)  # a group the tiers cannot serve is refused here, naming its kind
        hybrid = len(groups) > 1 or groups[0].is_window
        if hybrid and async_loads:
            raise ConfigError(
                "asynchronous tier loads serve models of one full-attention layer group; this model's groups "
                f"are {[g.manager.spec.kind.value for g in groups]} (its window blocks would be cached before "
                "their KV arrives)"
            )
        if hybrid and lookups is not None and any(isinstance(t, ByteTier) for t in policy.tiers):
            raise ConfigError(
                "off-step disk and Redis lookups serve models of one full-attention layer group; a hybrid "
                f"model ({[g.manager.spec.kind.value for g in groups]}) looks them up on the scheduler's thread"
            )
        self.manager = manager
        #: The layer groups as the tiers serve them (one home for keys and window rules: kvpool.tiers.windows).
        self.groups: tuple[TierGroup, ...] = groups
        self._hybrid = hybrid
        self._num_groups = len(groups)
        self._plans: dict[str, _HybridPlan] = {}  # hybrid: the latest match per request asked
        #: Hybrid: a window group saves only the blocks the request can still read (False: every full block).
        self.window_aware_saves = window_aware_saves
        #: Hybrid: window blocks of a hit not loaded (out of the window at its end), and full ones not saved.
        self.window_skipped_loads = 0
        self.window_skipped_saves = 0
        self.policy = policy
        self.tiers = policy.tiers
        self.write = write
        self.block_size = manager.block_size
        self.counters = {name: TierCounters(name) for name in policy.names}
        #: Load or compute: trims each match to what is worth loading (None: load all the tiers hold).
        self.chooser = chooser
        #: Loads from byte tiers (disk, Redis) finish in a later step: the request waits, the batch steps on.
        self.async_loads = async_loads
        self._byte_tiers = frozenset(t.name for t in policy.tiers if isinstance(t, ByteTier))
        #: Disk and Redis looked up on threads, off the step (None: on the scheduler's thread).
        self._lookups = None
        if lookups is not None and self._byte_tiers:
            self._lookups = OffStepLookups(policy, lookups, None if chooser is None else chooser.note_lookup)
        # The host tier alone, for a request whose stores are not worth asking.
        self._host_only = None if policy.host is None else TierPolicy([policy.host])
        self._offered: dict[str, ExternalMatch] = {}  # the tiers' answer before the chooser, per request asked
        self._pool = manager.pool
        self._host = policy.host
        self._pending_loads: dict[str, list[BlockLoad]] = {}
        self._saved_upto: dict[str, int] = {}  # blocks of the request handled (hit, saved or skipped)
        self._origin: dict[str, dict[int, str]] = {}  # loaded block position -> its tier
        self._pinned: dict[str, list[int]] = {}  # host blocks pinned by in-flight transfers
        self._saving: set[str] = set()
        self._stored: dict[str, list[BlockStored]] = {}  # tier events of planned saves, published when done
        # Write-back: full blocks in the pool by block ID, and the ones evicted since the last plan.
        self._resident: dict[int, _Resident] = {}
        self._evicted: list[tuple[int, _Resident]] = []
        if write is WritePolicy.WRITE_BACK:
            self._on_fill = self._remember_on_fill
            self._pool.watch_evictions(self._note_evicted)
        else:
            self._on_fill = self._save_on_fill

    # -- lookup ---------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> ExternalMatch:
        return self._match(request, num_computed_tokens, record=True)

    def preview_match(self, request: Request, num_computed_tokens: int) -> ExternalMatch:
        """What :meth:`get_num_new_matched_tokens` would answer, remembering nothing of ``request``.

        For a router weighing replicas (the simulator's): a request routed elsewhere leaves no trace here.
        """
        return self._match(request, num_computed_tokens, record=False)

    def _match(self, request: Request, num_computed_tokens: int, *, record: bool) -> ExternalMatch:
        bs = self.block_size
        first = num_computed_tokens // bs
        if first * bs != num_computed_tokens:
            return NO_MATCH  # a partial local hit cannot be extended by whole blocks
        if self._hybrid:
            return self._hybrid_match(request, first, record=record)
        keys = request.block_hashes[first : (request.num_tokens - 1) // bs]
        if not keys:
            return NO_MATCH
        if self._lookups is None:
            found = self.policy.match(keys)
        elif (
            self.chooser is not None
            and not self._lookups.asked(request.request_id, keys)
            and not self.chooser.worth_looking_up(
                len(keys), len(keys) * bs, self._lookups.threads.load_deadline_s, self._byte_tiers
            )
        ):
            found = () if self._host_only is None else self._host_only.match(keys)  # waiting would cost more
        else:
            # Waiting for the stores longer than computing the tokens would take is never worth it.
            give_up = None if self.chooser is None else self.chooser.compute_seconds(len(keys) * bs)
            answered = self._lookups.match(request.request_id, keys, give_up_after=give_up)
            if answered is None:
                return PENDING  # the stores have not answered yet: skipped this step, asked again
            found = answered
        match = ExternalMatch(tuple(TierRun(name, blocks * bs) for name, blocks in found))
        if self.chooser is not None and match.runs:
            if record:
                self._offered[request.request_id] = match
            match = self.chooser.choose(match)
        if self.async_loads and any(run.tier in self._byte_tiers for run in match.runs):
            match = ExternalMatch(match.runs, asynchronous=True)
        return match

    # -- hybrid models ----------------------------------------------------------------

    def _group_keys(self, request: Request, stop: int) -> list[list[bytes]]:
        """Each group's tier keys of the request's first ``stop`` blocks."""
        hashes = request.block_hashes[:stop]
        return [[bytes(h) + g.tag for h in hashes] for g in self.groups]

    def _held(self, keys: Sequence[bytes]) -> int:
        return sum(blocks for _, blocks in self.policy.match(keys))

    def _hybrid_plan(self, keys: list[list[bytes]], first: int, stop: int) -> _HybridPlan:
        """The common hit of at most ``stop`` blocks after ``first`` and each group's runs (changes no tier).

        A tier that lost a block between the search and the runs (an eviction) lowers the cap and searches again.
        """
        while True:
            end, starts = common_hit(self.groups, keys, first, stop, self._held)
            runs = tuple(self.policy.match(keys[g.index][starts[g.index] : end]) for g in self.groups)
            short = [
                starts[g.index] + sum(n for _, n in runs[g.index])
                for g in self.groups
                if starts[g.index] + sum(n for _, n in runs[g.index]) < end
            ]
            if not short:
                return _HybridPlan(first, end, starts, runs)
            stop = min(short)

    def _plan_match(self, plan: _HybridPlan) -> ExternalMatch:
        """The plan's tokens as runs by tier: a full-attention group's (the first), else the first group's.

        In a window-only model the blocks before the window are named after the first run's tier.
        """
        if plan.end <= plan.first:
            return NO_MATCH
        bs = self.block_size
        lead = next((g for g in self.groups if not g.is_window), self.groups[0])
        runs = [TierRun(name, blocks * bs) for name, blocks in plan.runs[lead.index]]
        gap = plan.starts[lead.index] - plan.first
        if gap:  # a window group loads at least its hit's last block, so the lead has a run
            runs[0] = TierRun(runs[0].tier, runs[0].num_tokens + gap * bs)
        return ExternalMatch(tuple(runs))

    def _hybrid_match(self, request: Request, first: int, *, record: bool) -> ExternalMatch:
        stop = (request.num_tokens - 1) // self.block_size
        if stop <= first:
            return NO_MATCH
        keys = self._group_keys(request, stop)
        plan = self._hybrid_plan(keys, first, stop)
        match = self._plan_match(plan)
        if self.chooser is not None and match.runs:
            offered = match
            chosen = self.chooser.choose(match)
            if chosen.num_tokens < match.num_tokens:
                # A shorter hit moves the windows: searched again under the chosen length, never above it.
                plan = self._hybrid_plan(keys, first, first + chosen.num_tokens // self.block_size)
                match = self._plan_match(plan)
            if record:
                self._offered[request.request_id] = offered
        if record:
            self._plans[request.request_id] = plan
        return match

    def _admitted_plan(self, request: Request, pos: int, match: ExternalMatch) -> _HybridPlan | None:
        """The plan behind ``match`` (this connector's latest answer for the request, else searched again).

        ConfigError, with nothing changed, for a match the tiers do not hold.
        """
        rid = request.request_id
        bs = self.block_size
        end = pos + match.num_tokens // bs
        plan = self._plans.get(rid)
        if plan is None or plan.first != pos or plan.end != end:
            if not match.runs:
                return None
            plan = self._hybrid_plan(self._group_keys(request, end), pos, end)
            if plan.end != end:
                raise ConfigError(
                    f"request {rid!r}: the tiers hold {(plan.end - pos) * bs} of the {match.num_tokens} tokens "
                    "admitted to load (the match was not this connector's latest answer)"
                )
        self._plans.pop(rid, None)
        return plan

    def _hybrid_admit(self, request: Request, plan: _HybridPlan) -> None:
        """Loads of a hybrid request's plan, group by group; a window group's blocks before its window
        (allocated and cached by the pool, never loaded) leave the pool's index."""
        rid = request.request_id
        pos = plan.first
        asynchronous = False  # a hybrid model loads synchronously (refused at construction otherwise)
        tables = self.manager.get_block_ids(rid)
        hashes = request.block_hashes
        n = self._num_groups
        origin: dict[int, str] = {}
        loads: list[BlockLoad] = []
        pool = self._pool
        for group in self.groups:
            g = group.index
            table = tables[g]
            start = plan.starts[g]
            for k in range(pos, start):  # out of the window at the hit's end: not loaded, so not cached
                block = pool.block(table[k])
                if block.block_id and block.block_hash is not None:
                    pool.uncache(block)
                self.window_skipped_loads += 1
            k = start
            for name, blocks in plan.runs[g]:
                counters = self.counters[name]
                for _ in range(blocks):
                    key = bytes(hashes[k]) + group.tag
                    slot = None
                    if self._host is not None and name == self._host.name:
                        slot = self._host.pin(key)
                        self._pinned.setdefault(rid, []).append(slot)
                    loads.append(BlockLoad(rid, k, table[k], key, name, slot, asynchronous))
                    origin[k * n + g] = name
                    counters.hit_blocks += 1
                    k += 1
        self._origin[rid] = origin
        if loads:
            self._pending_loads[rid] = loads

    def _hybrid_fill(self, request: Request, first: int, stop: int, end: int, saves: list[BlockSave]) -> None:
        """Blocks ``first .. stop-1`` of every group became full in a step ending at ``end`` tokens.

        Write-through plans their saves, write-back remembers them; a window group's blocks the
        request can no longer read (out of its window at ``end``) are skipped.
        """
        rid = request.request_id
        hashes = request.block_hashes
        tables = self.manager.get_block_ids(rid)
        origin = self._origin.get(rid, {})
        n = self._num_groups
        back = self.write is WritePolicy.WRITE_BACK
        tokens: Sequence[int] | None = None
        for group in self.groups:
            g = group.index
            table = tables[g]
            readable = first_readable(group, end) if group.is_window and self.window_aware_saves else 0
            if readable > first:
                self.window_skipped_saves += min(readable, stop) - first
            for pos in range(max(first, readable), stop):
                block_id = table[pos]
                if not block_id:
                    continue
                source = origin.get(pos * n + g)
                tiers = self._below(source)
                if back:
                    if not tiers:
                        self._resident.pop(block_id, None)
                        continue
                    event = None
                    if self._pool.records_events:
                        tokens = tokens or request.all_token_ids
                        event = self._pool.stored_event(
                            request, hashes, [pos], group_id=g, block_size=self.block_size, tokens=tokens
                        )
                    self._resident[block_id] = _Resident(hashes[pos], source, event, bytes(hashes[pos]) + group.tag)
                    continue
                if not tiers:
                    continue
                key = bytes(hashes[pos]) + group.tag
                tiers, slot = self._reserve_host(key, tiers, rid)
                if not tiers:
                    continue
                saves.append(BlockSave(rid, block_id, key, tiers, slot))
                for name in tiers:
                    self.counters[name].saved_blocks += 1
                self._saving.add(rid)
                if self._pool.records_events:
                    tokens = tokens or request.all_token_ids
                    event = self._pool.stored_event(
                        request, hashes, [pos], group_id=g, block_size=self.block_size, tokens=tokens
                    )
                    stored = self._stored.setdefault(rid, [])
                    stored.extend(dataclasses.replace(event, medium=event_medium(name)) for name in tiers)

    # -- admission --------------------------------------------------------------------

    def update_state_after_alloc(
        self, request: Request, block_ids: Sequence[int], num_local_tokens: int, match: ExternalMatch
    ) -> None:
        rid = request.request_id
        bs = self.block_size
        pos = num_local_tokens // bs
        if self._hybrid:
            plan = self._admitted_plan(request, pos, match)  # refuses a match it did not make, changing nothing
            self._saved_upto[rid] = pos
            offered = self._offered.pop(rid, None)
            if self.chooser is not None and offered is not None:
                self.chooser.count(offered, ExternalMatch(match.runs, offered.asynchronous))
            if plan is not None:
                self._hybrid_admit(request, plan)
            return
        self._saved_upto[rid] = pos
        if self._lookups is not None:
            self._lookups.forget(rid)  # admitted: a later admission (after a preemption) looks up again
        offered = self._offered.pop(rid, None)
        if self.chooser is not None and offered is not None:
            self.chooser.count(offered, ExternalMatch(match.runs, offered.asynchronous))
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
                    loads.append(BlockLoad(rid, pos, block_ids[pos], key, run.tier, slot, match.asynchronous))
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
        spills = self._spill_evicted()
        saves: list[BlockSave] = []
        bs = self.block_size
        for request, end in scheduled:
            rid = request.request_id
            done = self._saved_upto.get(rid)
            if done is None:
                continue
            full = min(end // bs, len(request.block_hashes))
            if full <= done:
                continue
            if self._hybrid:
                self._hybrid_fill(request, done, full, end, saves)
            else:
                self._on_fill(request, done, full, saves)
            self._saved_upto[rid] = full
        return ConnectorMetadata(tuple(loads), tuple(saves), tuple(spills))

    def _below(self, origin: str | None) -> tuple[str, ...]:
        """The tiers a block goes down to (the policy's destinations)."""
        return self.policy.destinations(origin)

    def _save_on_fill(self, request: Request, first: int, stop: int, saves: list[BlockSave]) -> None:
        """Write-through: blocks ``first .. stop-1`` of ``request`` became full this step; plan their saves."""
        rid = request.request_id
        hashes = request.block_hashes
        table = self.manager.get_block_ids(rid)[0]
        origin = self._origin.get(rid, {})
        tokens: Sequence[int] | None = None
        for pos in range(first, stop):
            tiers = self._below(origin.get(pos))
            if not tiers:
                continue
            key = bytes(hashes[pos])
            tiers, slot = self._reserve_host(key, tiers, rid)
            if not tiers:
                continue
            saves.append(BlockSave(rid, table[pos], key, tiers, slot))
            for name in tiers:
                self.counters[name].saved_blocks += 1
            self._saving.add(rid)
            if self._pool.records_events:
                tokens = tokens or request.all_token_ids  # a copy: taken once per request
                event = self._pool.stored_event(request, hashes, [pos], block_size=self.block_size, tokens=tokens)
                stored = self._stored.setdefault(rid, [])
                stored.extend(dataclasses.replace(event, medium=event_medium(name)) for name in tiers)

    def _remember_on_fill(self, request: Request, first: int, stop: int, saves: list[BlockSave]) -> None:
        """Write-back: blocks ``first .. stop-1`` of ``request`` became full; they go down when evicted."""
        rid = request.request_id
        hashes = request.block_hashes
        table = self.manager.get_block_ids(rid)[0]
        origin = self._origin.get(rid, {})
        tokens: Sequence[int] | None = None
        for pos in range(first, stop):
            source = origin.get(pos)
            if not self._below(source):
                self._resident.pop(table[pos], None)
                continue
            event = None
            if self._pool.records_events:
                tokens = tokens or request.all_token_ids
                event = self._pool.stored_event(request, hashes, [pos], block_size=self.block_size, tokens=tokens)
            self._resident[table[pos]] = _Resident(hashes[pos], source, event, bytes(hashes[pos]))

    def _note_evicted(self, blocks: Sequence[KVBlock]) -> None:
        """The GPU pool evicts ``blocks`` (their hashes still set): remember the ones write-back must save."""
        resident = self._resident
        for block in blocks:
            entry = resident.pop(block.block_id, None)
            if entry is not None and entry.key == block.block_hash:
                self._evicted.append((block.block_id, entry))

    def _spill_evicted(self) -> list[BlockSave]:
        """Write-back: saves of the blocks evicted since the last plan, copied out before anything reuses them.

        A spill belongs to no request; its host block is released at once (it is
        written at the start of this step, before any later plan can take it).
        """
        if not self._evicted:
            return []
        spills: list[BlockSave] = []
        for block_id, entry in self._evicted:
            key = entry.tier_key
            tiers, slot = self._reserve_host(key, self._below(entry.origin), None)
            if not tiers:
                continue
            spills.append(BlockSave(None, block_id, key, tiers, slot))
            for name in tiers:
                self.counters[name].saved_blocks += 1
            if entry.event is not None:
                for name in tiers:
                    self._pool.record(dataclasses.replace(entry.event, medium=event_medium(name)))
        self._evicted.clear()
        if self._host is not None:
            slots = [s.host_slot for s in spills if s.host_slot is not None]
            if slots:
                self._host.release(slots)
        return spills

    def _reserve_host(self, key: bytes, tiers: tuple[str, ...], rid: str | None) -> tuple[tuple[str, ...], int | None]:
        """A host block for ``key`` when the CPU tier is among ``tiers``; the tiers left to save to, and the slot."""
        placement = self.policy.place(key, tiers)
        if self._host is not None:
            self._record_removed(self._host.name, placement.evicted)
        if placement.host_slot is not None and rid is not None:
            self._pinned.setdefault(rid, []).append(placement.host_slot)
        return placement.tiers, placement.host_slot

    def update_finished(self, result: TransferResult) -> None:
        bs = self.block_size
        n = self._num_groups
        for rid, valid in result.failed_loads.items():
            for where, tier in self._origin.get(rid, {}).items():
                if where // n * bs >= valid:
                    self.counters[tier].failed_blocks += 1
        done = result.finished_loads | result.finished_saves
        for rid in sorted(done):  # events and host slots in request-ID order, not the set's (hash-seed) order
            if rid in result.finished_saves:
                self._saving.discard(rid)
                for event in self._stored.pop(rid, ()):
                    self._pool.record(event)
            if rid not in self._saving and self._host is not None:
                slots = self._pinned.pop(rid, None)
                if slots:
                    self._host.release(slots)

    def request_finished(self, request: Request, block_ids: Sequence[int]) -> bool:
        rid = request.request_id
        self._saved_upto.pop(rid, None)
        self._origin.pop(rid, None)
        self._offered.pop(rid, None)
        self._plans.pop(rid, None)
        if self._lookups is not None:
            self._lookups.forget(rid)
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
        self._offered.pop(request_id, None)
        self._plans.pop(request_id, None)
        if self._lookups is not None:
            self._lookups.forget(request_id)
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
        holds what a completed save wrote. Write-back forgets the pool's blocks
        it would have saved (their KV may be what the failed step left).
        """
        self._pending_loads.clear()
        self._offered.clear()
        self._plans.clear()
        if self._lookups is not None:
            self._lookups = OffStepLookups(self.policy, self._lookups.threads, self._lookups.on_lookup)
        self._saved_upto.clear()
        self._origin.clear()
        self._pinned.clear()
        self._saving.clear()
        self._stored.clear()
        self._resident.clear()
        self._evicted.clear()
        if self._host is not None:
            self._record_removed(self._host.name, self._host.clear())

    def _record_removed(self, tier: str, keys: Sequence[bytes]) -> None:
        if keys:
            self._pool.record(BlockRemoved(block_hashes=tuple(BlockHash(k) for k in keys), medium=event_medium(tier)))

    # -- figures ---------------------------------------------------------------------

    @property
    def num_looking(self) -> int:
        """Requests whose disk and Redis lookups are running off the step."""
        return 0 if self._lookups is None else self._lookups.num_pending

    def lookup_errors(self) -> dict[str, int]:
        return {t.name: t.lookup_errors for t in self.tiers if isinstance(t, ByteTier)}
