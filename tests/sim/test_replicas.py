"""Replicas in the simulator: routing, shared tiers, load imbalance, overload, and the sizing search."""

from __future__ import annotations

import pytest

from kvpool.cost_model import CostProfile
from kvpool.errors import ConfigError
from kvpool.routing import Routing
from kvpool.sim.simulator import SimulationConfig, SimulationResult, simulate, ttft_quantile
from kvpool.sim.sizing import fewest_replicas
from kvpool.sim.traces import SharedSegment, TraceRequest, UniqueSegment
from kvpool.tiers import parse_specs

COST = CostProfile.flat(step_overhead_s=0.01, prefill_s_per_token=0.0001, decode_s_per_seq=0.0005)


def conversations(num_prompts: int, per_prompt: int, gap_ms: float, *, prompt_tokens: int = 256) -> list[TraceRequest]:
    """``num_prompts`` long system prompts, each followed by ``per_prompt`` requests, interleaved in time."""
    trace = []
    for turn in range(per_prompt):
        for p in range(num_prompts):
            i = turn * num_prompts + p
            segments = (SharedSegment(name=f"system{p}", length=prompt_tokens), UniqueSegment(length=24))
            trace.append(TraceRequest.create(f"r{i}", i * gap_ms, segments, 2))
    return trace


def run(trace: list[TraceRequest], replicas: int, routing: Routing) -> SimulationResult:
    return simulate(trace, SimulationConfig(num_blocks=400, cost=COST, replicas=replicas, routing=routing))


def test_round_robin_deals_requests_in_turn():
    result = run(conversations(4, 5, 1000.0), 4, Routing.ROUND_ROBIN)
    assert [r.requests for r in result.per_replica] == [5, 5, 5, 5]
    assert result.request_imbalance == 1.0 and result.replicas == 4 and result.routing == "round-robin"


def test_prefix_routing_sends_every_follow_up_to_the_replica_holding_its_prompt():
    """Arrivals far apart (no load anywhere): each system prompt is computed once in the whole fleet."""
    trace = conversations(4, 6, 1000.0)
    prefix = run(trace, 3, Routing.PREFIX)
    one = run(trace, 1, Routing.PREFIX)
    rr = run(trace, 3, Routing.ROUND_ROBIN)
    assert prefix.hit_tokens == one.hit_tokens == 4 * 5 * 256  # every follow-up hits its whole prompt
    assert rr.hit_tokens < prefix.hit_tokens  # round-robin computes some prompts on several replicas
    assert min(r.requests for r in prefix.per_replica) > 0  # and the prompts still spread over the replicas


def test_prefix_routing_never_piles_a_burst_onto_the_hot_replica():
    """Everyone shares one prompt and arrives at once: the load term spreads them anyway."""
    trace = conversations(1, 40, 0.0)
    result = run(trace, 4, Routing.PREFIX)
    assert min(r.requests for r in result.per_replica) >= 5
    assert result.request_imbalance < 2.0


def test_prefix_routing_counts_the_blocks_a_replica_is_computing_as_held_there():
    """b shares a's first 512 tokens and arrives while a is prefilling: kvpool route sends it where a is."""
    system = SharedSegment(name="sys", length=512)
    a = TraceRequest.create("a", 0.0, (system, UniqueSegment(length=1024)), 1)  # 0.16 s of prefill
    b = TraceRequest.create("b", 1.0, (system, UniqueSegment(length=64)), 1)
    result = run([a, b], 2, Routing.PREFIX)
    where = {f.request_id: (f.replica, f.cached_tokens) for f in result.request_figures}
    assert where == {"a": (0, 0), "b": (0, 512)}  # 512 computing - 128 for a in flight beats the idle replica
    spread = simulate([a, b], SimulationConfig(num_blocks=400, cost=COST, replicas=2, routing_load_cost=33))
    assert {f.request_id: f.replica for f in spread.request_figures} == {"a": 0, "b": 1}  # 528 tokens a request


def test_least_loaded_counts_requests_in_flight_as_the_router_does():
    long = TraceRequest.create("long", 0.0, (UniqueSegment(length=3000),), 1)  # in flight for 0.3 s
    short = [TraceRequest.create(f"s{i}", ms, (UniqueSegment(length=40),), 1) for i, ms in enumerate((1, 200, 250))]
    result = run([long, *short], 2, Routing.LEAST_LOADED)
    assert [r.requests for r in result.per_replica] == [1, 3]  # s0 has ended by 200 ms, the long one has not
    burst = [TraceRequest.create(f"b{i}", 0.0, (UniqueSegment(length=40),), 1) for i in range(2)]
    tied = run([long, *burst, *short[:1]], 2, Routing.LEAST_LOADED)  # b0 to 1; then 1 each in flight: a tie
    assert [r.requests for r in tied.per_replica] == [2, 2]  # ties rotate, as kvpool route's chooser does


def test_a_shared_redis_tier_serves_one_replica_what_another_computed():
    system = SharedSegment(name="sys", length=64)
    trace = [
        TraceRequest.create("a", 0.0, (system, UniqueSegment(length=8)), 1),  # replica 0
        TraceRequest.create("x", 10_000.0, (UniqueSegment(length=72),), 1),  # replica 1
        TraceRequest.create("y", 20_000.0, (UniqueSegment(length=72),), 1),  # replica 0: pushes a's blocks out
        TraceRequest.create("b", 30_000.0, (system, UniqueSegment(length=8)), 1),  # replica 1
    ]
    config = SimulationConfig(num_blocks=6, cost=COST, replicas=2, routing=Routing.ROUND_ROBIN)
    private = simulate(trace, config)
    shared = simulate(trace, SimulationConfig(**{**_fields(config), "tiers": parse_specs(["redis://127.0.0.1:1/0"])}))
    assert private.hit_tokens == 0
    assert shared.hit_tokens_by_tier == {"gpu": 0, "redis": 64}


def _fields(config: SimulationConfig) -> dict[str, object]:
    return {name: getattr(config, name) for name in config.__dataclass_fields__}


def test_overload_is_reported_with_both_rates():
    # 20 requests of 1,000 tokens per second against a replica that computes ~10k tokens/s at most
    trace = [TraceRequest.create(f"r{i}", i * 50.0, (UniqueSegment(length=1000),), 1) for i in range(100)]
    cost = CostProfile.flat(step_overhead_s=0.01, prefill_s_per_token=0.0001, decode_s_per_seq=0.0)
    one = simulate(trace, SimulationConfig(num_blocks=1000, cost=cost))
    assert one.offered_prefill_tokens_per_s == pytest.approx(100 * 1000 / 4.95)
    assert one.servable_prefill_tokens_per_s == pytest.approx(8192 / (0.01 + 0.8192))
    assert one.overloaded and one.ttft_p90_s > 2.0
    three = simulate(trace, SimulationConfig(num_blocks=1000, cost=cost, replicas=3, routing=Routing.LEAST_LOADED))
    assert not three.overloaded and three.servable_prefill_tokens_per_s == pytest.approx(
        3 * one.servable_prefill_tokens_per_s
    )
    assert three.ttft_p90_s < 0.5


def test_the_timeline_records_the_queue_and_every_first_token():
    trace = [TraceRequest.create(f"r{i}", i * 50.0, (UniqueSegment(length=1000),), 1) for i in range(100)]
    result = simulate(trace, SimulationConfig(num_blocks=1000, cost=COST, usage_interval_s=0.5))
    assert len(result.ttft_points) == 100
    assert max(n for _, n in result.queue_timeline) > 10  # the backlog shows
    assert "ttft_points" not in result.to_dict() and "queue_timeline" in result.to_dict()


def test_ttft_quantile_interpolates_between_requests():
    trace = [TraceRequest.create(f"r{i}", i * 10_000.0, (UniqueSegment(length=100 * (i + 1)),), 1) for i in range(5)]
    result = simulate(trace, SimulationConfig(num_blocks=1000, cost=COST))
    values = sorted(t for _, t in result.ttft_points)
    assert ttft_quantile(result, 50) == pytest.approx(values[2])
    assert ttft_quantile(result, 87.5) == pytest.approx((values[3] + values[4]) / 2)
    for bad in (0, 100, -1, float("nan")):
        with pytest.raises(ConfigError, match="percentile"):
            ttft_quantile(result, bad)


# -- the sizing search ---------------------------------------------------------------------------------------


def _overloading_trace() -> list[TraceRequest]:
    return [TraceRequest.create(f"r{i}", i * 20.0, (UniqueSegment(length=800),), 1) for i in range(120)]


@pytest.mark.parametrize("routing", list(Routing))
def test_sizing_finds_the_fewest_replicas_that_meet_the_objective(routing):
    trace = _overloading_trace()
    config = SimulationConfig(num_blocks=400, cost=COST, routing=routing)
    answer = fewest_replicas(trace, config, slo_s=0.2, percentile=90, max_replicas=16)
    n = answer.replicas
    assert n is not None and n > 1
    assert answer.ttft_by_replicas[n] <= 0.2
    below = simulate(trace, SimulationConfig(num_blocks=400, cost=COST, routing=routing, replicas=n - 1))
    assert ttft_quantile(below, 90) > 0.2  # one fewer misses
    assert answer.overloaded_by_replicas[1]


def test_sizing_says_none_when_the_largest_count_misses():
    config = SimulationConfig(num_blocks=400, cost=COST)
    answer = fewest_replicas(_overloading_trace(), config, slo_s=0.001, percentile=50, max_replicas=3)
    assert answer.replicas is None and sorted(answer.ttft_by_replicas) == [1, 2, 3]


@pytest.mark.parametrize(("slo", "percentile", "fragment"), [(0, 90, "objective"), (1, 100, "percentile")])
def test_sizing_refuses_bad_objectives(slo, percentile, fragment):
    with pytest.raises(ConfigError, match=fragment):
        fewest_replicas([], SimulationConfig(num_blocks=10), slo_s=slo, percentile=percentile)


def test_requests_arriving_together_reach_a_woken_replica_one_step_apart():
    """A live server begins its step with the first request; the second one, a moment later, waits for the next."""
    pair = [TraceRequest.create(name, 0.0, (UniqueSegment(length=1000),), 1) for name in ("a", "b")]
    result = simulate(pair, SimulationConfig(num_blocks=400, cost=COST))
    ttft = {f.request_id: f.ttft_s for f in result.request_figures}
    assert ttft["a"] == pytest.approx(0.01 + 1000 * 0.0001)  # its step alone
    assert ttft["b"] == pytest.approx(2 * (0.01 + 1000 * 0.0001))  # the next one
