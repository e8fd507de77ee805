"""Run a Hugging Face causal LM over paged KV caches.

The runner reuses the model's own modules and weights (embedding, norms,
projections, rotary embedding, MLP, head) and replaces only attention: each
layer writes its new keys/values into the preallocated cache at the slots the
block tables name, then attends through the block tables (see
:mod:`kvpool.engine.paged_attention`). All chunks of a step are flattened into
one token dimension, ``[T, hidden]``, with no padding, so one forward pass
serves prefill chunks and decode tokens of many sequences at once: the linear
layers run once over all ``T`` tokens, and attention once per chunk or per
group of decodes of like length, each over its own sequences' blocks, so a
long context in the step does not make the short ones pay for it.

Supported architectures: Llama, Mistral, Qwen2, Qwen3 (q/k norms), and
Gemma 2 / Gemma 3 text models (sandwich norms, attention logit soft-capping,
per-layer-type rotary embeddings, final logit soft-capping).
"""

from __future__ import annotations

import enum
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

from kvpool.engine.kv_cache import KVCaches, KVCacheSpec, allocate_kv_caches, num_blocks_for_budget
from kvpool.engine.linear import LinearKernel, linear_function, select_linear_kernel
from kvpool.engine.paged_attention import (
    AttentionBackend,
    AttentionBackendKind,
    AttentionMetadata,
    select_attention_backend,
)
from kvpool.engine.threads import ThreadGovernor
from kvpool.errors import ConfigError, InvalidTokenError, KVPoolError, RequestStateError
from kvpool.model_layers import layer_sliding_windows
from kvpool.scheduler import ScheduledChunk

__all__ = ["LayerInfo", "ModelFamily", "ModelRunner"]


class ModelFamily(enum.Enum):
    """Decoder layouts the runner knows how to drive."""

    #: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``: Llama, Mistral, Qwen2, Qwen3.
    LLAMA = "llama"
    #: Norms also after attention and MLP ("sandwich"): Gemma 2, Gemma 3.
    GEMMA = "gemma"


_MODEL_TYPES: dict[str, ModelFamily] = {
    "llama": ModelFamily.LLAMA,
    "mistral": ModelFamily.LLAMA,
    "qwen2": ModelFamily.LLAMA,
    "qwen3": ModelFamily.LLAMA,
    "gemma2": ModelFamily.GEMMA,
    "gemma3_text": ModelFamily.GEMMA,
}

_FULL = "full_attention"
_SLIDING = "sliding_attention"


@dataclass(frozen=True, slots=True)
class LayerInfo:
    """What the runner needs to know about one attention layer.

    Attributes:
        index: Layer number.
        group: KV cache group whose block table the layer uses.
        layer_type: ``"full_attention"`` or ``"sliding_attention"``.
        sliding_window: ``W`` (a query sees the ``W`` most recent positions,
            itself included), or None for full attention.
        scale: Multiplier of ``q . k``, the model's own.
        logit_softcap: Attention score soft-cap, or None.
    """

    index: int
    group: int
    layer_type: str
    sliding_window: int | None
    scale: float
    logit_softcap: float | None


@dataclass(frozen=True, slots=True, eq=False)
class _FusedProjections:
    """One layer's q/k/v (and, where the MLP allows, gate/up) weights as single matrices.

    A decode step is a chain of small matrix products; one product over the
    concatenated rows reads the same weights in one pass and costs one dispatch
    (and one parallel region) instead of three or two. The model's own modules
    keep working: their weights become views of these matrices.
    """

    qkv_weight: torch.Tensor
    qkv_bias: torch.Tensor | None
    qkv_sizes: tuple[int, int, int]
    gate_up_weight: torch.Tensor | None
    intermediate: int


def _fuse_rows(linears: Sequence[nn.Module]) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """Concatenate the weight rows (and biases) of ``linears``; re-point each module at its rows.

    None (nothing changed) when the modules are not plain linears with biases alike.
    """
    if not all(isinstance(linear, nn.Linear) for linear in linears):
        return None
    has_bias = [linear.bias is not None for linear in linears]
    if any(has_bias) and not all(has_bias):
        return None
    with torch.no_grad():
        weight = torch.cat([cast(torch.Tensor, linear.weight).detach() for linear in linears])
        bias = torch.cat([cast(torch.Tensor, linear.bias).detach() for linear in linears]) if all(has_bias) else None
        sizes = [int(cast(torch.Tensor, linear.weight).shape[0]) for linear in linears]
        for linear, rows in zip(linears, torch.split_with_sizes(weight, sizes)):
            linear.weight = nn.Parameter(rows, requires_grad=False)
        if bias is not None:
            for linear, part in zip(linears, torch.split_with_sizes(bias, sizes)):
                linear.bias = nn.Parameter(part, requires_grad=False)
    return weight, bias


def _fuse_layer(layer: nn.Module) -> _FusedProjections | None:
    attn = layer.self_attn
    projections = [getattr(attn, name, None) for name in ("q_proj", "k_proj", "v_proj")]
    if any(module is None for module in projections):
        return None
    fused = _fuse_rows(cast(list[nn.Module], projections))
    if fused is None:
        return None
    qkv_weight, qkv_bias = fused
    q, k, v = (int(cast(nn.Linear, module).weight.shape[0]) for module in projections)
    mlp = layer.mlp
    gate_up = None
    intermediate = 0
    parts = [getattr(mlp, name, None) for name in ("gate_proj", "up_proj")]
    if hasattr(mlp, "down_proj") and hasattr(mlp, "act_fn") and all(isinstance(m, nn.Linear) for m in parts):
        same = cast(nn.Linear, parts[0]).weight.shape == cast(nn.Linear, parts[1]).weight.shape
        if same and all(cast(nn.Linear, m).bias is None for m in parts):
            gate_up_fused = _fuse_rows(cast(list[nn.Module], parts))
            if gate_up_fused is not None:
                gate_up = gate_up_fused[0]
                intermediate = int(cast(nn.Linear, parts[0]).weight.shape[0])
    return _FusedProjections(
        qkv_weight=qkv_weight, qkv_bias=qkv_bias, qkv_sizes=(q, k, v), gate_up_weight=gate_up,
        intermediate=intermediate,
    )  # fmt: skip


def _supported_model_type(config: Any) -> str:
    model_type = getattr(config, "model_type", None)
    if model_type not in _MODEL_TYPES:
        known = ", ".join(sorted(_MODEL_TYPES))
        raise ConfigError(f"model type {model_type!r} is not supported; supported: {known}")
    return str(model_type)


def _rotary_fn(attention: nn.Module) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """The ``apply_rotary_pos_emb`` of the module that defines the attention class."""
    module = inspect.getmodule(type(attention))
    fn = getattr(module, "apply_rotary_pos_emb", None)
    if fn is None:
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as fn
    return cast(Callable[..., tuple[torch.Tensor, torch.Tensor]], fn)


class ModelRunner:
    """Executes batches of :class:`~kvpool.scheduler.ScheduledChunk` on a causal LM with paged KV caches.

    Args:
        model: A ``*ForCausalLM`` of a supported architecture (see module doc),
            in eval mode, on the caches' device.
        kv_caches: From :func:`kvpool.engine.kv_cache.allocate_kv_caches`; its
            geometry must match the model.
        layer_to_group: KV cache group of each layer; default: one group.
            Groups are numbered ``0..num_groups-1`` and every group has a layer.
        sliding_windows: Per layer, the window ``W`` its attention uses, or
            None for full attention; default: what
            :func:`kvpool.model_layers.layer_sliding_windows` reads from the
            model's config. The runner has no layer rule of its own: start-up
            passes the windows it formed the KV cache groups from.
        attention_backend: Which paged-attention implementation to use; default:
            the best one for the caches' device. Chosen once, here.
        linear_kernel: The kernel of the projections and the head
            (:class:`kvpool.engine.linear.LinearKernel` or its name); default:
            oneDNN for float32 on a CPU that has it, else torch's ``F.linear``.

    Attributes:
        num_computed_tokens: Tokens fed through the model so far (summed over
            all :meth:`execute` calls). Cached prefix tokens are never counted.
        num_steps: Number of :meth:`execute` calls that ran a forward pass.

    Raises:
        ConfigError: unsupported architecture, or caches / groups that do not
            fit the model.
    """

    def __init__(
        self,
        model: nn.Module,
        kv_caches: KVCaches,
        *,
        layer_to_group: Sequence[int] | None = None,
        sliding_windows: Sequence[int | None] | None = None,
        attention_backend: AttentionBackendKind | str | None = None,
        linear_kernel: LinearKernel | str | None = None,
    ) -> None:
        config: Any = model.config  # a transformers config: typed loosely upstream
        model_type = _supported_model_type(config)
        family = _MODEL_TYPES[model_type]
        if getattr(config, "use_bidirectional_attention", False):
            raise ConfigError("models with use_bidirectional_attention are not causal LMs; not supported")
        decoder = getattr(model, "model", None)
        if decoder is None or not hasattr(decoder, "layers") or not hasattr(model, "lm_head"):
            raise ConfigError(f"{type(model).__name__} does not have the expected .model.layers / .lm_head")

        layers = list(decoder.layers)
        num_layers = len(layers)
        expected = KVCacheSpec.from_model_config(config, block_size=kv_caches.block_size, dtype=kv_caches.spec.dtype)
        if expected != kv_caches.spec:
            raise ConfigError(f"KV caches {kv_caches.spec} do not match the model, which needs {expected}")

        groups = [0] * num_layers if layer_to_group is None else list(layer_to_group)
        if len(groups) != num_layers:
            raise ConfigError(f"layer_to_group has {len(groups)} entries for {num_layers} layers")
        valid_ids = all(isinstance(g, int) and not isinstance(g, bool) and g >= 0 for g in groups)
        num_groups = max(groups) + 1 if valid_ids else 0
        if not valid_ids or set(groups) != set(range(num_groups)):
            raise ConfigError(f"layer_to_group must name groups 0..n-1, each at least once; got {groups}")

        param = next(model.parameters())
        if param.device != kv_caches.device:
            raise ConfigError(f"model is on {param.device} but the KV caches are on {kv_caches.device}")

        windows = layer_sliding_windows(config.to_dict()) if sliding_windows is None else tuple(sliding_windows)
        if len(windows) != num_layers or not all(
            w is None or (isinstance(w, int) and not isinstance(w, bool) and w >= 1) for w in windows
        ):
            raise ConfigError(
                f"sliding_windows must give None or a window >= 1 for each of {num_layers} layers; got {windows}"
            )
        infos = []
        for index, layer in enumerate(layers):
            attn = layer.self_attn
            softcap = getattr(attn, "attn_logit_softcapping", None)
            infos.append(
                LayerInfo(
                    index=index,
                    group=groups[index],
                    layer_type=_FULL if windows[index] is None else _SLIDING,
                    sliding_window=windows[index],
                    scale=float(attn.scaling),
                    logit_softcap=None if softcap is None else float(softcap),
                )
            )

        self.model = model
        self.kv_caches = kv_caches
        self.family = family
        self.layers: tuple[LayerInfo, ...] = tuple(infos)
        self.num_groups = num_groups
        self.backend: AttentionBackend = select_attention_backend(kv_caches.device, attention_backend)
        #: The kernel of the projections and the head (see :mod:`kvpool.engine.linear`).
        self.linear_kernel = select_linear_kernel(param.device, param.dtype, linear_kernel)
        self._linear = linear_function(self.linear_kernel)
        self.num_computed_tokens = 0
        self.num_steps = 0
        #: Called with a layer's index just before it runs, to wait for KV loaded into it (a KV connector's worker).
        self.kv_load_wait: Callable[[int], None] | None = None
        #: Sets the CPU thread count before each step (see :mod:`kvpool.engine.threads`); None leaves it.
        self.thread_governor: ThreadGovernor | None = None
        self._decoder = decoder
        self._modules = layers
        self._device = param.device
        self._dtype = param.dtype
        self._vocab_size = int(config.vocab_size)
        self._head_dim = kv_caches.spec.head_dim
        self._rotary = [_rotary_fn(layer.self_attn) for layer in layers]
        # Gemma 3 keeps one rotary table per layer type (local layers use another base).
        self._rotary_per_type = model_type == "gemma3_text"
        self._final_softcap = getattr(config, "final_logit_softcapping", None)
        self._fused = [_fuse_layer(layer) for layer in layers]

    @classmethod
    def create(
        cls,
        model: nn.Module,
        *,
        num_blocks: int | None = None,
        kv_cache_bytes: int | None = None,
        block_size: int = 16,
        layer_to_group: Sequence[int] | None = None,
        attention_backend: AttentionBackendKind | str | None = None,
        linear_kernel: LinearKernel | str | None = None,
    ) -> ModelRunner:
        """Allocate KV caches sized for ``model`` and build a runner over them.

        Exactly one of ``num_blocks`` (null block included) and ``kv_cache_bytes``
        (a memory budget, see :func:`~kvpool.engine.kv_cache.num_blocks_for_budget`)
        must be given. The caches take the model's dtype and device.
        """
        if (num_blocks is None) == (kv_cache_bytes is None):
            raise ConfigError(
                f"give exactly one of num_blocks ({num_blocks!r}) and kv_cache_bytes ({kv_cache_bytes!r})"
            )
        param = next(model.parameters())
        spec = KVCacheSpec.from_model_config(model.config, block_size=block_size, dtype=param.dtype)
        if num_blocks is None:
            num_blocks = num_blocks_for_budget(spec, cast(int, kv_cache_bytes))  # exactly one was given
        caches = allocate_kv_caches(spec, num_blocks, device=param.device)
        return cls(
            model, caches, layer_to_group=layer_to_group, attention_backend=attention_backend,
            linear_kernel=linear_kernel,
        )  # fmt: skip

    @property
    def block_size(self) -> int:
        return self.kv_caches.block_size

    @property
    def num_blocks(self) -> int:
        return self.kv_caches.num_blocks

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def attention_workspace_bytes(self, *, max_num_tokens: int, max_num_seqs: int, max_model_len: int) -> int:
        """Most bytes attention holds at once in any step the limits allow.

        A step's other activations grow with its tokens only (and its logits with
        the sequences it samples), so a pass of ``max_num_tokens`` tokens sampling
        ``max_num_seqs`` sequences shows them; what attention holds grows with the
        contexts it reads, which such a pass does not exercise, and is bounded here
        from what the backend allocates (:func:`~kvpool.engine.paged_attention.attention_workspace_bytes`).
        """
        config: Any = self.model.config
        return self.backend.workspace_bytes(
            max_num_tokens=max_num_tokens,
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
            num_heads=int(config.num_attention_heads),
            num_kv_heads=self.kv_caches.spec.num_kv_heads,
            head_dim=self._head_dim,
            block_size=self.block_size,
            dtype_bytes=torch.empty((), dtype=self._dtype).element_size(),
            num_metadata_sets=len({(info.group, info.sliding_window) for info in self.layers}),
            logit_softcap=any(info.logit_softcap is not None for info in self.layers),
        )

    def _validate(self, chunks: Sequence[ScheduledChunk]) -> None:
        """What only the runner can know: one chunk per request and a table per group.

        Tokens and block IDs were checked where the chunk was made (by the
        scheduler, or :func:`~kvpool.engine.batch.SequenceChunk`); the
        vocabulary bound is checked on the token tensor in :meth:`execute`.
        """
        if not chunks:
            raise KVPoolError("execute() needs at least one chunk")
        seen: set[str] = set()
        for chunk in chunks:
            if not isinstance(chunk, ScheduledChunk):
                raise KVPoolError(f"expected a ScheduledChunk, got {type(chunk).__name__}")
            if chunk.request_id in seen:
                raise RequestStateError(f"request {chunk.request_id!r} appears twice in one batch")
            seen.add(chunk.request_id)
            if len(chunk.block_tables) != self.num_groups:
                raise RequestStateError(
                    f"request {chunk.request_id!r} has {len(chunk.block_tables)} block table(s); "
                    f"the model has {self.num_groups} KV cache group(s)"
                )

    def _build_metadata(self, chunks: Sequence[ScheduledChunk]) -> dict[tuple[int, int | None], AttentionMetadata]:
        """One set of indices per (group, window) that some layer uses."""
        starts = [c.start_position for c in chunks]
        qlens = [c.num_tokens for c in chunks]
        labels = [c.request_id for c in chunks]
        metadata: dict[tuple[int, int | None], AttentionMetadata] = {}
        for info in self.layers:
            key = (info.group, info.sliding_window)
            if key not in metadata:
                metadata[key] = self.backend.build_metadata(
                    starts,
                    qlens,
                    [c.block_tables[info.group] for c in chunks],
                    block_size=self.block_size,
                    num_blocks=self.num_blocks,
                    sliding_window=info.sliding_window,
                    device=self._device,
                    dtype=self._dtype,
                    labels=labels,
                )
        return metadata

    def _attention(
        self,
        info: LayerInfo,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """``[T, hidden]`` -> ``[T, hidden]``: projections, rotary, paged attention, output."""
        attn = self._modules[info.index].self_attn
        num_tokens = hidden.shape[0]
        fused = self._fused[info.index]
        if fused is not None:
            q, k, v = torch.split_with_sizes(
                self._linear(hidden, fused.qkv_weight, fused.qkv_bias), list(fused.qkv_sizes), dim=-1
            )
        else:
            q, k, v = attn.q_proj(hidden), attn.k_proj(hidden), attn.v_proj(hidden)
        query = q.view(num_tokens, -1, self._head_dim)  # [T, H, D]
        key = k.view(num_tokens, -1, self._head_dim)  # [T, Hkv, D]
        value = v.view(num_tokens, -1, self._head_dim)
        if hasattr(attn, "q_norm"):
            query = attn.q_norm(query)
            key = attn.k_norm(key)
        # cos/sin are [T, D]; unsqueeze at dim 1 broadcasts them over heads.
        query, key = self._rotary[info.index](query, key, cos, sin, unsqueeze_dim=1)
        key_cache, value_cache = self.kv_caches.layer(info.index)
        self.backend.write_kv(key_cache, value_cache, key, value, metadata)
        out = self.backend.attend(
            query, key_cache, value_cache, metadata, scale=info.scale, logit_softcap=info.logit_softcap
        )
        return self._project(attn.o_proj, out.reshape(num_tokens, -1))

    def _mlp(self, index: int, hidden: torch.Tensor) -> torch.Tensor:
        """The layer's MLP, ``down(act(gate(x)) * up(x))``, with gate and up as one product where fused."""
        mlp = self._modules[index].mlp
        fused = self._fused[index]
        if fused is None or fused.gate_up_weight is None:
            return cast(torch.Tensor, mlp(hidden))
        gate, up = torch.chunk(self._linear(hidden, fused.gate_up_weight, None), 2, dim=-1)  # equal halves
        return self._project(mlp.down_proj, mlp.act_fn(gate) * up)

    def _project(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """``module(x)``, through the runner's linear kernel when ``module`` is a plain linear."""
        if type(module) is nn.Linear:
            return self._linear(x, module.weight, module.bias)
        return cast(torch.Tensor, module(x))

    def _rotary_tables(
        self, hidden: torch.Tensor, positions: torch.Tensor
    ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """cos/sin of shape ``[T, D]`` per layer type, from the model's rotary module."""
        rotary = self._decoder.rotary_emb
        position_ids = positions[None, :]
        x = hidden[None]
        if self._rotary_per_type:
            tables = {}
            for layer_type in {info.layer_type for info in self.layers}:
                cos, sin = rotary(x, position_ids, layer_type)
                tables[layer_type] = (cos[0], sin[0])
            return tables
        cos, sin = rotary(x, position_ids=position_ids)
        shared = (cos[0], sin[0])
        return {layer_type: shared for layer_type in (_FULL, _SLIDING)}

    @torch.inference_mode()
    def execute(self, chunks: Sequence[ScheduledChunk]) -> torch.Tensor:
        """Compute one step for a batch and store its K/V in the caches.

        Args:
            chunks: The batch, at most one chunk per request. Each chunk's block
                tables must cover positions ``0 .. end_position - 1``.

        Returns:
            ``[num_sampled, vocab_size]`` float32 logits of the last token of each
            chunk with ``sample=True``, in chunk order (``[0, vocab_size]`` if none).

        Raises:
            KVPoolError: an empty batch, a duplicate request, a token outside the
                vocabulary, or a block table that does not cover its positions.
                Validation happens before anything is written to the caches.
        """
        chunks = tuple(chunks)
        self._validate(chunks)
        if self.thread_governor is not None:
            self.thread_governor.before_step()
        metadata = self._build_metadata(chunks)

        token_ids = torch.tensor([t for c in chunks for t in c.token_ids], dtype=torch.int64, device=self._device)
        largest = int(token_ids.max())
        if largest >= self._vocab_size:  # one reduction per step, before anything is written
            raise InvalidTokenError(f"token ID {largest} is outside the vocabulary of {self._vocab_size}")
        positions = torch.tensor(
            [p for c in chunks for p in range(c.start_position, c.end_position)],
            dtype=torch.int64,
            device=self._device,
        )
        num_tokens = token_ids.shape[0]

        hidden = self._decoder.embed_tokens(token_ids)  # [T, hidden]
        rotary = self._rotary_tables(hidden, positions)
        wait = self.kv_load_wait
        for info in self.layers:
            if wait is not None:
                wait(info.index)
            layer = self._modules[info.index]
            cos, sin = rotary[info.layer_type]
            meta = metadata[(info.group, info.sliding_window)]
            residual = hidden
            attn_out = self._attention(info, layer.input_layernorm(hidden), cos, sin, meta)
            if self.family is ModelFamily.GEMMA:
                hidden = residual + layer.post_attention_layernorm(attn_out)
                mlp_out = self._mlp(info.index, layer.pre_feedforward_layernorm(hidden))
                hidden = hidden + layer.post_feedforward_layernorm(mlp_out)
            else:
                hidden = residual + attn_out
                hidden = hidden + self._mlp(info.index, layer.post_attention_layernorm(hidden))
        hidden = self._decoder.norm(hidden)

        self.num_computed_tokens += num_tokens
        self.num_steps += 1

        last_rows: list[int] = []
        offset = 0
        for chunk in chunks:
            offset += chunk.num_tokens
            if chunk.sample:
                last_rows.append(offset - 1)
        if not last_rows:
            return torch.empty((0, self._vocab_size), dtype=torch.float32, device=self._device)
        selected = hidden.index_select(0, torch.tensor(last_rows, dtype=torch.int64, device=self._device))
        logits = self._project(cast(Any, self.model).lm_head, selected)
        if self._final_softcap is not None:
            logits = torch.tanh(logits / self._final_softcap) * self._final_softcap
        return logits.float()
