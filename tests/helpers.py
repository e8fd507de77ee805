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


def without_modules(*packages: str, announce: bool = True) -> str:
    """Python source that makes ``packages`` unimportable in the interpreter it runs in (prepend it to ``-c`` code).

    A finder first on ``sys.meta_path`` refuses them (and, with ``announce``, writes ``IMPORTED <name>``
    to stderr first, so a test can tell which import reached for one), as on an install without them.
    """
    say = 'print("IMPORTED " + name, file=sys.stderr, flush=True)' if announce else "pass"
    return f"""
import sys

class _Blocker:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {packages!r}:
            {say}
            raise ImportError("blocked: " + name)
        return None

sys.meta_path.insert(0, _Blocker())
for _m in [m for m in sys.modules if m.split(".")[0] in {packages!r}]:
    sys.modules.pop(_m)
"""
