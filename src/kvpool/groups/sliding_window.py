"""Sliding-window attention: a token attends to the last ``window`` tokens, itself included.

The window of the next token
----------------------------
With ``c`` tokens computed, the next token (position ``c``) reads positions
``c - window + 1 .. c``. Everything before is *skipped*::

    window = 4, block_size = 2, c = 7

    position   0  1 | 2  3 | 4  5 | 6  7
    block        0  |   1  |   2  |   3
                            ^^^^^^^^^^^^ window of token 7: positions 4..7
               \\_skipped_/
    num_skipped_tokens(7) = 7 - 4 + 1 = 4  ->  blocks 0 and 1 go back to the pool

A running request gives back the blocks wholly inside the skipped tokens at
the start of each step and the null block takes their place, so the table
keeps its positions::

    table before   [ 5 | 6 | 7 | 8 ]
    table after    [ 0 | 0 | 7 | 8 ]     blocks 6, 5 released (the last one first)

A step that computes many tokens at once still needs every block it writes;
blocks leave only as the window moves past them.

Prefix hits
-----------
A hit of ``L`` tokens needs only the blocks covering the window before
position ``L``: ``cdiv(window - 1, block_size)`` contiguous cached blocks
ending at block ``L / block_size - 1``. The search therefore starts at the end
of the candidate prefix and walks backwards until it has seen that many
cached blocks in a row; the positions before them are returned as the null
block::

    window = 5, block_size = 2: a hit needs cdiv(4, 2) = 2 blocks in a row

    block       0    1    2    3    4    5
    cached?     y    n    y    n    y    y      <- scanned right to left
    hit         0    0    0    0  [b4] [b5]     12 tokens, two real blocks

A run of cached blocks that reaches block 0 is a hit even when it is shorter
than the window: no token precedes the prompt. Hits end on a multiple of the
coordinator's alignment; a run may not start (from the right) at a block
that ends off it.
"""

from __future__ import annotations

from typing import ClassVar

from kvpool.block import KVBlock
from kvpool.groups.base import GroupManager
from kvpool.request import Request
from kvpool.specs import SlidingWindowSpec, cdiv

__all__ = ["SlidingWindowManager"]


class SlidingWindowManager(GroupManager):
    """Keeps the blocks covering the window; hits search from the end of the prefix."""

    downward_closed: ClassVar[bool] = False
    supports_verified_index: ClassVar[bool] = False

    spec: SlidingWindowSpec

    def _setup(self) -> None:
        self.sliding_window: int = self.spec.sliding_window
        #: Contiguous cached blocks a hit needs before its end.
        self.blocks_for_hit = cdiv(self.sliding_window - 1, self.block_size)

    def num_skipped_tokens(self, num_computed_tokens: int) -> int:
        skipped = num_computed_tokens - self.sliding_window + 1
        return skipped if skipped > 0 else 0

    def find_longest_cache_hit(self, request: Request, max_length: int) -> list[KVBlock]:
        hashes = self.hashes_of(request)
        bs, align, need = self.block_size, self.alignment, self.blocks_for_hit
        get = self.index.get
        run: list[KVBlock] = []  # the current run of cached blocks, right to left
        for i in range(min(max_length // bs, len(hashes)) - 1, -1, -1):
            block = get(hashes[i])
            if block is None:
                run.clear()
                continue
            if not run and align != bs and (i + 1) * bs % align:
                continue  # a hit cannot end here
            run.append(block)
            if len(run) >= need:
                run.reverse()
                return [self.null_block] * i + run
        # No run as long as the window: only a run that reaches block 0 is a hit.
        run.reverse()
        while run and len(run) * bs % align:
            run.pop()
        return run

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Cache the full blocks a hit could use: the last ones before each aligned end.

        A hit ends on a multiple of the alignment and reads ``blocks_for_hit``
        blocks before it, so of each aligned segment of ``alignment /
        block_size`` blocks only the last ``blocks_for_hit`` are cached (all of
        them when the window spans a segment; none with a one-token window)::

            block_size 2, alignment 8 (segments of 4 blocks), window 3 -> 1 block
            blocks     0  1  2 [3] 4  5  6 [7] 8 ...      [k]: cached
        """
        per_segment = self.alignment // self.block_size
        need = self.blocks_for_hit
        if need >= per_segment:
            super().cache_blocks(request, num_tokens)
            return
        rid = request.request_id
        done = self.num_cached[rid]
        full = min(num_tokens // self.block_size, len(request._block_hashes) // self.hash_stride)
        if full <= done:
            return
        if need:
            table = self.tables[rid]
            for segment in range(done // per_segment * per_segment, full, per_segment):
                start = max(done, segment + per_segment - need)
                stop = min(full, segment + per_segment)
                if start < stop:
                    self._cache_range(request, table, start, stop)
        self.num_cached[rid] = full

    def grow(self, request_id: str, num_computed_tokens: int, num_tokens: int) -> list[int] | None:
        self.remove_skipped_blocks(request_id, num_computed_tokens)
        return super().grow(request_id, num_computed_tokens, num_tokens)
