"""The per-request state of a recurrent (Mamba-style) layer, sized from a model config.

Reads a :func:`kvpool.model_config.text_config_view` (a raw config is
flattened on the way in).

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
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

from kvpool.checks import check_int
from kvpool.errors import ConfigError
from kvpool.model_config import dtype_field, first_int_field, int_field, model_dtype, text_config_view
from kvpool.specs import KVDtype

__all__ = ["StateDims", "StateFamily", "StateSize", "state_dims", "state_size"]


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
            heads=int_field(cfg, "linear_num_value_heads"),
            head_dim=int_field(cfg, "linear_value_head_dim"),
            d_state=int_field(cfg, "linear_key_head_dim"),
            groups=int_field(cfg, "linear_num_key_heads"),
            d_conv=int_field(cfg, "linear_conv_kernel_dim"),
        )
    heads_fields = ("mamba_num_heads", "mamba_n_heads") + (("num_heads",) if model_type == "mamba2" else ())
    if any(cfg.get(f) is not None for f in heads_fields):
        heads = first_int_field(cfg, *heads_fields)
        head_fields = [f for f in ("mamba_head_dim", "mamba_d_head") if cfg.get(f) not in (None, "auto")]
        if model_type == "mamba2" and cfg.get("head_dim") is not None:
            head_fields.append("head_dim")
        if head_fields:
            head_dim = int_field(cfg, head_fields[0])
        else:  # "auto": the inner size split evenly over the heads
            d_inner = first_int_field(cfg, "mamba_expand", "expand") * int_field(cfg, "hidden_size")
            if d_inner % heads:
                raise ConfigError(f"Mamba inner size {d_inner} is not a multiple of mamba heads {heads}")
            head_dim = d_inner // heads
        return StateDims(
            family=StateFamily.MAMBA2,
            heads=heads,
            head_dim=head_dim,
            d_state=first_int_field(cfg, "ssm_state_size", "mamba_d_state", "state_size"),
            groups=first_int_field(cfg, "n_groups", "mamba_n_groups"),
            d_conv=first_int_field(cfg, "conv_kernel", "mamba_d_conv"),
        )
    if any(cfg.get(f) is not None for f in ("mamba_d_state", "state_size")):
        if model_type in ("mamba", "falcon_mamba"):
            d_inner = int_field(cfg, "intermediate_size")
        else:
            d_inner = first_int_field(cfg, "mamba_expand", "expand") * int_field(cfg, "hidden_size")
        return StateDims(
            family=StateFamily.MAMBA1,
            heads=d_inner,
            head_dim=1,
            d_state=first_int_field(cfg, "mamba_d_state", "state_size"),
            groups=0,
            d_conv=first_int_field(cfg, "mamba_d_conv", "conv_kernel"),
        )
    raise ConfigError(
        "config.json has recurrent (Mamba / linear attention) layers but none of the fields that size "
        "their state: 'mamba_d_state', 'ssm_state_size', 'mamba_n_heads' or 'linear_num_value_heads'"
    )


def state_size(config: dict[str, Any], *, tp_size: int = 1) -> StateSize:
    """The recurrent state of one Mamba-style layer (formulas in the module docstring)."""
    cfg = text_config_view(config)
    tp_size = check_int("tp_size", tp_size)
    dims = state_dims(cfg)
    conv_dtype = model_dtype(cfg)
    ssm_dtype = conv_dtype
    if cfg.get("mamba_ssm_cache_dtype") not in (None, "auto"):
        ssm_dtype = dtype_field(cfg, "mamba_ssm_cache_dtype")
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
