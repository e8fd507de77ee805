"""Helpers shared by the core tests."""

from __future__ import annotations

from kvpool import KVCacheManager, Request


def admit(mgr: KVCacheManager, request: Request) -> tuple[list[int], ...] | None:
    """Look a request up and allocate its whole prompt, as a scheduler admits it."""
    hit, num_hit = mgr.get_computed_blocks(request)
    new = mgr.allocate_slots(request, request.num_tokens - num_hit, num_hit, hit)
    if new is not None:
        request.num_computed_tokens = request.num_tokens
    return new


def snapshot(mgr: KVCacheManager) -> tuple:
    """Everything observable about a manager's bookkeeping, for "nothing changed" checks."""
    pool = mgr.pool
    return (
        mgr.free_queue_block_ids(),
        {rid: mgr.get_block_ids(rid) for rid in mgr.running_request_ids()},
        [(b.block_id, b.ref_cnt, b.block_hash) for b in pool.blocks],
        [sorted((h, b.block_id) for h, b in index.items()) for index in pool.indexes],
        [dict(g.num_cached) for g in mgr.groups],
        mgr.num_free_blocks,
        len(pool.events or []),
        mgr.prefix_cache_stats,
    )
