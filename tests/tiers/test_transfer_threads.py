"""TransferThreads: loads with deadlines, saves in a bounded queue; every wait is on an event, never on time."""

from __future__ import annotations

import threading

import pytest

from kvpool.errors import ConfigError
from kvpool.tiers.transfer_threads import TransferThreads


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def threads(clock: FakeClock):
    t = TransferThreads("test", load_threads=2, max_queued_saves=2, load_deadline_s=1.0, clock=clock)
    yield t
    t.close(drain_timeout=5)


def _drain(threads: TransferThreads) -> list:
    out = []
    while threads.loads_in_flight:
        threads.wait_for_loads(timeout=5)
        out.extend(threads.finished_loads())
    return out


def test_a_load_comes_back_once_with_its_value(threads: TransferThreads) -> None:
    ticket = threads.submit_load(lambda: b"kv")
    outcomes = _drain(threads)
    assert [(o.ticket, o.value, o.ok) for o in outcomes] == [(ticket, b"kv", True)]
    assert threads.finished_loads() == []
    assert threads.figures.loads_submitted == 1


def test_a_load_that_raises_is_a_failed_outcome_not_an_error(threads: TransferThreads) -> None:
    def broken() -> bytes:
        raise OSError("the tier went away")

    threads.submit_load(broken)
    (outcome,) = _drain(threads)
    assert isinstance(outcome.error, OSError) and not outcome.ok
    assert threads.figures.loads_failed == 1


def test_a_stalled_load_times_out_at_its_deadline_and_its_late_result_is_dropped(
    threads: TransferThreads, clock: FakeClock
) -> None:
    release = threading.Event()
    started = threading.Event()

    def stalled() -> bytes:
        started.set()
        release.wait(10)
        return b"late"

    ticket = threads.submit_load(stalled)
    assert started.wait(5)
    assert threads.finished_loads() == []  # before the deadline: still waiting
    clock.now = 1.0
    (outcome,) = threads.finished_loads()
    assert (outcome.ticket, outcome.timed_out, outcome.value, outcome.ok) == (ticket, True, None, False)
    assert threads.figures.loads_timed_out == 1
    release.set()
    fast = threads.submit_load(lambda: b"next")  # the pool's other thread serves the next one meanwhile
    assert [(o.ticket, o.value) for o in _drain(threads)] == [(fast, b"next")]


def test_saves_run_in_order_and_a_full_queue_drops_one_and_counts_it(threads: TransferThreads) -> None:
    gate = threading.Event()
    running = threading.Event()
    done: list[int] = []

    def first() -> None:
        running.set()
        gate.wait(10)
        done.append(0)

    assert threads.submit_save(first)
    assert running.wait(5)  # the save thread holds the first; the queue (2) takes two more
    assert threads.submit_save(lambda: done.append(1))
    assert threads.submit_save(lambda: done.append(2))
    assert not threads.submit_save(lambda: done.append(3))
    gate.set()
    assert threads.drain_saves(timeout=5)
    assert done == [0, 1, 2]
    figures = threads.figures.as_dict()
    assert (figures["saves_done"], figures["saves_dropped"], figures["saves_submitted"]) == (3, 1, 3)


def test_a_failed_save_is_counted_and_the_save_thread_goes_on(threads: TransferThreads) -> None:
    done: list[str] = []

    def broken() -> None:
        raise ConnectionError("redis closed the connection")

    threads.submit_save(broken)
    threads.submit_save(lambda: done.append("after"))
    assert threads.drain_saves(timeout=5)
    assert done == ["after"]
    assert threads.figures.saves_failed == 1


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"load_threads": 0}, "load_threads"),
        ({"max_queued_saves": True}, "max_queued_saves"),
        ({"load_deadline_s": 0}, "load_deadline_s"),
        ({"load_deadline_s": float("inf")}, "load_deadline_s"),
        ({"clock": 3}, "clock"),
    ],
)
def test_bad_settings_are_refused_by_name(kwargs: dict, named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        TransferThreads("bad", **kwargs)


def test_only_callables_are_submitted_and_nothing_after_close(threads: TransferThreads) -> None:
    with pytest.raises(ConfigError, match="callable"):
        threads.submit_load(b"not a function")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="callable"):
        threads.submit_save(None)  # type: ignore[arg-type]
    assert threads.figures.loads_submitted == 0 and threads.figures.saves_submitted == 0
    threads.close()
    with pytest.raises(ConfigError, match="closed"):
        threads.submit_load(lambda: None)
