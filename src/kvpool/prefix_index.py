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
* :class:`VerifiedPrefixIndex` (fast, non-cryptographic hashes): the same
  map, and every cached block sealed with its content bytes (tokens and extra
  keys), a seal number and its parent's seal number. A hit must match both,
  by content and by the parent's seal number, so equal hashes with different
  prefixes (collisions) can only cause misses. A seal whose last block is evicted is
  gone; children sealed under it can no longer be reached and age out. This
  can cost a hit that SHA-256 would have found, never the reverse.

Both insert and evict whole runs of blocks in one call (``insert_run``,
``remove_run``), so the pool pays one call per run, not per block.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from functools import partial
from itertools import chain
from operator import attrgetter, eq, is_not

from kvpool.block import KVBlock
from kvpool.errors import InvariantViolation
from kvpool.hashing import BlockHash

__all__ = ["PrefixIndex", "VerifiedPrefixIndex"]

#: ``found(x)``: ``x is not None``, called from C (a lookup's run of hits never enters Python per block).
_found = partial(is_not, None)
#: A verified block's sealed fields, read from C.
_content = attrgetter("content")
_seal = attrgetter("seal")
_parent_seal = attrgetter("parent_seal")


class PrefixIndex:
    """Hash -> block index for cryptographic hashes. All operations are O(1) per block."""

    __slots__ = ("_map", "_num_shared")

    verifies_content = False

    def __init__(self) -> None:
        self._map: dict[BlockHash, KVBlock | dict[int, KVBlock]] = {}
        #: Hashes that map to a dict of duplicates (lookups unwrap them only when there are any).
        self._num_shared = 0

    def __len__(self) -> int:
        return len(self._map)

    def get(self, block_hash: BlockHash) -> KVBlock | None:
        """The earliest block cached under ``block_hash``, or None."""
        found = self._map.get(block_hash)
        if found is None or isinstance(found, KVBlock):
            return found
        return next(iter(found.values()))

    def longest_prefix(
        self, hashes: Sequence[BlockHash], contents: Sequence[bytes] | None, max_blocks: int
    ) -> list[KVBlock]:
        """Cached blocks for ``hashes[0], hashes[1], ...`` up to the first miss or ``max_blocks``.

        One dictionary probe per block, in a plain loop (native in the compiled
        build); duplicates are unwrapped only while the index holds any.
        """
        m = self._map
        found: list[KVBlock] = []
        stop = len(hashes) if len(hashes) < max_blocks else max_blocks
        unwrap = self._num_shared != 0
        for k in range(stop):
            hit = m.get(hashes[k])
            if hit is None:
                break
            if unwrap and not isinstance(hit, KVBlock):
                hit = next(iter(hit.values()))
            found.append(hit)  # type: ignore[arg-type]  # a dict of duplicates was unwrapped above
        return found

    def insert_run(
        self,
        table: list[KVBlock],
        start: int,
        stop: int,
        hashes: Sequence[BlockHash],
        contents: Sequence[bytes] | None,
        group_id: int,
    ) -> int:
        """Cache ``table[k]`` under ``hashes[k]`` for ``k`` in ``start..stop-1``, null blocks skipped.

        Sets each block's hash and group. Returns where the run ended (always
        ``stop``: a trusted hash never refuses). One dictionary probe per
        block (``setdefault``), one call per run.
        """
        m = self._map
        for k in range(start, stop):
            block = table[k]
            if block.block_id == 0:
                continue
            if block.block_hash is not None:
                raise InvariantViolation(f"block {block.block_id} is cached twice")
            block_hash = hashes[k]
            found = m.setdefault(block_hash, block)
            if found is not block:  # the hash is cached already: keep both, earliest first
                self._keep_duplicate(block_hash, found, block)
            block.block_hash = block_hash
            block.group_id = group_id
        return stop

    def remove_run(self, blocks: Sequence[KVBlock]) -> None:
        """Drop every block of ``blocks`` from the index and clear its hash. O(1) per block."""
        m = self._map
        for block in blocks:
            block_hash = block.block_hash
            if block_hash is None:
                raise InvariantViolation(f"block {block.block_id} is evicted but carries no hash")
            found = m.pop(block_hash, None)
            if found is not block:
                self._drop_duplicate(block, block_hash, found)
            block.block_hash = None

    def remove(self, block: KVBlock) -> None:
        """Drop ``block`` from the index (its hash stays on the block for the caller to clear)."""
        block_hash = block.block_hash
        if block_hash is None:
            raise InvariantViolation(f"block {block.block_id} is removed from the index but carries no hash")
        found = self._map.pop(block_hash, None)
        if found is not block:
            self._drop_duplicate(block, block_hash, found)

    def _keep_duplicate(self, block_hash: BlockHash, found: KVBlock | dict[int, KVBlock], block: KVBlock) -> None:
        """Cache ``block`` beside what ``block_hash`` already maps to (rare: a recomputed block)."""
        if isinstance(found, KVBlock):
            self._map[block_hash] = {found.block_id: found, block.block_id: block}
            self._num_shared += 1
        else:
            found[block.block_id] = block

    def _drop_duplicate(
        self, block: KVBlock, block_hash: BlockHash, found: KVBlock | dict[int, KVBlock] | None
    ) -> None:
        """``block`` is one of several cached under ``block_hash`` (``found``, just popped): keep the others."""
        if found is None or isinstance(found, KVBlock) or block.block_id not in found:
            raise InvariantViolation(f"block {block.block_id} carries a hash the index does not map to it")
        del found[block.block_id]
        if found:
            self._map[block_hash] = found
        else:
            self._num_shared -= 1

    def clear(self) -> None:
        self._map.clear()
        self._num_shared = 0

    def hashes(self) -> list[BlockHash]:
        """Every hash in the index once (duplicates share one), in the order they were first cached; O(n)."""
        return list(self._map)

    def items(self) -> Iterator[tuple[BlockHash, KVBlock]]:
        """Every (hash, block) pair in the index."""
        for block_hash, found in self._map.items():
            if isinstance(found, KVBlock):
                yield block_hash, found
            else:
                for block in found.values():
                    yield block_hash, block


class VerifiedPrefixIndex(PrefixIndex):
    """Hash -> block index that verifies content and lineage on every hit.

    Each cached block is *sealed*: it keeps its content bytes
    (``block.content``), a seal number (``block.seal``, never reused) and the
    seal number of the block before it in the table that cached it
    (``block.parent_seal``, 0 for a first block). Blocks cached under the same
    hash with the same content and parent share one seal number, so lineage
    is checked by number: a lookup accepts block ``k`` only if its content
    equals the request's block ``k`` and its parent seal is the seal of the
    hit it just accepted for block ``k - 1``. Equal hashes with different
    content or a different prefix (collisions) therefore cost a miss, never a
    false hit. When every block of a seal is evicted the seal is gone (its
    number is never issued again); children sealed under it can no longer be
    reached and age out, which can cost a hit SHA-256 would have found, never
    the reverse.

    Same map layout and costs as :class:`PrefixIndex`, plus three field
    writes per sealed block and one bytes comparison per hit; sealing
    allocates nothing.
    """

    __slots__ = ("_last_seal",)

    verifies_content = True

    def __init__(self) -> None:
        super().__init__()
        #: The last seal number issued (numbers start at 1; 0 means "not sealed").
        self._last_seal = 0

    def longest_prefix(
        self, hashes: Sequence[BlockHash], contents: Sequence[bytes] | None, max_blocks: int
    ) -> list[KVBlock]:
        if contents is None:
            raise InvariantViolation("verified lookup needs the request's block contents")
        hits = super().longest_prefix(hashes, contents, max_blocks)  # the run by hash alone (duplicates share one seal)
        # The whole run verified in two C-level passes: each block's parent seal is the seal
        # before it (the first has none), and each content equals the request's block.
        if all(map(eq, map(_parent_seal, hits), chain((0,), map(_seal, hits)))) and all(
            map(eq, map(_content, hits), contents)
        ):
            return hits
        parent = 0  # a check failed: keep the hits before the first block that fails
        for k, block in enumerate(hits):
            if block.parent_seal != parent or block.content != contents[k]:
                del hits[k:]
                break
            parent = block.seal
        return hits

    def insert_run(
        self,
        table: list[KVBlock],
        start: int,
        stop: int,
        hashes: Sequence[BlockHash],
        contents: Sequence[bytes] | None,
        group_id: int,
    ) -> int:
        """Seal and cache ``table[start:stop]`` until a block is refused; returns where the run stopped.

        A block is refused when the block before it is not sealed (its chain
        cannot be verified), or when its hash is held by other content or
        another lineage; the blocks after it then stay uncached too. One
        dictionary probe per block (``setdefault``).
        """
        if contents is None:
            raise InvariantViolation("verified insert needs the blocks' contents")
        m = self._map
        parent = table[start - 1].seal if start else 0
        if start and parent == 0:
            return start
        last = self._last_seal
        for k in range(start, stop):
            block = table[k]
            if block.block_hash is not None:
                self._last_seal = last
                raise InvariantViolation(f"block {block.block_id} is cached twice")
            block_hash = hashes[k]
            content = contents[k]
            found = m.setdefault(block_hash, block)
            if found is block:
                last += 1
                seal = last
            else:
                first = found if isinstance(found, KVBlock) else next(iter(found.values()))
                if first.parent_seal != parent or first.content != content:
                    self._last_seal = last
                    return k  # a collision, or a lineage that was evicted and rebuilt
                self._keep_duplicate(block_hash, found, block)
                seal = first.seal
                content = first.content
            block.content = content
            block.seal = seal
            block.parent_seal = parent
            block.block_hash = block_hash
            block.group_id = group_id
            parent = seal
        self._last_seal = last
        return stop

    def remove_run(self, blocks: Sequence[KVBlock]) -> None:
        """Drop every block of ``blocks`` from the index, clearing its hash and seal. O(1) per block."""
        m = self._map
        for block in blocks:
            block_hash = block.block_hash
            if block_hash is None:
                raise InvariantViolation(f"block {block.block_id} is evicted but carries no hash")
            found = m.pop(block_hash, None)
            if found is not block:
                self._drop_duplicate(block, block_hash, found)
            block.block_hash = None
            block.content = None
            block.seal = 0

    def remove(self, block: KVBlock) -> None:
        super().remove(block)
        block.content = None
        block.seal = 0

    def clear(self) -> None:
        for _, block in self.items():
            block.content = None
            block.seal = 0
        self._map.clear()
        self._num_shared = 0
