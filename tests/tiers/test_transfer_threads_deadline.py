"""TransferThreads: a load's own deadline, asked each time it is checked, within the threads' fixed one."""

from __future__ import annotations

import threading

import pytest

from kvpool.errors import ConfigError
from kvpool.tiers.transfer_threads import TransferThreads
from tests.tiers.test_transfer_threads import FakeClock


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def threads(clock: FakeClock):
    t = TransferThreads("test", load_threads=2, max_queued_saves=2, load_deadline_s=10.0, clock=clock)
    yield t
    t.close(drain_timeout=5)


def _stalled(started: threading.Event, release: threading.Event):
    def fetch() -> bytes:
        started.set()
        release.wait(10)
        return b"late"

    return fetch


def test_a_load_times_out_at_its_own_deadline_which_may_grow_with_its_progress(threads, clock):
    started, release = threading.Event(), threading.Event()
    allowed = [0.5]
    ticket = threads.submit_load(_stalled(started, release), deadline=lambda: allowed[0])
    assert started.wait(5)
    clock.now = 0.4
    assert threads.finished_loads() == []
    allowed[0] = 2.0  # the load progressed: its request waits longer
    clock.now = 1.0
    assert threads.finished_loads() == []
    assert threads.wait_for_loads(timeout=0.0) is False  # nothing done, no deadline passed
    clock.now = 2.0
    (outcome,) = threads.finished_loads()
    assert (outcome.ticket, outcome.timed_out, outcome.seconds) == (ticket, True, 2.0)
    assert threads.figures.loads_timed_out == 1
    release.set()


def test_the_threads_deadline_bounds_a_load_s_own(threads, clock):
    started, release = threading.Event(), threading.Event()
    threads.submit_load(_stalled(started, release), deadline=lambda: 1e9)
    assert started.wait(5)
    clock.now = 9.9
    assert threads.finished_loads() == []
    clock.now = 10.0
    (outcome,) = threads.finished_loads()
    assert outcome.timed_out and outcome.seconds == 10.0
    release.set()


def test_a_load_in_time_is_not_held_to_its_deadline(threads):
    ticket = threads.submit_load(lambda: b"kv", deadline=lambda: 0.0 + 1e-9)
    outcomes = []
    while threads.loads_in_flight:
        threads.wait_for_loads(timeout=5)
        outcomes.extend(threads.finished_loads())
    # the fake clock never moves: a load that returned is done, whatever its deadline
    assert [(o.ticket, o.value, o.ok) for o in outcomes] == [(ticket, b"kv", True)]


def test_a_deadline_that_is_not_callable_is_refused_by_name_and_nothing_runs(threads):
    ran = threading.Event()
    with pytest.raises(ConfigError, match="deadline"):
        threads.submit_load(ran.set, deadline=0.5)  # type: ignore[arg-type]
    assert threads.loads_in_flight == 0 and threads.figures.loads_submitted == 0
    assert not ran.is_set()
