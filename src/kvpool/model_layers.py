"""What each decoder layer of a model is, and the KV cache spec of every layer that keeps one.

Reads a :func:`kvpool.model_config.text_config_view` (a raw config is
flattened on the way in).

* Layers: ``num_hidden_layers`` (or the length of a per-layer type list).
* Which layers are what (first rule that applies):

  1. ``layer_types`` (or ``layers_block_type``): ``full_attention`` /
     ``attention``, ``sliding_attention``, ``chunked_attention``,
     ``linear_attention`` / ``mamba`` (a fixed recurrent state), and ``mlp`` /
     ``moe`` for layers with no cache (Nemotron-H style).
  2. ``hybrid_override_pattern`` (Nemotron-H): ``M`` Mamba-2, ``*`` attention,
     ``-`` MLP and ``E`` mixture-of-experts (no cache).
  3. ``attn_layer_period`` / ``attn_layer_offset`` (Jamba): layer ``i`` is
     attention when ``i % period == offset``, Mamba otherwise.
  4. ``full_attention_interval`` (Qwen3-Next): layer ``i`` is full attention
     when ``(i + 1) % interval == 0``, gated delta net otherwise.
  5. ``model_type`` ``mamba`` / ``mamba2`` / ``falcon_mamba``: every layer is Mamba.
  6. ``attention_chunk_size`` (Llama 4): ``no_rope_layers[i] == 1`` marks a
     chunked-local layer, ``0`` a global one; an empty list means every
     ``no_rope_layer_interval``-th layer (default 4) is global.
  7. Sliding windows: ``model_type`` ``llama`` (whose layers never slide),
     ``use_sliding_window: false`` (Qwen) or a null ``sliding_window`` means
     all full attention; ``mistral`` slides on every layer, whatever
     ``layer_types`` says (its model class reads only ``sliding_window``); with ``max_window_layers``
     (Qwen) layers from that index on slide; Gemma 2 alternates (even layers
     slide); ``sliding_window_pattern`` ``p`` (Gemma 3, default 6) makes every
     ``p``-th layer global; otherwise every layer slides (Mistral).

* MLA: a non-null ``kv_lora_rank`` turns attention layers into MLA layers with
  ``kv_lora_rank`` and ``qk_rope_head_dim``.

:func:`layer_sliding_windows` is the per-layer window that follows from these
rules. The engine's runner computes attention with exactly these windows (it
has no rule of its own), so the layers kvpool frees blocks for and the layers
the model computes with a window are the same ones by construction.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any, TypedDict, cast

from kvpool.checks import check_int
from kvpool.errors import ConfigError
from kvpool.model_config import (
    head_dim,
    int_field,
    kv_heads_per_rank,
    missing_field,
    model_dtype,
    num_kv_heads,
    text_config_view,
)
from kvpool.recurrent_state import state_size
from kvpool.specs import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVDtype,
    LayerKind,
    LayerSpec,
    MambaSpec,
    MLASpec,
    SlidingWindowSpec,
)

__all__ = [
    "DecoderLayer",
    "MlpKind",
    "cache_layer_indices",
    "decoder_layers",
    "layer_kinds",
    "layer_sliding_windows",
    "layer_specs_from_config",
]


class MlpKind(Enum):
    """The feed-forward part of a decoder layer (for parameter estimates)."""

    NONE = "none"
    DENSE = "dense"
    MOE = "moe"


@dataclass(frozen=True, kw_only=True, slots=True)
class DecoderLayer:
    """One decoder layer: what it caches (None: nothing) and its feed-forward part."""

    kind: LayerKind | None
    mlp: MlpKind


_TYPE_NAMES: dict[str, LayerKind | None] = {
    "full_attention": LayerKind.FULL_ATTENTION,
    "attention": LayerKind.FULL_ATTENTION,
    "sliding_attention": LayerKind.SLIDING_WINDOW,
    "chunked_attention": LayerKind.CHUNKED_LOCAL,
    "linear_attention": LayerKind.MAMBA,
    "mamba": LayerKind.MAMBA,
    "mlp": None,
    "moe": None,
}
_PATTERN_CHARS: dict[str, tuple[LayerKind | None, MlpKind]] = {
    "M": (LayerKind.MAMBA, MlpKind.NONE),
    "*": (LayerKind.FULL_ATTENTION, MlpKind.NONE),
    "-": (None, MlpKind.DENSE),
    "E": (None, MlpKind.MOE),
}


#: Model classes that read only ``sliding_window``, never a per-layer type list.
_IGNORES_LAYER_TYPES = frozenset({"llama", "mistral"})


def _num_experts(cfg: dict[str, Any]) -> int:
    for field in ("n_routed_experts", "num_local_experts", "num_experts"):
        value = cfg.get(field)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return 0


def _is_moe_layer(cfg: dict[str, Any], i: int) -> bool:
    if not _num_experts(cfg) or i in (cfg.get("mlp_only_layers") or ()):
        return False
    if i < (cfg.get("first_k_dense_replace") or 0):
        return False
    if cfg.get("expert_layer_period"):
        return i % int_field(cfg, "expert_layer_period") == (cfg.get("expert_layer_offset") or 0)
    if cfg.get("moe_layer_freq"):
        return i % int_field(cfg, "moe_layer_freq") == 0
    if cfg.get("decoder_sparse_step"):
        return (i + 1) % int_field(cfg, "decoder_sparse_step") == 0
    return True


def _attention_kinds(cfg: dict[str, Any], n: int) -> list[LayerKind]:
    full, sliding = LayerKind.FULL_ATTENTION, LayerKind.SLIDING_WINDOW
    if cfg.get("attention_chunk_size") is not None:
        flags = cfg.get("no_rope_layers") or []
        if not flags:
            interval = int_field(cfg, "no_rope_layer_interval", 4)
            flags = [int((i + 1) % interval != 0) for i in range(n)]
        if len(flags) != n:
            raise ConfigError(f"config.json field 'no_rope_layers' has {len(flags)} entries, expected {n}")
        return [LayerKind.CHUNKED_LOCAL if flag else full for flag in flags]
    if cfg.get("model_type") == "llama":
        return [full] * n
    if cfg.get("use_sliding_window") is False or cfg.get("sliding_window") is None:
        return [full] * n
    if cfg.get("model_type") == "mistral":
        return [sliding] * n
    if cfg.get("max_window_layers") is not None and "use_sliding_window" in cfg:
        start = cfg["max_window_layers"]
        return [sliding if i >= start else full for i in range(n)]
    if cfg.get("model_type") == "gemma2":
        return [sliding if i % 2 == 0 else full for i in range(n)]
    if cfg.get("sliding_window_pattern") is not None:
        pattern = int_field(cfg, "sliding_window_pattern")
        return [sliding if (i + 1) % pattern else full for i in range(n)]
    return [sliding] * n


def _read_layers(cfg: dict[str, Any]) -> list[DecoderLayer]:
    types = cfg.get("layer_types") or cfg.get("layers_block_type")
    pattern = cfg.get("hybrid_override_pattern")
    model_type = cfg.get("model_type")
    kinds: list[LayerKind | None]
    separate_mlp = False
    if types is not None:
        kinds = []
        for i, name in enumerate(types):
            if name not in _TYPE_NAMES:
                raise ConfigError(f"config.json field 'layer_types' has unsupported entry {name!r} at layer {i}")
            kinds.append(_TYPE_NAMES[name])
        separate_mlp = any(name in ("mlp", "moe") for name in types)
        mlps = [(MlpKind.MOE if name == "moe" else MlpKind.DENSE if name == "mlp" else MlpKind.NONE) for name in types]
    elif pattern is not None:
        if any(ch not in _PATTERN_CHARS for ch in pattern):
            raise ConfigError(
                f"config.json field 'hybrid_override_pattern' must use only M, *, - and E, got {pattern!r}"
            )
        kinds = [_PATTERN_CHARS[ch][0] for ch in pattern]
        mlps = [_PATTERN_CHARS[ch][1] for ch in pattern]
        separate_mlp = True
    else:
        n = int_field(cfg, "num_hidden_layers")
        if cfg.get("attn_layer_period") is not None:
            period = int_field(cfg, "attn_layer_period")
            offset = cfg.get("attn_layer_offset") or 0
            if offset >= period:
                raise ConfigError(f"config.json field 'attn_layer_offset' must be in [0, {period}), got {offset!r}")
            kinds = [LayerKind.FULL_ATTENTION if i % period == offset else LayerKind.MAMBA for i in range(n)]
        elif cfg.get("full_attention_interval") is not None:
            interval = int_field(cfg, "full_attention_interval")
            kinds = [LayerKind.MAMBA if (i + 1) % interval else LayerKind.FULL_ATTENTION for i in range(n)]
        elif model_type in ("mamba", "mamba2", "falcon_mamba"):
            kinds = [LayerKind.MAMBA] * n
        else:
            kinds = list(_attention_kinds(cfg, n))
        mlps = [MlpKind.NONE] * n
    if model_type in _IGNORES_LAYER_TYPES and types is not None:
        kinds = list(_attention_kinds(cfg, len(kinds)))  # the list is checked above, but the model class never reads it
    if cfg.get("num_hidden_layers") is not None and int_field(cfg, "num_hidden_layers") != len(kinds):
        raise ConfigError(
            f"config.json field 'num_hidden_layers' is {cfg['num_hidden_layers']} but the per-layer "
            f"types list {len(kinds)} layers"
        )
    if not kinds:
        raise missing_field("num_hidden_layers")
    if not separate_mlp:
        no_mlp = model_type in ("mamba", "mamba2", "falcon_mamba")
        mlps = [
            MlpKind.NONE if no_mlp else MlpKind.MOE if _is_moe_layer(cfg, i) else MlpKind.DENSE
            for i in range(len(kinds))
        ]
    if cfg.get("kv_lora_rank") is not None:
        for i, kind in enumerate(kinds):
            if kind is LayerKind.FULL_ATTENTION:
                kinds[i] = LayerKind.MLA
            elif kind in (LayerKind.SLIDING_WINDOW, LayerKind.CHUNKED_LOCAL):
                raise ConfigError(f"layer {i}: MLA (kv_lora_rank) with {kind.value} attention is not supported")
    return [DecoderLayer(kind=k, mlp=m) for k, m in zip(kinds, mlps, strict=True)]


def decoder_layers(config: dict[str, Any]) -> tuple[DecoderLayer, ...]:
    """Every decoder layer in model order (rules in the module docstring)."""
    return tuple(_read_layers(text_config_view(config)))


def layer_kinds(config: dict[str, Any]) -> tuple[LayerKind | None, ...]:
    """What each decoder layer caches, in model order; None for a layer that keeps no cache."""
    return tuple(layer.kind for layer in decoder_layers(config))


def cache_layer_indices(config: dict[str, Any]) -> tuple[int, ...]:
    """Decoder-layer index of each entry of :func:`layer_specs_from_config`'s list."""
    return tuple(i for i, kind in enumerate(layer_kinds(config)) if kind is not None)


def layer_sliding_windows(config: dict[str, Any]) -> tuple[int | None, ...]:
    """Per decoder layer, the window ``W`` of a sliding-window layer (a query sees ``W`` positions), else None."""
    cfg = text_config_view(config)
    kinds = layer_kinds(cfg)
    window = int_field(cfg, "sliding_window") if LayerKind.SLIDING_WINDOW in kinds else None
    return tuple(window if kind is LayerKind.SLIDING_WINDOW else None for kind in kinds)


class _HeadFields(TypedDict):
    """The fields every attention spec with K/V heads shares."""

    block_size: int
    dtype: KVDtype
    head_dim: int
    num_kv_heads: int


def layer_specs_from_config(
    config: dict[str, Any],
    *,
    block_size: int = 16,
    kv_dtype: KVDtype | str | None = None,
    tp_size: int = 1,
) -> list[LayerSpec]:
    """One spec per cache-holding layer, in model order, sized for one tensor-parallel rank.

    ``kv_dtype`` None or ``"auto"`` means the model dtype; a string is parsed
    with :meth:`KVDtype.parse`. Layers that keep no cache (Nemotron-H's MLP
    layers) are skipped; :func:`cache_layer_indices` maps list positions back
    to decoder layers. Block sizes are as requested: sharing one pool may raise
    them (see :func:`kvpool.specs.group_layers`). Raises :class:`ConfigError`
    naming the field for a missing or invalid config field, or naming both
    numbers when ``tp_size`` does not fit the KV heads.
    """
    block_size = check_int("block_size", block_size)
    tp_size = check_int("tp_size", tp_size)
    cfg = text_config_view(config)
    layers = _read_layers(cfg)
    if isinstance(kv_dtype, KVDtype):
        dtype = kv_dtype
    else:
        dtype = KVDtype.parse("auto" if kv_dtype is None else kv_dtype, auto=model_dtype(cfg), field="kv_dtype")
    kinds = {layer.kind for layer in layers}
    specs: list[LayerSpec] = []
    if not kinds - {None}:
        raise ConfigError("the model config describes no layer that keeps a KV cache or state")
    heads = (
        _HeadFields(block_size=block_size, dtype=dtype, head_dim=head_dim(cfg),
                    num_kv_heads=kv_heads_per_rank(num_kv_heads(cfg), tp_size))
        if kinds & {LayerKind.FULL_ATTENTION, LayerKind.SLIDING_WINDOW, LayerKind.CHUNKED_LOCAL}
        else cast(_HeadFields, {})  # never unpacked: no layer of those kinds
    )  # fmt: skip
    for layer in layers:
        if layer.kind is None:
            continue
        if layer.kind is LayerKind.FULL_ATTENTION:
            specs.append(FullAttentionSpec(**heads))
        elif layer.kind is LayerKind.SLIDING_WINDOW:
            specs.append(SlidingWindowSpec(**heads, sliding_window=int_field(cfg, "sliding_window")))
        elif layer.kind is LayerKind.CHUNKED_LOCAL:
            specs.append(
                ChunkedLocalAttentionSpec(**heads, attention_chunk_size=int_field(cfg, "attention_chunk_size"))
            )
        elif layer.kind is LayerKind.MLA:
            specs.append(
                MLASpec(
                    block_size=block_size,
                    kv_lora_rank=int_field(cfg, "kv_lora_rank"),
                    qk_rope_head_dim=int_field(cfg, "qk_rope_head_dim"),
                    dtype=dtype,
                )
            )
        else:  # LayerKind.MAMBA
            specs.append(MambaSpec(state_bytes=state_size(cfg, tp_size=tp_size).total_bytes, block_size=block_size))
    return specs
