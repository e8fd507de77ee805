"""The free block queue: vLLM's eviction order, as a linked list.

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

The list is threaded through the block records (``prev_free``/``next_free``)
between two sentinels that are never removed, so every operation is O(1) per
block, does no list scans and allocates nothing.

Blocks that were never handed out are not materialised: they are one range of
IDs represented by a single marker node in the list, so building a pool of a
million blocks costs the same as building one of ten. The marker sits where
those blocks would be (after anything prepended, before anything appended) and
hands out records in ID order as they are taken.
"""

from __future__ import annotations

from collections.abc import Iterator

from kvpool.block import KVBlock
from kvpool.errors import InvariantViolation

__all__ = ["FreeBlockQueue"]


class FreeBlockQueue:
    """Doubly linked free list with sentinels and a lazily materialised tail.

    Args:
        blocks: the pool's list of block records, indexed by block ID. It holds
            records for IDs below ``len(blocks)``; the queue appends a record
            each time it hands out a never-used block.
        num_blocks: total number of block IDs in the pool. IDs from
            ``len(blocks)`` up to ``num_blocks - 1`` start free, in ID order.

    Complexity: ``popleft_n``/``prepend_n``/``append_n`` are O(k) for k blocks,
    ``remove`` is O(1), ``num_free_blocks`` is an attribute.
    """

    __slots__ = ("num_free_blocks", "_head", "_tail", "_fresh", "_blocks", "_next_fresh", "_end")

    def __init__(self, blocks: list[KVBlock], num_blocks: int) -> None:
        self._blocks = blocks
        self._next_fresh = len(blocks)
        self._end = num_blocks
        self._head = KVBlock(-1)
        self._tail = KVBlock(-1)
        self._fresh = KVBlock(-2)  # stands for the never-used ID range
        self.num_free_blocks = num_blocks - self._next_fresh
        if self.num_free_blocks > 0:
            self._link_between(self._fresh, self._head, self._tail)
        else:
            self._head.next_free = self._tail
            self._tail.prev_free = self._head

    @staticmethod
    def _link_between(node: KVBlock, before: KVBlock, after: KVBlock) -> None:
        before.next_free = node
        node.prev_free = before
        node.next_free = after
        after.prev_free = node

    # -- the eviction-policy interface used by the block pool ------------------

    def popleft_n(self, n: int) -> list[KVBlock]:
        """Take ``n`` blocks from the front, in queue order."""
        if n > self.num_free_blocks or n < 0:
            raise InvariantViolation(f"asked the free queue for {n} blocks, it holds {self.num_free_blocks}")
        self.num_free_blocks -= n
        out: list[KVBlock] = []
        head, fresh = self._head, self._fresh
        node = head.next_free
        while n:
            if node is fresh:
                start = self._next_fresh
                stop = min(self._end, start + n)
                new = [KVBlock(i) for i in range(start, stop)]
                self._blocks.extend(new)
                out.extend(new)
                n -= stop - start
                self._next_fresh = stop
                if stop == self._end:  # the never-used range is exhausted
                    nxt = fresh.next_free
                    fresh.prev_free = fresh.next_free = None
                    node = nxt
            else:
                nxt = node.next_free
                node.prev_free = node.next_free = None
                out.append(node)
                node = nxt
                n -= 1
        head.next_free = node
        node.prev_free = head  # type: ignore[union-attr]
        return out

    take = popleft_n

    def remove(self, block: KVBlock) -> None:
        """Unlink a free block from anywhere in the queue (a prefix hit)."""
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise InvariantViolation(f"block {block.block_id} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def prepend_n(self, blocks: list[KVBlock]) -> None:
        """Put blocks at the front, keeping their order: ``blocks[0]`` is reused first."""
        if not blocks:
            return
        prev = self._head
        first = prev.next_free
        for block in blocks:
            prev.next_free = block
            block.prev_free = prev
            prev = block
        prev.next_free = first
        first.prev_free = prev  # type: ignore[union-attr]
        self.num_free_blocks += len(blocks)

    def append_n(self, blocks: list[KVBlock]) -> None:
        """Put blocks at the back, keeping their order: ``blocks[-1]`` is reused last."""
        if not blocks:
            return
        tail = self._tail
        prev = tail.prev_free
        for block in blocks:
            prev.next_free = block  # type: ignore[union-attr]
            block.prev_free = prev
            prev = block
        prev.next_free = tail  # type: ignore[union-attr]
        tail.prev_free = prev
        self.num_free_blocks += len(blocks)

    def release(self, reuse_first: list[KVBlock], reuse_last: list[KVBlock]) -> None:
        """Return freed blocks: ``reuse_first`` (uncached) to the front, ``reuse_last`` (cached) to the back."""
        self.prepend_n(reuse_first)
        self.append_n(reuse_last)

    # -- inspection ------------------------------------------------------------

    def block_ids(self) -> Iterator[int]:
        """Block IDs from the front (reused first) to the back. O(free blocks)."""
        node = self._head.next_free
        tail, fresh = self._tail, self._fresh
        while node is not tail:
            if node is fresh:
                yield from range(self._next_fresh, self._end)
            else:
                yield node.block_id  # type: ignore[union-attr]
            node = node.next_free  # type: ignore[union-attr]

    def materialised_free_blocks(self) -> Iterator[KVBlock]:
        """The free blocks that have records, front to back (skips the never-used range)."""
        node = self._head.next_free
        tail, fresh = self._tail, self._fresh
        while node is not tail:
            if node is not fresh:
                yield node  # type: ignore[misc]
            node = node.next_free  # type: ignore[union-attr]

    @property
    def num_never_used(self) -> int:
        """How many block IDs have never been handed out."""
        return self._end - self._next_fresh

    def check(self) -> None:
        """Verify the links in O(n): both directions agree and the count matches."""
        seen = 0
        node = self._head
        limit = self.num_free_blocks + 2
        while node is not self._tail:
            nxt = node.next_free
            if nxt is None or nxt.prev_free is not node:
                raise InvariantViolation(f"free queue links broken after block {node.block_id}")
            if nxt is self._fresh:
                seen += self._end - self._next_fresh
            elif nxt is not self._tail:
                seen += 1
            node = nxt
            limit -= 1
            if limit < 0:
                raise InvariantViolation("free queue is longer than its count (a cycle or a lost count)")
        if seen != self.num_free_blocks:
            raise InvariantViolation(f"free queue holds {seen} blocks, its count says {self.num_free_blocks}")
        if (self._fresh.next_free is not None) != (self._next_fresh < self._end):
            raise InvariantViolation("never-used marker is linked while its range is empty, or the reverse")
