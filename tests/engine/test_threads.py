"""The thread count of a CPU step: fixed, or following the cores other processes leave free."""

from __future__ import annotations

import pytest

from kvpool.engine.threads import (
    CpuTimes,
    ThreadGovernor,
    auto_ceiling,
    available_cores,
    choose_threads,
    parse_threads,
    read_cpu_times,
)
from kvpool.errors import ConfigError

pytestmark = pytest.mark.engine


@pytest.mark.parametrize(
    ("cores", "elsewhere", "want"),
    [(2, 0.0, 2), (2, 0.3, 2), (2, 0.7, 1), (2, 1.0, 1), (2, 2.0, 1), (8, 2.2, 6), (1, 0.0, 1), (4, 9.0, 1)],
)
def test_choose_threads_leaves_the_busy_cores(cores, elsewhere, want):
    assert choose_threads(cores, elsewhere) == want


@pytest.mark.parametrize("bad", [0, -1, True, 1.5, "two", "AUTO", [2]])
def test_bad_thread_settings_are_refused_by_name(bad):
    with pytest.raises(ConfigError, match=repr(bad).replace("[", r"\[").replace("]", r"\]")):
        parse_threads(bad)


def test_engine_options_check_threads_before_loading():
    from kvpool.engine.startup import EngineOptions

    with pytest.raises(ConfigError, match="threads must be"):
        EngineOptions(model="no-such-model", threads=0)
    assert EngineOptions(model="no-such-model", threads="auto").threads == "auto"


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_fixed_count_is_set_once_and_kept():
    applied: list[int] = []
    governor = ThreadGovernor(3, applied.append, cores=2)
    assert governor.before_step() == 3 and applied == [3]


def test_auto_follows_the_cores_other_processes_take():
    """Two cores: another process takes one, then leaves it; own work never counts against us."""
    applied: list[int] = []
    clock = _Clock()
    samples = iter(
        [
            CpuTimes(busy=0, total=0, own=0),
            # 100 ticks per core: 180 busy, 90 of them ours -> 0.9 core elsewhere -> 1 thread
            CpuTimes(busy=180, total=200, own=90),
            # all 200 busy, all ours (two spinning threads) -> nothing elsewhere -> 2 threads
            CpuTimes(busy=380, total=400, own=290),
        ]
    )
    governor = ThreadGovernor(
        "auto", applied.append, cores=2, interval_s=1.0, read_times=lambda: next(samples), clock=clock
    )
    assert applied == [2]
    assert governor.before_step() == 2  # too early to measure: no sample taken
    clock.now = 1.5
    assert governor.before_step() == 1 and applied == [2, 1]
    clock.now = 3.0
    assert governor.before_step() == 2 and applied == [2, 1, 2]


def test_auto_keeps_its_count_where_proc_cannot_be_read():
    applied: list[int] = []
    clock = _Clock()
    governor = ThreadGovernor("auto", applied.append, cores=4, read_times=lambda: None, clock=clock)
    clock.now = 10.0
    assert governor.before_step() == 4 and applied == [4]


def test_read_cpu_times_reads_this_machine():
    times = read_cpu_times()
    if times is None:
        pytest.skip("no /proc here")
    assert 0 <= times.busy <= times.total and times.own >= 0


def test_auto_uses_at_most_torchs_count_and_the_allowed_cores():
    cores = available_cores()
    assert auto_ceiling(1) == 1
    assert auto_ceiling(cores + 8) == cores  # never more than the cores this process may run on
    assert auto_ceiling(0) == 1
