"""State-space groups: one state block per request, states cached at block boundaries (docs/hybrid.md)."""

from __future__ import annotations

import pytest

from kvpool import CapacityError, InvariantViolation, KVCacheManager, Request
from kvpool.groups import MambaManager
from kvpool.model_config import load_model_config
from kvpool.model_layers import layer_specs_from_config
from kvpool.specs import LayerKind, group_layers
from tests.group_helpers import cached_ids, decode, full, mamba, step
from tests.helpers import admit, snapshot


def test_one_state_block_at_the_last_position_and_nulls_before_it():
    mgr = KVCacheManager(16, 4, groups=[mamba()])
    (group,) = mgr.groups
    assert isinstance(group, MambaManager)
    a = Request("a", list(range(6)))
    assert admit(mgr, a) == ([1],)
    assert mgr.get_block_ids("a") == ([0, 1],)
    assert decode(mgr, a, 6) == ([],)  # the state is updated in place
    assert decode(mgr, a, 7) == ([],)
    # 8 computed, token 8 needs position 2: a new block; block 1 (the state
    # after exactly 8 tokens) is read by this step and cached
    assert decode(mgr, a, 8) == ([2],)
    assert mgr.get_block_ids("a") == ([0, 1, 2],)
    assert cached_ids(mgr, 0) == [1]
    # next step: the older state goes back to the pool, cached, to the back
    assert decode(mgr, a, 9) == ([],)
    assert mgr.get_block_ids("a") == ([0, 0, 2],)
    assert mgr.free_queue_block_ids()[-1] == 1
    assert mgr.num_free_blocks == 14
    mgr.check_invariants()


def _decoded(mgr: KVCacheManager, num_tokens: int) -> Request:
    """A request whose prompt (6 tokens) decodes one token at a time to ``num_tokens``."""
    a = Request("a", list(range(6)))
    admit(mgr, a)
    for token in range(6, num_tokens):
        decode(mgr, a, token)
    return a


def test_each_boundary_state_is_cached_one_step_late_and_released_the_step_after():
    mgr = KVCacheManager(16, 4, groups=[mamba()])
    a = _decoded(mgr, 17)  # steps started at 8, 12, 16: states after 8, 12 and 16 tokens cached
    assert a.num_computed_tokens == 17
    assert mgr.get_block_ids("a") == ([0, 0, 0, 3, 4],)
    assert cached_ids(mgr, 0) == [1, 2, 3]
    assert mgr.free_queue_block_ids()[-2:] == [1, 2]  # block 3 is still read by the current step
    mgr.check_invariants()


def test_hit_takes_the_latest_cached_state_searching_from_the_end():
    mgr = KVCacheManager(16, 4, groups=[mamba()])
    a = _decoded(mgr, 17)
    tokens = list(a.all_token_ids)
    b = Request("b", tokens[:15] + [99])  # 15 tokens at most: states at 12 and 8 qualify
    hit, num_hit = mgr.get_computed_blocks(b)
    assert num_hit == 12 and hit.block_ids == ([0, 0, 2],)
    c = Request("c", tokens[:17] + [99])
    hit, num_hit = mgr.get_computed_blocks(c)
    assert num_hit == 16 and hit.block_ids == ([0, 0, 0, 3],)
    d = Request("d", [500] + tokens[1:17])
    assert mgr.get_computed_blocks(d)[1] == 0


def test_a_hit_request_resumes_from_the_cached_state():
    mgr = KVCacheManager(16, 4, groups=[mamba()])
    a = _decoded(mgr, 17)
    mgr.free(a)  # state 4 (after 17 tokens, uncached) to the front, state 3 (cached) to the back
    assert mgr.free_queue_block_ids()[:2] == [4, 5] and mgr.free_queue_block_ids()[-1] == 3
    b = Request("b", list(a.all_token_ids)[:13] + [99, 98, 97])
    hit, num_hit = mgr.get_computed_blocks(b)
    assert num_hit == 12 and hit.block_ids == ([0, 0, 2],)
    # one new block for positions 12..15 plus the free hit block it leaves the queue for
    assert b.num_tokens == 16
    assert mgr.num_free_blocks == 15
    assert mgr.allocate_slots(b, 4, num_hit, hit) == ([4],)
    assert mgr.get_block_ids("b") == ([0, 0, 2, 4],)
    assert mgr.num_free_blocks == 13
    b.num_computed_tokens = 16
    # the hit state is shared and never written: the next step lets it go
    assert decode(mgr, b, 7) == ([5],)
    assert mgr.get_block_ids("b") == ([0, 0, 0, 4, 5],)
    assert mgr.pool.block(2).ref_cnt == 0 and mgr.pool.block(2).block_hash is not None
    mgr.check_invariants()


def test_a_state_is_not_visible_before_the_step_that_writes_it_has_run():
    mgr = KVCacheManager(16, 4, groups=[mamba()])
    a = Request("a", list(range(8)))
    admit(mgr, a)  # allocated; the caller marks it computed after the step
    b = Request("b", list(range(8)) + [1])
    assert mgr.get_computed_blocks(b)[1] == 0
    decode(mgr, a, 8)  # the next step starts at 8: the state after 8 is final now
    assert mgr.get_computed_blocks(b)[1] == 8


def test_a_step_past_max_model_len_is_refused_before_any_state_moves():
    mgr = KVCacheManager(16, 4, groups=[mamba()], max_model_len=8)
    a = Request("a", list(range(8)))
    admit(mgr, a)
    # 8 computed, a boundary: a ninth token would pass max_model_len, so the
    # step is refused whole; the state after 8 is neither moved nor cached
    a.append_output_token_ids(8)
    before = snapshot(mgr)
    with pytest.raises(CapacityError, match="max_model_len=8"):
        mgr.allocate_slots(a, 1)
    assert snapshot(mgr) == before
    assert mgr.get_block_ids("a") == ([0, 1],)
    assert cached_ids(mgr, 0) == []
    mgr.check_invariants()


def test_the_final_state_of_a_freed_request_is_not_cached():
    mgr = KVCacheManager(16, 4, groups=[mamba()])
    a = Request("a", list(range(8)))
    admit(mgr, a)  # computed 8, a boundary, but no later step starts there
    mgr.free(a)
    assert cached_ids(mgr, 0) == []
    assert mgr.free_queue_block_ids()[0] == 1  # uncached: reused first


def test_only_step_ends_on_block_boundaries_leave_reusable_states():
    one_step = KVCacheManager(16, 4, groups=[mamba()])
    a = Request("a", list(range(10)))
    admit(one_step, a)
    decode(one_step, a, 10)
    assert cached_ids(one_step, 0) == []  # only the states after 10 and 11 tokens existed
    chunked = KVCacheManager(16, 4, groups=[mamba()])
    c = Request("c", list(range(10)))
    step(chunked, c, 4)
    step(chunked, c, 4)
    step(chunked, c, 2)
    assert len(cached_ids(chunked, 0)) == 2  # states after 4 and 8 tokens
    b = Request("b", list(range(10)) + [1])
    hit, num_hit = chunked.get_computed_blocks(b)
    assert num_hit == 8 and hit.block_ids[0][:1] == [0]


def test_free_releases_the_state_blocks_newest_first():
    mgr = KVCacheManager(16, 4, groups=[mamba()], enable_caching=False)
    a = Request("a", list(range(8)))
    admit(mgr, a)
    assert decode(mgr, a, 8) == ([2],)  # a step across a block boundary holds two blocks
    assert mgr.get_block_ids("a") == ([0, 1, 2],)
    assert mgr.groups[0].live_positions("a") == (1, 2)
    mgr.free(a)
    assert mgr.free_queue_block_ids()[:3] == [2, 1, 3]
    assert mgr.num_free_blocks == 15
    mgr.check_invariants()


def test_refused_step_takes_nothing_and_keeps_the_latest_state():
    mgr = KVCacheManager(3, 4, groups=[mamba()])  # 2 usable blocks
    a = Request("a", list(range(4)))
    admit(mgr, a)
    admit(mgr, Request("x", list(range(50, 54))))
    assert mgr.num_free_blocks == 0
    a.append_output_token_ids(4)
    assert mgr.allocate_slots(a, 1) is None
    assert mgr.get_block_ids("a") == ([1],)
    mgr.check_invariants()


def test_the_checker_rejects_a_third_state_block():
    mgr = KVCacheManager(16, 4, groups=[mamba()])
    a = _decoded(mgr, 17)
    mgr.check_invariants()
    table = mgr.groups[0].tables["a"]
    table[0] = mgr.pool.get_new_blocks(1)[0]  # a consistent reference count, a broken rule
    with pytest.raises(InvariantViolation, match="holds 3 state blocks"):
        mgr.check_invariants()
    assert a.num_computed_tokens == 17


def test_the_checker_rejects_a_table_ending_with_the_null_block():
    mgr = KVCacheManager(16, 4, groups=[mamba()])
    _decoded(mgr, 9)
    mgr.groups[0].tables["a"].append(mgr.pool.null_block)
    with pytest.raises(InvariantViolation, match="ends with the null block"):
        mgr.check_invariants()


def test_full_attention_and_state_agree_on_the_latest_cached_state():
    mgr = KVCacheManager(32, 4, groups=[full(), mamba(layer=1)])
    a = Request("a", list(range(10)))
    step(mgr, a, 8)  # ends on a boundary
    step(mgr, a, 2)  # the step starting at 8 caches the state after 8
    b = Request("b", list(range(10)) + [1])
    hit, num_hit = mgr.get_computed_blocks(b)
    # full attention holds 8 tokens (two full blocks); the state after 8 exists
    assert num_hit == 8
    full_ids, state_ids = hit.block_ids
    assert full_ids == mgr.get_block_ids("a")[0][:2]
    assert state_ids == [0, mgr.get_block_ids("a")[1][1]]
    mgr.check_invariants()


def test_max_blocks_for_is_one_state_and_its_successor():
    mgr = KVCacheManager(8, 4, groups=[mamba()])
    assert mgr.coordinator.max_blocks_for(4) == 1
    assert mgr.coordinator.max_blocks_for(10_000) == 2


def test_a_shipped_hybrid_config_reuses_a_chunked_prompt():
    groups = group_layers(layer_specs_from_config(load_model_config("jamba-mini-1.6")))
    assert {g.kind for g in groups} == {LayerKind.MAMBA, LayerKind.FULL_ATTENTION}
    mgr = KVCacheManager.from_groups(groups, 200)
    bs = mgr.block_size
    assert all(g.block_size == bs for g in mgr.groups)
    prompt = [t % 1000 for t in range(2 * bs + bs // 2)]
    a = Request("a", prompt)
    step(mgr, a, bs)
    step(mgr, a, bs)
    step(mgr, a, bs // 2)
    b = Request("b", prompt + [7])
    hit, num_hit = mgr.get_computed_blocks(b)
    assert num_hit == 2 * bs
    for group, blocks in zip(mgr.groups, hit.blocks):
        assert len(blocks) == 2
        if group.spec.kind is LayerKind.MAMBA:
            assert blocks[0].block_id == 0 and blocks[1].block_id != 0
        else:
            assert all(block.block_id for block in blocks)
    assert mgr.allocate_slots(b, b.num_tokens - num_hit, num_hit, hit) is not None
    mgr.check_invariants()
