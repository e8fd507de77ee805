"""Synthetic workloads: determinism, structure of each kind, arrivals, configuration errors."""

from __future__ import annotations

import statistics
from dataclasses import replace

import pytest

from kvpool.errors import ConfigError
from kvpool.sim.traces import OutputSegment, SharedSegment, TraceRequest, UniqueSegment
from kvpool.sim.workloads import WorkloadConfig, WorkloadKind, generate_workload


def _by_id(reqs: list[TraceRequest]) -> dict[str, TraceRequest]:
    return {r.request_id: r for r in reqs}


@pytest.mark.parametrize("kind", list(WorkloadKind))
def test_deterministic_for_a_seed(kind: WorkloadKind) -> None:
    a = generate_workload(kind, num_requests=150, seed=42)
    b = generate_workload(kind.value, num_requests=150, seed=42)
    c = generate_workload(kind, num_requests=150, seed=43)
    assert a == b
    assert [r.prompt_token_ids() for r in a[:20]] == [r.prompt_token_ids() for r in b[:20]]
    assert [r.segments for r in a] != [r.segments for r in c]
    assert generate_workload(kind, num_requests=60, seed=42) == a[:60]  # a prefix of a longer run


@pytest.mark.parametrize("kind", list(WorkloadKind))
def test_common_invariants(kind: WorkloadKind) -> None:
    cfg = WorkloadConfig()
    reqs = generate_workload(kind, num_requests=400, seed=1)
    assert len(reqs) == 400 and len({r.request_id for r in reqs}) == 400
    assert all(r.request_id == f"{kind.value}/1/{i:06d}" for i, r in enumerate(reqs))
    arrivals = [r.arrival_ms for r in reqs]
    assert arrivals == sorted(arrivals) and arrivals[0] >= 0
    seen: dict[str, TraceRequest] = {}
    for r in reqs:
        if r.follows is not None:
            prev = seen[r.follows]  # the turn it extends came earlier
            k = len(prev.segments)
            assert r.segments[:k] == prev.segments
            assert r.segments[k] == OutputSegment(prev.request_id, prev.output_length)
            assert r.prompt_length <= cfg.max_context_tokens
            assert (r.cache_salt, r.lora_name) == (prev.cache_salt, prev.lora_name)
        seen[r.request_id] = r
    for r in reqs[::40]:
        assert len(r.prompt_token_ids()) == r.prompt_length and len(r.output_token_ids()) == r.output_length


def test_shared_prefix_reuses_a_few_system_prompts() -> None:
    reqs = generate_workload(WorkloadKind.SHARED_PREFIX, num_requests=300, seed=2)
    heads = [r.segments[0] for r in reqs]
    assert all(isinstance(h, SharedSegment) and 500 <= h.length <= 2000 for h in heads)
    names = {h.name: h.length for h in heads}
    assert 2 <= len(names) <= 4 and all(n.startswith("s2/system-") for n in names)
    assert all(names[h.name] == h.length for h in heads)  # one fixed length per prompt
    counts = [sum(h.name == f"s2/system-{k}" for h in heads) for k in range(4)]
    assert counts[0] == max(counts)  # Zipf: the first prompt is the most popular
    for r in reqs:
        assert isinstance(r.segments[1], UniqueSegment) and 50 <= r.segments[1].length <= 500
    assert all(r.follows is None and r.cache_salt is None for r in reqs)
    a, b = [r for r in reqs if r.segments[0].name == "s2/system-0"][:2]
    n = names["s2/system-0"]
    assert a.prompt_token_ids()[:n] == b.prompt_token_ids()[:n]
    assert a.prompt_token_ids()[n : n + 16] != b.prompt_token_ids()[n : n + 16]


def test_multi_turn_sessions_grow_and_interleave() -> None:
    reqs = generate_workload(WorkloadKind.MULTI_TURN, num_requests=300, seed=3, turns=(3, 5))
    by_id = _by_id(reqs)
    depth: dict[str, int] = {}
    for r in reqs:
        depth[r.request_id] = 1 + depth[r.follows] if r.follows else 1
        if r.follows:
            prev = by_id[r.follows]
            assert r.prompt_token_ids()[: prev.prompt_length + prev.output_length] == (
                prev.prompt_token_ids() + prev.output_token_ids()
            )
    assert max(depth.values()) == 5 and sum(d > 1 for d in depth.values()) > 150
    chains_open = [i for i, r in enumerate(reqs) if r.follows and reqs[i - 1].request_id != r.follows]
    assert len(chains_open) > 100  # turns of different sessions interleave


def test_agent_contexts_grow_by_tool_output() -> None:
    cfg = WorkloadConfig()
    reqs = generate_workload(WorkloadKind.AGENT, num_requests=300, seed=4)
    followers = [r for r in reqs if r.follows]
    assert len(followers) > 200
    for r in reqs:
        assert cfg.agent_output_tokens[0] <= r.output_length <= cfg.agent_output_tokens[1]
        if r.follows is None:
            assert r.segments[0].name.startswith("s4/agent-") and 1000 <= r.segments[0].length <= 3000
        else:
            tool = r.segments[-1]
            assert isinstance(tool, UniqueSegment) and 100 <= tool.length <= 1500
    longest = max(r.prompt_length for r in reqs)
    assert longest > 8000


def test_multi_tenant_salts_and_optional_lora() -> None:
    reqs = generate_workload(WorkloadKind.MULTI_TENANT, num_requests=400, seed=5)
    salts = {r.cache_salt for r in reqs}
    assert salts == {f"s5-tenant-{t}" for t in range(4)}
    heads = {(r.cache_salt, r.segments[0].name) for r in reqs}
    shared_names = {name for _, name in heads}
    assert any(sum((s, n) in heads for s in salts) > 1 for n in shared_names)  # same prompt, several tenants
    assert all(r.lora_name is None for r in reqs)
    lora = generate_workload(WorkloadKind.MULTI_TENANT, num_requests=100, seed=5, tenant_lora=True, num_tenants=2)
    assert {(r.cache_salt, r.lora_name) for r in lora} == {(f"s5-tenant-{t}", f"tenant-{t}-adapter") for t in range(2)}


def test_mixed_draws_from_every_kind() -> None:
    reqs = generate_workload(WorkloadKind.MIXED, num_requests=600, seed=6)
    heads = {r.segments[0].name.split("/")[1].split("-")[0] for r in reqs}
    assert heads == {"system", "agent"}
    assert any(r.cache_salt for r in reqs) and any(r.cache_salt is None for r in reqs)
    assert any(r.follows for r in reqs)
    only_agents = generate_workload(
        "mixed", num_requests=50, seed=6, mixed_weights=((WorkloadKind.AGENT, 1.0), (WorkloadKind.MULTI_TURN, 0.0))
    )
    assert all(r.segments[0].name.startswith("s6/agent-") for r in only_agents)


def test_poisson_arrivals_at_the_configured_rate() -> None:
    reqs = generate_workload(WorkloadKind.SHARED_PREFIX, num_requests=5000, seed=7, rate_per_s=20.0)
    times = [0.0] + [r.arrival_ms for r in reqs]
    gaps = [b - a for a, b in zip(times, times[1:])]
    mean = statistics.fmean(gaps)
    assert mean == pytest.approx(50.0, rel=0.05)
    assert statistics.pstdev(gaps) == pytest.approx(mean, rel=0.08)  # exponential: sd == mean
    faster = generate_workload(WorkloadKind.SHARED_PREFIX, num_requests=5000, seed=7, rate_per_s=40.0)
    assert [r.segments for r in faster] == [r.segments for r in reqs]  # content does not depend on the rate
    assert faster[-1].arrival_ms == pytest.approx(reqs[-1].arrival_ms / 2)


def test_config_object_and_overrides() -> None:
    cfg = replace(WorkloadConfig(), system_prompt_tokens=(100, 100), num_system_prompts=1)
    reqs = generate_workload(WorkloadKind.SHARED_PREFIX, num_requests=20, seed=8, config=cfg, user_tokens=(0, 0))
    assert {r.prompt_length for r in reqs} == {100}
    assert generate_workload("agent", num_requests=0, seed=8) == []


@pytest.mark.parametrize(
    ("kwargs", "text"),
    [
        ({"kind": "chatbot"}, "unknown workload kind 'chatbot'"),
        ({"num_requests": -1}, "num_requests"),
        ({"num_requests": 2.0}, "num_requests"),
        ({"seed": "1"}, "seed"),
        ({"rate_per_s": 0}, "rate_per_s"),
        ({"rate_per_s": float("inf")}, "rate_per_s"),
        ({"turns": (0, 3)}, "turns"),
        ({"user_tokens": (9, 3)}, "user_tokens"),
        ({"system_prompt_tokens": [500, 2000]}, "system_prompt_tokens"),
        ({"num_tenants": 0}, "num_tenants"),
        ({"prompt_skew": -1.0}, "prompt_skew"),
        ({"mixed_weights": ((WorkloadKind.MIXED, 1.0),)}, "mixed_weights"),
        ({"mixed_weights": ((WorkloadKind.AGENT, 0.0),)}, "mixed_weights"),
        ({"mixed_weights": ((WorkloadKind.AGENT, 1.0), (WorkloadKind.AGENT, 1.0))}, "mixed_weights"),
        ({"colour": "red"}, "unknown workload setting(s) ['colour']"),
    ],
)
def test_bad_arguments_raise_config_error(kwargs: dict, text: str) -> None:
    args = {"kind": WorkloadKind.MIXED, "num_requests": 5, "seed": 1, **kwargs}
    with pytest.raises(ConfigError) as info:
        generate_workload(args.pop("kind"), **args)
    assert text in str(info.value)
