"""Free lists: doubly linked lists threaded through the block records.

Every eviction policy keeps its free blocks in one or more :class:`FreeList`
objects and differs only in *which* list a block joins and *which* list it
is taken from; the list mechanics live here, once.

::

    head <-> block <-> block <-> [never used: IDs a..b-1] <-> block <-> tail

* The links are the records' own ``prev_free``/``next_free`` fields, so
  moving a block allocates nothing and removing it from the middle is O(1).
* ``head`` and ``tail`` are sentinels that never leave the list: no operation
  tests for an empty list or for the ends, and a block is in *some* list
  exactly when its links are set (``None`` means not free).
* Block IDs that were never handed out are not materialised: one marker node
  stands for the whole range ``[next, end)`` and hands out records in ID
  order as they are taken, so a list over a million blocks costs the same to
  build as one over ten. Only a list built with ``num_blocks > len(blocks)``
  has the range; its marker starts between the sentinels, so blocks
  prepended later go before it and blocks appended later go after it.

Every list keeps its own count (never-used IDs included), so a policy built
on a single list reads its size as an attribute.
"""

from __future__ import annotations

from collections.abc import Iterator

from kvpool.block import KVBlock
from kvpool.checks import check_int
from kvpool.errors import ConfigError, InvariantViolation

__all__ = ["FreeList"]

#: Block ID of the head and tail sentinels (never a real block: IDs start at 0).
_SENTINEL_ID = -1
#: Block ID of the never-used range marker.
_NEVER_USED_ID = -2


class FreeList:
    """A doubly linked list of free blocks between two sentinels.

    Args:
        blocks: the pool's block records, indexed by block ID. The list appends
            a record each time it hands out a never-used block.
        num_blocks: IDs from ``len(blocks)`` to ``num_blocks - 1`` start in the
            list as its never-used range, in ID order. ``len(blocks)`` builds an
            empty list.

    Attributes:
        num_free_blocks: blocks in the list, never-used IDs included.

    Complexity: ``append``/``remove`` O(1); ``append_n``/``prepend_n``/
    ``popleft_n``/``popleft_run`` O(k) for k blocks; iteration and ``check``
    O(blocks in the list). Nothing here scans, and steady-state operations
    allocate only the lists they return.

    Order: a block keeps its place until it leaves; ``append*`` add at the
    back, ``prepend_n`` at the front, ``popleft*`` take from the front, so a
    caller that always appends in non-decreasing order of some key keeps the
    list sorted by it (what :meth:`popleft_run` relies on).
    """

    __slots__ = ("num_free_blocks", "head", "tail", "_fresh", "_blocks", "_next_fresh", "_end")

    def __init__(self, blocks: object, num_blocks: object) -> None:
        # Checked as objects before the typed fields see them (a compiled build would raise its own TypeError).
        if type(blocks) is not list or not all(type(block) is KVBlock for block in blocks):
            raise ConfigError(f"blocks must be the pool's list of KVBlock records, got {blocks!r}")
        self._blocks: list[KVBlock] = blocks
        self._next_fresh = len(blocks)
        self._end = check_int("num_blocks", num_blocks, minimum=len(blocks))
        # Sentinels are plain records: something always follows the head and precedes the tail,
        # so their links are never None once set (the reads below say so to the type checker).
        head = self.head = KVBlock(_SENTINEL_ID)
        tail = self.tail = KVBlock(_SENTINEL_ID)
        self._fresh = KVBlock(_NEVER_USED_ID)
        self.num_free_blocks = self._end - self._next_fresh
        if self.num_free_blocks > 0:
            fresh = self._fresh
            head.next_free = fresh
            fresh.prev_free = head
            fresh.next_free = tail
            tail.prev_free = fresh
        else:
            head.next_free = tail
            tail.prev_free = head

    # -- adding ------------------------------------------------------------------

    def append(self, block: KVBlock) -> None:
        """Put one block at the back. O(1)."""
        tail = self.tail
        prev: KVBlock = tail.prev_free  # type: ignore[assignment]  # a sentinel always has a neighbour
        prev.next_free = block
        block.prev_free = prev
        block.next_free = tail
        tail.prev_free = block
        self.num_free_blocks += 1

    def append_n(self, blocks: list[KVBlock]) -> None:
        """Put blocks at the back, keeping their order: ``blocks[-1]`` ends up last. O(k)."""
        if not blocks:
            return
        tail = self.tail
        prev: KVBlock = tail.prev_free  # type: ignore[assignment]  # a sentinel always has a neighbour
        for block in blocks:
            prev.next_free = block
            block.prev_free = prev
            prev = block
        prev.next_free = tail
        tail.prev_free = prev
        self.num_free_blocks += len(blocks)

    def prepend_n(self, blocks: list[KVBlock]) -> None:
        """Put blocks at the front, keeping their order: ``blocks[0]`` ends up first. O(k)."""
        if not blocks:
            return
        head = self.head
        first: KVBlock = head.next_free  # type: ignore[assignment]  # a sentinel always has a neighbour
        prev: KVBlock = head
        for block in blocks:
            prev.next_free = block
            block.prev_free = prev
            prev = block
        prev.next_free = first
        first.prev_free = prev
        self.num_free_blocks += len(blocks)

    # -- taking ------------------------------------------------------------------

    def remove(self, block: KVBlock) -> None:
        """Unlink one block from wherever it is in the list. O(1).

        Raises:
            InvariantViolation: the block is in no list (its links are unset).
        """
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise InvariantViolation(f"block {block.block_id} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def popleft_n(self, n: int) -> list[KVBlock]:
        """Take ``n`` blocks from the front, in list order, materialising never-used
        ones in ID order when the front reaches their range. O(n).

        Raises:
            InvariantViolation: fewer than ``n`` blocks (or ``n < 0``).
        """
        if n > self.num_free_blocks or n < 0:
            raise InvariantViolation(f"asked the free queue for {n} blocks, it holds {self.num_free_blocks}")
        self.num_free_blocks -= n
        out: list[KVBlock] = []
        head, fresh = self.head, self._fresh
        node: KVBlock = head.next_free  # type: ignore[assignment]  # a sentinel always has a neighbour
        while len(out) < n:
            # A run of linked blocks, up to the never-used marker (``range`` and ``out.append``:
            # native in the compiled build, specialised by the interpreter)...
            for _ in range(n - len(out)):
                if node is fresh:
                    break
                nxt = node.next_free
                node.prev_free = node.next_free = None
                out.append(node)
                node = nxt  # type: ignore[assignment]  # a linked node's next is never None
            else:
                break
            # ...then never-used IDs in order, materialised as one run.
            start = self._next_fresh
            stop = min(self._end, start + n - len(out))
            new = [KVBlock(i) for i in range(start, stop)]
            self._blocks.extend(new)
            out.extend(new)
            self._next_fresh = stop
            if stop == self._end:  # the never-used range is exhausted
                nxt = fresh.next_free
                fresh.prev_free = fresh.next_free = None
                node = nxt  # type: ignore[assignment]  # a linked node's next is never None
        head.next_free = node
        node.prev_free = head
        return out

    def popleft_run(self, n: int, out: list[KVBlock], keys: list[int], last_key: int) -> int:
        """Move up to ``n`` blocks from the front to ``out`` while ``keys[block_id] <= last_key``;
        return how many moved. O(moved).

        For lists kept in non-decreasing key order (release times, say) this is
        "everything up to ``last_key``, oldest first". Lists with a never-used
        range must use :meth:`popleft_n`: the marker has no key.
        """
        head, tail = self.head, self.tail
        node: KVBlock = head.next_free  # type: ignore[assignment]  # a sentinel always has a neighbour
        taken = 0
        while taken < n and node is not tail and keys[node.block_id] <= last_key:
            nxt = node.next_free
            node.prev_free = node.next_free = None
            out.append(node)
            node = nxt  # type: ignore[assignment]  # a linked node's next is never None
            taken += 1
        head.next_free = node
        node.prev_free = head
        self.num_free_blocks -= taken
        return taken

    # -- inspection --------------------------------------------------------------

    def __iter__(self) -> Iterator[KVBlock]:
        """The blocks that have records, front to back (skips the never-used range)."""
        tail, fresh = self.tail, self._fresh
        node: KVBlock = self.head.next_free  # type: ignore[assignment]  # a sentinel always has a neighbour
        while node is not tail:
            if node is not fresh:
                yield node
            nxt = node.next_free
            if nxt is None:
                raise InvariantViolation(f"free list ends at block {node.block_id} before its tail")
            node = nxt

    def block_ids(self) -> Iterator[int]:
        """Every block ID in the list, front to back, never-used ones included. O(n)."""
        tail, fresh = self.tail, self._fresh
        node: KVBlock = self.head.next_free  # type: ignore[assignment]  # a sentinel always has a neighbour
        while node is not tail:
            if node is fresh:
                yield from range(self._next_fresh, self._end)
            else:
                yield node.block_id
            nxt = node.next_free
            if nxt is None:
                raise InvariantViolation(f"free list ends at block {node.block_id} before its tail")
            node = nxt

    @property
    def num_never_used(self) -> int:
        """How many block IDs of the range have never been handed out."""
        return self._end - self._next_fresh

    def check(self, name: str = "free queue") -> None:
        """Verify the list in O(n): links agree both ways, the count matches, and
        the never-used marker is linked exactly while its range is non-empty.
        ``name`` labels the list in the error."""
        seen = 0
        node: KVBlock = self.head
        tail, fresh = self.tail, self._fresh
        limit = self.num_free_blocks + 2
        while node is not tail:
            nxt = node.next_free
            if nxt is None or nxt.prev_free is not node:
                raise InvariantViolation(f"{name} links broken after block {node.block_id}")
            if nxt is fresh:
                seen += self._end - self._next_fresh
            elif nxt is not tail:
                seen += 1
            node = nxt
            limit -= 1
            if limit < 0:
                raise InvariantViolation(f"{name} is longer than its count (a cycle or a lost count)")
        if seen != self.num_free_blocks:
            raise InvariantViolation(f"{name} holds {seen} blocks, its count says {self.num_free_blocks}")
        if (fresh.next_free is not None) != (self._next_fresh < self._end):
            raise InvariantViolation(f"{name}: never-used marker is linked while its range is empty, or the reverse")
