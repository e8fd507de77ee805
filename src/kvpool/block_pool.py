"""The block pool: every block record, the free queue and the prefix-cache index.

The pool is shared by all layer groups of a model. It knows nothing about
requests beyond what caching a block needs; block tables live in the group
managers. Its operations:

* ``get_new_blocks(n)``: hand out the ``n`` blocks the eviction order puts first.
  A block that still carries a hash is evicted from the index at this moment
  and only now (lazy eviction).
* ``touch(blocks)``: prefix hits gain an owner; a free one leaves the queue.
  When the policy has ``on_hit`` it is then told of every hit (chosen once,
  at construction, so other policies pay nothing).
* ``free_blocks(blocks)``: owners let go, in eviction order (first = evicted
  first). A block whose count reaches 0 goes to the free queue: to the front
  when it has no hash, to the back when it is cached.
* ``cache_full_blocks(...)``: blocks that became full enter the index.
* For a layer above (a KV tier's bookkeeping): ``cached_block`` and
  ``cache_block`` (one hash, no event), ``stored_event`` (the event of
  blocks a request filled, in any medium), ``record`` (an event into the
  pool's stream) and ``watch_evictions`` (told of every eviction run).

Block 0 is the null block: materialised, never handed out, never freed, never
cached.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

from kvpool.block import NULL_BLOCK_ID, KVBlock
from kvpool.checks import check_flag, check_int
from kvpool.errors import ConfigError, InvariantViolation
from kvpool.events import MEDIUM_GPU, AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from kvpool.free_queue import FreeBlockQueue
from kvpool.hashing import BlockHash
from kvpool.prefix_index import PrefixIndex, VerifiedPrefixIndex
from kvpool.request import Request

if TYPE_CHECKING:
    from kvpool.eviction import FreeQueueFactory

__all__ = ["BlockPool"]


class BlockPool:
    """Blocks ``0 .. num_blocks-1``, block 0 reserved as the null block.

    Args:
        num_blocks: blocks in the pool, the null block included.
        num_groups: layer groups sharing the pool (each has its own index).
        enable_caching: whether full blocks are cached for prefix reuse.
        verify_content: use the verified index (for non-cryptographic hashes).
        enable_events: record KV events for ``take_events``.
        free_queue_factory: builds the eviction policy object; the default is
            vLLM's order (:class:`FreeBlockQueue`). It must be built over
            ``blocks`` and ``num_blocks`` exactly as the default is.

    The arguments are taken as objects and checked first (``int`` counts,
    ``bool`` switches, a callable factory), so both builds refuse a wrong one
    with the same :class:`~kvpool.errors.ConfigError`.
    """

    __slots__ = (
        "num_blocks",
        "blocks",
        "null_block",
        "free_queue",
        "indexes",
        "enable_caching",
        "events",
        "group_kinds",
        "num_evictions",
        "num_resets",
        "touch",
        "_on_hit",
        "_on_evict",
    )

    def __init__(
        self,
        num_blocks: object,
        *,
        num_groups: object = 1,
        enable_caching: object = True,
        verify_content: object = False,
        enable_events: object = False,
        free_queue_factory: object = FreeBlockQueue,
    ) -> None:
        count = check_int("num_blocks", num_blocks)  # the null block alone is a pool with nothing to hand out
        groups = check_int("num_groups", num_groups)
        caching = check_flag("enable_caching", enable_caching)
        verified = check_flag("verify_content", verify_content)
        with_events = check_flag("enable_events", enable_events)
        if not callable(free_queue_factory):
            raise ConfigError(f"free_queue_factory must be a free-queue factory, got {free_queue_factory!r}")
        factory: FreeQueueFactory = free_queue_factory
        self.num_blocks = count
        self.null_block = KVBlock(NULL_BLOCK_ID)
        self.blocks: list[KVBlock] = [self.null_block]
        self.free_queue = factory(self.blocks, count)
        index_type = VerifiedPrefixIndex if verified else PrefixIndex
        self.indexes: tuple[PrefixIndex, ...] = tuple(index_type() for _ in range(groups))
        self.enable_caching = caching
        self.events: list[KVCacheEvent] | None = [] if with_events else None
        #: Per group, its layer kind and sliding window, for stored-block events (set by the manager).
        self.group_kinds: tuple[tuple[str | None, int | None], ...] = ((None, None),) * groups
        #: Blocks evicted from the index so far (a logical clock for stale-hit checks).
        self.num_evictions = 0
        #: Accepted ``reset_prefix_cache`` calls (every hit issued before one is stale).
        self.num_resets = 0
        # ``touch`` is chosen once: a policy with ``on_hit`` sees every prefix hit;
        # any other policy gets the plain loop and pays nothing for the option.
        self._on_hit: Callable[[list[KVBlock]], None] | None = getattr(self.free_queue, "on_hit", None)
        self.touch = self._touch if self._on_hit is None else self._touch_reporting_hits
        self._on_evict: Callable[[Sequence[KVBlock]], None] | None = None

    # -- sizes -------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of the non-null blocks that are in use."""
        usable = self.num_blocks - 1
        return 1.0 - self.free_queue.num_free_blocks / usable if usable else 0.0

    def block(self, block_id: int) -> KVBlock:
        """The record of a block that has been handed out at least once."""
        if not 0 <= block_id < len(self.blocks):
            raise InvariantViolation(f"block {block_id} has no record (never handed out)")
        return self.blocks[block_id]

    # -- allocation ----------------------------------------------------------------

    def get_new_blocks(self, n: int) -> list[KVBlock]:
        """Take ``n`` blocks from the free queue, evicting their cached hashes."""
        blocks = self.free_queue.popleft_n(n)
        cached: list[KVBlock] = []
        for block in blocks:  # one pass: a new owner each, and the cached ones to evict
            block.ref_cnt = 1
            if block.block_hash is not None:
                cached.append(block)
        if cached:
            self._evict_run(cached)
        return blocks

    def _evict_run(self, blocks: list[KVBlock]) -> None:
        """Evict cached blocks from their indexes, one call per group (in the single-group case, one call)."""
        if self._on_evict is not None:
            self._on_evict(blocks)
        events = self.events
        if events is not None:
            for block in blocks:
                events.append(BlockRemoved(block_hashes=(block.block_hash,), group_id=block.group_id))  # type: ignore[arg-type]  # cached: hash set
        indexes = self.indexes
        if len(indexes) == 1:
            indexes[0].remove_run(blocks)
        else:
            for block in blocks:
                indexes[block.group_id].remove_run((block,))
        self.num_evictions += len(blocks)

    def uncache(self, block: KVBlock) -> None:
        """Take one cached block out of its index (its KV is not what its hash says); O(1).

        Its owners keep it; once free it is reused like any block without a hash.
        """
        if block.block_hash is None or block.block_id == NULL_BLOCK_ID:
            raise InvariantViolation(f"block {block.block_id} is not cached, so it cannot be uncached")
        self._evict(block)

    def _evict(self, block: KVBlock) -> None:
        self.indexes[block.group_id].remove(block)
        if self.events is not None:
            self.events.append(BlockRemoved(block_hashes=(block.block_hash,), group_id=block.group_id))  # type: ignore[arg-type]  # evicted blocks are cached: hash set
        block.block_hash = None
        self.num_evictions += 1

    def _touch(self, blocks: Iterable[KVBlock]) -> None:
        """``touch(blocks)``: give each hit block one more owner; free ones leave the free queue."""
        remove = self.free_queue.remove
        for block in blocks:
            if block.ref_cnt == 0:
                if block.block_id == NULL_BLOCK_ID:
                    continue
                remove(block)
            block.ref_cnt += 1

    def _touch_reporting_hits(self, blocks: Iterable[KVBlock]) -> None:
        """``touch`` for policies with ``on_hit``: the same, then the policy sees the hits."""
        hits = blocks if isinstance(blocks, list) else list(blocks)
        self._touch(hits)
        self._on_hit(hits)  # type: ignore[misc]  # chosen only when the policy has on_hit

    def free_blocks(self, ordered: Iterable[KVBlock]) -> None:
        """Drop one owner from each block, given in eviction order (first = evicted first).

        Blocks that become free without a hash are put at the front of the
        queue as one run (reused first); cached ones at the back as one run.
        """
        first: list[KVBlock] = []
        last: list[KVBlock] = []
        # Without caching no block carries a hash, so every freed block goes first.
        cached = last if self.enable_caching else first
        null = self.null_block
        for block in ordered:
            count = block.ref_cnt - 1
            if count == 0:
                block.ref_cnt = 0
                if block.block_hash is None:
                    first.append(block)
                else:
                    cached.append(block)
            elif count > 0:
                block.ref_cnt = count
            elif block is not null:  # the null block's count stays 0: it is never taken
                raise InvariantViolation(f"block {block.block_id} was freed more often than it was taken")
        self.free_queue.release(first, last)

    # -- caching -------------------------------------------------------------------

    def cache_full_blocks(
        self,
        request: Request,
        table: list[KVBlock],
        start: int,
        stop: int,
        group_id: int,
        block_size: int,
        hashes: Sequence[BlockHash],
        contents: Sequence[bytes] | None,
    ) -> None:
        """Enter ``table[start:stop]`` (now full) into group ``group_id``'s index.

        Block ``k`` of the table is cached under ``hashes[k]`` (the request's
        hashes at this group's block size); ``contents[k]`` is its content for
        the verified index. Null blocks are skipped. With the verified index a
        block whose hash is held by other content stays uncached (and so do its
        successors). ``request`` only feeds the KV events.
        """
        end = self.indexes[group_id].insert_run(table, start, stop, hashes, contents, group_id)
        if self.events is not None:
            stored = [k for k in range(start, end) if table[k].block_id != NULL_BLOCK_ID]
            if stored:
                self._record_stored(request, hashes, stored, group_id, block_size)

    def _record_stored(
        self, request: Request, hashes: Sequence[BlockHash], stored: list[int], group_id: int, block_size: int
    ) -> None:
        event = self.stored_event(request, hashes, stored, group_id=group_id, block_size=block_size)
        self.events.append(event)  # type: ignore[union-attr]  # called only when events are on

    def stored_event(
        self,
        request: Request,
        hashes: Sequence[BlockHash],
        positions: Sequence[int],
        *,
        group_id: int = 0,
        block_size: int,
        medium: str = MEDIUM_GPU,
        tokens: Sequence[int] | None = None,
    ) -> BlockStored:
        """The event of ``request``'s blocks at ``positions`` (consecutive) stored in ``medium``; records nothing.

        ``tokens``: the request's tokens when the caller already holds a copy
        (``request.all_token_ids`` copies them).
        """
        if tokens is None:
            tokens = request.all_token_ids
        first = positions[0]
        kind, window = self.group_kinds[group_id]
        return BlockStored(
            block_hashes=tuple(hashes[k] for k in positions),
            parent_block_hash=hashes[first - 1] if first else None,
            token_ids=tuple(t for k in positions for t in tokens[k * block_size : (k + 1) * block_size]),
            block_size=block_size,
            lora_name=request.lora_name,
            extra_keys=tuple(request.extra_keys(k * block_size, (k + 1) * block_size) for k in positions),
            group_id=group_id,
            medium=medium,
            spec_kind=kind,
            sliding_window=window,
        )

    def snapshot_events(self, block_sizes: Sequence[int]) -> list[BlockStored]:
        """What the index holds as stored-block events: one per group that caches any, ``block_sizes[g]`` each.

        A set, not a chain: the pool does not keep which block follows which, so
        ``parent_block_hash`` is None, and no token IDs nor extra keys are carried
        (see :mod:`kvpool.kv_events.snapshot`). O(cached blocks); records nothing.
        """
        out = []
        for group_id, index in enumerate(self.indexes):
            hashes = tuple(index.hashes())
            if hashes:
                kind, window = self.group_kinds[group_id]
                out.append(
                    BlockStored(
                        block_hashes=hashes,
                        parent_block_hash=None,
                        token_ids=(),
                        block_size=block_sizes[group_id],
                        lora_name=None,
                        extra_keys=(None,) * len(hashes),
                        group_id=group_id,
                        spec_kind=kind,
                        sliding_window=window,
                    )
                )
        return out

    @property
    def records_events(self) -> bool:
        """Whether the pool records KV events (``enable_events``)."""
        return self.events is not None

    def record(self, event: KVCacheEvent) -> None:
        """Add ``event`` (a layer above's, e.g. a tier's) to the pool's stream; nothing when events are off."""
        if self.events is not None:
            self.events.append(event)

    def watch_evictions(self, callback: Callable[[Sequence[KVBlock]], None]) -> None:
        """Call ``callback`` with every run of blocks ``get_new_blocks`` evicts, before their hashes are dropped.

        One watcher (a write-back tier); set once, after construction.
        """
        if self._on_evict is not None:
            raise InvariantViolation("the pool's evictions are already watched")
        self._on_evict = callback

    # -- one block under one hash (a tier's own pool) -----------------------------------

    def cached_block(self, block_hash: BlockHash, group_id: int = 0) -> KVBlock | None:
        """The block cached under ``block_hash`` in group ``group_id``, or None; O(1)."""
        return self.indexes[group_id].get(block_hash)

    def cache_block(self, block: KVBlock, block_hash: BlockHash, group_id: int = 0) -> None:
        """Cache one held block under ``block_hash`` (no event: its owner announces it); O(1)."""
        self.indexes[group_id].insert_run([block], 0, 1, [block_hash], None, group_id)

    def num_cached(self, group_id: int = 0) -> int:
        """Blocks cached in group ``group_id``'s index."""
        return len(self.indexes[group_id])

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Refused (False) while any block is in use."""
        if self.free_queue.num_free_blocks != self.num_blocks - 1:
            return False
        for index in self.indexes:
            index.clear()
        for block in self.blocks:
            block.block_hash = None
        self.num_resets += 1
        if self.events is not None:
            self.events.append(AllBlocksCleared())
        return True

    def take_events(self) -> list[KVCacheEvent]:
        if self.events is None:
            return []
        events, self.events = self.events, []
        return events
