"""The free block queue: vLLM's eviction order, as one free list.

The free queue holds every block with ``ref_cnt == 0``. Its order *is* the
eviction policy: new data always takes the block at the front, and a block
that still carries a hash is evicted from the prefix cache only at that
moment (lazy eviction).

::

    head <-> [uncached, tail first] <-> [never used, by ID] <-> [cached, LRU] <-> tail
             ^ reused first                                     ^ reused last

* A released block with no hash (a partial block, or caching off) goes to the
  front: its contents can never be looked up, so reusing it costs nothing.
* A released block with a hash goes to the back. A request's blocks are
  released from its end backwards, so its deepest blocks are queued ahead of
  its first ones and the shared prefix is evicted last.
* A prefix hit on a free block pulls it out of the middle.

The whole policy is those three rules on one
:class:`~kvpool.linked_blocks.FreeList` built over the pool: its never-used
range starts between the sentinels, so it stays after everything prepended
and before everything appended, which is exactly where vLLM's queue keeps
blocks it has not handed out yet.
"""

from __future__ import annotations

from collections.abc import Iterator

from kvpool.block import KVBlock
from kvpool.linked_blocks import FreeList

__all__ = ["FreeBlockQueue"]


class FreeBlockQueue(FreeList):
    """vLLM's eviction order: one free list, uncached blocks in front, cached at the back.

    Args:
        blocks: the pool's list of block records, indexed by block ID. It holds
            records for IDs below ``len(blocks)``; the queue appends a record
            each time it hands out a never-used block.
        num_blocks: total number of block IDs in the pool. IDs from
            ``len(blocks)`` up to ``num_blocks - 1`` start free, in ID order.

    The list operations are the pool's hot path, so they are the
    :class:`~kvpool.linked_blocks.FreeList` methods themselves, not wrappers:
    ``popleft_n``/``prepend_n``/``append_n`` are O(k) for k blocks, ``remove``
    is O(1), ``num_free_blocks`` is an attribute. ``materialised_free_blocks``
    and ``block_ids`` walk front to back (reused first to reused last).
    """

    __slots__ = ()

    def take(self, n: int) -> list[KVBlock]:
        """Alias of :meth:`popleft_n`."""
        return self.popleft_n(n)

    def release(self, reuse_first: list[KVBlock], reuse_last: list[KVBlock]) -> None:
        """Return freed blocks: ``reuse_first`` (uncached) to the front, ``reuse_last`` (cached) to the back."""
        self.prepend_n(reuse_first)
        self.append_n(reuse_last)

    def materialised_free_blocks(self) -> Iterator[KVBlock]:
        """The blocks that have records, front to back (the never-used range is skipped)."""
        return iter(self)
