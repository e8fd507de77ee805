"""Chunked local attention groups: chunk boundaries, released chunks, hits from the chunk start."""

from __future__ import annotations

import pytest

from kvpool import KVCacheManager, Request
from kvpool.groups import ChunkedLocalAttentionManager
from tests.group_helpers import chunked, decode, full, step
from tests.helpers import admit


@pytest.mark.parametrize(("computed", "skipped"), [(13, 8), (8, 8), (7, 0), (16, 16), (0, 0)])
def test_skipped_tokens_are_the_finished_chunks(computed, skipped):
    mgr = KVCacheManager(8, 4, groups=[chunked(8)])
    (group,) = mgr.groups
    assert isinstance(group, ChunkedLocalAttentionManager)
    assert group.num_skipped_tokens(computed) == skipped


def test_a_finished_chunk_is_released_when_the_next_one_starts():
    mgr = KVCacheManager(16, 4, groups=[chunked(8)])
    a = Request("a", list(range(6)))
    assert admit(mgr, a) == ([1, 2],)
    assert decode(mgr, a, 6) == ([],)
    assert decode(mgr, a, 7) == ([],)  # 7 computed: still inside chunk 0
    assert mgr.get_block_ids("a") == ([1, 2],)
    # 8 computed: chunk 0 is finished; its two blocks (both full, cached) go to
    # the back of the queue, the later one first.
    assert decode(mgr, a, 8) == ([3],)
    assert mgr.get_block_ids("a") == ([0, 0, 3],)
    assert mgr.free_queue_block_ids()[-2:] == [2, 1]
    for token in range(9, 16):
        decode(mgr, a, token)
    assert mgr.get_block_ids("a") == ([0, 0, 3, 4],)
    # 16 computed: chunk 1 goes the same way
    assert decode(mgr, a, 16) == ([5],)
    assert mgr.get_block_ids("a") == ([0, 0, 0, 0, 5],)
    assert mgr.free_queue_block_ids()[-4:] == [2, 1, 4, 3]
    mgr.check_invariants()


def test_without_caching_a_finished_chunk_is_reused_first():
    mgr = KVCacheManager(16, 4, groups=[chunked(8)], enable_caching=False)
    r = Request("r", list(range(20)))
    assert step(mgr, r, 8) == ([1, 2],)
    # 8 computed: blocks 2, 1 go to the front, so the next chunk reuses them in that order
    assert step(mgr, r, 8) == ([2, 1],)
    assert mgr.get_block_ids("r") == ([0, 0, 2, 1],)
    mgr.free(r)
    assert mgr.free_queue_block_ids()[:3] == [1, 2, 3]
    mgr.check_invariants()


def test_hit_starts_at_the_chunk_of_the_hit_point():
    mgr = KVCacheManager(16, 4, groups=[chunked(8)])
    a = Request("a", list(range(17)))
    # (a lookup would already find 16 tokens: a whole finished chunk needs no KV)
    assert step(mgr, a, 17) == ([1, 2, 3, 4, 5],)  # blocks 1..4 full and cached
    # 15 tokens asked at most: the next token (15) is in chunk 8..15, so blocks
    # 0 and 1 are null and the scan starts at block 2 (positions 8..11).
    b = Request("b", list(range(15)) + [99])
    hit, num_hit = mgr.get_computed_blocks(b)
    assert num_hit == 12 and hit.block_ids == ([0, 0, 3],)
    # a miss at the first block of the chunk leaves the chunk start as the hit
    c = Request("c", list(range(8)) + [50, 51, 52, 53, 54, 55, 56, 57])
    hit, num_hit = mgr.get_computed_blocks(c)
    assert num_hit == 8 and hit.block_ids == ([0, 0],)


def test_a_candidate_on_a_chunk_boundary_hits_without_any_cached_block():
    mgr = KVCacheManager(16, 4, groups=[chunked(8)])
    b = Request("b", list(range(16)) + [99])
    hit, num_hit = mgr.get_computed_blocks(b)
    assert num_hit == 16 and hit.block_ids == ([0, 0, 0, 0],)
    # nothing before position 16 is read: one block for token 16 is all it takes
    assert mgr.allocate_slots(b, 1, num_hit, hit) == ([1],)
    assert mgr.get_block_ids("b") == ([0, 0, 0, 0, 1],)
    assert mgr.num_free_blocks == 14
    mgr.check_invariants()


def test_full_attention_alongside_decides_the_common_hit():
    mgr = KVCacheManager(32, 4, groups=[full(), chunked(8, layer=1)])
    b = Request("b", list(range(16)) + [99])
    hit, num_hit = mgr.get_computed_blocks(b)
    assert num_hit == 0 and hit.block_ids == ([], [])
    a = Request("a", list(range(17)))
    admit(mgr, a)
    hit, num_hit = mgr.get_computed_blocks(b)
    assert num_hit == 16
    full_ids, chunk_ids = hit.block_ids
    assert full_ids == mgr.get_block_ids("a")[0][:4] and chunk_ids == [0, 0, 0, 0]


def test_chunk_not_a_multiple_of_the_block_keeps_the_block_holding_the_chunk_start():
    # chunk 6, blocks of 4: position 16 is in chunk 12..17, which starts inside block 3
    mgr = KVCacheManager(32, 4, groups=[chunked(6)])
    (group,) = mgr.groups
    assert group.num_skipped_tokens(16) == 12  # block 3 (positions 12..15) is still read
    a = Request("a", list(range(16)) + [7])
    step(mgr, a, 17)
    a_blocks = mgr.get_block_ids("a")[0]
    b = Request("b", list(range(20)) + [5])
    # 20 tokens at most: position 20 is in chunk 18..23 -> scan starts at block 4,
    # which is not cached; 16 tokens would need block 3, so it is searched again.
    hit, num_hit = mgr.get_computed_blocks(b)
    assert num_hit == 16 and hit.block_ids == ([0, 0, 0, a_blocks[3]],)
    # if block 3 is missing too, the hit falls back to the chunk start at 12
    c = Request("c", list(range(12)) + [60, 61, 62, 63, 64, 65, 66, 67, 68])
    hit, num_hit = mgr.get_computed_blocks(c)
    assert num_hit == 12 and hit.block_ids == ([0, 0, 0],)


def test_max_blocks_for_is_one_chunk():
    mgr = KVCacheManager(8, 4, groups=[chunked(8)])
    assert mgr.coordinator.max_blocks_for(100) == 2
    assert mgr.coordinator.max_blocks_for(3) == 1
    odd = KVCacheManager(8, 4, groups=[chunked(6)])
    assert odd.coordinator.max_blocks_for(100) == 3  # a chunk may start inside a block
