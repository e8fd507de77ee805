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

The output of a step is plain data for a model runner: which requests, which
tokens at which positions, their block tables and slot mappings. After the
runner has sampled, :meth:`Scheduler.update` appends the sampled tokens,
applies the stop conditions and frees finished requests.

Time is read from an injectable clock and only feeds the per-request figures
(queue time, time to first token); no decision depends on it.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum

from kvpool.errors import CapacityError, ConfigError, RequestStateError
from kvpool.manager import KVCacheManager
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
]


class RequestStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


class FinishReason(Enum):
    LENGTH = "length"  # max_tokens or max_model_len reached
    STOP = "stop"  # a stop token was sampled
    EOS = "eos"  # the end-of-sequence token was sampled
    ABORTED = "aborted"


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

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if self.max_model_len is not None and (type(self.max_model_len) is not int or self.max_model_len < 2):
            raise ConfigError(f"max_model_len must be an integer >= 2 or None, got {self.max_model_len!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class StopConditions:
    """When a request stops generating."""

    max_tokens: int = 16
    stop_token_ids: frozenset[int] = frozenset()
    eos_token_id: int | None = None
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if type(self.max_tokens) is not int or self.max_tokens < 1:
            raise ConfigError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        object.__setattr__(self, "stop_token_ids", frozenset(self.stop_token_ids))


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


@dataclass(frozen=True, slots=True, kw_only=True)
class SchedulerOutput:
    """One step's plan."""

    step: int
    chunks: tuple[ScheduledChunk, ...]
    preempted: tuple[str, ...]
    num_batched_tokens: int

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


class _Entry:
    """The scheduler's record of one request."""

    __slots__ = (
        "request",
        "stop",
        "status",
        "finish_reason",
        "arrival_time",
        "first_scheduled_time",
        "first_token_time",
        "finish_time",
        "num_computed_total",
        "num_cached_total",
    )

    def __init__(self, request: Request, stop: StopConditions, arrival_time: float) -> None:
        self.request = request
        self.stop = stop
        self.status = RequestStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.arrival_time = arrival_time
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.finish_time: float | None = None
        self.num_computed_total = 0
        self.num_cached_total = 0

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
        )


class Scheduler:
    """Continuous batching with chunked prefill, prefix caching and preemption.

    Args:
        manager: the KV cache manager whose blocks the requests use.
        config: step limits.
        clock: returns the current time in seconds (``time.monotonic`` by
            default; a simulator passes its simulated clock).
    """

    def __init__(
        self,
        manager: KVCacheManager,
        config: SchedulerConfig | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.manager = manager
        self.config = config or SchedulerConfig()
        self.clock = clock
        self.waiting: deque[_Entry] = deque()
        self.running: list[_Entry] = []
        self._entries: dict[str, _Entry] = {}
        self._step = 0
        self._counts_only = self.config.chunk_detail is ChunkDetail.COUNTS
        # A queue-aware eviction policy is told which requests wait, whenever that set changes.
        self._hints_wanted = hasattr(manager.pool.free_queue, "note_waiting")
        self._waiting_changed = False
        self.num_preemptions = 0
        max_len = self.config.max_model_len
        if max_len is not None and manager.max_model_len not in (None, max_len):
            raise ConfigError(
                f"scheduler max_model_len={max_len} differs from the manager's {manager.max_model_len}"
            )

    # -- requests --------------------------------------------------------------------

    def add_request(self, request: Request, stop: StopConditions, *, arrival_time: float | None = None) -> None:
        """Queue a request. Raises if it could never be served, even alone."""
        rid = request.request_id
        if rid in self._entries:
            raise RequestStateError(f"request {rid!r} is already in the scheduler")
        if request.num_computed_tokens != 0:
            raise RequestStateError(f"request {rid!r} has num_computed_tokens={request.num_computed_tokens}, expected 0")
        max_len = self.config.max_model_len
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
        self.manager.hash_request(request)
        entry = _Entry(request, stop, self.clock() if arrival_time is None else arrival_time)
        self._entries[rid] = entry
        self.waiting.append(entry)
        self._waiting_changed = True

    def abort(self, request_id: str) -> None:
        """Stop a request now; its blocks go back to the pool. Unknown IDs are ignored."""
        entry = self._entries.get(request_id)
        if entry is None or entry.status is RequestStatus.FINISHED:
            return
        if entry in self.waiting:
            self.waiting.remove(entry)
            self._waiting_changed = True
        if entry in self.running:
            self.running.remove(entry)
        self._finish(entry, FinishReason.ABORTED)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def metrics(self, request_id: str) -> RequestMetrics:
        entry = self._entries.get(request_id)
        if entry is None:
            raise RequestStateError(f"unknown request {request_id!r}")
        return entry.metrics()

    def request(self, request_id: str) -> Request:
        entry = self._entries.get(request_id)
        if entry is None:
            raise RequestStateError(f"unknown request {request_id!r}")
        return entry.request

    def forget(self, request_id: str) -> RequestMetrics:
        """Drop a finished request's record and return its figures."""
        entry = self._entries.get(request_id)
        if entry is None or entry.status is not RequestStatus.FINISHED:
            raise RequestStateError(f"request {request_id!r} is not finished")
        del self._entries[request_id]
        return entry.metrics()

    # -- a step ------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Plan one step. Requests in the plan hold the blocks it needs."""
        self._step += 1
        budget = self.config.max_num_batched_tokens
        mgr = self.manager
        if self._hints_wanted and self._waiting_changed:
            mgr.note_waiting([e.request for e in self.waiting])
            self._waiting_changed = False
        now = self.clock()
        chunks: list[ScheduledChunk] = []
        preempted: list[str] = []

        index = 0
        while index < len(self.running) and budget > 0:
            entry = self.running[index]
            request = entry.request
            todo = min(request.num_tokens - request.num_computed_tokens, budget)
            if todo <= 0:
                index += 1
                continue
            while True:
                new = mgr.allocate_slots(request, todo)
                if new is not None:
                    break
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim.request.request_id)
                if victim is entry:
                    break
            if new is None:
                break  # the request itself was preempted; later ones are gone too
            chunks.append(self._chunk(entry, todo, 0))
            budget -= todo
            index += 1

        while not preempted and self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            entry = self.waiting[0]
            request = entry.request
            hit, num_hit = mgr.get_computed_blocks(request)
            todo = min(request.num_tokens - num_hit, budget)
            if mgr.allocate_slots(request, todo, num_hit, hit) is None:
                break
            self.waiting.popleft()
            self._waiting_changed = True
            request.num_computed_tokens = num_hit
            entry.status = RequestStatus.RUNNING
            entry.num_cached_total += num_hit
            if entry.first_scheduled_time is None:
                entry.first_scheduled_time = now
            self.running.append(entry)
            chunks.append(self._chunk(entry, todo, num_hit))
            budget -= todo

        return SchedulerOutput(
            step=self._step,
            chunks=tuple(chunks),
            preempted=tuple(preempted),
            num_batched_tokens=self.config.max_num_batched_tokens - budget,
        )

    def _chunk(self, entry: _Entry, num_tokens: int, num_cached: int) -> ScheduledChunk:
        request = entry.request
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

        ``sampled`` maps the request ID of every chunk with ``sample=True`` to
        its sampled token. Returns the figures of the requests that finished.
        """
        now = self.clock()
        finished: list[RequestMetrics] = []
        for chunk in output.chunks:
            entry = self._entries.get(chunk.request_id)
            if entry is None or entry.status is not RequestStatus.RUNNING:
                continue  # aborted meanwhile
            request = entry.request
            request.num_computed_tokens += chunk.num_tokens
            entry.num_computed_total += chunk.num_tokens
            if not chunk.sample:
                continue
            try:
                token = sampled[chunk.request_id]
            except KeyError:
                raise RequestStateError(f"no sampled token for request {chunk.request_id!r}") from None
            request.append_output_token_ids(token)
            if entry.first_token_time is None:
                entry.first_token_time = now
            reason = self._stop_reason(entry, token)
            if reason is not None:
                self.running.remove(entry)
                self._finish(entry, reason, now)
                finished.append(entry.metrics())
        return finished

    def _stop_reason(self, entry: _Entry, token: int) -> FinishReason | None:
        stop = entry.stop
        request = entry.request
        if token in stop.stop_token_ids:
            return FinishReason.STOP
        if not stop.ignore_eos and stop.eos_token_id is not None and token == stop.eos_token_id:
            return FinishReason.EOS
        if request.num_output_tokens >= stop.max_tokens:
            return FinishReason.LENGTH
        max_len = self.config.max_model_len
        if max_len is not None and request.num_tokens >= max_len:
            return FinishReason.LENGTH
        return None

    def _finish(self, entry: _Entry, reason: FinishReason, now: float | None = None) -> None:
        self.manager.free(entry.request)
        entry.status = RequestStatus.FINISHED
        entry.finish_reason = reason
        entry.finish_time = self.clock() if now is None else now

    # -- inspection ----------------------------------------------------------------------

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def running_ids(self) -> list[str]:
        return [e.request.request_id for e in self.running]

    def waiting_ids(self) -> list[str]:
        return [e.request.request_id for e in self.waiting]

    def all_metrics(self) -> list[RequestMetrics]:
        return [e.metrics() for e in self._entries.values()]


def run_to_completion(
    scheduler: Scheduler, sample: Callable[[SchedulerOutput], Mapping[str, int]], max_steps: int = 1_000_000
) -> list[RequestMetrics]:
    """Drive a scheduler until every request finished; ``sample`` plays the model."""
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
    """A scripted 'model' for tests and simulators: request i's n-th sample is tokens[i][n]."""
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
