"""Drive vLLM's own KV cache manager with the same calls as kvpool's.

Used by the side-by-side benchmark (``bench_manager.py --vs-vllm``), the live
parity test (``tests/test_vllm_parity.py``) and the fixture recorder
(``record_vllm_decisions.py``), in an environment where vLLM is installed
beside kvpool. vLLM is never a dependency of kvpool. A separate virtual
environment that has it::

    python3 -m venv /work/venv-vllm
    /work/venv-vllm/bin/pip install torch==2.13.0
    /work/venv-vllm/bin/pip install --no-deps vllm==0.33.0
    /work/venv-vllm/bin/pip install --no-deps <the modules vllm.v1.core imports>   # see record_vllm_decisions.py
    /work/venv-vllm/bin/pip install -e ".[test,fast]"
"""

from __future__ import annotations

import math
from collections.abc import Sequence

GroupKind = tuple[str, int, int | None]  # ("full", block_size, None) | ("sw", bs, window) | ("cl", bs, chunk)


def build_vllm_manager(
    num_blocks: int, kinds: Sequence[GroupKind], max_model_len: int = 1 << 20, log_stats: bool = False
):
    """vLLM's KVCacheManager for the given layer groups, and a factory of its requests.

    ``kinds`` holds one ``(kind, block_size, parameter)`` per group: ``("full",
    bs, None)``, ``("sw", bs, window)`` or ``("cl", bs, chunk)``. Hashes are
    computed at the greatest common divisor of the block sizes, as kvpool's
    ``KVCacheManager.from_groups`` does. Returns ``(manager, make_request)``
    where ``make_request(request_id, token_ids, cache_salt=None)``.
    """
    import torch
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        SlidingWindowSpec,
    )
    from vllm.v1.request import Request

    hash_fn = get_hash_fn_by_name("sha256")
    init_none_hash(hash_fn)
    groups = []
    common = {"num_kv_heads": 1, "head_size": 1, "dtype": torch.float32}
    for i, (kind, block_size, parameter) in enumerate(kinds):
        if kind == "full":
            spec = FullAttentionSpec(block_size=block_size, **common)
        elif kind == "sw":
            spec = SlidingWindowSpec(block_size=block_size, sliding_window=parameter, **common)
        elif kind == "cl":
            spec = ChunkedLocalAttentionSpec(block_size=block_size, attention_chunk_size=parameter, **common)
        else:
            raise ValueError(f"unknown group kind {kind!r}")
        groups.append(KVCacheGroupSpec([f"layer.{i}"], spec))
    hash_block_size = math.gcd(*(k[1] for k in kinds))
    config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)
    manager = KVCacheManager(
        config,
        max_model_len=max_model_len,
        scheduler_block_size=math.lcm(*(k[1] for k in kinds)),
        hash_block_size=hash_block_size,
        enable_caching=True,
        log_stats=log_stats,
    )
    hasher = get_request_block_hasher(hash_block_size, hash_fn)
    sampling = SamplingParams(max_tokens=1 << 20)

    def make_request(request_id: str, token_ids: Sequence[int], cache_salt: str | None = None):
        return Request(request_id, list(token_ids), sampling, None, cache_salt=cache_salt, block_hasher=hasher)

    return manager, make_request


def _free_queue(manager) -> list[int]:
    return [b.block_id for b in manager.block_pool.free_block_queue.get_all_free_blocks()]


class VLLMManager:
    """vLLM's single-group KVCacheManager behind kvpool's call shapes (for the benchmark)."""

    def __init__(self, num_blocks: int, block_size: int, max_model_len: int = 1 << 20) -> None:
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher

        self._mgr, self._make = build_vllm_manager(
            num_blocks, [("full", block_size, None)], max_model_len, log_stats=True
        )
        self._hasher = get_request_block_hasher(block_size, get_hash_fn_by_name("sha256"))

    def make_request(self, request_id: str, token_ids: Sequence[int]):
        return self._make(request_id, token_ids)

    def make_request_timed(self, request_id: str, token_ids: Sequence[int]):
        """Build the request without hashing, then time hashing its prompt alone."""
        import time

        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        request = Request(request_id, list(token_ids), SamplingParams(max_tokens=1 << 20), None, block_hasher=None)
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
        return _free_queue(self._mgr)


class VLLMReference:
    """vLLM's manager as the reference of ``tests/parity_traffic.py``'s traffic driver.

    Implements that module's ``Reference`` calls: requests are vLLM requests,
    decisions come back as plain lists of block IDs, one list per group.
    """

    def __init__(self, num_blocks: int, kinds: Sequence[GroupKind], max_model_len: int = 1 << 20) -> None:
        import logging

        logging.getLogger("vllm").setLevel(logging.ERROR)  # a refused reset_prefix_cache logs a warning
        self.manager, self._make = build_vllm_manager(num_blocks, kinds, max_model_len)

    def make_request(self, request_id: str, token_ids: Sequence[int], cache_salt: str | None):
        return self._make(request_id, token_ids, cache_salt)

    def lookup(self, request):
        blocks, num_hit, _boundary = self.manager.get_computed_blocks(request)
        return blocks, num_hit, [list(ids) for ids in blocks.get_block_ids()]

    def allocate(self, request, num_new: int, num_hit: int, hit, lookahead: int):
        result = self.manager.allocate_slots(request, num_new, num_hit, hit, lookahead)
        return None if result is None else [list(ids) for ids in result.get_block_ids()]

    def num_tokens(self, request) -> int:
        return request.num_tokens

    def num_computed(self, request) -> int:
        return request.num_computed_tokens

    def set_computed(self, request, value: int) -> None:
        request.num_computed_tokens = value

    def append(self, request, token: int) -> None:
        request.append_output_token_ids(token)

    def mark_preempted(self, request) -> None:
        from vllm.v1.request import RequestStatus

        request.status = RequestStatus.PREEMPTED  # as vLLM's scheduler does (no watermark is set here)
        request.num_preemptions += 1

    def free(self, request) -> None:
        self.manager.free(request)

    def reset_prefix_cache(self) -> bool:
        return self.manager.reset_prefix_cache()

    def free_queue(self) -> list[int]:
        return _free_queue(self.manager)

    def block_table(self, request_id: str) -> list[list[int]]:
        return [list(ids) for ids in self.manager.get_block_ids(request_id)]
