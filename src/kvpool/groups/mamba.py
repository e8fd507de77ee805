"""State-space layers (Mamba, Mamba-2, gated delta nets): one recurrent state per request.

The state summarises every token so far and does not grow, so a request needs
one block in this group, whatever its length. The table still has one entry
per block position (so that positions line up with the other groups and a
cached state can be named by the hash of its prefix); every entry is the null
block except the ones holding states::

    block_size = 4, a request at 13 tokens, stepping to 17

    position      0..3 | 4..7 | 8..11 | 12..15 | 16..19
    table before    0  |   0  |   0   |  [s]   |              s: state after 13 tokens
    table after     0  |   0  |   0   |  [s]   |  [d]         d: new block for the step

The step reads the state from ``s`` (the last real block before the step) and
writes the state after it into ``d`` (the last block of the table). A step that
stays inside the last block updates that block in place. At the start of the
next step every real block except the last is given back, so a request holds
one block, and two from a step that crosses into a new block until the next
step starts. That count is :class:`kvpool.specs.MambaSpec`'s rule, which the
planner uses too; this manager's sizes ask it.

Prefix caching: states at block boundaries
------------------------------------------
A state can be reused only at exactly the prefix length it summarises. When a
step starts at ``c`` computed tokens with ``c`` a multiple of the hit
alignment, the block holding the state after those ``c`` tokens (index
``c / block_size - 1``) is entered into the prefix cache under the chained hash
of those ``c`` tokens, provided the step writes its result into a newer block
(so the cached state is never overwritten). The state is cached one step
late, when the caller has advanced ``num_computed_tokens`` past it and so
vouches that the step that produced it has run; a lookup in the same step
cannot see it. It then goes back to the pool like any released cached block:
evictable, last in line.

Only step ends that fall on a block boundary leave a cacheable state; a
scheduler that wants a prompt's prefix reusable sends prefill chunks ending on
block boundaries (decode passes every boundary). The final state of a
request that is freed is not cached.

A hit searches from the end of the candidate prefix backwards for the latest
cached state and returns it at its position, nulls before it::

    cached states at 8 and 16 tokens, candidate 19 tokens (block_size 4)
    hit = [0, 0, 0, s16]    16 tokens; the request resumes from s16
"""

from __future__ import annotations

from typing import ClassVar

from kvpool.block import NULL_BLOCK_ID, KVBlock
from kvpool.groups.base import GroupManager
from kvpool.request import Request
from kvpool.specs import MambaSpec, cdiv

__all__ = ["MambaManager"]


class MambaManager(GroupManager):
    """Holds the latest state block per request; caches states at block boundaries."""

    downward_closed: ClassVar[bool] = False
    supports_verified_index: ClassVar[bool] = False
    #: Real blocks a table may hold: the state a step reads and the one it writes.
    max_live_blocks: ClassVar[int] = MambaSpec.max_state_blocks

    spec: MambaSpec

    def _setup(self) -> None:
        # request ID -> positions of the real blocks in its table, ascending (at most two)
        self._live: dict[str, list[int]] = {}

    def num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Every token but the last: only the state after it matters."""
        return num_computed_tokens - 1 if num_computed_tokens > 1 else 0

    # -- prefix hits ---------------------------------------------------------------

    def find_longest_cache_hit(self, request: Request, max_length: int) -> list[KVBlock]:
        hashes = self.hashes_of(request)
        bs, align = self.block_size, self.alignment
        get = self.index.get
        for j in range(min(max_length // bs, len(hashes)) - 1, -1, -1):
            if (j + 1) * bs % align:
                continue
            block = get(hashes[j])
            if block is not None:
                return [self.null_block] * j + [block]
        return []

    # -- the running state ------------------------------------------------------------

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Give back every real block but the last (older states), newest first."""
        live = self._live.get(request_id)
        if not live or len(live) < 2:
            return
        table = self.tables[request_id]
        freed = [table[k] for k in reversed(live[:-1])]
        for k in live[:-1]:
            table[k] = self.null_block
        del live[:-1]
        self.pool.free_blocks(freed)

    def num_blocks_to_allocate(
        self, request_id: str, num_tokens: int, hit_blocks: list[KVBlock], num_computed_tokens: int
    ) -> int:
        required = cdiv(num_tokens, self.block_size)
        table = self.tables.get(request_id)
        if table is not None:
            return 1 if required > len(table) else 0
        new = 1 if required > len(hit_blocks) else 0
        evictable = 1 if hit_blocks and hit_blocks[-1].block_id and hit_blocks[-1].ref_cnt == 0 else 0
        return new + evictable

    def add_hit_blocks(self, request_id: str, hit_blocks: list[KVBlock], num_computed_tokens: int) -> None:
        table = list(hit_blocks)
        live = []
        if table and table[-1].block_id != NULL_BLOCK_ID:
            self.pool.touch(table[-1:])
            live.append(len(table) - 1)
        self.tables[request_id] = table
        self._live[request_id] = live
        self.num_cached[request_id] = len(table)

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> list[KVBlock]:
        table = self.tables.get(request_id)
        if table is None:
            table = self.tables[request_id] = []
            self._live[request_id] = []
            self.num_cached[request_id] = 0
        required = cdiv(num_tokens, self.block_size)
        if required <= len(table):
            return []
        blocks = self.pool.get_new_blocks(1)
        table.extend([self.null_block] * (required - 1 - len(table)))
        table.append(blocks[0])
        self._live[request_id].append(required - 1)
        return blocks

    def grow(self, request_id: str, num_computed_tokens: int, num_tokens: int) -> list[int] | None:
        self.remove_skipped_blocks(request_id, num_computed_tokens)
        if cdiv(num_tokens, self.block_size) <= len(self.tables[request_id]):
            return []
        if self.pool.free_queue.num_free_blocks < 1:
            return None
        return [b.block_id for b in self.allocate_new_blocks(request_id, num_tokens)]

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Cache the state the step starts from, if it sits on a boundary and is not written again."""
        rid = request.request_id
        computed = request.num_computed_tokens
        if computed == 0 or computed % self.alignment:
            return
        table = self.tables[rid]
        k = computed // self.block_size - 1
        if k >= len(table) - 1 or k < self.num_cached[rid]:
            return  # the step writes this block in place, or it was looked at already
        block = table[k]
        if block.block_id != NULL_BLOCK_ID and block.block_hash is None and k < len(self.hashes_of(request)):
            self._cache_range(request, table, k, k + 1)
        self.num_cached[rid] = k + 1

    def free(self, request_id: str) -> None:
        """Release the state blocks, the newest first."""
        table = self.tables.pop(request_id, None)
        live = self._live.pop(request_id, None)
        self.num_cached.pop(request_id, None)
        if table and live:
            self.pool.free_blocks([table[k] for k in reversed(live)])

    # -- sizes -------------------------------------------------------------------

    def blocks_held_after(self, num_computed_tokens: int, num_tokens: int) -> int:
        """The spec's count: two after a step from a state into a new block position, else one."""
        return self.spec.blocks_held_after(num_computed_tokens, num_tokens)

    def live_positions(self, request_id: str) -> tuple[int, ...]:
        """Positions of the real blocks in the request's table (for checks and tests)."""
        return tuple(self._live.get(request_id, ()))
