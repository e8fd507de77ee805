"""Frequency-aged eviction: blocks used more often are kept proportionally longer.

Policy. Every cached free block sits in one of ``K`` *frequency classes* by
its use count ``u`` (class ``min(u, K) - 1``): a block's content is used once
when it is computed and cached, and once more per prefix hit, whether the
block was free or in use (the pool reports hits through :meth:`on_hit`). Each
class is an LRU list ordered by the logical time the block was released. The
victim is the class head with the largest *scaled age*::

    scaled_age(block) = (clock - released_at(block)) / weight[class(block)]

with ``weight = (1, 2, 3, 4)`` by default: a block used twice survives twice as
long idle as a block used once, and so on. ``clock`` counts blocks handed out
for new data, so time passes only when the cache is written (no wall-clock
time; replays are repeatable).

Why: on the Mooncake conversation trace a block seen for the first time is
used again later about 28% of the time, one on its fourth or later use about
76%, and the difference persists at long idle times. Plain
LRU keeps every block for the same idle time; scaling the age per class keeps
the likely ones longer and lets one-off blocks (a scan, a one-shot prompt) go
sooner. A one-off scan only displaces class-0 blocks, and blocks of class
``c`` only once they are ``weight[c]`` times older than the class-0 head:
scan resistance with no tuning to the working-set size.

Known weakness: growing contexts (multi-turn chats, agent loops). The newest
blocks of a live session are used once, yet they are what the next turn
reads, while often-hit prefixes of finished sessions linger; there this
policy can lose to LRU by a few points (see ``docs/eviction.md``).

History survives eviction: when a cached block is taken for new data its hash
and use count enter a *ghost* table (FIFO, ``ghost_capacity`` entries, by
default one per pool block); if the same content is cached again it resumes
that count, so a prefix that keeps coming back is recognised even if it was
evicted in between.

Parents before children. A child block is useless without its parent (a
lookup stops at the first miss), so the order must not evict a parent while
its cached child stays. Three rules keep it that way in practice:

* a request's blocks are released tail first, so in a class list a child sits
  ahead of its parent (same release time; ties keep list order);
* when scaled ages tie across classes the lower class goes first, and a
  released chain is clamped so that no block ranks above the block released
  right after it (its parent): ``class(child) <= class(parent)``;
* every hit on a child is also a hit on its parent, so a parent's count and
  release time are never below its child's.

Order of hand-out (:meth:`popleft_n`)::

    [uncached, newest first] -> [never used, by ID] -> [cached: largest scaled age first]

Complexity (``K`` classes, a constant): ``popleft_n(n)`` O(n + K x runs),
where consecutive victims from one class cost O(1) each; ``remove`` O(1);
``release``/``prepend_n``/``append_n`` O(k) for k blocks; ``on_hit`` O(k);
``block_ids`` O(n K); ``check`` O(n). Memory: four small per-block arrays plus
the ghost table.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence
from math import lcm

from kvpool.block import NULL_BLOCK_ID, KVBlock
from kvpool.errors import ConfigError, InvariantViolation
from kvpool.hashing import BlockHash

__all__ = ["DEFAULT_WEIGHTS", "FrequencyAgedQueue"]

#: Idle-time multipliers of the frequency classes (use count 1, 2, 3, 4+).
DEFAULT_WEIGHTS: tuple[int, ...] = (1, 2, 3, 4)

#: ``_where`` value of a block in no list (in use, or never materialised).
_NOWHERE = -1


class FrequencyAgedQueue:
    """Frequency classes of LRU lists, victim = largest idle time / class weight.

    Args:
        blocks: the pool's block records, indexed by ID (see
            :class:`kvpool.eviction.FreeQueuePolicy`).
        num_blocks: total block IDs; IDs from ``len(blocks)`` start free.
        weights: positive integers, one per class, non-decreasing.
        ghost_capacity: use counts remembered for evicted hashes (default:
            ``num_blocks``); 0 keeps no history.

    Lists are threaded through the block records (``prev_free``/``next_free``)
    between per-list sentinels, like the default queue. List ``K`` is reserved
    for subclasses (kept after every class); list ``K + 1`` holds uncached blocks.
    """

    __slots__ = (
        "num_free_blocks",
        "_blocks",
        "_next_fresh",
        "_end",
        "_k",
        "_mult",
        "_heads",
        "_tails",
        "_where",
        "_stamp",
        "_uses",
        "_owner",
        "_clock",
        "_ghost",
        "_ghost_capacity",
        "_uncached",
    )

    def __init__(
        self,
        blocks: list[KVBlock],
        num_blocks: int,
        *,
        weights: Sequence[int] = DEFAULT_WEIGHTS,
        ghost_capacity: int | None = None,
    ) -> None:
        weights = tuple(weights)
        if (
            not weights
            or any(type(w) is not int or w < 1 for w in weights)
            or any(a > b for a, b in zip(weights, weights[1:], strict=False))
        ):
            raise ConfigError(f"weights must be non-decreasing positive integers, got {weights!r}")
        if ghost_capacity is None:
            ghost_capacity = num_blocks
        if type(ghost_capacity) is not int or ghost_capacity < 0:
            raise ConfigError(f"ghost_capacity must be a non-negative integer, got {ghost_capacity!r}")
        self._blocks = blocks
        self._next_fresh = len(blocks)
        self._end = num_blocks
        self.num_free_blocks = max(0, num_blocks - self._next_fresh)
        k = len(weights)
        self._k = k
        scale = lcm(*weights)
        # Scaled ages compare as integers: age * (lcm / weight).
        self._mult = tuple(scale // w for w in weights)
        num_lists = k + 2
        self._heads = [KVBlock(-1) for _ in range(num_lists)]
        self._tails = [KVBlock(-1) for _ in range(num_lists)]
        for head, tail in zip(self._heads, self._tails, strict=True):
            head.next_free = tail
            tail.prev_free = head
        self._uncached = k + 1
        n = len(blocks)
        self._where = [_NOWHERE] * n
        self._stamp = [0] * n
        self._uses = [0] * n
        #: The hash the use count belongs to (a block's count restarts with new content).
        self._owner: list[BlockHash | None] = [None] * n
        self._clock = 0
        self._ghost: OrderedDict[BlockHash, int] = OrderedDict()
        self._ghost_capacity = ghost_capacity

    # -- list primitives (O(1)) --------------------------------------------------

    def _append(self, block: KVBlock, where: int) -> None:
        tail = self._tails[where]
        prev = tail.prev_free
        prev.next_free = block  # type: ignore[union-attr]
        block.prev_free = prev
        block.next_free = tail
        tail.prev_free = block
        self._where[block.block_id] = where
        self._stamp[block.block_id] = self._clock

    def _unlink(self, block: KVBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        prev.next_free = nxt  # type: ignore[union-attr]
        nxt.prev_free = prev  # type: ignore[union-attr]
        block.prev_free = block.next_free = None
        self._where[block.block_id] = _NOWHERE

    # -- use counts ----------------------------------------------------------------

    def _count_of(self, block: KVBlock) -> int:
        """The block's use count, starting it (from the ghost table) if its content is new."""
        bid = block.block_id
        block_hash = block.block_hash
        if self._owner[bid] != block_hash:
            self._owner[bid] = block_hash
            self._uses[bid] = self._ghost.pop(block_hash, 0) + 1  # type: ignore[arg-type]
        return self._uses[bid]

    def _forget_all(self, blocks: list[KVBlock]) -> None:
        """Blocks taken for new data: remember each count under its hash, then reset. O(k)."""
        owner, uses, ghost, capacity = self._owner, self._uses, self._ghost, self._ghost_capacity
        for block in blocks:
            bid = block.block_id
            block_hash = owner[bid]
            if block_hash is None:
                continue
            if capacity and block.block_hash == block_hash:
                ghost[block_hash] = uses[bid]
                ghost.move_to_end(block_hash)
                if len(ghost) > capacity:
                    ghost.popitem(last=False)
            owner[bid] = None
            uses[bid] = 0

    def on_hit(self, blocks: list[KVBlock]) -> None:
        """Count one more use of each hit block (free or in use). O(len(blocks))."""
        uses = self._uses
        for block in blocks:
            if block.block_id == NULL_BLOCK_ID or block.block_hash is None:
                continue
            self._count_of(block)
            uses[block.block_id] += 1

    def use_count(self, block: KVBlock) -> int:
        """Uses counted for the block's current content (0 if none). O(1)."""
        bid = block.block_id
        if bid >= len(self._owner) or block.block_hash is None or self._owner[bid] != block.block_hash:
            return 0
        return self._uses[bid]

    # -- the eviction-policy interface -------------------------------------------

    def _place_cached(self, blocks: list[KVBlock], classes: list[int]) -> None:
        """Append released cached blocks to their lists (subclasses may redirect some). O(k)."""
        tails, where, stamp, clock = self._tails, self._where, self._stamp, self._clock
        for block, cls in zip(blocks, classes, strict=True):
            tail = tails[cls]
            prev = tail.prev_free
            prev.next_free = block  # type: ignore[union-attr]
            block.prev_free = prev
            block.next_free = tail
            tail.prev_free = block
            where[block.block_id] = cls
            stamp[block.block_id] = clock

    def release(self, reuse_first: list[KVBlock], reuse_last: list[KVBlock]) -> None:
        """Uncached blocks to the front (``reuse_first[0]`` reused first); cached ones to their class.

        ``reuse_last`` is in eviction order, a request's blocks tail first, so
        each block's parent is the block after it; classes are clamped along
        the chain so that a child never ranks above its parent. O(k).
        """
        if reuse_first:
            self.prepend_n(reuse_first)
        if not reuse_last:
            return
        cap = self._k - 1
        owner, uses, ghost = self._owner, self._uses, self._ghost
        classes = [0] * len(reuse_last)
        for i in range(len(reuse_last) - 1, -1, -1):
            block = reuse_last[i]
            block_hash = block.block_hash
            if block_hash is None:  # appended without a hash: the lowest class
                classes[i] = 0
                continue
            bid = block.block_id
            if owner[bid] != block_hash:  # new content: start (or resume) its count
                owner[bid] = block_hash
                uses[bid] = ghost.pop(block_hash, 0) + 1 if ghost else 1
            cls = uses[bid] - 1
            if cls < cap:
                cap = cls
            classes[i] = cap
        self._place_cached(reuse_last, classes)
        self.num_free_blocks += len(reuse_last)

    def prepend_n(self, blocks: list[KVBlock]) -> None:
        """Blocks to reuse first, ``blocks[0]`` first (the uncached list's front). O(k)."""
        if not blocks:
            return
        where = self._uncached
        head = self._heads[where]
        first = head.next_free
        prev = head
        marks = self._where
        for block in blocks:
            prev.next_free = block
            block.prev_free = prev
            marks[block.block_id] = where
            prev = block
        prev.next_free = first
        first.prev_free = prev  # type: ignore[union-attr]
        self.num_free_blocks += len(blocks)

    def append_n(self, blocks: list[KVBlock]) -> None:
        """Cached blocks to keep, in eviction order (as ``release``'s ``reuse_last``). O(k)."""
        self.release([], blocks)

    def remove(self, block: KVBlock) -> None:
        """Take a free block out of whichever list holds it (a prefix hit). O(1)."""
        bid = block.block_id
        if bid >= len(self._where) or self._where[bid] == _NOWHERE or block.prev_free is None:
            raise InvariantViolation(f"block {bid} is not in the free queue")
        self._unlink(block)
        self.num_free_blocks -= 1

    def _materialise(self, n: int) -> list[KVBlock]:
        start = self._next_fresh
        stop = min(self._end, start + n)
        new = [KVBlock(i) for i in range(start, stop)]
        self._blocks.extend(new)
        count = stop - start
        self._where.extend([_NOWHERE] * count)
        self._stamp.extend([0] * count)
        self._uses.extend([0] * count)
        self._owner.extend([None] * count)
        self._next_fresh = stop
        return new

    def _pick_class(self) -> tuple[int, int, int]:
        """``(class, runner-up scaled age, runner-up class)`` of the next victim; class -1 if none."""
        clock, stamp, mult = self._clock, self._stamp, self._mult
        best = second_cls = -1
        best_v = second_v = -1
        for c in range(self._k):
            head = self._heads[c].next_free
            if head is self._tails[c]:
                continue
            v = (clock - stamp[head.block_id]) * mult[c]  # type: ignore[union-attr]
            if v > best_v:
                second_v, second_cls = best_v, best
                best_v, best = v, c
            elif v > second_v:
                second_v, second_cls = v, c
        return best, second_v, second_cls

    def _take_victims(self, n: int, out: list[KVBlock]) -> int:
        """Move up to ``n`` cached victims into ``out``; return how many. O(n + K x runs)."""
        taken = 0
        stamp, clock, where = self._stamp, self._clock, self._where
        while taken < n:
            cls, second_v, second_cls = self._pick_class()
            if cls < 0:
                break
            m = self._mult[cls]
            head, tail = self._heads[cls], self._tails[cls]
            node = head.next_free
            run = 0
            # Consecutive blocks of one class keep winning while their scaled age
            # beats the runner-up's head (ties go to the lower class).
            while taken < n and node is not tail:
                if run:
                    v = (clock - stamp[node.block_id]) * m  # type: ignore[union-attr]
                    if v < second_v or (v == second_v and second_cls < cls):
                        break
                nxt = node.next_free  # type: ignore[union-attr]
                node.prev_free = node.next_free = None  # type: ignore[union-attr]
                where[node.block_id] = _NOWHERE  # type: ignore[union-attr]
                out.append(node)  # type: ignore[arg-type]
                node = nxt
                taken += 1
                run += 1
            head.next_free = node
            node.prev_free = head  # type: ignore[union-attr]
        return taken

    def _take_last_resort(self, n: int, out: list[KVBlock]) -> int:
        """Blocks handed out only when every class is empty (subclasses' protected list)."""
        return 0

    def popleft_n(self, n: int) -> list[KVBlock]:
        """Hand out ``n`` blocks: uncached, then never used, then victims by scaled age."""
        if n > self.num_free_blocks or n < 0:
            raise InvariantViolation(f"asked the free queue for {n} blocks, it holds {self.num_free_blocks}")
        out: list[KVBlock] = []
        left = n
        uncached = self._uncached
        head, tail = self._heads[uncached], self._tails[uncached]
        node = head.next_free
        where = self._where
        while left and node is not tail:
            nxt = node.next_free  # type: ignore[union-attr]
            node.prev_free = node.next_free = None  # type: ignore[union-attr]
            where[node.block_id] = _NOWHERE  # type: ignore[union-attr]
            out.append(node)  # type: ignore[arg-type]
            node = nxt
            left -= 1
        head.next_free = node
        node.prev_free = head  # type: ignore[union-attr]
        if left and self._next_fresh < self._end:
            fresh = self._materialise(left)
            out.extend(fresh)
            left -= len(fresh)
        if left:
            left -= self._take_victims(left, out)
            if left:
                left -= self._take_last_resort(left, out)
            if left:  # pragma: no cover - the count said they were there
                raise InvariantViolation("free queue ran out of blocks its count promised")
        self._forget_all(out)
        self.num_free_blocks -= n
        self._clock += n
        return out

    take = popleft_n

    # -- inspection ------------------------------------------------------------------

    def _walk(self, where: int) -> Iterator[KVBlock]:
        node = self._heads[where].next_free
        tail = self._tails[where]
        while node is not tail:
            yield node  # type: ignore[misc]
            node = node.next_free  # type: ignore[union-attr]

    def _victim_order(self) -> Iterator[KVBlock]:
        """The cached blocks in the order :meth:`popleft_n` would take them. O(n K)."""
        clock, stamp, mult = self._clock, self._stamp, self._mult
        cursors = [self._heads[c].next_free for c in range(self._k)]
        while True:
            best, best_v = -1, -1
            for c in range(self._k):
                node = cursors[c]
                if node is self._tails[c]:
                    continue
                v = (clock - stamp[node.block_id]) * mult[c]  # type: ignore[union-attr]
                if v > best_v:
                    best, best_v = c, v
            if best < 0:
                return
            node = cursors[best]
            yield node  # type: ignore[misc]
            cursors[best] = node.next_free  # type: ignore[union-attr]

    def _last_resort_order(self) -> Iterator[KVBlock]:
        return iter(())

    def block_ids(self) -> Iterator[int]:
        """Free block IDs in hand-out order, front to back (the merge is O(n K))."""
        for block in self._walk(self._uncached):
            yield block.block_id
        yield from range(self._next_fresh, self._end)
        for block in self._victim_order():
            yield block.block_id
        for block in self._last_resort_order():
            yield block.block_id

    def materialised_free_blocks(self) -> Iterator[KVBlock]:
        """Every free block that has a record, list by list."""
        for where in range(self._k + 2):
            yield from self._walk(where)

    @property
    def num_never_used(self) -> int:
        return self._end - self._next_fresh

    @property
    def clock(self) -> int:
        """Blocks handed out so far (the logical time ages are measured in)."""
        return self._clock

    def check(self) -> None:
        """Verify every list in O(n): links agree both ways, membership marks match,
        release times never decrease along a list, and the count adds up."""
        seen = 0
        limit = self.num_free_blocks + 1
        for where in range(self._k + 2):
            node = self._heads[where]
            tail = self._tails[where]
            last_stamp = -1
            while node is not tail:
                nxt = node.next_free
                if nxt is None or nxt.prev_free is not node:
                    raise InvariantViolation(f"free list {where} links broken after block {node.block_id}")
                if nxt is not tail:
                    bid = nxt.block_id
                    if bid < 0 or bid >= len(self._where) or self._where[bid] != where:
                        raise InvariantViolation(f"block {bid} is in free list {where} but marked otherwise")
                    if where != self._uncached:
                        if self._stamp[bid] < last_stamp:
                            raise InvariantViolation(f"free list {where} is out of release order at block {bid}")
                        last_stamp = self._stamp[bid]
                    seen += 1
                    limit -= 1
                    if limit < 0:
                        raise InvariantViolation("free lists are longer than the count (a cycle or a lost count)")
                node = nxt
        marked = sum(1 for w in self._where if w != _NOWHERE)
        if marked != seen:
            raise InvariantViolation(f"{marked} blocks are marked free but the lists hold {seen}")
        if seen + self.num_never_used != self.num_free_blocks:
            raise InvariantViolation(
                f"free lists hold {seen} blocks + {self.num_never_used} never used, the count says {self.num_free_blocks}"
            )
        if len(self._ghost) > self._ghost_capacity:
            raise InvariantViolation("ghost table is over its capacity")
