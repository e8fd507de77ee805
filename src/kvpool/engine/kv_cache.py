"""The KV cache memory: allocated once, as fixed-size blocks, and never again.

Every attention layer owns one key tensor and one value tensor, both of shape
``[num_blocks, block_size, num_kv_heads, head_dim]``. Block ``b`` of every layer
together forms one logical KV block: a block ID handed out by the manager
addresses the same row in each layer's tensors. Row ``0`` belongs to the null
block: it stands in block tables where no KV is kept and attention never reads it. The buffer starts
zero-filled so that even a stale block holds finite numbers.

All layers' tensors are views into a single buffer, so the whole cache is one
allocation whose size is known up front; nothing else in kvpool allocates KV
memory.

Hybrid models (layer groups that share one block pool, see
:mod:`kvpool.specs`) can map several layers onto one tensor pair through
``layer_slots``: layer ``j`` of every group uses slot ``j``, so one pool block
is ``group size`` layer pages, which is what the planner counts. Two layers in
the same slot never see each other's data because the pool hands each block ID
to one group at a time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

import kvpool.model_config as model_config
from kvpool.checks import check_int
from kvpool.errors import ConfigError

__all__ = [
    "KVCacheSpec",
    "KVCaches",
    "allocate_kv_caches",
    "num_blocks_for_budget",
]

#: Block 0 is never handed to a request; at least one usable block must follow it.
MIN_NUM_BLOCKS = 2


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    """Shape and dtype of the KV cache of one model.

    Attributes:
        num_layers: Attention layers, each with its own K and V tensors.
        num_kv_heads: Key/value heads per layer (fewer than query heads under GQA).
        head_dim: Size of one head.
        block_size: Tokens per block.
        dtype: Element type of the cache; it must match the model's activations.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int = 16
    dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        check_int("num_layers", self.num_layers)
        check_int("num_kv_heads", self.num_kv_heads)
        check_int("head_dim", self.head_dim)
        check_int("block_size", self.block_size)
        if not isinstance(self.dtype, torch.dtype) or not self.dtype.is_floating_point:
            raise ConfigError(f"KV cache dtype must be a floating torch.dtype, got {self.dtype!r}")

    @classmethod
    def from_model_config(cls, config: Any, *, block_size: int = 16, dtype: torch.dtype = torch.float32) -> KVCacheSpec:
        """Layer count and head geometry of a Hugging Face model config (an object or a dict).

        The geometry is :mod:`kvpool.model_config`'s (:func:`~kvpool.model_config.num_kv_heads`,
        :func:`~kvpool.model_config.head_dim`), the same the planner sizes the cache with.
        """
        fields = config if isinstance(config, dict) else config.to_dict()
        view = model_config.text_config_view(fields)
        return cls(
            num_layers=model_config.int_field(view, "num_hidden_layers"),
            num_kv_heads=model_config.num_kv_heads(view),
            head_dim=model_config.head_dim(view),
            block_size=block_size,
            dtype=dtype,
        )

    @property
    def element_size(self) -> int:
        """Bytes per cache element."""
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def layer_block_bytes(self) -> int:
        """Bytes of one block in one layer, K and V together."""
        return 2 * self.block_size * self.num_kv_heads * self.head_dim * self.element_size

    @property
    def block_bytes(self) -> int:
        """Bytes one block ID costs across all layers, K and V together."""
        return self.num_layers * self.layer_block_bytes


def num_blocks_for_budget(spec: KVCacheSpec, budget_bytes: int) -> int:
    """Number of blocks (the null block included) that fit in ``budget_bytes``.

    Raises:
        ConfigError: the budget is not a positive int, or it holds fewer than
            two blocks (the null block plus one usable block).
    """
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes < 1:
        raise ConfigError(f"KV cache budget must be an int number of bytes >= 1, got {budget_bytes!r}")
    num_blocks = budget_bytes // spec.block_bytes
    if num_blocks < MIN_NUM_BLOCKS:
        raise ConfigError(
            f"KV cache budget of {budget_bytes} bytes holds {num_blocks} block(s) of "
            f"{spec.block_bytes} bytes; at least {MIN_NUM_BLOCKS} are needed"
        )
    return num_blocks


@dataclass(frozen=True, slots=True, eq=False)
class KVCaches:
    """The preallocated K and V tensors of every layer.

    Attributes:
        spec: Geometry and dtype.
        num_blocks: Blocks per layer, the null block (ID 0) included.
        key_caches: ``key_caches[i]`` (layer ``i``) has shape
            ``[num_blocks, block_size, num_kv_heads, head_dim]``.
        value_caches: Same shape as ``key_caches``.
        layer_slots: ``layer_slots[i]`` is the tensor pair layer ``i`` uses;
            layers with equal slots share tensors. Empty means one pair per layer.
    """

    spec: KVCacheSpec
    num_blocks: int
    key_caches: tuple[torch.Tensor, ...]
    value_caches: tuple[torch.Tensor, ...]
    layer_slots: tuple[int, ...] = ()

    @property
    def num_layers(self) -> int:
        return self.spec.num_layers

    @property
    def block_size(self) -> int:
        return self.spec.block_size

    @property
    def device(self) -> torch.device:
        return self.key_caches[0].device

    @property
    def num_tensor_pairs(self) -> int:
        """Distinct (K, V) tensor pairs: the layers, or fewer when layers share slots."""
        return len(set(self.layer_slots)) if self.layer_slots else self.spec.num_layers

    @property
    def nbytes(self) -> int:
        """Total bytes held by the cache."""
        return self.num_blocks * self.num_tensor_pairs * self.spec.layer_block_bytes

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``(key_cache, value_cache)`` pair of layer ``index``."""
        return self.key_caches[index], self.value_caches[index]


def allocate_kv_caches(
    spec: KVCacheSpec,
    num_blocks: int,
    device: torch.device | str = "cpu",
    *,
    layer_slots: Sequence[int] | None = None,
) -> KVCaches:
    """Allocate the whole KV cache in one buffer and return per-layer views.

    Args:
        spec: Geometry and dtype.
        num_blocks: Blocks per layer including the null block; see
            :func:`num_blocks_for_budget`.
        device: Where the memory lives.
        layer_slots: Per layer, the tensor pair it uses (slots ``0..S-1``, each
            used at least once); None gives every layer its own pair.

    Returns:
        A :class:`KVCaches` whose tensors are zero-filled views of one buffer of
        shape ``[S, 2, num_blocks, block_size, num_kv_heads, head_dim]``
        (``S`` = number of slots, the layer count by default).
    """
    if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < MIN_NUM_BLOCKS:
        raise ConfigError(f"num_blocks must be an int >= {MIN_NUM_BLOCKS}, got {num_blocks!r}")
    if layer_slots is None:
        slots: tuple[int, ...] = ()
        num_slots = spec.num_layers
    else:
        slots = tuple(layer_slots)
        valid = all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in slots)
        num_slots = max(slots) + 1 if slots and valid else 0
        if len(slots) != spec.num_layers or not valid or set(slots) != set(range(num_slots)):
            raise ConfigError(
                f"layer_slots must give each of the {spec.num_layers} layers a slot in 0..S-1, "
                f"using every slot; got {list(slots)}"
            )
    buffer = torch.zeros(
        (num_slots, 2, num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim),
        dtype=spec.dtype,
        device=device,
    )
    index = slots or tuple(range(spec.num_layers))
    return KVCaches(
        spec=spec,
        num_blocks=num_blocks,
        key_caches=tuple(buffer[i, 0] for i in index),
        value_caches=tuple(buffer[i, 1] for i in index),
        layer_slots=slots,
    )
