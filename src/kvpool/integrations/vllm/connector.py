# mypy: disable-error-code="import-not-found", allow-subclassing-any
"""``KVPoolConnector``: the class vLLM drives, over the planner and the worker of this package.

vLLM builds one instance in its scheduler (``KVConnectorRole.SCHEDULER``) and one in each worker
(``KVConnectorRole.WORKER``), usually in different processes. Both compute the same entry
fingerprint from vLLM's configuration and open the same stores: the scheduler asks them what
they hold, the worker reads and writes them. Everything that decides lives in
:mod:`~kvpool.integrations.vllm.plan` (the scheduler side) and :mod:`~kvpool.integrations.vllm.blocks`
(the worker side); this module only translates vLLM's objects. This is the one module of kvpool
that imports vLLM.

Lookups and loads from a disk or Redis tier run off vLLM's step (``"async_loads": false`` puts
both back on it). A new request's lookup runs on a thread, and ``get_num_new_matched_tokens``
answers ``None`` until it is back (vLLM asks again at its next step); then it answers
``load_async`` for a match a store serves, so vLLM allocates the request's blocks, parks it in
``WAITING_FOR_REMOTE_KVS`` and goes on stepping the others. The worker starts the fetch on a
load thread as soon as vLLM binds the step's plan and reports the request from ``get_finished``
once its blocks are copied in, or once its fetch failed or ran past its deadline: the compute its
blocks still to come save (the engine's rule, :meth:`~kvpool.tiers.load_or_compute.TransferCosts.load_wait`,
priced in the scheduler and carried in the plan), never more than ``load_deadline_s``. The
leading blocks that arrived by then are used; the rest are load errors, which vLLM recomputes. Host tier loads are
memory copies, done in ``start_load_kv`` before the forward pass. Saves read the blocks in
``wait_for_save`` and queue the store writes for a save thread, so vLLM never holds a finished
request's blocks for them. A block that cannot be loaded is reported through
``get_block_ids_with_load_errors``, no later than the pass that reports its request received;
with ``"kv_load_failure_policy": "recompute"`` vLLM then computes it, and no request fails.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.platforms import current_platform
from vllm.v1.core.kv_cache_utils import resolve_none_hash_seed
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvpool.errors import ConfigError
from kvpool.integrations.vllm.blocks import KVBlockLayout, TierWorker
from kvpool.integrations.vllm.plan import ConnectorOptions, StepPlan, TierPlanner, TransferNotes, VllmScheduledChunk
from kvpool.secret_files import read_secret_file
from kvpool.tiers import ByteTier, CpuTarget, EntryCodec, HostTier, LayoutFingerprint, open_store
from kvpool.tiers.kinds import BlockStore
from kvpool.tiers.load_or_compute import LoadOrCompute, TransferCosts, registry_links
from kvpool.tiers.store import BACKENDS
from kvpool.tiers.transfer_threads import TransferThreads

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["KVPoolConnector", "KVPoolConnectorMetadata", "KVPoolWorkerMetadata", "vllm_fingerprint"]

_log = logging.getLogger("kvpool.integrations.vllm")


def _log_where_vllm_logs() -> None:
    """Send kvpool's records (the connector's, the stores' warnings) to vLLM's handlers, once."""
    ours, theirs = logging.getLogger("kvpool"), logging.getLogger("vllm")
    if not ours.handlers and theirs.handlers:
        for handler in theirs.handlers:
            ours.addHandler(handler)
        ours.setLevel(logging.INFO)
        ours.propagate = False


# Where vLLM's metrics file each tier's hits (the backend registry names the member).
_HIT_SOURCES = {kind.value: getattr(CacheHitSource, backend.vllm_hit_source) for kind, backend in BACKENDS.items()}


# The prefill rate load or compute assumes until a forward pass is timed (the engine's figures: a CPU, an accelerator).
_PREFILL_PRIOR = {"cpu": 2_000.0}
_PREFILL_PRIOR_ACCELERATOR = 20_000.0


class KVPoolWorkerMetadata(KVConnectorWorkerMetadata):
    """What the workers measured in one step (:class:`~kvpool.integrations.vllm.plan.TransferNotes`), to the scheduler."""

    def __init__(self, notes: TransferNotes) -> None:
        self.notes = notes

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if isinstance(other, KVPoolWorkerMetadata):
            self.notes.extend(other.notes)
        return self


class KVPoolConnectorMetadata(KVConnectorMetadata):
    """One step's plan, from the scheduler's connector to the workers' (picklable)."""

    def __init__(self, plan: StepPlan) -> None:
        self.plan = plan


def vllm_fingerprint(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, options: ConnectorOptions
) -> LayoutFingerprint:
    """What identifies this deployment's entries: the model, its weights, the KV layout and vLLM's block hash.

    ConfigError naming the value if vLLM runs what the connector cannot store: more than one KV
    cache group (hybrid models), a non-cryptographic block hash, an fp8 KV cache, or a model given
    by hub name while disk or Redis tiers need its folder (or a ``namespace``).
    """
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise ConfigError(f"KVPoolConnector stores one KV cache group; this model has {len(groups)}")
    spec = groups[0].kv_cache_spec
    num_kv_heads = getattr(spec, "num_kv_heads", None)
    head_size = getattr(spec, "head_size", None)
    if not isinstance(num_kv_heads, int) or not isinstance(head_size, int):
        raise ConfigError(f"KVPoolConnector stores attention KV; the cache spec is {type(spec).__name__}")
    algo = vllm_config.cache_config.prefix_caching_hash_algo
    if algo not in ("sha256", "sha256_cbor"):
        raise ConfigError(
            f"KVPoolConnector keys entries by vLLM's block hashes, which must be cryptographic: "
            f"--prefix-caching-hash-algo sha256 or sha256_cbor, got {algo!r}"
        )
    from vllm.utils.hashing import get_hash_fn_by_name

    model_config = vllm_config.model_config
    architectures = getattr(model_config.hf_config, "architectures", None) or [model_config.architecture]
    if options.namespace is not None or not options.needs_weights:
        weights = f"namespace:{options.namespace or 'host-memory-only'}"
    else:
        from kvpool.tiers.weights import tier_weights

        weights = tier_weights(model_config.model, None, _log.info)
    return LayoutFingerprint(
        architecture=f"{architectures[0]}@vllm/{current_platform.device_type}",
        num_layers=len(groups[0].layer_names),
        num_kv_heads=num_kv_heads,
        head_size=head_size,
        dtype=str(spec.dtype).removeprefix("torch."),
        block_size=spec.block_size,
        hash_algo=algo,
        hash_seed=resolve_none_hash_seed(get_hash_fn_by_name(algo)),
        weights=weights,
    )


class KVPoolConnector(KVConnectorBase_V1):
    """vLLM's blocks in kvpool's CPU, disk and Redis tiers, as signed entries keyed by vLLM's block hashes."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        _log_where_vllm_logs()
        if kv_cache_config is None:
            raise ConfigError("KVPoolConnector needs vLLM's KV cache config (vLLM 0.11 or later)")
        transfer = self._kv_transfer_config
        options = ConnectorOptions.from_extra_config(transfer.kv_connector_extra_config)
        if transfer.kv_load_failure_policy != "recompute":
            _log.warning(
                "kvpool connector: kv_load_failure_policy is %r, so a block a tier cannot return (evicted, "
                'corrupt, Redis down) fails its request; set "kv_load_failure_policy": "recompute"',
                transfer.kv_load_failure_policy,
            )
        fingerprint = vllm_fingerprint(vllm_config, kv_cache_config, options)
        secret = (
            None if options.secret_file is None else read_secret_file(options.secret_file, purpose="KV tier secret")
        )
        codec = EntryCodec(fingerprint, secret)
        self._block_size = fingerprint.block_size
        self._num_blocks = kv_cache_config.num_blocks
        self._layer_names = list(kv_cache_config.kv_cache_groups[0].layer_names)
        self._host_slots = options.host_slots(fingerprint.block_bytes)
        self._stores: dict[str, BlockStore] = {
            t.kind.value: open_store(t, codec) for t in options.tiers if not isinstance(t, CpuTarget)
        }
        self._block_bytes = fingerprint.block_bytes
        self._load_deadline_s = options.load_deadline_s
        self._planner: TierPlanner | None = None
        self._worker: TierWorker | None = None
        self._load_errors: set[int] = set()
        if role == KVConnectorRole.SCHEDULER:
            tiers: list[HostTier | ByteTier] = []
            for target in options.tiers:
                if isinstance(target, CpuTarget) and self._host_slots is not None:
                    tiers.append(HostTier(self._host_slots))
                else:
                    tiers.append(ByteTier(self._stores[target.kind.value]))
            off_step = options.async_loads and bool(self._stores)  # the cpu tier alone is looked up in memory
            lookups = TransferThreads("vllm-lookup", load_deadline_s=options.load_deadline_s) if off_step else None
            chooser = None
            if not options.always_load:
                rate = options.prefill_tokens_per_s or _PREFILL_PRIOR.get(
                    current_platform.device_type, _PREFILL_PRIOR_ACCELERATOR
                )
                costs = TransferCosts(
                    registry_links(t.name for t in tiers), block_bytes=self._block_bytes, prefill_tokens_per_s=rate
                )
                chooser = LoadOrCompute(costs, block_size=self._block_size)
            self._planner = TierPlanner(
                tiers,
                self._block_size,
                async_loads=options.async_loads,
                lookups=lookups,
                chooser=chooser,
                load_deadline_s=options.load_deadline_s,
            )
        # The worker times each forward pass for load or compute's prefill rate where the host sees the pass
        # end (vLLM-CPU), unless the rate is configured or the rule is off.
        self._time_steps = (
            not options.always_load and options.prefill_tokens_per_s is None and current_platform.device_type == "cpu"
        )
        self._step_started: float | None = None
        self._step_transfer_s = 0.0
        _log.info(
            "kvpool connector (%s): tiers %s, entries %s (namespace %s), %d bytes per block, %s loads (deadline %s s)",
            role.name.lower(),
            [t.kind.value for t in options.tiers],
            "signed" if codec.signed else "unsigned",
            codec.namespace,
            fingerprint.block_bytes,
            "asynchronous" if options.async_loads else "synchronous",
            options.load_deadline_s,
        )

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a dropped save is a later miss

    # -- worker side ------------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        missing = [name for name in self._layer_names if name not in kv_caches]
        if missing:
            raise ConfigError(f"vLLM registered no KV cache for layers {missing[:4]}")
        layout = KVBlockLayout([kv_caches[name] for name in self._layer_names], self._num_blocks, self._block_bytes)
        # the cpu tier alone copies in memory, on the step: no threads
        transfers = TransferThreads("vllm", load_deadline_s=self._load_deadline_s) if self._stores else None
        self._worker = TierWorker(layout, self._stores, self._host_slots, transfers)

    def _plan(self) -> StepPlan | None:
        if self._worker is None or not self.has_connector_metadata():
            return None
        meta = self._get_connector_metadata()
        return meta.plan if isinstance(meta, KVPoolConnectorMetadata) else None

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        # vLLM binds the plan before the forward pass, and calls start_load_kv after it when no load is
        # synchronous: asynchronous fetches start here, so that they run during the pass.
        plan = self._plan()
        if plan is not None and plan.receiving and self._worker is not None:
            self._worker.start_receiving(plan)
        self._step_started, self._step_transfer_s = time.perf_counter(), 0.0

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        plan = self._plan()
        if plan is not None and plan.loads and self._worker is not None:
            started = time.perf_counter()
            self._load_errors |= self._worker.load(plan)
            self._step_transfer_s += time.perf_counter() - started  # not the forward pass's time

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # synchronous loads are in place before the forward pass; vLLM schedules no asynchronous one

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any
    ) -> None:
        return  # blocks are saved whole, all layers at once, in wait_for_save

    def wait_for_save(self) -> None:
        plan = self._plan()
        if plan is None or self._worker is None:
            return
        if self._time_steps and self._step_started is not None and plan.num_scheduled_tokens:
            # bind .. here, less the loads: the forward pass (start_load_kv runs before or after it)
            seconds = time.perf_counter() - self._step_started - self._step_transfer_s
            self._worker.notes.steps.append((plan.num_scheduled_tokens, max(seconds, 0.0)))
        self._step_started = None
        if plan.saves:
            self._worker.save(plan)

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        notes = self._worker.take_notes() if self._worker is not None else None
        return None if notes is None else KVPoolWorkerMetadata(notes)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        # vLLM holds a request in WAITING_FOR_REMOTE_KVS, and an aborted one's blocks, until it is
        # reported here; its failed blocks go out through get_block_ids_with_load_errors in the same pass.
        if self._worker is None or not self._worker.num_receiving:
            return None, None
        received, failed = self._worker.received()
        self._load_errors |= failed
        return None, received or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        if self._worker is not None:
            transfers = self._worker.transfers
            _log.info(
                "kvpool connector: %s; transfers %s",
                self._worker.describe(),
                transfers.figures.as_dict() if transfers is not None else {},
            )
            self._worker.close()  # runs the queued saves, then closes the stores
        else:
            chooser = self._planner.chooser if self._planner is not None else None
            if chooser is not None:
                _log.info("kvpool connector: load or compute %s", chooser.figures())
            lookups = self._planner.lookups if self._planner is not None else None
            if lookups is not None:
                lookups.threads.close()
            for store in self._stores.values():
                store.close()

    # -- scheduler side ---------------------------------------------------------------------------

    def _scheduler(self) -> TierPlanner:
        if self._planner is None:
            raise ConfigError("a scheduler method was called on the worker's KVPoolConnector")
        return self._planner

    def on_new_request(self, request: Request) -> None:
        self._scheduler().add(request)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        planner = self._scheduler()
        tokens = planner.match(request, num_computed_tokens)
        if tokens is None:
            return None, False  # the stores' answers are not back: vLLM skips the request this step
        return tokens, tokens > 0 and planner.loads_async(request.request_id)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        # every admission: load or compute counts its decision there, none loaded included
        block_ids = blocks.get_block_ids()[0] if num_external_tokens else ()
        planner = self._scheduler()
        chooser = planner.chooser
        declined = 0 if chooser is None else chooser.requests["cut"] + chooser.requests["computed"]
        planner.allocated(request, block_ids, num_external_tokens)
        if chooser is not None and chooser.requests["cut"] + chooser.requests["computed"] > declined:
            declined += 1
            if declined & (declined - 1) == 0:  # the 1st, 2nd, 4th, 8th ... declined: what the rule weighed
                _log.info(
                    "kvpool connector: load or compute computed a tier hit (%d requests so far): %s",
                    declined,
                    chooser.figures(),
                )

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(meta, KVPoolWorkerMetadata):
            self._scheduler().note(meta.notes)

    def get_external_cache_hit_sources(self, request: Request, num_external_tokens: int) -> dict[CacheHitSource, int]:
        sources: dict[CacheHitSource, int] = {}
        left = num_external_tokens
        for tier, tokens in self._scheduler().hit_tokens_by_tier(request.request_id).items():
            take = min(tokens, left)
            if take:
                source = _HIT_SOURCES.get(tier, CacheHitSource.EXTERNAL_UNSPECIFIED)
                sources[source] = sources.get(source, 0) + take
                left -= take
        if left:
            sources[CacheHitSource.EXTERNAL_UNSPECIFIED] = sources.get(CacheHitSource.EXTERNAL_UNSPECIFIED, 0) + left
        return sources

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        scheduled = scheduler_output.num_scheduled_tokens
        chunks = [
            VllmScheduledChunk(
                request_id=new.req_id,
                block_ids=tuple(new.block_ids[0]),
                replace=True,
                num_computed_tokens=new.num_computed_tokens,
                num_scheduled_tokens=scheduled.get(new.req_id, 0),
            )
            for new in scheduler_output.scheduled_new_reqs
        ]
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            new_ids = cached.new_block_ids[i]
            chunks.append(
                VllmScheduledChunk(
                    request_id=req_id,
                    block_ids=tuple(new_ids[0]) if new_ids is not None else (),
                    replace=req_id in cached.resumed_req_ids,
                    num_computed_tokens=cached.num_computed_tokens[i],
                    num_scheduled_tokens=scheduled.get(req_id, 0),
                )
            )
        return KVPoolConnectorMetadata(self._scheduler().build(chunks))

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._scheduler().finished(request.request_id)
        return False, None  # saves read the blocks within the step that fills them; the store writes follow

    def reset_cache(self) -> bool | None:
        self._scheduler().reset()
        return True
