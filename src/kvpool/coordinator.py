"""The coordinator: one request's view across every layer group.

A prefix hit must be served by every group at the same length: full
attention needs every block of the prefix, a sliding-window group only the
blocks covering the window before the hit point, a state-space group one
state at the hit point. The coordinator finds the longest length all groups
accept, by a fixed point: each group either accepts the candidate length or
lowers it, and any lowering restarts the round. Lengths only fall, so it
ends.

With one group the coordinator is a thin pass-through, so a single-group
manager makes exactly the core's decisions.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvpool.block import KVBlock
from kvpool.block_pool import BlockPool
from kvpool.groups.base import GroupManager, cdiv
from kvpool.groups.full_attention import FullAttentionManager
from kvpool.request import Request

__all__ = ["Coordinator", "make_group_managers"]


def make_group_managers(
    pool: BlockPool, group_specs: Sequence, block_size: int, enable_caching: bool
) -> tuple[GroupManager, ...]:
    """One manager per layer group; no groups means a single full-attention group."""
    if not group_specs:
        return (FullAttentionManager(pool, 0, block_size, enable_caching),)
    from kvpool.groups import manager_class_for

    return tuple(
        manager_class_for(group.spec)(pool, i, block_size, enable_caching, spec=group.spec)
        for i, group in enumerate(group_specs)
    )


class Coordinator:
    """Applies a request's step to every group, and reconciles prefix hits."""

    __slots__ = ("groups", "block_size", "_single", "_lookup_order")

    def __init__(self, groups: tuple[GroupManager, ...]) -> None:
        self.groups = groups
        self.block_size = groups[0].block_size
        self._single = groups[0] if len(groups) == 1 else None
        # Downward-closed groups (a shorter prefix of a hit is a hit) go first:
        # they are looked up once and then only trimmed.
        self._lookup_order = sorted(range(len(groups)), key=lambda i: not groups[i].downward_closed)

    # -- lookup --------------------------------------------------------------------

    def find_longest_cache_hit(self, request: Request, max_length: int) -> tuple[tuple[list[KVBlock], ...], int]:
        """Per-group hit blocks and the common hit length in tokens."""
        single = self._single
        if single is not None:
            blocks = single.find_longest_cache_hit(request, max_length)
            return (blocks,), len(blocks) * single.block_size
        groups = self.groups
        found: list[list[KVBlock] | None] = [None] * len(groups)
        length = max_length
        while True:
            candidate = length
            for i in self._lookup_order:
                group = groups[i]
                if not group.enable_caching:
                    found[i] = []
                    candidate = 0
                    continue
                previous = found[i]
                if previous is not None and group.downward_closed:
                    candidate = min(candidate, len(previous) * group.block_size)
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
            del blocks[cdiv(length, group.block_size) :]
            result.append(blocks)
        return tuple(result), length

    def hit_still_valid(self, request: Request, hits: tuple[list[KVBlock], ...]) -> bool:
        """Whether every hit block is still cached under the request's hash."""
        hashes = request.block_hashes
        for group_id, blocks in enumerate(hits):
            for k, block in enumerate(blocks):
                if block.block_id and (block.block_hash != hashes[k] or block.group_id != group_id):
                    return False
        return True

    # -- a step ----------------------------------------------------------------------

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        for group in self.groups:
            group.remove_skipped_blocks(request_id, num_computed_tokens)

    def num_blocks_to_allocate(
        self, request_id: str, num_tokens: int, hits: tuple[list[KVBlock], ...] | None, num_computed_tokens: int
    ) -> int:
        single = self._single
        if single is not None:
            return single.num_blocks_to_allocate(request_id, num_tokens, hits[0] if hits else [], num_computed_tokens)
        total = 0
        for i, group in enumerate(self.groups):
            total += group.num_blocks_to_allocate(request_id, num_tokens, hits[i] if hits else [], num_computed_tokens)
        return total

    def add_hit_blocks(self, request_id: str, hits: tuple[list[KVBlock], ...], num_computed_tokens: int) -> None:
        # Every group takes its hits before any group takes new blocks, so one
        # group's allocation cannot evict another group's just-found hits.
        for i, group in enumerate(self.groups):
            group.add_hit_blocks(request_id, hits[i], num_computed_tokens)

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> tuple[list[KVBlock], ...]:
        single = self._single
        if single is not None:
            return (single.allocate_new_blocks(request_id, num_tokens),)
        return tuple(group.allocate_new_blocks(request_id, num_tokens) for group in self.groups)

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        for group in self.groups:
            if group.enable_caching:
                group.cache_blocks(request, num_tokens)

    def free(self, request_id: str) -> None:
        for group in self.groups:
            group.free(request_id)

    def max_blocks_for(self, num_tokens: int) -> int:
        """Blocks one request of ``num_tokens`` tokens holds at its peak, all groups together."""
        return sum(group.max_blocks_for(num_tokens) for group in self.groups)
