"""The prefix-cache index: block hash -> cached block(s), one per layer group.

A cached block is a full block whose hash is in the index. It may be in use
or free (waiting in the free queue, still valid until reused). The index does
not deduplicate: when a request fills a block whose hash is already cached
(for example the last block of a fully cached prompt, which is recomputed),
the new block is cached too, so block tables stay append-only. Lookups return
the earliest block still cached under the hash.

Two variants, chosen once when the manager is built:

* :class:`PrefixIndex` trusts the hash (SHA-256). Values are a block, or a
  ``{block_id: block}`` dict in insertion order when duplicates exist.
* :class:`VerifiedPrefixIndex` (fast, non-cryptographic hashes) keeps, per
  hash, an entry with the content bytes of the block (tokens and extra keys)
  and the entry of its parent. A hit must match both, by content and by
  identity of the parent entry, so equal hashes with different prefixes
  (collisions) can only cause misses. An entry that loses its last block
  leaves the index; children cached under it can no longer be reached and age
  out. This can cost a hit that SHA-256 would have found, never the reverse.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from itertools import islice

from kvpool.block import KVBlock
from kvpool.errors import InvariantViolation
from kvpool.hashing import BlockHash

__all__ = ["PrefixIndex", "VerifiedPrefixIndex"]


class PrefixIndex:
    """Hash -> block index for cryptographic hashes. All operations are O(1) per block."""

    __slots__ = ("_map",)

    verifies_content = False

    def __init__(self) -> None:
        self._map: dict[BlockHash, KVBlock | dict[int, KVBlock]] = {}

    def __len__(self) -> int:
        return len(self._map)

    def get(self, block_hash: BlockHash) -> KVBlock | None:
        """The earliest block cached under ``block_hash``, or None."""
        found = self._map.get(block_hash)
        if found is None or found.__class__ is KVBlock:
            return found  # type: ignore[return-value]
        return next(iter(found.values()))  # type: ignore[union-attr]

    def longest_prefix(
        self, hashes: Sequence[BlockHash], contents: Sequence[bytes] | None, max_blocks: int
    ) -> list[KVBlock]:
        """Cached blocks for ``hashes[0], hashes[1], ...`` up to the first miss or ``max_blocks``."""
        get = self._map.get
        hits: list[KVBlock] = []
        for block_hash in islice(hashes, max_blocks):
            found = get(block_hash)
            if found is None:
                break
            if found.__class__ is not KVBlock:
                found = next(iter(found.values()))  # type: ignore[union-attr]
            hits.append(found)  # type: ignore[arg-type]
        return hits

    def insert(self, block_hash: BlockHash, block: KVBlock, parent: KVBlock | None, content: bytes | None) -> bool:
        """Cache ``block`` under ``block_hash``. Always succeeds for trusted hashes."""
        found = self._map.get(block_hash)
        if found is None:
            self._map[block_hash] = block
        elif found.__class__ is KVBlock:
            self._map[block_hash] = {found.block_id: found, block.block_id: block}  # type: ignore[union-attr]
        else:
            found[block.block_id] = block  # type: ignore[index]
        return True

    def insert_run(
        self, table: Sequence[KVBlock], start: int, stop: int, hashes: Sequence[BlockHash], contents: object, group_id: int
    ) -> int:
        """Cache ``table[k]`` under ``hashes[k]`` for ``k`` in ``start..stop-1``, null blocks skipped.

        Sets each block's hash and group. Returns where the run ended (always
        ``stop``: a trusted hash never refuses). O(1) per block, one call per run.
        """
        m = self._map
        setdefault = m.setdefault
        for k in range(start, stop):
            block = table[k]
            if block.block_id == 0:
                continue
            if block.block_hash is not None:
                raise InvariantViolation(f"block {block.block_id} is cached twice")
            block_hash = hashes[k]
            found = setdefault(block_hash, block)
            if found is not block:  # the hash is cached already: keep both, earliest first
                if found.__class__ is KVBlock:
                    m[block_hash] = {found.block_id: found, block.block_id: block}  # type: ignore[union-attr]
                else:
                    found[block.block_id] = block  # type: ignore[index]
            block.block_hash = block_hash
            block.group_id = group_id
        return stop

    def remove_run(self, blocks: Sequence[KVBlock]) -> None:
        """Drop every block of ``blocks`` from the index and clear its hash. O(1) per block."""
        m = self._map
        pop = m.pop
        for block in blocks:
            block_hash = block.block_hash
            found = pop(block_hash, None)  # type: ignore[arg-type]
            if found is not block:
                if found is None or found.__class__ is KVBlock or block.block_id not in found:  # type: ignore[operator]
                    raise InvariantViolation(f"block {block.block_id} carries a hash the index does not map to it")
                del found[block.block_id]  # type: ignore[union-attr]
                if found:
                    m[block_hash] = found  # type: ignore[index]
            block.block_hash = None

    def remove(self, block: KVBlock) -> None:
        """Drop ``block`` from the index (its hash stays on the block for the caller to clear)."""
        block_hash = block.block_hash
        found = self._map.get(block_hash)  # type: ignore[arg-type]
        if found is block:
            del self._map[block_hash]  # type: ignore[arg-type]
            return
        if found is None or found.__class__ is KVBlock or block.block_id not in found:  # type: ignore[operator]
            raise InvariantViolation(f"block {block.block_id} carries a hash the index does not map to it")
        del found[block.block_id]  # type: ignore[union-attr]
        if not found:
            del self._map[block_hash]  # type: ignore[arg-type]

    def clear(self) -> None:
        self._map.clear()

    def items(self) -> Iterator[tuple[BlockHash, KVBlock]]:
        """Every (hash, block) pair in the index."""
        for block_hash, found in self._map.items():
            if found.__class__ is KVBlock:
                yield block_hash, found  # type: ignore[misc]
            else:
                for block in found.values():  # type: ignore[union-attr]
                    yield block_hash, block


class _Entry:
    """One verified hash: its content, its parent entry, the blocks that hold it."""

    __slots__ = ("parent", "content", "blocks")

    def __init__(self, parent: _Entry | None, content: bytes) -> None:
        self.parent = parent
        self.content = content
        self.blocks: dict[int, KVBlock] = {}


class VerifiedPrefixIndex:
    """Hash -> entry index that verifies content and lineage on every hit."""

    __slots__ = ("_map",)

    verifies_content = True

    def __init__(self) -> None:
        self._map: dict[BlockHash, _Entry] = {}

    def __len__(self) -> int:
        return len(self._map)

    def longest_prefix(
        self, hashes: Sequence[BlockHash], contents: Sequence[bytes] | None, max_blocks: int
    ) -> list[KVBlock]:
        if contents is None:
            raise InvariantViolation("verified lookup needs the request's block contents")
        get = self._map.get
        hits: list[KVBlock] = []
        parent = None
        for k in range(min(max_blocks, len(hashes))):
            entry = get(hashes[k])
            if entry is None or entry.parent is not parent or entry.content != contents[k]:
                break
            hits.append(next(iter(entry.blocks.values())))
            parent = entry
        return hits

    def insert(self, block_hash: BlockHash, block: KVBlock, parent: KVBlock | None, content: bytes | None) -> bool:
        """Cache ``block`` unless its hash is taken by different content or lineage.

        ``parent`` is the block before it in the same block table (None for the
        first block); it must itself be cached here, or the chain is unverifiable
        and the block stays uncached.
        """
        if content is None:
            raise InvariantViolation("verified insert needs the block's content")
        parent_entry = None
        if parent is not None:
            parent_entry = parent.entry
            if parent_entry is None:
                return False
        entry = self._map.get(block_hash)
        if entry is None:
            entry = self._map[block_hash] = _Entry(parent_entry, content)  # type: ignore[arg-type]
        elif entry.parent is not parent_entry or entry.content != content:
            return False  # a collision, or a lineage that was evicted and rebuilt
        entry.blocks[block.block_id] = block
        block.entry = entry
        return True

    def insert_run(
        self,
        table: Sequence[KVBlock],
        start: int,
        stop: int,
        hashes: Sequence[BlockHash],
        contents: Sequence[bytes] | None,
        group_id: int,
    ) -> int:
        """Cache ``table[start:stop]`` (null blocks skipped) until a block is refused; returns where it stopped."""
        if contents is None:
            raise InvariantViolation("verified insert needs the blocks' contents")
        insert = self.insert
        for k in range(start, stop):
            block = table[k]
            if block.block_id == 0:
                continue
            if block.block_hash is not None:
                raise InvariantViolation(f"block {block.block_id} is cached twice")
            block_hash = hashes[k]
            if not insert(block_hash, block, table[k - 1] if k else None, contents[k]):
                return k
            block.block_hash = block_hash
            block.group_id = group_id
        return stop

    def remove_run(self, blocks: Sequence[KVBlock]) -> None:
        """Drop every block of ``blocks`` from the index and clear its hash."""
        remove = self.remove
        for block in blocks:
            remove(block)
            block.block_hash = None

    def remove(self, block: KVBlock) -> None:
        entry = block.entry
        if not isinstance(entry, _Entry) or entry.blocks.pop(block.block_id, None) is not block:
            raise InvariantViolation(f"block {block.block_id} carries a hash the index does not map to it")
        if not entry.blocks:
            del self._map[block.block_hash]  # type: ignore[arg-type]
        block.entry = None

    def clear(self) -> None:
        for entry in self._map.values():
            for block in entry.blocks.values():
                block.entry = None
        self._map.clear()

    def items(self) -> Iterator[tuple[BlockHash, KVBlock]]:
        for block_hash, entry in self._map.items():
            for block in entry.blocks.values():
                yield block_hash, block
