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
    worker.start_load(meta)                  # spills out first, then external KV into the new blocks
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
* Blocks filled by a synchronous load are in the prefix cache as soon as
  they are allocated, like computed blocks; such a load therefore completes
  (or is reported failed) before the step's forward pass reads them.
* An asynchronous match (:attr:`ExternalMatch.asynchronous`) leaves the
  request waiting for its loads, with its blocks held and kept out of the
  prefix cache (nobody can read KV that has not arrived). Every asynchronous
  load is eventually reported: the request in ``finished_loads`` (and in
  ``failed_loads`` with the tokens in place, for a load that failed or ran
  past its deadline). Its blocks are then cached and it is scheduled again,
  computing what did not arrive.
* ``request_finished`` returning True keeps a finished request's blocks out
  of the free queue until a later :class:`TransferResult` lists the request
  in ``finished_saves``.

Writing your own connector: implement the five scheduler-side methods of
:class:`KVConnector` (plain Python, no torch) and the four worker-side methods
of :class:`KVConnectorWorker`, then hand the first to
:class:`~kvpool.scheduler.Scheduler` (``connector=``) and call the second from
the engine step as above. This module is the interface only; the connector
kvpool ships, tiers looked up in order by the chained block hash, is
:class:`kvpool.tiers.hierarchy.TierHierarchyConnector`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from kvpool.request import Request

__all__ = [
    "GPU",
    "NO_MATCH",
    "PENDING",
    "BlockLoad",
    "BlockSave",
    "ConnectorMetadata",
    "ExternalMatch",
    "KVConnector",
    "KVConnectorWorker",
    "TierRun",
    "TransferResult",
]

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
    """What a connector can supply beyond the local prefix hit: runs of tokens, in position order.

    ``pending``: not known yet (the tiers' lookup is still running, vLLM's
    ``None``): the request is skipped for this step and asked again at the next.

    ``asynchronous``: the loads finish in a later step (vLLM's ``load_async``).
    The request then holds its blocks and waits, computing nothing, until the
    worker lists it in :attr:`TransferResult.finished_loads`; the rest of the
    batch steps meanwhile. A synchronous match is loaded before the forward
    pass of the very step that admits the request.
    """

    runs: tuple[TierRun, ...] = ()
    asynchronous: bool = False
    pending: bool = False

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
        return ExternalMatch(tuple(runs), self.asynchronous)


#: Nothing beyond the local hit.
NO_MATCH = ExternalMatch()

#: Not known yet: skip the request this step and ask again at the next.
PENDING = ExternalMatch(pending=True)


@dataclass(frozen=True, slots=True)
class BlockLoad:
    """Copy the KV stored under ``key`` in ``tier`` into pool block ``block_id``.

    ``position`` is the block's index in the request (its tokens start at
    ``position * block_size``); ``host_slot`` is the CPU tier's host block
    holding it (None for byte tiers). ``asynchronous``: part of an asynchronous
    match (:attr:`ExternalMatch.asynchronous`), reported in a later step.
    """

    request_id: str
    position: int
    block_id: int
    key: bytes
    tier: str
    host_slot: int | None = None
    asynchronous: bool = False


@dataclass(frozen=True, slots=True)
class BlockSave:
    """Copy pool block ``block_id`` (full, cached under ``key``) to each of ``tiers``.

    ``host_slot`` is the CPU tier's host block reserved for it when ``"cpu"``
    is among the tiers. ``request_id`` is the request that filled the block,
    or None for a spill (a block the pool evicted, which no request holds).
    """

    request_id: str | None
    block_id: int
    key: bytes
    tiers: tuple[str, ...]
    host_slot: int | None = None


@dataclass(frozen=True, slots=True)
class ConnectorMetadata:
    """One step's transfers, from the scheduler side to the worker side.

    ``spills`` are saves of blocks the pool evicted while planning this step:
    their KV is still in place, and the worker copies them out at the start of
    :meth:`KVConnectorWorker.start_load`, before any load or forward pass
    writes those blocks again. ``saves`` go after the forward pass that fills
    their blocks.
    """

    loads: tuple[BlockLoad, ...] = ()
    saves: tuple[BlockSave, ...] = ()
    spills: tuple[BlockSave, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.loads or self.saves or self.spills)


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
        """Copy out this step's spills, then begin its loads; a failed load is reported by :meth:`get_finished`."""
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
