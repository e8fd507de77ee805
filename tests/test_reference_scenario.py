"""The reference scenario: block size 4, 12 blocks, exact block IDs and order."""

from __future__ import annotations

from kvpool import BlockRemoved, BlockStored, KVCacheManager, Request
from tests.helpers import admit


def test_reference_scenario_block_for_block(system_prompt):
    mgr = KVCacheManager(num_blocks=12, block_size=4, enable_events=True)

    a = Request("A", system_prompt + [1, 2, 3, 4, 5])
    hit, num_hit = mgr.get_computed_blocks(a)
    assert num_hit == 0
    assert mgr.allocate_slots(a, a.num_tokens - num_hit, num_hit, hit) == ([1, 2, 3, 4, 5],)
    a.num_computed_tokens = a.num_tokens
    mgr.check_invariants()

    b = Request("B", system_prompt + [7, 8, 9, 10])
    hit, num_hit = mgr.get_computed_blocks(b)
    assert num_hit == 12
    assert hit.block_ids == ([1, 2, 3],)
    assert mgr.allocate_slots(b, b.num_tokens - num_hit, num_hit, hit) == ([6],)
    b.num_computed_tokens = b.num_tokens
    assert mgr.get_block_ids("B") == ([1, 2, 3, 6],)
    assert {i: mgr.pool.block(i).ref_cnt for i in range(1, 7)} == {1: 2, 2: 2, 3: 2, 4: 1, 5: 1, 6: 1}
    mgr.check_invariants()

    mgr.free(a)
    mgr.free(b)
    assert mgr.free_queue_block_ids() == [5, 7, 8, 9, 10, 11, 4, 6, 3, 2, 1]
    mgr.check_invariants()

    c = Request("C", system_prompt + [7, 8, 9, 10], cache_salt="T2")
    assert admit(mgr, c) == ([5, 7, 8, 9],)
    assert mgr.prefix_cache_stats.hits == 12  # only B's lookup hit so far

    d = Request("D", system_prompt + [7, 8, 9, 10])
    hit, num_hit = mgr.get_computed_blocks(d)
    assert num_hit == 12  # all 16 tokens are cached, but the last block is recomputed
    assert mgr.allocate_slots(d, d.num_tokens - num_hit, num_hit, hit) == ([10],)
    assert mgr.get_block_ids("D") == ([1, 2, 3, 10],)
    assert mgr.free_queue_block_ids() == [11, 4, 6]
    mgr.check_invariants()

    mgr.take_events()
    e = Request("E", list(range(500, 512)))
    assert admit(mgr, e) == ([11, 4, 6],)
    removed = [ev for ev in mgr.take_events() if isinstance(ev, BlockRemoved)]
    # Blocks 4 (A's question) then 6 (B's question) are evicted, in that order.
    assert [ev.block_hashes[0] for ev in removed] == [a.block_hashes[3], b.block_hashes[3]]
    assert mgr.num_free_blocks == 0
    mgr.check_invariants()


def test_reference_scenario_events(system_prompt):
    mgr = KVCacheManager(num_blocks=12, block_size=4, enable_events=True)
    a = Request("A", system_prompt + [1, 2, 3, 4, 5], lora_name="adapter-x")
    admit(mgr, a)
    (stored,) = mgr.take_events()
    assert isinstance(stored, BlockStored)
    assert stored.block_hashes == tuple(a.block_hashes)
    assert stored.parent_block_hash is None
    assert stored.token_ids == tuple(system_prompt + [1, 2, 3, 4])
    assert stored.block_size == 4
    assert stored.lora_name == "adapter-x"
    assert stored.extra_keys == ((("lora", "adapter-x"),),) * 4
    assert mgr.take_events() == []
