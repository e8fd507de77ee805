"""Drive vLLM's own KV cache manager with the same calls as kvpool's.

Used only by the side-by-side benchmark, in an environment where vLLM is
installed beside kvpool (``pip install --no-deps vllm==0.33.0`` plus the
modules its ``vllm.v1.core`` package imports). vLLM is never a dependency of
kvpool.
"""

from __future__ import annotations

from collections.abc import Sequence


class VLLMManager:
    """vLLM's single-group KVCacheManager behind kvpool's call shapes."""

    def __init__(self, num_blocks: int, block_size: int, max_model_len: int = 1 << 20) -> None:
        import torch
        from vllm.sampling_params import SamplingParams
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_manager import KVCacheManager
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.kv_cache_interface import (
            FullAttentionSpec,
            KVCacheConfig,
            KVCacheGroupSpec,
        )

        hash_fn = get_hash_fn_by_name("sha256")
        init_none_hash(hash_fn)
        spec = FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float32)
        config = KVCacheConfig(
            num_blocks=num_blocks,
            kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)],
        )
        self._mgr = KVCacheManager(
            config,
            max_model_len=max_model_len,
            scheduler_block_size=block_size,
            hash_block_size=block_size,
            enable_caching=True,
            log_stats=True,
        )
        self._hasher = get_request_block_hasher(block_size, hash_fn)
        self._sampling = SamplingParams(max_tokens=1 << 20)

    def make_request(self, request_id: str, token_ids: Sequence[int]):
        from vllm.v1.request import Request

        return Request(
            request_id,
            list(token_ids),
            self._sampling,
            None,
            block_hasher=self._hasher,
        )

    def make_request_timed(self, request_id: str, token_ids: Sequence[int]):
        """Build the request without hashing, then time hashing its prompt alone."""
        import time

        from vllm.v1.request import Request

        request = Request(request_id, list(token_ids), self._sampling, None, block_hasher=None)
        request._block_hasher = self._hasher
        start = time.perf_counter_ns()
        request.update_block_hashes()
        return request, time.perf_counter_ns() - start

    def get_computed_blocks(self, request):
        blocks, num_hit, _boundary = self._mgr.get_computed_blocks(request)
        return blocks, num_hit

    def allocate_slots(self, request, num_new_tokens, num_new_computed_tokens=0, new_computed_blocks=None):
        result = self._mgr.allocate_slots(request, num_new_tokens, num_new_computed_tokens, new_computed_blocks)
        return None if result is None else result.get_block_ids()

    def free(self, request) -> None:
        self._mgr.free(request)

    def get_block_ids(self, request_id: str):
        return self._mgr.get_block_ids(request_id)

    def free_queue_block_ids(self) -> list[int]:
        return [b.block_id for b in self._mgr.block_pool.free_block_queue.get_all_free_blocks()]


def build_hybrid_pair(num_blocks: int, kinds: Sequence[tuple[str, int, int | None]]):
    """kvpool's and vLLM's managers for the same layer groups.

    ``kinds`` holds one ``(kind, block_size, parameter)`` per group: ``("full",
    bs, None)``, ``("sw", bs, window)`` or ``("cl", bs, chunk)``. Returns
    ``(kvpool_manager, vllm_manager, vllm_request_factory)``.
    """
    import math

    import torch
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_manager import KVCacheManager as VLLMKVCacheManager
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec as VChunked,
    )
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec as VFull,
    )
    from vllm.v1.kv_cache_interface import (
        KVCacheConfig,
        KVCacheGroupSpec,
    )
    from vllm.v1.kv_cache_interface import (
        SlidingWindowSpec as VSliding,
    )
    from vllm.v1.request import Request as VLLMRequest

    from kvpool import KVCacheManager
    from kvpool.specs import (
        ChunkedLocalAttentionSpec,
        FullAttentionSpec,
        KVCacheGroup,
        KVDtype,
        SlidingWindowSpec,
    )

    hash_fn = get_hash_fn_by_name("sha256")
    init_none_hash(hash_fn)
    theirs, ours = [], []
    common = {"num_kv_heads": 1, "dtype": torch.float32}
    for i, (kind, block_size, parameter) in enumerate(kinds):
        if kind == "full":
            spec = VFull(block_size=block_size, head_size=1, **common)
            mine = FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_dim=1, dtype=KVDtype.FP32)
        elif kind == "sw":
            spec = VSliding(block_size=block_size, head_size=1, sliding_window=parameter, **common)
            mine = SlidingWindowSpec(
                block_size=block_size, num_kv_heads=1, head_dim=1, dtype=KVDtype.FP32, sliding_window=parameter
            )
        else:
            spec = VChunked(block_size=block_size, head_size=1, attention_chunk_size=parameter, **common)
            mine = ChunkedLocalAttentionSpec(
                block_size=block_size, num_kv_heads=1, head_dim=1, dtype=KVDtype.FP32, attention_chunk_size=parameter
            )
        theirs.append(KVCacheGroupSpec([f"layer.{i}"], spec))
        ours.append(KVCacheGroup(spec=mine, layer_ids=(i,)))
    hash_block_size = math.gcd(*(k[1] for k in kinds))
    scheduler_block_size = math.lcm(*(k[1] for k in kinds))
    config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=theirs)
    vllm_manager = VLLMKVCacheManager(
        config,
        max_model_len=1 << 20,
        scheduler_block_size=scheduler_block_size,
        hash_block_size=hash_block_size,
        enable_caching=True,
    )
    hasher = get_request_block_hasher(hash_block_size, hash_fn)
    sampling = SamplingParams(max_tokens=1 << 20)

    def make_request(request_id: str, token_ids: Sequence[int]):
        return VLLMRequest(request_id, list(token_ids), sampling, None, block_hasher=hasher)

    return KVCacheManager.from_groups(ours, num_blocks), vllm_manager, make_request
