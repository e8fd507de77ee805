"""Chunks built by hand: the validated way to make the one chunk type, :class:`~kvpool.scheduler.ScheduledChunk`.

This module imports nothing heavy, so callers can build batches without
loading torch.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvpool.errors import InvalidTokenError, KVPoolError, RequestStateError
from kvpool.hashing import TOKEN_LIMIT
from kvpool.scheduler import ScheduledChunk

__all__ = ["SequenceChunk"]


def SequenceChunk(  # noqa: N802 - named as the type it builds is used across the engine
    request_id: str,
    token_ids: Sequence[int],
    start_position: int,
    block_tables: Sequence[Sequence[int]],
    sample: bool = True,
) -> ScheduledChunk:
    """A chunk built by hand (tests, start-up profiling, benchmarks), checked at this boundary.

    There is one chunk type, the scheduler's :class:`~kvpool.scheduler.ScheduledChunk`:
    the engine hands the scheduler's chunks to the model runner as they are, and
    the runner trusts them. This builds the same type from plain values and
    validates everything first.

    The chunk covers positions ``start_position .. start_position + len(token_ids) - 1``.
    Positions ``0 .. start_position - 1`` are already in the KV cache (computed
    earlier by this sequence, or shared through a prefix-cache hit) and are only
    read. ``block_tables`` holds one table per KV cache group; layer ``i`` reads
    and writes through ``block_tables[layer_to_group[i]]``, and the token at
    position ``p`` lives in slot ``table[p // block_size] * block_size + p % block_size``.
    A table must cover every position up to the chunk's last one; block ``0``
    (the null block) may stand only for positions a sliding-window layer can no
    longer see. ``sample`` asks for the logits of the chunk's last token.
    """
    if not isinstance(request_id, str) or not request_id:
        raise KVPoolError(f"request_id must be a non-empty str, got {request_id!r}")
    tokens = tuple(token_ids)
    if not tokens:
        raise KVPoolError(f"chunk of request {request_id!r} has no tokens to compute")
    for token in tokens:
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < TOKEN_LIMIT:
            raise InvalidTokenError(f"request {request_id!r}: token ID {token!r} is not an integer in [0, 2**32)")
    if isinstance(start_position, bool) or not isinstance(start_position, int) or start_position < 0:
        raise RequestStateError(f"request {request_id!r}: start_position must be an int >= 0, got {start_position!r}")
    tables = tuple(tuple(table) for table in block_tables)
    if not tables:
        raise RequestStateError(f"request {request_id!r}: block_tables is empty")
    for table in tables:
        for block_id in table:
            if isinstance(block_id, bool) or not isinstance(block_id, int) or block_id < 0:
                raise RequestStateError(f"request {request_id!r}: block ID {block_id!r} is not an int >= 0")
    if not isinstance(sample, bool):
        raise KVPoolError(f"request {request_id!r}: sample must be a bool, got {sample!r}")
    return ScheduledChunk(
        request_id=request_id,
        start_position=start_position,
        num_tokens=len(tokens),
        sample=sample,
        token_ids=tokens,
        block_tables=tables,
    )
