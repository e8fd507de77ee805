"""A continuous-batching scheduler on top of the KV cache manager (no torch).

Each step, under a token budget (``max_num_batched_tokens``) and a cap on
running requests (``max_num_seqs``):

1. Running requests first, oldest first: one token for a decoding request,
   the next chunk for a request still in prefill. When the manager has no
   room, the most recently admitted running request is preempted: its blocks
   are freed, it goes back to the front of the waiting queue and is
   recomputed later (its prompt and outputs will mostly hit the cache).
2. Then waiting requests in arrival order, each after a prefix-cache lookup,
   as long as the budget, the cap and the free blocks allow. A long prompt is
   split across steps (chunked prefill). No admission happens in a step that
   preempted.

Requests may name their tenant (:meth:`Scheduler.add_request`). While more
than one tenant has unfinished requests, the tenants share the batch, the
pool and each step's token budget by weighted dominant-resource fairness
(:mod:`kvpool.fair_share`): the running requests are served, and preempted,
in the order of their tenants' loads, waiting requests are admitted from the
tenant with the lowest load, and a tenant under its share may preempt a
tenant over it. With one tenant the steps are exactly the ones above.

The output of a step is plain data for a model runner: which requests, which
tokens at which positions, their block tables and slot mappings. After the
runner has sampled, :meth:`Scheduler.update` appends the sampled tokens,
applies the stop conditions and frees finished requests. Steps alternate:
``schedule`` then ``update`` with that very output, once.

Every public method checks all of its arguments before it changes anything:
a :class:`~kvpool.errors.KVPoolError` naming the value means the scheduler,
its requests and the manager are exactly as they were.

Time is read from an injectable clock and only feeds the per-request figures
(queue time, time to first token); no decision depends on it.

With a KV connector (:mod:`kvpool.connector`), an admission also asks it how
many tokens beyond the local prefix hit it can load; those tokens get blocks,
count as cached and are not computed. Each plan carries the connector's
loads and saves (:attr:`SchedulerOutput.connector_meta`);
:meth:`Scheduler.apply_transfers` takes the worker's report: a failed load
moves that request's chunk back so that the tokens are computed in the same
step, and a finished request whose saves were pending keeps its blocks until
they are reported done.

A connector may answer asynchronously (:attr:`ExternalMatch.asynchronous`):
the request is then admitted with blocks for its hit and its loads only, kept
out of the prefix cache, and waits (``WAITING_FOR_KV``, computing nothing)
until a report lists it in ``finished_loads``; its blocks are then cached and
it waits again at the front of the queue to compute the rest. A connector
that does not know yet (:data:`~kvpool.connector.PENDING`, a lookup still
running) has that request skipped for the step, in its place. Reports outside
a step go to :meth:`Scheduler.take_transfers`.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum

from kvpool.checks import MIN_MODEL_LEN, check_int
from kvpool.connector import GPU, NO_MATCH, ConnectorMetadata, ExternalMatch, KVConnector, TransferResult
from kvpool.errors import CapacityError, ConfigError, InvalidTokenError, RequestStateError, RequestTooLarge
from kvpool.fair_share import StepShares, TenantWeights
from kvpool.hashing import TOKEN_LIMIT, to_token_array
from kvpool.manager import HitBlocks, KVCacheManager
from kvpool.request import Request

__all__ = [
    "ChunkDetail",
    "FinishReason",
    "RequestMetrics",
    "RequestStatus",
    "ScheduledChunk",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
    "StopConditions",
    "check_output_bound",
]


class RequestStatus(Enum):
    WAITING = "waiting"
    #: Admitted with an asynchronous external match: it holds its blocks and waits for their KV.
    WAITING_FOR_KV = "waiting_for_kv"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


class FinishReason(Enum):
    LENGTH = "length"  # max_tokens or max_model_len reached
    STOP = "stop"  # a stop token was sampled, or the text reached a stop string
    EOS = "eos"  # the end-of-sequence token was sampled
    ABORTED = "aborted"
    ERROR = "error"  # failed while served (the engine's output carries the error)


class ChunkDetail(Enum):
    """What a scheduled chunk carries besides its counts."""

    #: Token IDs, block tables and slot mappings: what a model runner needs.
    FULL = "full"
    #: Only positions and counts: what a simulator needs (much cheaper).
    COUNTS = "counts"


@dataclass(frozen=True, slots=True, kw_only=True)
class SchedulerConfig:
    """Limits of one step."""

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    max_model_len: int | None = None
    chunk_detail: ChunkDetail = ChunkDetail.FULL
    #: The tenants' weights in the fair share (:mod:`kvpool.fair_share`).
    tenant_weights: TenantWeights = dataclasses.field(default_factory=TenantWeights)

    def __post_init__(self) -> None:
        check_int("max_num_batched_tokens", self.max_num_batched_tokens)
        check_int("max_num_seqs", self.max_num_seqs)
        if self.max_model_len is not None:
            check_int("max_model_len", self.max_model_len, minimum=MIN_MODEL_LEN)
        if not isinstance(self.chunk_detail, ChunkDetail):
            raise ConfigError(f"chunk_detail must be a ChunkDetail, got {self.chunk_detail!r}")
        if not isinstance(self.tenant_weights, TenantWeights):
            raise ConfigError(f"tenant_weights must be a TenantWeights, got {self.tenant_weights!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class StopConditions:
    """When a request stops generating.

    EOS and the stop tokens end a request only once more than ``min_tokens``
    tokens were generated; ``max_tokens`` and ``max_model_len`` always do.
    """

    max_tokens: int = 16
    stop_token_ids: frozenset[int] = frozenset()
    eos_token_id: int | None = None
    ignore_eos: bool = False
    min_tokens: int = 0

    def __post_init__(self) -> None:
        check_int("max_tokens", self.max_tokens)
        check_int("min_tokens", self.min_tokens, minimum=0)
        stops = self.stop_token_ids
        if isinstance(stops, Mapping):  # iterating a mapping would silently take its keys
            raise InvalidTokenError(f"stop_token_ids must be a collection of token IDs, got {stops!r}")
        object.__setattr__(self, "stop_token_ids", frozenset(to_token_array(stops, "stop_token_ids")))
        if self.eos_token_id is not None:
            _check_token(self.eos_token_id, "eos_token_id")
        if type(self.ignore_eos) is not bool:
            raise ConfigError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")


def check_output_bound(stops: Sequence[StopConditions], limit: int, *, omitted: bool = False) -> None:
    """Refuse requests that together may produce more than ``limit`` tokens, or ask that many ``min_tokens``.

    A server's bound on one API request (its prompts times ``n``: ``max_request_tokens``), asked by
    every engine that takes one. ``omitted``: some request gave no ``max_tokens``, so its
    ``max_tokens`` here is the rest of the context (the message says so).

    Raises:
        RequestTooLarge: naming the field (``max_tokens`` or ``min_tokens``) and the totals.
    """
    for field, total in (
        ("max_tokens", sum(s.max_tokens for s in stops)),
        ("min_tokens", sum(s.min_tokens for s in stops)),
    ):
        if total <= limit:
            continue
        each = {s.max_tokens if field == "max_tokens" else s.min_tokens for s in stops}
        what = (
            f"{len(stops)} sequences x {each.pop()} tokens = {total}"
            if len(each) == 1 and len(stops) > 1
            else f"{total} tokens"
        )
        raise RequestTooLarge(
            f"the request may produce {what} ({field}"
            + (", the rest of the context where it is not given" if field == "max_tokens" and omitted else "")
            + f"); one request may ask for at most {limit} (the server's max_request_tokens)",
            field,
        )


def _check_token(token: object, what: str) -> None:
    if type(token) is not int or not 0 <= token < TOKEN_LIMIT:
        raise InvalidTokenError(f"{what} is {token!r}, not an integer token ID in [0, 2**32)")


@dataclass(frozen=True, slots=True, kw_only=True)
class ScheduledChunk:
    """Tokens of one request to compute in this step.

    The chunk covers positions ``start_position .. start_position + len(token_ids) - 1``.
    ``block_tables`` and ``slot_mapping`` hold one entry per layer group;
    ``slot_mapping[g][i] = block * block_size + offset`` is where token ``i``'s
    K and V go in group ``g``. ``sample`` says whether the chunk reaches the end
    of the known tokens, so the logits of its last token are needed. With
    :attr:`ChunkDetail.COUNTS` the three sequences are empty.
    """

    request_id: str
    start_position: int
    num_tokens: int
    sample: bool
    num_cached_tokens: int = 0  # tokens this admission took from the prefix cache
    token_ids: tuple[int, ...] = ()
    block_tables: tuple[tuple[int, ...], ...] = ()
    slot_mapping: tuple[tuple[int, ...], ...] = ()

    @property
    def positions(self) -> range:
        return range(self.start_position, self.start_position + self.num_tokens)

    @property
    def end_position(self) -> int:
        """One past the chunk's last position: the sequence's cached length afterwards."""
        return self.start_position + self.num_tokens


@dataclass(frozen=True, slots=True, kw_only=True)
class SchedulerOutput:
    """One step's plan."""

    step: int
    chunks: tuple[ScheduledChunk, ...]
    preempted: tuple[str, ...]
    num_batched_tokens: int
    #: The KV connector's loads and saves for this step (None without a connector).
    connector_meta: ConnectorMetadata | None = None

    @property
    def is_empty(self) -> bool:
        return not self.chunks


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestMetrics:
    """Per-request figures, in the scheduler clock's seconds."""

    request_id: str
    status: RequestStatus
    finish_reason: FinishReason | None
    arrival_time: float
    queue_time: float | None  # arrival -> first scheduled
    time_to_first_token: float | None  # arrival -> first output token
    finish_time: float | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_computed_tokens: int  # tokens fed to the model, recomputation included
    num_cached_tokens: int  # tokens served from the prefix cache, all admissions
    num_preemptions: int
    #: ``num_cached_tokens`` by where they came from: ``"gpu"`` (the pool) and each connector tier.
    cached_tokens_by_tier: Mapping[str, int] = dataclasses.field(default_factory=dict)


class _Entry:
    """The scheduler's record of one request."""

    __slots__ = (
        "request",
        "stop",
        "tenant",
        "admission",
        "status",
        "finish_reason",
        "arrival_time",
        "first_scheduled_time",
        "first_token_time",
        "finish_time",
        "num_computed_total",
        "num_cached_total",
        "cached_by_tier",
        "loading",
        "loaded",
    )

    def __init__(self, request: Request, stop: StopConditions, arrival_time: float, tenant: str | None) -> None:
        self.request = request
        self.stop = stop
        self.tenant = tenant
        self.admission = 0  # the scheduler's count of admissions when this one was last admitted
        self.status = RequestStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.arrival_time = arrival_time
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.finish_time: float | None = None
        self.num_computed_total = 0
        self.num_cached_total = 0
        self.cached_by_tier: dict[str, int] = {}
        # The latest admission's external match and where it starts, until its loads are reported.
        self.loading: tuple[int, ExternalMatch] | None = None
        # Its asynchronous loads are done: it waits again, holding its blocks, to compute the rest.
        self.loaded = False

    def metrics(self) -> RequestMetrics:
        r = self.request
        return RequestMetrics(
            request_id=r.request_id,
            status=self.status,
            finish_reason=self.finish_reason,
            arrival_time=self.arrival_time,
            queue_time=None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time,
            time_to_first_token=None if self.first_token_time is None else self.first_token_time - self.arrival_time,
            finish_time=self.finish_time,
            num_prompt_tokens=r.num_prompt_tokens,
            num_output_tokens=r.num_output_tokens,
            num_computed_tokens=self.num_computed_total,
            num_cached_tokens=self.num_cached_total,
            num_preemptions=r.num_preemptions,
            cached_tokens_by_tier=dict(self.cached_by_tier),
        )


class Scheduler:
    """Continuous batching with chunked prefill, prefix caching and preemption.

    Args:
        manager: the KV cache manager whose blocks the requests use.
        config: step limits.
        clock: returns the current time in seconds (``time.monotonic`` by
            default; a simulator passes its simulated clock).
        connector: the scheduler side of a KV connector, or None.

    ``max_model_len`` is the config's, or else the manager's.
    """

    def __init__(
        self,
        manager: KVCacheManager,
        config: SchedulerConfig | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        connector: KVConnector | None = None,
    ) -> None:
        if not isinstance(manager, KVCacheManager):
            raise ConfigError(f"manager must be a KVCacheManager, got {manager!r}")
        if config is None:
            config = SchedulerConfig()
        elif not isinstance(config, SchedulerConfig):
            raise ConfigError(f"config must be a SchedulerConfig or None, got {config!r}")
        if not callable(clock):
            raise ConfigError(f"clock must be callable, got {clock!r}")
        if connector is not None and not isinstance(connector, KVConnector):
            raise ConfigError(f"connector must be a KVConnector or None, got {connector!r}")
        max_len = config.max_model_len
        if max_len is not None and manager.max_model_len not in (None, max_len):
            raise ConfigError(f"scheduler max_model_len={max_len} differs from the manager's {manager.max_model_len}")
        self.manager = manager
        self.config = config
        self.clock = clock
        self.max_model_len: int | None = manager.max_model_len if max_len is None else max_len
        self.waiting: deque[_Entry] = deque()
        self.running: list[_Entry] = []
        self._entries: dict[str, _Entry] = {}
        #: Unfinished requests (waiting or running) per tenant: the tenants that share the server now.
        self._active: dict[str | None, int] = {}
        self._admissions = 0
        self._step = 0
        # The latest plan, and its chunks' entries until update() applies it.
        self._issued: SchedulerOutput | None = None
        self._in_flight: tuple[_Entry, ...] = ()
        self._counts_only = config.chunk_detail is ChunkDetail.COUNTS
        # A queue-aware eviction policy is told which requests wait, whenever that set changes.
        self._hints_wanted = hasattr(manager.pool.free_queue, "note_waiting")
        self._waiting_changed = False
        self.num_preemptions = 0
        self.connector = connector
        #: Finished requests whose blocks wait for the connector's saves, by ID.
        self._saving: dict[str, _Entry] = {}
        #: Requests waiting for asynchronous loads (WAITING_FOR_KV), by ID, in admission order.
        self._loading: dict[str, _Entry] = {}
        #: Finished requests whose blocks wait for asynchronous loads still in flight, by ID.
        self._unloaded: dict[str, _Entry] = {}
        #: Prompt tokens taken from each source since the start (``"gpu"`` and each connector tier).
        self.cached_tokens_by_tier: dict[str, int] = {}

    # -- requests --------------------------------------------------------------------

    def check_request(self, request: Request, stop: StopConditions, *, tenant: str | None = None) -> None:
        """Raise what :meth:`add_request` would raise, without queuing anything."""
        if tenant is not None and (not isinstance(tenant, str) or not tenant):
            raise ConfigError(f"a tenant is a non-empty string or None, got {tenant!r}")
        if not isinstance(request, Request):
            raise RequestStateError(f"request must be a Request, got {request!r}")
        if not isinstance(stop, StopConditions):
            raise ConfigError(f"stop must be a StopConditions, got {stop!r}")
        rid = request.request_id
        if rid in self._entries:
            raise RequestStateError(f"request {rid!r} is already in the scheduler")
        if any(self.manager.get_block_ids(rid)):
            raise RequestStateError(f"request {rid!r} already holds blocks in the manager")
        if request.num_computed_tokens != 0:
            raise RequestStateError(
                f"request {rid!r} has num_computed_tokens={request.num_computed_tokens}, expected 0"
            )
        max_len = self.max_model_len
        if max_len is not None and request.num_tokens >= max_len:
            raise RequestStateError(
                f"request {rid!r}: prompt of {request.num_tokens} tokens leaves no room under max_model_len={max_len}"
            )
        peak = request.num_tokens + stop.max_tokens
        if max_len is not None:
            peak = min(peak, max_len)
        blocks = self.manager.coordinator.max_blocks_for(peak)
        if blocks > self.manager.num_blocks - 1:
            raise CapacityError(
                f"request {rid!r} may reach {peak} tokens, which need {blocks} blocks; "
                f"the pool has {self.manager.num_blocks - 1} usable blocks"
            )

    def add_request(
        self,
        request: Request,
        stop: StopConditions,
        *,
        arrival_time: float | None = None,
        tenant: str | None = None,
    ) -> None:
        """Queue a request of ``tenant`` (None: the one unnamed tenant). Raises if it could never be
        served, even alone."""
        self.check_request(request, stop, tenant=tenant)
        if arrival_time is not None and (type(arrival_time) not in (int, float) or not math.isfinite(arrival_time)):
            raise ConfigError(f"arrival_time must be a finite number or None, got {arrival_time!r}")
        arrival = self.clock() if arrival_time is None else arrival_time
        # Refuses a request hashed under another block size or algorithm, and then binds nothing.
        self.manager.hash_request(request)
        entry = _Entry(request, stop, arrival, tenant)
        self._entries[request.request_id] = entry
        self._active[tenant] = self._active.get(tenant, 0) + 1
        self.waiting.append(entry)
        self._waiting_changed = True

    def abort(self, request_id: str, *, reason: FinishReason = FinishReason.ABORTED) -> bool:
        """Stop a request now; its blocks go back to the pool.

        ``reason`` is ``ABORTED`` (the caller gave up), ``ERROR`` (it failed
        while served) or ``STOP`` (its text reached a stop string, which only
        the engine sees). Returns whether it stopped one: an unknown or already
        finished ID (a request may finish just before its abort) changes nothing.
        """
        if reason not in (FinishReason.ABORTED, FinishReason.ERROR, FinishReason.STOP):
            raise ConfigError(f"an abort's reason is ABORTED, ERROR or STOP, got {reason!r}")
        entry = self._lookup(request_id)
        if entry is None or entry.status is RequestStatus.FINISHED:
            return False
        now = self.clock()
        status = entry.status
        self._finish(entry, reason, now)  # the blocks go back first: the one step that could refuse
        if status is RequestStatus.RUNNING:
            self.running.remove(entry)
        elif status is RequestStatus.WAITING_FOR_KV:
            del self._loading[request_id]
        else:
            self.waiting.remove(entry)
            self._waiting_changed = True
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running or self._loading)

    def _lookup(self, request_id: str) -> _Entry | None:
        if not isinstance(request_id, str):
            raise RequestStateError(f"a request ID is a string, got {request_id!r}")
        return self._entries.get(request_id)

    def _known(self, request_id: str) -> _Entry:
        entry = self._lookup(request_id)
        if entry is None:
            raise RequestStateError(f"unknown request {request_id!r}")
        return entry

    def metrics(self, request_id: str) -> RequestMetrics:
        return self._known(request_id).metrics()

    def request(self, request_id: str) -> Request:
        return self._known(request_id).request

    def forget(self, request_id: str) -> RequestMetrics:
        """Drop a finished request's record and return its figures."""
        entry = self._known(request_id)
        if entry.status is not RequestStatus.FINISHED:
            raise RequestStateError(f"request {request_id!r} is not finished")
        del self._entries[request_id]
        return entry.metrics()

    # -- a step ------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Plan one step. Requests in the plan hold the blocks it needs.

        Refused while the previous plan still has a running request and was
        not applied with :meth:`update`.
        """
        if self._issued is not None and any(e.status is RequestStatus.RUNNING for e in self._in_flight):
            raise RequestStateError(
                f"step {self._issued.step} was planned but not applied; call update() with its output first"
            )
        now = self.clock()
        self._step += 1
        budget = self.config.max_num_batched_tokens
        mgr = self.manager
        connector = self.connector
        if self._hints_wanted and self._waiting_changed:
            mgr.note_waiting([e.request for e in self.waiting])
            self._waiting_changed = False
        scheduled: list[_Entry] = []
        chunks: list[ScheduledChunk] = []
        preempted: list[str] = []
        shares = None
        if len(self._active) > 1:  # tenants share the step; the most loaded ones' requests last (preempted first)
            shares = fair = self._step_shares(budget)
            self.running.sort(key=lambda e: fair.load(e.tenant))

        index = 0
        while index < len(self.running) and budget > 0:
            entry = self.running[index]
            request = entry.request
            todo = min(request.num_tokens - request.num_computed_tokens, budget)
            if shares is not None:
                todo = min(todo, shares.left[entry.tenant])
            if todo <= 0:
                index += 1
                continue
            while True:
                new = mgr.allocate_slots(request, todo)
                if new is not None:
                    break
                victim = self.running.pop()
                self._preempt(victim)
                if shares is not None:
                    shares.preempted(victim.tenant, victim.request.num_tokens)
                preempted.append(victim.request.request_id)
                if victim is entry:
                    break
            if new is None:
                break  # the request itself was preempted; later ones are gone too
            scheduled.append(entry)
            chunks.append(self._chunk(entry, todo, 0))
            budget -= todo
            if shares is not None:
                shares.left[entry.tenant] -= todo
            index += 1

        yielded: list[str] = []  # preempted for another tenant's admission (admission goes on)
        first_admission = self._admissions + 1  # requests admitted in this step are never preempted in it
        max_seqs = self.config.max_num_seqs
        unknown: list[_Entry] = []  # the connector does not know their match yet: back in line after the loop
        while not preempted and self.waiting and budget > 0:
            if shares is None:
                if len(self.running) >= max_seqs:
                    break
                entry = self.waiting[0]
            else:
                tenant = shares.pick(e.tenant for e in self.waiting)
                if tenant is None:
                    break
                entry = next(e for e in self.waiting if e.tenant == tenant)
            request = entry.request
            if entry.loaded:  # back from its asynchronous loads, holding its blocks: no lookup
                hit, num_hit, match = None, request.num_computed_tokens, NO_MATCH
            else:
                hit, num_hit = mgr.get_computed_blocks(request)
                match = NO_MATCH if connector is None else self._external_match(request, num_hit)
                if match.pending:  # its lookup is still running: the requests behind it go first this step
                    self.waiting.remove(entry)
                    unknown.append(entry)
                    continue
            num_loaded = match.num_tokens
            if match.asynchronous and num_loaded:
                if self._admit_loading(entry, hit, num_hit, match):
                    continue
                if shares is None:
                    break
                shares.block(entry.tenant)
                continue
            todo = min(request.num_tokens - num_hit - num_loaded, budget)
            if shares is not None:
                todo = min(todo, shares.left[entry.tenant])
            while True:
                admitted = len(self.running) < max_seqs and (
                    mgr.allocate_slots(request, todo) is not None
                    if entry.loaded
                    else mgr.allocate_slots(request, todo, num_hit, hit, num_external_computed_tokens=num_loaded)
                    is not None
                )
                if admitted or shares is None:
                    break
                loser = self._fairness_victim(entry, shares, first_admission)
                if loser is None:
                    break
                budget += self._unschedule(loser, scheduled, chunks, shares)
                yielded.append(loser.request.request_id)
            if not admitted:
                if shares is None:
                    break  # first come, first served: nobody overtakes the head of the queue
                shares.block(entry.tenant)
                continue
            if shares is None:
                self.waiting.popleft()
            else:
                self.waiting.remove(entry)
            self._waiting_changed = True
            request.num_computed_tokens = num_hit + num_loaded
            entry.status = RequestStatus.RUNNING
            self._admissions += 1
            entry.admission = self._admissions
            if entry.loaded:
                entry.loaded = False  # its cached tokens were counted when it was admitted to load
            else:
                entry.num_cached_total += num_hit + num_loaded
                self._count_cached(entry, GPU, num_hit)
            if connector is not None and hit is not None:
                for tier, tokens in match.tokens_by_tier().items():
                    self._count_cached(entry, tier, tokens)
                entry.loading = (num_hit, match) if num_loaded else None
                connector.update_state_after_alloc(request, mgr.get_block_ids(request.request_id)[0], num_hit, match)
            if entry.first_scheduled_time is None:
                entry.first_scheduled_time = now
            self.running.append(entry)
            scheduled.append(entry)
            chunks.append(self._chunk(entry, todo, num_hit + num_loaded))
            budget -= todo
            if shares is not None:
                shares.admitted(entry.tenant, request.num_tokens)
                shares.left[entry.tenant] -= todo
        preempted.extend(yielded)
        if unknown:
            self.waiting.extendleft(reversed(unknown))

        meta = None
        if connector is not None:
            meta = connector.build_meta([(e.request, c.end_position) for e, c in zip(scheduled, chunks)])
        output = SchedulerOutput(
            step=self._step,
            chunks=tuple(chunks),
            preempted=tuple(preempted),
            num_batched_tokens=self.config.max_num_batched_tokens - budget,
            connector_meta=meta,
        )
        self._issued = output
        self._in_flight = tuple(scheduled)
        return output

    def _admit_loading(self, entry: _Entry, hit: HitBlocks | None, num_hit: int, match: ExternalMatch) -> bool:
        """Admit ``entry`` to wait for its asynchronous loads: blocks, uncached, for its hit and its loads only."""
        request = entry.request
        num_loaded = match.num_tokens
        blocks = self.manager.allocate_slots_to_load(request, num_hit, hit, num_loaded)
        if blocks is None:
            return False
        self.waiting.remove(entry)
        self._waiting_changed = True
        request.num_computed_tokens = num_hit + num_loaded
        entry.status = RequestStatus.WAITING_FOR_KV
        entry.num_cached_total += num_hit + num_loaded
        self._count_cached(entry, GPU, num_hit)
        for tier, tokens in match.tokens_by_tier().items():
            self._count_cached(entry, tier, tokens)
        entry.loading = (num_hit, match)
        self._loading[request.request_id] = entry
        self.connector.update_state_after_alloc(  # type: ignore[union-attr]  # a match comes from a connector
            request, self.manager.get_block_ids(request.request_id)[0], num_hit, match
        )
        return True

    def _take_async_loads(self, result: TransferResult) -> None:
        """Requests whose asynchronous loads the worker reports done wait again, first, to compute the rest."""
        # In request-ID order, not the set's (which hangs on the process's string hash seed): a replay repeats.
        done = [rid for rid in sorted(result.finished_loads) if rid in self._loading or rid in self._unloaded]
        if not done:
            return
        failed = result.failed_loads
        for rid in done:  # every report is checked before anything changes
            entry = self._loading.get(rid)
            if entry is None or rid not in failed:
                continue
            num_hit, match = entry.loading  # type: ignore[misc]  # set while it waits for its loads
            valid = failed[rid]
            if type(valid) is not int or not num_hit <= valid <= num_hit + match.num_tokens:
                raise RequestStateError(
                    f"request {rid!r}: a failed load leaves {valid!r} tokens in place; expected an int from "
                    f"{num_hit} (the local hit) to {num_hit + match.num_tokens} (the promised tokens)"
                )
        resumed: list[_Entry] = []
        for rid in done:
            gone = self._unloaded.pop(rid, None)
            if gone is not None:  # finished while its loads ran: its blocks go back now
                if rid not in self._saving:
                    self.manager.free(gone.request)
                continue
            entry = self._loading.pop(rid)
            num_hit, match = entry.loading  # type: ignore[misc]  # set while it waits for its loads
            promised = num_hit + match.num_tokens
            valid = failed.get(rid, promised)
            if valid < promised:
                self._uncount_lost(entry, match, match.truncated(valid - num_hit), promised - valid)
            self.manager.cache_loaded_blocks(entry.request, valid)
            entry.request.num_computed_tokens = valid
            entry.loading = None
            entry.loaded = True
            entry.status = RequestStatus.WAITING
            resumed.append(entry)
        self.waiting.extendleft(reversed(resumed))
        self._waiting_changed = self._waiting_changed or bool(resumed)

    def take_transfers(self, result: TransferResult) -> None:
        """Take a worker's report outside a step (after :meth:`update`, before the next :meth:`schedule`).

        What it may hold then: asynchronous loads that finished (or failed, or
        ran past their deadline) and saves that finished. A request whose
        asynchronous loads are done waits again at the front of the queue and
        computes what did not arrive.
        """
        if not isinstance(result, TransferResult):
            raise RequestStateError(f"take_transfers takes a TransferResult, got {result!r}")
        if self._issued is not None and any(e.status is RequestStatus.RUNNING for e in self._in_flight):
            raise RequestStateError(f"step {self._issued.step} is in flight; report its transfers with apply_transfers")
        self._take_async_loads(result)
        if self.connector is not None and result:
            self.connector.update_finished(result)
        self._free_saved(result)

    def _free_saved(self, result: TransferResult) -> None:
        for rid in sorted(result.finished_saves):  # the order blocks return to the free queue: not the set's
            entry = self._saving.pop(rid, None)
            if entry is not None and rid not in self._unloaded:
                self.manager.free(entry.request)

    def _step_shares(self, budget: int) -> StepShares:
        mgr = self.manager
        return StepShares(
            self.config.tenant_weights,
            self._active,
            ((e.tenant, e.request.num_tokens) for e in self.running),
            max_seqs=self.config.max_num_seqs,
            pool_tokens=(mgr.num_blocks - 1) * mgr.block_size,
            budget=budget,
        )

    def _fairness_victim(self, entry: _Entry, shares: StepShares, first_admission: int) -> _Entry | None:
        """The running request to preempt so that ``entry`` (waiting) gets in, or None (see
        :meth:`StepShares.victim`): the latest admitted of the tenant most over its share."""
        tenant = shares.victim(entry.tenant, entry.request.num_tokens)
        if tenant is None:
            return None
        candidates = [e for e in self.running if e.tenant == tenant and e.admission < first_admission]
        return max(candidates, key=lambda e: e.admission, default=None)

    def _unschedule(
        self, victim: _Entry, scheduled: list[_Entry], chunks: list[ScheduledChunk], shares: StepShares
    ) -> int:
        """Preempt a running ``victim`` for fairness, taking back its chunk of this step; returns its tokens."""
        refund = 0
        for i, other in enumerate(scheduled):
            if other is victim:
                refund = chunks[i].num_tokens
                del scheduled[i], chunks[i]
                break
        shares.left[victim.tenant] += refund
        shares.preempted(victim.tenant, victim.request.num_tokens)
        self.running.remove(victim)
        self._preempt(victim)
        return refund

    def _external_match(self, request: Request, num_hit: int) -> ExternalMatch:
        """The connector's answer, held to its contract (whole blocks, short of the last token)."""
        match = self.connector.get_num_new_matched_tokens(request, num_hit)  # type: ignore[union-attr]  # called with a connector only
        if not isinstance(match, ExternalMatch):
            raise ConfigError(f"the connector answered {match!r}, not an ExternalMatch")
        if match.pending and (match.runs or match.asynchronous):
            raise ConfigError(f"the connector answered {match!r}: a pending match carries no runs")
        num = match.num_tokens
        bs = self.manager.block_size
        if type(num) is not int or num < 0 or num % bs or num_hit + num > request.num_tokens - 1:
            raise ConfigError(
                f"the connector offers {num!r} tokens beyond the {num_hit} cached of request "
                f"{request.request_id!r} ({request.num_tokens} tokens): expected whole blocks of {bs} "
                "ending before the last token"
            )
        return match

    def _uncount_lost(self, entry: _Entry, match: ExternalMatch, kept: ExternalMatch, num_lost: int) -> None:
        """A load delivered only ``kept`` of ``match``: the ``num_lost`` tokens it did not no longer count as cached."""
        lost = match.tokens_by_tier()
        for tier, tokens in kept.tokens_by_tier().items():
            lost[tier] -= tokens
        for tier, tokens in lost.items():
            self._count_cached(entry, tier, -tokens)
        entry.num_cached_total -= num_lost

    def _count_cached(self, entry: _Entry, tier: str, tokens: int) -> None:
        entry.cached_by_tier[tier] = entry.cached_by_tier.get(tier, 0) + tokens
        self.cached_tokens_by_tier[tier] = self.cached_tokens_by_tier.get(tier, 0) + tokens

    def _chunk(self, entry: _Entry, num_tokens: int, num_cached: int, start: int | None = None) -> ScheduledChunk:
        request = entry.request
        if start is None:
            start = request.num_computed_tokens
        stop = start + num_tokens
        if self._counts_only:
            return ScheduledChunk(
                request_id=request.request_id,
                start_position=start,
                num_tokens=num_tokens,
                sample=stop == request.num_tokens,
                num_cached_tokens=num_cached,
            )
        tables = []
        slots = []
        for group, table in zip(self.manager.groups, self.manager.get_block_ids(request.request_id)):
            bs = group.block_size
            tables.append(tuple(table))
            slots.append(tuple(table[p // bs] * bs + p % bs for p in range(start, stop)))
        return ScheduledChunk(
            request_id=request.request_id,
            start_position=start,
            num_tokens=num_tokens,
            sample=stop == request.num_tokens,
            num_cached_tokens=num_cached,
            token_ids=tuple(request.all_token_ids[start:stop]),
            block_tables=tuple(tables),
            slot_mapping=tuple(slots),
        )

    def apply_transfers(self, output: SchedulerOutput, result: TransferResult) -> SchedulerOutput:
        """Take a connector worker's report on the step ``output`` plans; returns the plan to run.

        A request in ``result.failed_loads`` computes what its load did not
        deliver: its chunk now starts at the number of tokens whose KV is in
        place (the chunk grows past the token budget by that much) and its
        cached-token figures drop accordingly. Requests in
        ``result.finished_saves`` that finished while their saves were pending
        give their blocks back now. Call it between :meth:`schedule` and
        :meth:`update`, as often as the worker reports; the returned plan
        replaces ``output`` (the same object when no load failed).
        """
        if not isinstance(result, TransferResult):
            raise RequestStateError(f"apply_transfers takes a TransferResult, got {result!r}")
        if self._issued is None or output is not self._issued:
            raise RequestStateError("apply_transfers takes the latest schedule() output, before update()")
        self._take_async_loads(result)
        if self.connector is not None and result:
            self.connector.update_finished(result)
        self._free_saved(result)
        failed = result.failed_loads
        if not failed:
            return output
        chunks = list(output.chunks)
        for i, (entry, chunk) in enumerate(zip(self._in_flight, chunks)):
            rid = chunk.request_id
            if rid not in failed or entry.loading is None or entry.status is not RequestStatus.RUNNING:
                continue
            num_hit, match = entry.loading
            valid = failed[rid]
            if type(valid) is not int or not num_hit <= valid < chunk.start_position:
                raise RequestStateError(
                    f"request {rid!r}: a failed load leaves {valid!r} tokens in place; expected an int from "
                    f"{num_hit} (the local hit) to below {chunk.start_position} (the promised tokens)"
                )
            kept = match.truncated(valid - num_hit)
            self._uncount_lost(entry, match, kept, chunk.start_position - valid)
            entry.loading = (num_hit, kept) if kept.runs else None
            entry.request.num_computed_tokens = valid
            num_cached = chunk.num_cached_tokens - (chunk.start_position - valid)
            chunks[i] = self._chunk(entry, chunk.end_position - valid, num_cached, start=valid)
        extra = sum(c.num_tokens for c in chunks) - sum(c.num_tokens for c in output.chunks)
        revised = dataclasses.replace(
            output, chunks=tuple(chunks), num_batched_tokens=output.num_batched_tokens + extra
        )
        self._issued = revised
        return revised

    def _preempt(self, entry: _Entry) -> None:
        request = entry.request
        self.manager.free(request)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        entry.status = RequestStatus.PREEMPTED
        self.waiting.appendleft(entry)
        self._waiting_changed = True

    def update(self, output: SchedulerOutput, sampled: Mapping[str, int]) -> list[RequestMetrics]:
        """Apply a step's results: advance progress, append sampled tokens, stop.

        ``output`` is the latest :meth:`schedule` result, applied once.
        ``sampled`` maps the request ID of every chunk with ``sample=True``
        whose request is still running (not aborted since) to its sampled
        token, an ``int`` in ``[0, 2**32)``, and holds nothing else. Anything
        else is refused before any request changes. Returns the figures of the
        requests that finished.
        """
        tokens = self._check_update(output, sampled)
        now = self.clock()
        in_flight, self._in_flight = self._in_flight, ()
        finished: list[RequestMetrics] = []
        for entry, chunk in zip(in_flight, output.chunks):
            if entry.status is not RequestStatus.RUNNING:
                continue  # aborted meanwhile
            request = entry.request
            entry.loading = None  # the step's loads are over, failed ones reported
            request.num_computed_tokens += chunk.num_tokens
            entry.num_computed_total += chunk.num_tokens
            if not chunk.sample:
                continue
            token = tokens[chunk.request_id]
            request.append_output_token_ids(token)
            if entry.first_token_time is None:
                entry.first_token_time = now
            reason = self._stop_reason(entry, token)
            if reason is not None:
                self.running.remove(entry)
                self._finish(entry, reason, now)
                finished.append(entry.metrics())
        self._issued = None
        return finished

    def _check_update(self, output: SchedulerOutput, sampled: Mapping[str, int]) -> dict[str, int]:
        """The sampled tokens, checked against the plan in flight; raises before anything changes."""
        if self._issued is None or output is not self._issued:
            if not isinstance(output, SchedulerOutput):
                raise RequestStateError(f"update() takes the SchedulerOutput of schedule(), got {output!r}")
            if output.step == self._step and self._issued is None:
                raise RequestStateError(f"the output of step {output.step} was already applied")
            if output.step < self._step:
                raise RequestStateError(f"the output of step {output.step} is stale: the latest step is {self._step}")
            raise RequestStateError(f"the output of step {output.step} was not issued by this scheduler")
        if not isinstance(sampled, Mapping):
            raise RequestStateError(f"sampled must map request IDs to token IDs, got {sampled!r}")
        needed = {
            chunk.request_id
            for entry, chunk in zip(self._in_flight, output.chunks)
            if chunk.sample and entry.status is RequestStatus.RUNNING
        }
        for rid, token in sampled.items():
            if rid not in needed:
                raise RequestStateError(f"sampled has a token for request {rid!r}, {self._why_no_token(rid, output)}")
            _check_token(token, f"the sampled token of request {rid!r}")
        if len(sampled) != len(needed):
            missing = sorted(needed.difference(sampled))
            raise RequestStateError(f"no sampled token for request{'s' if len(missing) > 1 else ''} {missing}")
        return dict(sampled)

    def _why_no_token(self, rid: object, output: SchedulerOutput) -> str:
        for entry, chunk in zip(self._in_flight, output.chunks):
            if chunk.request_id == rid:
                if entry.status is not RequestStatus.RUNNING:
                    return f"which was {entry.status.value} after step {output.step} was planned"
                return f"whose chunk in step {output.step} ends before its last token and samples nothing"
        return f"which step {output.step} did not schedule"

    def _stop_reason(self, entry: _Entry, token: int) -> FinishReason | None:
        stop = entry.stop
        request = entry.request
        if request.num_output_tokens > stop.min_tokens:  # EOS first, as vLLM checks them
            if not stop.ignore_eos and stop.eos_token_id is not None and token == stop.eos_token_id:
                return FinishReason.EOS
            if token in stop.stop_token_ids:
                return FinishReason.STOP
        if request.num_output_tokens >= stop.max_tokens:
            return FinishReason.LENGTH
        max_len = self.max_model_len
        if max_len is not None and request.num_tokens >= max_len:
            return FinishReason.LENGTH
        return None

    def _finish(self, entry: _Entry, reason: FinishReason, now: float) -> None:
        request = entry.request
        connector = self.connector
        entry.loading = None
        entry.loaded = False
        rid = request.request_id
        saving = connector is not None and connector.request_finished(request, self.manager.get_block_ids(rid)[0])
        if saving:
            self._saving[rid] = entry  # its blocks go back when the saves are done
        if entry.status is RequestStatus.WAITING_FOR_KV:
            self._unloaded[rid] = entry  # and when its loads are: nothing may write a block it gave back
        if not saving and rid not in self._unloaded:
            self.manager.free(request)
        entry.status = RequestStatus.FINISHED
        entry.finish_reason = reason
        entry.finish_time = now
        left = self._active[entry.tenant] - 1
        if left:
            self._active[entry.tenant] = left
        else:
            del self._active[entry.tenant]

    # -- inspection ----------------------------------------------------------------------

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_loading(self) -> int:
        """Requests waiting for their asynchronous loads (WAITING_FOR_KV)."""
        return len(self._loading)

    @property
    def num_saving(self) -> int:
        """Finished requests whose blocks wait for the connector's saves."""
        return len(self._saving)

    def running_ids(self) -> list[str]:
        return [e.request.request_id for e in self.running]

    def waiting_ids(self) -> list[str]:
        return [e.request.request_id for e in self.waiting]

    def num_waiting_for(self, tenant: str | None) -> int:
        """Requests of ``tenant`` waiting for admission."""
        return sum(1 for e in self.waiting if e.tenant == tenant) if self._active.get(tenant) else 0

    def tenant_of(self, request_id: str) -> str | None:
        return self._known(request_id).tenant

    def all_metrics(self) -> list[RequestMetrics]:
        return [e.metrics() for e in self._entries.values()]


def run_to_completion(
    scheduler: Scheduler, sample: Callable[[SchedulerOutput], Mapping[str, int]], max_steps: int = 1_000_000
) -> list[RequestMetrics]:
    """Drive a scheduler until every request finished; ``sample`` plays the model."""
    if not callable(sample):
        raise ConfigError(f"sample must be callable, got {sample!r}")
    check_int("max_steps", max_steps)
    finished: list[RequestMetrics] = []
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            return finished
        output = scheduler.schedule()
        if output.is_empty:
            raise RequestStateError("the scheduler made no progress: no request could be scheduled")
        finished.extend(scheduler.update(output, sample(output)))
    raise RequestStateError(f"requests still unfinished after {max_steps} steps")


def sample_from(tokens: Mapping[str, Sequence[int]]) -> Callable[[SchedulerOutput], dict[str, int]]:
    """A scripted 'model' for tests and simulators: request i's n-th sample is tokens[i][n] (cycling)."""
    if not isinstance(tokens, Mapping) or not all(isinstance(s, Sequence) and s for s in tokens.values()):
        raise ConfigError(f"tokens must map request IDs to non-empty token sequences, got {tokens!r}")
    cursor: dict[str, int] = {}

    def sample(output: SchedulerOutput) -> dict[str, int]:
        out = {}
        for chunk in output.chunks:
            if chunk.sample:
                n = cursor.get(chunk.request_id, 0)
                script = tokens[chunk.request_id]
                out[chunk.request_id] = script[n % len(script)]
                cursor[chunk.request_id] = n + 1
        return out

    return sample
