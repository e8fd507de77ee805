"""Read a Hugging Face ``config.json`` (plain JSON, no transformers) into per-layer KV cache specs.

What is read, and how
---------------------
* Layers: ``num_hidden_layers`` (or the length of a per-layer type list).
* KV heads: ``num_key_value_heads``. Only when that field is absent (or null)
  is ``num_attention_heads`` used: Hugging Face defines a missing
  ``num_key_value_heads`` as plain multi-head attention.
* Head size: ``head_dim``, else ``hidden_size / num_attention_heads`` (which
  must divide evenly).
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
  7. Sliding windows: ``use_sliding_window: false`` (Qwen) or a null
     ``sliding_window`` means all full attention; with ``max_window_layers``
     (Qwen) layers from that index on slide; Gemma 2 alternates (even layers
     slide); ``sliding_window_pattern`` ``p`` (Gemma 3, default 6) makes every
     ``p``-th layer global; otherwise every layer slides (Mistral).

* MLA: a non-null ``kv_lora_rank`` turns attention layers into MLA layers with
  ``kv_lora_rank`` and ``qk_rope_head_dim``.
* Multimodal wrappers: the fields of ``text_config`` are read, on top of the
  outer ``torch_dtype`` / ``dtype`` / ``quantization_config``.
* Hugging Face leaves out fields equal to its config classes' defaults; for the
  model types whose published files rely on that, the defaults are filled in
  from :data:`MODEL_TYPE_DEFAULTS`.
* Every field read is checked once, in :func:`text_config_view`, against its
  rule in ``_FIELD_RULES``: sizes are positive integers up to
  :data:`MAX_FIELD_VALUE` (an integral float such as ``4096.0`` counts as an
  integer), layer counts and per-layer lists stop at :data:`MAX_LAYERS`, so a
  hostile file is refused before any work proportional to it. A ``null`` field
  counts as absent. Anything else raises :class:`ConfigError` naming the field
  and the value.

Recurrent state sizes (elements per layer per request)
------------------------------------------------------
* Mamba-1 (Jamba; ``d_inner = mamba_expand * hidden_size``):
  conv ``d_inner * (d_conv - 1)``, SSM ``d_inner * d_state``.
* Mamba-2 (Nemotron-H, Granite 4.0-H; ``H`` heads of ``P`` dims, ``G`` groups,
  state ``N``, ``d_inner = H * P``): conv ``(d_inner + 2 * G * N) * (d_conv - 1)``,
  SSM ``H * P * N``.
* Gated delta net (Qwen3-Next; ``Hk`` key heads of ``Dk``, ``Hv`` value heads
  of ``Dv``, kernel ``K``): conv ``(2 * Hk * Dk + Hv * Dv) * (K - 1)``,
  recurrent state ``Hv * Dv * Dk``.

The conv state is stored in the model dtype; the SSM/recurrent state in
``mamba_ssm_cache_dtype`` when the config sets it (Nemotron-H's default is
float32), else in the model dtype. A KV cache dtype such as fp8 does not apply
to states. With tensor parallelism the state is split across ranks when its
heads divide evenly (Mamba-2 groups are split, or one group kept per rank when
there are fewer groups than ranks); otherwise each rank holds the whole state.

The model dtype is ``torch_dtype`` (or ``dtype``), except that a float32
checkpoint is served in bf16, as serving engines do by default.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from types import MappingProxyType
from typing import Any

from kvpool.errors import ConfigError
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
    "MAX_FIELD_VALUE",
    "MAX_LAYERS",
    "MODEL_TYPE_DEFAULTS",
    "SHIPPED_CONFIG_DIR",
    "DecoderLayer",
    "MlpKind",
    "StateDims",
    "StateFamily",
    "StateSize",
    "cache_layer_indices",
    "checkpoint_dtype",
    "decoder_layers",
    "head_dim",
    "kv_heads_per_rank",
    "layer_kinds",
    "layer_specs_from_config",
    "load_model_config",
    "max_position_embeddings",
    "model_dtype",
    "num_kv_heads",
    "shipped_config_names",
    "state_dims",
    "state_size",
    "text_config_view",
]

#: Folder of the config.json files that ship with kvpool (``<name>.json``).
SHIPPED_CONFIG_DIR = Path(__file__).resolve().parent / "configs"

#: Hugging Face config-class defaults that published files leave out, by ``model_type``.
MODEL_TYPE_DEFAULTS: MappingProxyType[str, MappingProxyType[str, Any]] = MappingProxyType(
    {
        "gemma3_text": MappingProxyType(
            {
                "head_dim": 256,
                "max_position_embeddings": 131072,
                "sliding_window": 4096,
                "sliding_window_pattern": 6,
                "tie_word_embeddings": True,
                "vocab_size": 262208,
            }
        ),
        "gemma2": MappingProxyType({"head_dim": 256, "tie_word_embeddings": True}),
        "nemotron_h": MappingProxyType({"head_dim": 128, "mamba_ssm_cache_dtype": "float32"}),
    }
)

_OUTER_FIELDS = ("torch_dtype", "dtype", "quantization_config", "tie_word_embeddings", "architectures")

#: Most decoder layers a config may describe (and longest per-layer list or string field).
MAX_LAYERS = 4096
#: Largest value of a size field (heads, widths, vocabulary, context, windows, experts).
MAX_FIELD_VALUE = 2**32


class _Rule(Enum):
    """What a config field may hold (the value is what error messages say it must be)."""

    COUNT = "a positive integer"
    INDEX = "an integer >= 0"
    LAYERS = "a positive number of layers"
    TEXT = "a string"
    FLAG = "true or false"
    OBJECT = "a JSON object"
    NAMES = "a list of strings"
    INDICES = "a list of integers >= 0"


def _rules(rule: _Rule, names: str) -> dict[str, _Rule]:
    return dict.fromkeys(names.split(), rule)


#: The rule of every field this module, the estimates and the planner read.
_FIELD_RULES: dict[str, _Rule] = {
    **_rules(
        _Rule.COUNT,
        "hidden_size vocab_size intermediate_size max_position_embeddings num_attention_heads "
        "num_key_value_heads head_dim sliding_window sliding_window_pattern attention_chunk_size "
        "no_rope_layer_interval attn_layer_period full_attention_interval expert_layer_period "
        "moe_layer_freq decoder_sparse_step kv_lora_rank qk_rope_head_dim qk_nope_head_dim v_head_dim "
        "moe_intermediate_size num_experts_per_tok shared_expert_intermediate_size "
        "shared_intermediate_size moe_shared_expert_intermediate_size linear_num_value_heads "
        "linear_value_head_dim linear_key_head_dim linear_num_key_heads linear_conv_kernel_dim "
        "mamba_num_heads mamba_n_heads num_heads mamba_head_dim mamba_d_head mamba_expand expand "
        "ssm_state_size mamba_d_state state_size n_groups mamba_n_groups conv_kernel mamba_d_conv "
        "mamba_dt_rank time_step_rank",
    ),
    **_rules(
        _Rule.INDEX,
        "max_window_layers attn_layer_offset expert_layer_offset first_k_dense_replace "
        "n_shared_experts q_lora_rank n_routed_experts num_local_experts num_experts",
    ),
    "num_hidden_layers": _Rule.LAYERS,
    **_rules(
        _Rule.TEXT,
        "model_type torch_dtype dtype mamba_ssm_cache_dtype hidden_act mlp_hidden_act hybrid_override_pattern",
    ),
    **_rules(_Rule.FLAG, "use_sliding_window tie_word_embeddings"),
    **_rules(_Rule.OBJECT, "text_config quantization_config"),
    **_rules(_Rule.NAMES, "architectures layer_types layers_block_type"),
    **_rules(_Rule.INDICES, "no_rope_layers mlp_only_layers"),
}
#: The fields read inside ``quantization_config``.
_QUANT_RULES: dict[str, _Rule] = {"quant_method": _Rule.TEXT, "bits": _Rule.COUNT}
#: Fields whose published files may say "auto" (the size is then derived).
_AUTO_FIELDS = frozenset({"mamba_head_dim", "mamba_d_head", "mamba_dt_rank", "time_step_rank"})
_SHAPES: dict[_Rule, Callable[[Any], bool]] = {
    _Rule.TEXT: lambda v: isinstance(v, str),
    _Rule.FLAG: lambda v: isinstance(v, bool),
    _Rule.OBJECT: lambda v: isinstance(v, dict),
    _Rule.NAMES: lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
    _Rule.INDICES: lambda v: isinstance(v, list)
    and all(type(x) is int and 0 <= x <= MAX_FIELD_VALUE for x in v),
}


def _checked(field: str, value: Any, rule: _Rule) -> Any:
    """``value`` if it obeys ``rule`` (an integral float comes back as an int); ConfigError naming both otherwise."""
    if rule in (_Rule.COUNT, _Rule.INDEX, _Rule.LAYERS):
        if field in _AUTO_FIELDS and value == "auto":
            return value
        number = int(value) if isinstance(value, float) and value.is_integer() else value
        low = 0 if rule is _Rule.INDEX else 1
        if isinstance(number, bool) or not isinstance(number, int) or number < low:
            raise ConfigError(f"config.json field {field!r} must be {rule.value}, got {_short(value)}")
        high = MAX_LAYERS if rule is _Rule.LAYERS else MAX_FIELD_VALUE
        if number > high:
            raise ConfigError(f"config.json field {field!r} must be at most {high:,}, got {_short(value)}")
        return number
    if not _SHAPES[rule](value):
        raise ConfigError(f"config.json field {field!r} must be {rule.value}, got {_short(value)}")
    if rule in (_Rule.TEXT, _Rule.NAMES, _Rule.INDICES) and len(value) > MAX_LAYERS:
        raise ConfigError(f"config.json field {field!r} has {len(value):,} entries; at most {MAX_LAYERS:,} are allowed")
    if field == "quantization_config":
        return _checked_fields(value, _QUANT_RULES, prefix=f"{field}.")
    return value


def _short(value: Any) -> str:
    """The value as a message shows it: its repr, cut to 80 characters."""
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:77]}..."


def _checked_fields(fields: dict[str, Any], rules: dict[str, _Rule], *, prefix: str = "") -> dict[str, Any]:
    """A copy of ``fields`` with every field that has a rule checked (null fields count as absent)."""
    out = dict(fields)
    for name, value in fields.items():
        rule = rules.get(name) if isinstance(name, str) else None
        if rule is not None and value is not None:
            out[name] = _checked(prefix + name, value, rule)
    return out


def shipped_config_names() -> tuple[str, ...]:
    """Names of the shipped configs, sorted (``"llama-3.1-8b"``, ...)."""
    return tuple(sorted(p.stem for p in SHIPPED_CONFIG_DIR.glob("*.json")))


def load_model_config(name_or_path: str | os.PathLike[str]) -> dict[str, Any]:
    """Load a config: a shipped name, a path to a config.json, or a folder holding one.

    Returns the parsed JSON object. Raises :class:`ConfigError` for an unknown
    name (listing the shipped ones), unreadable or malformed JSON, JSON that is
    not an object, or a field that breaks its rule (see :func:`text_config_view`).
    """
    text = os.fspath(name_or_path)
    shipped = SHIPPED_CONFIG_DIR / f"{text}.json"
    if "/" not in text and os.sep not in text and shipped.is_file():
        path = shipped
    else:
        path = Path(text)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            names = ", ".join(shipped_config_names())
            raise ConfigError(
                f"unknown model config {text!r}: not a shipped name ({names}) "
                f"and no such config.json file or folder"
            )
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:  # ValueError: bad UTF-8 or JSON, or a number too long to read
        raise ConfigError(f"cannot read model config {str(path)!r}: {exc}") from None
    except RecursionError:
        raise ConfigError(f"cannot read model config {str(path)!r}: JSON nested too deeply") from None
    if not isinstance(config, dict):
        raise ConfigError(f"model config {str(path)!r} must hold a JSON object, got {type(config).__name__}")
    text_config_view(config)  # every field it reads obeys its rule
    return config


def text_config_view(config: dict[str, Any]) -> dict[str, Any]:
    """The language model's fields as one flat dict (a new dict; the input is not changed).

    For multimodal wrappers the ``text_config`` fields win over the outer dtype,
    quantization and tying fields; known model-type defaults fill the gaps.
    Every field with a rule is checked here (see the module docstring), so the
    readers trust the view. O(fields) time.
    """
    if not isinstance(config, dict):
        raise ConfigError(f"model config must be a dict, got {type(config).__name__}")
    inner = config.get("text_config")
    if inner is not None:
        inner = _checked("text_config", inner, _Rule.OBJECT)
        merged = {k: config[k] for k in _OUTER_FIELDS if k in config}
        merged.update(inner)
    else:
        merged = dict(config)
    for key, value in MODEL_TYPE_DEFAULTS.get(str(merged.get("model_type")), {}).items():
        if merged.get(key) is None:
            merged[key] = value
    return _checked_fields(merged, _FIELD_RULES)


def _missing(field: str) -> ConfigError:
    return ConfigError(f"config.json field {field!r} is missing")


def _pos_int(cfg: dict[str, Any], field: str, default: int | None = None) -> int:
    """A required (or defaulted) positive integer field of a :func:`text_config_view`."""
    value = cfg.get(field)
    if value is None:
        if default is None:
            raise _missing(field)
        return default
    value = _checked(field, value, _FIELD_RULES.get(field, _Rule.COUNT))
    if value == "auto":
        raise ConfigError(f"config.json field {field!r} must be {_Rule.COUNT.value} here, got 'auto'")
    return value


def _first_int(cfg: dict[str, Any], *fields: str) -> int:
    for field in fields:
        if cfg.get(field) is not None:
            return _pos_int(cfg, field)
    others = ", ".join(map(repr, fields[1:]))
    raise ConfigError(f"config.json field {fields[0]!r} is missing (also looked for {others})")


def _dtype_field(cfg: dict[str, Any], field: str) -> KVDtype:
    value = cfg[field]
    try:
        return KVDtype.parse(str(value))
    except ConfigError:
        raise ConfigError(f"config.json field {field!r} has an unsupported dtype {value!r}") from None


def checkpoint_dtype(config: dict[str, Any]) -> KVDtype:
    """The dtype the checkpoint declares (``torch_dtype``, or ``dtype`` in newer files)."""
    cfg = text_config_view(config)
    for field in ("torch_dtype", "dtype"):
        if cfg.get(field) is not None:
            return _dtype_field(cfg, field)
    raise ConfigError("config.json field 'torch_dtype' is missing (nor is there a 'dtype' field)")


def model_dtype(config: dict[str, Any]) -> KVDtype:
    """The dtype the model is served in: the checkpoint dtype, with float32 served as bf16."""
    dtype = checkpoint_dtype(config)
    return KVDtype.BF16 if dtype is KVDtype.FP32 else dtype


def max_position_embeddings(config: dict[str, Any]) -> int:
    """The longest context the model was configured for (``max_position_embeddings``)."""
    return _pos_int(text_config_view(config), "max_position_embeddings")


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
        return i % _pos_int(cfg, "expert_layer_period") == (cfg.get("expert_layer_offset") or 0)
    if cfg.get("moe_layer_freq"):
        return i % _pos_int(cfg, "moe_layer_freq") == 0
    if cfg.get("decoder_sparse_step"):
        return (i + 1) % _pos_int(cfg, "decoder_sparse_step") == 0
    return True


def _attention_kinds(cfg: dict[str, Any], n: int) -> list[LayerKind]:
    full, sliding = LayerKind.FULL_ATTENTION, LayerKind.SLIDING_WINDOW
    if cfg.get("attention_chunk_size") is not None:
        flags = cfg.get("no_rope_layers") or []
        if not flags:
            interval = _pos_int(cfg, "no_rope_layer_interval", 4)
            flags = [int((i + 1) % interval != 0) for i in range(n)]
        if len(flags) != n:
            raise ConfigError(f"config.json field 'no_rope_layers' has {len(flags)} entries, expected {n}")
        return [LayerKind.CHUNKED_LOCAL if flag else full for flag in flags]
    if cfg.get("use_sliding_window") is False or cfg.get("sliding_window") is None:
        return [full] * n
    if cfg.get("max_window_layers") is not None and "use_sliding_window" in cfg:
        start = cfg["max_window_layers"]
        return [sliding if i >= start else full for i in range(n)]
    if cfg.get("model_type") == "gemma2":
        return [sliding if i % 2 == 0 else full for i in range(n)]
    if cfg.get("sliding_window_pattern") is not None:
        pattern = _pos_int(cfg, "sliding_window_pattern")
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
        n = _pos_int(cfg, "num_hidden_layers")
        if cfg.get("attn_layer_period") is not None:
            period = _pos_int(cfg, "attn_layer_period")
            offset = cfg.get("attn_layer_offset") or 0
            if offset >= period:
                raise ConfigError(f"config.json field 'attn_layer_offset' must be in [0, {period}), got {offset!r}")
            kinds = [LayerKind.FULL_ATTENTION if i % period == offset else LayerKind.MAMBA for i in range(n)]
        elif cfg.get("full_attention_interval") is not None:
            interval = _pos_int(cfg, "full_attention_interval")
            kinds = [LayerKind.MAMBA if (i + 1) % interval else LayerKind.FULL_ATTENTION for i in range(n)]
        elif model_type in ("mamba", "mamba2", "falcon_mamba"):
            kinds = [LayerKind.MAMBA] * n
        else:
            kinds = list(_attention_kinds(cfg, n))
        mlps = [MlpKind.NONE] * n
    if cfg.get("num_hidden_layers") is not None and _pos_int(cfg, "num_hidden_layers") != len(kinds):
        raise ConfigError(
            f"config.json field 'num_hidden_layers' is {cfg['num_hidden_layers']} but the per-layer "
            f"types list {len(kinds)} layers"
        )
    if not kinds:
        raise _missing("num_hidden_layers")
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


def kv_heads_per_rank(num_kv_heads: int, tp_size: int) -> int:
    """KV heads each tensor-parallel rank caches.

    ``num_kv_heads / tp_size`` when it divides evenly; when ``tp_size`` is a
    multiple of the heads, each rank holds one (replicated) head. Any other
    pairing raises :class:`ConfigError` naming both numbers.
    """
    if num_kv_heads % tp_size == 0:
        return num_kv_heads // tp_size
    if tp_size % num_kv_heads == 0:
        return 1
    raise ConfigError(
        f"tensor parallel size {tp_size} does not divide num_key_value_heads {num_kv_heads} "
        f"(nor is it a multiple of it)"
    )


def head_dim(config: dict[str, Any]) -> int:
    """Attention head size: ``head_dim``, else ``hidden_size / num_attention_heads``."""
    cfg = text_config_view(config)
    if cfg.get("head_dim") is not None:
        return _pos_int(cfg, "head_dim")
    hidden = _pos_int(cfg, "hidden_size")
    heads = _pos_int(cfg, "num_attention_heads")
    if hidden % heads:
        raise ConfigError(
            f"config.json field 'head_dim' is missing and hidden_size {hidden} is not a multiple "
            f"of num_attention_heads {heads}"
        )
    return hidden // heads


def num_kv_heads(config: dict[str, Any]) -> int:
    """``num_key_value_heads``; when absent, ``num_attention_heads`` (Hugging Face's multi-head default)."""
    cfg = text_config_view(config)
    if cfg.get("num_key_value_heads") is not None:
        return _pos_int(cfg, "num_key_value_heads")
    if cfg.get("num_attention_heads") is None:
        raise ConfigError("config.json field 'num_key_value_heads' is missing (and so is 'num_attention_heads')")
    return _pos_int(cfg, "num_attention_heads")  # absent num_key_value_heads means multi-head attention


class StateFamily(Enum):
    """Which recurrent mixer a Mamba-style layer is."""

    MAMBA1 = "mamba1"
    MAMBA2 = "mamba2"
    GATED_DELTA_NET = "gated_delta_net"


@dataclass(frozen=True, kw_only=True, slots=True)
class StateSize:
    """One recurrent layer's per-request state on one tensor-parallel rank."""

    family: StateFamily
    conv_elements: int
    conv_dtype: KVDtype
    ssm_elements: int
    ssm_dtype: KVDtype
    sharded: bool  # True when split across tensor-parallel ranks

    @property
    def total_bytes(self) -> int:
        return self.conv_elements * self.conv_dtype.itemsize + self.ssm_elements * self.ssm_dtype.itemsize


@dataclass(frozen=True, kw_only=True, slots=True)
class StateDims:
    """Whole-model (unsharded) sizes of a recurrent mixer."""

    family: StateFamily
    heads: int  # Mamba-2 heads, or value heads of a gated delta net; d_inner for Mamba-1
    head_dim: int  # Mamba-2 head dim, value head dim (gated delta net); 1 for Mamba-1
    d_state: int  # SSM state size, or key head dim (gated delta net)
    groups: int  # Mamba-2 groups, or key heads (gated delta net); 0 for Mamba-1
    d_conv: int

    @property
    def d_inner(self) -> int:
        return self.heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the causal convolution."""
        if self.family is StateFamily.MAMBA1:
            return self.d_inner
        if self.family is StateFamily.MAMBA2:
            return self.d_inner + 2 * self.groups * self.d_state
        return 2 * self.groups * self.d_state + self.d_inner


def state_dims(config: dict[str, Any]) -> StateDims:
    """Whole-model sizes of the recurrent mixer (raises :class:`ConfigError` when the fields are missing)."""
    cfg = text_config_view(config)
    model_type = cfg.get("model_type")
    if cfg.get("linear_num_value_heads") is not None:
        return StateDims(
            family=StateFamily.GATED_DELTA_NET,
            heads=_pos_int(cfg, "linear_num_value_heads"),
            head_dim=_pos_int(cfg, "linear_value_head_dim"),
            d_state=_pos_int(cfg, "linear_key_head_dim"),
            groups=_pos_int(cfg, "linear_num_key_heads"),
            d_conv=_pos_int(cfg, "linear_conv_kernel_dim"),
        )
    heads_fields = ("mamba_num_heads", "mamba_n_heads") + (("num_heads",) if model_type == "mamba2" else ())
    if any(cfg.get(f) is not None for f in heads_fields):
        heads = _first_int(cfg, *heads_fields)
        head_fields = [f for f in ("mamba_head_dim", "mamba_d_head") if cfg.get(f) not in (None, "auto")]
        if model_type == "mamba2" and cfg.get("head_dim") is not None:
            head_fields.append("head_dim")
        if head_fields:
            head_dim = _pos_int(cfg, head_fields[0])
        else:  # "auto": the inner size split evenly over the heads
            d_inner = _first_int(cfg, "mamba_expand", "expand") * _pos_int(cfg, "hidden_size")
            if d_inner % heads:
                raise ConfigError(f"Mamba inner size {d_inner} is not a multiple of mamba heads {heads}")
            head_dim = d_inner // heads
        return StateDims(
            family=StateFamily.MAMBA2,
            heads=heads,
            head_dim=head_dim,
            d_state=_first_int(cfg, "ssm_state_size", "mamba_d_state", "state_size"),
            groups=_first_int(cfg, "n_groups", "mamba_n_groups"),
            d_conv=_first_int(cfg, "conv_kernel", "mamba_d_conv"),
        )
    if any(cfg.get(f) is not None for f in ("mamba_d_state", "state_size")):
        if model_type in ("mamba", "falcon_mamba"):
            d_inner = _pos_int(cfg, "intermediate_size")
        else:
            d_inner = _first_int(cfg, "mamba_expand", "expand") * _pos_int(cfg, "hidden_size")
        return StateDims(
            family=StateFamily.MAMBA1,
            heads=d_inner,
            head_dim=1,
            d_state=_first_int(cfg, "mamba_d_state", "state_size"),
            groups=0,
            d_conv=_first_int(cfg, "mamba_d_conv", "conv_kernel"),
        )
    raise ConfigError(
        "config.json has recurrent (Mamba / linear attention) layers but none of the fields that size "
        "their state: 'mamba_d_state', 'ssm_state_size', 'mamba_n_heads' or 'linear_num_value_heads'"
    )


def state_size(config: dict[str, Any], *, tp_size: int = 1) -> StateSize:
    """The recurrent state of one Mamba-style layer (formulas in the module docstring)."""
    cfg = text_config_view(config)
    tp_size = _check_int_arg("tp_size", tp_size)
    dims = state_dims(cfg)
    conv_dtype = model_dtype(cfg)
    ssm_dtype = conv_dtype
    if cfg.get("mamba_ssm_cache_dtype") not in (None, "auto"):
        ssm_dtype = _dtype_field(cfg, "mamba_ssm_cache_dtype")
    if dims.family is StateFamily.MAMBA1:
        split, groups = dims.d_inner % tp_size == 0, 0
    elif dims.family is StateFamily.GATED_DELTA_NET:
        split = dims.heads % tp_size == 0 and dims.groups % tp_size == 0
        groups = dims.groups // tp_size if split else dims.groups
    else:  # Mamba-2 keeps one whole group per rank when there are fewer groups than ranks
        split = dims.heads % tp_size == 0 and (dims.groups % tp_size == 0 or tp_size % dims.groups == 0)
        groups = max(dims.groups // tp_size, 1) if split else dims.groups
    inner = dims.heads // (tp_size if split else 1) * dims.head_dim
    return StateSize(
        family=dims.family,
        conv_elements=(inner + 2 * groups * dims.d_state) * (dims.d_conv - 1),
        conv_dtype=conv_dtype,
        ssm_elements=inner * dims.d_state,
        ssm_dtype=ssm_dtype,
        sharded=split and tp_size > 1,
    )


def _check_int_arg(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")
    return value


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
    block_size = _check_int_arg("block_size", block_size)
    tp_size = _check_int_arg("tp_size", tp_size)
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
        {"block_size": block_size, "dtype": dtype, "head_dim": head_dim(cfg),
         "num_kv_heads": kv_heads_per_rank(num_kv_heads(cfg), tp_size)}
        if kinds & {LayerKind.FULL_ATTENTION, LayerKind.SLIDING_WINDOW, LayerKind.CHUNKED_LOCAL}
        else {}
    )  # fmt: skip
    for layer in layers:
        if layer.kind is None:
            continue
        if layer.kind is LayerKind.FULL_ATTENTION:
            specs.append(FullAttentionSpec(**heads))
        elif layer.kind is LayerKind.SLIDING_WINDOW:
            specs.append(SlidingWindowSpec(**heads, sliding_window=_pos_int(cfg, "sliding_window")))
        elif layer.kind is LayerKind.CHUNKED_LOCAL:
            specs.append(ChunkedLocalAttentionSpec(**heads, attention_chunk_size=_pos_int(cfg, "attention_chunk_size")))
        elif layer.kind is LayerKind.MLA:
            specs.append(
                MLASpec(
                    block_size=block_size,
                    kv_lora_rank=_pos_int(cfg, "kv_lora_rank"),
                    qk_rope_head_dim=_pos_int(cfg, "qk_rope_head_dim"),
                    dtype=dtype,
                )
            )
        else:  # LayerKind.MAMBA
            specs.append(MambaSpec(state_bytes=state_size(cfg, tp_size=tp_size).total_bytes, block_size=block_size))
    return specs
