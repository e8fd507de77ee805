"""Offload tiers in the simulator: the stores, the LRU equivalence, load times and per-tier hits."""

from __future__ import annotations

import random

import pytest

from kvpool.errors import ConfigError
from kvpool.sim.sequential import replay_sequential
from kvpool.sim.simulator import CostModel, SimulationConfig, simulate
from kvpool.sim.tiers import DEFAULT_LINKS, TierKind, TierSpec, TierStore, chain, parse_tier
from kvpool.sim.traces import SharedSegment, TraceRequest, UniqueSegment

# -- specs and stores -------------------------------------------------------------------------------------


def test_parse_tier_takes_kind_and_blocks_with_the_default_link():
    spec = parse_tier("cpu=40000")
    assert (spec.kind, spec.capacity_blocks, spec.shared) == (TierKind.CPU, 40000, False)
    assert (spec.bandwidth_bytes_per_s, spec.latency_s) == DEFAULT_LINKS[TierKind.CPU]
    assert parse_tier("redis=5").shared  # Redis is one store for every replica
    custom = parse_tier("disk=10", bandwidth_gb_per_s=2.0, latency_us=50)
    assert custom.bandwidth_bytes_per_s == 2e9 and custom.latency_s == pytest.approx(50e-6)


@pytest.mark.parametrize(
    ("text", "fragment"),
    [("gpu=10", "unknown kind 'gpu'"), ("cpu", "KIND=BLOCKS"), ("cpu=0", "KIND=BLOCKS"), ("cpu=x", "KIND=BLOCKS")],
)
def test_bad_tiers_are_refused_naming_the_text(text, fragment):
    with pytest.raises(ConfigError, match=fragment):
        parse_tier(text)


@pytest.mark.parametrize(
    ("field", "value"), [("bandwidth_bytes_per_s", 0), ("bandwidth_bytes_per_s", float("inf")), ("latency_s", -1)]
)
def test_a_tier_link_must_be_finite_and_positive(field, value):
    args = {"kind": TierKind.CPU, "capacity_blocks": 4, "bandwidth_bytes_per_s": 1e9, "latency_s": 0.0}
    with pytest.raises(ConfigError, match="cpu tier"):
        TierSpec(**(args | {field: value}))


def test_load_time_is_one_latency_plus_the_bytes_over_the_bandwidth():
    spec = TierSpec(kind=TierKind.DISK, capacity_blocks=8, bandwidth_bytes_per_s=1e6, latency_s=0.002)
    assert spec.load_seconds(0, 1000) == 0.0
    assert spec.load_seconds(3, 1000) == pytest.approx(0.002 + 0.003)


def _spec(kind: TierKind, blocks: int, shared: bool = False) -> TierSpec:
    return TierSpec(kind=kind, capacity_blocks=blocks, bandwidth_bytes_per_s=1e9, latency_s=0.0, shared=shared)


def test_a_store_is_lru_and_spills_its_oldest_into_the_tier_below():
    cpu, disk = chain([_spec(TierKind.CPU, 2), _spec(TierKind.DISK, 2)])
    for h in (b"a", b"b"):
        cpu.put(h)
    cpu.put(b"a")  # refreshed: b is now the oldest
    cpu.put(b"c")
    assert b"b" not in cpu and b"b" in disk and len(cpu) == 2
    cpu.take(b"a")  # a private tier lets a hit go up to the GPU
    assert b"a" not in cpu
    for h in (b"d", b"e", b"f"):
        cpu.put(h)
    assert len(disk) == 2 and b"b" not in disk  # the disk dropped its oldest
    assert cpu.num_evicted == 3 and disk.num_evicted == 1


def test_a_shared_store_is_one_object_for_every_replica_and_keeps_its_copy_on_a_hit():
    shared: dict[TierKind, TierStore] = {}
    specs = [_spec(TierKind.CPU, 2), _spec(TierKind.REDIS, 4, shared=True)]
    one, two = chain(specs, shared), chain(specs, shared)
    assert one[0] is not two[0] and one[1] is two[1]
    one[1].put(b"x")
    two[1].take(b"x")
    assert b"x" in one[1]


# -- the LRU equivalence (sequential model) -----------------------------------------------------------------


def _shared_prefix_trace(n: int, *, aligned: bool, seed: int = 0) -> list[TraceRequest]:
    rng = random.Random(seed)
    trace = []
    for i in range(n):
        system = SharedSegment(name=f"sys{rng.randrange(12)}", length=16 * rng.randrange(1, 6))
        extra = 16 * rng.randrange(0, 2) + (0 if aligned else rng.randrange(1, 16))
        segments = (system, UniqueSegment(length=extra)) if extra else (system,)
        trace.append(TraceRequest.create(f"r{i}", float(i), segments, 1))
    return trace


@pytest.mark.parametrize(("gpu", "cpu"), [(8, 40), (10, 30), (20, 20), (40, 8)])
def test_an_lru_tier_below_an_lru_pool_is_one_lru_pool_of_the_combined_size(gpu, cpu):
    trace = _shared_prefix_trace(400, aligned=False)
    single = replay_sequential(trace, gpu + cpu)
    tiered = replay_sequential(trace, gpu, tiers=[parse_tier(f"cpu={cpu}")])
    assert tiered.oversized == 0  # every request fits in the GPU pool alone
    assert tiered.hit_tokens == single.hit_tokens and tiered.hit_blocks == single.hit_blocks
    assert tiered.hit_tokens_by_tier["cpu"] > 0  # the tier did part of the work
    assert sum(tiered.hit_tokens_by_tier.values()) == tiered.hit_tokens


def test_two_lru_tiers_are_one_lru_pool_of_the_three_sizes():
    trace = _shared_prefix_trace(400, aligned=False, seed=3)
    single = replay_sequential(trace, 8 + 10 + 20)
    tiered = replay_sequential(trace, 8, tiers=[parse_tier("cpu=10"), parse_tier("disk=20")])
    assert tiered.hit_tokens == single.hit_tokens
    assert set(tiered.hit_tokens_by_tier) == {"gpu", "cpu", "disk"} and tiered.hit_tokens_by_tier["disk"] > 0


def test_block_aligned_prompts_differ_only_by_the_duplicate_the_single_pool_keeps():
    """Every prompt block-aligned: the single pool spends a second slot on each recomputed last block."""
    trace = _shared_prefix_trace(400, aligned=True)
    for gpu, cpu in [(8, 40), (10, 30), (20, 20)]:
        single = replay_sequential(trace, gpu + cpu)
        tiered = replay_sequential(trace, gpu, tiers=[parse_tier(f"cpu={cpu}")])
        assert tiered.hit_tokens != single.hit_tokens
        assert abs(tiered.hit_tokens - single.hit_tokens) <= 0.1 * single.hit_tokens


def test_tenants_stay_apart_in_the_tiers():
    system = SharedSegment(name="sys", length=64)
    trace = [
        TraceRequest.create("a", 0.0, (system, UniqueSegment(length=8)), 1, cache_salt="alice"),
        TraceRequest.create("filler", 1.0, (UniqueSegment(length=72),), 1),
        TraceRequest.create("b", 2.0, (system, UniqueSegment(length=8)), 1, cache_salt="bob"),
        TraceRequest.create("a2", 3.0, (system, UniqueSegment(length=8)), 1, cache_salt="alice"),
    ]
    result = replay_sequential(trace, 5, tiers=[parse_tier("cpu=100")])
    assert result.hit_tokens_by_tier == {"gpu": 0, "cpu": 64}  # only alice's second request, from the tier


# -- time to first token: a load against a recompute ------------------------------------------------------

COST = CostModel(step_overhead_s=0.01, prefill_s_per_token=0.001, decode_s_per_seq=0.0, kv_bytes_per_token=1000)


def _evicted_then_reused() -> list[TraceRequest]:
    """c shares a's 64-token prefix; b, in between, pushes a's blocks out of a 5-block GPU pool."""
    system = SharedSegment(name="sys", length=64)
    return [
        TraceRequest.create("a", 0.0, (system, UniqueSegment(length=8)), 1),
        TraceRequest.create("b", 10_000.0, (UniqueSegment(length=72),), 1),
        TraceRequest.create("c", 20_000.0, (system, UniqueSegment(length=8)), 1),
    ]


def test_a_tier_hit_costs_its_load_instead_of_the_recompute():
    # 16-token blocks of 16,000 B; at 16 MB/s a block loads in 1 ms, after 1 ms of latency
    cpu = TierSpec(kind=TierKind.CPU, capacity_blocks=100, bandwidth_bytes_per_s=16e6, latency_s=0.001)
    trace = _evicted_then_reused()
    plain = simulate(trace, SimulationConfig(num_blocks=6, cost=COST))
    tiered = simulate(trace, SimulationConfig(num_blocks=6, cost=COST, tiers=(cpu,)))
    assert plain.hit_tokens == 0
    assert tiered.hit_tokens_by_tier == {"gpu": 0, "cpu": 64}
    assert tiered.tier_load_seconds == pytest.approx(0.001 + 4 * 0.001)
    ttft = dict(zip("abc", sorted(t for _, t in tiered.ttft_points), strict=True))
    assert [s for _, s in plain.ttft_points][-1] == pytest.approx(0.01 + 0.072)  # c recomputed all 72 tokens
    assert [s for _, s in tiered.ttft_points][-1] == pytest.approx(0.01 + 0.008 + 0.005)  # 8 computed, 64 loaded
    assert ttft["a"] == pytest.approx(0.01 + 0.008 + 0.005)


@pytest.mark.slow
def test_on_the_conversation_trace_a_cpu_tier_is_a_pool_of_the_combined_size(conversation_trace_path):
    """The first 1,500 Mooncake requests, 512-token blocks; 2 of them are block-aligned (the duplicate case)."""
    from itertools import islice

    from kvpool.sim.traces import iter_trace

    trace = list(islice(iter_trace(conversation_trace_path), 1500))
    single = replay_sequential(trace, 1200, block_size=512, hash_algo="xxh3_128")
    tiered = replay_sequential(trace, 300, block_size=512, hash_algo="xxh3_128", tiers=[parse_tier("cpu=900")])
    assert tiered.oversized == single.oversized == 0
    assert tiered.hit_tokens_by_tier["cpu"] > 0.05 * tiered.hit_tokens
    assert tiered.hit_tokens == pytest.approx(single.hit_tokens, rel=0.002)
