"""Read a Hugging Face ``config.json`` (plain JSON, no transformers): loading, field rules, dtype and head geometry.

:func:`load_model_config` reads a shipped name, a file or a folder;
:func:`text_config_view` flattens a config once into a :class:`TextConfig`,
the language model's fields with every field checked against its rule. Every
reader in kvpool (this module, :mod:`kvpool.model_layers`,
:mod:`kvpool.recurrent_state`, the estimates and the planner) takes that view
as it is, so a config is flattened and checked once per entry point; a raw
config handed to a reader is flattened on the way in.

What is read, and how
---------------------
* KV heads: ``num_key_value_heads``. Only when that field is absent (or null)
  is ``num_attention_heads`` used: Hugging Face defines a missing
  ``num_key_value_heads`` as plain multi-head attention.
* Head size: ``head_dim``, else ``hidden_size / num_attention_heads`` (which
  must divide evenly).
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

The model dtype is ``torch_dtype`` (or ``dtype``), except that a float32
checkpoint is served in bf16, as serving engines do by default
(:func:`serving_dtype` is that rule, :func:`model_dtype` applies it to a config).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from enum import Enum
from pathlib import Path
from types import MappingProxyType
from typing import Any, cast

from kvpool.errors import ConfigError
from kvpool.specs import KVDtype

__all__ = [
    "MAX_FIELD_VALUE",
    "MAX_LAYERS",
    "MODEL_TYPE_DEFAULTS",
    "SHIPPED_CONFIG_DIR",
    "TextConfig",
    "checkpoint_dtype",
    "dtype_field",
    "first_int_field",
    "head_dim",
    "int_field",
    "kv_heads_per_rank",
    "load_model_config",
    "max_position_embeddings",
    "missing_field",
    "model_dtype",
    "num_kv_heads",
    "serving_dtype",
    "shipped_config_names",
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
    _Rule.INDICES: lambda v: isinstance(v, list) and all(type(x) is int and 0 <= x <= MAX_FIELD_VALUE for x in v),
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
                f"unknown model config {text!r}: not a shipped name ({names}) and no such config.json file or folder"
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


class TextConfig(dict[str, Any]):
    """A config flattened and checked by :func:`text_config_view`; readers take it as it is."""

    __slots__ = ()


def text_config_view(config: dict[str, Any]) -> TextConfig:
    """The language model's fields as one flat, checked dict (a new one; the input is not changed).

    For multimodal wrappers the ``text_config`` fields win over the outer dtype,
    quantization and tying fields; known model-type defaults fill the gaps.
    Every field with a rule is checked here (see the module docstring), so the
    readers trust the view. O(fields) time; a :class:`TextConfig` comes back
    as it is, in O(1), so a reader handed a view does not flatten it again.
    """
    if isinstance(config, TextConfig):
        return config
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
    return TextConfig(_checked_fields(merged, _FIELD_RULES))


def missing_field(field: str) -> ConfigError:
    """The error for a required field that a config lacks."""
    return ConfigError(f"config.json field {field!r} is missing")


def int_field(cfg: dict[str, Any], field: str, default: int | None = None) -> int:
    """A required (or defaulted) positive integer field of a :func:`text_config_view`."""
    value = cfg.get(field)
    if value is None:
        if default is None:
            raise missing_field(field)
        return default
    value = _checked(field, value, _FIELD_RULES.get(field, _Rule.COUNT))
    if value == "auto":
        raise ConfigError(f"config.json field {field!r} must be {_Rule.COUNT.value} here, got 'auto'")
    return cast(int, value)  # a counting rule passed and 'auto' is refused: an int


def first_int_field(cfg: dict[str, Any], *fields: str) -> int:
    """The first of ``fields`` present in a :func:`text_config_view`, as by :func:`int_field`."""
    for field in fields:
        if cfg.get(field) is not None:
            return int_field(cfg, field)
    if len(fields) == 1:
        raise missing_field(fields[0])
    others = ", ".join(map(repr, fields[1:]))
    raise ConfigError(f"config.json field {fields[0]!r} is missing (also looked for {others})")


def dtype_field(cfg: dict[str, Any], field: str) -> KVDtype:
    """A dtype field of a :func:`text_config_view` (``"bfloat16"``, ...)."""
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
            return dtype_field(cfg, field)
    raise ConfigError("config.json field 'torch_dtype' is missing (nor is there a 'dtype' field)")


def serving_dtype(checkpoint: KVDtype) -> KVDtype:
    """The dtype a model stored in ``checkpoint`` is served in: float32 checkpoints are served in bf16."""
    return KVDtype.BF16 if checkpoint is KVDtype.FP32 else checkpoint


def model_dtype(config: dict[str, Any]) -> KVDtype:
    """The dtype the model is served in: :func:`serving_dtype` of the checkpoint dtype."""
    return serving_dtype(checkpoint_dtype(config))


def max_position_embeddings(config: dict[str, Any]) -> int:
    """The longest context the model was configured for (``max_position_embeddings``)."""
    return int_field(text_config_view(config), "max_position_embeddings")


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
        return int_field(cfg, "head_dim")
    hidden = int_field(cfg, "hidden_size")
    heads = int_field(cfg, "num_attention_heads")
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
        return int_field(cfg, "num_key_value_heads")
    if cfg.get("num_attention_heads") is None:
        raise ConfigError("config.json field 'num_key_value_heads' is missing (and so is 'num_attention_heads')")
    return int_field(cfg, "num_attention_heads")  # absent num_key_value_heads means multi-head attention
