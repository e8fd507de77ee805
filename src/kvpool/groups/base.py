"""The contract every layer group's manager follows.

A group manager owns the block tables of one layer group (layers with the
same cache requirements) and applies that group's rules: which blocks a prefix
hit needs, which blocks a growing request can give back, how many blocks a
step needs. All groups draw blocks from one shared :class:`BlockPool`.

The default behaviour here is full attention's: keep every block, hit by
walking the hashes from the first block. Other layer types override the hooks
they change.
"""

from __future__ import annotations

from typing import ClassVar

from kvpool.block import KVBlock
from kvpool.block_pool import BlockPool
from kvpool.request import Request

__all__ = ["GroupManager", "cdiv"]


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative integers."""
    return -(-a // b)


class GroupManager:
    """Block tables and rules of one layer group.

    Args:
        pool: the shared block pool.
        group_id: this group's position among the model's groups.
        block_size: tokens per block.
        enable_caching: whether this group caches full blocks.

    ``tables[request_id]`` is the request's block table: block ``k`` holds
    token positions ``k*block_size .. (k+1)*block_size - 1``.
    ``num_cached[request_id]`` counts the leading table entries already
    offered to the prefix-cache index.
    """

    #: Whether a prefix hit can be served by this group's layer type at all.
    prefix_cacheable: ClassVar[bool] = True
    #: Whether every shorter block-aligned prefix of a hit is also a hit.
    downward_closed: ClassVar[bool] = True
    #: Whether hits walk the hashes from block 0 (needed by the verified index).
    supports_verified_index: ClassVar[bool] = True

    def __init__(
        self, pool: BlockPool, group_id: int, block_size: int, enable_caching: bool, *, spec: object = None
    ) -> None:
        self.spec = spec
        self.pool = pool
        self.group_id = group_id
        self.block_size = block_size
        self.enable_caching = enable_caching and self.prefix_cacheable
        self.index = pool.indexes[group_id]
        self.null_block = pool.null_block
        self.tables: dict[str, list[KVBlock]] = {}
        self.num_cached: dict[str, int] = {}

    # -- prefix hits -----------------------------------------------------------

    def find_longest_cache_hit(self, request: Request, max_length: int) -> list[KVBlock]:
        """Blocks serving the longest cached prefix of at most ``max_length`` tokens.

        The result covers ``len(result) * block_size`` tokens; entries a layer
        type does not need are the null block. Changes nothing.
        """
        return self.index.longest_prefix(request.block_hashes, request._block_contents, max_length // self.block_size)

    # -- blocks a request no longer needs ----------------------------------------

    def num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Leading tokens whose KV no later step will read (0 for full attention)."""
        return 0

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Give back blocks wholly outside what later steps read; null them in the table."""

    # -- allocation ----------------------------------------------------------------

    def num_blocks_to_allocate(
        self, request_id: str, num_tokens: int, hit_blocks: list[KVBlock], num_computed_tokens: int
    ) -> int:
        """Free blocks this step would consume: new blocks plus hit blocks that are free now."""
        required = cdiv(num_tokens, self.block_size)
        table = self.tables.get(request_id)
        if table is not None:
            return required - len(table) if required > len(table) else 0
        num_skipped = self.num_skipped_tokens(num_computed_tokens) // self.block_size
        new = required - max(num_skipped, len(hit_blocks))
        evictable = 0
        for block in hit_blocks[num_skipped:]:
            if block.ref_cnt == 0 and block.block_id:
                evictable += 1
        return (new if new > 0 else 0) + evictable

    def add_hit_blocks(self, request_id: str, hit_blocks: list[KVBlock], num_computed_tokens: int) -> None:
        """Start the table of a newly admitted request with its prefix hits."""
        num_skipped = self.num_skipped_tokens(num_computed_tokens) // self.block_size
        if num_skipped:
            kept = hit_blocks[num_skipped:]
            table = [self.null_block] * min(num_skipped, len(hit_blocks)) + kept
        else:
            kept = hit_blocks
            table = list(hit_blocks)
        self.pool.touch(kept)
        self.tables[request_id] = table
        self.num_cached[request_id] = len(table)

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> list[KVBlock]:
        """Grow the table to cover ``num_tokens`` tokens; return the new blocks."""
        table = self.tables.get(request_id)
        if table is None:
            table = self.tables[request_id] = []
            self.num_cached[request_id] = 0
        missing = cdiv(num_tokens, self.block_size) - len(table)
        if missing <= 0:
            return []
        blocks = self.pool.get_new_blocks(missing)
        table.extend(blocks)
        return blocks

    def grow(self, request_id: str, num_computed_tokens: int, num_tokens: int) -> list[int] | None:
        """One step of a running request in a single-group model, in one call.

        Gives back skipped blocks, then grows the table to ``num_tokens`` tokens.
        Returns the new block IDs, or None (and takes nothing) when the free
        queue is short. Same decisions as ``num_blocks_to_allocate`` followed by
        ``allocate_new_blocks``.
        """
        table = self.tables[request_id]
        missing = -(-num_tokens // self.block_size) - len(table)
        if missing <= 0:
            return []
        pool = self.pool
        if missing > pool.free_queue.num_free_blocks:
            return None
        blocks = pool.get_new_blocks(missing)
        table.extend(blocks)
        return [b.block_id for b in blocks]

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Offer the blocks that the first ``num_tokens`` tokens fill to the index."""
        rid = request.request_id
        done = self.num_cached[rid]
        hashed = len(request.block_hashes) * self.block_size
        full = (num_tokens if num_tokens < hashed else hashed) // self.block_size
        if full > done:
            self.pool.cache_full_blocks(request, self.tables[rid], done, full, self.group_id, self.block_size)
            self.num_cached[rid] = full

    def free(self, request_id: str) -> None:
        """Release the request's blocks, last block first."""
        table = self.tables.pop(request_id, None)
        self.num_cached.pop(request_id, None)
        if table:
            self.pool.free_blocks(reversed(table))

    # -- sizes -------------------------------------------------------------------

    def max_blocks_for(self, num_tokens: int) -> int:
        """The most blocks one request of ``num_tokens`` tokens holds at once in this group."""
        return cdiv(num_tokens, self.block_size)
