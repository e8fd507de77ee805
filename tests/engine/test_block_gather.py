"""Attention gathers whole blocks; what a reused block holds past a sequence's end must not leak in."""

from __future__ import annotations

import pytest
import torch

from kvpool.engine.paged_attention import build_attention_metadata, paged_attention, write_kv

pytestmark = pytest.mark.engine

BLOCK, HKV, HEADS, DIM = 4, 2, 4, 8


def dense(q, k, v, start, scale):
    """Causal attention of ``q`` (positions start..) over ``k``/``v`` (positions 0..), GQA by repetition."""
    k = k.repeat_interleave(HEADS // HKV, dim=1)
    v = v.repeat_interleave(HEADS // HKV, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k.double()) * scale
    qpos = torch.arange(start, start + q.shape[0])[:, None]
    kpos = torch.arange(k.shape[0])[None, :]
    scores = scores.masked_fill(kpos > qpos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.double())


@pytest.mark.parametrize("window", [None, 3])
def test_stale_slots_and_padding_blocks_never_reach_the_output(window):
    gen = torch.Generator().manual_seed(3)
    key_cache = torch.full((12, BLOCK, HKV, DIM), float("nan"))  # every slot stale until written
    value_cache = torch.full_like(key_cache, float("nan"))
    lengths, new = [6, 13], [1, 2]  # sequence A ends inside a block; B spans more blocks than A
    tables = [[7, 2], [4, 9, 1, 11]]
    full_k = [torch.randn(n, HKV, DIM, generator=gen) for n in lengths]
    full_v = [torch.randn(n, HKV, DIM, generator=gen) for n in lengths]
    starts = [n - m for n, m in zip(lengths, new)]
    for table, k, v, start in zip(tables, full_k, full_v, starts):  # the cached positions
        for p in range(start):
            key_cache[table[p // BLOCK], p % BLOCK] = k[p]
            value_cache[table[p // BLOCK], p % BLOCK] = v[p]
    meta = build_attention_metadata(starts, new, tables, block_size=BLOCK, num_blocks=12, sliding_window=window)
    assert any(2 in group.key_blocks.tolist() for group in meta.groups)  # A's newest block, stale past its end
    new_k = torch.cat([k[s:] for k, s in zip(full_k, starts)])
    new_v = torch.cat([v[s:] for v, s in zip(full_v, starts)])
    write_kv(key_cache, value_cache, new_k, new_v, meta.slot_mapping)
    q = torch.randn(sum(new), HEADS, DIM, generator=gen)
    out = paged_attention(q, key_cache, value_cache, meta, scale=0.3)
    assert torch.isfinite(out).all()
    offset = 0
    for k, v, start, m in zip(full_k, full_v, starts, new):
        if window is None:
            expected = dense(q[offset : offset + m], k, v, start, 0.3)
        else:  # one query at a time over its window
            expected = torch.cat([
                dense(q[offset + i : offset + i + 1], k[start + i - window + 1 : start + i + 1],
                      v[start + i - window + 1 : start + i + 1], window - 1, 0.3)
                for i in range(m)
            ])  # fmt: skip
        torch.testing.assert_close(out[offset : offset + m].double(), expected, atol=1e-6, rtol=1e-6)
        offset += m
