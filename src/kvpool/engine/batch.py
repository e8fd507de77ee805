"""What the model runner computes in one step: a batch of sequence chunks.

This module imports nothing heavy, so schedulers can build batches without
loading torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpool.errors import InvalidTokenError, KVPoolError, RequestStateError
from kvpool.hashing import TOKEN_LIMIT

__all__ = ["SequenceChunk"]


@dataclass(frozen=True, slots=True)
class SequenceChunk:
    """A run of consecutive tokens of one sequence to compute in this step.

    The chunk covers positions ``start_position .. start_position + len(token_ids) - 1``.
    Positions ``0 .. start_position - 1`` are already in the KV cache (computed
    earlier by this sequence, or shared through a prefix-cache hit) and are only
    read.

    Attributes:
        request_id: Identifies the sequence; unique within one batch.
        token_ids: Tokens to feed this step (at least one).
        start_position: Number of this sequence's tokens already in the KV cache.
        block_tables: One block table per KV cache group. Layer ``i`` reads and
            writes through ``block_tables[layer_to_group[i]]``. The token at
            position ``p`` lives in slot
            ``table[p // block_size] * block_size + p % block_size``. A table must
            cover every position up to the chunk's last one; block ``0`` (the
            null block) may stand only for positions a sliding-window layer can
            no longer see.
        sample: Whether the logits of the chunk's last token are wanted (true for
            a decode step or the last chunk of a prompt).
    """

    request_id: str
    token_ids: tuple[int, ...]
    start_position: int
    block_tables: tuple[tuple[int, ...], ...]
    sample: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.request_id, str) or not self.request_id:
            raise KVPoolError(f"request_id must be a non-empty str, got {self.request_id!r}")
        # Accept any sequence from callers but store tuples, so the chunk stays hashable.
        if not isinstance(self.token_ids, tuple):
            object.__setattr__(self, "token_ids", tuple(self.token_ids))
        if not self.token_ids:
            raise KVPoolError(f"chunk of request {self.request_id!r} has no tokens to compute")
        for token in self.token_ids:
            if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < TOKEN_LIMIT:
                raise InvalidTokenError(
                    f"request {self.request_id!r}: token ID {token!r} is not an integer in [0, 2**32)"
                )
        if (
            isinstance(self.start_position, bool)
            or not isinstance(self.start_position, int)
            or self.start_position < 0
        ):
            raise RequestStateError(
                f"request {self.request_id!r}: start_position must be an int >= 0, "
                f"got {self.start_position!r}"
            )
        tables = tuple(tuple(table) for table in self.block_tables)
        object.__setattr__(self, "block_tables", tables)
        if not tables:
            raise RequestStateError(f"request {self.request_id!r}: block_tables is empty")
        for table in tables:
            for block_id in table:
                if isinstance(block_id, bool) or not isinstance(block_id, int) or block_id < 0:
                    raise RequestStateError(
                        f"request {self.request_id!r}: block ID {block_id!r} is not an int >= 0"
                    )
        if not isinstance(self.sample, bool):
            raise KVPoolError(f"request {self.request_id!r}: sample must be a bool, got {self.sample!r}")

    @property
    def num_tokens(self) -> int:
        """Number of tokens computed by this chunk."""
        return len(self.token_ids)

    @property
    def end_position(self) -> int:
        """One past the chunk's last position: the sequence's cached length afterwards."""
        return self.start_position + len(self.token_ids)
