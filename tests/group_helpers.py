"""Builders shared by the layer-group tests: real groups made with kvpool.specs."""

from __future__ import annotations

from kvpool import KVCacheManager, Request
from kvpool.specs import (
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheGroup,
    KVDtype,
    MambaSpec,
    MLASpec,
    SlidingWindowSpec,
)

_HEADS = {"num_kv_heads": 2, "head_dim": 8, "dtype": KVDtype.BF16}


def full(bs: int = 4, layer: int = 0) -> KVCacheGroup:
    return KVCacheGroup(spec=FullAttentionSpec(block_size=bs, **_HEADS), layer_ids=(layer,))


def mla(bs: int = 4, layer: int = 0) -> KVCacheGroup:
    spec = MLASpec(block_size=bs, kv_lora_rank=16, qk_rope_head_dim=4, dtype=KVDtype.BF16)
    return KVCacheGroup(spec=spec, layer_ids=(layer,))


def sliding(window: int, bs: int = 4, layer: int = 0) -> KVCacheGroup:
    return KVCacheGroup(spec=SlidingWindowSpec(block_size=bs, sliding_window=window, **_HEADS), layer_ids=(layer,))


def chunked(chunk: int, bs: int = 4, layer: int = 0) -> KVCacheGroup:
    spec = ChunkedLocalAttentionSpec(block_size=bs, attention_chunk_size=chunk, **_HEADS)
    return KVCacheGroup(spec=spec, layer_ids=(layer,))


def mamba(bs: int = 4, layer: int = 0) -> KVCacheGroup:
    return KVCacheGroup(spec=MambaSpec(state_bytes=1024, block_size=bs), layer_ids=(layer,))


def cross(bs: int = 4, layer: int = 0) -> KVCacheGroup:
    return KVCacheGroup(spec=CrossAttentionSpec(block_size=bs, **_HEADS), layer_ids=(layer,))


def step(mgr: KVCacheManager, request: Request, num_new_tokens: int, **kwargs) -> tuple[list[int], ...] | None:
    """Allocate a step of a running request and, if granted, mark it computed."""
    new = mgr.allocate_slots(request, num_new_tokens, **kwargs)
    if new is not None:
        request.num_computed_tokens += num_new_tokens
    return new


def decode(mgr: KVCacheManager, request: Request, token: int) -> tuple[list[int], ...] | None:
    """Append one sampled token and allocate its slot."""
    request.append_output_token_ids(token)
    return step(mgr, request, 1)


def cached_ids(mgr: KVCacheManager, group_id: int) -> list[int]:
    """Block IDs cached in one group's index, ascending."""
    return sorted(block.block_id for _, block in mgr.pool.indexes[group_id].items())
