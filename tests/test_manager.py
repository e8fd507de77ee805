"""KVCacheManager behaviour beyond the reference scenario."""

from __future__ import annotations

import pytest

from kvpool import AllBlocksCleared, KVCacheManager, Request
from tests.helpers import admit, snapshot


def test_lookup_stops_at_the_first_miss_and_changes_nothing():
    mgr = KVCacheManager(32, 4)
    admit(mgr, Request("a", list(range(16)) + [99]))
    probe = Request("b", list(range(8)) + [50, 51, 52, 53] + list(range(12, 16)) + [7])
    before = snapshot(mgr)
    hit, num_hit = mgr.get_computed_blocks(probe)
    assert num_hit == 8 and hit.block_ids == ([1, 2],)
    after = snapshot(mgr)
    assert before[:-1] == after[:-1]  # only the stats moved


def test_full_hit_of_a_block_aligned_prompt_recomputes_the_last_block():
    mgr = KVCacheManager(32, 4)
    first = Request("a", list(range(16)))
    admit(mgr, first)
    mgr.free(first)
    again = Request("b", list(range(16)))
    _, num_hit = mgr.get_computed_blocks(again)
    assert num_hit == 12
    one_more = Request("c", list(range(17)))
    _, num_hit = mgr.get_computed_blocks(one_more)
    assert num_hit == 16


def test_duplicate_hashes_lookup_returns_the_earliest_block():
    mgr = KVCacheManager(32, 4)
    tokens = list(range(8))
    a, b = Request("a", tokens), Request("b", tokens)
    admit(mgr, a)  # blocks 1, 2 cached
    admit(mgr, b)  # hits block 1, recomputes block 2's content into block 3
    assert mgr.get_block_ids("b") == ([1, 3],)
    assert len(list(mgr.pool.indexes[0].items())) == 3
    c = Request("c", tokens + [1])
    hit, _ = mgr.get_computed_blocks(c)
    assert hit.block_ids == ([1, 2],)
    mgr.free(a)  # block 2 stays cached; both copies are findable
    mgr.check_invariants()


def test_decode_caches_each_block_as_it_fills():
    mgr = KVCacheManager(32, 4)
    req = Request("a", [1, 2, 3, 4, 5, 6])
    admit(mgr, req)
    assert len(list(mgr.pool.indexes[0].items())) == 1
    for token in (7, 8):
        req.append_output_token_ids(token)
        assert mgr.allocate_slots(req, 1) == ([],)
        req.num_computed_tokens += 1
    # The step that computes token 8 fills block 2, which is cached with it.
    assert len(list(mgr.pool.indexes[0].items())) == 2
    req.append_output_token_ids(9)
    assert mgr.allocate_slots(req, 1) == ([3],)
    assert len(list(mgr.pool.indexes[0].items())) == 2
    mgr.check_invariants()


def test_none_when_the_pool_is_short_and_then_nothing_changed():
    mgr = KVCacheManager(6, 4)
    admit(mgr, Request("a", list(range(12))))
    big = Request("b", list(range(100, 112)))
    hit, num_hit = mgr.get_computed_blocks(big)
    before = snapshot(mgr)
    assert mgr.allocate_slots(big, big.num_tokens, num_hit, hit) is None
    assert snapshot(mgr) == before
    mgr.check_invariants()


def test_free_hit_blocks_count_against_the_free_supply():
    mgr = KVCacheManager(6, 4)  # 5 usable blocks
    first = Request("a", list(range(12)))
    admit(mgr, first)
    mgr.free(first)  # 3 cached free blocks + 2 never used
    second = Request("b", list(range(12)) + list(range(50, 58)))
    hit, num_hit = mgr.get_computed_blocks(second)
    assert num_hit == 12
    # 3 hit blocks leave the free queue and 2 new ones are needed: exactly 5.
    assert mgr.allocate_slots(second, 8, num_hit, hit) == ([4, 5],)
    assert mgr.num_free_blocks == 0
    mgr.check_invariants()


def test_lookahead_slots_are_allocated_but_not_cached():
    mgr = KVCacheManager(32, 4)
    req = Request("a", list(range(8)))
    hit, num_hit = mgr.get_computed_blocks(req)
    assert mgr.allocate_slots(req, 8, num_hit, hit, num_lookahead_tokens=5) == ([1, 2, 3, 4],)
    assert len(list(mgr.pool.indexes[0].items())) == 2


def test_max_model_len_caps_the_slots():
    mgr = KVCacheManager(32, 4, max_model_len=9)
    req = Request("a", list(range(8)))
    assert admit(mgr, req) == ([1, 2],)
    req.append_output_token_ids(8)
    assert mgr.allocate_slots(req, 1, num_lookahead_tokens=8) == ([3],)


def test_caching_disabled_never_hits_and_frees_everything_to_the_front():
    mgr = KVCacheManager(16, 4, enable_caching=False)
    a = Request("a", list(range(9)))
    admit(mgr, a)
    assert a.block_hashes == []  # nothing is hashed when nothing is cached
    mgr.free(a)
    assert mgr.free_queue_block_ids()[:3] == [3, 2, 1]
    _, num_hit = mgr.get_computed_blocks(Request("b", list(range(9))))
    assert num_hit == 0
    mgr.check_invariants()


def test_release_order_unhashed_first_as_one_run_then_cached_tail_first():
    mgr = KVCacheManager(16, 4)
    a = Request("a", list(range(10)))  # blocks 1, 2 full; 3 partial
    admit(mgr, a)
    mgr.free(a)
    assert mgr.free_queue_block_ids() == [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 2, 1]


def test_reset_prefix_cache_only_when_idle():
    mgr = KVCacheManager(16, 4, enable_events=True)
    a = Request("a", list(range(8)) + [1])
    admit(mgr, a)
    assert mgr.reset_prefix_cache() is False
    mgr.free(a)
    mgr.take_events()
    assert mgr.reset_prefix_cache() is True
    assert mgr.take_events() == [AllBlocksCleared()]
    _, num_hit = mgr.get_computed_blocks(Request("b", list(range(8)) + [1]))
    assert num_hit == 0
    mgr.check_invariants()


def test_stats_count_preempted_lookups_apart():
    mgr = KVCacheManager(32, 4)
    a = Request("a", list(range(9)))
    admit(mgr, a)
    b = Request("b", list(range(9)))
    mgr.get_computed_blocks(b)
    b.num_preemptions = 1
    mgr.get_computed_blocks(b)
    stats = mgr.prefix_cache_stats
    assert (stats.requests, stats.queries, stats.hits) == (2, 18, 8)
    assert (stats.preempted_requests, stats.preempted_queries, stats.preempted_hits) == (1, 9, 8)
    assert stats.hit_rate == pytest.approx(8 / 18)


def test_a_freed_request_can_be_admitted_again():
    mgr = KVCacheManager(32, 4)
    req = Request("a", list(range(10)))
    admit(mgr, req)
    req.append_output_token_ids([1, 2])
    mgr.free(req)
    mgr.free(req)  # a second free is a no-op
    req.num_computed_tokens = 0
    req.num_preemptions += 1
    hit, num_hit = mgr.get_computed_blocks(req)
    assert num_hit == 8
    assert mgr.allocate_slots(req, req.num_tokens - num_hit, num_hit, hit) is not None
    mgr.check_invariants()


def test_usage_and_free_count():
    mgr = KVCacheManager(11, 4)
    assert mgr.usage == 0.0 and mgr.num_free_blocks == 10
    admit(mgr, Request("a", list(range(10))))
    assert mgr.num_free_blocks == 7
    assert mgr.usage == pytest.approx(0.3)


def test_stale_hit_is_detected_not_served():
    mgr = KVCacheManager(5, 4)  # 4 usable blocks
    a = Request("a", list(range(8)) + [1])
    admit(mgr, a)
    mgr.free(a)
    b = Request("b", list(range(8)) + [2])
    hit, num_hit = mgr.get_computed_blocks(b)
    assert num_hit == 8
    admit(mgr, Request("c", list(range(200, 216))))  # evicts both cached blocks
    with pytest.raises(ValueError, match="went stale"):
        mgr.allocate_slots(b, b.num_tokens - num_hit, num_hit, hit)
    mgr.check_invariants()
