"""The worker side of the vLLM connector: a vLLM block's tensors as one payload, and a step's plan carried out.

vLLM hands the worker one KV cache tensor per attention layer. Whatever its backend's shape
(vLLM-CPU's ``[blocks, kv_heads, block_size, 2 * head_size]``, flash attention's
``[2, blocks, block_size, kv_heads, head_size]``), one dimension counts blocks; a block's payload
is that block's slice of every layer, in the layers' order, as raw bytes::

    payload = layer 0's block | layer 1's block | ... | layer L-1's block

which is :attr:`~kvpool.tiers.entry.LayoutFingerprint.block_bytes` long. The slice's layout is
the backend's, so the fingerprint names the platform (``architecture@vllm/cpu``): a CPU and a
GPU deployment sharing a Redis keep apart.

:class:`TierWorker` carries out a :class:`~kvpool.integrations.vllm.plan.StepPlan`: loads before
the forward pass (host slots by a tensor copy, stores by one ``get_many`` per tier), saves after
it (one ``put_many`` per tier). A block a store does not return (absent, refused as corrupt,
foreign or unsigned, the backend down) is a failed load: its vLLM block ID is reported, and
vLLM recomputes from it (``"kv_load_failure_policy": "recompute"``). Torch, no vLLM.

With :class:`~kvpool.tiers.transfer_threads.TransferThreads`, nothing waits on a store:

* a receiving request's store loads (:attr:`StepPlan.receiving`) are one fetch on a load
  thread, which only fills bytes this worker owns. It is the engine's fetch
  (:class:`~kvpool.tiers.piece_fetch.PieceFetch`): read in the pieces the scheduler planned
  (:attr:`StepPlan.waits`, :meth:`~kvpool.tiers.load_or_compute.TransferCosts.load_wait`), and
  waited for only as long as computing the blocks still to come would take (the fixed
  ``load_deadline_s`` where the plan has no wait). :meth:`TierWorker.received` (never blocking)
  reports the request once its fetch ended or ran past its deadline, having copied into vLLM's
  blocks the leading blocks that arrived (whole pieces, verified); every later block is a failed
  load, which vLLM recomputes, and its late bytes are never copied. A miss is counted
  (:attr:`WorkerFigures.deadline_misses`, ``kept_at_deadline``, ``timed_out_loads``) and sent to
  the scheduler (:attr:`TransferNotes.misses`), whose load or compute then neither loads from nor
  looks up in that tier until the worker reports the late piece's real time
  (:attr:`TransferNotes.late_done`);
* saves read vLLM's blocks into bytes on the caller's thread, at once (so vLLM may reuse the
  blocks when the step ends), and queue the ``put_many`` for the save thread; a save that finds
  the queue full is dropped and counted (a later miss).

Host slot copies stay on the caller's thread: they are memory copies, and the scheduler's
bookkeeping of the slots assumes each plan's copies are done in the step it was built for.
"""

from __future__ import annotations

import functools
import logging
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from kvpool.errors import ConfigError
from kvpool.integrations.vllm.plan import StepPlan, TransferNotes
from kvpool.tiers import BlockStore
from kvpool.tiers.piece_fetch import PieceFetch
from kvpool.tiers.transfer_threads import LoadOutcome, TransferThreads

__all__ = ["KVBlockLayout", "TierWorker", "WorkerFigures"]

_log = logging.getLogger("kvpool.integrations.vllm")


class KVBlockLayout:
    """vLLM's per-layer KV cache tensors seen as blocks of ``block_bytes`` bytes.

    ``layers``: one tensor per attention layer, in a fixed order (both processes sharing a tier
    must use the same); ``num_blocks``: vLLM's block count, which names the block dimension (the
    first dimension of that size). ConfigError naming the shape if a layer has no such
    dimension, or if the layers' blocks do not add up to ``block_bytes``.
    """

    def __init__(self, layers: Sequence[torch.Tensor], num_blocks: int, block_bytes: int) -> None:
        if not layers:
            raise ConfigError("the vLLM connector found no KV cache tensor to move")
        self._layers = list(layers)
        self._dims: list[int] = []
        self._sizes: list[int] = []
        for tensor in self._layers:
            dims = [d for d, size in enumerate(tensor.shape) if size == num_blocks]
            if not dims:
                raise ConfigError(
                    f"a KV cache tensor of shape {tuple(tensor.shape)} has no dimension of {num_blocks} blocks"
                )
            self._dims.append(dims[0])
            self._sizes.append(tensor.numel() // num_blocks * tensor.element_size())
        if sum(self._sizes) != block_bytes:
            raise ConfigError(
                f"vLLM's KV cache holds {sum(self._sizes)} bytes per block over {len(layers)} layers "
                f"(first layer {tuple(self._layers[0].shape)}, {self._layers[0].dtype}); the entry layout says {block_bytes}"
            )
        self.num_blocks = num_blocks
        self.block_bytes = block_bytes

    def read(self, block_id: int) -> torch.Tensor:
        """A copy of block ``block_id`` as ``block_bytes`` uint8 values."""
        parts = [
            t.select(d, block_id).contiguous().view(torch.uint8).reshape(-1) for t, d in zip(self._layers, self._dims)
        ]
        return torch.cat(parts)

    def write(self, block_id: int, data: torch.Tensor) -> None:
        """Put ``data`` (``block_bytes`` uint8 values, as :meth:`read` returns) into block ``block_id``."""
        if data.dtype != torch.uint8 or data.numel() != self.block_bytes:
            raise ConfigError(
                f"a block payload must be {self.block_bytes} uint8 values, got {data.numel()} {data.dtype}"
            )
        data = data.contiguous()
        offset = 0
        for tensor, dim, size in zip(self._layers, self._dims, self._sizes):
            target = tensor.select(dim, block_id)
            target.copy_(data[offset : offset + size].view(tensor.dtype).view(target.shape))
            offset += size


@dataclass(slots=True)
class WorkerFigures:
    """Cumulative block counts of one worker, by tier name."""

    loaded: Counter[str] = field(default_factory=Counter)
    failed_loads: Counter[str] = field(default_factory=Counter)  # not returned: absent, refused or down
    saved: Counter[str] = field(default_factory=Counter)
    failed_saves: Counter[str] = field(default_factory=Counter)  # a store said it did not keep them
    dropped_saves: Counter[str] = field(default_factory=Counter)  # the save queue was full
    timed_out_loads: Counter[str] = field(default_factory=Counter)  # past the load deadline (in failed_loads too)
    deadline_misses: Counter[str] = field(default_factory=Counter)  # fetches past their deadline, by the late tier
    kept_at_deadline: Counter[str] = field(default_factory=Counter)  # blocks such fetches had brought, used


# A synchronous load's store loads, by tier: (key, vLLM block ID) in the plan's order.
_Wanted = dict[str, list[tuple[bytes, int]]]


@dataclass(slots=True)
class _Receiving:
    """One receiving request's store loads, fetched on a load thread into ``payloads`` (one per load)."""

    request_id: str
    loads: list[tuple[str, bytes, int]]  # (tier, key, vLLM block ID) in the plan's order
    fetch: PieceFetch
    payloads: list[bytes | None]


class TierWorker:
    """Carries out step plans against a :class:`KVBlockLayout`, the stores and a host buffer.

    ``stores``: the disk and Redis stores by tier name; ``host_slots``: host blocks of the cpu
    tier (None without one), held here as one ``[host_slots + 1, block_bytes]`` uint8 tensor
    (slot 0 is never named: the host tier's bookkeeping keeps it as its null block);
    ``transfers``: the threads receiving requests' loads and every store save run on (None:
    both on the caller's thread, and a plan with receiving requests is refused).
    """

    def __init__(
        self,
        layout: KVBlockLayout,
        stores: Mapping[str, BlockStore],
        host_slots: int | None,
        transfers: TransferThreads | None = None,
    ) -> None:
        self.layout = layout
        self.stores = dict(stores)
        self.host = None if host_slots is None else torch.zeros((host_slots + 1, layout.block_bytes), dtype=torch.uint8)
        self.transfers = transfers
        self.figures = WorkerFigures()
        #: Each fetch's size and seconds (and each timed forward pass), until the scheduler is sent them.
        self.notes = TransferNotes()
        self._fetching: dict[int, _Receiving] = {}  # ticket -> the fetch
        self._received: set[str] = set()  # receiving requests with nothing left to fetch
        self._late: list[_Receiving] = []  # fetches past their deadline whose thread still reads a piece

    # -- loads -------------------------------------------------------------------------------------

    def start_receiving(self, plan: StepPlan) -> None:
        """Start the receiving requests' loads: host slots copied now, store loads on a load thread.

        :meth:`received` reports each request once its loads ended. Call it as early in the
        step as the plan is known: on vLLM-CPU the forward pass runs before ``start_load_kv``
        when no load is synchronous, so a fetch started there would wait for the whole pass.
        """
        if not plan.receiving:
            return
        if self.transfers is None:
            raise ConfigError(
                f"requests {list(plan.receiving)[:4]} load asynchronously, and this worker has no threads"
            )
        later: dict[str, list[tuple[str, bytes, int]]] = {request_id: [] for request_id in plan.receiving}
        for load in plan.loads:
            if load.request_id not in later:
                continue
            if load.slot is not None and self.host is not None:
                self.layout.write(load.block_id, self.host[load.slot])
                self.figures.loaded[load.tier] += 1
            else:
                later[load.request_id].append((load.tier, load.key, load.block_id))
        waits = dict(plan.waits)
        transfers = self.transfers
        for request_id, loads in later.items():
            if not loads:
                self._received.add(request_id)
                continue
            fetch = PieceFetch(
                [tier for tier, _key, _block in loads],
                waits.get(request_id),  # one for other blocks is ignored: the fixed deadline
                fixed_deadline_s=transfers.load_deadline_s,
                clock=transfers.clock,
            )
            job = _Receiving(request_id, loads, fetch, [None] * len(loads))
            ticket = transfers.submit_load(functools.partial(self._read_pieces, job), deadline=fetch.deadline_s)
            self._fetching[ticket] = job

    def _read_pieces(self, job: _Receiving) -> list[bool]:
        """On a load thread: the request's store blocks into its payloads, piece by piece (PieceFetch.run)."""

        def read(tier: str, start: int, stop: int) -> list[bool]:
            got = self._get(tier, [key for _tier, key, _block in job.loads[start:stop]])
            whole = [payload is not None and len(payload) == self.layout.block_bytes for payload in got]
            job.payloads[start:stop] = [p if ok else None for p, ok in zip(got, whole)]
            return whole

        return job.fetch.run(read)

    def load(self, plan: StepPlan) -> set[int]:
        """Copy the loads of the plan's other (not receiving) requests into vLLM's blocks now; the block IDs that failed."""
        receiving = set(plan.receiving)
        failed: set[int] = set()
        now: _Wanted = {}
        count = 0
        for load in plan.loads:
            if load.request_id in receiving:
                continue
            count += 1
            if load.slot is not None and self.host is not None:
                self.layout.write(load.block_id, self.host[load.slot])
                self.figures.loaded[load.tier] += 1
            else:
                now.setdefault(load.tier, []).append((load.key, load.block_id))
        for name, payloads in self._fetch(now, self.notes.loads).items():
            failed |= self._copy(name, now[name], payloads)
        if failed:
            self._warn_not_loaded(len(failed), count)
        return failed

    def _fetch(self, wanted: _Wanted, timings: list[tuple[str, int, int, float]]) -> dict[str, Sequence[bytes | None]]:
        """Each tier's payloads for ``wanted`` (None for a block not returned), on the caller's thread.

        Each tier's fetch is appended to ``timings`` as (tier, blocks, bytes, seconds), failed ones too.
        """
        out: dict[str, Sequence[bytes | None]] = {}
        for name, items in wanted.items():
            started = time.perf_counter()
            out[name] = self._get(name, [key for key, _ in items])
            timings.append((name, len(items), len(items) * self.layout.block_bytes, time.perf_counter() - started))
        return out

    def _get(self, name: str, keys: list[bytes]) -> list[bytes | None]:
        """The payloads of ``keys`` from store ``name``: None for each not returned.

        A store that raises, or answers anything but one bytes-like payload or None per key, is a miss
        of them all (vLLM recomputes them), never an error of the request.
        """
        store = self.stores.get(name)
        if store is None:
            return [None] * len(keys)
        try:
            got = list(store.get_many(keys))
        except Exception as exc:  # noqa: BLE001  # a store's fault is a miss; vLLM recomputes
            _log.warning("kvpool connector: reading %d blocks from %s failed (%s)", len(keys), name, exc)
            return [None] * len(keys)
        if len(got) != len(keys) or not all(p is None or isinstance(p, bytes | bytearray) for p in got):
            _log.warning("kvpool connector: %s answered %d blocks garbled; vLLM recomputes them", name, len(keys))
            return [None] * len(keys)
        return [None if p is None else bytes(p) for p in got]

    def _copy(self, name: str, items: list[tuple[bytes, int]], payloads: Sequence[bytes | None]) -> set[int]:
        """Write the payloads that are whole blocks into their vLLM blocks; the block IDs of the others."""
        failed: set[int] = set()
        for (_key, block_id), payload in zip(items, payloads):
            if payload is None or len(payload) != self.layout.block_bytes:
                failed.add(block_id)
                self.figures.failed_loads[name] += 1
                continue
            self.layout.write(block_id, torch.frombuffer(bytearray(payload), dtype=torch.uint8))
            self.figures.loaded[name] += 1
        return failed

    @property
    def num_receiving(self) -> int:
        """Receiving requests not yet reported by :meth:`received`."""
        return len(self._fetching) + len(self._received)

    def received(self) -> tuple[set[str], set[int]]:
        """The receiving requests whose loads ended since the last call, and the block IDs of theirs that failed.

        Never blocks. A request is reported once its fetch came back, failed, or ran past its
        deadline (:meth:`~kvpool.tiers.piece_fetch.PieceFetch.deadline_s`: the compute the blocks
        still to come save); the leading blocks that arrived are copied into vLLM's blocks here, and
        every later one is failed (its bytes, if they come, are dropped).
        """
        self._poll_late()
        done, self._received = self._received, set()
        failed: set[int] = set()
        outcomes: list[LoadOutcome] = self.transfers.finished_loads() if self.transfers is not None else []
        for outcome in outcomes:
            job = self._fetching.pop(outcome.ticket, None)
            if job is None:
                continue
            done.add(job.request_id)
            failed |= self._land(job, outcome)
        return done, failed

    def _land(self, job: _Receiving, outcome: LoadOutcome) -> set[int]:
        """Copy what an ended fetch brought, up to its first missing block; the block IDs of the rest, counted."""
        fetch = job.fetch
        miss = None
        if outcome.ok:
            timings = fetch.take_timings()
            arrived = outcome.value if isinstance(outcome.value, list) else []
            kept = 0
            while kept < len(arrived) and kept < len(job.loads) and arrived[kept]:
                kept += 1
        else:
            given = fetch.abandon(timed_out=outcome.timed_out)  # its thread reads no piece after this one
            timings, kept, miss = list(given.timings), given.kept, given.miss
            if given.running:
                self._late.append(job)  # its late piece's real time is sent once the thread is done with it
        self._note(timings)
        if miss is not None:
            self.notes.misses.append(miss)
            self.figures.deadline_misses[miss.tier] += 1
        lost: set[int] = set()
        for index, (tier, _key, block_id) in enumerate(job.loads):
            payload = job.payloads[index] if index < kept else None
            if payload is not None:
                self.layout.write(block_id, torch.frombuffer(bytearray(payload), dtype=torch.uint8))
                self.figures.loaded[tier] += 1
                if miss is not None:
                    self.figures.kept_at_deadline[tier] += 1
                continue
            lost.add(block_id)
            self.figures.failed_loads[tier] += 1
            if miss is not None:
                self.figures.timed_out_loads[tier] += 1
        if lost:
            why = "ran past its deadline" if miss is not None else "failed" if outcome.error else "missed blocks"
            _log.warning(
                "kvpool connector: request %s: %d of %d blocks not loaded (its fetch %s after %.3g s); vLLM "
                "recomputes them (%s)",
                job.request_id, len(lost), len(job.loads), why, outcome.seconds, self.describe(),
            )  # fmt: skip
        return lost

    def _note(self, timings: Sequence[tuple[str, int, float]]) -> None:
        self.notes.loads.extend((tier, n, n * self.layout.block_bytes, seconds) for tier, n, seconds in timings)

    def _poll_late(self) -> None:
        """Send the real time of the pieces fetches were reading when their requests stopped waiting, once read."""
        late = []
        for job in self._late:
            done, owed, timings = job.fetch.late_done()
            if not done:
                late.append(job)
                continue
            self._note(timings)
            if owed is not None:
                self.notes.late_done.append(owed)
                _log.info(
                    "kvpool connector: request %s's late piece from %s was read after all (%s)",
                    job.request_id, owed, ", ".join(f"{n} blocks in {s:.3g} s" for _t, n, s in timings) or "failed",
                )  # fmt: skip
        self._late = late

    @property
    def num_late(self) -> int:
        """Fetches their requests stopped waiting for, whose threads still read a piece."""
        return len(self._late)

    def take_notes(self) -> TransferNotes | None:
        """What was measured since the last call (None: nothing), for the scheduler's load or compute."""
        self._poll_late()
        if not self.notes:
            return None
        notes, self.notes = self.notes, TransferNotes()
        return notes

    def _warn_not_loaded(self, failed: int, wanted: int) -> None:
        _log.warning(
            "kvpool connector: %d of %d blocks not loaded (%s); vLLM recomputes them", failed, wanted, self.describe()
        )

    # -- saves -------------------------------------------------------------------------------------

    def save(self, plan: StepPlan) -> None:
        """Send the plan's saves down: host slots by a tensor copy, each store by one ``put_many``.

        With transfer threads the ``put_many`` is queued (the blocks are read into bytes now).
        """
        by_store: dict[str, list[tuple[bytes, bytes]]] = {}
        for save in plan.saves:
            data = self.layout.read(save.block_id)
            for name in save.tiers:
                if save.slot is not None and self.host is not None and name not in self.stores:
                    self.host[save.slot].copy_(data)
                    self.figures.saved[name] += 1
                else:
                    by_store.setdefault(name, []).append((save.key, data.numpy().tobytes()))
        for name, items in by_store.items():
            if self.transfers is None:
                self._put(name, items)
            elif not self.transfers.submit_save(functools.partial(self._put, name, items)):
                self.figures.dropped_saves[name] += len(items)

    def _put(self, name: str, items: list[tuple[bytes, bytes]]) -> None:
        store = self.stores.get(name)
        try:
            stored = store.put_many(items) if store is not None else 0
        except Exception as exc:  # noqa: BLE001  # a lost save is a future miss, never a failed request
            _log.warning("kvpool connector: saving %d blocks to %s failed (%s)", len(items), name, exc)
            stored = 0
        self.figures.saved[name] += stored
        self.figures.failed_saves[name] += len(items) - stored

    def describe(self) -> str:
        """The figures so far, per tier, with each store's refusals by kind."""
        parts = []
        f = self.figures
        for name in sorted(set(f.loaded) | set(f.failed_loads) | set(f.saved) | set(f.dropped_saves)):
            text = f"{name}: {f.loaded[name]} loaded, {f.failed_loads[name]} not loaded"
            if f.timed_out_loads[name]:
                text += f" ({f.timed_out_loads[name]} past the deadline)"
            if f.deadline_misses[name]:
                text += f", {f.deadline_misses[name]} fetches past their deadline"
            if f.kept_at_deadline[name]:
                text += f" ({f.kept_at_deadline[name]} blocks kept)"
            text += f", {f.saved[name]} saved"
            if f.dropped_saves[name]:
                text += f", {f.dropped_saves[name]} dropped (save queue full)"
            store = self.stores.get(name)
            if store is not None:
                stats = store.stats
                kinds = ", ".join(f"{k} {n}" for k, n in sorted(stats.corrupt_by_kind.items()))
                text += f", {stats.corrupt} refused" + (f" ({kinds})" if kinds else "") + f", {stats.errors} errors"
            parts.append(text)
        return "; ".join(parts) or "no block moved"

    def close(self) -> None:
        """Run the queued saves (a few seconds at most), stop the threads, close the stores."""
        if self.transfers is not None:
            self.transfers.close()
        for store in self.stores.values():
            store.close()
