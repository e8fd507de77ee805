"""Chunked local attention: attention confined to aligned chunks of ``chunk`` tokens.

A query at position ``p`` reads positions ``(p // chunk) * chunk .. p``. With
``c`` tokens computed, the next token is at position ``c``, so the tokens of
every finished chunk are skipped::

    chunk = 8, block_size = 4

    position  0 .. 3 | 4 .. 7 | 8 .. 11 | 12 .. 15 | 16 ..
    block        0   |    1   |    2    |    3     |   4
              \\____ chunk 0 ___/ \\____ chunk 1 _____/

    c = 13: num_skipped_tokens = 8   -> blocks 0, 1 released and nulled
    c = 16: num_skipped_tokens = 16  -> blocks 2, 3 follow (the whole chunk 1)
    c = 7:  num_skipped_tokens = 0   -> nothing yet

Prefix hits
-----------
A hit of ``L`` tokens needs the cached blocks from the start of the chunk
holding position ``L`` up to ``L``; the blocks of earlier chunks are null. The
search starts at that chunk's first block and walks forward to the first
miss, so a candidate that ends exactly on a chunk boundary is a hit with no
real block at all::

    chunk = 8, block_size = 4, candidate 15 tokens
    blocks 0, 1 are in finished chunk 0  -> [0, 0]
    block 2 (positions 8..11) cached?    -> [0, 0, b2]   12 tokens
                              missing?   -> [0, 0]        8 tokens

When the chunk size is not a multiple of the block size, the block holding a
chunk's start also holds tokens of the previous chunk; a result that falls
back into an earlier chunk is searched again from that chunk's start, so every
block the hit's next token reads is real.
"""

from __future__ import annotations

from typing import ClassVar

from kvpool.block import KVBlock
from kvpool.groups.base import GroupManager
from kvpool.request import Request
from kvpool.specs import ChunkedLocalAttentionSpec

__all__ = ["ChunkedLocalAttentionManager"]


class ChunkedLocalAttentionManager(GroupManager):
    """Keeps the blocks of the current chunk; hits scan forward from the chunk start."""

    downward_closed: ClassVar[bool] = False
    supports_verified_index: ClassVar[bool] = False

    spec: ChunkedLocalAttentionSpec

    def _setup(self) -> None:
        self.attention_chunk_size: int = self.spec.attention_chunk_size

    def num_skipped_tokens(self, num_computed_tokens: int) -> int:
        chunk = self.attention_chunk_size
        return num_computed_tokens // chunk * chunk

    def _first_block_needed(self, length: int) -> int:
        """The first block a token at position ``length`` reads."""
        return self.num_skipped_tokens(length) // self.block_size

    def find_longest_cache_hit(self, request: Request, max_length: int) -> list[KVBlock]:
        hashes = self.hashes_of(request)
        bs, align = self.block_size, self.alignment
        get = self.index.get
        length = max_length
        while True:
            start = self._first_block_needed(length)
            hits: list[KVBlock] = [self.null_block] * start
            for i in range(start, min(length // bs, len(hashes))):
                block = get(hashes[i])
                if block is None:
                    break
                hits.append(block)
            found = len(hits) * bs // align * align
            if found == length or self._first_block_needed(found) >= start:
                del hits[found // bs :]
                return hits
            length = found  # fell back into an earlier chunk: its blocks were not looked at

    def grow(self, request_id: str, num_computed_tokens: int, num_tokens: int) -> list[int] | None:
        self.remove_skipped_blocks(request_id, num_computed_tokens)
        return super().grow(request_id, num_computed_tokens, num_tokens)
