"""Paged attention and KV cache allocation, checked against dense references."""

from __future__ import annotations

import math

import pytest
import torch

from kvpool.engine.kv_cache import KVCacheSpec, allocate_kv_caches, num_blocks_for_budget
from kvpool.engine.paged_attention import (
    AttentionBackendKind,
    TorchAttentionBackend,
    build_attention_metadata,
    paged_attention,
    select_attention_backend,
    write_kv,
)
from kvpool.errors import ConfigError, RequestStateError

pytestmark = pytest.mark.engine

BLOCK_SIZE = 4
HEAD_DIM = 8


def _cache(num_blocks: int, num_kv_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    spec = KVCacheSpec(num_layers=1, num_kv_heads=num_kv_heads, head_dim=HEAD_DIM, block_size=BLOCK_SIZE)
    caches = allocate_kv_caches(spec, num_blocks)
    return caches.layer(0)


def _slot(table: list[int], position: int) -> int:
    return table[position // BLOCK_SIZE] * BLOCK_SIZE + position % BLOCK_SIZE


def _dense_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    start: int,
    scale: float,
    window: int | None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Textbook attention in float64 for one sequence.

    q: [L, H, D] for positions start..start+L-1; k, v: [start+L, Hkv, D].
    """
    num_heads, num_kv_heads = q.shape[1], k.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for i in range(q.shape[0]):
        qpos = start + i
        for h in range(num_heads):
            kv_head = h // (num_heads // num_kv_heads)
            scores = []
            for kpos in range(k.shape[0]):
                visible = kpos <= qpos and (window is None or kpos > qpos - window)
                if visible:
                    s = float(q[i, h].double() @ k[kpos, kv_head].double()) * scale
                    if softcap is not None:
                        s = math.tanh(s / softcap) * softcap
                    scores.append((kpos, s))
            peak = max(s for _, s in scores)
            weights = [(kpos, math.exp(s - peak)) for kpos, s in scores]
            total = sum(w for _, w in weights)
            for kpos, w in weights:
                out[i, h] += (w / total) * v[kpos, kv_head].double()
    return out


def _setup_batch(starts, qlens, num_heads, num_kv_heads, window, *, seed=0, null_out_of_window=False):
    """Random K/V for every position, prefix already in the cache, tables shuffled.

    Returns (caches, q, new_k, new_v, tables, full_k, full_v).
    """
    gen = torch.Generator().manual_seed(seed)
    total_blocks = sum(-(-(s + n) // BLOCK_SIZE) for s, n in zip(starts, qlens))
    block_ids = (torch.randperm(total_blocks, generator=gen) + 1).tolist()
    key_cache, value_cache = _cache(total_blocks + 1, num_kv_heads)
    tables, full_k, full_v, qs, new_k, new_v = [], [], [], [], [], []
    for start, qlen in zip(starts, qlens):
        end = start + qlen
        table = [block_ids.pop() for _ in range(-(-end // BLOCK_SIZE))]
        k = torch.randn(end, num_kv_heads, HEAD_DIM, generator=gen)
        v = torch.randn(end, num_kv_heads, HEAD_DIM, generator=gen)
        for pos in range(start):  # the cached prefix
            key_cache.view(-1, num_kv_heads, HEAD_DIM)[_slot(table, pos)] = k[pos]
            value_cache.view(-1, num_kv_heads, HEAD_DIM)[_slot(table, pos)] = v[pos]
        if null_out_of_window and window is not None:
            first_visible = max(0, start - window + 1)
            table = [0 if (i + 1) * BLOCK_SIZE <= first_visible else b for i, b in enumerate(table)]
        tables.append(table)
        full_k.append(k)
        full_v.append(v)
        qs.append(torch.randn(qlen, num_heads, HEAD_DIM, generator=gen))
        new_k.append(k[start:])
        new_v.append(v[start:])
    return (
        (key_cache, value_cache),
        torch.cat(qs),
        torch.cat(new_k),
        torch.cat(new_v),
        tables,
        full_k,
        full_v,
    )


CASES = [
    # starts, qlens, heads, kv heads, window
    pytest.param([0], [7], 4, 4, None, id="prefill-mha"),
    pytest.param([0, 0, 0], [1, 5, 9], 4, 2, None, id="prefill-batch-gqa"),
    pytest.param([9, 3, 14], [1, 1, 1], 4, 1, None, id="decode-batch-mqa"),
    pytest.param([8, 0, 5], [3, 6, 1], 6, 2, None, id="chunked-over-prefix-mixed"),
    pytest.param([13, 0, 6], [4, 10, 1], 4, 2, 5, id="sliding-window-5"),
    pytest.param([16, 2], [1, 7], 2, 2, 8, id="sliding-window-8-block-aligned"),
    pytest.param([3], [9], 2, 1, 1, id="window-1-sees-only-itself"),
    pytest.param([300, 3, 290, 0, 5], [1, 1, 1, 1, 1], 4, 2, None, id="decodes-long-and-short"),
    pytest.param([300, 3, 290, 17], [1, 1, 1, 5], 4, 2, 7, id="decodes-and-chunk-sliding-window-7"),
]


@pytest.mark.parametrize(("starts", "qlens", "num_heads", "num_kv_heads", "window"), CASES)
def test_paged_attention_matches_dense_reference(starts, qlens, num_heads, num_kv_heads, window):
    (key_cache, value_cache), q, new_k, new_v, tables, full_k, full_v = _setup_batch(
        starts, qlens, num_heads, num_kv_heads, window, null_out_of_window=True
    )
    meta = build_attention_metadata(
        starts,
        qlens,
        tables,
        block_size=BLOCK_SIZE,
        num_blocks=key_cache.shape[0],
        sliding_window=window,
    )
    write_kv(key_cache, value_cache, new_k, new_v, meta.slot_mapping)
    scale = HEAD_DIM**-0.5
    out = paged_attention(q, key_cache, value_cache, meta, scale=scale)
    assert out.shape == q.shape

    offset = 0
    for start, qlen, k, v in zip(starts, qlens, full_k, full_v):
        expected = _dense_attention(q[offset : offset + qlen], k, v, start, scale, window)
        torch.testing.assert_close(out[offset : offset + qlen].double(), expected, atol=1e-5, rtol=1e-5)
        offset += qlen


def test_softcap_path_matches_dense_reference():
    starts, qlens = [6, 0], [2, 5]
    (key_cache, value_cache), q, new_k, new_v, tables, full_k, full_v = _setup_batch(starts, qlens, 4, 2, None, seed=3)
    q = q * 4  # large scores, so that the cap actually bends them
    meta = build_attention_metadata(starts, qlens, tables, block_size=BLOCK_SIZE, num_blocks=key_cache.shape[0])
    write_kv(key_cache, value_cache, new_k, new_v, meta.slot_mapping)
    out = paged_attention(q, key_cache, value_cache, meta, scale=0.3, logit_softcap=2.0)
    uncapped = paged_attention(q, key_cache, value_cache, meta, scale=0.3)
    offset = 0
    for start, qlen, k, v in zip(starts, qlens, full_k, full_v):
        expected = _dense_attention(q[offset : offset + qlen], k, v, start, 0.3, None, softcap=2.0)
        torch.testing.assert_close(out[offset : offset + qlen].double(), expected, atol=1e-5, rtol=1e-5)
        offset += qlen
    assert not torch.allclose(out, uncapped, atol=1e-3)


def test_write_kv_places_each_token_at_its_slot():
    key_cache, value_cache = _cache(num_blocks=6, num_kv_heads=2)
    table = [3, 1]
    keys = torch.randn(6, 2, HEAD_DIM)
    values = torch.randn(6, 2, HEAD_DIM)
    meta = build_attention_metadata([0], [6], [table], block_size=BLOCK_SIZE, num_blocks=6)
    assert meta.slot_mapping.tolist() == [12, 13, 14, 15, 4, 5]
    write_kv(key_cache, value_cache, keys, values, meta.slot_mapping)
    for pos in range(6):
        block, offset = table[pos // BLOCK_SIZE], pos % BLOCK_SIZE
        assert torch.equal(key_cache[block, offset], keys[pos])
        assert torch.equal(value_cache[block, offset], values[pos])
    untouched = [b for b in range(6) if b not in table]
    assert torch.count_nonzero(key_cache[untouched]) == 0
    assert torch.count_nonzero(key_cache[1, 2:]) == 0  # only offsets 0..1 of block 1 were written


@pytest.mark.parametrize("window", [None, 1, 3, 4, 8])
def test_visibility_matches_transformers(window):
    """Which keys each query attends to, read back from the output itself.

    With zero queries every visible key gets the same weight, and with value
    ``e_p`` (one-hot) at position ``p`` the output of a query is ``1/n`` exactly
    at the ``n`` positions it sees: any extra, missing or doubled key shows.
    """
    from transformers.masking_utils import causal_mask_function, sliding_window_causal_mask_function

    fn = causal_mask_function if window is None else sliding_window_causal_mask_function(window)
    starts, qlens = [0, 5, 11, 2, 9, 0], [6, 3, 1, 9, 1, 1]
    dim = 32  # more than any position, so every position has its own one-hot value
    # Ten blocks apart, so no two sequences share a block.
    tables = [[10 * b + 1 + i for i in range(-(-(s + n) // BLOCK_SIZE))] for b, (s, n) in enumerate(zip(starts, qlens))]
    spec = KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=dim, block_size=BLOCK_SIZE)
    key_cache, value_cache = allocate_kv_caches(spec, 64).layer(0)
    value_cache.fill_(float("nan"))  # stale everywhere until written
    meta = build_attention_metadata(starts, qlens, tables, block_size=BLOCK_SIZE, num_blocks=64, sliding_window=window)
    for table, start in zip(tables, starts):  # the cached prefix
        for pos in range(start):
            value_cache.view(-1, 1, dim)[_slot(table, pos)] = torch.eye(dim)[pos]
    new_v = torch.cat([torch.eye(dim)[s : s + n] for s, n in zip(starts, qlens)])[:, None, :]
    write_kv(key_cache, value_cache, torch.zeros_like(new_v), new_v, meta.slot_mapping)
    out = paged_attention(torch.zeros(sum(qlens), 2, dim), key_cache, value_cache, meta, scale=1.0)
    row = 0
    zero = torch.tensor(0)
    for start, qlen in zip(starts, qlens):
        for qpos in range(start, start + qlen):
            expected = [k for k in range(qpos + 1) if bool(fn(zero, zero, torch.tensor(qpos), torch.tensor(k)))]
            want = torch.zeros(dim)
            want[expected] = 1 / len(expected)
            torch.testing.assert_close(out[row, 0], want)
            torch.testing.assert_close(out[row, 1], want)
            row += 1


def test_decodes_are_grouped_by_length_and_chunks_attend_alone():
    from kvpool.engine.paged_attention import GROUP_PADDING_KEYS

    long = 4 * GROUP_PADDING_KEYS
    starts = [long, 3, long - 8, 5, 0, 40]
    qlens = [1, 1, 1, 1, 7, 9]
    tables = []
    next_block = 1
    for s, n in zip(starts, qlens):
        blocks = -(-(s + n) // BLOCK_SIZE)
        tables.append(list(range(next_block, next_block + blocks)))
        next_block += blocks
    meta = build_attention_metadata(starts, qlens, tables, block_size=BLOCK_SIZE, num_blocks=next_block)
    shapes = sorted((g.num_seqs, g.query_len, g.num_keys, g.mask is None, g.is_causal) for g in meta.groups)
    assert shapes == [
        (1, 7, 7, True, True),  # a fresh chunk: square causal, no mask tensor
        (1, 9, 49, False, False),  # a chunk over a prefix: one additive mask
        (2, 1, 2 * BLOCK_SIZE, False, False),  # the two short decodes, padded together
        (2, 1, -(-(long + 1) // BLOCK_SIZE) * BLOCK_SIZE, False, False),  # the two long ones
    ]
    assert meta.num_tokens == sum(qlens)


def test_null_block_and_freed_blocks_are_never_read():
    starts, qlens, window = [13, 0, 9], [3, 2, 1], 4
    (key_cache, value_cache), q, new_k, new_v, tables, full_k, full_v = _setup_batch(
        starts, qlens, 4, 2, window, seed=7
    )
    # Blocks wholly outside the window become the null block and get poisoned.
    for table, start in zip(tables, starts):
        for index, block_id in enumerate(table):
            if (index + 1) * BLOCK_SIZE <= start - window + 1:
                key_cache[block_id] = float("nan")
                value_cache[block_id] = float("nan")
                table[index] = 0
    assert tables[0][:2] == [0, 0] and tables[2][:1] == [0]
    key_cache[0] = float("nan")
    value_cache[0] = float("nan")
    meta = build_attention_metadata(
        starts, qlens, tables, block_size=BLOCK_SIZE, num_blocks=key_cache.shape[0], sliding_window=window
    )
    write_kv(key_cache, value_cache, new_k, new_v, meta.slot_mapping)
    out = paged_attention(q, key_cache, value_cache, meta, scale=0.5)
    assert torch.isfinite(out).all()
    offset = 0
    for start, qlen, k, v in zip(starts, qlens, full_k, full_v):
        expected = _dense_attention(q[offset : offset + qlen], k, v, start, 0.5, window)
        torch.testing.assert_close(out[offset : offset + qlen].double(), expected, atol=1e-5, rtol=1e-5)
        offset += qlen


def test_backend_object_matches_functions():
    backend = select_attention_backend("cpu")
    assert isinstance(backend, TorchAttentionBackend)
    assert backend.kind is AttentionBackendKind.TORCH
    assert select_attention_backend("cpu", "torch").kind is AttentionBackendKind.TORCH
    starts, qlens = [4], [3]
    (key_cache, value_cache), q, new_k, new_v, tables, full_k, full_v = _setup_batch(starts, qlens, 2, 2, None)
    meta = backend.build_metadata(
        starts,
        qlens,
        tables,
        block_size=BLOCK_SIZE,
        num_blocks=key_cache.shape[0],
        sliding_window=None,
        device=torch.device("cpu"),
        dtype=torch.float32,
        labels=["a"],
    )
    backend.write_kv(key_cache, value_cache, new_k, new_v, meta)
    out = backend.attend(q, key_cache, value_cache, meta, scale=0.25, logit_softcap=None)
    expected = _dense_attention(q, full_k[0], full_v[0], 4, 0.25, None)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


def test_unknown_backend_is_a_config_error():
    with pytest.raises(ConfigError, match="'flash9'"):
        select_attention_backend("cpu", "flash9")


@pytest.mark.parametrize(
    ("starts", "qlens", "tables", "window", "match"),
    [
        pytest.param([4], [1], [[1]], None, "has 1 block.*need 2", id="table-too-short"),
        pytest.param([0], [3], [[9]], None, "block ID 9 is outside", id="block-id-out-of-range"),
        pytest.param([5], [1], [[0, 2]], None, "entry 0 is the null block", id="null-block-full-attention"),
        pytest.param([5], [1], [[0, 2]], 3, "entry 0 is the null block", id="null-block-inside-window"),
        pytest.param([0, 0], [2, 2], [[3], [3]], None, "same KV cache slot", id="two-writers-one-slot"),
        pytest.param([0], [0], [[1]], None, "computes 0 tokens", id="empty-query"),
    ],
)
def test_bad_block_tables_are_rejected(starts, qlens, tables, window, match):
    with pytest.raises(RequestStateError, match=match):
        build_attention_metadata(
            starts,
            qlens,
            tables,
            block_size=BLOCK_SIZE,
            num_blocks=8,
            sliding_window=window,
            labels=["req-x"] * len(starts),
        )


def test_null_block_is_fine_once_out_of_window():
    # Positions 0..3 (block 0 of the table) are invisible to position 8 with window 5.
    meta = build_attention_metadata([8], [1], [[0, 2, 3]], block_size=BLOCK_SIZE, num_blocks=8, sliding_window=5)
    assert all(0 not in group.key_blocks.tolist() for group in meta.groups)


def test_error_names_the_request():
    with pytest.raises(RequestStateError, match="'req-42'"):
        build_attention_metadata([4], [1], [[1]], block_size=BLOCK_SIZE, num_blocks=8, labels=["req-42"])


def test_bad_window_is_a_config_error():
    with pytest.raises(ConfigError, match="sliding_window"):
        build_attention_metadata([0], [1], [[1]], block_size=BLOCK_SIZE, num_blocks=8, sliding_window=0)


# --- KV cache allocation ------------------------------------------------------------------


def test_allocation_shapes_views_and_zero_fill():
    spec = KVCacheSpec(num_layers=3, num_kv_heads=2, head_dim=8, block_size=4)
    caches = allocate_kv_caches(spec, 10)
    assert len(caches.key_caches) == len(caches.value_caches) == 3
    base = caches.key_caches[0].untyped_storage().data_ptr()
    for key_cache, value_cache in zip(caches.key_caches, caches.value_caches):
        assert key_cache.shape == value_cache.shape == (10, 4, 2, 8)
        assert key_cache.dtype == torch.float32
        assert key_cache.is_contiguous() and value_cache.is_contiguous()
        # One allocation: every layer's tensors are views of the same storage.
        assert key_cache.untyped_storage().data_ptr() == base
        assert torch.count_nonzero(key_cache) == 0
    caches.key_caches[1].fill_(1.0)
    assert torch.count_nonzero(caches.key_caches[0]) == 0
    assert torch.count_nonzero(caches.value_caches[1]) == 0
    assert caches.nbytes == 10 * spec.block_bytes == 3 * 2 * 10 * 4 * 2 * 8 * 4


def test_num_blocks_for_budget():
    spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=8, block_size=16, dtype=torch.float16)
    assert spec.block_bytes == 2 * 2 * 16 * 2 * 8 * 2
    assert num_blocks_for_budget(spec, spec.block_bytes * 10) == 10
    assert num_blocks_for_budget(spec, spec.block_bytes * 10 + spec.block_bytes - 1) == 10
    with pytest.raises(ConfigError, match="holds 1 block"):
        num_blocks_for_budget(spec, spec.block_bytes + 1)
    with pytest.raises(ConfigError, match="-5"):
        num_blocks_for_budget(spec, -5)


def test_spec_from_model_config_and_validation():
    from transformers import Qwen2Config

    config = Qwen2Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3)
    spec = KVCacheSpec.from_model_config(config, block_size=8)
    assert (spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.block_size) == (3, 2, 16, 8)
    with pytest.raises(ConfigError, match="block_size"):
        KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=8, block_size=0)
    with pytest.raises(ConfigError, match="dtype"):
        KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=8, dtype=torch.int8)
    with pytest.raises(ConfigError, match="num_blocks"):
        allocate_kv_caches(spec, 1)


@pytest.mark.parametrize("softcap", [None, 30.0])
def test_decodes_sharing_a_prompt_read_it_once_and_match_dense_reference(softcap):
    from kvpool.engine.paged_attention import SHARED_PREFIX_MIN_KEYS

    shared_blocks = -(-SHARED_PREFIX_MIN_KEYS // BLOCK_SIZE) + 1
    prompt = shared_blocks * BLOCK_SIZE + 2  # the shared blocks, then a partial block of each member's own
    starts = [prompt + 3, prompt, prompt + 9, prompt + 1]
    num_heads, num_kv_heads = 6, 2
    gen = torch.Generator().manual_seed(3)
    shared_k = torch.randn(shared_blocks * BLOCK_SIZE, num_kv_heads, HEAD_DIM, generator=gen)
    shared_v = torch.randn(shared_blocks * BLOCK_SIZE, num_kv_heads, HEAD_DIM, generator=gen)
    next_block = shared_blocks + 1
    key_cache, value_cache = _cache(64, num_kv_heads)
    tables, full_k, full_v = [], [], []
    for start in starts:
        end = start + 1
        own = list(range(next_block, next_block + -(-end // BLOCK_SIZE) - shared_blocks))
        next_block += len(own)
        table = list(range(1, shared_blocks + 1)) + own
        k = torch.cat([shared_k, torch.randn(end - len(shared_k), num_kv_heads, HEAD_DIM, generator=gen)])
        v = torch.cat([shared_v, torch.randn(end - len(shared_v), num_kv_heads, HEAD_DIM, generator=gen)])
        for pos in range(end):
            key_cache.view(-1, num_kv_heads, HEAD_DIM)[_slot(table, pos)] = k[pos]
            value_cache.view(-1, num_kv_heads, HEAD_DIM)[_slot(table, pos)] = v[pos]
        tables.append(table)
        full_k.append(k)
        full_v.append(v)
    meta = build_attention_metadata(starts, [1] * len(starts), tables, block_size=BLOCK_SIZE, num_blocks=64)
    [group] = meta.groups
    assert group.shared_blocks is not None and group.shared_blocks.tolist() == list(range(1, shared_blocks + 1))
    # Each member gathers only what follows the shared blocks.
    assert group.num_keys == (max(starts) // BLOCK_SIZE - shared_blocks + 1) * BLOCK_SIZE
    q = torch.randn(len(starts), num_heads, HEAD_DIM, generator=gen)
    out = paged_attention(q, key_cache, value_cache, meta, scale=0.3, logit_softcap=softcap)
    for row, (start, k, v) in enumerate(zip(starts, full_k, full_v)):
        expected = _dense_attention(q[row : row + 1], k, v, start, 0.3, None, softcap)
        torch.testing.assert_close(out[row : row + 1].double(), expected, atol=1e-5, rtol=1e-5)


def test_shared_prompt_split_is_not_used_under_a_sliding_window():
    from kvpool.engine.paged_attention import SHARED_PREFIX_MIN_KEYS

    start = 2 * SHARED_PREFIX_MIN_KEYS
    shared = list(range(1, start // BLOCK_SIZE + 1))
    tables = [shared + [100], shared + [101]]
    full = build_attention_metadata([start, start], [1, 1], tables, block_size=BLOCK_SIZE, num_blocks=102)
    windowed = build_attention_metadata(
        [start, start], [1, 1], tables, block_size=BLOCK_SIZE, num_blocks=102, sliding_window=start
    )
    assert full.groups[0].shared_blocks is not None
    assert all(g.shared_blocks is None for g in windowed.groups)
