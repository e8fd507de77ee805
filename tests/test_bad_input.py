"""Bad input: a kvpool error that names the value, and nothing changes."""

from __future__ import annotations

import pytest

from kvpool import (
    CapacityError,
    ConfigError,
    InvalidTokenError,
    KVCacheManager,
    KVPoolError,
    Request,
    RequestStateError,
)
from kvpool.hashing import to_token_array
from tests.helpers import admit, snapshot


@pytest.fixture
def busy():
    mgr = KVCacheManager(16, 4)
    a = Request("a", list(range(10)))
    admit(mgr, a)
    b = Request("b", list(range(6)))
    admit(mgr, b)
    mgr.free(b)
    return mgr, a


@pytest.mark.parametrize(
    ("tokens", "message"),
    [
        ([1, 2, -3], r"prompt_token_ids\[2\] = -3"),
        ([1, 2.5], r"prompt_token_ids\[1\] = 2.5 is not an integer"),
        ([1, "7"], r"prompt_token_ids\[1\] = '7' is not an integer"),
        ([2**32], r"4294967296 is out of range"),
        ([], "prompt_token_ids is empty"),
        ("hello", "must be a sequence of integer token IDs"),
    ],
)
def test_bad_token_ids_are_named(tokens, message):
    with pytest.raises(KVPoolError, match=message):
        Request("r", tokens)


@pytest.mark.parametrize(
    "tokens",
    [{1: 2, 3: 4}, {1, 2, 3}, frozenset({5, 6}), {7: 0}.keys()],
    ids=["dict", "set", "frozenset", "dict_keys"],
)
def test_a_mapping_or_a_set_is_no_prompt(tokens, busy):
    name = type(tokens).__name__
    with pytest.raises(InvalidTokenError, match=rf"prompt_token_ids must be a sequence .* in order, got {name} "):
        Request("r", tokens)
    mgr, a = busy
    before = snapshot(mgr)
    with pytest.raises(InvalidTokenError, match=rf"got {name} \(a mapping or a set has no token order\)"):
        a.append_output_token_ids(tokens)
    assert a.num_tokens == 10 and snapshot(mgr) == before


@pytest.mark.parametrize(
    ("tokens", "bad_at"),
    [
        ([5, 6, True], 2),
        ([False, 7], 0),
        ([0, 1] * 20 + [True], 40),  # many 0s and 1s: every item's type is read
        ([2**24, 5, True], 2),  # the bytes of 2**24 then 5 hold an unaligned 1-item before the True
        ([256, 0, False], 2),  # 256 then 0 hold an unaligned 0-item
        ([2**24] * 40 + [1, True], 41),  # many unaligned matches before the one that counts
    ],
)
def test_a_bool_among_the_tokens_is_found_wherever_it_is(tokens, bad_at):
    with pytest.raises(InvalidTokenError, match=rf"prompt_token_ids\[{bad_at}\] = (True|False) is not an integer"):
        Request("r", tokens)


@pytest.mark.parametrize("tokens", [[0, 1] * 50, [2**24, 256, 0, 1, 2**24], [1] + list(range(2, 300)), [0] * 33])
def test_zeros_and_ones_that_are_ints_are_tokens(tokens):
    assert list(Request("r", tokens).prompt_token_ids) == tokens


def test_token_hashes_take_no_set_and_stop_tokens_still_may_be_one():
    from kvpool.hashing import BlockHasher
    from kvpool.scheduler import StopConditions

    with pytest.raises(InvalidTokenError, match="token_ids must be a sequence .* got set"):
        BlockHasher(4).hash_token_ids({1, 2, 3, 4})
    with pytest.raises(InvalidTokenError, match="got dict"):
        to_token_array({1: 2}, "stop_token_ids")
    assert StopConditions(max_tokens=4, stop_token_ids={7, 8}).stop_token_ids == frozenset({7, 8})
    assert sorted(to_token_array({7, 8}, "stop_token_ids")) == [7, 8]  # order does not matter there


def test_bad_output_tokens_change_nothing(busy):
    mgr, a = busy
    before = snapshot(mgr)
    with pytest.raises(InvalidTokenError, match="-1"):
        a.append_output_token_ids(-1)
    with pytest.raises(InvalidTokenError, match=r"output token_ids\[1\] = None"):
        a.append_output_token_ids([5, None])
    assert a.num_tokens == 10
    assert snapshot(mgr) == before
    mgr.check_invariants()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_blocks": 1, "block_size": 4}, "num_blocks must be an integer >= 2.*got 1"),
        ({"num_blocks": 8, "block_size": 0}, "block_size must be a positive integer, got 0"),
        ({"num_blocks": 8, "block_size": 2.0}, "block_size must be a positive integer, got 2.0"),
        ({"num_blocks": 8, "block_size": 4, "hash_algo": "crc32"}, "unknown hash algorithm 'crc32'"),
        ({"num_blocks": 8, "block_size": 4, "max_model_len": 0}, "max_model_len must be an integer >= 2, got 0"),
    ],
)
def test_bad_construction_is_named(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        KVCacheManager(**kwargs)


def test_a_request_larger_than_the_pool_raises_instead_of_waiting_forever(busy):
    mgr, _ = busy
    huge = Request("huge", list(range(100)))  # 25 blocks, the pool has 15
    hit, num_hit = mgr.get_computed_blocks(huge)
    before = snapshot(mgr)
    with pytest.raises(CapacityError, match="needs 25 blocks for 100 tokens.*only 15 usable"):
        mgr.allocate_slots(huge, huge.num_tokens - num_hit, num_hit, hit)
    assert snapshot(mgr) == before
    mgr.check_invariants()


def test_computed_tokens_without_blocks_are_rejected(busy):
    mgr, _ = busy
    liar = Request("liar", list(range(40, 50)))
    liar.num_computed_tokens = 8
    before = snapshot(mgr)
    with pytest.raises(RequestStateError, match="num_computed_tokens=8 but holds no blocks"):
        mgr.allocate_slots(liar, 2)
    assert snapshot(mgr) == before
    mgr.check_invariants()


def test_a_second_request_under_a_busy_id_is_rejected(busy):
    mgr, a = busy
    impostor = Request("a", list(range(30, 40)))
    before = snapshot(mgr)
    with pytest.raises(RequestStateError, match="'a' already holds blocks for a different Request"):
        mgr.allocate_slots(impostor, impostor.num_tokens)
    with pytest.raises(RequestStateError, match="different Request object"):
        mgr.free(impostor)
    assert snapshot(mgr) == before
    mgr.check_invariants()


@pytest.mark.parametrize(
    ("num_new", "message"),
    [(-1, "num_new_tokens=-1"), (1.0, "num_new_tokens=1.0"), (None, "num_new_tokens=None")],
)
def test_bad_token_counts_are_named(busy, num_new, message):
    mgr, a = busy
    before = snapshot(mgr)
    with pytest.raises(RequestStateError, match=message):
        mgr.allocate_slots(a, num_new)
    assert snapshot(mgr) == before
    mgr.check_invariants()


def test_more_new_tokens_than_the_request_has(busy):
    mgr, a = busy
    before = snapshot(mgr)
    with pytest.raises(RequestStateError, match="10 computed \\+ 0 cached \\+ 3 new tokens exceed its 10 tokens"):
        mgr.allocate_slots(a, 3)
    assert snapshot(mgr) == before


def test_hits_must_match_their_request_and_length(busy):
    mgr, _ = busy
    c = Request("c", list(range(6)) + [1, 1, 1])
    hit, num_hit = mgr.get_computed_blocks(c)
    assert num_hit == 4
    d = Request("d", list(range(6)) + [2, 2, 2])
    before = snapshot(mgr)
    with pytest.raises(RequestStateError, match=r"looked up for another Request object \('c'\)"):
        mgr.allocate_slots(d, 5, 4, hit)
    with pytest.raises(RequestStateError, match="num_new_computed_tokens=8 but the hit covers 4"):
        mgr.allocate_slots(c, 1, 8, hit)
    with pytest.raises(RequestStateError, match="without the lookup's blocks"):
        mgr.allocate_slots(c, 5, 4, None)
    assert snapshot(mgr) == before
    mgr.check_invariants()


@pytest.mark.parametrize("bad_id", ["", None, 7])
def test_bad_request_ids(bad_id):
    with pytest.raises(RequestStateError, match="request_id must be a non-empty string"):
        Request(bad_id, [1, 2])
