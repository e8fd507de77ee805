"""The coordinator: one request's view across every layer group.

A prefix hit must be served by every group at the same length: full
attention needs every block of the prefix, a sliding-window group only the
blocks covering the window before the hit point, a chunked-local group the
blocks of the hit point's chunk, a state-space group one state at the hit
point. The coordinator finds the longest length all groups accept.

The common hit
--------------
Every group's hit covers a whole number of its blocks, so a common length is
a multiple of every group's block size: the search works in units of their
least common multiple (the *alignment*), and each group only reports lengths
on it. Then a fixed point::

    length = max_length rounded down to the alignment
    repeat:
        for each group (full attention first):
            candidate = the group's longest hit of at most candidate tokens
        if no group lowered the candidate: done
        length = candidate

Lengths only fall, so it ends; when it ends every group accepted the same
length. Groups whose hits are downward closed (full attention: any shorter
prefix of a hit is a hit) are looked up once and afterwards only trimmed.

Example (block size 4, full attention + window 8)::

    full attention     hits blocks 0..9            -> 40 tokens
    sliding window     asked for 40: blocks 8, 9 were evicted;
                       the latest run of 2 ends at block 5 -> 24 tokens
    full attention     trimmed to 6 blocks          -> 24 tokens, agreed

A group that can never serve a hit (cross attention) makes the common hit
empty. With one group the coordinator is a thin pass-through, so a
single-group manager makes exactly the core's decisions.
"""

from __future__ import annotations

from collections.abc import Sequence
from math import lcm

from kvpool.block import KVBlock
from kvpool.block_pool import BlockPool
from kvpool.checks import check_flag, check_int
from kvpool.errors import ConfigError
from kvpool.groups.base import GroupManager
from kvpool.groups.full_attention import FullAttentionManager
from kvpool.request import Request
from kvpool.specs import KVCacheGroup

__all__ = ["Coordinator", "make_group_managers"]


def make_group_managers(
    pool: object, group_specs: object, block_size: object, enable_caching: object
) -> tuple[GroupManager, ...]:
    """One manager per layer group; no groups means a single full-attention group.

    Each group keeps its own block size, which must be a multiple of
    ``block_size`` (the size request hashes are computed at). The arguments
    (a :class:`BlockPool`, a sequence of ``KVCacheGroup``, an ``int`` and a
    ``bool``) are taken as objects and checked first, so both builds refuse a
    wrong one with the same :class:`~kvpool.errors.ConfigError`.
    """
    if not isinstance(pool, BlockPool):
        raise ConfigError(f"pool must be a kvpool.block_pool.BlockPool, got {pool!r}")
    if isinstance(group_specs, str | bytes) or not isinstance(group_specs, Sequence):
        raise ConfigError(f"groups must be a sequence of KVCacheGroup, got {group_specs!r}")
    block_size = check_int("block_size", block_size)
    enable_caching = check_flag("enable_caching", enable_caching)
    if not group_specs:
        return (FullAttentionManager(pool, 0, block_size, enable_caching),)
    from kvpool.groups import manager_class_for

    managers = []
    listed: list[object] = list(group_specs)
    for i, group in enumerate(listed):
        if not isinstance(group, KVCacheGroup):
            raise ConfigError(f"groups[{i}] must be a kvpool.specs.KVCacheGroup, got {group!r}")
        size = group.block_size
        if size % block_size:
            raise ConfigError(
                f"groups[{i}] ({group.kind.value}) has block_size {size}, which is not a multiple of "
                f"the manager's block_size {block_size}"
            )
        cls = manager_class_for(group.spec)
        managers.append(cls(pool, i, size, enable_caching, spec=group.spec, hash_block_size=block_size))
    return tuple(managers)


class Coordinator:
    """Applies a request's step to every group, and reconciles prefix hits."""

    __slots__ = ("groups", "block_size", "alignment", "_single", "_lookup_order", "_never_hits")

    def __init__(self, groups: object) -> None:
        # Checked as an object first (a compiled build would raise its own TypeError).
        if type(groups) is not tuple or not groups or not all(isinstance(g, GroupManager) for g in groups):
            raise ConfigError(f"groups must be a non-empty tuple of group managers, got {groups!r}")
        managers: tuple[GroupManager, ...] = groups
        self.groups = managers
        self.block_size = managers[0].block_size
        self._single = managers[0] if len(managers) == 1 else None
        #: Tokens a common hit is a multiple of.
        self.alignment = lcm(*(g.block_size for g in managers))
        if self._single is None:
            for group in managers:
                group.alignment = self.alignment
        self._never_hits = any(not g.enable_caching for g in managers)
        # Downward-closed groups (a shorter prefix of a hit is a hit) go first:
        # they are looked up once and then only trimmed.
        self._lookup_order = sorted(range(len(managers)), key=lambda i: not managers[i].downward_closed)

    # -- lookup --------------------------------------------------------------------

    def find_longest_cache_hit(self, request: Request, max_length: int) -> tuple[tuple[list[KVBlock], ...], int]:
        """Per-group hit blocks and the common hit length in tokens."""
        single = self._single
        if single is not None:
            blocks = single.find_longest_cache_hit(request, max_length)
            return (blocks,), len(blocks) * single.block_size
        groups = self.groups
        if self._never_hits:
            return tuple([] for _ in groups), 0
        found: list[list[KVBlock] | None] = [None] * len(groups)
        length = max_length // self.alignment * self.alignment
        while True:
            candidate = length
            for i in self._lookup_order:
                group = groups[i]
                previous = found[i]
                if previous is not None and group.downward_closed:
                    have = len(previous) * group.block_size
                    if have < candidate:
                        candidate = have
                    continue
                if candidate == 0:
                    found[i] = []
                    continue
                blocks = group.find_longest_cache_hit(request, candidate)
                found[i] = blocks
                candidate = len(blocks) * group.block_size
            if candidate >= length:
                break
            length = candidate
        result = []
        for i, group in enumerate(groups):
            blocks = found[i] or []
            del blocks[length // group.block_size :]
            result.append(blocks)
        return tuple(result), length

    def hit_still_valid(self, request: Request, hits: tuple[list[KVBlock], ...]) -> bool:
        """Whether every hit block is still cached under the request's hash."""
        for group, blocks in zip(self.groups, hits):
            hashes = group.hashes_of(request)
            group_id = group.group_id
            for k, block in enumerate(blocks):
                if block.block_id and (block.block_hash != hashes[k] or block.group_id != group_id):
                    return False
        return True

    # -- a step ----------------------------------------------------------------------

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        for group in self.groups:
            group.remove_skipped_blocks(request_id, num_computed_tokens)

    def num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        hits: tuple[list[KVBlock], ...] | None,
        num_computed_tokens: int,
        num_encoder_tokens: int = 0,
    ) -> int:
        single = self._single
        if single is not None and not single.uses_encoder_tokens:
            return single.num_blocks_to_allocate(request_id, num_tokens, hits[0] if hits else [], num_computed_tokens)
        total = 0
        for i, group in enumerate(self.groups):
            if group.uses_encoder_tokens:
                total += group.num_blocks_to_allocate(request_id, num_encoder_tokens, [], 0)
            else:
                total += group.num_blocks_to_allocate(
                    request_id, num_tokens, hits[i] if hits else [], num_computed_tokens
                )
        return total

    def add_hit_blocks(self, request_id: str, hits: tuple[list[KVBlock], ...], num_computed_tokens: int) -> None:
        # Every group takes its hits before any group takes new blocks, so one
        # group's allocation cannot evict another group's just-found hits.
        for i, group in enumerate(self.groups):
            group.add_hit_blocks(request_id, hits[i], num_computed_tokens)

    def allocate_new_blocks(
        self, request_id: str, num_tokens: int, num_encoder_tokens: int = 0
    ) -> tuple[list[KVBlock], ...]:
        single = self._single
        if single is not None and not single.uses_encoder_tokens:
            return (single.allocate_new_blocks(request_id, num_tokens),)
        return tuple(
            group.allocate_new_blocks(request_id, num_encoder_tokens if group.uses_encoder_tokens else num_tokens)
            for group in self.groups
        )

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Offer the blocks the first ``num_tokens`` tokens filled, up to the last aligned length.

        A block past the last multiple of the alignment cannot be part of a
        hit yet; it is cached once the request reaches the next one.
        """
        num_tokens = num_tokens // self.alignment * self.alignment
        for group in self.groups:
            if group.enable_caching:
                group.cache_blocks(request, num_tokens)

    def free(self, request_id: str) -> None:
        for group in self.groups:
            group.free(request_id)

    # -- sizes -------------------------------------------------------------------

    def max_blocks_for(self, num_tokens: int) -> int:
        """Blocks one request of ``num_tokens`` tokens holds at its peak, all groups together.

        Assumes the request grows in steps no longer than its windows;
        cross-attention blocks (sized by the encoder input) are not included.
        """
        return sum(group.max_blocks_for(num_tokens) for group in self.groups)

    def blocks_held_after(self, num_computed_tokens: int, num_tokens: int, num_encoder_tokens: int = 0) -> int:
        """Blocks a request holds right after a step from ``num_computed_tokens`` to ``num_tokens``, all groups."""
        return sum(
            group.blocks_held_after(0, num_encoder_tokens)
            if group.uses_encoder_tokens
            else group.blocks_held_after(num_computed_tokens, num_tokens)
            for group in self.groups
        )
