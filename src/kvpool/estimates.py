"""Estimates of the memory a model needs besides its KV cache, from its config.

Used by the planner for any term the caller does not give; every estimate says
how it was obtained (:class:`MemoryTerm.basis`).

* weights: the parameter count (:func:`estimate_parameters`) times the model
  dtype's bytes (fp8-quantized checkpoints: 1 byte per matrix weight; MXFP4
  experts: 4.25 bits), divided by the tensor-parallel size.
* activations: the peak of one profiling step of ``8192`` batched tokens and
  ``256`` sequences: ``8192 * (4 * hidden + 2 * mlp_width / tp) * dtype_bytes``
  for the hidden states and MLP intermediates, plus ``256 * vocab * 4`` bytes of
  float32 logits. ``mlp_width`` is the larger of ``intermediate_size`` and
  ``num_experts_per_tok * moe_intermediate_size``.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

from kvpool.model_config import first_int_field, head_dim, model_dtype, num_kv_heads, text_config_view
from kvpool.model_layers import MlpKind, decoder_layers
from kvpool.recurrent_state import StateFamily, state_dims
from kvpool.specs import LayerKind, cdiv

__all__ = [
    "ACTIVATION_BATCH_TOKENS",
    "ACTIVATION_NUM_SEQS",
    "MemoryTerm",
    "ParameterEstimate",
    "TermSource",
    "estimate_activation_bytes",
    "estimate_parameters",
    "estimate_weight_bytes",
]

#: Tokens in the profiling step the activation estimate assumes.
ACTIVATION_BATCH_TOKENS = 8192
#: Sequences whose logits the activation estimate assumes at once.
ACTIVATION_NUM_SEQS = 256


class TermSource(Enum):
    """Whether a memory term was given by the caller or estimated here."""

    GIVEN = "given"
    ESTIMATED = "estimated"


@dataclass(frozen=True, kw_only=True, slots=True)
class MemoryTerm:
    """One subtracted term of the budget, per GPU, with how it was obtained."""

    bytes: int
    source: TermSource
    basis: str  # one line saying how the figure was obtained

    @property
    def estimated(self) -> bool:
        return self.source is TermSource.ESTIMATED


@dataclass(frozen=True, kw_only=True, slots=True)
class ParameterEstimate:
    """Approximate parameter count of the language model, by part.

    Counts weight matrices, embeddings and norms; biases and vision or audio
    towers are left out. ``experts`` holds the routed and shared experts and
    the routers of mixture-of-experts layers.
    """

    embedding: int
    attention: int
    recurrent: int
    dense_mlp: int
    experts: int

    @property
    def total(self) -> int:
        return self.embedding + self.attention + self.recurrent + self.dense_mlp + self.experts


def _attention_params(cfg: dict[str, Any], kind: LayerKind) -> int:
    h, heads = first_int_field(cfg, "hidden_size"), first_int_field(cfg, "num_attention_heads")
    if kind is LayerKind.MLA:
        rope, nope = first_int_field(cfg, "qk_rope_head_dim"), first_int_field(cfg, "qk_nope_head_dim")
        v_dim, rank = first_int_field(cfg, "v_head_dim"), first_int_field(cfg, "kv_lora_rank")
        q_rank = cfg.get("q_lora_rank")
        q = h * heads * (nope + rope) if not q_rank else h * q_rank + q_rank * heads * (nope + rope)
        return q + h * (rank + rope) + rank * heads * (nope + v_dim) + heads * v_dim * h + 2 * h
    d = head_dim(cfg)
    return 2 * h * heads * d + 2 * h * num_kv_heads(cfg) * d + 2 * h  # q, o; k, v; two norms


def _recurrent_params(cfg: dict[str, Any]) -> int:
    h = first_int_field(cfg, "hidden_size")
    d = state_dims(cfg)
    conv = d.conv_dim * (d.d_conv + 1)  # weights and bias
    if d.family is StateFamily.GATED_DELTA_NET:  # in_proj (q, k, v, z, two gates), out_proj, A, dt, norm
        return h * (d.conv_dim + d.d_inner + 2 * d.heads) + conv + d.d_inner * h + 2 * d.heads + d.head_dim
    if d.family is StateFamily.MAMBA2:  # in_proj (z, x, B, C, dt), out_proj, A, D, dt bias, gated norm
        return h * (d.d_inner + d.conv_dim + d.heads) + conv + d.d_inner * h + 3 * d.heads + d.d_inner
    dt_rank = cfg.get("mamba_dt_rank") or cfg.get("time_step_rank")
    if isinstance(dt_rank, bool) or not isinstance(dt_rank, int):
        dt_rank = cdiv(h, 16)  # Mamba-1's "auto"
    # in_proj (x, z), x_proj (dt, B, C), dt_proj, A, D, out_proj
    return (
        2 * h * d.d_inner + conv + d.d_inner * (dt_rank + 2 * d.d_state) + (dt_rank + 1) * d.d_inner
        + d.d_inner * (d.d_state + 1) + d.d_inner * h
    )  # fmt: skip


def _mlp_params(cfg: dict[str, Any], mlp: MlpKind) -> tuple[int, int]:
    """(dense, experts) parameters of one layer's feed-forward part."""
    if mlp is MlpKind.NONE:
        return 0, 0
    h = first_int_field(cfg, "hidden_size")
    matrices = 2 if (cfg.get("mlp_hidden_act") or cfg.get("hidden_act")) == "relu2" else 3
    if mlp is MlpKind.DENSE:
        return matrices * h * first_int_field(cfg, "intermediate_size"), 0
    experts = first_int_field(cfg, "n_routed_experts", "num_local_experts", "num_experts")
    inner = first_int_field(cfg, "moe_intermediate_size", "intermediate_size")
    shared = (cfg.get("n_shared_experts") or 0) * inner
    for name in ("shared_expert_intermediate_size", "shared_intermediate_size", "moe_shared_expert_intermediate_size"):
        if not shared and cfg.get(name):
            shared = first_int_field(cfg, name)
    return 0, experts * matrices * h * inner + matrices * h * shared + h * experts + h


def estimate_parameters(config: dict[str, Any]) -> ParameterEstimate:
    """Estimate the language model's parameter count from its config (see :class:`ParameterEstimate`).

    Attention: q, k, v, o projections (MLA: its low-rank projections). Dense
    MLP: 3 matrices of ``hidden x intermediate`` (2 for relu2 MLPs). Experts:
    every routed and shared expert plus the router. Recurrent mixers: input and
    output projections, convolution and the per-head parameters. Embeddings:
    ``vocab x hidden``, twice unless ``tie_word_embeddings``.
    """
    cfg = text_config_view(config)
    h, vocab = first_int_field(cfg, "hidden_size"), first_int_field(cfg, "vocab_size")
    tied = cfg.get("tie_word_embeddings", True) is not False
    attention = recurrent = dense = experts = 0
    for layer in decoder_layers(cfg):
        if layer.kind is LayerKind.MAMBA:
            recurrent += _recurrent_params(cfg)
        elif layer.kind is not None:
            attention += _attention_params(cfg, layer.kind)
        d, e = _mlp_params(cfg, layer.mlp)
        dense, experts = dense + d, experts + e
    return ParameterEstimate(
        embedding=vocab * h * (1 if tied else 2) + h,
        attention=attention,
        recurrent=recurrent,
        dense_mlp=dense,
        experts=experts,
    )


def estimate_weight_bytes(config: dict[str, Any], *, tp_size: int = 1) -> MemoryTerm:
    """Estimated weight bytes on one GPU: parameters x bytes per parameter / tp (see module docstring)."""
    cfg = text_config_view(config)
    params = estimate_parameters(cfg)
    dtype = model_dtype(cfg)
    quant = cfg.get("quantization_config") or {}
    method = str(quant.get("quant_method", "")).lower() if isinstance(quant, dict) else ""
    matrices = params.attention + params.recurrent + params.dense_mlp + params.experts
    if method == "fp8":
        total = params.embedding * dtype.itemsize + matrices
        how = f"{params.total / 1e9:.2f}B params; fp8 matrices (1 B), embeddings {dtype.value}"
    elif method == "mxfp4":
        total = (params.total - params.experts) * dtype.itemsize + params.experts * 17 // 32
        how = f"{params.total / 1e9:.2f}B params; MXFP4 experts (4.25 bits), the rest {dtype.value}"
    elif method in ("gptq", "awq") and isinstance(quant.get("bits"), int):
        total = params.embedding * dtype.itemsize + matrices * quant["bits"] // 8
        how = f"{params.total / 1e9:.2f}B params; {quant['bits']}-bit {method} matrices"
    else:
        total = params.total * dtype.itemsize
        how = f"{params.total / 1e9:.2f}B params x {dtype.itemsize} B ({dtype.value})"
        if method:
            how += f"; quantization {method!r} not modelled"
    per_gpu = cdiv(total, tp_size)
    if tp_size > 1:
        how += f", / tp {tp_size}"
    return MemoryTerm(bytes=per_gpu, source=TermSource.ESTIMATED, basis=how)


def estimate_activation_bytes(config: dict[str, Any], *, tp_size: int = 1) -> MemoryTerm:
    """Estimated peak activation bytes on one GPU (formula in the module docstring)."""
    cfg = text_config_view(config)
    dtype = model_dtype(cfg)
    hidden, vocab = first_int_field(cfg, "hidden_size"), first_int_field(cfg, "vocab_size")
    width = first_int_field(cfg, "intermediate_size") if cfg.get("intermediate_size") is not None else 4 * hidden
    if cfg.get("moe_intermediate_size") is not None and cfg.get("num_experts_per_tok") is not None:
        width = max(width, first_int_field(cfg, "moe_intermediate_size") * first_int_field(cfg, "num_experts_per_tok"))
    per_token = (4 * hidden + 2 * width // tp_size) * dtype.itemsize
    total = ACTIVATION_BATCH_TOKENS * per_token + ACTIVATION_NUM_SEQS * vocab * 4
    how = (
        f"{ACTIVATION_BATCH_TOKENS} tokens x (4 x {hidden} + 2 x {width}"
        f"{f' / {tp_size}' if tp_size > 1 else ''}) x {dtype.itemsize} B + "
        f"{ACTIVATION_NUM_SEQS} seqs x {vocab} vocab x 4 B logits"
    )
    return MemoryTerm(bytes=total, source=TermSource.ESTIMATED, basis=how)
