"""KV tiers in the simulator: the engine's connector, a worker that keeps time, per-tier hits, both write policies."""

from __future__ import annotations

import random

import pytest

from kvpool.cost_model import CostProfile
from kvpool.errors import ConfigError
from kvpool.sim.simulator import SimulationConfig, SimulationResult, simulate
from kvpool.sim.traces import SharedSegment, TraceRequest, UniqueSegment
from kvpool.sim.transfers import DEFAULT_LINKS, KeyStore, TierLink, capacity_blocks
from kvpool.tiers import CpuTarget, TierKind, WritePolicy, parse_spec, parse_specs

COST = CostProfile.flat(step_overhead_s=0.01, prefill_s_per_token=0.001, decode_s_per_seq=0.0, kv_bytes_per_token=1000)
BLOCK_BYTES = 16 * 1000  # 16-token blocks


def test_sizes_in_bytes_become_blocks_through_the_block_bytes():
    assert capacity_blocks(parse_spec("cpu:1MB"), BLOCK_BYTES) == 62
    assert capacity_blocks(parse_spec("disk:/nowhere:160000"), BLOCK_BYTES) == 10
    assert capacity_blocks(parse_spec("redis://127.0.0.1:1/0"), BLOCK_BYTES) is None  # Redis evicts by itself
    with pytest.raises(ConfigError, match="holds no block of 16000 bytes"):
        capacity_blocks(CpuTarget(15_999), BLOCK_BYTES)


@pytest.mark.parametrize(("field", "value"), [("bandwidth_bytes_per_s", 0), ("latency_s", -1), ("latency_s", True)])
def test_a_tier_link_must_be_finite_and_positive(field, value):
    args = {"bandwidth_bytes_per_s": 1e9, "latency_s": 0.0} | {field: value}
    with pytest.raises(ConfigError, match=repr(value)):
        TierLink(**args)


def test_a_transfer_is_one_latency_plus_the_bytes_over_the_bandwidth():
    link = TierLink(bandwidth_bytes_per_s=1e6, latency_s=0.002)
    assert link.seconds(0, 1000) == 0.0 and link.seconds(3, 1000) == pytest.approx(0.005)
    assert DEFAULT_LINKS[TierKind.CPU].bandwidth_bytes_per_s == 25e9


def test_a_key_store_is_lru_within_its_blocks():
    store = KeyStore("disk", 2)
    store.put_many([b"a", b"b"])
    assert store.get_many([b"a", b"x"]) == [b"", None]  # a read refreshes a
    store.put_many([b"c"])
    assert store.contains_prefix([b"a", b"c"]) == 2 and store.contains_prefix([b"b"]) == 0


def test_the_config_checks_its_tier_options():
    with pytest.raises(ConfigError, match="each tier kind may appear once"):
        SimulationConfig(num_blocks=8, tiers=(CpuTarget(10**6), CpuTarget(10**6)))
    with pytest.raises(ConfigError, match="tier_write must be a WritePolicy"):
        SimulationConfig(num_blocks=8, tiers=parse_specs(["cpu:1MB"]), tier_write="write-back")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"no link for the tiers \['cpu'\]"):
        SimulationConfig(num_blocks=8, tiers=parse_specs(["cpu:1MB"]), tier_links={})


def _evicted_then_reused() -> list[TraceRequest]:
    """c shares a's 64-token prefix; b, in between, pushes a's blocks out of a 5-block GPU pool."""
    system = SharedSegment(name="sys", length=64)
    return [
        TraceRequest.create("a", 0.0, (system, UniqueSegment(length=8)), 1),
        TraceRequest.create("b", 10_000.0, (UniqueSegment(length=72),), 1),
        TraceRequest.create("c", 20_000.0, (system, UniqueSegment(length=8)), 1),
    ]


@pytest.mark.parametrize("write", list(WritePolicy))
def test_a_tier_hit_costs_its_load_instead_of_the_recompute(write):
    # 16,000 B blocks; at 16 MB/s a block loads in 1 ms, after 1 ms of latency
    links = {TierKind.CPU: TierLink(bandwidth_bytes_per_s=16e6, latency_s=0.001)}
    trace = _evicted_then_reused()
    plain = simulate(trace, SimulationConfig(num_blocks=6, cost=COST))
    config = SimulationConfig(num_blocks=6, cost=COST, tiers=parse_specs(["cpu:1600000"]), tier_links=links)
    tiered = simulate(trace, SimulationConfig(**{**_fields(config), "tier_write": write}))
    assert plain.hit_tokens == 0
    assert tiered.hit_tokens_by_tier == {"gpu": 0, "cpu": 64}
    assert tiered.tier_load_seconds == pytest.approx(0.001 + 4 * 0.001)
    assert [s for _, s in plain.ttft_points][-1] == pytest.approx(0.01 + 0.072)  # c recomputed all 72 tokens
    assert [s for _, s in tiered.ttft_points][-1] == pytest.approx(0.01 + 0.008 + 0.005)  # 8 computed, 64 loaded


def test_tenants_stay_apart_in_the_tiers():
    system = SharedSegment(name="sys", length=64)
    trace = [
        TraceRequest.create("a", 0.0, (system, UniqueSegment(length=8)), 1, cache_salt="alice"),
        TraceRequest.create("filler", 1000.0, (UniqueSegment(length=72),), 1),
        TraceRequest.create("b", 2000.0, (system, UniqueSegment(length=8)), 1, cache_salt="bob"),
        TraceRequest.create("a2", 3000.0, (system, UniqueSegment(length=8)), 1, cache_salt="alice"),
    ]
    result = simulate(trace, SimulationConfig(num_blocks=6, cost=COST, tiers=parse_specs(["cpu:1600000"])))
    assert result.hit_tokens_by_tier == {"gpu": 0, "cpu": 64}  # only alice's second request, from the tier


def _shared_prefix_trace(n: int, seed: int = 0) -> list[TraceRequest]:
    rng = random.Random(seed)
    trace = []
    for i in range(n):
        system = SharedSegment(name=f"sys{rng.randrange(12)}", length=16 * rng.randrange(1, 6))
        segments = (system, UniqueSegment(length=16 * rng.randrange(0, 2) + rng.randrange(1, 16)))
        trace.append(TraceRequest.create(f"r{i}", 100.0 * i, segments, 4))
    return trace


def test_write_back_saves_less_than_write_through_and_both_beat_the_pool_alone():
    trace = _shared_prefix_trace(300)
    base = SimulationConfig(num_blocks=12, cost=COST, tiers=parse_specs(["cpu:640000"]))  # 40 host blocks
    alone = simulate(trace, SimulationConfig(num_blocks=12, cost=COST))
    through = simulate(trace, base)
    back = simulate(trace, SimulationConfig(**{**_fields(base), "tier_write": WritePolicy.WRITE_BACK}))
    for result in (through, back):
        assert result.hit_tokens > alone.hit_tokens and result.hit_tokens_by_tier["cpu"] > 0
        assert sum(result.hit_tokens_by_tier.values()) == result.prefill_tokens_saved
    assert 0 < back.tier_save_seconds < through.tier_save_seconds


def _fields(config: SimulationConfig) -> dict[str, object]:
    return {name: getattr(config, name) for name in config.__dataclass_fields__}


# -- load or compute -------------------------------------------------------------------------------------


SLOW_REDIS = {TierKind.REDIS: TierLink(bandwidth_bytes_per_s=1e9, latency_s=0.5)}  # half a second per load


def test_a_tier_slower_than_computing_is_computed_and_counted():
    trace = _evicted_then_reused()
    plain = simulate(trace, SimulationConfig(num_blocks=6, cost=COST))
    config = SimulationConfig(
        num_blocks=6, cost=COST, tiers=parse_specs(["redis://127.0.0.1:1/0"]), tier_links=SLOW_REDIS
    )
    ruled = simulate(trace, config)
    always = simulate(trace, SimulationConfig(**{**_fields(config), "load_or_compute": False}))
    # c's 64 tokens compute in 64 ms; the load would take 0.5 s: computed, as without the tier.
    assert ruled.hit_tokens_by_tier == {"gpu": 0, "redis": 0} and ruled.tier_load_seconds == 0
    assert ruled.tier_blocks_computed == {"redis": 4}
    assert ruled.load_decisions == {"loaded": 0, "cut": 0, "computed": 1, "probed": 0}
    assert [s for _, s in ruled.ttft_points] == [s for _, s in plain.ttft_points]
    # Without the rule c loads, and its first token comes later than with no tier at all.
    assert always.hit_tokens_by_tier == {"gpu": 0, "redis": 64}
    assert always.tier_blocks_computed == {} and always.load_decisions == {}
    assert [s for _, s in always.ttft_points][-1] > [s for _, s in plain.ttft_points][-1] + 0.4


def _first_tokens(result: SimulationResult) -> dict[float, float]:
    """Each request's time to first token, by its arrival (ms after the first, rounded)."""
    return {round((done - ttft) * 1000): ttft for done, ttft in result.ttft_points}


@pytest.mark.parametrize("latency_s", [0.0005, 0.005, 0.02, 0.5])
def test_with_the_rule_no_request_waits_longer_for_its_first_token_than_without_the_tier(latency_s):
    """Prompts of 16 to 1,024 shared tokens, each evicted from the pool and then asked again, over a tier
    a block loads from in a third of its compute, after a latency of a block's compute to hundreds of blocks'."""
    trace = []
    for i, length in enumerate((16, 48, 160, 512, 1024)):
        shared = SharedSegment(name=f"p{i}", length=length)
        start = 30_000.0 * i
        trace.append(TraceRequest.create(f"a{i}", start, (shared, UniqueSegment(length=5)), 1))
        trace.append(TraceRequest.create(f"b{i}", start + 10_000, (UniqueSegment(length=1100),), 1))
        trace.append(TraceRequest.create(f"c{i}", start + 20_000, (shared, UniqueSegment(length=5)), 1))
    cost = CostProfile.flat(
        step_overhead_s=0.01, prefill_s_per_token=50e-6, decode_s_per_seq=0.0, kv_bytes_per_token=1000
    )
    plain = SimulationConfig(num_blocks=70, cost=cost, max_num_batched_tokens=2048)  # b evicts all
    links = {TierKind.DISK: TierLink(bandwidth_bytes_per_s=64e6, latency_s=latency_s)}  # 0.25 ms a block
    tiered = SimulationConfig(**{**_fields(plain), "tiers": parse_specs(["disk:/nowhere:10MB"]), "tier_links": links})
    without = _first_tokens(simulate(trace, plain))
    ruled = simulate(trace, tiered)
    with_rule = _first_tokens(ruled)
    always = _first_tokens(simulate(trace, SimulationConfig(**{**_fields(tiered), "load_or_compute": False})))
    assert len(without) == len(with_rule) == len(always) == len(trace)
    assert [a for a in without if with_rule[a] > without[a] + 1e-9] == []
    slower_without_the_rule = [a for a in without if always[a] > without[a] + 1e-9]
    assert bool(slower_without_the_rule) == (latency_s > 0.001)  # the rule is what keeps them from it
    assert ruled.hit_tokens_by_tier["disk"] > 0 or latency_s == 0.5  # and it still loads where that pays
