"""The KV block record.

A block is the bookkeeping side of ``block_size`` token slots in every layer's
KV tensor. The manager never touches tensor memory: it moves block records
between the free queue, request block tables and the prefix-cache index.

Records are created lazily (the first time a block leaves the never-used
region of the free queue), so a pool of a million blocks starts in
microseconds; after that a block ID is also an index into the pool's list of
records.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvpool.errors import ConfigError

if TYPE_CHECKING:
    from kvpool.hashing import BlockHash

__all__ = ["KVBlock", "NULL_BLOCK_ID", "block_ids"]

#: Block 0 is reserved: a placeholder in block tables for positions that need
#: no memory (tokens that slid out of a sliding window). It is never handed out
#: and never sits in the free queue.
NULL_BLOCK_ID = 0


class KVBlock:
    """One block's bookkeeping.

    ``ref_cnt`` is 0 while the block sits in the free queue (it may still hold
    valid cached data), 1 while one request owns it, and 2 or more while it
    holds a shared prefix that every owner reads and none writes.

    ``block_hash`` is set only while the block is in the prefix-cache index;
    ``group_id`` says which layer group's index holds it. ``prev_free`` and
    ``next_free`` thread the free queue through the records themselves, so
    removing a block from the middle of the queue is O(1) and allocates
    nothing. ``content``, ``seal`` and ``parent_seal`` are used only by the
    verified (fast-hash) index: the block's content bytes, its seal number
    (0: not sealed) and the seal number of the block before it when it was
    sealed. They are plain fields, so sealing a block allocates nothing.
    """

    __slots__ = (
        "block_id",
        "ref_cnt",
        "block_hash",
        "group_id",
        "prev_free",
        "next_free",
        "content",
        "seal",
        "parent_seal",
    )

    def __init__(self, block_id: object) -> None:
        # Taken as an object, so both builds refuse a non-int (a bool too) with this error;
        # the free lists' sentinels are negative, so any int is a block ID here.
        if type(block_id) is not int:
            raise ConfigError(f"block_id must be an integer, got {block_id!r}")
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        self.group_id = 0
        self.prev_free: KVBlock | None = None
        self.next_free: KVBlock | None = None
        self.content: bytes | None = None
        self.seal = 0
        self.parent_seal = 0

    @property
    def is_null(self) -> bool:
        return self.block_id == NULL_BLOCK_ID

    def __repr__(self) -> str:
        cached = "cached" if self.block_hash is not None else "uncached"
        return f"KVBlock({self.block_id}, ref={self.ref_cnt}, {cached})"


def block_ids(blocks: list[KVBlock]) -> list[int]:
    """The IDs of ``blocks``, in order (one pass in the compiled build's native loop)."""
    return [block.block_id for block in blocks]
