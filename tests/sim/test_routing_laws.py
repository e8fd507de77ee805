"""The figure laws in the simulator: expected-ttft and the threshold gate over each replica's own state."""

from __future__ import annotations

from kvpool.cost_model import CostProfile
from kvpool.routing import Routing
from kvpool.sim.simulator import SimulationConfig, SimulationResult, simulate
from kvpool.sim.traces import SharedSegment, TraceRequest, UniqueSegment

COST = CostProfile.flat(step_overhead_s=0.01, prefill_s_per_token=0.0001, decode_s_per_seq=0.0005)


def conversations(num_prompts: int, per_prompt: int, gap_ms: float, *, prompt_tokens: int = 256) -> list[TraceRequest]:
    trace = []
    for turn in range(per_prompt):
        for p in range(num_prompts):
            i = turn * num_prompts + p
            segments = (SharedSegment(name=f"system{p}", length=prompt_tokens), UniqueSegment(length=24))
            trace.append(TraceRequest.create(f"r{i}", i * gap_ms, segments, 2))
    return trace


def run(trace: list[TraceRequest], replicas: int, routing: Routing) -> SimulationResult:
    return simulate(trace, SimulationConfig(num_blocks=400, cost=COST, replicas=replicas, routing=routing))


def test_expected_ttft_computes_each_system_prompt_once_when_arrivals_are_far_apart() -> None:
    trace = conversations(4, 6, 1000.0)
    for rule in (Routing.EXPECTED_TTFT, Routing.THRESHOLD):
        result = run(trace, 3, rule)
        assert result.hit_tokens == 4 * 5 * 256, rule  # every follow-up hits its whole prompt
        assert min(r.requests for r in result.per_replica) > 0, rule  # and the prompts spread
        assert result.routing == rule.value


def test_expected_ttft_copies_a_hot_prompt_where_the_threshold_gate_queues_it_all_on_one_replica() -> None:
    """One long shared prompt, a request every 5 ms (each prefill takes about 0.2 s): a queue builds fast."""
    trace = conversations(1, 40, 5.0, prompt_tokens=2048)
    ttft = run(trace, 4, Routing.EXPECTED_TTFT)
    gate = run(trace, 4, Routing.THRESHOLD)
    assert sorted(r.requests for r in gate.per_replica) == [0, 0, 0, 40]  # the match always wins the gate
    assert max(r.requests for r in ttft.per_replica) <= 12  # the prompt copied to every replica
    assert ttft.ttft_p90_s < gate.ttft_p90_s
