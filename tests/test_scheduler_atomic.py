"""Every public call of the scheduler is atomic: a refused call changes nothing, and serving goes on.

Each test puts a scheduler in the middle of its work (a request decoding, one
in chunked prefill, one waiting, one aborted, a plan in flight), makes one bad
call, compares a snapshot of everything observable with the one taken before,
and then runs every request to the end with exact outputs.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvpool import (
    CapacityError,
    ConfigError,
    InvalidTokenError,
    KVCacheManager,
    KVPoolError,
    Request,
    RequestStateError,
)
from kvpool.scheduler import (
    ChunkDetail,
    FinishReason,
    RequestStatus,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
    StopConditions,
    run_to_completion,
    sample_from,
)
from tests.helpers import snapshot as manager_snapshot


def token_for(rid: str, n: int) -> int:
    """The 'model': request ``rid``'s n-th output token."""
    return 50 + (sum(map(ord, rid)) + 7 * n) % 40


def sample(scheduler: Scheduler, output: SchedulerOutput) -> dict[str, int]:
    """Valid sampled tokens for a plan: one for each sampling chunk whose request still runs."""
    out = {}
    for chunk in output.chunks:
        if chunk.sample and scheduler.metrics(chunk.request_id).status is RequestStatus.RUNNING:
            out[chunk.request_id] = token_for(chunk.request_id, scheduler.request(chunk.request_id).num_output_tokens)
    return out


def scheduler_snapshot(scheduler: Scheduler) -> tuple:
    """Everything observable about a scheduler, its requests and its manager."""
    requests = {
        m.request_id: (
            m,
            scheduler.request(m.request_id).num_computed_tokens,
            list(scheduler.request(m.request_id).all_token_ids),
            list(scheduler.request(m.request_id).block_hashes),
        )
        for m in scheduler.all_metrics()
    }
    mgr = scheduler.manager
    mgr.check_invariants()
    return (
        scheduler.waiting_ids(),
        scheduler.running_ids(),
        scheduler.num_preemptions,
        requests,
        manager_snapshot(mgr),
        {rid: mgr.get_block_ids(rid) for rid in mgr.running_request_ids()},
    )


def finish_all(scheduler: Scheduler, pending: SchedulerOutput | None = None) -> None:
    """Apply ``pending`` (if given), run to the end, and check that every output is the scripted one."""
    if pending is not None:
        scheduler.update(pending, sample(scheduler, pending))
    while scheduler.has_unfinished_requests():
        output = scheduler.schedule()
        assert not output.is_empty
        scheduler.update(output, sample(scheduler, output))
        scheduler.manager.check_invariants()
    for m in scheduler.all_metrics():
        assert m.status is RequestStatus.FINISHED
        if m.finish_reason is not FinishReason.ABORTED:
            outputs = list(scheduler.request(m.request_id).output_token_ids)
            assert outputs == [token_for(m.request_id, n) for n in range(len(outputs))]
            assert m.finish_reason is FinishReason.LENGTH
    assert scheduler.manager.num_free_blocks == scheduler.manager.num_blocks - 1
    scheduler.manager.check_invariants()


@pytest.fixture
def busy():
    """A plan in flight: "r" prefills its 6 tokens (and samples), "long" is mid-prefill,
    "dead" was aborted after being scheduled, "w" waits. Returns (scheduler, output)."""
    mgr = KVCacheManager(40, 4)
    sched = Scheduler(mgr, SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=3))
    sched.add_request(Request("dead", list(range(200, 203))), StopConditions(max_tokens=4))
    sched.add_request(Request("r", list(range(100, 106))), StopConditions(max_tokens=4))
    sched.add_request(Request("long", list(range(20))), StopConditions(max_tokens=3))
    sched.add_request(Request("w", list(range(300, 305))), StopConditions(max_tokens=2))
    output = sched.schedule()
    assert [(c.request_id, c.num_tokens, c.sample) for c in output.chunks] == [
        ("dead", 3, True),
        ("r", 6, True),
        ("long", 7, False),
    ]
    assert sched.abort("dead")
    return sched, output


def refused(scheduler: Scheduler, call, error=KVPoolError, match: str | None = None):
    before = scheduler_snapshot(scheduler)
    with pytest.raises(error, match=match):
        call()
    assert scheduler_snapshot(scheduler) == before


# -- update: the sampled tokens ----------------------------------------------------------


def test_update_with_a_negative_token_changes_nothing_and_a_retry_is_exact(busy):
    sched, out = busy
    refused(sched, lambda: sched.update(out, {"r": -1}), InvalidTokenError, r"request 'r' is -1")
    r = sched.request("r")
    assert (r.num_computed_tokens, r.num_tokens) == (0, 6)
    sched.update(out, {"r": token_for("r", 0)})
    assert (r.num_computed_tokens, r.num_tokens) == (6, 7)
    finish_all(sched)
    assert sched.metrics("r").num_output_tokens == 4


@pytest.mark.parametrize(
    ("sampled", "error", "match"),
    [
        ({"r": -1}, InvalidTokenError, "-1"),
        ({"r": True}, InvalidTokenError, "True"),
        ({"r": False}, InvalidTokenError, "False"),
        ({"r": 5.0}, InvalidTokenError, "5.0"),
        ({"r": "5"}, InvalidTokenError, "'5'"),
        ({"r": None}, InvalidTokenError, "None"),
        ({"r": 2**32}, InvalidTokenError, "4294967296"),
        ({"r": [5]}, InvalidTokenError, r"\[5\]"),
        ({}, RequestStateError, r"no sampled token for request \['r'\]"),
        ({"r": 5, "ghost": 5}, RequestStateError, "'ghost', which step 1 did not schedule"),
        ({"r": 5, "w": 5}, RequestStateError, "'w', which step 1 did not schedule"),
        ({"r": 5, "long": 5}, RequestStateError, "'long', whose chunk .* samples nothing"),
        ({"r": 5, "dead": 5}, RequestStateError, "'dead', which was finished"),
        ({"dead": 5}, RequestStateError, "'dead'"),
        ({"r": 5, 7: 5}, RequestStateError, "request 7"),
        ({"r": 5, "ghost": -1}, RequestStateError, "'ghost'"),
        ([("r", 5)], RequestStateError, r"sampled must map request IDs .* \[\('r', 5\)\]"),
        (None, RequestStateError, "got None"),
    ],
    ids=lambda v: repr(v)[:30],
)
def test_bad_sampled_tokens_are_refused_before_anything_changes(busy, sampled, error, match):
    sched, out = busy
    refused(sched, lambda: sched.update(out, sampled), error, match)
    finish_all(sched, out)


def test_a_stale_output_is_refused(busy):
    sched, first = busy
    sched.update(first, sample(sched, first))
    second = sched.schedule()
    refused(sched, lambda: sched.update(first, {"r": 5}), RequestStateError, "step 1 is stale: the latest step is 2")
    refused(sched, lambda: sched.update(first, {}), RequestStateError, "stale")
    sched.update(second, sample(sched, second))
    finish_all(sched)


def test_the_same_output_is_applied_once(busy):
    sched, out = busy
    tokens = sample(sched, out)
    sched.update(out, tokens)
    refused(sched, lambda: sched.update(out, tokens), RequestStateError, "step 1 was already applied")
    finish_all(sched)


def test_an_output_the_scheduler_did_not_issue_is_refused(busy):
    sched, out = busy
    forged = SchedulerOutput(step=out.step, chunks=out.chunks, preempted=(), num_batched_tokens=out.num_batched_tokens)
    refused(sched, lambda: sched.update(forged, {"r": 5}), RequestStateError, "not issued by this scheduler")
    other = Scheduler(KVCacheManager(8, 4))
    refused(other, lambda: other.update(out, {"r": 5}), RequestStateError, "not issued")
    refused(sched, lambda: sched.update("step 1", {"r": 5}), RequestStateError, "'step 1'")
    finish_all(sched, out)


def test_update_before_any_schedule_is_refused():
    sched = Scheduler(KVCacheManager(8, 4))
    refused(sched, lambda: sched.update(None, {}), RequestStateError, "got None")


def test_schedule_is_refused_while_a_plan_is_in_flight(busy):
    sched, out = busy
    refused(sched, sched.schedule, RequestStateError, "step 1 was planned but not applied")
    finish_all(sched, out)


def test_a_plan_whose_requests_were_all_aborted_need_not_be_applied():
    sched = Scheduler(KVCacheManager(16, 4))
    sched.add_request(Request("a", [1, 2, 3]), StopConditions(max_tokens=2))
    first = sched.schedule()
    sched.abort("a")
    sched.add_request(Request("b", [4, 5, 6]), StopConditions(max_tokens=2))
    second = sched.schedule()  # nothing of step 1 is left to apply
    refused(sched, lambda: sched.update(first, {}), RequestStateError, "stale")
    sched.update(second, sample(sched, second))
    finish_all(sched)


def test_an_empty_plan_is_applied_with_no_tokens_or_skipped():
    sched = Scheduler(KVCacheManager(16, 4))
    empty = sched.schedule()
    assert empty.is_empty
    refused(sched, lambda: sched.update(empty, {"a": 1}), RequestStateError, "'a'")
    assert sched.update(empty, {}) == []
    sched.schedule()  # and the next one may come without applying it


# -- add_request, abort, lookups ------------------------------------------------------------


def _hashed_elsewhere() -> Request:
    request = Request("elsewhere", list(range(8)))
    KVCacheManager(8, 2).hash_request(request)
    return request


def _progressed() -> Request:
    request = Request("progressed", list(range(8)))
    request.num_computed_tokens = 4
    return request


@pytest.mark.parametrize(
    ("args", "kwargs", "error", "match"),
    [
        (("r", StopConditions()), {}, RequestStateError, "request must be a Request, got 'r'"),
        ((Request("new", [1]), {"max_tokens": 3}), {}, ConfigError, "stop must be a StopConditions"),
        ((Request("r", [1, 2]), StopConditions()), {}, RequestStateError, "'r' is already in the scheduler"),
        ((Request("dead", [1, 2]), StopConditions()), {}, RequestStateError, "'dead' is already in the scheduler"),
        ((_progressed(), StopConditions()), {}, RequestStateError, "num_computed_tokens=4"),
        ((Request("big", list(range(100))), StopConditions(max_tokens=100)), {}, CapacityError, "'big'"),
        ((Request("new", [1]), StopConditions()), {"arrival_time": True}, ConfigError, "arrival_time .* True"),
        ((Request("new", [1]), StopConditions()), {"arrival_time": "0"}, ConfigError, "'0'"),
        ((Request("new", [1]), StopConditions()), {"arrival_time": math.nan}, ConfigError, "nan"),
        ((_hashed_elsewhere(), StopConditions()), {}, RequestStateError, "block_size=2"),
    ],
    ids=lambda v: repr(v)[:30],
)
def test_bad_add_request_changes_nothing(busy, args, kwargs, error, match):
    sched, out = busy
    refused(sched, lambda: sched.add_request(*args, **kwargs), error, match)
    finish_all(sched, out)


def test_a_request_id_that_holds_blocks_in_the_manager_is_refused(busy):
    sched, out = busy
    outsider = Request("outsider", [1, 2, 3])
    sched.manager.allocate_slots(outsider, 3)
    refused(sched, lambda: sched.add_request(Request("outsider", [4]), StopConditions()), RequestStateError, "holds")
    sched.manager.free(outsider)
    finish_all(sched, out)


def test_max_model_len_comes_from_the_manager_when_the_config_has_none():
    sched = Scheduler(KVCacheManager(32, 4, max_model_len=8))
    assert sched.max_model_len == 8
    refused(sched, lambda: sched.add_request(Request("a", list(range(8))), StopConditions()), RequestStateError, "8")
    sched.add_request(Request("b", list(range(5))), StopConditions(max_tokens=50))
    run_to_completion(sched, sample_from({"b": [9]}))
    assert sched.metrics("b").finish_reason is FinishReason.LENGTH and sched.request("b").num_tokens == 8


@pytest.mark.parametrize("bad", [5, None, ["r"], b"r"])
def test_ids_of_the_wrong_type_are_refused_everywhere(busy, bad):
    sched, out = busy
    for call in (sched.abort, sched.metrics, sched.request, sched.forget):
        refused(sched, lambda call=call: call(bad), RequestStateError, "string|unknown")
    finish_all(sched, out)


def test_abort_of_an_unknown_or_finished_request_changes_nothing(busy):
    sched, out = busy
    before = scheduler_snapshot(sched)
    assert sched.abort("ghost") is False
    assert sched.abort("dead") is False  # already aborted
    assert scheduler_snapshot(sched) == before
    refused(sched, lambda: sched.forget("r"), RequestStateError, "'r' is not finished")
    refused(sched, lambda: sched.metrics("ghost"), RequestStateError, "unknown request 'ghost'")
    finish_all(sched, out)


# -- options ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_num_batched_tokens": True}, "max_num_batched_tokens .* True"),
        ({"max_num_batched_tokens": 8.0}, "8.0"),
        ({"max_num_seqs": "4"}, "'4'"),
        ({"max_num_seqs": 0}, "max_num_seqs .* 0"),
        ({"max_model_len": False}, "max_model_len .* False"),
        ({"max_model_len": 1}, "max_model_len .* 1"),
        ({"chunk_detail": "full"}, "chunk_detail .* 'full'"),
    ],
)
def test_scheduler_config_types_are_strict(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        SchedulerConfig(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"max_tokens": True}, ConfigError, "max_tokens .* True"),
        ({"max_tokens": 2.0}, ConfigError, "2.0"),
        ({"stop_token_ids": [True]}, InvalidTokenError, "True"),
        ({"stop_token_ids": [-1]}, InvalidTokenError, "-1"),
        ({"stop_token_ids": "ab"}, InvalidTokenError, "str"),
        ({"stop_token_ids": 7}, InvalidTokenError, "int"),
        ({"stop_token_ids": {7: 8}}, InvalidTokenError, r"\{7: 8\}"),
        ({"eos_token_id": True}, InvalidTokenError, "eos_token_id is True"),
        ({"eos_token_id": 2.0}, InvalidTokenError, "eos_token_id is 2.0"),
        ({"eos_token_id": 2**32}, InvalidTokenError, "4294967296"),
        ({"ignore_eos": "false"}, ConfigError, "ignore_eos .* 'false'"),
        ({"ignore_eos": 0}, ConfigError, "ignore_eos .* 0"),
    ],
)
def test_stop_condition_types_are_strict(kwargs, error, match):
    with pytest.raises(error, match=match):
        StopConditions(**kwargs)


def test_stop_conditions_take_any_collection_of_token_ids():
    assert StopConditions(stop_token_ids=(3, 4, 3)).stop_token_ids == frozenset({3, 4})
    assert StopConditions(stop_token_ids=iter([5])).stop_token_ids == frozenset({5})


@pytest.mark.parametrize(
    ("args", "kwargs", "match"),
    [
        (("manager",), {}, "manager must be a KVCacheManager, got 'manager'"),
        ((KVCacheManager(8, 4), {"max_num_seqs": 2}), {}, "config must be a SchedulerConfig"),
        ((KVCacheManager(8, 4),), {"clock": 5.0}, "clock must be callable, got 5.0"),
        ((KVCacheManager(8, 4, max_model_len=10), SchedulerConfig(max_model_len=12)), {}, "differs"),
    ],
)
def test_scheduler_arguments_are_checked(args, kwargs, match):
    with pytest.raises(ConfigError, match=match):
        Scheduler(*args, **kwargs)


def test_driver_arguments_are_checked():
    sched = Scheduler(KVCacheManager(8, 4))
    with pytest.raises(ConfigError, match="max_steps .* 0"):
        run_to_completion(sched, sample_from({}), max_steps=0)
    with pytest.raises(ConfigError, match="max_steps .* True"):
        run_to_completion(sched, sample_from({}), max_steps=True)
    with pytest.raises(ConfigError, match="sample must be callable"):
        run_to_completion(sched, {"a": [1]})
    with pytest.raises(ConfigError, match="non-empty token sequences"):
        sample_from({"a": []})


def test_counts_only_plans_are_checked_the_same_way():
    sched = Scheduler(KVCacheManager(16, 4), SchedulerConfig(chunk_detail=ChunkDetail.COUNTS))
    sched.add_request(Request("a", [1, 2, 3]), StopConditions(max_tokens=2))
    out = sched.schedule()
    refused(sched, lambda: sched.update(out, {"a": -2}), InvalidTokenError, "-2")
    finish_all(sched, out)


# -- a stateful machine: valid steps interleaved with hostile calls ------------------------------


PREFIXES = [list(range(100, 112)), list(range(200, 205)), []]
BAD_TOKENS = [-1, 2**32, True, 1.5, "3", None]


class HostileSchedulerMachine(RuleBasedStateMachine):
    """Valid adds, schedules, updates and aborts, with hostile calls in between.

    After every rule the manager's invariants hold; every refused call must
    leave the snapshot as it was; at the end every request runs to completion
    with exactly its scripted tokens.
    """

    @initialize(
        num_blocks=st.integers(min_value=8, max_value=30),
        block_size=st.sampled_from([2, 4]),
        budget=st.integers(min_value=3, max_value=24),
        max_num_seqs=st.integers(min_value=1, max_value=4),
    )
    def setup(self, num_blocks, block_size, budget, max_num_seqs):
        self.sched = Scheduler(
            KVCacheManager(num_blocks, block_size),
            SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_num_seqs),
        )
        self.pending: SchedulerOutput | None = None
        self.applied: list[SchedulerOutput] = []
        self.next_id = 0

    def _refused(self, call, error=KVPoolError) -> None:
        before = scheduler_snapshot(self.sched)
        with pytest.raises(error):
            call()
        assert scheduler_snapshot(self.sched) == before

    # -- valid calls

    @rule(prefix=st.sampled_from(PREFIXES), tail=st.lists(st.integers(0, 30), min_size=1, max_size=8),
          max_tokens=st.integers(1, 6))  # fmt: skip
    def add(self, prefix, tail, max_tokens):
        rid = f"r{self.next_id}"
        self.next_id += 1
        try:
            self.sched.add_request(Request(rid, prefix + tail), StopConditions(max_tokens=max_tokens))
        except CapacityError:
            pass

    @precondition(lambda self: self.pending is None)
    @rule()
    def schedule(self):
        if self.sched.has_unfinished_requests():
            self.pending = self.sched.schedule()
            assert not self.pending.is_empty

    @precondition(lambda self: self.pending is not None)
    @rule()
    def update(self):
        output, self.pending = self.pending, None
        self.sched.update(output, sample(self.sched, output))
        self.applied.append(output)

    @rule(data=st.data())
    def abort(self, data):
        ids = self.sched.waiting_ids() + self.sched.running_ids()
        if ids:
            assert self.sched.abort(data.draw(st.sampled_from(ids)))

    # -- hostile calls

    @precondition(lambda self: self.pending is not None)
    @rule(bad=st.sampled_from(BAD_TOKENS), data=st.data())
    def update_with_a_bad_token(self, bad, data):
        tokens = sample(self.sched, self.pending)
        if tokens:
            tokens[data.draw(st.sampled_from(sorted(tokens)))] = bad
            self._refused(lambda: self.sched.update(self.pending, tokens), InvalidTokenError)

    @precondition(lambda self: self.pending is not None)
    @rule(how=st.sampled_from(["missing", "unknown", "not sampling", "not running"]))
    def update_with_wrong_ids(self, how):
        tokens = sample(self.sched, self.pending)
        if how == "missing" and tokens:
            tokens.pop(next(iter(tokens)))
        elif how == "unknown":
            tokens["ghost"] = 1
        else:
            running = how == "not sampling"
            others = [
                c.request_id
                for c in self.pending.chunks
                if (self.sched.metrics(c.request_id).status is RequestStatus.RUNNING) == running
                and (not c.sample or not running)
            ]
            if not others:
                return
            tokens[others[0]] = 1
        if tokens != sample(self.sched, self.pending):
            self._refused(lambda: self.sched.update(self.pending, tokens), RequestStateError)

    @precondition(lambda self: bool(self.applied))
    @rule(data=st.data())
    def update_with_an_old_output(self, data):
        old = data.draw(st.sampled_from(self.applied))
        self._refused(lambda: self.sched.update(old, {}), RequestStateError)

    @precondition(lambda self: self.pending is not None)
    @rule()
    def schedule_twice(self):
        if any(self.sched.metrics(c.request_id).status is RequestStatus.RUNNING for c in self.pending.chunks):
            self._refused(self.sched.schedule, RequestStateError)

    @rule(rid=st.sampled_from(["ghost", "r0", "r1"]))
    def abort_unknown_or_finished(self, rid):
        before = scheduler_snapshot(self.sched)
        known = rid in {m.request_id for m in self.sched.all_metrics()}
        if not known or self.sched.metrics(rid).status is RequestStatus.FINISHED:
            assert self.sched.abort(rid) is False
            assert scheduler_snapshot(self.sched) == before

    @rule(bad=st.sampled_from([5, None, ("r0",)]))
    def abort_a_non_id(self, bad):
        self._refused(lambda: self.sched.abort(bad), RequestStateError)

    @rule(which=st.sampled_from(["duplicate", "not a request", "bad stop", "too big", "bad arrival"]))
    def bad_add_request(self, which):
        known = [m.request_id for m in self.sched.all_metrics()]
        if which == "duplicate" and known:
            call = lambda: self.sched.add_request(Request(known[0], [1]), StopConditions())  # noqa: E731
        elif which == "not a request":
            call = lambda: self.sched.add_request([1, 2], StopConditions())  # noqa: E731
        elif which == "bad stop":
            call = lambda: self.sched.add_request(Request("x", [1]), None)  # noqa: E731
        elif which == "too big":
            call = lambda: self.sched.add_request(Request("x", [1] * 200), StopConditions())  # noqa: E731
        else:
            call = lambda: self.sched.add_request(Request("x", [1]), StopConditions(), arrival_time="now")  # noqa: E731
        if which != "duplicate" or known:
            self._refused(call)

    @invariant()
    def bookkeeping_holds(self):
        self.sched.manager.check_invariants()

    def teardown(self):
        if not hasattr(self, "sched"):
            return
        finish_all(self.sched, self.pending)


TestHostileScheduler = settings(
    max_examples=60, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)(HostileSchedulerMachine).TestCase
