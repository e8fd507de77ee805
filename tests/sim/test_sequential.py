"""Sequential replay through the real manager: agreement with the key-level LRU model, and end to end."""

from __future__ import annotations

import pytest

pytest.importorskip("numpy", reason="the LRU model in kvpool.sim.optimum needs numpy (the sim extra)")

from kvpool.errors import ConfigError  # noqa: E402
from kvpool.eviction import POLICIES  # noqa: E402
from kvpool.hashing import HashAlgo  # noqa: E402
from kvpool.sim.optimum import build_block_trace, lru_hit_rate, optimal_hit_rate  # noqa: E402
from kvpool.sim.sequential import SequentialResult, replay_sequential  # noqa: E402
from kvpool.sim.traces import HashBlockSegment, TokenSegment, TraceRequest  # noqa: E402
from kvpool.sim.workloads import WorkloadKind, generate_workload  # noqa: E402


def _unaligned(kind: WorkloadKind, n: int, seed: int, block_size: int = 16) -> list[TraceRequest]:
    """A synthetic trace without block-aligned prompts (see the module docstring of sequential)."""
    return [r for r in generate_workload(kind, num_requests=n, seed=seed) if r.prompt_length % block_size]


@pytest.mark.parametrize("kind", [WorkloadKind.MULTI_TURN, WorkloadKind.SHARED_PREFIX, WorkloadKind.MIXED])
@pytest.mark.parametrize("scale", [1, 2, 6])
def test_lru_replay_equals_the_key_level_model_one_block_smaller(kind, scale):
    """With no block-aligned prompt the manager and the LRU model make the same decisions.

    The only difference left is the slot that the previous request's partial
    block occupies (freed uncached, it is the next block handed out), so the
    manager with C usable blocks caches what the model caches with C - 1.
    (Every request must fit in the pool: the model has no notion of a request
    too large to admit.)
    """
    reqs = _unaligned(kind, 150, seed=5)
    capacity = scale * max(-(-r.prompt_length // 16) for r in reqs)
    got = replay_sequential(reqs, capacity, policy="lru")
    model = lru_hit_rate(reqs, capacity - 1, 16)
    assert got.requests == model.requests == len(reqs) and got.oversized == 0
    assert got.hit_blocks == model.hits
    assert got.hit_tokens == model.hit_tokens
    assert got.cacheable_blocks == model.lookups
    assert got.token_hit_rate == model.token_hit_rate


def _hash_request(i: int, ids: tuple[int, ...], length: int) -> TraceRequest:
    return TraceRequest(f"r{i}", float(i), (HashBlockSegment(ids, length),), 1)


def test_a_fully_cached_block_aligned_prompt_is_where_the_manager_and_the_model_differ():
    """The manager always computes the last token, so it misses the last block the model hits."""
    reqs = [_hash_request(0, (1,), 64), _hash_request(1, (1,), 64)]  # 4 full blocks, twice
    got = replay_sequential(reqs, 100)
    model = lru_hit_rate(reqs, 100, 16)
    assert model.hits == 4
    assert got.hit_blocks == 3 and got.hit_tokens == 48


def test_the_result_is_frozen_and_repeatable():
    reqs = generate_workload(WorkloadKind.AGENT, num_requests=80, seed=2)
    first = replay_sequential(reqs, 300, policy="frequency")
    again = replay_sequential(reqs, 300, policy="frequency")
    assert isinstance(first, SequentialResult)
    assert first == again  # elapsed time is left out of equality
    with pytest.raises(AttributeError):
        first.hit_tokens = 0  # type: ignore[misc]
    assert 0.0 < first.token_hit_rate < 1.0 and first.elapsed_s > 0
    assert first.policy == "frequency" and first.hash_algo == HashAlgo.SHA256.value


def test_fast_hash_gives_the_same_hits():
    pytest.importorskip("xxhash")
    reqs = generate_workload(WorkloadKind.MIXED, num_requests=120, seed=9)
    sha = replay_sequential(reqs, 400, policy="lru")
    fast = replay_sequential(reqs, 400, policy="lru", hash_algo="xxh3_128")
    assert (fast.hit_tokens, fast.evictions) == (sha.hit_tokens, sha.evictions)
    assert fast.hash_algo == "xxh3_128"


def test_lookahead_changes_nothing_for_a_policy_without_hints():
    reqs = generate_workload(WorkloadKind.MULTI_TURN, num_requests=100, seed=4)
    plain = replay_sequential(reqs, 200, policy="lru")
    hinted = replay_sequential(reqs, 200, policy="lru", lookahead=8)
    assert (plain.hit_tokens, plain.evictions) == (hinted.hit_tokens, hinted.evictions)
    assert hinted.lookahead == 8


def test_lookahead_hints_protect_the_next_requests_prefix():
    """A document evicted under LRU survives when its next reader is announced as waiting."""
    doc = TokenSegment.of(range(1000, 1064))  # 4 blocks
    reqs = [TraceRequest("doc", 0.0, (doc, TokenSegment.of([1])), 1)]
    reqs += [
        TraceRequest(f"x{i}", 1.0 + i, (TokenSegment.of(range(5000 + 100 * i, 5000 + 100 * i + 80)),), 1)
        for i in range(3)
    ]
    reqs.append(TraceRequest("reader", 9.0, (doc, TokenSegment.of([2])), 1))
    without = replay_sequential(reqs, 10, policy="waiting")
    with_hints = replay_sequential(reqs, 10, policy="waiting", lookahead=4)
    assert without.hit_tokens == 0
    assert with_hints.hit_tokens == 64


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_every_policy_replays_and_never_beats_the_optimum(name):
    reqs = _unaligned(WorkloadKind.MIXED, 200, seed=13)
    trace = build_block_trace(reqs, 16)
    for capacity in (100, 400):
        got = replay_sequential(reqs, capacity, policy=name, lookahead=4)
        best = optimal_hit_rate(trace, capacity)
        assert got.hit_blocks <= best.hits


def test_oversized_requests_are_counted_not_admitted():
    reqs = [_hash_request(0, (1, 2), 1000), _hash_request(1, (1,), 100)]
    got = replay_sequential(reqs, 10)
    assert got.oversized == 1 and got.requests == 2
    assert got.prompt_tokens == 1100


def test_bad_arguments():
    with pytest.raises(ConfigError):
        replay_sequential([], 0)
    with pytest.raises(ConfigError):
        replay_sequential([], 10, lookahead=-1)
    with pytest.raises(ConfigError):
        replay_sequential([], 10, policy="nope")
    empty = replay_sequential([], 10)
    assert empty.requests == 0 and empty.token_hit_rate == 0.0 and empty.block_hit_rate == 0.0


# -- end to end on the conversation trace ----------------------------------------------------


@pytest.fixture(scope="module")
def conversation_slice(conversation_requests):
    return conversation_requests[:400]


def test_conversation_slice_lru_matches_the_model_up_to_aligned_prompts(conversation_slice):
    """The first 400 requests at 500 x 512 tokens: the manager's LRU hits what the model predicts,
    except the last block of fully cached block-aligned prompts (counted here exactly)."""
    capacity = 500 * 32
    got = replay_sequential(conversation_slice, capacity, policy="lru")
    model = lru_hit_rate(conversation_slice, capacity - 1, 16)
    assert got.requests == 400
    assert got.hit_blocks <= model.hits
    assert model.hits - got.hit_blocks <= sum(1 for r in conversation_slice if r.prompt_length % 16 == 0)
    assert got.token_hit_rate > 0.03


def test_conversation_slice_policies_and_hashes(conversation_slice):
    pytest.importorskip("xxhash")
    capacity = 300 * 32
    lru = replay_sequential(conversation_slice, capacity, policy="lru")
    fast = replay_sequential(conversation_slice, capacity, policy="lru", hash_algo="xxh3_128")
    assert (fast.hit_tokens, fast.evictions) == (lru.hit_tokens, lru.evictions)
    freq = replay_sequential(conversation_slice, capacity, policy="frequency", hash_algo="xxh3_128")
    best = optimal_hit_rate(conversation_slice, capacity, 16)
    assert freq.hit_blocks <= best.hits and lru.hit_blocks <= best.hits
