"""Paged attention in plain torch: write K/V at slots, attend through block tables.

Shapes used throughout (``T`` = tokens computed this step, summed over the
batch; ``B`` = sequences in the batch; ``H`` / ``Hkv`` = query / key-value heads;
``D`` = head size; ``Q`` = longest chunk in the batch; ``K`` = most keys any
sequence attends to this step):

* ``query``: ``[T, H, D]``; new ``key`` / ``value``: ``[T, Hkv, D]``, flattened
  over the batch in chunk order, with no padding.
* ``key_cache`` / ``value_cache``: ``[num_blocks, block_size, Hkv, D]``.
* A slot is ``block_id * block_size + offset``; it indexes the flattened cache
  view ``[num_blocks * block_size, Hkv, D]``.

Visibility (identical to transformers 5.24, ``masking_utils``): a query at
position ``q`` sees a key at position ``k`` iff ``k <= q`` (causal) and, on a
layer with sliding window ``W``, also ``k > q - W``; i.e. the ``W`` most recent
positions, itself included. A chunk starting at ``s`` therefore needs keys from
``max(0, s - W + 1)`` on, and only those are gathered: blocks wholly before that
may be the null block ``0``, which is never read.

Attention itself runs on a padded ``[B, H, Q, K]`` problem built once per step
(per KV cache group and window) by :func:`build_attention_metadata` and reused
by every layer that shares the group and window; the padding lives only inside
attention, never in the model's token dimension.

Keys and values are gathered a whole block at a time (one row copy per block
rather than per token, several times faster on a CPU): the ``K`` columns of a
sequence are the blocks from the one holding its first visible position to the
one holding its newest, padded with repeats of its newest block. Columns that
are not visible positions (before the window, past the newest token, padding)
are masked, and their gathered copies are zeroed so that whatever a reused
block still holds there never reaches the output.

A backend is chosen once, when the model runner is built
(:func:`select_attention_backend`). :class:`TorchAttentionBackend` always works;
a fused device kernel can be added as another :class:`AttentionBackend` without
touching the runner.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from kvpool.errors import ConfigError, RequestStateError

__all__ = [
    "AttentionBackend",
    "AttentionBackendKind",
    "AttentionMetadata",
    "NULL_BLOCK_ID",
    "TorchAttentionBackend",
    "build_attention_metadata",
    "paged_attention",
    "select_attention_backend",
    "write_kv",
]

#: Placeholder block for positions a sliding-window layer no longer sees.
NULL_BLOCK_ID = 0


@dataclass(frozen=True, slots=True, eq=False)
class AttentionMetadata:
    """Index tensors for one step of one KV cache group and one window setting.

    Attributes:
        slot_mapping: ``[T]`` int64, the cache slot each new token's K/V goes to.
        query_index: ``[B * Q]`` int64, for each padded query row the row of the
            flattened ``[T, ...]`` tensors it is copied from (padding rows read row 0).
        output_index: ``[T]`` int64, for each flattened token its row in the
            padded ``[B * Q]`` output.
        key_slots: ``[B, K]`` int64, the cache slot of each gathered key column.
        key_blocks: ``[B, K / block_size]`` int64, the blocks gathered for each
            sequence (padding repeats its newest block).
        invalid_keys: ``[n]`` int64, flat indices into ``[B * K]`` of the columns
            that are not visible positions of their sequence (masked and zeroed).
        mask: ``[B, 1, Q, K]`` bool, True where the query may attend to the key.
            Padding query rows see every column so that softmax stays finite.
        num_seqs: ``B``.
        max_query_len: ``Q``.
        sliding_window: The window these indices were built for, or None.
    """

    slot_mapping: torch.Tensor
    query_index: torch.Tensor
    output_index: torch.Tensor
    key_slots: torch.Tensor
    key_blocks: torch.Tensor
    invalid_keys: torch.Tensor
    mask: torch.Tensor
    num_seqs: int
    max_query_len: int
    sliding_window: int | None


def _labels(labels: Sequence[str] | None, count: int) -> Sequence[str]:
    return labels if labels is not None else [f"#{i}" for i in range(count)]


def build_attention_metadata(
    start_positions: Sequence[int],
    query_lens: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    *,
    block_size: int,
    num_blocks: int,
    sliding_window: int | None = None,
    device: torch.device | str = "cpu",
    labels: Sequence[str] | None = None,
) -> AttentionMetadata:
    """Turn a batch's positions and block tables into gather/scatter indices.

    Args:
        start_positions: Per sequence, positions already in the cache (``s``).
        query_lens: Per sequence, tokens computed this step (``>= 1``).
        block_tables: Per sequence, the block table of this KV cache group.
        block_size: Tokens per block.
        num_blocks: Blocks in the cache, the null block included.
        sliding_window: ``W`` for a sliding-window layer, None for full attention.
        device: Where the index tensors go (the cache's device).
        labels: Per sequence, a name used in error messages (the request ID).

    Raises:
        RequestStateError: a block table does not cover the chunk's positions,
            holds a block ID outside the cache, puts the null block where a
            position is still visible, or two tokens of the batch would be
            written to the same slot.
        ConfigError: the argument lists disagree in length, or a window < 1.
    """
    num_seqs = len(query_lens)
    if not (len(start_positions) == num_seqs == len(block_tables)) or num_seqs == 0:
        raise ConfigError(
            f"need one start position, query length and block table per sequence; got "
            f"{len(start_positions)}, {num_seqs}, {len(block_tables)}"
        )
    if sliding_window is not None and sliding_window < 1:
        raise ConfigError(f"sliding_window must be >= 1 or None, got {sliding_window!r}")
    names = _labels(labels, num_seqs)

    key_starts: list[int] = []
    for name, start, qlen, table in zip(names, start_positions, query_lens, block_tables):
        if qlen < 1:
            raise RequestStateError(f"sequence {name!r} computes {qlen} tokens; at least 1 is needed")
        end = start + qlen
        needed = -(-end // block_size)
        if len(table) < needed:
            raise RequestStateError(
                f"sequence {name!r}: block table has {len(table)} block(s) but positions "
                f"0..{end - 1} need {needed} of size {block_size}"
            )
        for block_id in table[:needed]:
            if not 0 <= block_id < num_blocks:
                raise RequestStateError(
                    f"sequence {name!r}: block ID {block_id} is outside the cache's {num_blocks} blocks"
                )
        key_start = 0 if sliding_window is None else max(0, start - sliding_window + 1)
        # Every block holding a visible position must be a real block.
        for index in range(key_start // block_size, needed):
            if table[index] == NULL_BLOCK_ID:
                raise RequestStateError(
                    f"sequence {name!r}: block table entry {index} is the null block, but "
                    f"positions {index * block_size}..{(index + 1) * block_size - 1} are still "
                    f"visible to a chunk at {start}..{end - 1}"
                    + ("" if sliding_window is None else f" with sliding window {sliding_window}")
                )
        key_starts.append(key_start)

    starts_t = torch.tensor(list(start_positions), dtype=torch.int64)
    qlens_t = torch.tensor(list(query_lens), dtype=torch.int64)
    key_starts_t = torch.tensor(key_starts, dtype=torch.int64)
    ends_t = starts_t + qlens_t
    first_block_t = key_starts_t // block_size
    num_key_blocks_t = (ends_t - 1) // block_size - first_block_t + 1
    max_q = int(qlens_t.max())
    max_kb = int(num_key_blocks_t.max())
    max_k = max_kb * block_size
    max_blocks = max(len(t) for t in block_tables)
    tables_t = torch.zeros((num_seqs, max_blocks), dtype=torch.int64)
    for row, table in enumerate(block_tables):
        tables_t[row, : len(table)] = torch.tensor(list(table), dtype=torch.int64)

    last_pos = (ends_t - 1)[:, None]

    def slots_of(positions: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        # Padding entries take the slot of the sequence's newest token, which is
        # always a real, freshly written block: padding never touches the null
        # block or another sequence's blocks.
        safe = torch.where(valid, positions, last_pos)
        blocks = tables_t.gather(1, safe // block_size)
        return blocks * block_size + safe % block_size

    q_cols = torch.arange(max_q, dtype=torch.int64)
    q_valid = q_cols[None, :] < qlens_t[:, None]  # [B, Q]
    q_pos = starts_t[:, None] + q_cols[None, :]  # [B, Q]
    k_cols = torch.arange(max_k, dtype=torch.int64)
    k_pos = first_block_t[:, None] * block_size + k_cols[None, :]  # [B, K], block-aligned
    k_valid = (k_pos >= key_starts_t[:, None]) & (k_pos < ends_t[:, None])  # padding lies past the end
    kb_cols = torch.arange(max_kb, dtype=torch.int64)
    kb_index = first_block_t[:, None] + torch.minimum(kb_cols[None, :], num_key_blocks_t[:, None] - 1)
    key_blocks = tables_t.gather(1, kb_index)  # [B, K / block_size]
    invalid_keys = torch.nonzero(~k_valid.reshape(-1)).reshape(-1)

    slot_mapping = slots_of(q_pos, q_valid)[q_valid]  # [T], chunk order
    if torch.unique(slot_mapping).numel() != slot_mapping.numel():
        raise RequestStateError("two tokens of the batch would be written to the same KV cache slot")
    key_slots = key_blocks.repeat_interleave(block_size, dim=1) * block_size + k_cols[None, :] % block_size

    visible = k_valid[:, None, :] & (k_pos[:, None, :] <= q_pos[:, :, None])
    if sliding_window is not None:
        visible &= k_pos[:, None, :] > q_pos[:, :, None] - sliding_window
    # Padding query rows see everything: their output is dropped, but an all-False
    # row would make softmax produce NaN.
    visible |= ~q_valid[:, :, None]

    offsets = torch.cumsum(qlens_t, 0) - qlens_t
    query_index = torch.where(q_valid, offsets[:, None] + q_cols[None, :], 0).reshape(-1)
    padded_rows = torch.arange(num_seqs * max_q, dtype=torch.int64).reshape(num_seqs, max_q)
    output_index = padded_rows[q_valid]

    return AttentionMetadata(
        slot_mapping=slot_mapping.to(device),
        query_index=query_index.to(device),
        output_index=output_index.to(device),
        key_slots=key_slots.to(device),
        key_blocks=key_blocks.to(device),
        invalid_keys=invalid_keys.to(device),
        mask=visible[:, None, :, :].to(device),
        num_seqs=num_seqs,
        max_query_len=max_q,
        sliding_window=sliding_window,
    )


def write_kv(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store new keys and values in the cache, in place.

    Args:
        key_cache: ``[num_blocks, block_size, Hkv, D]``.
        value_cache: Same shape as ``key_cache``.
        key: ``[T, Hkv, D]`` (already rotated).
        value: ``[T, Hkv, D]``.
        slot_mapping: ``[T]`` int64, distinct slots.
    """
    num_kv_heads, head_dim = key_cache.shape[-2:]
    key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key.to(key_cache.dtype))
    value_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value.to(value_cache.dtype))


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    metadata: AttentionMetadata,
    *,
    scale: float,
    logit_softcap: float | None = None,
) -> torch.Tensor:
    """Attend each sequence's queries to its cached keys and values.

    The new tokens' K/V must already be in the cache (:func:`write_kv`).

    Args:
        query: ``[T, H, D]`` (already rotated); ``H`` a multiple of ``Hkv``.
        key_cache: ``[num_blocks, block_size, Hkv, D]``.
        value_cache: Same shape as ``key_cache``.
        metadata: From :func:`build_attention_metadata` for this batch.
        scale: Multiplier of ``q . k`` (usually ``D ** -0.5``).
        logit_softcap: If set, scores become ``c * tanh(scores / c)`` before the
            mask (Gemma 2); this takes the explicit matmul path.

    Returns:
        ``[T, H, D]``, in the dtype of ``query``.
    """
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[-2]
    batch, max_q = metadata.num_seqs, metadata.max_query_len

    # [B*Q, H, D] -> [B, H, Q, D]
    q = query.index_select(0, metadata.query_index).view(batch, max_q, num_heads, head_dim).transpose(1, 2)
    # Whole blocks with index_select (one row copy per block), then the columns that
    # are no visible position are zeroed: a reused block may hold anything there.
    flat_blocks = metadata.key_blocks.view(-1)
    kv_shape = (batch, metadata.key_slots.shape[1], num_kv_heads, head_dim)
    # [B, K, Hkv, D] -> [B, Hkv, K, D]
    k = key_cache.index_select(0, flat_blocks).view(kv_shape)
    v = value_cache.index_select(0, flat_blocks).view(kv_shape)
    if metadata.invalid_keys.numel():
        k.view(-1, num_kv_heads, head_dim).index_fill_(0, metadata.invalid_keys, 0.0)
        v.view(-1, num_kv_heads, head_dim).index_fill_(0, metadata.invalid_keys, 0.0)
    k = k.transpose(1, 2).to(query.dtype)
    v = v.transpose(1, 2).to(query.dtype)

    if logit_softcap is None:
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=metadata.mask, scale=scale, enable_gqa=num_heads != num_kv_heads
        )
    else:
        repeats = num_heads // num_kv_heads
        k = k.repeat_interleave(repeats, dim=1)
        v = v.repeat_interleave(repeats, dim=1)
        scores = torch.matmul(q, k.transpose(-1, -2)) * scale
        scores = torch.tanh(scores / logit_softcap) * logit_softcap
        scores = scores.masked_fill(~metadata.mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        out = torch.matmul(probs, v)

    # [B, H, Q, D] -> [B*Q, H, D] -> [T, H, D]
    out = out.transpose(1, 2).reshape(batch * max_q, num_heads, head_dim)
    return out.index_select(0, metadata.output_index)


class AttentionBackendKind(enum.Enum):
    """Implementations of paged attention."""

    #: Plain torch (gather + scaled_dot_product_attention); works on every device.
    TORCH = "torch"


class AttentionBackend(Protocol):
    """What the model runner needs from an attention implementation."""

    kind: AttentionBackendKind

    def build_metadata(
        self,
        start_positions: Sequence[int],
        query_lens: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        *,
        block_size: int,
        num_blocks: int,
        sliding_window: int | None,
        device: torch.device,
        labels: Sequence[str] | None,
    ) -> AttentionMetadata: ...

    def write_kv(
        self,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> None: ...

    def attend(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        metadata: AttentionMetadata,
        *,
        scale: float,
        logit_softcap: float | None,
    ) -> torch.Tensor: ...


class TorchAttentionBackend:
    """The always-available backend: the functions of this module."""

    kind = AttentionBackendKind.TORCH

    def build_metadata(
        self,
        start_positions: Sequence[int],
        query_lens: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        *,
        block_size: int,
        num_blocks: int,
        sliding_window: int | None,
        device: torch.device,
        labels: Sequence[str] | None,
    ) -> AttentionMetadata:
        return build_attention_metadata(
            start_positions,
            query_lens,
            block_tables,
            block_size=block_size,
            num_blocks=num_blocks,
            sliding_window=sliding_window,
            device=device,
            labels=labels,
        )

    def write_kv(
        self,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> None:
        write_kv(key_cache, value_cache, key, value, metadata.slot_mapping)

    def attend(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        metadata: AttentionMetadata,
        *,
        scale: float,
        logit_softcap: float | None,
    ) -> torch.Tensor:
        return paged_attention(
            query, key_cache, value_cache, metadata, scale=scale, logit_softcap=logit_softcap
        )


_BACKENDS: dict[AttentionBackendKind, type] = {AttentionBackendKind.TORCH: TorchAttentionBackend}


def select_attention_backend(
    device: torch.device | str, kind: AttentionBackendKind | str | None = None
) -> AttentionBackend:
    """Pick the attention implementation for ``device``.

    Args:
        device: Device of the KV cache. Every device gets the torch backend
            today; a fused kernel for a device would be preferred here.
        kind: A specific backend, or None for the best one available on ``device``.

    Raises:
        ConfigError: ``kind`` is unknown.
    """
    if kind is None:
        return TorchAttentionBackend()
    try:
        resolved = AttentionBackendKind(kind.value if isinstance(kind, AttentionBackendKind) else kind)
    except ValueError:
        known = ", ".join(k.value for k in AttentionBackendKind)
        raise ConfigError(f"unknown attention backend {kind!r}; known: {known}") from None
    return _BACKENDS[resolved]()
