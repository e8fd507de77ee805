"""LRU and offline-optimal (MIN) prefix hit rates: exhaustive checks and reference numbers."""

from __future__ import annotations

import random
from itertools import combinations

import pytest

pytest.importorskip("numpy", reason="kvpool.sim.optimum needs numpy (the sim extra)")

from kvpool.errors import ConfigError  # noqa: E402
from kvpool.sim.optimum import (  # noqa: E402
    BlockTrace,
    HitRateResult,
    Policy,
    build_block_trace,
    lru_hit_rate,
    optimal_hit_rate,
)
from kvpool.sim.traces import (  # noqa: E402
    HashBlockSegment,
    SharedSegment,
    TraceRequest,
    UniqueSegment,
)
from kvpool.sim.workloads import WorkloadKind, generate_workload  # noqa: E402


def _hash_request(i: int, path: list[int], length: int | None = None) -> TraceRequest:
    length = 512 * len(path) if length is None else length
    return TraceRequest(f"r{i}", float(i), (HashBlockSegment(tuple(path), length),), 1)


def _random_tree_trace(rng: random.Random, nodes: int, requests: int) -> list[list[int]]:
    """Root-to-node paths over a random tree of block ids (a request = one path)."""
    parent = [-1] + [rng.randrange(-1, i) for i in range(1, nodes)]
    paths = []
    for _ in range(requests):
        node = rng.randrange(nodes)
        path = [node]
        while parent[path[-1]] >= 0:
            path.append(parent[path[-1]])
        paths.append(path[::-1])
    return paths


def _prefix_hits(cached: frozenset[int], keys: list[int]) -> int:
    hits = 0
    for k in keys:
        if k not in cached:
            break
        hits += 1
    return hits


def _exhaustive_optimum(paths: list[list[int]], capacity: int) -> int:
    """Most prefix hits of any policy, by trying every cache state after every request.

    After a request the cache may become any subset of (cache + the request's
    blocks) that fits. Only subsets of the largest possible size are kept: more
    cached blocks never lower prefix hits, and from a superset every later
    choice of a subset stays available, so the maximum is unchanged.
    """
    states = {frozenset(): 0}
    for keys in paths:
        nxt: dict[frozenset[int], int] = {}
        for cached, score in states.items():
            total = score + _prefix_hits(cached, keys)
            pool = sorted(cached | set(keys))
            for subset in combinations(pool, min(capacity, len(pool))):
                state = frozenset(subset)
                if nxt.get(state, -1) < total:
                    nxt[state] = total
        states = nxt
    return max(states.values())


def test_min_equals_exhaustive_optimum_and_lru_never_beats_it() -> None:
    rng = random.Random(2024)
    checked = differs = 0
    for _ in range(300):
        paths = _random_tree_trace(rng, rng.randint(4, 7), rng.randint(4, 7))
        requests = [_hash_request(i, p) for i, p in enumerate(paths)]
        trace = build_block_trace(requests, 512)
        for capacity in range(1, 5):
            best = _exhaustive_optimum(paths, capacity)
            opt = optimal_hit_rate(trace, capacity)
            lru = lru_hit_rate(trace, capacity)
            assert opt.hits == best, (paths, capacity)
            assert lru.hits <= opt.hits, (paths, capacity)
            checked += 1
            differs += lru.hits < opt.hits
    assert checked == 1200 and differs > 50  # the cases are not all trivial


def _reference_lru(paths: list[list[int]], capacity: int) -> int:
    """Plain-list LRU (front = least recent): the model stated in lru_hit_rate's docstring."""
    order: list[int] = []
    hits = 0
    for keys in paths:
        hits += _prefix_hits(frozenset(order), keys)
        for k in reversed(keys) if capacity else ():
            if k in order:
                order.remove(k)
            elif len(order) >= capacity:
                order.pop(0)
            order.append(k)
    return hits


def test_lru_matches_a_plain_list_reference() -> None:
    rng = random.Random(7)
    for _ in range(200):
        paths = _random_tree_trace(rng, rng.randint(3, 30), rng.randint(5, 40))
        trace = build_block_trace([_hash_request(i, p) for i, p in enumerate(paths)], 512)
        for capacity in (0, 1, 2, 3, 5, 8, 13):
            assert lru_hit_rate(trace, capacity).hits == _reference_lru(paths, capacity)


def test_hand_worked_example() -> None:
    # Two branches under a common root; capacity 2 cannot hold both branches.
    paths = [[0, 1], [0, 2], [0, 1], [0, 2], [0, 1]]
    reqs = [_hash_request(i, p) for i, p in enumerate(paths)]
    lru = lru_hit_rate(reqs, 2, 512)
    opt = optimal_hit_rate(reqs, 2, 512)
    # LRU keeps {0, x} of the previous request: only block 0 ever hits after the first request.
    assert (lru.hits, lru.lookups) == (4, 10)
    # MIN keeps {0, 1} throughout and bypasses 2 (needed later than 1, or never): 1+2+1+2 hits.
    assert opt.hits == _exhaustive_optimum(paths, 2) == 6
    assert opt.policy is Policy.MIN and lru.policy is Policy.LRU
    assert opt.token_hit_rate == pytest.approx(6 * 512 / (10 * 512))
    unbounded = [f(reqs, 100, 512) for f in (lru_hit_rate, optimal_hit_rate)]
    assert [r.hits for r in unbounded] == [7, 7]
    assert [f(reqs, 0, 512).hits for f in (lru_hit_rate, optimal_hit_rate)] == [0, 0]


def test_token_path_matches_hash_id_fast_path() -> None:
    rng = random.Random(11)
    paths = _random_tree_trace(rng, 25, 60)
    reqs = [_hash_request(i, p, 512 * (len(p) - 1) + rng.randint(1, 512)) for i, p in enumerate(paths)]
    # Same tokens, but a salt of None on a copy that is not a single hash segment forces the token path.
    slow = [
        TraceRequest(r.request_id, r.arrival_ms, (*r.segments, SharedSegment("x", 0)), r.output_length) for r in reqs
    ]
    assert all(r.hash_ids is None for r in slow)
    for block_size in (16, 64, 512):
        for partial in (False, True):
            fast_t = build_block_trace(reqs, block_size, include_partial_blocks=partial)
            slow_t = build_block_trace(slow, block_size, include_partial_blocks=partial)
            assert fast_t.offsets.tolist() == slow_t.offsets.tolist()
            for capacity in (3, 40, 400):
                for f in (lru_hit_rate, optimal_hit_rate):
                    assert f(fast_t, capacity) == f(slow_t, capacity)


def test_partial_blocks_and_token_hits() -> None:
    reqs = [_hash_request(0, [0, 1], 700), _hash_request(1, [0, 1], 700), _hash_request(2, [0, 1], 600)]
    full = optimal_hit_rate(reqs, 10, 512)
    assert (full.lookups, full.hits, full.hit_tokens, full.prompt_tokens) == (3, 2, 1024, 2000)
    part = optimal_hit_rate(reqs, 10, 512, include_partial_blocks=True)
    # Request 2's tail (600 tokens) differs from the 700-token tail of the same id: a miss.
    assert (part.lookups, part.hits, part.hit_tokens) == (6, 3, 700 + 512)
    assert part.block_hit_rate == pytest.approx(3 / 6) and part.token_hit_rate == pytest.approx(1212 / 2000)


def test_salts_and_lora_isolate_identical_prompts() -> None:
    prompt = [SharedSegment("system", 64), UniqueSegment(0)]
    reqs = [
        TraceRequest.create(f"r{i}", i, prompt, 1, cache_salt=salt, lora_name=lora)
        for i, (salt, lora) in enumerate([(None, None), ("a", None), (None, "x"), ("a", None), (None, None)])
    ]
    result = optimal_hit_rate(reqs, 100, 16)
    assert result.lookups == 20 and result.hits == 8  # only r3 (salt a) and r4 (plain) hit their twins


def test_workloads_share_what_they_promise() -> None:
    shared = generate_workload(WorkloadKind.SHARED_PREFIX, num_requests=200, seed=5)
    res = optimal_hit_rate(shared, 10**6, 16)
    sys_blocks = sum(r.segments[0].length // 16 for r in shared)
    first_use = {r.segments[0].name: r.segments[0].length // 16 for r in shared}
    assert res.hits == sys_blocks - sum(first_use.values())  # every reuse of a system prompt hits fully
    tenants = generate_workload(WorkloadKind.MULTI_TENANT, num_requests=200, seed=5)
    plain = [TraceRequest(r.request_id, r.arrival_ms, r.segments, r.output_length, follows=r.follows) for r in tenants]
    salted, unsalted = (lru_hit_rate(x, 10**6, 16).hits for x in (tenants, plain))
    assert salted < unsalted  # salts keep tenants apart


def test_capacity_monotonicity_on_a_workload() -> None:
    trace = build_block_trace(generate_workload("mixed", num_requests=300, seed=9), 16)
    previous = -1
    for capacity in (0, 50, 200, 800, 3200, 10**6):
        opt, lru = optimal_hit_rate(trace, capacity), lru_hit_rate(trace, capacity)
        assert lru.hits <= opt.hits and opt.hits >= previous
        previous = opt.hits
    assert lru.hits == opt.hits  # unbounded: both keep everything


def test_argument_errors() -> None:
    reqs = [_hash_request(0, [0])]
    trace = build_block_trace(reqs, 512)
    assert isinstance(trace, BlockTrace) and trace.num_requests == 1
    with pytest.raises(ConfigError, match="capacity_blocks"):
        lru_hit_rate(reqs, -1)
    with pytest.raises(ConfigError, match="block_size"):
        optimal_hit_rate(reqs, 1, 0)
    with pytest.raises(ConfigError, match="differs from the BlockTrace's 512"):
        optimal_hit_rate(trace, 1, 16)
    with pytest.raises(ConfigError, match="include_partial_blocks"):
        lru_hit_rate(trace, 1, include_partial_blocks=True)
    empty = HitRateResult(Policy.LRU, 1, 16, False, 0, 0, 0, 0, 0)
    assert (empty.block_hit_rate, empty.token_hit_rate) == (0.0, 0.0)


# ------------------------------------------------------- the Mooncake reference table

README_512 = {  # capacity -> (LRU block, LRU token, MIN block, MIN token), partial last block counted
    1_000: (0.0445, 0.0454, 0.1907, 0.1944),
    10_000: (0.2116, 0.2157, 0.3664, 0.3736),
}
README_FULL_ONLY = {1_000: (0.0459, 0.1944), 10_000: (0.2193, 0.3734)}  # token hit, LRU and MIN


@pytest.mark.parametrize("capacity", sorted(README_512))
def test_readme_table_at_512_tokens(conversation_requests: list[TraceRequest], capacity: int) -> None:
    trace = build_block_trace(conversation_requests, 512, include_partial_blocks=True)
    assert trace.offsets[-1] == 288_500
    lru, opt = lru_hit_rate(trace, capacity), optimal_hit_rate(trace, capacity)
    got = (lru.block_hit_rate, lru.token_hit_rate, opt.block_hit_rate, opt.token_hit_rate)
    assert [round(x, 4) for x in got] == list(README_512[capacity])


@pytest.mark.parametrize("capacity", sorted(README_FULL_ONLY))
def test_readme_full_blocks_only_at_512_tokens(conversation_requests: list[TraceRequest], capacity: int) -> None:
    trace = build_block_trace(conversation_requests, 512)
    lru, opt = lru_hit_rate(trace, capacity), optimal_hit_rate(trace, capacity)
    assert (round(lru.token_hit_rate, 4), round(opt.token_hit_rate, 4)) == README_FULL_ONLY[capacity]


def test_unbounded_ceiling(conversation_requests: list[TraceRequest]) -> None:
    trace = build_block_trace(conversation_requests, 512, include_partial_blocks=True)
    res = lru_hit_rate(trace, 10**9)
    assert (round(res.block_hit_rate, 4), round(res.token_hit_rate, 4)) == (0.3664, 0.3736)


@pytest.mark.slow
def test_16_token_blocks_at_32x_capacity(conversation_requests: list[TraceRequest]) -> None:
    # Caching only the 16-token sub-blocks of full 512-token blocks reproduces the README's
    # full-blocks-only list through the 16-token machinery.
    whole = [
        TraceRequest(
            r.request_id,
            r.arrival_ms,
            (HashBlockSegment(r.hash_ids[: r.prompt_length // 512], 512 * (r.prompt_length // 512)),),
            r.output_length,
        )
        for r in conversation_requests
    ]
    total = sum(r.prompt_length for r in conversation_requests)
    trace = build_block_trace(whole, 16)
    lru, opt = lru_hit_rate(trace, 32_000), optimal_hit_rate(trace, 32_000)
    assert (round(lru.hit_tokens / total, 4), round(opt.hit_tokens / total, 4)) == README_FULL_ONLY[1_000]
    # Every full 16-token block cacheable, the trailing 512-token block's included (measured, not
    # from the README): slightly different because those sub-blocks now compete for space.
    full16 = build_block_trace(conversation_requests, 16)
    assert full16.offsets[-1] == sum(r.prompt_length // 16 for r in conversation_requests)
    lru16, opt16 = lru_hit_rate(full16, 32_000), optimal_hit_rate(full16, 32_000)
    assert (round(lru16.token_hit_rate, 4), round(opt16.token_hit_rate, 4)) == (0.0457, 0.1945)
    assert lru16.hits < opt16.hits


def test_unchained_hash_ids_fall_back_to_exact_token_keys() -> None:
    # Id 2 is second in request 0 but first in request 1: those prompts share no prefix,
    # so request 1 must miss although its only id was seen before.
    reqs = [_hash_request(0, [1, 2]), _hash_request(1, [2]), _hash_request(2, [1, 2])]
    for block_size in (16, 512):
        for f in (lru_hit_rate, optimal_hit_rate):
            assert f(reqs, 100, block_size).hits == 2 * 512 // block_size  # only request 2 repeats 0
