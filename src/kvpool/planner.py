"""Capacity planning: how many KV blocks (and tokens, and requests) fit on a GPU.

:func:`plan_kv_cache` is a pure function of a model config and a memory
picture. All sizes are per GPU (per tensor-parallel rank) and in bytes:

    budget     = floor(gpu_memory * gpu_memory_utilization)
                 - weights / tp - activations - other overhead
    num_blocks = floor(budget / pool_block_bytes)

``pool_block_bytes`` is one block of the shared pool (``layers_per_block``
layer pages, see :mod:`kvpool.specs`). A request of ``L`` tokens holds, in
every group, the blocks that group's layer kind keeps at its peak (all
``cdiv(L, block_size)`` for full attention, the window's blocks for sliding
windows, two blocks for a Mamba state: the one a step reads and the one it
writes), as ``LayerSpec.blocks_per_request`` counts them for the scheduler's
admission too; summing over the groups gives ``blocks_per_request`` and::

    max_concurrency = num_blocks / blocks_per_request
    kv_cache_tokens = floor(max_concurrency * L)

which is the "KV cache size ... maximum concurrency" figure serving engines
print. Terms the caller does not give are estimated by :mod:`kvpool.estimates`
and marked as estimates in the result.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from decimal import Decimal
from enum import Enum
from fractions import Fraction
from typing import Any

from kvpool.checks import GB, MIN_MODEL_LEN, GiB, check_int, parse_size
from kvpool.errors import ConfigError
from kvpool.estimates import (
    ACTIVATION_BATCH_TOKENS,
    ACTIVATION_NUM_SEQS,
    MemoryTerm,
    ParameterEstimate,
    TermSource,
    estimate_activation_bytes,
    estimate_parameters,
    estimate_weight_bytes,
)
from kvpool.model_config import checkpoint_dtype, max_position_embeddings, model_dtype, text_config_view
from kvpool.model_layers import cache_layer_indices, layer_kinds, layer_specs_from_config
from kvpool.recurrent_state import state_size
from kvpool.specs import (
    KVCacheGroup,
    KVDtype,
    LayerKind,
    LayerSpec,
    MambaSpec,
    cdiv,
    group_layers,
    layers_per_pool_block,
    pool_block_bytes,
)

__all__ = [
    "ACTIVATION_BATCH_TOKENS",
    "ACTIVATION_NUM_SEQS",
    "GB",
    "GiB",
    "OTHER_OVERHEAD_BYTES",
    "GroupPlan",
    "KVPlan",
    "MemoryBudget",
    "MemoryTerm",
    "ParameterEstimate",
    "TermSource",
    "estimate_activation_bytes",
    "estimate_parameters",
    "estimate_weight_bytes",
    "longest_fitting_request",
    "parse_size",
    "plan_kv_cache",
]

#: The estimate of memory outside weights, activations and KV cache.
OTHER_OVERHEAD_BYTES = GiB


@dataclass(frozen=True, kw_only=True, slots=True)
class MemoryBudget:
    """``usable - weights - activations - other = kv_budget``, all per GPU, in bytes.

    ``usable_bytes`` is ``floor(gpu_memory_bytes * gpu_memory_utilization)``
    computed exactly from the utilization's decimal value.
    """

    gpu_memory_bytes: int
    gpu_memory_utilization: float
    usable_bytes: int
    weights: MemoryTerm
    activations: MemoryTerm
    other: MemoryTerm
    kv_budget_bytes: int


@dataclass(frozen=True, kw_only=True, slots=True)
class GroupPlan:
    """One KV cache group as planned.

    ``layer_ids`` index the cache-holding layers (as in
    :class:`kvpool.specs.KVCacheGroup`); ``decoder_layers`` are the same
    layers' indices among all decoder layers. ``page_bytes`` is one layer's
    bytes per block, ``block_bytes`` the group's (``len(layer_ids) *
    page_bytes``), and ``blocks_per_request`` what one ``max_model_len``-token
    request holds in this group.
    """

    index: int
    kind: LayerKind
    spec: LayerSpec
    layer_ids: tuple[int, ...]
    decoder_layers: tuple[int, ...]
    block_size: int
    page_bytes: int
    block_bytes: int
    blocks_per_request: int


@dataclass(frozen=True, kw_only=True, slots=True)
class KVPlan:
    """The result of :func:`plan_kv_cache` (see the module docstring for the formulas).

    ``block_size`` is the tokens per block of the attention groups after any
    raise for Mamba states (``requested_block_size`` is what was asked).
    ``pool_tokens`` is ``num_blocks * block_size``; ``kv_cache_tokens`` the
    engine-style capacity ``floor(num_blocks * max_model_len /
    blocks_per_request)``. When one ``max_model_len`` request does not fit,
    ``max_fitting_model_len`` is the longest request that does (otherwise it
    equals ``max_model_len``).
    """

    model: str
    tp_size: int
    model_dtype: KVDtype
    kv_dtype: KVDtype
    requested_block_size: int
    block_size: int
    max_model_len: int
    groups: tuple[GroupPlan, ...]
    layers_per_block: int
    pool_block_bytes: int
    budget: MemoryBudget
    num_blocks: int
    pool_tokens: int
    blocks_per_request: int
    max_concurrency: float
    kv_cache_tokens: int
    fits_max_model_len: bool
    max_fitting_model_len: int
    notes: tuple[str, ...]

    @property
    def capacity_line(self) -> str:
        """The serving-engine style summary line."""
        return (
            f"KV cache size: {self.kv_cache_tokens:,} tokens; maximum concurrency for "
            f"{self.max_model_len:,} tokens per request: {self.max_concurrency:.2f}x"
        )

    def to_dict(self) -> dict[str, Any]:
        """The whole plan as JSON-ready data (enums as their values, specs with their kind), plus the capacity line."""
        data: dict[str, Any] = _jsonable(self)
        data["capacity_line"] = self.capacity_line
        return data


def _jsonable(value: Any) -> Any:
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, (tuple, list)):
        return [_jsonable(v) for v in value]
    if hasattr(value, "__dataclass_fields__"):
        out = {f.name: _jsonable(getattr(value, f.name)) for f in fields(value)}
        if hasattr(type(value), "kind") and "kind" not in out:
            out = {"kind": value.kind.value, **out, "page_bytes": value.page_bytes}
        return out
    return value


def _utilization(value: object) -> Fraction:
    """The utilization as an exact fraction of its decimal spelling (0.9 is 9/10), checked to be in (0, 1]."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str, Decimal, Fraction)):
        raise ConfigError(f"gpu_memory_utilization must be a number in (0, 1], got {value!r}")
    try:
        fraction = value if isinstance(value, Fraction) else Fraction(str(value))
    except (ValueError, ZeroDivisionError):  # nan, inf, or not a number
        raise ConfigError(f"gpu_memory_utilization must be in (0, 1], got {value!r}") from None
    if not 0 < fraction <= 1:
        raise ConfigError(f"gpu_memory_utilization must be in (0, 1], got {value}")
    return fraction


def _given(name: str, value: int | str, basis: str) -> MemoryTerm:
    return MemoryTerm(bytes=parse_size(value, field=name), source=TermSource.GIVEN, basis=basis)


def _blocks_per_request(groups: Sequence[KVCacheGroup], num_tokens: int) -> int:
    return sum(g.spec.blocks_per_request(num_tokens) for g in groups)


def longest_fitting_request(groups: Sequence[KVCacheGroup], num_blocks: int, upper: int) -> int:
    """The longest request, at most ``upper`` tokens, whose blocks over all groups fit in ``num_blocks``; 0 if none.

    A binary search (the need grows with the length): O(groups * log upper).
    """
    lo, hi = 0, upper
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if _blocks_per_request(groups, mid) <= num_blocks:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _model_name(config: dict[str, Any]) -> str:
    arch = config.get("architectures")
    if isinstance(arch, list) and arch:
        return str(arch[0])
    return str(config.get("model_type", "model"))


def plan_kv_cache(
    config: dict[str, Any],
    *,
    gpu_memory_bytes: int | str,
    gpu_memory_utilization: float = 0.9,
    weights_bytes: int | str | None = None,
    activation_bytes: int | str | None = None,
    other_overhead_bytes: int | str | None = None,
    tp_size: int = 1,
    kv_dtype: KVDtype | str | None = None,
    block_size: int = 16,
    max_model_len: int | None = None,
    name: str | None = None,
) -> KVPlan:
    """Plan the KV cache of one GPU (one tensor-parallel rank) for the model described by ``config``.

    ``gpu_memory_bytes`` is one GPU's memory; ``weights_bytes`` the whole
    model's weights (split evenly over ``tp_size`` GPUs); ``activation_bytes``
    and ``other_overhead_bytes`` are per GPU. Sizes may be integers (bytes) or
    strings for :func:`parse_size`. A None term is estimated (see the module
    docstring). ``kv_dtype`` None or ``"auto"`` means the model dtype;
    ``max_model_len`` None means the config's ``max_position_embeddings``.

    Raises :class:`ConfigError`, naming the field, for invalid arguments or
    config fields, and when the terms leave no room for even one request.
    """
    total = parse_size(gpu_memory_bytes, field="gpu_memory_bytes")
    if total <= 0:
        raise ConfigError(f"gpu_memory_bytes must be positive, got {total}")
    utilization = _utilization(gpu_memory_utilization)
    tp_size = check_int("tp_size", tp_size)
    block_size = check_int("block_size", block_size)
    cfg = text_config_view(config)
    if max_model_len is None:
        max_model_len = max_position_embeddings(cfg)
    max_model_len = check_int("max_model_len", max_model_len, minimum=MIN_MODEL_LEN)
    dtype = model_dtype(cfg)
    if isinstance(kv_dtype, KVDtype):
        cache_dtype = kv_dtype
    else:
        cache_dtype = KVDtype.parse("auto" if kv_dtype is None else kv_dtype, auto=dtype, field="kv_cache_dtype")

    specs = layer_specs_from_config(cfg, block_size=block_size, kv_dtype=cache_dtype, tp_size=tp_size)
    groups = group_layers(specs)
    decoder_index = cache_layer_indices(cfg)
    page = pool_block_bytes(groups)
    attention_sizes = [g.block_size for g in groups if g.kind is not LayerKind.MAMBA]
    effective_block_size = min(attention_sizes) if attention_sizes else block_size

    if weights_bytes is None:
        weights = estimate_weight_bytes(cfg, tp_size=tp_size)
    else:
        whole = parse_size(weights_bytes, field="weights_bytes")
        weights = MemoryTerm(
            bytes=cdiv(whole, tp_size),
            source=TermSource.GIVEN,
            basis="given" + (f", {whole:,} B / tp {tp_size}" if tp_size > 1 else ""),
        )
    if activation_bytes is None:
        activations = estimate_activation_bytes(cfg, tp_size=tp_size)
    else:
        activations = _given("activation_bytes", activation_bytes, "given")
    if other_overhead_bytes is None:
        other = MemoryTerm(bytes=OTHER_OVERHEAD_BYTES, source=TermSource.ESTIMATED, basis="1 GiB allowance")
    else:
        other = _given("other_overhead_bytes", other_overhead_bytes, "given")

    usable = int(total * utilization)
    kv_budget = usable - weights.bytes - activations.bytes - other.bytes
    if kv_budget <= 0:
        terms = {"weights": weights, "activations": activations, "other overhead": other}
        largest = max(terms, key=lambda k: terms[k].bytes)
        kind = "estimated" if terms[largest].estimated else "given"
        raise ConfigError(
            f"no memory left for the KV cache: {largest} ({kind}, {terms[largest].bytes:,} B per GPU) "
            f"leave nothing of the usable {usable:,} B (gpu_memory_bytes x gpu_memory_utilization): "
            f"{usable:,} - weights {weights.bytes:,} - activations {activations.bytes:,} "
            f"- other {other.bytes:,} = {kv_budget:,} B"
        )
    num_blocks = kv_budget // page
    if num_blocks == 0:
        raise ConfigError(f"KV cache budget of {kv_budget:,} B is smaller than one pool block ({page:,} B)")
    needed = _blocks_per_request(groups, max_model_len)
    fits = needed <= num_blocks
    if fits:
        longest = max_model_len
    elif _blocks_per_request(groups, 1) > num_blocks:
        raise ConfigError(
            f"the KV cache holds {num_blocks:,} blocks but even a 1-token request needs "
            f"{_blocks_per_request(groups, 1):,} (one per group)"
        )
    else:
        longest = longest_fitting_request(groups, num_blocks, max_model_len)

    group_plans = tuple(
        GroupPlan(
            index=i,
            kind=g.kind,
            spec=g.spec,
            layer_ids=g.layer_ids,
            decoder_layers=tuple(decoder_index[j] for j in g.layer_ids),
            block_size=g.block_size,
            page_bytes=g.page_bytes,
            block_bytes=g.block_bytes,
            blocks_per_request=g.spec.blocks_per_request(max_model_len),
        )
        for i, g in enumerate(groups)
    )
    budget = MemoryBudget(
        gpu_memory_bytes=total,
        gpu_memory_utilization=float(utilization),
        usable_bytes=usable,
        weights=weights,
        activations=activations,
        other=other,
        kv_budget_bytes=kv_budget,
    )
    notes = _notes(cfg, groups, specs, block_size, effective_block_size, tp_size, max_model_len, longest, fits)
    return KVPlan(
        model=name or _model_name(config),
        tp_size=tp_size,
        model_dtype=dtype,
        kv_dtype=cache_dtype,
        requested_block_size=block_size,
        block_size=effective_block_size,
        max_model_len=max_model_len,
        groups=group_plans,
        layers_per_block=layers_per_pool_block(groups),
        pool_block_bytes=page,
        budget=budget,
        num_blocks=num_blocks,
        pool_tokens=num_blocks * effective_block_size,
        blocks_per_request=needed,
        max_concurrency=num_blocks / needed,
        kv_cache_tokens=num_blocks * max_model_len // needed,
        fits_max_model_len=fits,
        max_fitting_model_len=longest,
        notes=notes,
    )


def _notes(
    cfg: dict[str, Any],
    groups: tuple[KVCacheGroup, ...],
    specs: list[LayerSpec],
    requested: int,
    effective: int,
    tp_size: int,
    max_model_len: int,
    longest: int,
    fits: bool,
) -> tuple[str, ...]:
    notes: list[str] = []
    if checkpoint_dtype(cfg) is KVDtype.FP32:
        notes.append("the checkpoint is float32; it is served (and estimated) in bf16")
    states = [s for s in specs if isinstance(s, MambaSpec)]
    if states:
        size = state_size(cfg, tp_size=tp_size)
        state = max(s.state_bytes for s in states)
        page = groups[0].page_bytes
        notes.append(
            f"each {size.family.value} layer keeps a {state:,} B state per request "
            f"({size.conv_elements:,} conv x {size.conv_dtype.itemsize} B + "
            f"{size.ssm_elements:,} SSM x {size.ssm_dtype.itemsize} B)"
            + ("" if size.sharded or tp_size == 1 else ", replicated on every tp rank")
        )
        if effective != requested:
            notes.append(
                f"attention block size raised from {requested} to {effective} tokens so that one "
                f"page ({page:,} B) holds the state; states are padded by {page - state:,} B"
            )
    elif effective != requested:
        notes.append(f"attention block size raised from {requested} to {effective} tokens to equalize pages")
    kinds = layer_kinds(cfg)
    no_cache = sum(1 for k in kinds if k is None)
    if no_cache:
        notes.append(f"{no_cache} of {len(kinds)} decoder layers keep no cache (MLP-only layers)")
    width = layers_per_pool_block(groups)
    padded = [g for g in groups if g.num_layers < width]
    if padded:
        notes.append(f"{len(padded)} group(s) have fewer than {width} layers; their unused page slots are padding")
    heads = cfg.get("num_key_value_heads") or cfg.get("num_attention_heads")
    per_head_kinds = (LayerKind.FULL_ATTENTION, LayerKind.SLIDING_WINDOW, LayerKind.CHUNKED_LOCAL)
    if isinstance(heads, int) and tp_size > heads and any(g.kind in per_head_kinds for g in groups):
        notes.append(f"tp {tp_size} exceeds the {heads} KV heads: each rank holds one replicated head")
    if any(g.kind is LayerKind.MLA for g in groups) and tp_size > 1:
        notes.append("the MLA latent is replicated on every tp rank")
    if not fits:
        notes.append(f"one {max_model_len:,}-token request does not fit; the longest that does is {longest:,} tokens")
    return tuple(notes)
