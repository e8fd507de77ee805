"""Tenants share the scheduler fairly: the batch, the KV pool and each step's token budget (kvpool.fair_share)."""

from __future__ import annotations

import math
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool import KVCacheManager, Request
from kvpool.errors import ConfigError
from kvpool.fair_share import StepShares, TenantWeights, split_budget
from kvpool.scheduler import FinishReason, Scheduler, SchedulerConfig, SchedulerOutput, StopConditions


def _scheduler(num_blocks: int = 64, *, block_size: int = 4, seqs: int = 8, budget: int = 64, weights=None):
    manager = KVCacheManager(num_blocks, block_size, max_model_len=200)
    config = SchedulerConfig(
        max_num_batched_tokens=budget,
        max_num_seqs=seqs,
        max_model_len=200,
        tenant_weights=weights if weights is not None else TenantWeights(),
    )
    return Scheduler(manager, config, clock=lambda: 0.0)


def _step(scheduler: Scheduler) -> tuple[SchedulerOutput, list]:
    output = scheduler.schedule()
    sampled = {c.request_id: 7 for c in output.chunks if c.sample and c.request_id in scheduler.running_ids()}
    finished = scheduler.update(output, sampled)
    scheduler.manager.check_invariants()
    return output, finished


def _add(scheduler: Scheduler, rid: str, tenant: str | None, prompt: int, max_tokens: int, base: int = 0) -> None:
    tokens = [base + (hash((rid, i)) % 30000) for i in range(prompt)]
    scheduler.add_request(Request(rid, tokens), StopConditions(max_tokens=max_tokens), tenant=tenant)


def test_a_tenant_that_holds_the_whole_pool_does_not_stall_another_tenants_first_request() -> None:
    """The hostile case of issue 25: one tenant's long sequences fill the batch and the pool; another
    tenant's short request still finishes within a few steps instead of after all of them."""
    s = _scheduler(num_blocks=64, seqs=8)
    for i in range(8):  # each runs to 180 tokens: together far more than the pool's 252
        _add(s, f"m{i}", "mallory", 4, 176, base=i * 1000)
    for _ in range(30):
        _step(s)
    assert s.num_running >= 4 and s.num_waiting == 8 - s.num_running  # mallory holds the pool
    _add(s, "alice", "alice", 4, 2)
    steps = 0
    while True:
        steps += 1
        _, finished = _step(s)
        if any(m.request_id == "alice" for m in finished):
            break
        assert steps < 10, "alice's request did not finish within 9 steps"
    assert s.metrics("alice").finish_reason is FinishReason.LENGTH
    assert steps <= 4


def test_the_same_requests_without_tenants_wait_first_come_first_served() -> None:
    """The control: with one tenant the short request waits behind the long ones, as vLLM decides."""
    s = _scheduler(num_blocks=64, seqs=8)
    for i in range(8):
        _add(s, f"m{i}", None, 4, 176, base=i * 1000)
    for _ in range(30):
        _step(s)
    _add(s, "alice", None, 4, 2)
    for _ in range(9):
        _step(s)
    assert s.metrics("alice").finish_time is None


@given(
    st.lists(
        st.tuples(st.sampled_from(["a", "b", "c"]), st.integers(1, 40), st.integers(1, 40), st.integers(0, 3)),
        min_size=1,
        max_size=24,
    )
)
@settings(max_examples=60, deadline=None)
def test_one_named_tenant_makes_the_decisions_of_no_tenant(requests) -> None:
    """Naming one tenant for every request changes no decision: fairness only acts between tenants."""
    plans = []
    for tenant in (None, "solo"):
        s = _scheduler(num_blocks=48, seqs=4, budget=32)
        trace = []
        pending = list(enumerate(requests))
        step = 0
        while pending or s.has_unfinished_requests():
            while pending and pending[0][1][3] <= step % 4:
                i, (_, prompt, out, _) = pending.pop(0)
                _add(s, f"r{i}", tenant, prompt, out)
            if not s.has_unfinished_requests():
                step += 1
                continue
            output, _ = _step(s)
            trace.append(([(c.request_id, c.start_position, c.num_tokens) for c in output.chunks], output.preempted))
            step += 1
            assert step < 5000
        plans.append(trace)
    assert plans[0] == plans[1]


@given(
    st.lists(
        st.tuples(st.sampled_from(["a", "b", "c"]), st.integers(1, 60), st.integers(1, 60), st.booleans()),
        min_size=1,
        max_size=30,
    ),
    st.sampled_from([None, {"a": 3.0}, {"b": 0.5, "c": 2}]),
)
@settings(max_examples=80, deadline=None)
def test_every_request_of_every_tenant_finishes_and_the_pool_stays_whole(requests, weights) -> None:
    """Between tenants (weighted or not): the invariants hold after every step, every request finishes,
    and once all are done no block is owned."""
    s = _scheduler(num_blocks=40, seqs=4, budget=24, weights=TenantWeights(weights or {}))
    pending = list(enumerate(requests))
    steps = 0
    while pending or s.has_unfinished_requests():
        if pending:
            i, (tenant, prompt, out, later) = pending.pop(0)
            _add(s, f"r{i}", tenant, prompt, out)
            if later and pending:  # two at once
                i, (tenant, prompt, out, _) = pending.pop(0)
                _add(s, f"r{i}", tenant, prompt, out)
        output, _ = _step(s)
        assert output.num_batched_tokens <= 24
        steps += 1
        assert steps < 20_000, "a request starved"
    for i in range(len(requests)):
        assert s.metrics(f"r{i}").status.value == "finished"
    assert s.manager.num_free_blocks == 39


def test_a_steps_budget_is_split_between_the_tenants_with_work() -> None:
    """Two long prompts of two tenants: each step gives each tenant half the budget, not all to the first."""
    s = _scheduler(num_blocks=128, budget=64)
    _add(s, "a", "a", 150, 1)
    _add(s, "b", "b", 150, 1)
    output, _ = _step(s)
    assert {c.request_id: c.num_tokens for c in output.chunks} == {"a": 32, "b": 32}
    solo = _scheduler(num_blocks=128, budget=64)
    _add(solo, "a", "a", 150, 1)
    _add(solo, "b", "a", 150, 1)
    output, _ = _step(solo)
    assert {c.request_id: c.num_tokens for c in output.chunks} == {"a": 64}


def test_weights_divide_the_batch() -> None:
    """With the batch full, a tenant of weight 3 runs three sequences for every one of a tenant of weight 1."""
    s = _scheduler(num_blocks=400, seqs=8, budget=64, weights=TenantWeights({"big": 3}))
    for i in range(12):
        _add(s, f"big{i}", "big", 2, 100, base=i * 100)
        _add(s, f"small{i}", "small", 2, 100, base=50_000 + i * 100)
    for _ in range(5):
        _step(s)
    running = Counter(s.tenant_of(rid) for rid in s.running_ids())
    assert running == {"big": 6, "small": 2}


def test_a_tenant_over_its_share_is_preempted_first_when_blocks_run_out() -> None:
    s = _scheduler(num_blocks=24, seqs=8, budget=64)
    _add(s, "a0", "a", 4, 60)
    _add(s, "b0", "b", 4, 60, base=1000)
    _add(s, "b1", "b", 4, 60, base=2000)
    _add(s, "b2", "b", 4, 60, base=3000)
    preempted = []
    for _ in range(40):
        output, _ = _step(s)
        preempted.extend(output.preempted)
    assert preempted and all(rid.startswith("b") for rid in preempted)
    assert s.metrics("a0").num_preemptions == 0


def test_the_waiting_count_per_tenant() -> None:
    s = _scheduler()
    _add(s, "a0", "a", 4, 4)
    _add(s, "a1", "a", 4, 4)
    _add(s, "b0", "b", 4, 4)
    assert (s.num_waiting_for("a"), s.num_waiting_for("b"), s.num_waiting_for("c")) == (2, 1, 0)
    assert s.tenant_of("b0") == "b"


@pytest.mark.parametrize("tenant", ["", 3, b"a", True])
def test_a_bad_tenant_is_refused_and_nothing_is_queued(tenant) -> None:
    s = _scheduler()
    with pytest.raises(ConfigError, match="tenant"):
        s.add_request(Request("x", [1, 2]), StopConditions(), tenant=tenant)
    assert not s.has_unfinished_requests()


@pytest.mark.parametrize("weight", [0, -1, math.nan, math.inf, True, "2", None, 1e9])
def test_bad_weights_are_refused_by_name(weight) -> None:
    with pytest.raises(ConfigError, match="alice"):
        TenantWeights({"alice": weight})
    with pytest.raises(ConfigError, match="default"):
        TenantWeights(default=weight)


def test_bad_weight_mappings_are_refused() -> None:
    with pytest.raises(ConfigError):
        TenantWeights([("a", 1)])  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="tenant name"):
        TenantWeights({"": 1})
    with pytest.raises(ConfigError, match="tenant_weights"):
        SchedulerConfig(tenant_weights={"a": 1})  # type: ignore[arg-type]


def test_split_budget_never_hands_out_more_than_the_budget() -> None:
    parts = split_budget(100, {"a": 1.0, "b": 1.0, "c": 1.0})
    assert parts == {"a": 33, "b": 33, "c": 33}
    assert split_budget(100, {"a": 3.0, None: 1.0}) == {"a": 75, None: 25}


def test_a_tenant_that_would_go_over_its_share_preempts_nobody() -> None:
    shares = StepShares(TenantWeights(), ["a", "b"], [("b", 100)] * 4, max_seqs=4, pool_tokens=1000, budget=10)
    assert shares.victim("a", 10) == "b"  # b holds the whole batch
    assert shares.victim("a", 600) is None  # a would hold more than half the pool
