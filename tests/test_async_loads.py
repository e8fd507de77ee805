"""Asynchronous loads in the scheduler: a request waits for its KV holding uncached blocks; the batch steps on.

A fake connector offers, asynchronously, every whole block past the local hit
of a request whose prompt starts with LOADED; the test plays the worker and
reports loads done, failed part-way, or never (the request is aborted). The
Hypothesis machine checks the pool's invariants, and that nobody can find a
block whose KV has not arrived, after every operation, on whichever build
(pure or compiled) is installed.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvpool import ConfigError, KVCacheManager, Request, RequestStateError
from kvpool.connector import NO_MATCH, PENDING, ConnectorMetadata, ExternalMatch, TierRun, TransferResult
from kvpool.scheduler import RequestStatus, Scheduler, SchedulerConfig, StopConditions

BS = 4
LOADED = 7  # a prompt starting with this token is offered by the fake tier


class AsyncTier:
    """A connector whose one tier holds every block of the prompts that start with LOADED."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.admitted: dict[str, int] = {}  # request -> tokens promised

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> ExternalMatch:
        bs = self.block_size
        if request.all_token_ids[0] != LOADED or num_computed_tokens % bs:
            return NO_MATCH
        tokens = (request.num_tokens - 1) // bs * bs - num_computed_tokens
        return ExternalMatch((TierRun("disk", tokens),), asynchronous=True) if tokens > 0 else NO_MATCH

    def update_state_after_alloc(
        self, request: Request, block_ids: Sequence[int], num_local_tokens: int, match: ExternalMatch
    ) -> None:
        self.admitted[request.request_id] = num_local_tokens + match.num_tokens

    def build_meta(self, scheduled) -> ConnectorMetadata:
        return ConnectorMetadata()

    def update_finished(self, result: TransferResult) -> None:
        pass

    def request_finished(self, request: Request, block_ids: Sequence[int]) -> bool:
        return False


def setup(num_blocks: int = 64, budget: int = 64):
    manager = KVCacheManager(num_blocks, BS)
    tier = AsyncTier(BS)
    scheduler = Scheduler(manager, SchedulerConfig(max_num_batched_tokens=budget), connector=tier)
    return manager, tier, scheduler


def step(scheduler: Scheduler) -> list[str]:
    """One step; every sampling request gets token 1. The requests that were in it."""
    plan = scheduler.schedule()
    scheduler.update(plan, {c.request_id: 1 for c in plan.chunks if c.sample})
    return [c.request_id for c in plan.chunks]


def uncached_past_hit(manager: KVCacheManager, rid: str, hit_tokens: int) -> bool:
    table = manager.groups[0].tables.get(rid, [])
    return all(block.block_hash is None for block in table[hit_tokens // BS :])


def test_a_loading_request_holds_uncached_blocks_while_another_runs():
    manager, tier, scheduler = setup()
    loaded = Request("loaded", [LOADED, *range(1, 17)])  # 17 tokens: 16 loadable
    other = Request("other", list(range(100, 110)))
    scheduler.add_request(loaded, StopConditions(max_tokens=2))
    scheduler.add_request(other, StopConditions(max_tokens=2))
    assert step(scheduler) == ["other"]  # admitted to load; nothing of it computed
    assert scheduler.request("loaded") is loaded and scheduler.num_loading == 1
    assert len(manager.get_block_ids("loaded")[0]) == 4 and uncached_past_hit(manager, "loaded", 0)
    twin = Request("twin", [LOADED, *range(1, 17)])  # the same prompt finds nothing of the loading one
    assert manager.get_computed_blocks(twin)[1] == 0
    while scheduler.metrics("other").finish_reason is None:
        step(scheduler)
    assert scheduler.num_loading == 1 and loaded.num_computed_tokens == 16
    scheduler.take_transfers(TransferResult(finished_loads=frozenset({"loaded"})))
    assert scheduler.num_loading == 0 and not uncached_past_hit(manager, "loaded", 0)
    plan = scheduler.schedule()
    (chunk,) = plan.chunks
    assert (chunk.request_id, chunk.start_position, chunk.num_tokens, chunk.num_cached_tokens) == ("loaded", 16, 1, 16)
    scheduler.update(plan, {"loaded": 1})
    assert scheduler.metrics("loaded").cached_tokens_by_tier == {"gpu": 0, "disk": 16}
    manager.check_invariants()


def test_a_load_that_failed_part_way_computes_the_rest():
    manager, tier, scheduler = setup()
    loaded = Request("loaded", [LOADED, *range(1, 17)])
    scheduler.add_request(loaded, StopConditions(max_tokens=1))
    step(scheduler)
    scheduler.take_transfers(TransferResult(finished_loads=frozenset({"loaded"}), failed_loads={"loaded": 8}))
    plan = scheduler.schedule()
    (chunk,) = plan.chunks
    assert (chunk.start_position, chunk.num_tokens) == (8, 9)
    scheduler.update(plan, {"loaded": 1})
    metrics = scheduler.metrics("loaded")
    assert metrics.cached_tokens_by_tier == {"gpu": 0, "disk": 8} and metrics.finish_reason is not None
    manager.check_invariants()


@pytest.mark.parametrize("valid", [-4, 12.0, 20, None, True])
def test_a_report_out_of_range_is_refused_and_changes_nothing(valid):
    manager, tier, scheduler = setup()
    scheduler.add_request(Request("loaded", [LOADED, *range(1, 17)]), StopConditions(max_tokens=1))
    step(scheduler)
    before = (scheduler.num_loading, manager.num_free_blocks, manager.get_block_ids("loaded"))
    with pytest.raises(RequestStateError, match="loaded"):
        scheduler.take_transfers(TransferResult(finished_loads=frozenset({"loaded"}), failed_loads={"loaded": valid}))
    assert (scheduler.num_loading, manager.num_free_blocks, manager.get_block_ids("loaded")) == before
    assert uncached_past_hit(manager, "loaded", 0)


def test_take_transfers_is_refused_while_a_step_is_in_flight():
    manager, tier, scheduler = setup()
    scheduler.add_request(Request("r", list(range(100, 110))), StopConditions(max_tokens=2))
    plan = scheduler.schedule()
    with pytest.raises(RequestStateError, match="apply_transfers"):
        scheduler.take_transfers(TransferResult())
    with pytest.raises(RequestStateError, match="TransferResult"):
        scheduler.take_transfers({"finished_loads": ()})  # type: ignore[arg-type]
    scheduler.update(plan, {"r": 1})
    scheduler.take_transfers(TransferResult())  # between steps: taken


def test_an_aborted_loading_request_keeps_its_blocks_until_its_load_is_reported():
    manager, tier, scheduler = setup()
    free = manager.num_free_blocks
    scheduler.add_request(Request("loaded", [LOADED, *range(1, 17)]), StopConditions(max_tokens=1))
    step(scheduler)
    assert scheduler.abort("loaded")
    assert not scheduler.has_unfinished_requests() and manager.num_free_blocks == free - 4
    scheduler.take_transfers(TransferResult(finished_loads=frozenset({"loaded"})))
    assert manager.num_free_blocks == free
    manager.check_invariants()


class AsyncLoadMachine(RuleBasedStateMachine):
    """Requests, steps, load reports and aborts in any order; invariants after every one."""

    @initialize(num_blocks=st.integers(12, 40), budget=st.integers(4, 40))
    def start(self, num_blocks, budget):
        self.manager, self.tier, self.scheduler = setup(num_blocks, budget)
        self.count = 0

    @rule(loaded=st.booleans(), length=st.integers(2, 30), max_tokens=st.integers(1, 4))
    def add(self, loaded, length, max_tokens):
        rid = f"r{self.count}"
        self.count += 1
        first = LOADED if loaded else 50 + self.count
        self.scheduler.add_request(Request(rid, [first, *range(1, length)]), StopConditions(max_tokens=max_tokens))

    @rule()
    def one_step(self):
        if self.scheduler.num_waiting or self.scheduler.num_running:
            step(self.scheduler)

    @precondition(lambda self: self.scheduler.num_loading)
    @rule(data=st.data(), fails=st.booleans())
    def report(self, data, fails):
        rid = data.draw(st.sampled_from(sorted(self.scheduler._loading)))
        request = self.scheduler.request(rid)
        promised = self.tier.admitted[rid]
        failed = {}
        if fails:
            hit = promised - self.scheduler._loading[rid].loading[1].num_tokens
            failed[rid] = data.draw(st.integers(hit // BS, promised // BS)) * BS
        self.scheduler.take_transfers(TransferResult(finished_loads=frozenset({rid}), failed_loads=failed))
        assert request.num_computed_tokens == failed.get(rid, promised)

    @precondition(lambda self: self.count)
    @rule(data=st.data())
    def abort(self, data):
        self.scheduler.abort(f"r{data.draw(st.integers(0, self.count - 1))}")

    @invariant()
    def pool_is_sound(self):
        if not hasattr(self, "manager"):
            return
        self.manager.check_invariants()
        for rid, entry in self.scheduler._loading.items():
            assert entry.status is RequestStatus.WAITING_FOR_KV
            hit = self.tier.admitted[rid] - entry.loading[1].num_tokens
            assert uncached_past_hit(self.manager, rid, hit), rid
        assert self.scheduler.has_unfinished_requests() == bool(
            self.scheduler.num_waiting or self.scheduler.num_running or self.scheduler.num_loading
        )


AsyncLoadMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestAsyncLoads = AsyncLoadMachine.TestCase


class PendingTier(AsyncTier):
    """Answers PENDING for the requests named in ``unknown``."""

    def __init__(self, block_size: int) -> None:
        super().__init__(block_size)
        self.unknown: set[str] = set()

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> ExternalMatch:
        if request.request_id in self.unknown:
            return PENDING
        return super().get_num_new_matched_tokens(request, num_computed_tokens)


def test_a_request_whose_lookup_is_pending_is_skipped_and_keeps_its_place():
    manager = KVCacheManager(64, BS)
    tier = PendingTier(BS)
    scheduler = Scheduler(manager, SchedulerConfig(max_num_batched_tokens=64), connector=tier)
    tier.unknown = {"first"}
    scheduler.add_request(Request("first", list(range(100, 110))), StopConditions(max_tokens=1))
    scheduler.add_request(Request("second", list(range(200, 210))), StopConditions(max_tokens=1))
    assert step(scheduler) == ["second"]
    assert [e.request.request_id for e in scheduler.waiting] == ["first"]
    tier.unknown = set()
    assert step(scheduler) == ["first"]
    manager.check_invariants()


def test_a_pending_answer_with_runs_is_refused():
    manager = KVCacheManager(64, BS)
    tier = PendingTier(BS)
    tier.get_num_new_matched_tokens = lambda r, n: ExternalMatch((TierRun("disk", 4),), pending=True)
    scheduler = Scheduler(manager, SchedulerConfig(), connector=tier)
    scheduler.add_request(Request("r", [LOADED, *range(1, 17)]), StopConditions(max_tokens=1))
    with pytest.raises(ConfigError, match="pending"):
        scheduler.schedule()
    assert manager.get_block_ids("r") == ([],) and scheduler.num_waiting == 1
