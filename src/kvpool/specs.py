"""KV cache layer specs: how many bytes one layer keeps per block, and how layers share a pool.

Every layer that keeps per-request state (keys and values, a compressed
latent, or a recurrent state) is described by one *spec*: a frozen record of
integers that fixes the exact bytes the layer needs for one block of
``block_size`` token positions (:attr:`page_bytes`). Nothing here touches
memory or imports torch; the specs are what a planner sizes and what a
runtime uses to shape its tensors and decide which blocks a request keeps.

Spec kinds (:class:`LayerKind`):

=================  ===========================================  ==========================
kind               page_bytes (one layer, one block)            blocks a request keeps
=================  ===========================================  ==========================
full attention     2 * block_size * kv_heads * head_dim * item   every block of its tokens
sliding window     same                                         the blocks covering the window
chunked local      same                                         the blocks covering its chunk
MLA                block_size * (kv_lora_rank + rope_dim) * item every block of its tokens
Mamba-style state  state_bytes (fixed, whatever the length)     two state blocks (one up to
                                                                ``block_size`` tokens)
cross attention    same as full attention                       every encoder-token block
=================  ===========================================  ==========================

``blocks_per_request`` is the one home of these counts: the planner sizes a
pool with it and each group manager (:mod:`kvpool.groups`) admits requests
with it.

The factor 2 is K plus V. MLA caches one compressed latent per token and no
separate V, and that latent is the same on every tensor-parallel rank.

Sharing one pool (hybrid models)
--------------------------------
All layers draw block IDs from a single pool, the same design as vLLM's hybrid
allocator. A block ID stands for one page in each of ``group_size`` per-slot
tensors, so a pool block is ``group_size * page_bytes`` bytes. For that to
work every layer's page must have the same size and every group the same
number of layers:

1. :func:`unify_page_sizes` makes pages equal. Attention pages that are
   smaller than the largest attention page by a whole factor get a
   proportionally larger ``block_size``. A Mamba-style state, which does not
   grow with the sequence, must fit one page: when it is larger than the
   attention page, every attention block size is multiplied by the smallest
   integer ``k`` that makes the attention page at least the state, i.e. the
   smallest multiple of the requested block size that is big enough. The
   state is then padded up to the attention page.
2. :func:`group_layers` collects layers with identical specs (in order of
   their first layer) and cuts each collection into groups of ``group_size``
   layers. ``group_size`` is the smallest collection's size (most hybrid
   models repeat an n:1 pattern, so this is the "1"), unless the largest
   collection is under 1.5 times the smallest, in which case the largest size
   is used so that near-equal collections are padded slightly rather than
   split. Collection ``c`` of ``n`` layers becomes ``ceil(n / group_size)``
   groups, group ``i`` taking layers ``c[i::num_groups]`` (every
   ``num_groups``-th layer, so a pipeline stage's share stays balanced). A
   group with fewer than ``group_size`` layers leaves its remaining slots
   unused.

Each group keeps its own block table per request; a runtime applies that table
to every layer in the group.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import ClassVar, Self

from kvpool.checks import check_int
from kvpool.errors import ConfigError

__all__ = [
    "ChunkedLocalAttentionSpec",
    "CrossAttentionSpec",
    "FullAttentionSpec",
    "KVCacheGroup",
    "KVDtype",
    "LayerKind",
    "LayerSpec",
    "MLASpec",
    "MambaSpec",
    "SlidingWindowSpec",
    "cdiv",
    "group_layers",
    "layers_per_pool_block",
    "pool_block_bytes",
    "unify_page_sizes",
]


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative ``a`` by positive ``b``."""
    return -(-a // b)


class KVDtype(Enum):
    """Element type of a cached tensor. ``itemsize`` is its width in bytes."""

    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"
    FP8 = "fp8"

    @property
    def itemsize(self) -> int:
        return _ITEMSIZE[self]

    @classmethod
    def parse(cls, text: str, *, auto: KVDtype | None = None, field: str = "dtype") -> KVDtype:
        """Parse a dtype spelling such as ``"bf16"``, ``"bfloat16"``, ``"half"`` or ``"fp8_e4m3"``.

        Matching ignores case and a leading ``"torch."``. ``"auto"`` means
        ``auto`` (the model's own dtype); it is an error when ``auto`` is None.
        Raises :class:`ConfigError` naming ``field`` and the text for an
        unknown spelling.
        """
        if not isinstance(text, str):
            raise ConfigError(f"{field} must be a string such as 'bf16', got {text!r}")
        key = text.strip().lower().removeprefix("torch.")
        if key == "auto":
            if auto is None:
                raise ConfigError(f"{field} 'auto' needs the model's dtype, which is unknown here")
            return auto
        try:
            return _DTYPE_SPELLINGS[key]
        except KeyError:
            raise ConfigError(
                f"unknown {field} {text!r}: use auto, fp32, bf16, fp16 or fp8 "
                f"(or a spelling such as float32, bfloat16, float16, half, fp8_e4m3, fp8_e5m2)"
            ) from None


_ITEMSIZE = {KVDtype.FP32: 4, KVDtype.BF16: 2, KVDtype.FP16: 2, KVDtype.FP8: 1}

_DTYPE_SPELLINGS: dict[str, KVDtype] = {
    **dict.fromkeys(("fp32", "float32", "float", "f32"), KVDtype.FP32),
    **dict.fromkeys(("bf16", "bfloat16"), KVDtype.BF16),
    **dict.fromkeys(("fp16", "float16", "half", "f16"), KVDtype.FP16),
    **dict.fromkeys(
        (
            "fp8",
            "fp8_e4m3",
            "fp8_e5m2",
            "float8",
            "float8_e4m3fn",
            "float8_e4m3fnuz",
            "float8_e5m2",
            "float8_e5m2fnuz",
        ),
        KVDtype.FP8,
    ),
}


class LayerKind(Enum):
    """What a layer caches, which decides how many blocks a request keeps for it."""

    FULL_ATTENTION = "full_attention"
    SLIDING_WINDOW = "sliding_window"
    CHUNKED_LOCAL = "chunked_local"
    MLA = "mla"
    MAMBA = "mamba"
    CROSS_ATTENTION = "cross_attention"


def _check_positive(owner: str, **values: object) -> None:
    for name, value in values.items():
        check_int(f"{owner}.{name}", value)


def _check_dtype(owner: str, dtype: object) -> None:
    if not isinstance(dtype, KVDtype):
        raise ConfigError(f"{owner}.dtype must be a KVDtype, got {dtype!r}")


@dataclass(frozen=True, kw_only=True, slots=True)
class _HeadsSpec:
    """Shared fields of the specs that cache K and V per KV head (not public)."""

    kind: ClassVar[LayerKind]
    #: Whether blocks of this kind may be shared between requests by prefix hash.
    prefix_cacheable: ClassVar[bool] = True

    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: KVDtype

    def __post_init__(self) -> None:
        name = type(self).__name__
        _check_positive(name, block_size=self.block_size, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim)
        _check_dtype(name, self.dtype)

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token occupies in this layer (K and V)."""
        return 2 * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    @property
    def page_bytes(self) -> int:
        """Exact bytes of this layer's share of one block: ``block_size * bytes_per_token``."""
        return self.block_size * self.bytes_per_token

    def with_block_size(self, block_size: int) -> Self:
        """A copy with a different ``block_size``."""
        return dataclasses.replace(self, block_size=block_size)


@dataclass(frozen=True, kw_only=True, slots=True)
class FullAttentionSpec(_HeadsSpec):
    """A causal attention layer that keeps K and V for every token of the request."""

    kind: ClassVar[LayerKind] = LayerKind.FULL_ATTENTION

    @property
    def sliding_window(self) -> int | None:
        """Tokens a query attends back over (itself included); None means unlimited."""
        return None

    @property
    def attention_chunk_size(self) -> int | None:
        """Length of the aligned chunks attention is confined to; None means unchunked."""
        return None

    def blocks_per_request(self, num_tokens: int) -> int:
        """Blocks one request of ``num_tokens`` tokens holds at once in this layer."""
        return cdiv(num_tokens, self.block_size)


@dataclass(frozen=True, kw_only=True, slots=True)
class SlidingWindowSpec(_HeadsSpec):
    """Attention over the last ``sliding_window`` tokens only (the query itself included).

    Same page size as full attention; the runtime frees (replaces with the null
    block) the blocks that fall entirely out of the window, so a request keeps
    at most ``cdiv(sliding_window - 1, block_size) + 1`` blocks: the window
    minus the current token, plus one because the window need not start on a
    block boundary.
    """

    kind: ClassVar[LayerKind] = LayerKind.SLIDING_WINDOW

    sliding_window: int

    def __post_init__(self) -> None:
        _HeadsSpec.__post_init__(self)
        _check_positive(type(self).__name__, sliding_window=self.sliding_window)

    @property
    def attention_chunk_size(self) -> int | None:
        return None

    def blocks_per_request(self, num_tokens: int) -> int:
        full = cdiv(num_tokens, self.block_size)
        return min(full, cdiv(self.sliding_window - 1, self.block_size) + 1)


@dataclass(frozen=True, kw_only=True, slots=True)
class ChunkedLocalAttentionSpec(_HeadsSpec):
    """Attention confined to aligned chunks of ``attention_chunk_size`` tokens (Llama 4 style).

    A query at position ``p`` sees positions ``(p // chunk) * chunk`` to ``p``;
    earlier blocks can be freed. A request keeps the blocks covering one
    chunk: ``cdiv(chunk, block_size)``, plus one when the chunk is not a whole
    number of blocks (a chunk may then start inside a block).
    """

    kind: ClassVar[LayerKind] = LayerKind.CHUNKED_LOCAL

    attention_chunk_size: int

    def __post_init__(self) -> None:
        _HeadsSpec.__post_init__(self)
        _check_positive(type(self).__name__, attention_chunk_size=self.attention_chunk_size)

    @property
    def sliding_window(self) -> int | None:
        return None

    def blocks_per_request(self, num_tokens: int) -> int:
        chunk_blocks = cdiv(self.attention_chunk_size, self.block_size)
        if self.attention_chunk_size % self.block_size:
            chunk_blocks += 1
        return min(cdiv(num_tokens, self.block_size), chunk_blocks)


@dataclass(frozen=True, kw_only=True, slots=True)
class CrossAttentionSpec(_HeadsSpec):
    """Decoder-to-encoder attention: K and V of the encoder's tokens.

    Sized like full attention over the encoder tokens (``num_tokens`` in
    :meth:`blocks_per_request` is the encoder length). Its blocks depend on the
    request's encoder input, not on a token prefix, so they are never
    prefix-cached.
    """

    kind: ClassVar[LayerKind] = LayerKind.CROSS_ATTENTION
    prefix_cacheable: ClassVar[bool] = False

    @property
    def sliding_window(self) -> int | None:
        return None

    @property
    def attention_chunk_size(self) -> int | None:
        return None

    def blocks_per_request(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)


@dataclass(frozen=True, kw_only=True, slots=True)
class MLASpec:
    """Multi-head latent attention (DeepSeek V2/V3): one compressed latent per token.

    Each token stores ``kv_lora_rank`` latent values plus ``qk_rope_head_dim``
    rotary key values; K and V are both reconstructed from the latent, so there
    is no factor 2. The latent is replicated on every tensor-parallel rank.
    """

    kind: ClassVar[LayerKind] = LayerKind.MLA
    prefix_cacheable: ClassVar[bool] = True

    block_size: int
    kv_lora_rank: int
    qk_rope_head_dim: int
    dtype: KVDtype

    def __post_init__(self) -> None:
        name = type(self).__name__
        _check_positive(
            name,
            block_size=self.block_size,
            kv_lora_rank=self.kv_lora_rank,
            qk_rope_head_dim=self.qk_rope_head_dim,
        )
        _check_dtype(name, self.dtype)

    @property
    def bytes_per_token(self) -> int:
        return (self.kv_lora_rank + self.qk_rope_head_dim) * self.dtype.itemsize

    @property
    def page_bytes(self) -> int:
        return self.block_size * self.bytes_per_token

    @property
    def sliding_window(self) -> int | None:
        return None

    @property
    def attention_chunk_size(self) -> int | None:
        return None

    def blocks_per_request(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def with_block_size(self, block_size: int) -> Self:
        return dataclasses.replace(self, block_size=block_size)


@dataclass(frozen=True, kw_only=True, slots=True)
class MambaSpec:
    """A fixed-size recurrent state (Mamba, Mamba-2, gated delta net): at most two blocks per request.

    ``state_bytes`` is the layer's whole per-request state (convolution state
    plus SSM/recurrent state, in their storage dtypes), whatever the sequence
    length; how it is computed from a model config is documented in
    :mod:`kvpool.model_config`. ``block_size`` is the token span that pool
    blocks have in the attention layers the state shares a pool with.
    ``padded_page_bytes``, when set, is the page the state occupies after being
    padded to the shared page size (at least ``state_bytes``).
    """

    kind: ClassVar[LayerKind] = LayerKind.MAMBA
    #: Whole states at block boundaries are cacheable (see docs/hybrid.md).
    prefix_cacheable: ClassVar[bool] = True
    #: Most state blocks a request holds at once: the state a step reads and
    #: the one it writes when it crosses into a new block position.
    max_state_blocks: ClassVar[int] = 2

    state_bytes: int
    block_size: int
    padded_page_bytes: int | None = None

    def __post_init__(self) -> None:
        name = type(self).__name__
        _check_positive(name, state_bytes=self.state_bytes, block_size=self.block_size)
        if self.padded_page_bytes is not None:
            _check_positive(name, padded_page_bytes=self.padded_page_bytes)
            if self.padded_page_bytes < self.state_bytes:
                raise ConfigError(
                    f"{name}.padded_page_bytes ({self.padded_page_bytes}) is smaller than "
                    f"state_bytes ({self.state_bytes})"
                )

    @property
    def page_bytes(self) -> int:
        """Bytes the state occupies in one block (padded when sharing a pool)."""
        return self.state_bytes if self.padded_page_bytes is None else self.padded_page_bytes

    @property
    def sliding_window(self) -> int | None:
        return None

    @property
    def attention_chunk_size(self) -> int | None:
        return None

    def blocks_per_request(self, num_tokens: int) -> int:
        """Blocks one request of ``num_tokens`` tokens holds at its peak: ``min(cdiv(num_tokens, block_size), 2)``.

        The state does not grow with the sequence, but a step that crosses
        into a new block position reads the state from the old block and
        writes the new state into a fresh one, so both are held until the
        next step gives the old one back (:meth:`blocks_held_after`). A
        request of at most ``block_size`` tokens never crosses a block.
        """
        return min(cdiv(num_tokens, self.block_size), self.max_state_blocks)

    def blocks_held_after(self, num_computed_tokens: int, num_tokens: int) -> int:
        """State blocks held right after a step from ``num_computed_tokens`` to ``num_tokens`` tokens.

        One, or two when the step starts from a state (``num_computed_tokens``
        > 0) and ends in a later block position than that state's.
        """
        if num_tokens == 0:
            return 0
        bs = self.block_size
        if num_computed_tokens == 0 or cdiv(num_tokens, bs) == cdiv(num_computed_tokens, bs):
            return 1
        return self.max_state_blocks

    def with_block_size(self, block_size: int) -> Self:
        return dataclasses.replace(self, block_size=block_size)


#: Any layer spec.
LayerSpec = FullAttentionSpec | SlidingWindowSpec | ChunkedLocalAttentionSpec | CrossAttentionSpec | MLASpec | MambaSpec

_SPEC_TYPES = (_HeadsSpec, MLASpec, MambaSpec)


@dataclass(frozen=True, kw_only=True, slots=True)
class KVCacheGroup:
    """Layers that share one block table per request because their specs are identical.

    ``layer_ids`` are positions in the sequence of specs given to
    :func:`group_layers` (for a model config, the cache-holding layers in model
    order), ascending. A runtime needs, per group: ``spec.kind`` (which rule
    frees blocks), ``spec.block_size`` (tokens per block), ``sliding_window`` /
    ``attention_chunk_size`` (how far back to keep), ``spec.prefix_cacheable``
    and ``layer_ids`` (which layers' tensors the block table applies to).
    """

    spec: LayerSpec
    layer_ids: tuple[int, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.spec, _SPEC_TYPES):
            raise ConfigError(f"KVCacheGroup.spec must be a layer spec, got {self.spec!r}")
        if not self.layer_ids:
            raise ConfigError("KVCacheGroup.layer_ids must not be empty")
        if list(self.layer_ids) != sorted(set(self.layer_ids)) or self.layer_ids[0] < 0:
            raise ConfigError(f"KVCacheGroup.layer_ids must be distinct, ascending and >= 0, got {self.layer_ids}")

    @property
    def kind(self) -> LayerKind:
        return self.spec.kind

    @property
    def block_size(self) -> int:
        return self.spec.block_size

    @property
    def sliding_window(self) -> int | None:
        return self.spec.sliding_window

    @property
    def attention_chunk_size(self) -> int | None:
        return self.spec.attention_chunk_size

    @property
    def num_layers(self) -> int:
        return len(self.layer_ids)

    @property
    def page_bytes(self) -> int:
        """Bytes of one layer's share of one block."""
        return self.spec.page_bytes

    @property
    def block_bytes(self) -> int:
        """Bytes this group's layers use of one pool block (``num_layers * page_bytes``)."""
        return self.num_layers * self.spec.page_bytes


def _check_specs(layer_specs: Sequence[LayerSpec]) -> None:
    if len(layer_specs) == 0:
        raise ConfigError("no layer holds a KV cache: the list of layer specs is empty")
    for i, spec in enumerate(layer_specs):
        if not isinstance(spec, _SPEC_TYPES):
            raise ConfigError(f"layer {i}: expected a layer spec, got {spec!r}")


def unify_page_sizes(layer_specs: Sequence[LayerSpec]) -> tuple[LayerSpec, ...]:
    """Return the specs adjusted so that every layer has the same ``page_bytes``.

    Attention-like specs (everything but :class:`MambaSpec`) whose page divides
    the largest attention page get their ``block_size`` multiplied by the
    ratio. If a Mamba-style state is larger than that page, every attention
    ``block_size`` is multiplied by ``ceil(largest_state / page)``. States are
    then padded (``padded_page_bytes``) to the common page and take the
    smallest attention block size as their ``block_size``. A model with only
    states pads them to the largest state. Specs already equal come back
    unchanged. Raises :class:`ConfigError` when an attention page does not
    divide the largest one (no integer block size can make them equal).
    """
    _check_specs(layer_specs)
    attention = [s for s in layer_specs if not isinstance(s, MambaSpec)]
    states = [s for s in layer_specs if isinstance(s, MambaSpec)]
    largest_state = max((s.state_bytes for s in states), default=0)

    if not attention:
        return tuple(
            s if s.page_bytes == largest_state else dataclasses.replace(s, padded_page_bytes=largest_state)
            for s in states
        )

    target = max(s.page_bytes for s in attention)
    factor: dict[LayerSpec, int] = {}
    for spec in attention:
        if target % spec.page_bytes:
            raise ConfigError(
                f"attention pages of {spec.page_bytes} and {target} bytes cannot share one pool: "
                f"{target} is not a multiple of {spec.page_bytes}"
            )
        factor[spec] = target // spec.page_bytes
    raise_by = cdiv(largest_state, target) if largest_state > target else 1
    page = target * raise_by

    def adjust(spec: LayerSpec) -> LayerSpec:
        scale = factor[spec] * raise_by
        return spec if scale == 1 else spec.with_block_size(spec.block_size * scale)

    adjusted_attention = {spec: adjust(spec) for spec in factor}
    state_block_size = min(s.block_size for s in adjusted_attention.values())
    result: list[LayerSpec] = []
    for layer in layer_specs:
        if isinstance(layer, MambaSpec):
            padded = None if layer.state_bytes == page else page
            result.append(dataclasses.replace(layer, block_size=state_block_size, padded_page_bytes=padded))
        else:
            result.append(adjusted_attention[layer])
    return tuple(result)


def group_layers(layer_specs: Sequence[LayerSpec]) -> tuple[KVCacheGroup, ...]:
    """Group layers with identical specs into KV cache groups that share one block pool.

    Position ``i`` of ``layer_specs`` is layer ID ``i``. Pages are first made
    equal with :func:`unify_page_sizes`, so the groups' specs may have larger
    block sizes (or padded states) than the input. Layers with identical specs
    are collected in order of their first layer and cut into groups of one
    common size as described in the module docstring; groups come out in
    collection order, then by split index. The result is deterministic and
    every layer ID appears in exactly one group.
    """
    specs = unify_page_sizes(layer_specs)
    collections: dict[LayerSpec, list[int]] = {}
    for layer_id, spec in enumerate(specs):
        collections.setdefault(spec, []).append(layer_id)
    if len(collections) == 1:
        ((spec, ids),) = collections.items()
        return (KVCacheGroup(spec=spec, layer_ids=tuple(ids)),)

    sizes = [len(ids) for ids in collections.values()]
    group_size = min(sizes)
    if 2 * max(sizes) < 3 * min(sizes):  # largest under 1.5x the smallest
        group_size = max(sizes)
    groups: list[KVCacheGroup] = []
    for spec, ids in collections.items():
        num_groups = cdiv(len(ids), group_size)
        for i in range(num_groups):
            groups.append(KVCacheGroup(spec=spec, layer_ids=tuple(ids[i::num_groups])))
    return tuple(groups)


def layers_per_pool_block(groups: Sequence[KVCacheGroup]) -> int:
    """The group size: how many layer pages one pool block holds (the largest group)."""
    if not groups:
        raise ConfigError("no KV cache groups")
    return max(g.num_layers for g in groups)


def pool_block_bytes(groups: Sequence[KVCacheGroup]) -> int:
    """Bytes of one pool block: ``group size * page_bytes``.

    Requires every group to have the same ``page_bytes`` (as
    :func:`group_layers` guarantees); raises :class:`ConfigError` otherwise.
    """
    pages = {g.page_bytes for g in groups}
    if len(pages) != 1:
        raise ConfigError(f"groups sharing one pool must have equal page bytes, got {sorted(pages)}")
    return layers_per_pool_block(groups) * pages.pop()
