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
  thread, which only fills bytes this worker owns; :meth:`TierWorker.received` (never
  blocking) copies them into vLLM's blocks on the caller's thread when the fetch came back in
  time, and reports the request either way; a fetch that failed or ran past the deadline
  reports all of its blocks as failed loads, and its late bytes are dropped;
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


# One receiving request's store loads, by tier: (key, vLLM block ID) in the plan's order.
_Wanted = dict[str, list[tuple[bytes, int]]]


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
        self._fetching: dict[
            int, tuple[str, _Wanted, list[tuple[str, int, int, float]]]
        ] = {}  # ticket -> (request, its store loads, its fetches' timings)
        self._received: set[str] = set()  # receiving requests with nothing left to fetch

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
        later: dict[str, _Wanted] = {request_id: {} for request_id in plan.receiving}
        for load in plan.loads:
            if load.request_id not in later:
                continue
            if load.slot is not None and self.host is not None:
                self.layout.write(load.block_id, self.host[load.slot])
                self.figures.loaded[load.tier] += 1
            else:
                later[load.request_id].setdefault(load.tier, []).append((load.key, load.block_id))
        for request_id, wanted in later.items():
            if not wanted:
                self._received.add(request_id)
                continue
            timings: list[tuple[str, int, int, float]] = []
            ticket = self.transfers.submit_load(functools.partial(self._fetch, wanted, timings))
            self._fetching[ticket] = (request_id, wanted, timings)

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
        """Each tier's payloads for ``wanted`` (None for a block not returned); on a load thread when asynchronous.

        Each tier's fetch is appended to ``timings`` as (tier, blocks, bytes, seconds), failed ones too.
        """
        out: dict[str, Sequence[bytes | None]] = {}
        for name, items in wanted.items():
            store = self.stores.get(name)
            started = time.perf_counter()
            try:
                out[name] = store.get_many([key for key, _ in items]) if store is not None else [None] * len(items)
            except Exception as exc:  # noqa: BLE001  # a store's fault is a miss; vLLM recomputes
                _log.warning("kvpool connector: reading %d blocks from %s failed (%s)", len(items), name, exc)
                out[name] = [None] * len(items)
            timings.append((name, len(items), len(items) * self.layout.block_bytes, time.perf_counter() - started))
        return out

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

        Never blocks. A fetch that came back in time is copied into vLLM's blocks here; one that
        raised or ran past the deadline fails all of its blocks (its bytes, if they come, are dropped).
        """
        done, self._received = self._received, set()
        failed: set[int] = set()
        outcomes: list[LoadOutcome] = self.transfers.finished_loads() if self.transfers is not None else []
        for outcome in outcomes:
            request_id, wanted, timings = self._fetching.pop(outcome.ticket)
            done.add(request_id)
            timed = list(timings)  # a fetch past its deadline may still be running: what it timed so far
            self.notes.loads.extend(timed)
            if outcome.timed_out:  # a tier not back took the deadline, as the engine's worker counts it
                back = {tier for tier, *_ in timed}
                self.notes.failed.extend(
                    (name, len(items), outcome.seconds) for name, items in wanted.items() if name not in back
                )
            count = sum(len(items) for items in wanted.values())
            if outcome.ok:
                _log.debug(
                    "kvpool connector: request %s: %d blocks fetched in %.3f s", request_id, count, outcome.seconds
                )
                payloads = outcome.value
                assert isinstance(payloads, dict)  # what _fetch returns
                lost = set().union(*(self._copy(name, items, payloads[name]) for name, items in wanted.items()))
                if lost:
                    self._warn_not_loaded(len(lost), count)
                failed |= lost
                continue
            for name, items in wanted.items():
                self.figures.failed_loads[name] += len(items)
                if outcome.timed_out:
                    self.figures.timed_out_loads[name] += len(items)
                failed.update(block_id for _key, block_id in items)
            why = f"not back in {outcome.seconds:.3g} s" if outcome.timed_out else f"failed ({outcome.error})"
            _log.warning(
                "kvpool connector: %d blocks of request %s %s; vLLM computes them (%s)",
                count,
                request_id,
                why,
                self.describe(),
            )
        return done, failed

    def take_notes(self) -> TransferNotes | None:
        """What was measured since the last call (None: nothing), for the scheduler's load or compute."""
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
