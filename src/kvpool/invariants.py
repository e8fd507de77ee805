"""The invariant checker: the pool's bookkeeping, verified in O(blocks).

Property tests call it after every operation; users can call it through
``KVCacheManager.check_invariants()`` when they suspect misuse. It raises
:class:`~kvpool.errors.InvariantViolation` at the first broken rule:

* every non-null block is either free (in the free queue, reference count 0)
  or in use (reference count = the number of block tables holding it);
* the free count equals the free queue's length, and no block is queued twice;
* the prefix-cache index and the blocks' hashes agree, group by group;
* the null block is never free, never cached and never counted;
* every group holds tables for exactly the running requests, and null blocks
  sit only where the group's layer type allows them (a skipped prefix in a
  sliding-window or chunked-local table; a state-space table holds at most
  two real blocks and ends with one).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

from kvpool.block import NULL_BLOCK_ID, KVBlock
from kvpool.block_pool import BlockPool
from kvpool.errors import InvariantViolation

if TYPE_CHECKING:
    from kvpool.groups.base import GroupManager
    from kvpool.request import Request

__all__ = ["check_manager", "check_pool", "check_table"]


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
                raise InvariantViolation(
                    f"index of group {group_id} maps a hash to block {block.block_id}, which disagrees"
                )
    if num_indexed != num_hashed:
        raise InvariantViolation(f"{num_hashed} blocks carry a hash but the indexes hold {num_indexed}")


def check_manager(
    pool: BlockPool,
    groups: Sequence[GroupManager],
    running: Mapping[str, tuple[Request, int, int]],
) -> None:
    """Check the pool and each group's per-request state.

    ``running`` maps each request holding blocks to its request object, the
    progress the manager last accepted and the token slots allocated to it.
    Besides the pool: progress never passes the slots; every group holds a
    table for exactly the running requests; a table's cached blocks carry the
    request's hash at their position (at the group's block size); null blocks
    appear only where the group's rule allows them (see :func:`check_table`).
    """
    check_pool(pool, (group.tables for group in groups))
    for request_id, (request, computed, slots) in running.items():
        if request.request_id != request_id:
            raise InvariantViolation(f"request {request.request_id!r} is held under the ID {request_id!r}")
        if not 0 <= computed <= slots:
            raise InvariantViolation(f"request {request_id!r} has progress {computed} beyond its {slots} slots")
    for group in groups:
        tables = group.tables
        if len(tables) != len(running) or any(rid not in running for rid in tables):
            raise InvariantViolation(
                f"group {group.group_id} holds tables for {sorted(set(tables) ^ set(running))}, "
                "which are not exactly the running requests"
            )
        for request_id, table in tables.items():
            request, computed, _ = running[request_id]
            done = group.num_cached.get(request_id, 0)
            if done > len(table):
                raise InvariantViolation(f"request {request_id!r} counts {done} cached blocks of {len(table)}")
            hashes = group.hashes_of(request)
            for k in range(done):
                block = table[k]
                if block.block_hash is not None and block.block_hash != hashes[k]:
                    raise InvariantViolation(
                        f"request {request_id!r} group {group.group_id} block {k} is cached under another hash"
                    )
            check_table(group, request_id, table, max(computed, done * group.block_size))


def check_table(group: GroupManager, request_id: str, table: list[KVBlock], num_tokens: int) -> None:
    """Check where one table may hold the null block, in O(len(table)).

    ``num_tokens`` bounds the tokens the request has computed or taken from
    the cache. Full attention, MLA and cross attention hold no null block.
    Sliding-window and chunked-local tables hold nulls only as a prefix, no
    longer than the blocks wholly skipped at ``num_tokens``. A state-space
    table ends with a real block and holds at most ``max_live_blocks`` real
    blocks.
    """
    live_limit = getattr(group, "max_live_blocks", None)
    if live_limit is not None:
        real = [k for k, block in enumerate(table) if block.block_id != NULL_BLOCK_ID]
        if len(real) > live_limit:
            raise InvariantViolation(
                f"request {request_id!r} group {group.group_id} holds {len(real)} state blocks (at most {live_limit})"
            )
        if table and table[-1].block_id == NULL_BLOCK_ID:
            raise InvariantViolation(
                f"request {request_id!r} group {group.group_id}: the table ends with the null block"
            )
        return
    nulls = 0
    for block in table:
        if block.block_id != NULL_BLOCK_ID:
            break
        nulls += 1
    allowed = group.num_skipped_tokens(num_tokens) // group.block_size
    if nulls > allowed:
        raise InvariantViolation(
            f"request {request_id!r} group {group.group_id} has {nulls} leading null blocks; "
            f"its rule skips only {allowed} at {num_tokens} tokens"
        )
    for k in range(nulls, len(table)):
        if table[k].block_id == NULL_BLOCK_ID:
            raise InvariantViolation(
                f"request {request_id!r} group {group.group_id} has a null block at position {k}, after a real one"
            )
