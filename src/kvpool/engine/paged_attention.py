"""Paged attention in plain torch: write K/V at slots, attend through block tables.

Shapes used throughout (``T`` = tokens computed this step, summed over the
batch; ``H`` / ``Hkv`` = query / key-value heads; ``D`` = head size):

* ``query``: ``[T, H, D]``; new ``key`` / ``value``: ``[T, Hkv, D]``, flattened
  over the batch in chunk order, with no padding.
* ``key_cache`` / ``value_cache``: ``[num_blocks, block_size, Hkv, D]``.
* A slot is ``block_id * block_size + offset``; it indexes the flattened cache
  view ``[num_blocks * block_size, Hkv, D]``.

Visibility (identical to transformers 5.24, ``masking_utils``): a query at
position ``q`` sees a key at position ``k`` iff ``k <= q`` (causal) and, on a
layer with sliding window ``W``, also ``k > q - W``; i.e. the ``W`` most recent
positions, itself included. A chunk starting at ``s`` therefore needs keys from
``max(0, s - W + 1)`` on, and only those are read: blocks wholly before that
may be the null block ``0``, which is never read.

No padding across the step
--------------------------

A server's steps mix one long conversation with many short requests, prefill
chunks with decodes. Padding every sequence to the step's longest query and
longest context makes such a step cost several times the sum of its parts, so
the step is split into *attention groups* once (by
:func:`build_attention_metadata`, shared by every layer of a KV cache group
and window), and each group is one ``scaled_dot_product_attention`` call over
exactly the keys its sequences read::

    step:  [chunk A: 448 tokens over 4,096]  [decode B @ 8,192]  [decodes C..J @ 120-130]
    calls: A alone (causal mask)             B alone (no mask)   C..J together, padded to 130 keys

* A prefill chunk (more than one query) is always a group of its own: its
  queries are a slice of ``query`` (no copy) and its keys are the blocks from
  the one holding its first visible position, trimmed to exactly the visible
  range. A chunk that starts at 0 on a full-attention layer uses
  ``is_causal`` (its square mask needs no tensor); others get one additive
  ``[Q, K]`` mask.
* Decodes are sorted by the number of keys they read and packed greedily: a
  decode joins the current group when padding it to the group's longest
  costs at most :data:`GROUP_PADDING_KEYS` extra key columns (about what a
  call of its own costs in fixed overhead) and the group's gather stays
  within :data:`GROUP_KEY_LIMIT` keys (or one sequence's, when longer). A
  decode alone reads its exact key range and needs no mask; in a padded
  group the columns past a sequence's visible range are masked and their
  gathered copies zeroed, since a reused block may hold anything there.

So every sequence's attention reads its own blocks only, and the keys a step
gathers are, up to a group's padding, the keys its sequences attend to: a
step's attention costs the sum of its sequences' attention plus one call's
overhead per group. Keys and values are gathered a whole block at a time with
``index_select`` (one row copy per block rather than per token, several times
faster on a CPU), one group at a time, so the transient copy is one group's.

A backend is chosen once, when the model runner is built
(:func:`select_attention_backend`). :class:`TorchAttentionBackend` always works;
a fused device kernel that reads the blocks in place can be added as another
:class:`AttentionBackend` without touching the runner.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from kvpool.block import NULL_BLOCK_ID  # positions a sliding-window layer no longer sees
from kvpool.errors import ConfigError, RequestStateError

__all__ = [
    "AttentionBackend",
    "AttentionBackendKind",
    "AttentionGroup",
    "AttentionMetadata",
    "GROUP_KEY_LIMIT",
    "GROUP_PADDING_KEYS",
    "SHARED_PREFIX_MIN_KEYS",
    "TorchAttentionBackend",
    "attention_workspace_bytes",
    "build_attention_metadata",
    "paged_attention",
    "select_attention_backend",
    "write_kv",
]

#: Most key columns of padding a decode may add to join a group. One call's fixed
#: cost (a few torch dispatches) is about what attending to this many more keys costs
#: one decode on a CPU, so below it a shared call wins and above it a call of its own.
GROUP_PADDING_KEYS = 256

#: Most keys (sequences x padded keys) one group gathers, unless a single sequence
#: reads more: it bounds the transient copy of a step of many long decodes.
GROUP_KEY_LIMIT = 16384

#: Fewest keys a decode group's members must share (the same leading blocks, a common
#: prompt) before they are attended to once for the whole group rather than once per
#: member: below it the split's extra merge costs more than the copies it saves.
SHARED_PREFIX_MIN_KEYS = 32


@dataclass(frozen=True, slots=True, eq=False)
class AttentionGroup:
    """Sequences that attend in one call (see the module docstring).

    Attributes:
        token_rows: ``[B]`` int64 for a decode group: the row of ``query`` (and of
            the output) of each member; None for a single sequence, whose rows
            are ``first_row .. first_row + query_len - 1``.
        first_row: First row of a single sequence's tokens in ``[T, ...]``.
        query_len: ``Q``, tokens of the (single) sequence; 1 for a decode group.
        key_blocks: ``[B * n]`` int64, the ``n`` blocks gathered per member, in order
            (a member with fewer repeats its newest block).
        key_offset: Column of the first key kept from the gathered blocks (the
            first visible position's offset in its block).
        num_keys: ``K``, key columns attended per member after the offset.
        invalid_keys: ``[m]`` int64, flat indices into the gathered ``[B * n * block_size]``
            rows that are not visible positions of their member (zeroed), or None.
        mask: Additive ``[B, 1, Q, K]`` mask (0 visible, -inf hidden), or None.
        is_causal: The keys are exactly the query positions: a square causal mask.
        shared_blocks: ``[S]`` int64 for a decode group whose members all begin
            with these same blocks (a shared prompt): every member's first
            ``S * block_size`` positions, read once for the whole group; then
            ``key_blocks`` hold only what follows them. None otherwise.
    """

    token_rows: torch.Tensor | None
    first_row: int
    query_len: int
    key_blocks: torch.Tensor
    key_offset: int
    num_keys: int
    invalid_keys: torch.Tensor | None
    mask: torch.Tensor | None
    is_causal: bool
    shared_blocks: torch.Tensor | None = None

    @property
    def num_seqs(self) -> int:
        return 1 if self.token_rows is None else int(self.token_rows.shape[0])


@dataclass(frozen=True, slots=True, eq=False)
class AttentionMetadata:
    """Indices for one step of one KV cache group and one window setting.

    Attributes:
        slot_mapping: ``[T]`` int64, the cache slot each new token's K/V goes to.
        groups: The attention calls of the step, each over its own sequences.
        num_tokens: ``T``.
        sliding_window: The window these indices were built for, or None.
    """

    slot_mapping: torch.Tensor
    groups: tuple[AttentionGroup, ...]
    num_tokens: int
    sliding_window: int | None


def _labels(labels: Sequence[str] | None, count: int) -> Sequence[str]:
    return labels if labels is not None else [f"#{i}" for i in range(count)]


def _check_tables(
    names: Sequence[str],
    start_positions: Sequence[int],
    query_lens: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    block_size: int,
    num_blocks: int,
    sliding_window: int | None,
) -> list[int]:
    """Per sequence, the first position it reads; raises on a table that cannot serve the chunk."""
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
    return key_starts


def _decode_groups(decodes: list[int], num_keys: Sequence[int]) -> list[list[int]]:
    """Pack decodes (sequence indices) into groups, longest first; O(n log n).

    A decode joins the open group if padding it to the group's keys costs at most
    :data:`GROUP_PADDING_KEYS` columns and the group's gather stays within
    :data:`GROUP_KEY_LIMIT` keys; otherwise it opens the next group.
    """
    groups: list[list[int]] = []
    width = 0
    for seq in sorted(decodes, key=lambda i: -num_keys[i]):
        if (
            groups
            and width - num_keys[seq] <= GROUP_PADDING_KEYS
            and (len(groups[-1]) + 1) * width <= max(GROUP_KEY_LIMIT, width)
        ):
            groups[-1].append(seq)
        else:
            groups.append([seq])
            width = num_keys[seq]
    return groups


def _shared_blocks(
    members: Sequence[int], block_tables: Sequence[Sequence[int]], ends: Sequence[int], block_size: int
) -> int:
    """How many leading blocks every member's table has in common, each member keeping its newest block apart.

    Shared blocks are whole and wholly visible to every member (full attention);
    each member's own part keeps at least its newest position, so neither part
    of the split is ever empty.
    """
    limit = min((ends[s] - 1) // block_size for s in members)
    first = block_tables[members[0]]
    count = 0
    while count < limit and all(block_tables[s][count] == first[count] for s in members):
        count += 1
    return count


def build_attention_metadata(
    start_positions: Sequence[int],
    query_lens: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    *,
    block_size: int,
    num_blocks: int,
    sliding_window: int | None = None,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    labels: Sequence[str] | None = None,
) -> AttentionMetadata:
    """Turn a batch's positions and block tables into attention groups and slots.

    Cost: O(total block-table entries read) in Python, plus the groups' masks:
    ``Q x K`` for a chunk that needs one, ``B x K`` for a padded decode group.

    Args:
        start_positions: Per sequence, positions already in the cache (``s``).
        query_lens: Per sequence, tokens computed this step (``>= 1``).
        block_tables: Per sequence, the block table of this KV cache group.
        block_size: Tokens per block.
        num_blocks: Blocks in the cache, the null block included.
        sliding_window: ``W`` for a sliding-window layer, None for full attention.
        device: Where the index tensors go (the cache's device).
        dtype: The queries' dtype (the masks are additive in it).
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
    key_starts = _check_tables(names, start_positions, query_lens, block_tables, block_size, num_blocks, sliding_window)

    slots: list[int] = []
    first_rows: list[int] = []
    for start, qlen, table in zip(start_positions, query_lens, block_tables):
        first_rows.append(len(slots))
        slots.extend(table[p // block_size] * block_size + p % block_size for p in range(start, start + qlen))
    if len(set(slots)) != len(slots):
        raise RequestStateError("two tokens of the batch would be written to the same KV cache slot")
    ends = [s + q for s, q in zip(start_positions, query_lens)]
    num_keys = [end - key_start for end, key_start in zip(ends, key_starts)]

    def blocks_of(seq: int, count: int) -> list[int]:
        # The blocks from the one holding the first visible position to the newest;
        # padding repeats the newest, a real block of this very sequence.
        first, last = key_starts[seq] // block_size, (ends[seq] - 1) // block_size
        table = block_tables[seq]
        return [table[min(first + i, last)] for i in range(count)]

    def blocks_from(seq: int, first: int, count: int) -> list[int]:
        last = (ends[seq] - 1) // block_size
        table = block_tables[seq]
        return [table[min(first + i, last)] for i in range(count)]

    groups: list[AttentionGroup] = []
    chunks = [i for i in range(num_seqs) if query_lens[i] > 1]
    for seq in chunks:
        start, qlen, key_start = start_positions[seq], query_lens[seq], key_starts[seq]
        first, last = key_start // block_size, (ends[seq] - 1) // block_size
        keys = num_keys[seq]
        # Keys exactly the chunk's own positions, none of them out of a window: the
        # square causal mask, which needs no tensor.
        causal = key_start == start and (sliding_window is None or sliding_window >= qlen)
        mask = None
        if not causal:
            q_pos = torch.arange(start, ends[seq], dtype=torch.int64)[:, None]
            k_pos = torch.arange(key_start, ends[seq], dtype=torch.int64)[None, :]
            visible = k_pos <= q_pos
            if sliding_window is not None:
                visible &= k_pos > q_pos - sliding_window
            mask = torch.zeros((1, 1, qlen, keys), dtype=dtype)
            mask.masked_fill_(~visible[None, None], float("-inf"))
            mask = mask.to(device)
        groups.append(
            AttentionGroup(
                token_rows=None,
                first_row=first_rows[seq],
                query_len=qlen,
                key_blocks=torch.tensor(blocks_of(seq, last - first + 1), dtype=torch.int64, device=device),
                key_offset=key_start % block_size,
                num_keys=keys,
                invalid_keys=None,
                mask=mask,
                is_causal=causal,
            )
        )
    for members in _decode_groups([i for i in range(num_seqs) if query_lens[i] == 1], num_keys):
        if len(members) == 1:
            [seq] = members
            first, last = key_starts[seq] // block_size, (ends[seq] - 1) // block_size
            groups.append(
                AttentionGroup(
                    token_rows=None,
                    first_row=first_rows[seq],
                    query_len=1,
                    key_blocks=torch.tensor(blocks_of(seq, last - first + 1), dtype=torch.int64, device=device),
                    key_offset=key_starts[seq] % block_size,
                    num_keys=num_keys[seq],
                    invalid_keys=None,
                    mask=None,
                    is_causal=False,
                )
            )
            continue
        # Padded: every member gathers the same number of blocks, from its first
        # visible one (or the first after the blocks all members share); columns
        # outside [key_start, end) are masked and zeroed.
        shared = _shared_blocks(members, block_tables, ends, block_size) if sliding_window is None else 0
        if shared * block_size < SHARED_PREFIX_MIN_KEYS:
            shared = 0
        firsts = [shared if shared else key_starts[s] // block_size for s in members]
        count = max((ends[s] - 1) // block_size - first + 1 for s, first in zip(members, firsts))
        width = count * block_size
        cols = torch.arange(width, dtype=torch.int64)[None, :]
        base = torch.tensor([first * block_size for first in firsts], dtype=torch.int64)[:, None]
        lo = torch.tensor([key_starts[s] for s in members], dtype=torch.int64)[:, None]
        hi = torch.tensor([ends[s] for s in members], dtype=torch.int64)[:, None]
        valid = (base + cols >= lo) & (base + cols < hi)  # [B, width]
        mask = torch.zeros((len(members), 1, 1, width), dtype=dtype)
        mask.masked_fill_(~valid[:, None, None, :], float("-inf"))
        groups.append(
            AttentionGroup(
                token_rows=torch.tensor([first_rows[s] for s in members], dtype=torch.int64, device=device),
                first_row=0,
                query_len=1,
                key_blocks=torch.tensor(
                    [b for s, first in zip(members, firsts) for b in blocks_from(s, first, count)],
                    dtype=torch.int64,
                    device=device,
                ),
                key_offset=0,
                num_keys=width,
                invalid_keys=torch.nonzero(~valid.reshape(-1)).reshape(-1).to(device),
                mask=mask.to(device),
                is_causal=False,
                shared_blocks=(
                    torch.tensor(block_tables[members[0]][:shared], dtype=torch.int64, device=device)
                    if shared
                    else None
                ),
            )
        )
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        groups=tuple(groups),
        num_tokens=len(slots),
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


def _gather(cache: torch.Tensor, group: AttentionGroup, dtype: torch.dtype) -> torch.Tensor:
    """``[B, Hkv, K, D]``: the group's keys (or values), whole blocks copied, then trimmed."""
    num_kv_heads, head_dim = cache.shape[-2:]
    rows = cache.index_select(0, group.key_blocks).view(group.num_seqs, -1, num_kv_heads, head_dim)
    if group.invalid_keys is not None and group.invalid_keys.numel():
        rows.view(-1, num_kv_heads, head_dim).index_fill_(0, group.invalid_keys, 0.0)
    rows = rows[:, group.key_offset : group.key_offset + group.num_keys]
    return rows.transpose(1, 2).to(dtype)


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: AttentionGroup,
    scale: float,
    logit_softcap: float | None,
) -> torch.Tensor:
    """One group's attention: ``[B, H, Q, D]`` queries over ``[B, Hkv, K, D]`` keys/values."""
    num_heads, num_kv_heads = q.shape[1], k.shape[1]
    if logit_softcap is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=group.mask, is_causal=group.is_causal, scale=scale,
            enable_gqa=num_heads != num_kv_heads,
        )  # fmt: skip
    repeats = num_heads // num_kv_heads
    k = k.repeat_interleave(repeats, dim=1)
    v = v.repeat_interleave(repeats, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / logit_softcap) * logit_softcap
    if group.mask is not None:
        scores = scores + group.mask
    elif group.is_causal:
        size = scores.shape[-1]
        hidden = torch.ones(size, size, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(hidden, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v)


def _attend_shared(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    group: AttentionGroup,
    scale: float,
    logit_softcap: float | None,
) -> torch.Tensor:
    """``[B, H, D]``: a decode group's attention split at the blocks its members share.

    The shared keys are read once and every member's queries attend to them in
    one matrix product (the members stand in for a query sequence); each member's
    own keys are attended as in a padded group. The two halves are joined by
    their softmax statistics (running max and sum), which gives exactly the
    softmax over all keys up to float rounding. Computed in float32.
    """
    assert group.token_rows is not None and group.shared_blocks is not None
    num_kv_heads, head_dim = key_cache.shape[-2:]
    num_seqs, num_heads = group.num_seqs, query.shape[1]
    per_kv = num_heads // num_kv_heads
    q = query.index_select(0, group.token_rows).float().view(num_seqs, num_kv_heads, per_kv, head_dim)

    def softmax_parts(
        scores: torch.Tensor, mask: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Unnormalized weights, their row max and row sum."""
        if logit_softcap is not None:
            scores = torch.tanh(scores / logit_softcap) * logit_softcap
        if mask is not None:
            scores = scores + mask
        peak = scores.amax(dim=-1, keepdim=True)
        weights = torch.exp(scores - peak)
        return weights, peak, weights.sum(dim=-1, keepdim=True)

    # Shared part: [Hkv, B * G, D] queries over [Hkv, S, D] keys.
    shared_k = key_cache.index_select(0, group.shared_blocks).view(-1, num_kv_heads, head_dim).float()
    shared_v = value_cache.index_select(0, group.shared_blocks).view(-1, num_kv_heads, head_dim).float()
    q_rows = q.permute(1, 0, 2, 3).reshape(num_kv_heads, num_seqs * per_kv, head_dim)
    scores = torch.matmul(q_rows, shared_k.permute(1, 2, 0)).mul_(scale)
    weights, peak_1, sum_1 = softmax_parts(scores, None)
    out_1 = torch.matmul(weights, shared_v.transpose(0, 1))  # [Hkv, B * G, D]
    to_members = (num_kv_heads, num_seqs, per_kv)
    out_1 = out_1.view(*to_members, head_dim).permute(1, 0, 2, 3)
    peak_1 = peak_1.view(*to_members, 1).permute(1, 0, 2, 3)
    sum_1 = sum_1.view(*to_members, 1).permute(1, 0, 2, 3)

    # Own part: [B, Hkv, G, D] queries over [B, Hkv, K, D] keys, padding masked.
    own_k = _gather(key_cache, group, torch.float32)
    own_v = _gather(value_cache, group, torch.float32)
    scores = torch.matmul(q, own_k.transpose(-1, -2)).mul_(scale)
    weights, peak_2, sum_2 = softmax_parts(scores, None if group.mask is None else group.mask.float())
    out_2 = torch.matmul(weights, own_v)

    peak = torch.maximum(peak_1, peak_2)
    scale_1, scale_2 = torch.exp(peak_1 - peak), torch.exp(peak_2 - peak)
    out = (out_1 * scale_1 + out_2 * scale_2) / (sum_1 * scale_1 + sum_2 * scale_2)
    return out.reshape(num_seqs, num_heads, head_dim).to(query.dtype)


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

    The new tokens' K/V must already be in the cache (:func:`write_kv`). One
    attention call per group of ``metadata``; memory beyond the output is one
    group's gathered keys and values at a time (see :func:`attention_workspace_bytes`).

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
    out = torch.empty_like(query)
    for group in metadata.groups:
        if group.shared_blocks is not None:
            assert group.token_rows is not None
            out.index_copy_(
                0, group.token_rows, _attend_shared(query, key_cache, value_cache, group, scale, logit_softcap)
            )
            continue
        k = _gather(key_cache, group, query.dtype)
        v = _gather(value_cache, group, query.dtype)
        if group.token_rows is None:
            rows = slice(group.first_row, group.first_row + group.query_len)
            q = query[rows].transpose(0, 1).unsqueeze(0)  # [1, H, Q, D], a view
            out[rows] = _attend(q, k, v, group, scale, logit_softcap)[0].transpose(0, 1)
        else:
            q = query.index_select(0, group.token_rows).unsqueeze(2)  # [B, H, 1, D]
            result = _attend(q, k, v, group, scale, logit_softcap)
            out.index_copy_(0, group.token_rows, result.squeeze(2))
    return out


def attention_workspace_bytes(
    *,
    max_num_tokens: int,
    max_num_seqs: int,
    max_model_len: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype_bytes: int,
    num_metadata_sets: int = 1,
    logit_softcap: bool = False,
) -> int:
    """Most bytes attention holds at once, beyond its inputs, in any step within the limits.

    What :func:`paged_attention` and :func:`build_attention_metadata` allocate,
    bounded over every step of at most ``max_num_tokens`` tokens and
    ``max_num_seqs`` sequences, each ending at most at ``max_model_len``:

    * for the whole step, per metadata set (KV cache group and window): the
      masks, at most ``T x L`` for chunks and ``S x (L + 2 block_size)`` for
      padded decode groups, with the latter's int64 indices of masked columns;
    * during one layer's call: its output ``[T, H, D]``, the attention output,
      copied queries and float32 log-sum-exp of one group (``T`` rows at most), and one
      group's gathered keys and values: one sequence's blocks (``L`` keys and a
      block on each side) or a padded decode group (at most
      :data:`GROUP_KEY_LIMIT` keys plus two blocks per member);
    * with ``logit_softcap`` (the explicit matmul path): the float32 scores,
      their capped, masked and softmaxed copies (``4 x H x T x L``), and keys and
      values repeated to ``H`` heads.

    Workspace inside a fused kernel (a few tiles per thread) is not counted.
    O(1).
    """
    e, t, s, n = dtype_bytes, max_num_tokens, max_num_seqs, max_model_len
    padded_width = n + 2 * block_size
    masks = (t * n * e + s * padded_width * (e + 8)) * num_metadata_sets
    gathered = max((-(-n // block_size) + 1) * block_size, GROUP_KEY_LIMIT + 2 * block_size * min(s, t))
    # The output, one group's result and (decode groups) its copied queries; float32 log-sum-exp.
    per_layer = 3 * t * num_heads * head_dim * e + t * num_heads * 4 + 2 * gathered * num_kv_heads * head_dim * e
    if logit_softcap:
        per_layer += 4 * num_heads * t * n * 4 + 2 * gathered * num_heads * head_dim * e
    return masks + per_layer


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
        dtype: torch.dtype,
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

    def workspace_bytes(self, **limits: int | bool) -> int:
        """The most memory one step within ``limits`` needs (see :func:`attention_workspace_bytes`)."""
        ...


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
        dtype: torch.dtype,
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
            dtype=dtype,
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
        return paged_attention(query, key_cache, value_cache, metadata, scale=scale, logit_softcap=logit_softcap)

    def workspace_bytes(self, **limits: int | bool) -> int:
        return attention_workspace_bytes(**limits)  # type: ignore[arg-type]  # each limit has its parameter's type (logit_softcap the bool)


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
    backend: AttentionBackend = _BACKENDS[resolved]()
    return backend
