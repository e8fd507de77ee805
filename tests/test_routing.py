"""The routing rules: exact choices, tie-breaks, the load bound of the prefix rule, and refused figures."""

from __future__ import annotations

import math
import random

import pytest

from kvpool.errors import ConfigError
from kvpool.routing import (
    DEFAULT_LOAD_COST,
    LOAD_COST_TOKENS,
    LeastLoaded,
    PrefixAware,
    RoundRobin,
    Routing,
    RoutingFigures,
    chooser,
    fleet_chooser,
    held_or_computing,
    least_loaded,
    prefix_aware,
)


def test_least_loaded_takes_the_smallest_load_and_the_lowest_index_among_equals():
    assert least_loaded([3, 1, 2]) == 1
    assert least_loaded([2, 1, 1]) == 1
    assert least_loaded([0.5]) == 0


def test_round_robin_cycles_and_wraps_when_the_count_changes():
    rr = RoundRobin()
    assert [rr.next(3) for _ in range(5)] == [0, 1, 2, 0, 1]
    assert rr.next(2) == 0  # position 2 wraps over two replicas
    assert rr.next(2) == 1
    other = RoundRobin()  # each router has its own position
    assert other.next(3) == 0


def test_round_robin_ignores_prefixes_and_loads():
    rr = RoundRobin()
    assert [rr.choose([9, 0], [0, 100]) for _ in range(4)] == [0, 1, 0, 1]


def test_prefix_rule_prefers_the_longest_prefix_at_equal_load():
    assert prefix_aware([0, 5, 3], [1, 1, 1], load_cost=1.0) == 1


def test_prefix_rule_trades_cached_blocks_against_load():
    # replica 0 holds 4 blocks but has 6 more units of load: 4 - 6 < 0 - 0
    assert prefix_aware([4, 0], [6, 0], load_cost=1.0) == 1
    # a smaller load cost makes the same prefix worth the wait: 4 - 3 > 0
    assert prefix_aware([4, 0], [6, 0], load_cost=0.5) == 0


def test_prefix_rule_ties_go_to_the_smaller_load_then_the_lower_index():
    # scores: 3 - 2 = 1 and 1 - 0 = 1; replica 1 is less loaded
    assert prefix_aware([3, 1], [2, 0], load_cost=1.0) == 1
    assert prefix_aware([2, 2], [1, 1], load_cost=1.0) == 0


def test_prefix_rule_without_any_cached_prefix_is_least_loaded():
    rng = random.Random(7)
    for _ in range(200):
        loads = [rng.randrange(5) for _ in range(rng.randrange(1, 6))]
        assert prefix_aware([0] * len(loads), loads, load_cost=0.3) == least_loaded(loads)


def test_prefix_rule_never_piles_every_request_onto_the_hot_replica():
    """Every request shares one 8-block prefix; loads grow as requests are placed and never drain.

    The replica holding the prefix may lead by at most prefix_blocks / load_cost, so the others get work.
    """
    prefix_blocks, load_cost, replicas = 8, 1.0, 4
    rule = PrefixAware(load_cost)
    loads = [0] * replicas
    cached = [prefix_blocks, 0, 0, 0]
    for _ in range(400):
        i = rule.choose(cached, loads)
        loads[i] += 1
        cached[i] = prefix_blocks  # the chosen replica now holds the prefix too
        assert max(loads) - min(loads) <= prefix_blocks / load_cost + 1
    assert min(loads) >= 90


@pytest.mark.parametrize("rule", list(Routing))
def test_every_rule_has_a_chooser(rule):
    rule_chooser = chooser(rule, load_cost=0.5)
    figures = [RoutingFigures(cached_tokens=c, in_flight=n) for c, n in [(1, 1), (0, 2), (2, 0)]]
    assert 0 <= rule_chooser.pick(figures, 4) < 3


def test_chooser_names_match_the_command_line():
    assert [r.value for r in Routing] == ["prefix", "round-robin", "least-loaded", "expected-ttft", "threshold"]
    assert isinstance(chooser(Routing.LEAST_LOADED), LeastLoaded)


@pytest.mark.parametrize(
    ("cached", "loads", "fragment"),
    [
        ([], [], "at least one replica"),
        ([0], [0, 1], "one cached-prefix length per replica"),
        ([0, 1], [-1, 0], "replica 0's load"),
        ([0, 1], [0, math.nan], "replica 1's load"),
        ([0, 1], [0, math.inf], "replica 1's load"),
        ([0, -2], [0, 0], "replica 1's cached prefix"),
        ([0, 1.5], [0, 0], "replica 1's cached prefix"),
        ([True, 0], [0, 0], "replica 0's cached prefix"),
    ],
)
def test_bad_figures_are_refused_naming_the_value(cached, loads, fragment):
    for rule in (PrefixAware(), LeastLoaded(), RoundRobin()):
        with pytest.raises(ConfigError, match=fragment):
            rule.choose(cached, loads)


def test_a_refused_round_robin_choice_does_not_advance():
    rr = RoundRobin()
    with pytest.raises(ConfigError):
        rr.choose([0], [0, 0])
    with pytest.raises(ConfigError, match="at least one replica"):
        rr.next(0)
    assert rr.next(3) == 0


@pytest.mark.parametrize("load_cost", [0, -1.0, math.nan, math.inf, True])
def test_bad_load_cost_is_refused(load_cost):
    with pytest.raises(ConfigError, match="load_cost"):
        PrefixAware(load_cost)
    with pytest.raises(ConfigError, match="load_cost"):
        prefix_aware([0], [0], load_cost=load_cost)


def test_chooser_objects_rotate_among_ties_so_an_idle_fleet_still_spreads():
    for rule in (PrefixAware(), LeastLoaded()):
        picks = [rule.choose([0, 0, 0], [0, 0, 0]) for _ in range(6)]
        assert picks == [0, 1, 2, 0, 1, 2]
    rule = PrefixAware()
    assert rule.choose([0, 0, 0], [0, 0, 0]) == 0
    assert rule.choose([3, 0, 0], [0, 0, 0]) == 0  # a strictly better replica wins whatever the rotation
    assert rule.choose([0, 2, 2], [0, 0, 0]) == 1  # ties rotate from after the previous choice
    assert rule.choose([0, 2, 2], [0, 0, 0]) == 2


def test_a_fleets_prefix_rule_weighs_cached_tokens_against_requests_in_flight():
    rule = fleet_chooser(Routing.PREFIX)
    assert isinstance(rule, PrefixAware) and rule.load_cost == DEFAULT_LOAD_COST * LOAD_COST_TOKENS == 128
    assert rule.choose([129, 0], [1, 0]) == 0  # 129 cached tokens outweigh one request in flight
    assert rule.choose([127, 0], [1, 0]) == 1  # 127 do not
    assert fleet_chooser(Routing.PREFIX, load_cost=2).choose([33, 0], [1, 0]) == 0  # 2 blocks of 16 a request
    for bad in (0, -1.0, math.nan, math.inf, True):
        with pytest.raises(ConfigError, match="load_cost"):
            fleet_chooser(Routing.PREFIX, load_cost=bad)


def test_held_or_computing_extends_the_held_prefix_by_the_blocks_being_computed():
    prompt = ["a", "b", "c", "d"]
    assert held_or_computing(prompt, 1, {"b": 1, "c": 2}) == 3  # held a; b and c are being computed there
    assert held_or_computing(prompt, 0, {"b": 1}) == 0  # a gap: b is not reached
    assert held_or_computing(prompt, 2, None) == held_or_computing(prompt, 2, {}) == 2
    assert held_or_computing(prompt, 0, set(prompt)) == 4  # never past the prompt
