"""The worker's copies between the pool and the CPU tier: whole blocks, in runs or scattered, every layer."""

from __future__ import annotations

import torch

from kvpool.connector import BlockLoad, BlockSave, ConnectorMetadata
from kvpool.engine.kv_cache import KVCacheSpec, allocate_kv_caches
from kvpool.engine.kv_transfer import KVTransferWorker, _block_major, _runs


def test_runs_step_both_indices_by_one():
    assert _runs([3, 4, 5, 9, 1], [7, 8, 2, 3, 4]) == [(3, 7, 2), (5, 2, 1), (9, 3, 1), (1, 4, 1)]
    assert _runs([], []) == []


def test_block_major_view_is_the_pool_seen_block_by_block():
    spec = KVCacheSpec(num_layers=3, num_kv_heads=2, head_dim=4, block_size=2, dtype=torch.float32)
    caches = allocate_kv_caches(spec, 5)
    view = _block_major(caches)
    assert view is not None and view.shape == (5, 3, 2, 2, 2, 4)
    caches.value_caches[2][4].fill_(7.0)
    assert bool((view[4, 2, 1] == 7.0).all()) and float(view.sum()) == 7.0 * 16
    shared = allocate_kv_caches(spec, 5, layer_slots=[0, 0, 1])
    assert _block_major(shared) is None  # layers sharing a pair: no such view


def test_scattered_saves_and_loads_move_every_layer_of_the_right_blocks():
    spec = KVCacheSpec(num_layers=3, num_kv_heads=2, head_dim=4, block_size=2, dtype=torch.float32)
    caches = allocate_kv_caches(spec, 12)
    for cache in (*caches.key_caches, *caches.value_caches):
        cache.normal_()
    worker = KVTransferWorker(caches, 6, [])
    pool_ids, slots = [1, 2, 5, 3, 4], [6, 1, 2, 3, 5]  # runs and breaks on both sides
    before = [(k[pool_ids].clone(), v[pool_ids].clone()) for k, v in zip(caches.key_caches, caches.value_caches)]
    worker.save(ConnectorMetadata(saves=tuple(BlockSave("r", b, b"k", ("cpu",), s) for b, s in zip(pool_ids, slots))))
    targets = [7, 8, 11, 9, 10]
    loads = tuple(BlockLoad("r", i, t, b"k", "cpu", s) for i, (t, s) in enumerate(zip(targets, slots)))
    worker.start_load(ConnectorMetadata(loads=loads))
    for (k, v), (k_before, v_before) in zip(zip(caches.key_caches, caches.value_caches), before):
        assert torch.equal(k[targets], k_before) and torch.equal(v[targets], v_before)
