"""The invariant checker: the pool's bookkeeping, verified in O(blocks).

Property tests call it after every operation; users can call it through
``KVCacheManager.check_invariants()`` when they suspect misuse. It raises
:class:`~kvpool.errors.InvariantViolation` at the first broken rule:

* every non-null block is either free (in the free queue, reference count 0)
  or in use (reference count = the number of block tables holding it);
* the free count equals the free queue's length, and no block is queued twice;
* the prefix-cache index and the blocks' hashes agree, group by group;
* the null block is never free, never cached and never counted.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

from kvpool.block import KVBlock
from kvpool.block_pool import BlockPool
from kvpool.errors import InvariantViolation

if TYPE_CHECKING:
    from kvpool.manager import KVCacheManager

__all__ = ["check_manager", "check_pool"]


def check_pool(pool: BlockPool, tables: Iterable[Mapping[str, list[KVBlock]]]) -> None:
    """Check the pool against every group's block tables."""
    queue = pool.free_queue
    queue.check()
    refs: Counter[int] = Counter()
    for group_tables in tables:
        for request_id, table in group_tables.items():
            for block in table:
                if block.block_id == 0:
                    if block is not pool.null_block:
                        raise InvariantViolation(f"request {request_id!r} holds a second block 0")
                    continue
                if block.block_id >= len(pool.blocks) or pool.blocks[block.block_id] is not block:
                    raise InvariantViolation(f"request {request_id!r} holds a block record the pool does not know")
                refs[block.block_id] += 1

    queued: set[int] = set()
    for block in queue.materialised_free_blocks():
        if block.block_id in queued:
            raise InvariantViolation(f"block {block.block_id} appears twice in the free queue")
        if block.block_id == 0:
            raise InvariantViolation("the null block is in the free queue")
        queued.add(block.block_id)
    if len(queued) + queue.num_never_used != queue.num_free_blocks:
        raise InvariantViolation(
            f"free count {queue.num_free_blocks} != {len(queued)} queued + {queue.num_never_used} never used"
        )

    null = pool.null_block
    if null.block_hash is not None or null.ref_cnt != 0:
        raise InvariantViolation("the null block was cached or counted")
    num_hashed = 0
    for block in pool.blocks[1:]:
        bid = block.block_id
        if bid in queued:
            if block.ref_cnt != 0 or refs[bid]:
                raise InvariantViolation(f"free block {bid} has ref_cnt {block.ref_cnt} and {refs[bid]} table entries")
        elif block.ref_cnt != refs[bid] or block.ref_cnt < 1:
            raise InvariantViolation(
                f"block {bid} is not free but has ref_cnt {block.ref_cnt} and {refs[bid]} table entries"
            )
        if block.block_hash is not None:
            num_hashed += 1

    num_indexed = 0
    for group_id, index in enumerate(pool.indexes):
        for block_hash, block in index.items():
            num_indexed += 1
            if block.block_hash != block_hash or block.group_id != group_id:
                raise InvariantViolation(f"index of group {group_id} maps a hash to block {block.block_id}, which disagrees")
    if num_indexed != num_hashed:
        raise InvariantViolation(f"{num_hashed} blocks carry a hash but the indexes hold {num_indexed}")


def check_manager(manager: KVCacheManager) -> None:
    """Check the pool and each group's per-request state."""
    check_pool(manager.pool, (group.tables for group in manager.groups))
    owners = set(manager._owners)
    for group in manager.groups:
        if set(group.tables) != owners:
            raise InvariantViolation(f"group {group.group_id} holds tables for {sorted(set(group.tables) ^ owners)}")
        for request_id, table in group.tables.items():
            request = manager._owners[request_id]
            done = group.num_cached.get(request_id, 0)
            if done > len(table):
                raise InvariantViolation(f"request {request_id!r} counts {done} cached blocks of {len(table)}")
            for k in range(done):
                block = table[k]
                if block.block_hash is not None and block.block_hash != request.block_hashes[k]:
                    raise InvariantViolation(f"request {request_id!r} block {k} is cached under another hash")
