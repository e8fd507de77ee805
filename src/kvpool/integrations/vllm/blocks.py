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
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from kvpool.errors import ConfigError
from kvpool.integrations.vllm.plan import StepPlan
from kvpool.tiers import BlockStore

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


class TierWorker:
    """Carries out step plans against a :class:`KVBlockLayout`, the stores and a host buffer.

    ``stores``: the disk and Redis stores by tier name; ``host_slots``: host blocks of the cpu
    tier (None without one), held here as one ``[host_slots + 1, block_bytes]`` uint8 tensor
    (slot 0 is never named: the host tier's bookkeeping keeps it as its null block).
    """

    def __init__(self, layout: KVBlockLayout, stores: Mapping[str, BlockStore], host_slots: int | None) -> None:
        self.layout = layout
        self.stores = dict(stores)
        self.host = None if host_slots is None else torch.zeros((host_slots + 1, layout.block_bytes), dtype=torch.uint8)
        self.figures = WorkerFigures()

    def load(self, plan: StepPlan) -> set[int]:
        """Copy the plan's loads into vLLM's blocks; the block IDs that could not be loaded."""
        failed: set[int] = set()
        by_store: dict[str, list[tuple[bytes, int]]] = {}
        for load in plan.loads:
            if load.slot is not None and self.host is not None:
                self.layout.write(load.block_id, self.host[load.slot])
                self.figures.loaded[load.tier] += 1
            else:
                by_store.setdefault(load.tier, []).append((load.key, load.block_id))
        for name, wanted in by_store.items():
            store = self.stores.get(name)
            payloads: Sequence[bytes | None]
            try:
                payloads = store.get_many([key for key, _ in wanted]) if store is not None else [None] * len(wanted)
            except Exception as exc:  # noqa: BLE001  # a store's fault is a miss; vLLM recomputes
                _log.warning("kvpool connector: reading %d blocks from %s failed (%s)", len(wanted), name, exc)
                payloads = [None] * len(wanted)
            for (_key, block_id), payload in zip(wanted, payloads):
                if payload is None or len(payload) != self.layout.block_bytes:
                    failed.add(block_id)
                    self.figures.failed_loads[name] += 1
                    continue
                self.layout.write(block_id, torch.frombuffer(bytearray(payload), dtype=torch.uint8))
                self.figures.loaded[name] += 1
        if failed:
            _log.warning(
                "kvpool connector: %d of %d blocks not loaded (%s); vLLM recomputes them",
                len(failed),
                len(plan.loads),
                self.describe(),
            )
        return failed

    def save(self, plan: StepPlan) -> None:
        """Send the plan's saves down: host slots by a tensor copy, each store by one ``put_many``."""
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
        for name in sorted(set(self.figures.loaded) | set(self.figures.failed_loads) | set(self.figures.saved)):
            text = (
                f"{name}: {self.figures.loaded[name]} loaded, {self.figures.failed_loads[name]} not loaded, "
                f"{self.figures.saved[name]} saved"
            )
            store = self.stores.get(name)
            if store is not None:
                stats = store.stats
                kinds = ", ".join(f"{k} {n}" for k, n in sorted(stats.corrupt_by_kind.items()))
                text += f", {stats.corrupt} refused" + (f" ({kinds})" if kinds else "") + f", {stats.errors} errors"
            parts.append(text)
        return "; ".join(parts) or "no block moved"

    def close(self) -> None:
        for store in self.stores.values():
            store.close()
