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
from kvpool.linked_blocks import FreeList

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

    The free blocks sit in ``K + 2`` :class:`~kvpool.linked_blocks.FreeList`
    objects: lists ``0 .. K-1`` are the classes, each in release order (the
    release times along a list never decrease); list ``K`` is reserved for
    subclasses (handed out after every class); list ``K + 1`` holds the
    uncached blocks, newest first, with the never-used range behind them.
    ``_where[block_id]`` names the list a free block is in.
    """

    __slots__ = (
        "num_free_blocks",
        "_blocks",
        "_k",
        "_mult",
        "_lists",
        "_uncached",
        "_where",
        "_stamp",
        "_uses",
        "_owner",
        "_clock",
        "_ghost",
        "_ghost_capacity",
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
        n = len(blocks)
        self.num_free_blocks = max(0, num_blocks - n)
        k = len(weights)
        self._k = k
        scale = lcm(*weights)
        # Scaled ages compare as integers: age * (lcm / weight).
        self._mult = tuple(scale // w for w in weights)
        # Classes and the reserved list start empty; the uncached list carries the
        # never-used range, so prepended blocks go out before it and victims after.
        self._lists = [FreeList(blocks, n) for _ in range(k + 1)]
        self._lists.append(FreeList(blocks, max(num_blocks, n)))
        self._uncached = k + 1
        self._where = [_NOWHERE] * n
        self._stamp = [0] * n
        self._uses = [0] * n
        #: The hash the use count belongs to (a block's count restarts with new content).
        self._owner: list[BlockHash | None] = [None] * n
        self._clock = 0
        self._ghost: OrderedDict[BlockHash, int] = OrderedDict()
        self._ghost_capacity = ghost_capacity

    # -- moves between lists (O(1)) ----------------------------------------------------

    def _append(self, block: KVBlock, where: int) -> None:
        """Put a block at the back of list ``where``, released now."""
        self._lists[where].append(block)
        bid = block.block_id
        self._where[bid] = where
        self._stamp[bid] = self._clock

    def _unlink(self, block: KVBlock) -> None:
        """Take a free block out of its list (the free count is the caller's)."""
        bid = block.block_id
        self._lists[self._where[bid]].remove(block)
        self._where[bid] = _NOWHERE

    # -- use counts ----------------------------------------------------------------

    def _count_of(self, bid: int, block_hash: BlockHash) -> int:
        """Block ``bid``'s use count, starting it (from the ghost table) if its content is new."""
        if self._owner[bid] != block_hash:
            self._owner[bid] = block_hash
            self._uses[bid] = self._ghost.pop(block_hash, 0) + 1
        return self._uses[bid]

    def _forget_all(self, blocks: list[KVBlock]) -> None:
        """Blocks handed out for new data: in no list now; remember each count under
        its hash, then reset it. O(k)."""
        owner, uses, ghost, capacity = self._owner, self._uses, self._ghost, self._ghost_capacity
        where = self._where
        for block in blocks:
            bid = block.block_id
            where[bid] = _NOWHERE
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
            block_hash = block.block_hash
            if block.block_id == NULL_BLOCK_ID or block_hash is None:
                continue
            self._count_of(block.block_id, block_hash)
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
        lists, where, stamp, clock = self._lists, self._where, self._stamp, self._clock
        for block, cls in zip(blocks, classes, strict=True):
            lists[cls].append(block)
            bid = block.block_id
            where[bid] = cls
            stamp[bid] = clock

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
        self._lists[where].prepend_n(blocks)
        marks = self._where
        for block in blocks:
            marks[block.block_id] = where
        self.num_free_blocks += len(blocks)

    def append_n(self, blocks: list[KVBlock]) -> None:
        """Cached blocks to keep, in eviction order (as ``release``'s ``reuse_last``). O(k)."""
        self.release([], blocks)

    def remove(self, block: KVBlock) -> None:
        """Take a free block out of whichever list holds it (a prefix hit). O(1)."""
        bid = block.block_id
        where = self._where
        if bid >= len(where) or where[bid] == _NOWHERE:
            raise InvariantViolation(f"block {bid} is not in the free queue")
        self._lists[where[bid]].remove(block)
        where[bid] = _NOWHERE
        self.num_free_blocks -= 1

    def _grow(self) -> None:
        """Per-block entries for records the uncached list just materialised (in no list)."""
        count = len(self._blocks) - len(self._where)
        self._where.extend([_NOWHERE] * count)
        self._stamp.extend([0] * count)
        self._uses.extend([0] * count)
        self._owner.extend([None] * count)

    def _pick_class(self) -> tuple[int, int, int]:
        """``(class, runner-up scaled age, runner-up class)`` of the next victim; class -1 if none."""
        clock, stamp, mult, lists = self._clock, self._stamp, self._mult, self._lists
        best = second_cls = -1
        best_v = second_v = -1
        for c in range(self._k):
            lst = lists[c]
            head: KVBlock = lst.head.next_free  # type: ignore[assignment]  # a sentinel always has a neighbour
            if head is lst.tail:
                continue
            v = (clock - stamp[head.block_id]) * mult[c]
            if v > best_v:
                second_v, second_cls = best_v, best
                best_v, best = v, c
            elif v > second_v:
                second_v, second_cls = v, c
        return best, second_v, second_cls

    def _take_victims(self, n: int, out: list[KVBlock]) -> int:
        """Move up to ``n`` cached victims into ``out``; return how many. O(n + K x runs)."""
        taken = 0
        clock, stamp, mult, lists = self._clock, self._stamp, self._mult, self._lists
        while taken < n:
            cls, second_v, second_cls = self._pick_class()
            if cls < 0:
                break
            # Consecutive blocks of one class keep winning while their scaled age
            # beats the runner-up's head, ties going to the lower class:
            # (clock - released) * mult >= need. Release times grow along the list,
            # so the winners are its front up to release time clock - ceil(need / mult);
            # the head itself always qualifies (it won the pick).
            need = second_v if cls < second_cls else second_v + 1
            taken += lists[cls].popleft_run(n - taken, out, stamp, clock + (-need // mult[cls]))
        return taken

    def _take_last_resort(self, n: int, out: list[KVBlock]) -> int:
        """Blocks handed out only when every class is empty (subclasses' protected list)."""
        return 0

    def popleft_n(self, n: int) -> list[KVBlock]:
        """Hand out ``n`` blocks: uncached, then never used, then victims by scaled age."""
        if n > self.num_free_blocks or n < 0:
            raise InvariantViolation(f"asked the free queue for {n} blocks, it holds {self.num_free_blocks}")
        uncached = self._lists[self._uncached]
        first = min(n, uncached.num_free_blocks)
        out = uncached.popleft_n(first)
        if len(self._blocks) > len(self._where):
            self._grow()
        left = n - first
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
        return iter(self._lists[where])

    def _victim_order(self) -> Iterator[KVBlock]:
        """The cached blocks in the order :meth:`popleft_n` would take them. O(n K)."""
        clock, stamp, mult = self._clock, self._stamp, self._mult
        walks = [iter(self._lists[c]) for c in range(self._k)]
        fronts = [next(walk, None) for walk in walks]
        while True:
            best, best_v, victim = -1, -1, None
            for c, node in enumerate(fronts):
                if node is None:
                    continue
                v = (clock - stamp[node.block_id]) * mult[c]
                if v > best_v:
                    best, best_v, victim = c, v, node
            if victim is None:
                return
            yield victim
            fronts[best] = next(walks[best], None)

    def _last_resort_order(self) -> Iterator[KVBlock]:
        return iter(())

    def block_ids(self) -> Iterator[int]:
        """Free block IDs in hand-out order, front to back (the merge is O(n K))."""
        yield from self._lists[self._uncached].block_ids()  # uncached, then never used
        for block in self._victim_order():
            yield block.block_id
        for block in self._last_resort_order():
            yield block.block_id

    def materialised_free_blocks(self) -> Iterator[KVBlock]:
        """Every free block that has a record, list by list."""
        for free_list in self._lists:
            yield from free_list

    @property
    def num_never_used(self) -> int:
        return self._lists[self._uncached].num_never_used

    @property
    def clock(self) -> int:
        """Blocks handed out so far (the logical time ages are measured in)."""
        return self._clock

    def check(self) -> None:
        """Verify every list in O(n): links agree both ways and match each list's
        count, membership marks match, release times never decrease along a
        class list, and the counts add up."""
        seen = 0
        marks, stamps = self._where, self._stamp
        for where, free_list in enumerate(self._lists):
            free_list.check(f"free list {where}")
            last_stamp = -1
            for block in free_list:
                bid = block.block_id
                if bid < 0 or bid >= len(marks) or marks[bid] != where:
                    raise InvariantViolation(f"block {bid} is in free list {where} but marked otherwise")
                if where != self._uncached:
                    if stamps[bid] < last_stamp:
                        raise InvariantViolation(f"free list {where} is out of release order at block {bid}")
                    last_stamp = stamps[bid]
                seen += 1
        marked = sum(1 for w in marks if w != _NOWHERE)
        if marked != seen:
            raise InvariantViolation(f"{marked} blocks are marked free but the lists hold {seen}")
        if seen + self.num_never_used != self.num_free_blocks:
            raise InvariantViolation(
                f"free lists hold {seen} blocks + {self.num_never_used} never used, the count says {self.num_free_blocks}"
            )
        if len(self._ghost) > self._ghost_capacity:
            raise InvariantViolation("ghost table is over its capacity")
