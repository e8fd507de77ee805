"""The continuous-batching scheduler: budgets, chunked prefill, preemption, stops, figures."""

from __future__ import annotations

import random

import pytest

from kvpool import CapacityError, ConfigError, KVCacheManager, Request, RequestStateError
from kvpool.scheduler import (
    ChunkDetail,
    FinishReason,
    RequestStatus,
    Scheduler,
    SchedulerConfig,
    StopConditions,
    run_to_completion,
    sample_from,
)


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make(num_blocks=64, block_size=4, **config) -> tuple[Scheduler, FakeClock]:
    clock = FakeClock()
    mgr = KVCacheManager(num_blocks, block_size)
    return Scheduler(mgr, SchedulerConfig(**config), clock=clock), clock


def step(scheduler: Scheduler, token: int = 7):
    out = scheduler.schedule()
    finished = scheduler.update(out, {c.request_id: token for c in out.chunks if c.sample})
    scheduler.manager.check_invariants()
    return out, finished


def test_chunked_prefill_splits_a_long_prompt_under_the_budget():
    sched, _ = make(max_num_batched_tokens=8)
    sched.add_request(Request("a", list(range(20))), StopConditions(max_tokens=2))
    sizes = []
    for _ in range(3):
        out, _ = step(sched)
        (chunk,) = out.chunks
        sizes.append((chunk.start_position, chunk.num_tokens, chunk.sample))
    assert sizes == [(0, 8, False), (8, 8, False), (16, 4, True)]
    assert sched.request("a").num_output_tokens == 1


def test_decodes_are_scheduled_before_new_prefills():
    sched, _ = make(max_num_batched_tokens=10)
    sched.add_request(Request("a", list(range(6))), StopConditions(max_tokens=5))
    step(sched)
    sched.add_request(Request("b", list(range(50, 70))), StopConditions(max_tokens=5))
    out, _ = step(sched)
    assert [(c.request_id, c.num_tokens) for c in out.chunks] == [("a", 1), ("b", 9)]
    assert out.num_batched_tokens == 10


def test_chunks_carry_block_tables_and_slot_mapping():
    sched, _ = make(block_size=4)
    sched.add_request(Request("a", list(range(10))), StopConditions(max_tokens=3))
    out, _ = step(sched)
    (chunk,) = out.chunks
    assert chunk.block_tables == ((1, 2, 3),)
    assert chunk.slot_mapping == ((4, 5, 6, 7, 8, 9, 10, 11, 12, 13),)
    assert list(chunk.positions) == list(range(10)) and chunk.token_ids == tuple(range(10))
    out, _ = step(sched)
    (chunk,) = out.chunks
    assert chunk.token_ids == (7,) and chunk.start_position == 10
    assert chunk.slot_mapping == ((3 * 4 + 2,),)


def test_prefix_hits_skip_computation_and_are_reported():
    sched, _ = make(block_size=4)
    shared = list(range(100, 116))
    sched.add_request(Request("a", shared + [1, 2]), StopConditions(max_tokens=1))
    step(sched)
    sched.add_request(Request("b", shared + [3, 4, 5]), StopConditions(max_tokens=1))
    out, finished = step(sched)
    (chunk,) = out.chunks
    assert chunk.start_position == 16 and chunk.num_tokens == 3 and chunk.num_cached_tokens == 16
    (b,) = finished
    assert b.num_cached_tokens == 16 and b.num_computed_tokens == 3


def test_preemption_frees_the_newest_and_recomputes_it_later():
    # 6 usable blocks of 4 tokens; two requests of 8 tokens each need 2 blocks,
    # and growing both past 12 tokens needs more than the pool has.
    sched, _ = make(num_blocks=7, block_size=4)
    sched.add_request(Request("old", list(range(8))), StopConditions(max_tokens=12))
    sched.add_request(Request("new", list(range(50, 58))), StopConditions(max_tokens=12))
    preempted = []
    for _ in range(40):
        if not sched.has_unfinished_requests():
            break
        out, _ = step(sched)
        preempted += out.preempted
    assert preempted and set(preempted) == {"new"}
    old, new = sched.metrics("old"), sched.metrics("new")
    assert old.num_preemptions == 0 and new.num_preemptions == len(preempted)
    assert old.status is new.status is RequestStatus.FINISHED
    assert old.num_output_tokens == new.num_output_tokens == 12
    assert new.num_cached_tokens > 0  # the recompute found part of its own prefix
    assert sched.manager.num_free_blocks == 6


def test_a_request_that_can_never_fit_is_refused_at_once():
    sched, _ = make(num_blocks=5, block_size=4)  # 16 token slots
    with pytest.raises(CapacityError, match="need 5 blocks; the pool has 4 usable"):
        sched.add_request(Request("big", list(range(12))), StopConditions(max_tokens=8))
    assert not sched.has_unfinished_requests()


@pytest.mark.parametrize(
    ("stop", "expected_reason", "expected_outputs"),
    [
        (StopConditions(max_tokens=3), FinishReason.LENGTH, 3),
        (StopConditions(max_tokens=9, stop_token_ids={7}), FinishReason.STOP, 1),
        (StopConditions(max_tokens=9, eos_token_id=7), FinishReason.EOS, 1),
        (StopConditions(max_tokens=4, eos_token_id=7, ignore_eos=True), FinishReason.LENGTH, 4),
    ],
)
def test_stop_conditions(stop, expected_reason, expected_outputs):
    sched, _ = make()
    sched.add_request(Request("a", [1, 2, 3]), stop)
    finished = []
    while sched.has_unfinished_requests():
        finished += step(sched)[1]
    (metrics,) = finished
    assert metrics.finish_reason is expected_reason
    assert metrics.num_output_tokens == expected_outputs


def test_max_model_len_stops_generation_and_rejects_long_prompts():
    clock = FakeClock()
    sched = Scheduler(KVCacheManager(64, 4, max_model_len=6), SchedulerConfig(max_model_len=6), clock=clock)
    with pytest.raises(RequestStateError, match="max_model_len=6"):
        sched.add_request(Request("long", list(range(6))), StopConditions(max_tokens=1))
    sched.add_request(Request("a", [1, 2, 3, 4]), StopConditions(max_tokens=50))
    finished = []
    while sched.has_unfinished_requests():
        finished += step(sched)[1]
    assert finished[0].finish_reason is FinishReason.LENGTH
    assert sched.request("a").num_tokens == 6


def test_queue_time_and_time_to_first_token_follow_the_clock():
    sched, clock = make(max_num_seqs=1)
    sched.add_request(Request("a", [1, 2, 3]), StopConditions(max_tokens=2), arrival_time=0.0)
    sched.add_request(Request("b", [4, 5, 6]), StopConditions(max_tokens=1), arrival_time=0.5)
    clock.now = 1.0
    step(sched)  # a prefills, samples its first token
    clock.now = 2.0
    step(sched)  # a finishes; b waits for the seat
    clock.now = 3.0
    step(sched)
    a, b = sched.metrics("a"), sched.metrics("b")
    assert (a.queue_time, a.time_to_first_token) == (1.0, 1.0)
    assert (b.queue_time, b.time_to_first_token) == (2.5, 2.5)


def test_abort_frees_blocks():
    sched, _ = make()
    sched.add_request(Request("a", list(range(10))), StopConditions(max_tokens=5))
    step(sched)
    sched.abort("a")
    assert sched.metrics("a").finish_reason is FinishReason.ABORTED
    assert sched.manager.num_free_blocks == 63
    assert not sched.has_unfinished_requests()


def test_bad_configuration_and_duplicates():
    with pytest.raises(ConfigError, match="max_num_batched_tokens must be a positive integer, got 0"):
        SchedulerConfig(max_num_batched_tokens=0)
    with pytest.raises(ConfigError, match="max_tokens must be a positive integer, got 0"):
        StopConditions(max_tokens=0)
    sched, _ = make()
    sched.add_request(Request("a", [1]), StopConditions())
    with pytest.raises(RequestStateError, match="already in the scheduler"):
        sched.add_request(Request("a", [2]), StopConditions())


@pytest.mark.parametrize("seed", range(25))
def test_random_workloads_finish_with_exact_outputs_under_pressure(seed):
    """Preemption and recompute never lose or duplicate a token."""
    rng = random.Random(seed)
    block_size = rng.choice([2, 4, 8])
    num_blocks = rng.randint(12, 40)
    mgr = KVCacheManager(num_blocks, block_size)
    sched = Scheduler(mgr, SchedulerConfig(max_num_batched_tokens=rng.randint(4, 40), max_num_seqs=rng.randint(1, 8)))
    prefixes = [[rng.randrange(9) for _ in range(rng.randint(0, 24))] for _ in range(3)]
    scripts = {}
    for i in range(rng.randint(3, 12)):
        prompt = rng.choice(prefixes) + [rng.randrange(9) for _ in range(rng.randint(1, 10))]
        max_tokens = rng.randint(1, 12)
        if -(-(len(prompt) + max_tokens) // block_size) > num_blocks - 1:
            continue
        rid = f"r{i}"
        scripts[rid] = [rng.randrange(50, 60) for _ in range(max_tokens)]
        sched.add_request(Request(rid, prompt), StopConditions(max_tokens=max_tokens))
    sampler = sample_from(scripts)

    def checked(output):
        mgr.check_invariants()
        return sampler(output)

    finished = run_to_completion(sched, checked)
    assert {m.request_id for m in finished} == set(scripts)
    for rid, script in scripts.items():
        assert list(sched.request(rid).output_token_ids) == script
    assert mgr.num_free_blocks == num_blocks - 1
    mgr.check_invariants()


def test_counts_only_chunks_make_the_same_decisions():
    def run(detail):
        mgr = KVCacheManager(20, 4)
        sched = Scheduler(mgr, SchedulerConfig(max_num_batched_tokens=9, chunk_detail=detail))
        for i in range(6):
            sched.add_request(Request(f"r{i}", list(range(i, i + 14))), StopConditions(max_tokens=6))
        plan = []
        while sched.has_unfinished_requests():
            out = sched.schedule()
            plan.append(
                [(c.request_id, c.start_position, c.num_tokens, c.sample) for c in out.chunks] + list(out.preempted)
            )
            sched.update(out, {c.request_id: 3 for c in out.chunks if c.sample})
            if detail is ChunkDetail.COUNTS:
                assert all(c.token_ids == () and c.block_tables == () for c in out.chunks)
        return plan

    assert run(ChunkDetail.FULL) == run(ChunkDetail.COUNTS)
