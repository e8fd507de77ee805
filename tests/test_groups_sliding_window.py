"""Sliding-window groups: window freeing, null padding, release order, hits searched from the end."""

from __future__ import annotations

import pytest

from kvpool import InvariantViolation, KVCacheManager, Request
from kvpool.groups import SlidingWindowManager
from tests.group_helpers import cached_ids, decode, full, sliding, step
from tests.helpers import admit


def test_skipped_tokens_follow_the_window():
    mgr = KVCacheManager(8, 2, groups=[sliding(4, bs=2)])
    (group,) = mgr.groups
    assert isinstance(group, SlidingWindowManager)
    # window 4, 7 computed: the next token (7) reads 4..7, so 0..3 are skipped
    assert group.num_skipped_tokens(7) == 4
    assert group.num_skipped_tokens(3) == 0
    assert group.num_skipped_tokens(4) == 1
    assert group.blocks_for_hit == 2  # cdiv(window - 1, block_size)


def test_decode_releases_blocks_leaving_the_window_and_pads_with_nulls():
    mgr = KVCacheManager(16, 4, groups=[sliding(8)])
    a = Request("a", list(range(10)))
    assert admit(mgr, a) == ([1, 2, 3],)
    assert decode(mgr, a, 10) == ([],)  # 10 computed: skipped 3 tokens, no whole block
    assert mgr.get_block_ids("a") == ([1, 2, 3],)
    # 11 computed: tokens 0..3 skipped -> block 1 (cached) goes to the back of the queue
    assert decode(mgr, a, 11) == ([],)
    assert mgr.get_block_ids("a") == ([0, 2, 3],)
    assert mgr.free_queue_block_ids() == [4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 1]
    assert decode(mgr, a, 12) == ([4],)
    assert decode(mgr, a, 13) == ([],)
    assert decode(mgr, a, 14) == ([],)
    # 15 computed: tokens 0..7 skipped -> block 2 follows block 1
    assert decode(mgr, a, 15) == ([],)
    assert mgr.get_block_ids("a") == ([0, 0, 3, 4],)
    assert mgr.free_queue_block_ids()[-2:] == [1, 2]
    mgr.check_invariants()


def test_a_long_step_releases_several_blocks_the_deepest_first():
    mgr = KVCacheManager(16, 4, groups=[sliding(8)], enable_caching=False)
    r = Request("r", list(range(24)))
    assert step(mgr, r, 8) == ([1, 2],)
    assert step(mgr, r, 8) == ([3, 4],)
    # 16 computed: tokens 0..8 skipped -> blocks 1 and 2 leave, uncached, to the
    # front of the queue as one run, the later block first, and the step's two
    # new blocks come from the front: 2, then 1.
    assert step(mgr, r, 8) == ([2, 1],)
    assert mgr.get_block_ids("r") == ([0, 0, 3, 4, 2, 1],)
    assert mgr.free_queue_block_ids()[:2] == [5, 6]
    mgr.check_invariants()


def test_cached_blocks_leaving_the_window_go_to_the_back_in_the_same_order():
    mgr = KVCacheManager(16, 4, groups=[sliding(8)])
    r = Request("r", list(range(24)))
    step(mgr, r, 8)
    step(mgr, r, 8)
    step(mgr, r, 8)
    assert mgr.free_queue_block_ids()[-2:] == [2, 1]
    assert cached_ids(mgr, 0) == [1, 2, 3, 4, 5, 6]  # released blocks stay findable


def test_free_returns_every_real_block_and_skips_the_nulls():
    mgr = KVCacheManager(16, 4, groups=[sliding(8)], enable_caching=False)
    r = Request("r", list(range(24)))
    for _ in range(3):
        step(mgr, r, 8)
    mgr.free(r)
    assert mgr.num_free_blocks == 15
    # the table [0, 0, 3, 4, 2, 1] is released last block first; the nulls are skipped
    assert mgr.free_queue_block_ids()[:5] == [1, 2, 4, 3, 5]
    mgr.check_invariants()


def _window_scenario() -> tuple[KVCacheManager, Request]:
    """A decodes from 12 to 24 tokens (window 8), releasing blocks 1..4 as it goes, then finishes."""
    mgr = KVCacheManager(12, 4, groups=[sliding(8)])
    a = Request("a", list(range(12)))
    assert admit(mgr, a) == ([1, 2, 3],)
    for token in range(12, 24):
        decode(mgr, a, token)
    assert mgr.get_block_ids("a") == ([0, 0, 0, 0, 5, 6],)
    assert mgr.free_queue_block_ids() == [7, 8, 9, 10, 11, 1, 2, 3, 4]
    mgr.free(a)
    assert mgr.free_queue_block_ids() == [7, 8, 9, 10, 11, 1, 2, 3, 4, 6, 5]
    return mgr, a


def test_hit_searches_from_the_end_and_nulls_the_skipped_positions():
    mgr, a = _window_scenario()
    other = Request("c", list(range(1000, 1028)))  # 7 blocks: evicts cached blocks 1 and 2
    assert admit(mgr, other) == ([7, 8, 9, 10, 11, 1, 2],)
    b = Request("b", list(a.all_token_ids) + [999])
    hit, num_hit = mgr.get_computed_blocks(b)
    # The first block of the prefix is gone, so full attention would find nothing;
    # the window before position 24 needs only blocks 4 and 5 (indices), found from the end.
    assert num_hit == 24
    assert hit.block_ids == ([0, 0, 0, 0, 5, 6],)
    assert mgr.num_free_blocks == 4
    # 1 new block (for token 24) + the 2 free hit blocks; the 4 skipped positions cost nothing
    assert mgr.allocate_slots(b, 1, num_hit, hit) == ([3],)
    assert mgr.num_free_blocks == 1
    assert mgr.get_block_ids("b") == ([0, 0, 0, 0, 5, 6, 3],)
    mgr.check_invariants()


def test_a_broken_run_near_the_end_moves_the_hit_back():
    mgr = KVCacheManager(24, 4, groups=[sliding(8)])
    a = Request("a", list(range(24)) + [1])
    admit(mgr, a)
    mgr.free(a)
    b = Request("b", list(range(24)) + [2])
    # Evict the block of positions 16..19 only: take every free block before it.
    queue = mgr.free_queue_block_ids()
    assert queue.index(5) == len(queue) - 5  # cached blocks sit at the back: 6, 5, 4, 3, 2, 1
    filler = Request("f", list(range(500, 500 + 4 * (queue.index(5) + 1))))
    assert admit(mgr, filler)[0][-2:] == [6, 5]  # the blocks of positions 20..23 and 16..19
    hit, num_hit = mgr.get_computed_blocks(b)
    # blocks at indices 5 and 4 are gone; the latest run of two ends at index 3
    assert num_hit == 16 and hit.block_ids == ([0, 0, 3, 4],)


def test_a_run_reaching_the_prompt_start_is_a_hit_even_if_shorter_than_the_window():
    mgr = KVCacheManager(16, 4, groups=[sliding(20)])  # a hit needs cdiv(19, 4) = 5 blocks
    admit(mgr, Request("a", list(range(9))))  # caches blocks for positions 0..7
    b = Request("b", list(range(8)) + list(range(50, 60)))
    hit, num_hit = mgr.get_computed_blocks(b)
    assert num_hit == 8 and hit.block_ids == ([1, 2],)
    c = Request("c", list(range(50, 68)))
    assert mgr.get_computed_blocks(c)[1] == 0


def test_num_blocks_to_allocate_counts_new_and_evictable_hit_blocks_not_skipped_ones():
    mgr, a = _window_scenario()
    (group,) = mgr.groups
    b = Request("b", list(a.all_token_ids) + [999])
    hit, num_hit = mgr.get_computed_blocks(b)
    assert hit.block_ids == ([0, 0, 0, 0, 5, 6],)
    # 25 tokens -> 7 positions; 4 skipped, 2 hit (both free), 1 new
    assert group.num_blocks_to_allocate("b", 25, hit.blocks[0], num_hit) == 3
    # a hit block that another request holds costs nothing extra
    mgr.pool.touch([mgr.pool.block(6)])
    assert group.num_blocks_to_allocate("b", 25, hit.blocks[0], num_hit) == 2


def test_refused_step_still_releases_the_blocks_that_left_the_window():
    mgr = KVCacheManager(5, 4, groups=[sliding(8)])  # 4 usable blocks
    a = Request("a", list(range(8)))
    assert admit(mgr, a) == ([1, 2],)
    a.append_output_token_ids([8, 9, 10, 11])
    assert step(mgr, a, 4) == ([3],)
    assert admit(mgr, Request("x", list(range(100, 104)))) == ([4],)
    assert mgr.num_free_blocks == 0
    # 12 computed: tokens 0..4 are skipped, so block 1 leaves; 5 new tokens need
    # positions 12..16, two new blocks, and only the released one is free.
    a.append_output_token_ids([12, 13, 14, 15, 16])
    assert mgr.allocate_slots(a, 5) is None
    assert mgr.get_block_ids("a") == ([0, 2, 3],)
    assert mgr.free_queue_block_ids() == [1]
    mgr.check_invariants()
    # the same request, one token at a time, fits
    assert mgr.allocate_slots(a, 1) == ([1],)
    mgr.check_invariants()


def test_one_token_window_caches_nothing():
    mgr = KVCacheManager(16, 4, groups=[sliding(1)])
    admit(mgr, Request("a", list(range(13))))
    assert cached_ids(mgr, 0) == []


def test_only_blocks_a_hit_can_use_are_cached_under_a_coarser_alignment():
    # full attention at 8 tokens/block makes hits multiples of 8; the window
    # group (2 tokens/block, window 3 -> 1 block per hit) caches only the last
    # block of every 4-block segment.
    mgr = KVCacheManager.from_groups([full(bs=8), sliding(3, bs=2, layer=1)], 40)
    a = Request("a", list(range(17)))
    admit(mgr, a)
    sw_table = mgr.get_block_ids("a")[1]
    assert cached_ids(mgr, 1) == sorted([sw_table[3], sw_table[7]])


@pytest.mark.parametrize(("window", "num_tokens", "expected"), [(8, 100, 3), (8, 5, 2), (9, 100, 3), (10, 100, 4)])
def test_max_blocks_for_is_the_window_bound(window, num_tokens, expected):
    mgr = KVCacheManager(8, 4, groups=[sliding(window)])
    assert mgr.coordinator.max_blocks_for(num_tokens) == expected


def test_a_prompt_longer_than_the_pool_still_raises_when_one_step_cannot_fit():
    mgr = KVCacheManager(5, 4, groups=[sliding(8)])
    huge = Request("h", list(range(40)))
    with pytest.raises(ValueError, match="needs 10 blocks for 40 tokens"):
        admit(mgr, huge)
    # in chunks it fits: the window needs at most 3 blocks
    r = Request("r", list(range(40)))
    assert step(mgr, r, 4) is not None
    for _ in range(9):
        assert step(mgr, r, 4) is not None
    mgr.check_invariants()


def test_the_checker_rejects_nulls_the_window_does_not_allow():
    mgr = KVCacheManager(16, 4, groups=[sliding(8)])
    a = Request("a", list(range(10)))
    admit(mgr, a)  # 10 computed: 3 tokens skipped, no whole block
    table = mgr.groups[0].tables["a"]
    mgr.pool.free_blocks([table[0]])
    table[0] = mgr.pool.null_block  # the pool agrees, the window rule does not
    with pytest.raises(InvariantViolation, match="1 leading null blocks; its rule skips only 0"):
        mgr.check_invariants()


def test_the_checker_rejects_a_null_after_a_real_block():
    mgr = KVCacheManager(16, 4, groups=[sliding(8)])
    a = Request("a", list(range(10)))
    admit(mgr, a)
    for token in range(10, 20):
        decode(mgr, a, token)
    mgr.check_invariants()
    table = mgr.groups[0].tables["a"]
    assert mgr.get_block_ids("a") == ([0, 0, 0, 4, 5],)
    mgr.pool.free_blocks([table[4]])
    table[4] = mgr.pool.null_block
    with pytest.raises(InvariantViolation, match="null block at position 4, after a real one"):
        mgr.check_invariants()
