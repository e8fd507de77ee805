"""The core refuses what it did not issue: stale or foreign lookups, false progress, changed keys.

One test per hostile sequence; each checks that the call raises a
``KVPoolError`` naming the problem and that nothing changed (the snapshot and
the invariants), and that honest traffic still works afterwards.
"""

from __future__ import annotations

import pytest

from kvpool import (
    CapacityError,
    ConfigError,
    InvalidTokenError,
    KVCacheManager,
    KVPoolError,
    MultiModalInput,
    ReadOnlyFieldError,
    Request,
    RequestStateError,
)
from kvpool.hashing import BlockHasher
from tests.helpers import admit, snapshot

PROMPT = list(range(100, 108)) + [1]  # two full blocks of 4, then one token


def refused(mgr: KVCacheManager, call, match: str, error=KVPoolError) -> None:
    before = snapshot(mgr)
    with pytest.raises(error, match=match):
        call()
    assert snapshot(mgr) == before
    mgr.check_invariants()


def cached_then_free(mgr: KVCacheManager, rid: str = "a", **keys) -> Request:
    a = Request(rid, PROMPT, **keys)
    admit(mgr, a)
    mgr.free(a)
    return a


# -- class 1: a lookup result is a capability ----------------------------------------


@pytest.mark.parametrize("hash_algo", ["sha256", "xxh3_128"])
def test_a_hit_is_stale_after_a_reset_even_if_the_block_is_cached_again(hash_algo):
    pytest.importorskip("xxhash") if hash_algo == "xxh3_128" else None
    mgr = KVCacheManager(16, 4, hash_algo=hash_algo)
    cached_then_free(mgr)
    r = Request("r", PROMPT[:8] + [9])
    hit, n = mgr.get_computed_blocks(r)
    assert n == 8
    assert mgr.reset_prefix_cache()
    other = Request("x", [5, 5, 5, 5, 6, 6, 6, 6, 7])  # takes blocks and writes other tokens
    admit(mgr, other)
    refused(mgr, lambda: mgr.allocate_slots(r, r.num_tokens - n, n, hit), "went stale")
    # looked up again, it is honest: a miss
    assert mgr.get_computed_blocks(r)[1] == 0


def test_a_hit_is_stale_after_its_block_is_evicted_and_reused():
    mgr = KVCacheManager(6, 4)  # 5 usable blocks
    cached_then_free(mgr)
    r = Request("r", PROMPT[:8] + [9])
    hit, n = mgr.get_computed_blocks(r)
    flood = Request("f", list(range(500, 520)))  # 5 blocks: every cached block is evicted
    admit(mgr, flood)
    refused(mgr, lambda: mgr.allocate_slots(r, r.num_tokens - n, n, hit), "went stale")


def test_a_hit_survives_unrelated_evictions_with_a_cryptographic_hash():
    mgr = KVCacheManager(12, 4)  # 11 usable blocks
    cached_then_free(mgr, "u", cache_salt="t")  # blocks 1, 2 cached; older than a's
    cached_then_free(mgr)  # blocks 3, 4 cached
    r = Request("r", PROMPT[:8] + [9])
    hit, n = mgr.get_computed_blocks(r)
    assert hit.block_ids == ([3, 4],)
    admit(mgr, Request("f", list(range(500, 532))))  # 8 blocks: the last one evicts u's block 2
    assert mgr.pool.num_evictions == 1
    assert mgr.allocate_slots(r, r.num_tokens - n, n, hit) == ([1],)
    assert mgr.get_block_ids("r") == ([3, 4, 1],)
    mgr.check_invariants()


def test_a_hit_from_another_manager_is_refused():
    m1, m2 = KVCacheManager(16, 4), KVCacheManager(16, 4)
    cached_then_free(m2)
    r = Request("r", PROMPT[:8] + [9])
    hit, n = m2.get_computed_blocks(r)
    assert n == 8
    refused(m1, lambda: m1.allocate_slots(r, r.num_tokens - n, n, hit), "another KVCacheManager")
    empty, zero = KVCacheManager(16, 4).get_computed_blocks(r)  # even an empty one
    refused(m1, lambda: m1.allocate_slots(r, r.num_tokens, zero, empty), "another KVCacheManager")
    assert snapshot(m2) == snapshot(m2)


def test_a_hit_for_another_request_object_with_the_same_id_is_refused():
    mgr = KVCacheManager(16, 4)
    cached_then_free(mgr)
    looked_up = Request("r", PROMPT[:8] + [9])
    hit, n = mgr.get_computed_blocks(looked_up)
    impostor = Request("r", [50, 51, 52, 53, 54, 55, 56, 57, 58])
    refused(mgr, lambda: mgr.allocate_slots(impostor, 1, n, hit), "another Request object")
    refused(mgr, lambda: mgr.allocate_slots(impostor, impostor.num_tokens - n, n, hit), "another Request object")


def test_a_hit_for_a_running_request_cannot_be_replayed_by_its_impostor():
    mgr = KVCacheManager(16, 4)
    a = Request("a", PROMPT)
    admit(mgr, a)
    impostor = Request("a", PROMPT[:8] + [2])
    hit, n = mgr.get_computed_blocks(impostor)
    refused(mgr, lambda: mgr.allocate_slots(impostor, impostor.num_tokens - n, n, hit), "different Request object")
    refused(mgr, lambda: mgr.free(impostor), "different Request object")


def test_a_hit_is_read_only():
    mgr = KVCacheManager(16, 4)
    cached_then_free(mgr)
    r = Request("r", PROMPT[:8] + [9])
    hit, n = mgr.get_computed_blocks(r)
    for name, value in (("num_tokens", 4), ("blocks", ([],)), ("block_ids", ([1],))):
        with pytest.raises(AttributeError):
            setattr(hit, name, value)
    hit.blocks[0].clear()  # a copy
    assert mgr.allocate_slots(r, r.num_tokens - n, n, hit) is not None
    assert mgr.get_block_ids("r")[0][:2] == hit.block_ids[0]


# -- class 2: progress is checked against what was allocated ------------------------


@pytest.fixture
def running() -> tuple[KVCacheManager, Request]:
    mgr = KVCacheManager(16, 4)
    r = Request("r", list(range(4)))
    assert mgr.allocate_slots(r, 4) == ([1],)
    r.num_computed_tokens = 4
    r.append_output_token_ids(range(20, 32))  # 16 tokens in all
    return mgr, r


@pytest.mark.parametrize("lie", [4.0, 3.5, True, False, None, "4", -1])
def test_progress_must_be_an_int(running, lie):
    mgr, r = running
    r.num_computed_tokens = lie
    refused(mgr, lambda: mgr.allocate_slots(r, 4), "num_computed_tokens")
    assert mgr.num_free_blocks == 14 and type(mgr.num_free_blocks) is int


@pytest.mark.parametrize("jump", [5, 8, 12])
def test_progress_cannot_jump_past_the_allocated_slots(running, jump):
    mgr, r = running
    r.num_computed_tokens = jump
    refused(mgr, lambda: mgr.allocate_slots(r, 4), "past the 4 token slots")
    # no block was cached over tokens that were never computed: only the first block hits
    probe = Request("p", list(range(4)) + list(range(20, 32)) + [7])
    assert mgr.get_computed_blocks(probe)[1] == 4


def test_progress_cannot_move_backwards(running):
    mgr, r = running
    assert mgr.allocate_slots(r, 4) == ([2],)
    r.num_computed_tokens = 8
    assert mgr.allocate_slots(r, 4) == ([3],)
    for lie in (7, 4, 0):
        r.num_computed_tokens = lie
        refused(mgr, lambda: mgr.allocate_slots(r, 1), "moved backwards from 8")
    r.num_computed_tokens = 12
    assert mgr.allocate_slots(r, 4) == ([4],)


def test_progress_of_an_admission_must_be_zero():
    mgr = KVCacheManager(16, 4)
    r = Request("r", list(range(16)))
    r.num_computed_tokens = 8
    refused(mgr, lambda: mgr.allocate_slots(r, 8), "holds no blocks")


# -- class 3: cache keys cannot change after construction ---------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("cache_salt", "tenant-B"),
        ("cache_salt", None),
        ("lora_name", "adapter"),
        ("mm_inputs", ()),
        ("request_id", "other"),
        ("num_prompt_tokens", 1),
        ("prompt_token_ids", [1, 2]),
        ("all_token_ids", [1, 2]),
        ("block_hashes", []),
    ],
)
def test_keys_are_read_only(field, value):
    b = Request("b", PROMPT, cache_salt="tenant-A")
    before = getattr(b, field)
    with pytest.raises(AttributeError):
        setattr(b, field, value)
    assert getattr(b, field) == before


def test_assigning_a_salt_raises_a_kvpool_error_and_the_tenant_stays_isolated():
    mgr = KVCacheManager(16, 4)
    cached_then_free(mgr)  # unsalted tenant
    b = Request("b", PROMPT[:8] + [3])
    with pytest.raises(ReadOnlyFieldError, match="cache_salt is fixed at construction"):
        b.cache_salt = "tenant-B"
    salted = Request("s", PROMPT[:8] + [3], cache_salt="tenant-B")
    assert mgr.get_computed_blocks(salted)[1] == 0


def test_views_are_copies():
    mgr = KVCacheManager(16, 4)
    a = Request("a", PROMPT)
    admit(mgr, a)
    tokens, hashes = a.all_token_ids, a.block_hashes
    tokens[0] = 999
    hashes[0] = hashes[1]
    assert a.all_token_ids[0] == 100 and a.block_hashes[0] != a.block_hashes[1]
    mgr.check_invariants()


# -- class 4: max_model_len is a limit ------------------------------------------------


def test_a_request_longer_than_max_model_len_is_refused_before_any_block_moves():
    mgr = KVCacheManager(16, 4, max_model_len=8)
    r = Request("r", range(16))
    refused(mgr, lambda: mgr.allocate_slots(r, 16), "max_model_len=8", CapacityError)
    refused(mgr, lambda: mgr.get_computed_blocks(r), "max_model_len=8", CapacityError)


def test_ten_tokens_never_get_eight_slots():
    mgr = KVCacheManager(16, 4, max_model_len=8)
    r = Request("r", range(8))
    assert mgr.allocate_slots(r, 8) == ([1, 2],)
    r.num_computed_tokens = 8
    r.append_output_token_ids([1, 2])
    refused(mgr, lambda: mgr.allocate_slots(r, 2), "exceed max_model_len=8", CapacityError)


def test_lookahead_slots_stop_at_max_model_len():
    mgr = KVCacheManager(16, 4, max_model_len=8)
    r = Request("r", range(6))
    assert mgr.allocate_slots(r, 6, num_lookahead_tokens=5) == ([1, 2],)  # 11 slots asked, 8 given


# -- class 6: strict input types ------------------------------------------------------


@pytest.mark.parametrize("field", ["cache_salt", "lora_name"])
def test_lone_surrogates_in_keys_are_refused(field):
    with pytest.raises(RequestStateError, match="lone surrogate"):
        Request("r", [1, 2], **{field: "tenant-\udc80"})
    with pytest.raises(ConfigError, match="lone surrogate"):
        BlockHasher(4).hash_token_ids([1, 2, 3, 4], **{field: "x\ud800"})


def test_lone_surrogates_in_media_ids_and_request_ids_are_refused():
    with pytest.raises(ConfigError, match="lone surrogate"):
        MultiModalInput(identifier="img-\ud800", offset=0, length=1)
    with pytest.raises(RequestStateError, match="lone surrogate"):
        Request("r-\udfff", [1])


@pytest.mark.parametrize("tokens", [[True, 2], [1, False], (3, True), [1.0], [None], ["5"], range(-1, 3)])
def test_only_integers_are_token_ids(tokens):
    with pytest.raises(InvalidTokenError):
        Request("r", tokens)
    r = Request("r", [1])
    with pytest.raises(InvalidTokenError):
        r.append_output_token_ids(tokens)
    with pytest.raises(InvalidTokenError):
        r.append_output_token_ids(True)
    assert list(r.all_token_ids) == [1]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"enable_caching": "false"}, "enable_caching"),
        ({"enable_caching": 0}, "enable_caching"),
        ({"enable_events": "yes"}, "enable_events"),
        ({"groups": 5}, "groups"),
        ({"groups": "full"}, "groups"),
        ({"eviction_policy": 3}, "eviction_policy"),
        ({"hash_seed": "seed"}, "seed"),
        ({"hash_algo": 5}, "hash algorithm"),
        ({"max_model_len": 8.0}, "max_model_len"),
    ],
)
def test_constructor_arguments_are_strict(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        KVCacheManager(16, 4, **kwargs)


@pytest.mark.parametrize("bad", [None, "r", 5, ["r"]])
def test_every_entry_point_refuses_a_non_request(bad):
    mgr = KVCacheManager(16, 4)
    refused(mgr, lambda: mgr.get_computed_blocks(bad), "expected a kvpool.Request")
    refused(mgr, lambda: mgr.allocate_slots(bad, 1), "expected a kvpool.Request")
    refused(mgr, lambda: mgr.free(bad), "expected a kvpool.Request")
    refused(mgr, lambda: mgr.hash_request(bad), "expected a kvpool.Request")
    refused(mgr, lambda: mgr.note_waiting([bad]), "expected a kvpool.Request")


@pytest.mark.parametrize(
    ("args", "kwargs", "match"),
    [
        ((1.0,), {}, "num_new_tokens=1.0"),
        ((True,), {}, "num_new_tokens=True"),
        ((1,), {"num_lookahead_tokens": 0.0}, "num_lookahead_tokens=0.0"),
        ((1,), {"num_lookahead_tokens": False}, "num_lookahead_tokens=False"),
        ((1,), {"num_encoder_tokens": None}, "num_encoder_tokens=None"),
        ((1, 0.0), {}, "num_new_computed_tokens=0.0"),
    ],
)
def test_counts_are_ints_on_the_fast_path_too(running, args, kwargs, match):
    mgr, r = running
    refused(mgr, lambda: mgr.allocate_slots(r, *args, **kwargs), match)
