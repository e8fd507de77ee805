"""Cross-attention groups: blocks for the encoder input, allocated once, never cached."""

from __future__ import annotations

import pytest

from kvpool import KVCacheManager, Request, RequestStateError
from kvpool.groups import CrossAttentionManager
from tests.group_helpers import cached_ids, cross, decode, full


def _encdec() -> KVCacheManager:
    return KVCacheManager(32, 4, groups=[full(), cross(layer=1)])


def test_encoder_tokens_size_the_cross_attention_table():
    mgr = _encdec()
    assert isinstance(mgr.groups[1], CrossAttentionManager)
    a = Request("a", list(range(6)))
    hit, num_hit = mgr.get_computed_blocks(a)
    new = mgr.allocate_slots(a, 6, num_hit, hit, num_encoder_tokens=10)
    # decoder: 6 tokens -> 2 blocks; encoder: 10 tokens -> 3 blocks, after them
    assert new == ([1, 2], [3, 4, 5])
    a.num_computed_tokens = 6
    mgr.check_invariants()


def test_decoder_steps_do_not_grow_the_cross_attention_table():
    mgr = _encdec()
    a = Request("a", list(range(6)))
    mgr.allocate_slots(a, 6, num_encoder_tokens=10)
    a.num_computed_tokens = 6
    for token in range(6, 12):
        new = decode(mgr, a, token)
        assert new is not None and new[1] == []
    assert mgr.get_block_ids("a") == ([1, 2, 6], [3, 4, 5])
    # passing the same encoder length again adds nothing to the cross-attention table
    a.append_output_token_ids(1)
    assert mgr.allocate_slots(a, 1, num_encoder_tokens=10) == ([7], [])
    mgr.check_invariants()


def test_cross_attention_blocks_are_never_cached_and_go_back_to_the_front():
    mgr = _encdec()
    a = Request("a", list(range(8)) + [1])
    mgr.allocate_slots(a, 9, num_encoder_tokens=8)
    a.num_computed_tokens = 9
    assert mgr.get_block_ids("a") == ([1, 2, 3], [4, 5])
    assert cached_ids(mgr, 1) == []
    mgr.free(a)
    queue = mgr.free_queue_block_ids()
    # decoder: 3 uncached to the front first, then cross 5, 4 in front of it;
    # the cached decoder blocks 2, 1 at the back
    assert queue[:3] == [5, 4, 3] and queue[-2:] == [2, 1]
    mgr.check_invariants()


def test_a_model_with_cross_attention_gets_no_prefix_hits():
    mgr = _encdec()
    a = Request("a", list(range(16)) + [1])
    mgr.allocate_slots(a, 17, num_encoder_tokens=4)
    b = Request("b", list(range(16)) + [2])
    hit, num_hit = mgr.get_computed_blocks(b)
    assert num_hit == 0 and hit.block_ids == ([], [])


def test_the_encoder_length_counts_against_the_free_blocks():
    mgr = KVCacheManager(9, 4, groups=[full(), cross(layer=1)])  # 8 usable
    x = Request("x", list(range(12)))
    assert mgr.allocate_slots(x, 12) == ([1, 2, 3], [])  # a decoder-only step of an encoder-decoder model
    a = Request("a", list(range(8)))
    before = mgr.free_queue_block_ids()
    assert mgr.allocate_slots(a, 8, num_encoder_tokens=16) is None  # 2 + 4 blocks, 5 free
    assert mgr.free_queue_block_ids() == before and mgr.running_request_ids() == ["x"]
    assert mgr.allocate_slots(a, 8, num_encoder_tokens=12) == ([4, 5], [6, 7, 8])
    with pytest.raises(ValueError, match="needs 9 blocks for 8 tokens and 28 encoder tokens"):
        mgr.allocate_slots(Request("b", list(range(8))), 8, num_encoder_tokens=28)


@pytest.mark.parametrize("value", [-1, 2.0, "4"])
def test_bad_encoder_lengths_are_named(value):
    mgr = _encdec()
    with pytest.raises(RequestStateError, match=f"num_encoder_tokens={value!r}"):
        mgr.allocate_slots(Request("a", [1, 2]), 2, num_encoder_tokens=value)


def test_encoder_tokens_without_a_cross_attention_group_are_refused():
    mgr = KVCacheManager(8, 4)
    with pytest.raises(RequestStateError, match="num_encoder_tokens=3 but the model has no cross-attention group"):
        mgr.allocate_slots(Request("a", [1, 2]), 2, num_encoder_tokens=3)
