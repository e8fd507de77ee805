"""The scheduler side of the vLLM connector: which blocks load from which tier, which go down, and where.

Torch-free and vLLM-free: it sees a request only as ``request_id``, ``num_tokens`` and
``block_hashes`` (vLLM's chained block hashes, bytes), so tests drive it with plain objects.

Keys are vLLM's own block hashes. vLLM chains them from the request's tokens, its cache salt
and LoRA name (its ``sha256`` or ``sha256_cbor``, seeded by ``PYTHONHASHSEED`` or its fixed
default), so two vLLM processes with the same settings compute the same key for the same
prefix, and tenants with different salts never share a block. The entry around each block
(:class:`~kvpool.tiers.entry.EntryCodec`) names the model, its weights and the KV layout, and
with a secret is signed.

The rules (lookup, where a block goes down, host slots) are :class:`~kvpool.tiers.policy.TierPolicy`'s,
the ones the engine and the simulator follow; this module translates vLLM's requests, scheduler
output and block IDs into keys and back. What one step does, as :meth:`TierPlanner.build` plans it::

    admission      match(): after vLLM's local hit, each next block from the first tier holding it
                   (the host tier first, then the stores in the order given; the next block again
                   from the first), never the last token; loads_async(): whether vLLM should wait
                   for them off its step (a store serves one of them)
    allocation     allocated(): the matched blocks' vLLM block IDs become loads
    end of step    build(): loads (host slots pinned first), then saves: every block that becomes
                   full in this step and was neither a local hit nor loaded goes to every tier; a
                   loaded block goes to the tiers above the one it came from

An asynchronous load (:attr:`StepPlan.receiving`) is planned in the step its blocks are allocated,
while vLLM holds the request in ``WAITING_FOR_REMOTE_KVS``; the request is scheduled in a later
step, once the worker reported it received. Its promotions wait for that step, and cover only the
blocks below where vLLM resumes it (a block that failed to load is computed, and saved as computed).

The host tier's bookkeeping is kvpool's :class:`~kvpool.tiers.policy.HostTier` (an LRU of host
slots); the worker holds the memory and copies at the slots named here. Slots are pinned only
while a plan is built: the worker carries out plans in the order they were built, so a slot
reassigned by a later plan is read or written by this plan's copies first.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvpool.checks import check_flag
from kvpool.connector import ExternalMatch, TierRun
from kvpool.errors import ConfigError
from kvpool.tiers import ByteTier, CpuTarget, HostTier, parse_specs
from kvpool.tiers.entry import check_namespace
from kvpool.tiers.load_or_compute import LoadOrCompute, LoadWait
from kvpool.tiers.lookups import OffStepLookups
from kvpool.tiers.piece_fetch import DeadlineMiss, tier_runs
from kvpool.tiers.policy import TierPolicy
from kvpool.tiers.store import BACKENDS, TierTarget, check_tier_trust
from kvpool.tiers.transfer_threads import DEFAULT_LOAD_DEADLINE_S, TransferThreads, check_load_deadline

__all__ = [
    "VllmBlockLoad",
    "VllmBlockSave",
    "ConnectorOptions",
    "PlannedRequest",
    "VllmScheduledChunk",
    "StepPlan",
    "TierPlanner",
    "TransferNotes",
]

_log = logging.getLogger("kvpool.integrations.vllm")

_OPTION_KEYS = frozenset(
    {
        "tiers",
        "secret_file",
        "unauthenticated",
        "namespace",
        "async_loads",
        "load_deadline_s",
        "always_load",
        "prefill_tokens_per_s",
    }
)


@dataclass(frozen=True, slots=True, kw_only=True)
class ConnectorOptions:
    """What ``kv_connector_extra_config`` says, checked.

    ``tiers``: tier specs in lookup order (``cpu:SIZE``, ``disk:PATH:SIZE``, ``redis://...``);
    ``secret_file``: signs and checks every disk and Redis entry (at least 16 bytes); a disk or
    Redis tier needs it, or ``unauthenticated`` (true: the operator accepts entries anyone who can
    write to the tier may have planted; :func:`kvpool.tiers.store.check_tier_trust`);
    ``namespace``: names the weights instead of hashing the model folder's files;
    ``async_loads`` (default true): loads from a disk or Redis tier run off vLLM's step, vLLM
    holding only the requests that wait on them; ``load_deadline_s``: the longest such a lookup or
    load may take before its request computes those blocks instead (the worker's transfer
    threads, :class:`~kvpool.tiers.transfer_threads.TransferThreads`); with load or compute a
    load is given up sooner, once waiting for its next piece costs more than computing it
    (:attr:`StepPlan.waits`).

    Load or compute (:class:`~kvpool.tiers.load_or_compute.LoadOrCompute`, the engine's rule): a
    match is trimmed to the blocks whose load is measured to beat computing them. ``always_load``
    (default false) turns it off. ``prefill_tokens_per_s``: this deployment's prefill rate, fixed
    (vLLM tells a connector no rate; None: the worker measures it on vLLM-CPU, from each step's
    forward pass, and elsewhere, where a pass is not timed on the host, the prior is 20,000).
    """

    tiers: tuple[TierTarget, ...]
    secret_file: str | None = None
    unauthenticated: bool = False
    namespace: str | None = None
    async_loads: bool = True
    load_deadline_s: float = DEFAULT_LOAD_DEADLINE_S
    always_load: bool = False
    prefill_tokens_per_s: float | None = None

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, object]) -> ConnectorOptions:
        """The options in vLLM's ``kv_connector_extra_config``; ConfigError naming the key or value at fault."""
        if not isinstance(extra, Mapping):
            raise ConfigError(f"kv_connector_extra_config must be a JSON object, got {extra!r}")
        unknown = sorted(set(extra) - _OPTION_KEYS)
        if unknown:
            raise ConfigError(
                f"kv_connector_extra_config has unknown keys {unknown} for KVPoolConnector; it takes {sorted(_OPTION_KEYS)}"
            )
        specs = extra.get("tiers")
        if not isinstance(specs, list | tuple) or not specs:
            raise ConfigError(
                f"kv_connector_extra_config 'tiers' must be a non-empty list of tier specs such as "
                f"['cpu:2GiB', 'redis://127.0.0.1:6379/0'], got {specs!r}"
            )
        secret_file = extra.get("secret_file")
        if secret_file is not None and (not isinstance(secret_file, str) or not secret_file):
            raise ConfigError(f"kv_connector_extra_config 'secret_file' must be a file path, got {secret_file!r}")
        namespace = check_namespace(extra.get("namespace"), "kv_connector_extra_config 'namespace'")
        tiers = parse_specs(list(specs))
        unauthenticated = check_tier_trust(
            tiers,
            secret=secret_file is not None,
            unauthenticated=extra.get("unauthenticated", False),
            secret_name="kv_connector_extra_config 'secret_file'",
            unauthenticated_name="kv_connector_extra_config 'unauthenticated'",
        )
        async_loads = check_flag("kv_connector_extra_config 'async_loads'", extra.get("async_loads", True))
        deadline = check_load_deadline(
            extra.get("load_deadline_s", DEFAULT_LOAD_DEADLINE_S), "kv_connector_extra_config 'load_deadline_s'"
        )
        always_load = check_flag("kv_connector_extra_config 'always_load'", extra.get("always_load", False))
        rate = extra.get("prefill_tokens_per_s")
        if rate is not None and (
            isinstance(rate, bool) or not isinstance(rate, int | float) or not math.isfinite(rate) or rate <= 0
        ):
            raise ConfigError(f"kv_connector_extra_config 'prefill_tokens_per_s' must be a number > 0, got {rate!r}")
        return cls(
            tiers=tiers,
            secret_file=secret_file,
            unauthenticated=unauthenticated,
            namespace=namespace,
            async_loads=async_loads,
            load_deadline_s=deadline,
            always_load=always_load,
            prefill_tokens_per_s=None if rate is None else float(rate),
        )

    @property
    def needs_weights(self) -> bool:
        """Whether any tier keeps entries that outlive this process (disk, Redis), so entries must name the weights."""
        return any(BACKENDS[t.kind].outlives_process for t in self.tiers)

    def host_slots(self, block_bytes: int) -> int | None:
        """Host blocks the ``cpu:SIZE`` tier holds for blocks of ``block_bytes``; None without one.

        ConfigError naming the spec if it holds less than one block.
        """
        for target in self.tiers:
            if isinstance(target, CpuTarget):
                slots = target.capacity_bytes // block_bytes
                if slots < 1:
                    raise ConfigError(
                        f"tier cpu:{target.capacity_bytes} holds less than one block of {block_bytes} bytes"
                    )
                return slots
        return None


@dataclass(frozen=True, slots=True, kw_only=True)
class VllmBlockLoad:
    """Copy the block stored under ``key`` in ``tier`` into vLLM block ``block_id`` (at host ``slot`` for cpu).

    ``request_id``: the request it is loaded for (an asynchronous load is reported by request).
    """

    request_id: str
    tier: str
    key: bytes
    block_id: int
    slot: int | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class VllmBlockSave:
    """Send vLLM block ``block_id`` to ``tiers`` under ``key`` (the cpu tier at host ``slot``)."""

    key: bytes
    block_id: int
    tiers: tuple[str, ...]
    slot: int | None = None


@dataclass(frozen=True, slots=True)
class StepPlan:
    """One step's transfers: loads before the forward pass, saves after it (promotions of loads included).

    ``receiving``: the requests whose loads vLLM waits for off its step (``WAITING_FOR_REMOTE_KVS``);
    each is reported received once, when its blocks are in place or reported as load errors.
    The other requests' loads are in place before the forward pass. ``waits``: for a receiving
    request, how its disk and Redis blocks (its loads without a host slot, in order) are read and
    how long it waits for them (:meth:`~kvpool.tiers.load_or_compute.TransferCosts.load_wait`, the
    engine's rule, priced by the scheduler's measurement); a request without one waits the fixed
    load deadline.
    """

    loads: tuple[VllmBlockLoad, ...] = ()
    saves: tuple[VllmBlockSave, ...] = ()
    receiving: tuple[str, ...] = ()
    #: Tokens the step computes (all its requests': what its forward pass is timed against).
    num_scheduled_tokens: int = 0
    waits: tuple[tuple[str, LoadWait], ...] = ()


@dataclass(slots=True)
class TransferNotes:
    """What a worker measured since its last report, for the scheduler's load-or-compute rule.

    ``loads``: (tier, blocks, bytes, seconds) per fetch (per piece of an asynchronous one);
    ``failed``: (tier, blocks, seconds) per fetch that failed after that long; ``steps``: (tokens,
    seconds) per forward pass; ``misses``: the asynchronous fetches their request stopped waiting
    for (:class:`~kvpool.tiers.piece_fetch.DeadlineMiss`: the tier then owes its late piece);
    ``late_done``: the tiers whose late piece has since been read (its real time is in ``loads``).
    Sent back to the scheduler as vLLM's worker metadata, where :meth:`TierPlanner.note` hands it
    to the measurement, as the engine's worker does.
    """

    loads: list[tuple[str, int, int, float]] = field(default_factory=list)
    failed: list[tuple[str, int, float]] = field(default_factory=list)
    steps: list[tuple[int, float]] = field(default_factory=list)
    misses: list[DeadlineMiss] = field(default_factory=list)
    late_done: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.loads or self.failed or self.steps or self.misses or self.late_done)

    def extend(self, other: TransferNotes) -> None:
        self.loads += other.loads
        self.failed += other.failed
        self.steps += other.steps
        self.misses += other.misses
        self.late_done += other.late_done


class PlannedRequest(Protocol):
    """The part of a vLLM ``Request`` the planner reads."""

    @property
    def request_id(self) -> str: ...

    @property
    def num_tokens(self) -> int: ...

    @property
    def block_hashes(self) -> Sequence[bytes]: ...


@dataclass(frozen=True, slots=True, kw_only=True)
class VllmScheduledChunk:
    """One request in vLLM's scheduler output.

    ``block_ids``: the request's new block IDs (vLLM's first KV cache group); with ``replace``
    (a new or resumed request) they are all of its blocks. ``num_computed_tokens``: before this
    step (a new request's local hit and loads included); ``num_scheduled_tokens``: computed now.
    """

    request_id: str
    block_ids: tuple[int, ...]
    replace: bool
    num_computed_tokens: int
    num_scheduled_tokens: int


@dataclass(slots=True)
class _Tracked:
    request: PlannedRequest
    block_ids: list[int] = field(default_factory=list)
    saved_upto: int | None = None  # blocks below this index are in the tiers, or were a local hit
    first_block: int = 0  # where the last match started
    runs: tuple[tuple[str, int], ...] = ()  # the last match: (tier, blocks) in lookup order
    loads: list[tuple[str, bytes, int]] = field(default_factory=list)  # allocated, not yet planned
    load_async: bool = False  # the allocated loads are waited for off vLLM's step
    loaded_async: bool = False  # it had an asynchronous load: the stores are not offered again
    # an asynchronous load's promotions, planned when vLLM schedules the request: (index, key, block, tiers)
    promotions: list[tuple[int, bytes, int, tuple[str, ...]]] = field(default_factory=list)
    offered: ExternalMatch | None = None  # what the tiers held before load or compute trimmed it


class TierPlanner:
    """The scheduler side's state and decisions over ``tiers`` (a host tier first, if any, then stores).

    Each tier answers ``contains_prefix`` (a :class:`~kvpool.tiers.hierarchy.HostTier` or a
    :class:`~kvpool.tiers.hierarchy.ByteTier`, which turns a store's fault into a miss).
    ``async_loads``: a match that a store serves is loaded off vLLM's step (:meth:`loads_async`);
    ``lookups``: the threads the stores are looked up on, off vLLM's step too
    (:class:`~kvpool.tiers.lookups.OffStepLookups`; None: on the caller's thread);
    ``chooser``: load or compute, the engine's :class:`~kvpool.tiers.load_or_compute.LoadOrCompute`
    asked the same way :class:`~kvpool.tiers.hierarchy.TierHierarchyConnector` asks it (a lookup not
    worth waiting for is not asked, one outlasting the compute is given up, each match is trimmed,
    each admission counted, and each asynchronous load's wait bounded by the compute it saves,
    :attr:`StepPlan.waits`); None: every hit loads, waited for up to ``load_deadline_s``.
    O(blocks looked up) per match, O(blocks moved) per plan.
    """

    def __init__(
        self,
        tiers: Sequence[HostTier | ByteTier],
        block_size: int,
        *,
        async_loads: bool = False,
        lookups: TransferThreads | None = None,
        chooser: LoadOrCompute | None = None,
        load_deadline_s: float = DEFAULT_LOAD_DEADLINE_S,
    ) -> None:
        names = [t.name for t in tiers]
        if not tiers or len(set(names)) != len(names):
            raise ConfigError(f"the connector needs tiers of distinct kinds, got {names}")
        if any(isinstance(t, HostTier) for t in tiers[1:]):
            raise ConfigError(f"the cpu tier is looked up first; got the order {names}")
        if type(block_size) is not int or block_size < 1:
            raise ConfigError(f"block_size must be a positive int, got {block_size!r}")
        self.policy = TierPolicy(tiers)
        self.tiers = self.policy.tiers
        self.block_size = block_size
        self.host = self.policy.host
        self.async_loads = check_flag("async_loads", async_loads)
        #: The fixed deadline that bounds every asynchronous load's wait (the worker's transfer threads').
        self.load_deadline_s = check_load_deadline(load_deadline_s)
        has_store = any(not isinstance(t, HostTier) for t in self.tiers)
        if chooser is not None and not isinstance(chooser, LoadOrCompute):
            raise ConfigError(f"chooser must be a LoadOrCompute, got {chooser!r}")
        self.chooser = chooser
        on_lookup = None if chooser is None else chooser.note_lookup
        self.lookups = OffStepLookups(self.policy, lookups, on_lookup) if lookups is not None and has_store else None
        self._host_only = None if self.host is None else TierPolicy([self.host])
        self._requests: dict[str, _Tracked] = {}
        self._allocated: dict[str, None] = {}  # requests with loads not yet planned, in allocation order
        #: Cumulative blocks matched per tier (what vLLM was told it can load).
        self.matched_blocks: dict[str, int] = dict.fromkeys(names, 0)
        #: Cumulative blocks planned to be saved per tier.
        self.saved_blocks: dict[str, int] = dict.fromkeys(names, 0)

    def _track(self, request: PlannedRequest) -> _Tracked:
        tracked = self._requests.get(request.request_id)
        if tracked is None:
            tracked = self._requests[request.request_id] = _Tracked(request)
        return tracked

    def add(self, request: PlannedRequest) -> None:
        """Start tracking ``request`` (vLLM's ``on_new_request``)."""
        self._track(request)

    def match(self, request: PlannedRequest, num_computed_tokens: int) -> int | None:
        """Tokens beyond ``num_computed_tokens`` (block-aligned) that the tiers hold, whole blocks only.

        Never reaches the request's last token (vLLM computes at least that one). Changes no
        tier: it may be asked again for the same request when its allocation is refused. With
        ``lookups``, None while the stores' answers are not back (vLLM asks again next step).

        A request that already had an asynchronous load is offered the host tier only: vLLM
        asks again when that load failed from its first block (it frees the blocks and admits the
        request anew), and a store that lists blocks it cannot return would be offered them at
        every step, for ever. (A preempted request then computes what a store would have served.)
        """
        if num_computed_tokens % self.block_size:
            raise ConfigError(f"num_computed_tokens {num_computed_tokens} is not a multiple of {self.block_size}")
        tracked = self._track(request)
        first = num_computed_tokens // self.block_size
        limit = min((request.num_tokens - 1) // self.block_size, len(request.block_hashes))
        keys = [bytes(h) for h in request.block_hashes[first:limit]]
        chooser, bs = self.chooser, self.block_size
        if tracked.loaded_async or not keys:
            runs: tuple[tuple[str, int], ...] = self._host_only.match(keys) if self._host_only is not None else ()
        elif self.lookups is None:
            runs = self.policy.match(keys)
        elif (
            chooser is not None
            and not self.lookups.asked(request.request_id, keys)
            and not chooser.worth_looking_up(
                len(keys),
                len(keys) * bs,
                self.lookups.threads.load_deadline_s,
                [t.name for t in self.policy.tiers if isinstance(t, ByteTier)],  # none worth loading: not asked
            )
        ):
            runs = self._host_only.match(keys) if self._host_only is not None else ()  # waiting would cost more
        else:
            # waiting for the stores longer than computing the tokens would take is never worth it
            give_up = None if chooser is None else chooser.compute_seconds(len(keys) * bs)
            found = self.lookups.match(request.request_id, keys, give_up_after=give_up)
            if found is None:
                return None
            runs = found
        tracked.offered = None
        if chooser is not None and runs:
            offered = ExternalMatch(tuple(TierRun(name, blocks * bs) for name, blocks in runs))
            tracked.offered = offered
            runs = tuple((run.tier, run.num_tokens // bs) for run in chooser.choose(offered).runs)
        tracked.first_block, tracked.runs = first, runs
        return sum(blocks for _name, blocks in runs) * bs

    def loads_async(self, request_id: str) -> bool:
        """Whether the last match of ``request_id`` is loaded off vLLM's step: a disk or Redis tier serves part of it.

        A match the host tier serves alone is a memory copy, done before the forward pass.
        """
        tracked = self._requests.get(request_id)
        if not self.async_loads or tracked is None:
            return False
        host_name = self.host.name if self.host is not None else None
        return any(name != host_name for name, _blocks in tracked.runs)

    def hit_tokens_by_tier(self, request_id: str) -> dict[str, int]:
        """The last match of ``request_id``, in tokens per tier (only tiers that hold some)."""
        tracked = self._requests.get(request_id)
        found: dict[str, int] = {}
        for name, n in () if tracked is None else tracked.runs:  # a tier may serve more than one run
            found[name] = found.get(name, 0) + n * self.block_size
        return found

    def allocated(self, request: PlannedRequest, block_ids: Sequence[int], num_external_tokens: int) -> None:
        """vLLM allocated ``block_ids`` (all of the request's blocks) and will count ``num_external_tokens`` loaded.

        Call it at every admission, with 0 external tokens too: load or compute counts each
        admitted request's decision here, where the engine counts it. ConfigError naming the count
        if it is not whole blocks of the last match.
        """
        tracked = self._track(request)
        offered, tracked.offered = tracked.offered, None
        if self.chooser is not None and offered is not None and num_external_tokens <= offered.num_tokens:
            self.chooser.count(offered, offered.truncated(num_external_tokens))
        if num_external_tokens == 0:
            return
        blocks, partial = divmod(num_external_tokens, self.block_size)
        matched = sum(n for _name, n in tracked.runs)
        if partial or not 0 < blocks <= matched:
            raise ConfigError(
                f"request {request.request_id!r}: {num_external_tokens} external tokens are not whole blocks "
                f"of the {matched * self.block_size} tokens the tiers matched"
            )
        index = tracked.first_block
        loads: list[tuple[str, bytes, int]] = []
        for name, n in tracked.runs:
            for _ in range(n):
                if len(loads) == blocks:
                    break
                loads.append((name, bytes(request.block_hashes[index]), block_ids[index]))
                index += 1
        tracked.loads = loads
        tracked.load_async = self.loads_async(request.request_id)
        tracked.loaded_async = tracked.loaded_async or tracked.load_async
        if self.lookups is not None:
            self.lookups.forget(request.request_id)  # admitted: a later admission (preempted) asks again
        self._allocated[request.request_id] = None
        for name, _key, _block in loads:
            self.matched_blocks[name] += 1

    def note(self, notes: TransferNotes) -> None:
        """A worker's measurements (:class:`TransferNotes`) into load or compute's; nothing without a chooser.

        A fixed prefill rate (``prefill_tokens_per_s`` configured) is kept: the worker sends no steps then.
        A deadline miss makes its tier owe the late piece, so load or compute neither loads from it nor
        looks it up until a ``late_done`` names it (the piece's real time is then among the loads).
        A note the measurement refuses (a tier it does not measure, a negative time: another process's
        bug) is dropped, never raised into vLLM's step.
        """
        if self.chooser is None:
            return
        costs = self.chooser.costs
        told: list[Callable[[], object]] = [
            *(functools.partial(costs.note_load, *load) for load in notes.loads),
            *(functools.partial(costs.note_failed_load, *failed) for failed in notes.failed),
            *(functools.partial(costs.note_prefill, *step) for step in notes.steps),
            *(functools.partial(miss.tell, costs) for miss in notes.misses if isinstance(miss, DeadlineMiss)),
        ]
        for tell in told:
            try:
                tell()
            except (ConfigError, TypeError, ValueError) as exc:
                _log.warning("kvpool connector: a worker's measurement was dropped (%s)", exc)
        for miss in notes.misses:
            if isinstance(miss, DeadlineMiss) and miss.reading and miss.tier in costs.tiers and costs.owes(miss.tier):
                _log.info(
                    "kvpool connector: %s missed a load's deadline (a piece of %d blocks not back in %.3g s); "
                    "not loaded from until it is",
                    miss.tier, miss.late_blocks, miss.seconds,
                )  # fmt: skip
        for tier in notes.late_done:
            if tier in costs.tiers and costs.owes(tier):
                costs.note_late_piece_done(tier)
                if not costs.owes(tier):
                    _log.info("kvpool connector: %s's late pieces arrived; it is loaded from again", tier)

    def build(self, chunks: Sequence[VllmScheduledChunk]) -> StepPlan:
        """The step's loads and saves for vLLM's scheduled ``chunks``; resets what allocation queued.

        Loads are those allocated since the last plan, whether or not their request is scheduled
        now (an asynchronous load's request is not, until it is received).
        """
        loads: list[VllmBlockLoad] = []
        saves: list[VllmBlockSave] = []
        receiving: list[str] = []
        pinned: list[int] = []
        host_name = self.host.name if self.host is not None else None
        promotions: list[tuple[bytes, int, tuple[str, ...]]] = []
        waits: list[tuple[str, LoadWait]] = []
        for request_id in self._allocated:
            loading = self._requests[request_id]
            if loading.load_async:
                receiving.append(request_id)
                wait = self._wait(loading.loads, host_name)
                if wait is not None:
                    waits.append((request_id, wait))
            for index, (name, key, block_id) in enumerate(loading.loads, start=loading.first_block):
                slot = None
                if name == host_name and self.host is not None:
                    slot = self.host.pin(key)  # nothing is reserved between a match and this plan
                    pinned.append(slot)
                loads.append(VllmBlockLoad(tier=name, key=key, block_id=block_id, slot=slot, request_id=request_id))
                above = self.policy.destinations(name)
                if above and loading.load_async:
                    loading.promotions.append((index, key, block_id, above))
                elif above:
                    promotions.append((key, block_id, above))
            loading.loads = []
        self._allocated.clear()
        for key, block_id, tiers in promotions:
            save = self._save(key, block_id, tiers, pinned)
            if save is not None:
                saves.append(save)
        for chunk in chunks:
            tracked = self._requests.get(chunk.request_id)
            if tracked is None:
                continue
            if tracked.promotions:  # received: promote what vLLM counts as loaded
                loaded = chunk.num_computed_tokens // self.block_size
                for index, key, block_id, tiers in tracked.promotions:
                    save = self._save(key, block_id, tiers, pinned) if index < loaded else None
                    if save is not None:
                        saves.append(save)
                tracked.promotions = []
            if chunk.replace:
                tracked.block_ids = list(chunk.block_ids)
            else:
                tracked.block_ids.extend(chunk.block_ids)
            done = chunk.num_computed_tokens // self.block_size
            # New: what is computed already was a local hit or a load. Later: a step that starts below
            # what was saved is recomputing (a failed load, a preemption), and saves those blocks again.
            tracked.saved_upto = done if tracked.saved_upto is None else min(tracked.saved_upto, done)
            hashes = tracked.request.block_hashes
            full = min(
                (chunk.num_computed_tokens + chunk.num_scheduled_tokens) // self.block_size,
                len(hashes),
                len(tracked.block_ids),
            )
            every = self.policy.destinations(None)
            for index in range(tracked.saved_upto, full):
                save = self._save(bytes(hashes[index]), tracked.block_ids[index], every, pinned)
                if save is not None:
                    saves.append(save)
            tracked.saved_upto = max(tracked.saved_upto, full)
        if self.host is not None and pinned:
            self.host.release(pinned)
        scheduled = sum(chunk.num_scheduled_tokens for chunk in chunks)
        return StepPlan(tuple(loads), tuple(saves), tuple(receiving), scheduled, tuple(waits))

    def _wait(self, loads: Sequence[tuple[str, bytes, int]], host_name: str | None) -> LoadWait | None:
        """How an asynchronous load's store blocks are read and waited for (None: no rule, the fixed deadline)."""
        tiers = [name for name, _key, _block in loads if name != host_name]
        if self.chooser is None or not tiers:
            return None
        costs = self.chooser.costs
        return costs.load_wait(tier_runs(tiers), block_size=self.block_size, cap_s=self.load_deadline_s)

    def _save(self, key: bytes, block_id: int, tiers: tuple[str, ...], pinned: list[int]) -> VllmBlockSave | None:
        placement = self.policy.place(key, tiers)  # a host slot when the cpu tier is among them
        tiers, slot = placement.tiers, placement.host_slot
        if slot is not None:
            pinned.append(slot)
        if not tiers:
            return None
        for name in tiers:
            self.saved_blocks[name] += 1
        return VllmBlockSave(key=key, block_id=block_id, tiers=tiers, slot=slot)

    def finished(self, request_id: str) -> None:
        """Forget ``request_id`` (finished or aborted); its saves were planned as its blocks filled."""
        self._requests.pop(request_id, None)
        self._allocated.pop(request_id, None)
        if self.lookups is not None:
            self.lookups.forget(request_id)

    def reset(self) -> None:
        """Forget every host block (vLLM's ``reset_prefix_cache``); disk and Redis entries stay."""
        if self.host is not None:
            self.host.clear()

    @property
    def num_tracked(self) -> int:
        return len(self._requests)
