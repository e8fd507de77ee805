"""The contract every layer group's manager follows.

A group manager owns the block tables of one layer group (layers with the
same cache requirements) and applies that group's rules: which blocks a prefix
hit needs, which blocks a growing request can give back, how many blocks a
step needs. All groups draw blocks from one shared :class:`BlockPool`.

The default behaviour here is full attention's: keep every block, hit by
walking the hashes from the first block. Other layer types override the hooks
they change.

Block sizes and hashes
----------------------
Request hashes are computed once, at the manager's hash block size (the
smallest block size of the model). A group whose blocks are ``m`` times
larger reads every ``m``-th hash: its block ``k`` is identified by
``block_hashes[(k + 1) * m - 1]``, the chained hash at the block's last token,
which covers the whole prefix up to there::

    hash blocks   | h0 | h1 | h2 | h3 | h4 | h5 |      (hash block size 4)
    group blocks  |  block 0  |  block 1  |  block 2  |    (block size 8, m = 2)
    its hashes          h1          h3          h5
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar, TypeVar, overload

from kvpool.block import NULL_BLOCK_ID, KVBlock
from kvpool.block_pool import BlockPool
from kvpool.checks import check_flag, check_int
from kvpool.errors import ConfigError
from kvpool.hashing import BlockHash
from kvpool.request import Request
from kvpool.specs import FullAttentionSpec, KVDtype, LayerSpec, cdiv

__all__ = ["GroupManager"]

_T = TypeVar("_T")


class _StridedHashes(Sequence[_T]):
    """Every ``stride``-th hash of a request: item ``k`` is ``hashes[(k + 1) * stride - 1]``."""

    __slots__ = ("_hashes", "_stride")

    def __init__(self, hashes: Sequence[_T], stride: int) -> None:
        self._hashes = hashes
        self._stride = stride

    def __len__(self) -> int:
        return len(self._hashes) // self._stride

    @overload
    def __getitem__(self, k: int) -> _T: ...
    @overload
    def __getitem__(self, k: slice) -> list[_T]: ...
    def __getitem__(self, k: int | slice) -> _T | list[_T]:
        if isinstance(k, slice):
            return [self[i] for i in range(*k.indices(len(self)))]
        n = len(self)
        if k < 0:
            k += n
        if not 0 <= k < n:
            raise IndexError(k)
        return self._hashes[(k + 1) * self._stride - 1]


class _JoinedContents(_StridedHashes[bytes]):
    """Block contents at a coarser block size: item ``k`` joins ``stride`` fine contents."""

    __slots__ = ()

    @overload
    def __getitem__(self, k: int) -> bytes: ...
    @overload
    def __getitem__(self, k: slice) -> list[bytes]: ...
    def __getitem__(self, k: int | slice) -> bytes | list[bytes]:
        if isinstance(k, slice):
            return [self[i] for i in range(*k.indices(len(self)))]
        n = len(self)
        if k < 0:
            k += n
        if not 0 <= k < n:
            raise IndexError(k)
        s = self._stride
        return b"".join(self._hashes[k * s : (k + 1) * s])


class GroupManager:
    """Block tables and rules of one layer group.

    Args:
        pool: the shared block pool.
        group_id: this group's position among the model's groups.
        block_size: tokens per block of this group.
        enable_caching: whether this group caches full blocks.
        spec: the group's layer spec (``kvpool.specs``): the rules' parameters,
            whether its blocks may be prefix-cached and how many a request
            keeps. None means full attention (a manager built without a model).
        hash_block_size: tokens per request hash; ``block_size`` must be a
            multiple of it. None means ``block_size``.

    The arguments are taken as objects and checked first, so both builds
    refuse a wrong one with the same :class:`~kvpool.errors.ConfigError`.

    ``tables[request_id]`` is the request's block table: block ``k`` holds
    token positions ``k*block_size .. (k+1)*block_size - 1``; the null block
    (block 0) stands where a layer type needs no memory.
    ``num_cached[request_id]`` counts the leading table entries already
    offered to the prefix-cache index.
    ``alignment`` is the granularity of a prefix hit in tokens: the block
    size, or in a hybrid model the least common multiple of the groups' block
    sizes (set by the coordinator).
    """

    #: Whether every shorter block-aligned prefix of a hit is also a hit.
    downward_closed: ClassVar[bool] = True
    #: Whether hits walk the hashes from block 0 (needed by the verified index).
    supports_verified_index: ClassVar[bool] = True
    #: Whether the group's blocks hold the encoder input instead of the tokens.
    uses_encoder_tokens: ClassVar[bool] = False

    def __init__(
        self,
        pool: object,
        group_id: object,
        block_size: object,
        enable_caching: object,
        *,
        spec: object = None,
        hash_block_size: object = None,
    ) -> None:
        if not isinstance(pool, BlockPool):
            raise ConfigError(f"pool must be a kvpool.block_pool.BlockPool, got {pool!r}")
        gid = check_int("group_id", group_id, minimum=0)
        if gid >= len(pool.indexes):
            raise ConfigError(f"group_id {gid} is not a group of the pool, which has {len(pool.indexes)}")
        size = check_int("block_size", block_size)
        caching = check_flag("enable_caching", enable_caching)
        if spec is None:  # only the block size matters to full attention's rules
            spec = FullAttentionSpec(block_size=size, num_kv_heads=1, head_dim=1, dtype=KVDtype.FP32)
        elif not isinstance(spec, LayerSpec):
            raise ConfigError(f"spec must be a kvpool.specs layer spec or None, got {spec!r}")
        stride = 1
        if hash_block_size is not None:
            hash_size = check_int("hash_block_size", hash_block_size)
            if size % hash_size:
                raise ConfigError(f"block_size {size} is not a multiple of hash_block_size {hash_size}")
            stride = size // hash_size
        self.spec = spec
        self.pool = pool
        self.group_id = gid
        self.block_size = size
        self.hash_stride = stride
        self.alignment = size
        self.enable_caching = caching and spec.prefix_cacheable
        self.index = pool.indexes[gid]
        self.null_block = pool.null_block
        self.tables: dict[str, list[KVBlock]] = {}
        self.num_cached: dict[str, int] = {}
        self._setup()

    def _setup(self) -> None:
        """Derive a layer type's own state from ``self.spec`` (called once, at the end of construction)."""

    # -- hashes at this group's block size ------------------------------------------

    def hashes_of(self, request: Request) -> Sequence[BlockHash]:
        """The request's block hashes at this group's block size (``hashes[k]`` names block ``k``)."""
        if self.hash_stride == 1:
            return request._block_hashes
        return _StridedHashes(request._block_hashes, self.hash_stride)

    def contents_of(self, request: Request) -> Sequence[bytes] | None:
        """The request's block contents at this group's block size (verified index only)."""
        contents = request._block_contents
        if contents is None or self.hash_stride == 1:
            return contents
        return _JoinedContents(contents, self.hash_stride)

    # -- prefix hits -----------------------------------------------------------

    def find_longest_cache_hit(self, request: Request, max_length: int) -> list[KVBlock]:
        """Blocks serving the longest cached prefix of at most ``max_length`` tokens.

        The result covers ``len(result) * block_size`` tokens, a multiple of
        ``alignment``; entries a layer type does not need are the null block.
        Changes nothing.
        """
        bs = self.block_size
        if self.hash_stride == 1:
            hits = self.index.longest_prefix(request._block_hashes, request._block_contents, max_length // bs)
        else:
            hits = self.index.longest_prefix(self.hashes_of(request), self.contents_of(request), max_length // bs)
        align = self.alignment
        if align != bs:
            del hits[len(hits) * bs // align * align // bs :]
        return hits

    # -- blocks a request no longer needs ----------------------------------------

    def num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Leading tokens whose KV no later step will read (0 for full attention)."""
        return 0

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Give back the blocks wholly before the skipped tokens; null them in the table.

        The blocks are released from the last one backwards (the deepest is
        evicted first), stopping at the first entry that is already null:
        earlier calls released everything before it.
        """
        skipped = self.num_skipped_tokens(num_computed_tokens)
        if skipped <= 0:
            return
        table = self.tables[request_id]
        num_skipped = skipped // self.block_size
        if num_skipped > len(table):
            num_skipped = len(table)
        null = self.null_block
        freed: list[KVBlock] = []
        for i in range(num_skipped - 1, -1, -1):
            block = table[i]
            if block.block_id == NULL_BLOCK_ID:
                break
            freed.append(block)
            table[i] = null
        if freed:
            self.pool.free_blocks(freed)

    # -- allocation ----------------------------------------------------------------

    def num_blocks_to_allocate(
        self, request_id: str, num_tokens: int, hit_blocks: list[KVBlock], num_computed_tokens: int
    ) -> int:
        """Free blocks this step would consume: new blocks plus hit blocks that are free now."""
        required = cdiv(num_tokens, self.block_size)
        table = self.tables.get(request_id)
        if table is not None:
            return required - len(table) if required > len(table) else 0
        num_skipped = self.num_skipped_tokens(num_computed_tokens) // self.block_size
        new = required - max(num_skipped, len(hit_blocks))
        evictable = 0
        for block in hit_blocks[num_skipped:]:
            if block.ref_cnt == 0 and block.block_id:
                evictable += 1
        return (new if new > 0 else 0) + evictable

    def add_hit_blocks(self, request_id: str, hit_blocks: list[KVBlock], num_computed_tokens: int) -> None:
        """Start the table of a newly admitted request with its prefix hits."""
        num_skipped = self.num_skipped_tokens(num_computed_tokens) // self.block_size
        if num_skipped:
            kept = hit_blocks[num_skipped:]
            table = [self.null_block] * min(num_skipped, len(hit_blocks)) + kept
        else:
            kept = hit_blocks
            table = list(hit_blocks)
        self.pool.touch(kept)
        self.tables[request_id] = table
        self.num_cached[request_id] = len(table)

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> list[KVBlock]:
        """Grow the table to cover ``num_tokens`` tokens; return the new blocks."""
        table = self.tables.get(request_id)
        if table is None:
            table = self.tables[request_id] = []
            self.num_cached[request_id] = 0
        missing = cdiv(num_tokens, self.block_size) - len(table)
        if missing <= 0:
            return []
        blocks = self.pool.get_new_blocks(missing)
        table.extend(blocks)
        return blocks

    def grow(self, request_id: str, num_computed_tokens: int, num_tokens: int) -> list[int] | None:
        """One step of a running request in a single-group model, in one call.

        Gives back skipped blocks, then grows the table to ``num_tokens`` tokens.
        Returns the new block IDs, or None (and takes nothing) when the free
        queue is short. Same decisions as ``num_blocks_to_allocate`` followed by
        ``allocate_new_blocks``.
        """
        table = self.tables[request_id]
        missing = -(-num_tokens // self.block_size) - len(table)  # cdiv, inlined: once per request per step
        if missing <= 0:
            return []
        pool = self.pool
        if missing > pool.free_queue.num_free_blocks:
            return None
        blocks = pool.get_new_blocks(missing)
        table.extend(blocks)
        return [b.block_id for b in blocks]

    def step(self, request: Request, num_computed_tokens: int, num_tokens: int) -> tuple[list[int] | None, int]:
        """One step of a running request in a single-group model: :meth:`grow`, then :meth:`cache_blocks`.

        Returns the new block IDs (None when the free queue is short: nothing
        is taken or cached) and a *quiet bound*: a later step to fewer tokens
        than it, with no other call on the request in between, changes nothing
        in this group, so the caller may skip it. 0 here: every step is
        called; a layer type whose steps are often no-ops overrides this.
        """
        new = self.grow(request.request_id, num_computed_tokens, num_tokens)
        if new is not None and self.enable_caching:
            self.cache_blocks(request, num_tokens)
        return new, 0

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Offer the blocks that the first ``num_tokens`` tokens fill to the index."""
        rid = request.request_id
        done = self.num_cached[rid]
        stride = self.hash_stride
        if stride == 1:
            hashed = len(request._block_hashes) * self.block_size
            full = (num_tokens if num_tokens < hashed else hashed) // self.block_size
            if full > done:
                self.pool.cache_full_blocks(
                    request,
                    self.tables[rid],
                    done,
                    full,
                    self.group_id,
                    self.block_size,
                    request._block_hashes,
                    request._block_contents,
                )
                self.num_cached[rid] = full
            return
        full = min(num_tokens // self.block_size, len(request._block_hashes) // stride)
        if full > done:
            self._cache_range(request, self.tables[rid], done, full)
            self.num_cached[rid] = full

    def _cache_range(self, request: Request, table: list[KVBlock], start: int, stop: int) -> None:
        """Enter ``table[start:stop]`` into this group's index under the hashes at this group's block size."""
        self.pool.cache_full_blocks(
            request,
            table,
            start,
            stop,
            self.group_id,
            self.block_size,
            self.hashes_of(request),
            self.contents_of(request),
        )

    def free(self, request_id: str) -> None:
        """Release the request's blocks, last block first."""
        table = self.tables.pop(request_id, None)
        self.num_cached.pop(request_id, None)
        if table:
            self.pool.free_blocks(reversed(table))

    # -- sizes -------------------------------------------------------------------

    def max_blocks_for(self, num_tokens: int) -> int:
        """The most blocks one request of ``num_tokens`` tokens holds at once in this group: the spec's count.

        Assumes the request grows in steps no longer than its window (decode,
        or prefill chunks); one long step holds what :meth:`blocks_held_after`
        says.
        """
        return self.spec.blocks_per_request(num_tokens)

    def blocks_held_after(self, num_computed_tokens: int, num_tokens: int) -> int:
        """Blocks a request holds right after a step from ``num_computed_tokens`` to ``num_tokens`` tokens."""
        return cdiv(num_tokens, self.block_size) - self.num_skipped_tokens(num_computed_tokens) // self.block_size
