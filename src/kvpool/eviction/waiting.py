"""Waiting-aware eviction: keep the prefixes that queued requests are about to look up.

Policy. :class:`~kvpool.eviction.frequency.FrequencyAgedQueue`'s order, plus
one rule: a free cached block whose hash belongs to a *waiting* request is
*protected* and is handed out only after every unprotected block (uncached,
never used, and every frequency class). Protected blocks among themselves go
oldest protection first.

Hints. A scheduler knows which requests wait for admission; it passes them
with :meth:`kvpool.KVCacheManager.note_waiting`, which hashes each request
once and calls :meth:`WaitingAwareQueue.note_waiting` with ``{request ID:
block hashes}``. Each call *replaces* the waiting set; the queue applies only
the difference (requests that left lose their protection, new ones gain it),
so a scheduler can simply call it every step. A hash is protected while at
least one waiting request names it; a request's hashes are read when it first
appears in the set.

When protection ends, a block still free returns to its frequency class as if
released at that moment (it was wanted until then).

Parents stay before children: a request names every hash of its prompt, so a
protected child's parent is protected too; unprotected blocks follow the
frequency order's rules.

Complexity: ``note_waiting`` O(requests that joined or left x their blocks) +
O(size of the waiting set) to find them; protecting or unprotecting one hash
O(1) (one free block per hash is tracked, which suffices: the index serves a
hash as long as any copy is cached). Every free-queue operation keeps the base
policy's cost plus one dict operation per cached block.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

from kvpool.block import KVBlock
from kvpool.errors import InvariantViolation
from kvpool.eviction.frequency import DEFAULT_WEIGHTS, FrequencyAgedQueue
from kvpool.hashing import BlockHash

__all__ = ["WaitingAwareQueue"]


class WaitingAwareQueue(FrequencyAgedQueue):
    """Frequency-aged order with protection for waiting requests' prefixes.

    Args:
        blocks, num_blocks, weights, ghost_capacity: as for
            :class:`~kvpool.eviction.frequency.FrequencyAgedQueue`.

    List ``K`` (after every frequency class) holds the protected free blocks.
    """

    __slots__ = ("_protected", "_hints", "_free_by_hash")

    def __init__(
        self,
        blocks: list[KVBlock],
        num_blocks: int,
        *,
        weights: Sequence[int] = DEFAULT_WEIGHTS,
        ghost_capacity: int | None = None,
    ) -> None:
        super().__init__(blocks, num_blocks, weights=weights, ghost_capacity=ghost_capacity)
        #: hash -> number of waiting requests naming it
        self._protected: dict[BlockHash, int] = {}
        #: request ID -> the hashes it was protected with
        self._hints: dict[str, tuple[BlockHash, ...]] = {}
        #: hash -> one free cached block holding it (validated on use)
        self._free_by_hash: dict[BlockHash, KVBlock] = {}

    # -- hints -------------------------------------------------------------------------

    def note_waiting(self, waiting: Mapping[str, Sequence[BlockHash]]) -> None:
        """Make ``waiting`` (request ID -> block hashes) the protected set; apply the difference."""
        hints = self._hints
        for request_id in [rid for rid in hints if rid not in waiting]:
            for block_hash in hints.pop(request_id):
                self._unprotect(block_hash)
        for request_id, hashes in waiting.items():
            if request_id not in hints:
                frozen = tuple(hashes)
                hints[request_id] = frozen
                for block_hash in frozen:
                    self._protect(block_hash)

    @property
    def num_protected_hashes(self) -> int:
        """Distinct hashes named by waiting requests."""
        return len(self._protected)

    def _tracked(self, block_hash: BlockHash) -> KVBlock | None:
        """The free cached block tracked for ``block_hash``, dropping a stale entry."""
        block = self._free_by_hash.get(block_hash)
        if block is None:
            return None
        if block.block_hash != block_hash or self._where[block.block_id] < 0:
            del self._free_by_hash[block_hash]
            if self._where[block.block_id] == self._k:  # its hash was cleared (a cache reset)
                self._unlink(block)
                self._append(block, 0)
            return None
        return block

    def _protect(self, block_hash: BlockHash) -> None:
        count = self._protected.get(block_hash, 0)
        self._protected[block_hash] = count + 1
        if count:
            return
        block = self._tracked(block_hash)
        if block is not None and self._where[block.block_id] < self._k:
            self._unlink(block)
            self._append(block, self._k)

    def _unprotect(self, block_hash: BlockHash) -> None:
        count = self._protected[block_hash] - 1
        if count:
            self._protected[block_hash] = count
            return
        del self._protected[block_hash]
        block = self._tracked(block_hash)
        if block is not None and self._where[block.block_id] == self._k:
            self._unlink(block)
            cls = self.use_count(block) - 1
            self._append(block, min(max(cls, 0), self._k - 1))

    # -- hooks of the base policy ------------------------------------------------------

    def _place_cached(self, blocks: list[KVBlock], classes: list[int]) -> None:
        """Released cached blocks: protected hashes to the protected list, the rest to their class."""
        protected, by_hash, last = self._protected, self._free_by_hash, self._k
        lists, where, stamp, clock = self._lists, self._where, self._stamp, self._clock
        for block, cls in zip(blocks, classes, strict=True):
            block_hash = block.block_hash
            # Only the tracked copy of a hash is protected (a duplicate would stay
            # protected with no way to find it when protection ends).
            if block_hash is not None and by_hash.setdefault(block_hash, block) is block and block_hash in protected:
                cls = last
            lists[cls].append(block)
            bid = block.block_id
            where[bid] = cls
            stamp[bid] = clock

    def _untrack(self, block: KVBlock) -> None:
        owner = self._owner[block.block_id]
        if owner is not None and self._free_by_hash.get(owner) is block:
            del self._free_by_hash[owner]

    def remove(self, block: KVBlock) -> None:
        """Take a free block out (a prefix hit). O(1)."""
        super().remove(block)
        self._untrack(block)

    def _forget_all(self, blocks: list[KVBlock]) -> None:
        for block in blocks:
            self._untrack(block)
        super()._forget_all(blocks)

    def _take_last_resort(self, n: int, out: list[KVBlock]) -> int:
        """Protected blocks, oldest protection first, once nothing else is left."""
        protected = self._lists[self._k]
        taken = min(n, protected.num_free_blocks)
        if taken:
            out.extend(protected.popleft_n(taken))
        return taken

    def _last_resort_order(self) -> Iterator[KVBlock]:
        return self._walk(self._k)

    def check(self) -> None:
        """The base checks, plus: protection counts match the hints, and every
        protected free block holds a protected hash (O(n + hinted hashes))."""
        super().check()
        counts: dict[BlockHash, int] = {}
        for hashes in self._hints.values():
            for block_hash in hashes:
                counts[block_hash] = counts.get(block_hash, 0) + 1
        if counts != self._protected:
            raise InvariantViolation("protection counts disagree with the waiting requests' hashes")
        for block in self._walk(self._k):
            if block.block_hash is not None and block.block_hash not in self._protected:
                raise InvariantViolation(f"block {block.block_id} is protected but no waiting request names it")
            if block.block_hash is not None and self._free_by_hash.get(block.block_hash) is not block:
                raise InvariantViolation(f"protected block {block.block_id} is not the tracked copy of its hash")
