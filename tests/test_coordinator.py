"""The common prefix hit across layer groups, and groups of different block sizes."""

from __future__ import annotations

import pytest

from kvpool import ConfigError, KVCacheManager, Request
from kvpool.model_config import load_model_config
from kvpool.model_layers import layer_specs_from_config
from kvpool.specs import LayerKind, group_layers
from tests.group_helpers import cached_ids, chunked, cross, full, mamba, sliding, step
from tests.helpers import admit, snapshot


def _hit_lengths(mgr: KVCacheManager, hit) -> list[int]:
    return [len(blocks) * group.block_size for group, blocks in zip(mgr.groups, hit.blocks)]


def test_evicted_window_blocks_lower_the_common_hit():
    # group 0: window 8 (a hit needs 2 blocks); group 1: full attention
    mgr = KVCacheManager(32, 4, groups=[sliding(8), full(layer=1)])
    a = Request("a", list(range(40)) + [1])
    assert admit(mgr, a) == (list(range(1, 12)), list(range(12, 23)))
    mgr.free(a)
    # Released per group, the last block first: uncached ones (11, 22) to the
    # front, the cached ones to the back: the window group's 10..1, then 21..12.
    queue = mgr.free_queue_block_ids()
    assert queue[:2] == [22, 11] and queue[-20:] == list(range(10, 0, -1)) + list(range(21, 11, -1))
    # 12 new blocks: the 11 uncached or never used ones, then block 10, the
    # window group's block of positions 36..39.
    c = Request("c", list(range(500, 524)))
    assert admit(mgr, c) == ([22, 11, 23, 24, 25, 26], [27, 28, 29, 30, 31, 10])
    b = Request("b", list(range(40)) + [2])
    hit, num_hit = mgr.get_computed_blocks(b)
    # full attention alone would serve 40 tokens (10 blocks); the window group's
    # latest two cached blocks in a row end at block 8: 36 tokens for both.
    assert num_hit == 36
    assert hit.block_ids == ([0] * 7 + [8, 9], list(range(12, 21)))
    assert _hit_lengths(mgr, hit) == [36, 36]
    assert mgr.allocate_slots(b, b.num_tokens - num_hit, num_hit, hit) is not None
    mgr.check_invariants()


def test_a_hit_is_consistent_across_groups():
    mgr = KVCacheManager(64, 4, groups=[full(), sliding(6, layer=1), chunked(8, layer=2), mamba(layer=3)])
    a = Request("a", list(range(20)))
    for _ in range(5):
        step(mgr, a, 4)  # chunks on block boundaries: states after 4, 8, 12, 16 are cached
    a.append_output_token_ids(1)
    step(mgr, a, 1)  # the step starting at 20 caches the state after 20
    b = Request("b", list(range(20)) + [3, 4])
    hit, num_hit = mgr.get_computed_blocks(b)
    assert num_hit == 20
    assert _hit_lengths(mgr, hit) == [20] * 4
    full_ids, window_ids, chunk_ids, state_ids = hit.block_ids
    assert full_ids == mgr.get_block_ids("a")[0][:5]
    assert window_ids[:3] == [0, 0, 0] and all(window_ids[3:])  # window 6 -> 2 blocks
    assert chunk_ids[:4] == [0, 0, 0, 0] and chunk_ids[4] != 0  # chunk 16..23
    assert state_ids[:4] == [0, 0, 0, 0] and state_ids[4] != 0


def test_the_latest_state_bounds_the_common_hit():
    mgr = KVCacheManager(64, 4, groups=[full(), mamba(layer=1)])
    a = Request("a", list(range(19)))
    step(mgr, a, 8)
    step(mgr, a, 11)  # the state after 8 is cached; 19 is not a boundary
    b = Request("b", list(range(19)) + [5])
    hit, num_hit = mgr.get_computed_blocks(b)
    assert num_hit == 8 and _hit_lengths(mgr, hit) == [8, 8]
    assert len(cached_ids(mgr, 0)) == 4  # full attention had 16 tokens; trimmed to 8


def test_the_fixed_point_takes_several_rounds():
    mgr = KVCacheManager(64, 4, groups=[full(), mamba(layer=1), sliding(5, layer=2)])
    a = Request("a", list(range(24)))
    step(mgr, a, 8)
    step(mgr, a, 16)  # caches the state after 8
    a.append_output_token_ids(24)
    step(mgr, a, 1)  # caches the state after 24; there is none at 16, 20
    state_at_8, state_at_24 = (mgr.pool.block(i) for i in sorted(cached_ids(mgr, 1)))
    # drop the window group's block of positions 20..23 from the cache
    block = mgr.pool.block(mgr.get_block_ids("a")[2][5])
    mgr.pool.indexes[2].remove(block)
    block.block_hash = None
    mgr.check_invariants()
    b = Request("b", list(range(24)) + [9])
    hit, num_hit = mgr.get_computed_blocks(b)
    # round 1: full 24, state 24, window 20 (the block before 24 is gone)
    # round 2: full 20, state 8 (none at 20, 16, 12), window 8
    # round 3: everyone accepts 8
    assert num_hit == 8 and _hit_lengths(mgr, hit) == [8, 8, 8]
    assert hit.blocks[1] == [mgr.pool.null_block, state_at_8]
    assert state_at_24.block_hash is not None


def test_groups_with_larger_blocks_use_every_mth_hash():
    mgr = KVCacheManager.from_groups([full(bs=8), sliding(8, bs=4, layer=1)], 40)
    assert mgr.block_size == 4 and mgr.coordinator.alignment == 8
    a = Request("a", list(range(17)))
    assert admit(mgr, a) == ([1, 2, 3], [4, 5, 6, 7, 8])
    # cached up to 16 tokens (the last multiple of 8): full blocks 0, 1 under hashes 1 and 3
    full_table = mgr.get_block_ids("a")[0]
    assert mgr.pool.block(full_table[0]).block_hash == a.block_hashes[1]
    assert mgr.pool.block(full_table[1]).block_hash == a.block_hashes[3]
    assert mgr.pool.block(full_table[2]).block_hash is None
    b = Request("b", list(range(16)) + [70, 71])
    hit, num_hit = mgr.get_computed_blocks(b)
    assert num_hit == 16 and hit.block_ids == ([1, 2], [0, 0, 6, 7])
    # a prefix of 12 tokens is not a multiple of 8: the hit is 8 tokens
    c = Request("c", list(range(12)) + [70, 71, 72])
    hit, num_hit = mgr.get_computed_blocks(c)
    assert num_hit == 8 and hit.block_ids == ([1], [4, 5])
    mgr.check_invariants()


def test_blocks_past_the_last_aligned_length_wait_to_be_cached():
    mgr = KVCacheManager.from_groups([full(bs=4), full(bs=12, layer=1)], 40)
    a = Request("a", list(range(20)))
    admit(mgr, a)
    assert len(cached_ids(mgr, 0)) == 3  # 12 tokens: the 4-token blocks of 12..19 wait for 24
    a.append_output_token_ids(list(range(4)))
    step(mgr, a, 4)
    assert len(cached_ids(mgr, 0)) == 6 and len(cached_ids(mgr, 1)) == 2


def test_block_sizes_must_be_multiples_of_the_hash_block_size():
    with pytest.raises(ConfigError, match="block_size 6, which is not a multiple of the manager's block_size 4"):
        KVCacheManager(16, 4, groups=[full(bs=4), sliding(8, bs=6, layer=1)])
    assert KVCacheManager.from_groups([full(bs=4), sliding(8, bs=6, layer=1)], 16).block_size == 2
    with pytest.raises(ConfigError, match="KVCacheGroup"):
        KVCacheManager(16, 4, groups=["full"])
    with pytest.raises(ConfigError, match="at least one"):
        KVCacheManager.from_groups([], 16)
    with pytest.raises(ConfigError, match="block_size=4"):
        KVCacheManager.from_groups([full()], 16, block_size=4)


def test_a_group_that_never_caches_makes_the_hit_empty():
    mgr = KVCacheManager(32, 4, groups=[full(), cross(layer=1)])
    a = Request("a", list(range(9)))
    mgr.allocate_slots(a, 9, num_encoder_tokens=4)
    b = Request("b", list(range(9)))
    before = snapshot(mgr)
    hit, num_hit = mgr.get_computed_blocks(b)
    assert num_hit == 0 and hit.block_ids == ([], [])
    assert snapshot(mgr)[:-1] == before[:-1]


def test_a_stale_hit_in_any_group_is_detected():
    mgr = KVCacheManager(7, 4, groups=[sliding(8), full(layer=1)])  # 6 usable blocks
    a = Request("a", list(range(8)) + [1])
    admit(mgr, a)
    mgr.free(a)
    b = Request("b", list(range(8)) + [2])
    hit, num_hit = mgr.get_computed_blocks(b)
    assert num_hit == 8
    admit(mgr, Request("c", list(range(100, 112))))  # evicts the window group's cached blocks
    with pytest.raises(ValueError, match="went stale"):
        mgr.allocate_slots(b, b.num_tokens - num_hit, num_hit, hit)
    mgr.check_invariants()


@pytest.mark.parametrize(("name", "prompt_len"), [("gemma-3-12b", 1100), ("gpt-oss-20b", 300)])
def test_a_shipped_config_shares_prefixes_in_every_group(name, prompt_len):
    groups = group_layers(layer_specs_from_config(load_model_config(name)))
    kinds = {g.kind for g in groups}
    assert kinds == {LayerKind.SLIDING_WINDOW, LayerKind.FULL_ATTENTION}
    mgr = KVCacheManager.from_groups(groups, 600)
    bs = mgr.block_size
    prompt = [t % 5000 for t in range(prompt_len)]
    a = Request("a", prompt)
    assert admit(mgr, a) is not None
    b = Request("b", prompt + [1, 2, 3])
    hit, num_hit = mgr.get_computed_blocks(b)
    assert num_hit == prompt_len // bs * bs
    assert all(len(blocks) * g.block_size == num_hit for g, blocks in zip(mgr.groups, hit.blocks))
    assert admit(mgr, b) is not None
    # a long decode: the window groups release what leaves their window, full attention keeps all
    for token in range(100):
        a.append_output_token_ids(token)
        assert step(mgr, a, 1) is not None
    for group, table in zip(mgr.groups, mgr.get_block_ids("a")):
        real = sum(1 for block_id in table if block_id)
        if group.spec.kind is LayerKind.SLIDING_WINDOW:
            assert a.num_tokens > group.spec.sliding_window + bs
            assert real <= group.max_blocks_for(a.num_tokens) and table[0] == 0
        else:
            assert real == len(table)
    mgr.check_invariants()


def test_the_verified_index_serves_groups_with_larger_blocks():
    pytest.importorskip("xxhash")
    mgr = KVCacheManager.from_groups([full(bs=8), full(bs=4, layer=1)], 40, hash_algo="xxh3_128")
    a = Request("a", list(range(17)))
    assert admit(mgr, a) == ([1, 2, 3], [4, 5, 6, 7, 8])
    hit, num_hit = mgr.get_computed_blocks(Request("b", list(range(16)) + [5]))
    assert num_hit == 16 and hit.block_ids == ([1, 2], [4, 5, 6, 7])
    hit, num_hit = mgr.get_computed_blocks(Request("c", list(range(8)) + [0] * 9))
    assert num_hit == 8 and hit.block_ids == ([1], [4, 5])
    mgr.check_invariants()


def test_the_verified_index_refuses_groups_that_search_from_the_end():
    pytest.importorskip("xxhash")
    with pytest.raises(ConfigError, match="use 'sha256'"):
        KVCacheManager.from_groups([full(), sliding(8, layer=1)], 40, hash_algo="xxh3_128")
