"""Full attention: every token attends to every earlier token.

The group keeps every block of a request until it finishes, and a prefix hit
walks the block hashes from the first block and stops at the first miss.
These are the defaults of :class:`GroupManager`; MLA layers follow the same
rules (one latent per token instead of K and V changes only the bytes).

Only a step's own block boundaries change anything: a decode step needs a
new block once every ``block_size`` tokens and fills one (to cache) once
every ``block_size`` tokens, so :meth:`FullAttentionManager.step` tells the
manager how far it may go without calling again.
"""

from __future__ import annotations

from kvpool.groups.base import GroupManager
from kvpool.request import Request

__all__ = ["FullAttentionManager"]


class FullAttentionManager(GroupManager):
    """Keeps every block; hits are prefixes from the first block."""

    def step(self, request: Request, num_computed_tokens: int, num_tokens: int) -> tuple[list[int] | None, int]:
        """:meth:`GroupManager.step` in one pass, with a quiet bound.

        A step to ``t`` tokens takes blocks only when ``t`` passes the table's
        last slot, and caches only when ``t`` reaches the end of the first
        block not yet offered to the index, so every step to fewer tokens than
        both is a no-op::

            table of 3 blocks (size 4), 2 cached     tokens 9..11: quiet
            |0000|1111|22..|                         12: block 2 fills, cache it
                                                     13: a new block
        """
        rid = request.request_id
        table = self.tables[rid]
        bs = self.block_size
        missing = -(-num_tokens // bs) - len(table)  # cdiv, inlined: the decode path
        new: list[int] = []
        if missing > 0:
            pool = self.pool
            if missing > pool.free_queue.num_free_blocks:
                return None, 0
            blocks = pool.get_new_blocks(missing)
            table.extend(blocks)
            new = [b.block_id for b in blocks]
        quiet = len(table) * bs + 1
        if self.enable_caching:
            self.cache_blocks(request, num_tokens)
            due = (self.num_cached[rid] + 1) * bs
            if due < quiet:
                quiet = due
        return new, quiet
