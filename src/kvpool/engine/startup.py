"""Engine startup: load the weights, group the KV layers, measure memory, allocate the KV cache once.

The steps a serving engine takes before it accepts a request:

1. Load the weights and the tokenizer (:mod:`kvpool.engine.model_store`).
2. Build the KV cache groups from the model's ``config.json`` with
   :func:`kvpool.model_layers.layer_specs_from_config` and
   :func:`kvpool.specs.group_layers`: one full-attention group for Llama,
   Qwen2 and SmolLM2, one sliding-window group for Mistral, a sliding-window
   and a full-attention group for Gemma-2-style alternation.
3. Profile: one forward pass over the biggest step a scheduler can plan
   (``max_num_batched_tokens`` tokens as dummy prefill chunks, one per
   sequence a step may hold, each sampled) through a
   scratch KV cache just large enough for it, after a short warm-up pass
   (which pages in weights mapped from disk) and a timed probe pass, and
   measure the peak as :mod:`kvpool.engine.memory` describes: with
   ``torch.cuda`` memory statistics on CUDA, as the growth of the peak
   resident set on the CPU (an estimate, and reported as one). The passes are
   bounded in time (:data:`PROFILE_BUDGET_S`): where the probe says the full
   pass would not fit (a busy machine), a smaller one is measured and its peak
   scaled up to the full step, never below what the full pass would show
   (:func:`_profile`). The thread governor sets the threads of these passes
   as it does of a served step.
4. Budget: ``total x gpu_memory_utilization - weights - peak activations -
   other`` (:func:`kvpool.engine.memory.kv_budget`; capped on the CPU), or an
   explicit ``kv_cache_memory`` (the profile still runs: it warms the model
   up and its figure is logged).
5. ``num_blocks = budget // pool block bytes``, where one pool block is
   ``group size`` layer pages (:func:`kvpool.specs.pool_block_bytes`). The
   figure and the capacity line come from :func:`kvpool.planner.plan_kv_cache`
   given exactly that budget, so the engine and ``kvpool plan`` agree.
6. Allocate one K and one V tensor ``[num_blocks, block_size, kv_heads,
   head_dim]`` per layer slot, once, zero-filled. With several groups, layer
   ``j`` of every group shares slot ``j`` (the pool hands a block ID to one
   group at a time), so the cache is ``num_blocks x pool block bytes``, the
   planner's figure. Nothing allocates or frees KV memory after this.
"""

from __future__ import annotations

import functools
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvpool.checks import MIN_MODEL_LEN, check_flag, check_int
from kvpool.engine.batch import SequenceChunk
from kvpool.engine.kv_cache import KVCaches, KVCacheSpec, allocate_kv_caches
from kvpool.engine.kv_transfer import check_tier_specs
from kvpool.engine.linear import LinearKernel, select_linear_kernel
from kvpool.engine.memory import (
    MemoryBaseline,
    MemoryProfile,
    describe_budget,
    format_bytes,
    kv_budget,
    measure_peak,
    weights_bytes,
)
from kvpool.engine.model_runner import ModelRunner
from kvpool.engine.model_store import load_model, pending_conversion, resolve_model
from kvpool.engine.threads import AUTO, DEFAULT_THREADS, ThreadGovernor, auto_ceiling, parse_threads
from kvpool.errors import ConfigError
from kvpool.fair_share import TenantWeights
from kvpool.hashing import HashAlgo
from kvpool.model_config import max_position_embeddings, serving_dtype
from kvpool.model_layers import layer_sliding_windows, layer_specs_from_config
from kvpool.planner import KVPlan, longest_fitting_request, parse_size, plan_kv_cache
from kvpool.scheduler import ScheduledChunk
from kvpool.specs import KVCacheGroup, KVDtype, LayerKind, cdiv, group_layers
from kvpool.tiers.entry import check_namespace
from kvpool.tiers.kinds import WritePolicy
from kvpool.tiers.store import TierTarget, check_tier_trust, parse_specs
from kvpool.tiers.transfer_threads import DEFAULT_LOAD_DEADLINE_S, check_load_deadline

__all__ = ["EngineOptions", "EngineSetup", "start_engine"]

_TORCH_DTYPES = {KVDtype.FP32: torch.float32, KVDtype.BF16: torch.bfloat16, KVDtype.FP16: torch.float16}


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineOptions:
    """What the engine is asked to be: the one statement of the engine's options.

    :class:`~kvpool.engine.LLM` and :class:`~kvpool.engine.LLMEngine` take these
    fields as keywords (or one ``EngineOptions``) and the ``generate`` / ``chat``
    commands map their flags onto them, so a new option is one field here.
    Every field is checked before any loading.

    Attributes:
        model: a known model name (``"smollm2-135m"``) or a local model folder.
        block_size: tokens per KV block.
        max_num_batched_tokens: tokens one step computes at most (chunked prefill).
        max_num_seqs: requests running at once at most.
        max_model_len: prompt plus output tokens per request; None means the
            model's ``max_position_embeddings``.
        kv_cache_memory: KV cache bytes (an int or a size such as ``"512MiB"``);
            None measures the budget (see :mod:`kvpool.engine.memory`).
        gpu_memory_utilization: fraction of the memory the budget may use.
        enable_prefix_caching: share cached prompt blocks between requests.
        dtype: weight and cache dtype; None picks float32 on the CPU and the
            model's serving dtype on CUDA.
        device: ``"cpu"`` or ``"cuda"``; None picks CUDA when available.
        hash_algo: block hash (a :class:`kvpool.HashAlgo` name): kvpool's
            ``"kvpool_sha256"``, or vLLM's ``"sha256"`` / ``"sha256_cbor"``
            when routers compute the hashes as vLLM does.
        enable_kv_events: record KV cache events (``manager.take_events()``)
            for a publisher (:mod:`kvpool.kv_events`).
        kv_tiers: KV offload tiers in lookup order (``"cpu:4GiB"``,
            ``"disk:/path:50GiB"``, ``"redis://host:6379/0"``; see
            :mod:`kvpool.engine.kv_transfer`); empty means none.
        kv_tier_secret_file: a file holding the secret that signs tier
            entries (a keyed MAC); replicas sharing a tier share it. A shared tier
            (disk, Redis) needs it, or ``kv_tier_unauthenticated``
            (:func:`kvpool.tiers.store.check_tier_trust`).
        kv_tier_unauthenticated: open disk and Redis tiers without a secret:
            their entries carry a checksum (which catches damage, not
            tampering), so whoever can write to the directory or the Redis
            server can plant KV the engine serves. Refused with a secret, or
            without a shared tier.
        kv_tier_namespace: what names the model's weights in disk and Redis
            tier entries instead of the digest of the model folder's files
            (printable, no spaces, at most 128 characters). The operator
            vouches that every engine given the same namespace (and the same
            layout) runs the same weights; None hashes the folder once
            (:func:`kvpool.tiers.weights.model_digest`).
        kv_tier_write: when blocks go down to the tiers, a
            :class:`kvpool.tiers.WritePolicy` or its name: ``write-through``
            (when a block fills) or ``write-back`` (when the pool evicts it).
        kv_tier_always_load: load every tier hit, even where computing its tokens
            is measured to be faster (load or compute, :mod:`kvpool.tiers.load_or_compute`, is off).
        kv_tier_load_deadline: seconds a disk or Redis load may take; a request
            whose blocks have not arrived by then computes them instead. Those
            loads run off the step: the request waits, the batch steps on.
        threads: CPU threads of a step: ``"auto"`` (the default: follow the
            cores other processes leave free, re-measured between steps, never
            more than torch's count when the engine starts; see
            :mod:`kvpool.engine.threads`), a fixed count (set once and kept: one
            reduction order for the whole run), or None to leave torch's setting.
        linear_kernel: the kernel of the weight products, a
            :class:`kvpool.engine.linear.LinearKernel` or its name (``"onednn"``,
            ``"torch"``); None picks oneDNN for float32 on a CPU whose torch has
            it, else torch's ``F.linear`` (:func:`kvpool.engine.linear.select_linear_kernel`).
        tenant_weights: each tenant's weight in the fair share of the batch,
            the pool and a step (:mod:`kvpool.fair_share`); tenants not named
            weigh 1.
        tensor_parallel_size: devices the model is split over; the engine
            runs on one, so only 1 is accepted (vLLM's option, so that its
            launch lines run).
    """

    model: str | os.PathLike[str]
    block_size: int = 16
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    max_model_len: int | None = None
    kv_cache_memory: int | str | None = None
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    dtype: torch.dtype | str | None = None
    device: torch.device | str | None = None
    hash_algo: str = HashAlgo.SHA256.value
    enable_kv_events: bool = False
    kv_tiers: tuple[str, ...] = ()
    kv_tier_secret_file: str | os.PathLike[str] | None = None
    kv_tier_unauthenticated: bool = False
    kv_tier_namespace: str | None = None
    kv_tier_write: WritePolicy = WritePolicy.WRITE_THROUGH
    kv_tier_load_deadline: float = DEFAULT_LOAD_DEADLINE_S
    kv_tier_always_load: bool = False
    threads: int | str | None = DEFAULT_THREADS
    linear_kernel: LinearKernel | str | None = None
    tenant_weights: TenantWeights = field(default_factory=TenantWeights)
    tensor_parallel_size: int = 1
    #: ``kv_tiers`` parsed, once, into their typed targets (what the engine's start-up opens).
    kv_tier_targets: tuple[TierTarget, ...] = field(init=False, repr=False, compare=False, default=())

    def __post_init__(self) -> None:
        if not isinstance(self.model, (str, os.PathLike)) or not os.fspath(self.model):
            raise ConfigError(f"model must be a model name or a folder path, got {self.model!r}")
        check_int("block_size", self.block_size)
        check_int("max_num_batched_tokens", self.max_num_batched_tokens)
        check_int("max_num_seqs", self.max_num_seqs)
        if self.max_model_len is not None:
            check_int("max_model_len", self.max_model_len, minimum=MIN_MODEL_LEN)
        if self.kv_cache_memory is not None:
            size = parse_size(self.kv_cache_memory, field="kv_cache_memory")
            if size <= 0:
                raise ConfigError(f"kv_cache_memory must be positive, got {self.kv_cache_memory!r}")
            object.__setattr__(self, "kv_cache_memory", size)
        util = self.gpu_memory_utilization
        if isinstance(util, bool) or not isinstance(util, (int, float)) or not 0 < util <= 1:
            raise ConfigError(f"gpu_memory_utilization must be in (0, 1], got {util!r}")
        if not isinstance(self.enable_prefix_caching, bool):
            raise ConfigError(f"enable_prefix_caching must be a bool, got {self.enable_prefix_caching!r}")
        if self.dtype is not None and not isinstance(self.dtype, (str, torch.dtype)):
            raise ConfigError(f"dtype must be a torch.dtype, a name such as 'bfloat16', or None, got {self.dtype!r}")
        if self.device is not None and not isinstance(self.device, (str, torch.device)):
            raise ConfigError(f"device must be 'cpu', 'cuda', a torch.device or None, got {self.device!r}")
        object.__setattr__(self, "hash_algo", HashAlgo.parse(self.hash_algo).value)
        if not isinstance(self.enable_kv_events, bool):
            raise ConfigError(f"enable_kv_events must be a bool, got {self.enable_kv_events!r}")
        object.__setattr__(self, "kv_tiers", check_tier_specs(self.kv_tiers))
        object.__setattr__(self, "kv_tier_targets", parse_specs(self.kv_tiers))  # the one parse
        object.__setattr__(self, "kv_tier_write", WritePolicy.parse(self.kv_tier_write))
        check_flag("kv_tier_always_load", self.kv_tier_always_load)
        check_load_deadline(self.kv_tier_load_deadline, "kv_tier_load_deadline")
        parse_threads(self.threads)
        if self.linear_kernel is not None:
            object.__setattr__(self, "linear_kernel", LinearKernel.parse(self.linear_kernel))
        if check_int("tensor_parallel_size", self.tensor_parallel_size) != 1:
            raise ConfigError(
                f"tensor_parallel_size {self.tensor_parallel_size} is not supported: kvpool's engine runs a model "
                "on one device, so only 1 is accepted (run one server per device and `kvpool route` across them)"
            )
        if not isinstance(self.tenant_weights, TenantWeights):
            object.__setattr__(self, "tenant_weights", TenantWeights(self.tenant_weights))
        secret = self.kv_tier_secret_file
        if secret is not None and (not isinstance(secret, (str, os.PathLike)) or not self.kv_tiers):
            raise ConfigError(f"kv_tier_secret_file must be a file path, given with kv_tiers; got {secret!r}")
        check_tier_trust(
            self.kv_tier_targets,
            secret=secret is not None,
            unauthenticated=self.kv_tier_unauthenticated,
            secret_name="kv_tier_secret_file (--kv-tier-secret-file)",
            unauthenticated_name="kv_tier_unauthenticated (--kv-tier-unauthenticated)",
        )
        if check_namespace(self.kv_tier_namespace, "kv_tier_namespace") is not None and not self.kv_tiers:
            raise ConfigError(f"kv_tier_namespace is given with kv_tiers; got {self.kv_tier_namespace!r} without")


@dataclass(frozen=True, slots=True, eq=False)
class EngineSetup:
    """Everything startup produced; the engine serves from this."""

    options: EngineOptions
    model_name: str
    model_path: Path
    model: Any
    tokenizer: Any
    device: torch.device
    dtype: torch.dtype
    max_model_len: int
    groups: tuple[KVCacheGroup, ...]
    plan: KVPlan
    memory: MemoryProfile
    kv_caches: KVCaches
    runner: ModelRunner
    eos_token_ids: tuple[int, ...]
    startup_seconds: float


# -- pieces ------------------------------------------------------------------------------


def _resolve_device(device: torch.device | str | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError):
        raise ConfigError(f"unknown device {device!r}") from None
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {device!r} asked for, but CUDA is not available")
    if resolved.type not in ("cpu", "cuda"):
        raise ConfigError(f"device {device!r} is not supported: use 'cpu' or 'cuda'")
    return resolved


def _resolve_dtype(dtype: torch.dtype | str | None, device: torch.device, config: dict[str, Any]) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype not in _TORCH_DTYPES.values():
            raise ConfigError(f"dtype {dtype} is not supported: use float32, bfloat16 or float16")
        return dtype
    if dtype is None or (isinstance(dtype, str) and dtype.strip().lower() == "auto"):
        if device.type == "cpu":
            return torch.float32
        declared = config.get("torch_dtype") or config.get("dtype") or "float32"
        served = serving_dtype(KVDtype.parse(str(declared), field="config dtype"))
        return _TORCH_DTYPES.get(served, torch.bfloat16)
    kv = KVDtype.parse(dtype, field="dtype")
    if kv not in _TORCH_DTYPES:
        raise ConfigError(f"dtype {dtype!r} is not supported for weights: use float32, bfloat16 or float16")
    return _TORCH_DTYPES[kv]


def _kv_dtype(dtype: torch.dtype) -> KVDtype:
    return next(k for k, v in _TORCH_DTYPES.items() if v == dtype)


def _layer_maps(groups: tuple[KVCacheGroup, ...], num_layers: int) -> tuple[list[int], list[int]]:
    """Per decoder layer: its group, and its tensor slot (its position within the group)."""
    to_group = [-1] * num_layers
    to_slot = [-1] * num_layers
    for g, group in enumerate(groups):
        for j, layer in enumerate(group.layer_ids):
            to_group[layer] = g
            to_slot[layer] = j
    if -1 in to_group:
        raise ConfigError(f"layer {to_group.index(-1)} keeps a cache but is in no KV cache group")
    return to_group, to_slot


def _dummy_chunks(
    num_tokens: int, max_model_len: int, max_num_seqs: int, vocab: int, block_size: int
) -> tuple[list[tuple[str, tuple[int, ...], tuple[int, ...]]], int]:
    """The profile step: ``num_tokens`` tokens as fresh prefill chunks, block tables from block 1 on.

    As many sequences as a step may hold, each sampled: besides attention (bounded
    apart, :meth:`ModelRunner.attention_workspace_bytes`), a step's memory grows with
    its tokens and with the logits of the sequences it samples.
    """
    lengths = [1] * min(max_num_seqs, num_tokens)
    left = num_tokens - len(lengths)
    for i in range(len(lengths)):
        extra = min(left, max_model_len - 1)
        lengths[i] += extra
        left -= extra
    chunks: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = []
    next_block = 1
    for i, n in enumerate(lengths):
        blocks = cdiv(n, block_size)
        table = tuple(range(next_block, next_block + blocks))
        next_block += blocks
        tokens = tuple((i * 7919 + p * 31) % vocab for p in range(n))
        chunks.append((f"profile-{i}", tokens, table))
    return chunks, next_block


#: Seconds the profile's measured passes may take together, roughly (see :func:`_profile`).
PROFILE_BUDGET_S = 5.0
#: Tokens of the profile's first measured pass, which times the machine.
PROFILE_PROBE_TOKENS = 64


@dataclass(frozen=True, slots=True)
class _ProfileResult:
    """What the profile step found (see :func:`_profile`)."""

    peak: int | None  # activation bytes for the biggest step, attention's bound included (None: not observable)
    attention: int  # attention's bound alone
    tokens: int  # tokens of the pass the peak was measured on
    seconds: float  # that pass's time
    scale: float  # the measured pass's peak was multiplied by this (1: the full step was measured)


def _thread_governor(threads: int | str | None) -> ThreadGovernor | None:
    """The engine's governor: None leaves torch's count; ``"auto"`` starts at :func:`auto_ceiling`."""
    if threads is None:
        return None
    cores = auto_ceiling(torch.get_num_threads()) if threads == AUTO else None
    return ThreadGovernor(threads, torch.set_num_threads, cores=cores)


def _profile(
    model: Any,
    spec: KVCacheSpec,
    to_group: list[int],
    to_slot: list[int],
    windows: tuple[int | None, ...],
    options: EngineOptions,
    max_model_len: int,
    device: torch.device,
    *,
    governor: ThreadGovernor | None = None,
    budget_s: float = PROFILE_BUDGET_S,
    clock: Callable[[], float] = time.perf_counter,
    measure: Callable[[torch.device, Callable[[], object]], int | None] | None = None,
) -> _ProfileResult:
    """Run the profile step: the peak activation bytes of the biggest step, bounded in time.

    The peak is a measured pass's peak, scaled as below, plus the most attention
    may hold in any step within the limits, which the pass (fresh, short
    contexts) does not show.

    The bound: after a short unmeasured warm-up pass (weights mapped from disk
    are paged in), a probe pass of ``PROBE = min(PROFILE_PROBE_TOKENS,
    max_num_batched_tokens)`` tokens is measured and timed. If the probe's
    time per token says the full ``max_num_batched_tokens`` pass fits in what is
    left of ``budget_s``, the full pass is measured, as it always was; otherwise
    (a busy or slow machine) the largest pass that fits is (at least the probe),
    and its peak is scaled by ``max_num_batched_tokens / its tokens``. The
    passes' time is then about ``budget_s`` at most wherever a step's time grows
    no faster than its tokens (the probe's time per token carries its fixed
    cost, so it overestimates bigger passes'), instead of growing with the
    machine's load.

    Why scaling is safe: apart from attention (bounded separately), a step's
    activations are a part that grows in proportion to its tokens plus a part
    that does not shrink with fewer tokens (the logits of the sampled
    sequences: a pass of ``m`` tokens samples ``min(max_num_seqs, m)``, which
    times ``n / m`` is at least ``min(max_num_seqs, n)``; fixed buffers). For
    ``p(m) = f + m x t`` with ``f, t >= 0`` and ``m <= n``, ``p(m) x n / m =
    f x n / m + n x t >= p(n)``: the scaled figure is never below the full
    pass's, and is above it by the fixed part times ``n / m``.

    The governor (if any) sets the threads before each pass, as it does before a
    served step, so that a busy machine does not run the passes on threads that
    wait for a shared core. ``clock`` and ``measure`` are for tests.
    """
    measure = measure_peak if measure is None else measure
    full = options.max_num_batched_tokens
    probe = min(PROFILE_PROBE_TOKENS, full)

    def batch_of(num_tokens: int) -> tuple[list[ScheduledChunk], int]:
        chunks, blocks = _dummy_chunks(
            num_tokens, max_model_len, options.max_num_seqs, model.config.vocab_size, spec.block_size
        )
        num_groups = max(to_group) + 1
        made = [SequenceChunk(request_id=rid, token_ids=t, start_position=0, block_tables=(table,) * num_groups)
                for rid, t, table in chunks]  # fmt: skip
        return made, blocks

    batches = {n: batch_of(n) for n in {probe, full}}
    scratch = allocate_kv_caches(spec, max(max(b for _, b in batches.values()), 2), device=device, layer_slots=to_slot)
    runner = ModelRunner(
        model, scratch, layer_to_group=to_group, sliding_windows=windows, linear_kernel=options.linear_kernel
    )
    runner.thread_governor = governor

    def measured(batch: list[ScheduledChunk], runner: ModelRunner = runner) -> tuple[int | None, float]:
        began = clock()
        peak = measure(device, functools.partial(runner.execute, batch))
        return peak, clock() - began

    # A short pass first: weights mapped from disk are paged in and kernels set up,
    # so that the measured passes see activations only (and the probe times the model, not the disk).
    first = batches[probe][0][0]
    runner.execute([SequenceChunk(first.request_id, first.token_ids[: spec.block_size], 0, first.block_tables)])
    budget_start = clock()
    peak, seconds = measured(batches[probe][0])
    tokens = probe
    if probe < full:
        per_token = seconds / probe
        left = budget_s - (clock() - budget_start)
        fits = full if per_token * full <= left else int(left / per_token)  # per_token > 0 here: left < its product
        if fits >= full:
            peak, seconds = measured(batches[full][0])
            tokens = full
        elif fits > probe:
            peak, seconds = measured(batch_of(fits)[0])  # its blocks are within the full batch's
            tokens = fits
    attention = runner.attention_workspace_bytes(
        max_num_tokens=full, max_num_seqs=options.max_num_seqs, max_model_len=max_model_len
    )
    del runner, scratch
    if device.type == "cuda":
        torch.cuda.empty_cache()
    scale = full / tokens
    scaled = None if peak is None else -(-peak * full // tokens)
    return _ProfileResult(
        peak=None if scaled is None else scaled + attention,
        attention=attention,
        tokens=tokens,
        seconds=seconds,
        scale=scale,
    )


def _eos_token_ids(model: Any, tokenizer: Any) -> tuple[int, ...]:
    for source in (getattr(model, "generation_config", None), model.config, tokenizer):
        if source is None:
            continue
        eos = getattr(source, "eos_token_id", None)
        if eos is None:
            continue
        ids = [eos] if isinstance(eos, int) else list(eos)
        return tuple(int(i) for i in ids)
    return ()


# -- startup -----------------------------------------------------------------------------


def _load(
    options: EngineOptions, device: torch.device, log: Callable[[str], None]
) -> tuple[Path, dict[str, Any], Any, Any]:
    """Resolve and load the model; returns (folder, config.json as a dict, model, tokenizer or None)."""
    bundled = pending_conversion(options.model)
    if bundled is not None:
        log(f"first use of {bundled.name}: converting {bundled.gguf_file} to safetensors once (about 20 s)")
    path = resolve_model(options.model)
    config_path = path / "config.json"
    try:
        config: dict[str, Any] = json.loads(config_path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read {str(config_path)!r}: {exc}") from None
    dtype = _resolve_dtype(options.dtype, device, config)
    model, tokenizer = load_model(path, dtype=dtype, device=device, require_tokenizer=False)
    return path, config, model, tokenizer


def _kv_groups(served: dict[str, Any], kv_dtype: KVDtype, hf_config: Any, block_size: int) -> tuple[KVCacheGroup, ...]:
    """The core's layer groups of the served config, checked against what the engine can run."""
    groups = group_layers(layer_specs_from_config(served, block_size=block_size, kv_dtype=kv_dtype))
    unsupported = {g.kind for g in groups} - {LayerKind.FULL_ATTENTION, LayerKind.SLIDING_WINDOW}
    if unsupported:
        raise ConfigError(
            f"the engine runs attention layers only; this model has {sorted(k.value for k in unsupported)}"
        )
    if sum(g.num_layers for g in groups) != hf_config.num_hidden_layers:
        raise ConfigError("every decoder layer must keep a KV cache for the engine to run it")
    if {g.block_size for g in groups} != {block_size}:
        raise ConfigError(
            f"the KV groups need block sizes {sorted({g.block_size for g in groups})}; "
            f"the engine runs one block size ({block_size})"
        )
    return groups


def start_engine(options: EngineOptions, log: Callable[[str], None]) -> EngineSetup:
    """Run the startup steps of the module docstring and report each through ``log``.

    Raises:
        ConfigError: an unknown model, an unsupported architecture, a budget
            that holds no block or not one ``max_model_len`` request, and the
            like; nothing is allocated for the KV cache before the checks pass.
    """
    started = time.perf_counter()
    device = _resolve_device(options.device)
    governor = _thread_governor(options.threads)
    baseline = MemoryBaseline.capture(device)
    name = os.fspath(options.model)
    loading = time.perf_counter()
    path, config, model, tokenizer = _load(options, device, log)
    load_seconds = time.perf_counter() - loading
    hf_config = model.config
    dtype = next(model.parameters()).dtype
    weights = weights_bytes(model, baseline)
    arch = (getattr(hf_config, "architectures", None) or [type(model).__name__])[0]
    num_threads = torch.get_num_threads()
    threads = f" ({num_threads} thread{'s' if num_threads > 1 else ''}" if device.type == "cpu" else ""
    if threads:
        threads += ", following the free cores)" if options.threads == AUTO else ")"
    log(f"model {name} ({arch}, {hf_config.num_hidden_layers} layers) from {path}")
    kernel = select_linear_kernel(device, dtype, options.linear_kernel)  # ConfigError before any profiling
    log(
        f"dtype {str(dtype).removeprefix('torch.')}, device {device}{threads}, {kernel.value} linears; "
        f"weights {format_bytes(weights)} loaded in {load_seconds:.1f} s"
        + ("" if tokenizer is not None else "; no tokenizer (token-ID prompts only)")
    )

    limit = max_position_embeddings(config)
    max_model_len = options.max_model_len or limit
    if max_model_len > limit:
        raise ConfigError(f"max_model_len {max_model_len} exceeds the model's max_position_embeddings {limit}")

    # The planner reads config.json as served (this dtype), so engine and planner agree.
    served = {k: v for k, v in config.items() if k != "torch_dtype"}
    served["dtype"] = _kv_dtype(dtype).value

    groups = _kv_groups(served, _kv_dtype(dtype), hf_config, options.block_size)
    to_group, to_slot = _layer_maps(groups, hf_config.num_hidden_layers)
    windows = layer_sliding_windows(served)  # the rule the groups were formed by; the runner computes with it
    spec = KVCacheSpec.from_model_config(hf_config, block_size=options.block_size, dtype=dtype)

    profiled = _profile(model, spec, to_group, to_slot, windows, options, max_model_len, device, governor=governor)
    peak = profiled.peak
    how = "torch.cuda peak" if device.type == "cuda" else "CPU estimate: peak resident-set growth"
    full = options.max_num_batched_tokens
    scaled = "" if profiled.tokens == full else f", its peak scaled x{profiled.scale:.2f} to {full} (the time bound)"
    log(
        f"profile: one forward pass of {profiled.tokens} tokens (max_num_batched_tokens {full}) in "
        f"{profiled.seconds:.2f} s{scaled}; peak activations "
        f"{'not observable here' if peak is None else format_bytes(peak)} ({how}, "
        f"with {format_bytes(profiled.attention)} for attention over contexts up to {max_model_len} tokens)"
    )
    memory = kv_budget(
        baseline=baseline,
        utilization=float(options.gpu_memory_utilization),
        weights=weights,
        peak=peak,
        given=options.kv_cache_memory,  # type: ignore[arg-type]  # bytes after EngineOptions' check
        profile_tokens=profiled.tokens,
        profile_seconds=profiled.seconds,
    )
    plan = plan_kv_cache(
        served, gpu_memory_bytes=memory.kv_budget_bytes, gpu_memory_utilization=1, weights_bytes=0,
        activation_bytes=0, other_overhead_bytes=0, kv_dtype=_kv_dtype(dtype), block_size=options.block_size,
        max_model_len=max_model_len, name=name,
    )  # fmt: skip
    if plan.blocks_per_request > plan.num_blocks - 1:  # the null block never holds KV
        raise ConfigError(
            f"a KV cache of {format_bytes(memory.kv_budget_bytes)} holds {plan.num_blocks} blocks, not enough for "
            f"one request of max_model_len={max_model_len} tokens (the longest that fits is "
            f"{longest_fitting_request(groups, plan.num_blocks - 1, max_model_len)}); lower max_model_len or raise "
            "kv_cache_memory"
        )
    kinds = ", ".join(f"{g.num_layers} {g.kind.value.replace('_', '-')}" for g in groups)
    window = next((g.sliding_window for g in groups if g.sliding_window), None)
    log(
        f"KV cache: {len(groups)} group{'' if len(groups) == 1 else 's'} ({kinds} layers"
        f"{f', window {window}' if window else ''}), block size {options.block_size}; "
        f"{format_bytes(plan.pool_block_bytes)} per block; budget {format_bytes(memory.kv_budget_bytes)} "
        f"({describe_budget(memory)}) -> {plan.num_blocks:,} blocks"
    )
    kv_caches = allocate_kv_caches(spec, plan.num_blocks, device=device, layer_slots=to_slot)
    if kv_caches.nbytes != plan.num_blocks * plan.pool_block_bytes:
        raise ConfigError(
            f"allocated {kv_caches.nbytes} B of KV cache but planned {plan.num_blocks * plan.pool_block_bytes} B"
        )
    runner = ModelRunner(
        model, kv_caches, layer_to_group=to_group, sliding_windows=windows, linear_kernel=options.linear_kernel
    )
    runner.thread_governor = governor
    log(plan.capacity_line)
    return EngineSetup(
        options=options,
        model_name=name,
        model_path=path,
        model=model,
        tokenizer=tokenizer,
        device=device,
        dtype=dtype,
        max_model_len=max_model_len,
        groups=groups,
        plan=plan,
        memory=memory,
        kv_caches=kv_caches,
        runner=runner,
        eos_token_ids=_eos_token_ids(model, tokenizer),
        startup_seconds=time.perf_counter() - started,
    )
