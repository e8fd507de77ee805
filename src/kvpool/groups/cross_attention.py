"""Cross attention (encoder-decoder models): the decoder reads the encoder's keys and values.

The group's blocks hold K and V of the request's *encoder* input, so they are
sized by ``num_encoder_tokens`` (the keyword of
:meth:`kvpool.KVCacheManager.allocate_slots`), not by the decoder's tokens::

    encoder input: 10 tokens, block_size 4   ->  table [b1 | b2 | b3], allocated once
    decoder tokens 0, 1, 2, ...              ->  no growth in this group

The encoder input is not part of the token hash chain, so these blocks are
never cached and a model with a cross-attention group gets no prefix hits
(its decoder's keys and values depend on the encoder input too). The blocks
go back to the pool, uncached, when the request is freed.
"""

from __future__ import annotations

from typing import ClassVar

from kvpool.block import KVBlock
from kvpool.groups.base import GroupManager
from kvpool.request import Request
from kvpool.specs import cdiv

__all__ = ["CrossAttentionManager"]


class CrossAttentionManager(GroupManager):
    """Blocks for the encoder input, allocated by ``num_encoder_tokens``; never cached."""

    uses_encoder_tokens: ClassVar[bool] = True

    def find_longest_cache_hit(self, request: Request, max_length: int) -> list[KVBlock]:
        return []

    def add_hit_blocks(self, request_id: str, hit_blocks: list[KVBlock], num_computed_tokens: int) -> None:
        self.tables[request_id] = []
        self.num_cached[request_id] = 0

    def grow(self, request_id: str, num_computed_tokens: int, num_tokens: int) -> list[int] | None:
        """Decoder tokens need no room here."""
        return []

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Never caches."""

    def max_blocks_for(self, num_tokens: int) -> int:
        """Zero: the encoder length, not the decoder's, sizes this group."""
        return 0

    def blocks_held_after(self, num_computed_tokens: int, num_tokens: int) -> int:
        """``num_tokens`` here is the encoder length."""
        return cdiv(num_tokens, self.block_size)
