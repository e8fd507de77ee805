"""The figure-based routing laws: expected-ttft and the threshold gate, their figures, and a hot shared prefix."""

from __future__ import annotations

import math

import pytest

from kvpool.errors import ConfigError
from kvpool.routing import (
    ExpectedTtft,
    Routing,
    RoutingFigures,
    ThresholdGate,
    Thresholds,
    chooser,
    expected_ttft_s,
    threshold_gate,
)


def fig(
    cached: int = 0, in_flight: int = 0, pending: int = 0, rate: float = 1000.0, step: float = 0.0
) -> RoutingFigures:
    return RoutingFigures(
        cached_tokens=cached,
        in_flight=in_flight,
        prefill_pending=pending,
        prefill_tokens_per_s=rate,
        decode_step_s=step,
    )


def test_expected_ttft_is_queued_plus_own_uncached_tokens_over_the_rate_plus_a_step_share() -> None:
    idle = fig(cached=300, rate=1000.0)
    assert expected_ttft_s(idle, 1000) == pytest.approx(0.7)
    busy = RoutingFigures(
        cached_tokens=0,
        in_flight=2,
        prefill_pending=9000,
        prefill_tokens_per_s=1000.0,
        decode_step_s=0.5,
        chunk_tokens=4096,
    )
    assert expected_ttft_s(busy, 1000) == pytest.approx(10.0 + math.ceil(10_000 / 4096) * 0.5)
    assert expected_ttft_s(fig(cached=5000), 1000) == 0.0  # all cached (more than the prompt counts as all)


def test_expected_ttft_prefers_the_cache_until_its_queue_costs_more_than_the_prefill_saved() -> None:
    # replica 0 holds 900 of 1000 tokens: its first token in 0.1 s + its queue, and 2 x 0.1 s of prefill
    # added for those after it; replica 1: 1.0 s and 2 x 1.0 s
    rule = ExpectedTtft()
    assert rule.pick([fig(cached=900, in_flight=1, pending=2600), fig()], 1000) == 0  # 2.9 s < 3.0 s
    assert rule.pick([fig(cached=900, in_flight=1, pending=2800), fig()], 1000) == 1  # 3.1 s > 3.0 s
    alone = ExpectedTtft(own_weight=0.0)  # the request's own first token only
    assert alone.pick([fig(cached=900, in_flight=1, pending=800), fig()], 1000) == 0  # 0.9 s < 1.0 s
    assert alone.pick([fig(cached=900, in_flight=1, pending=1000), fig()], 1000) == 1  # 1.1 s > 1.0 s
    assert rule.cost(fig(cached=900, pending=100), 1000) == pytest.approx(0.2 + 2 * 0.1)


def test_expected_ttft_weighs_each_replicas_own_rate() -> None:
    fast, slow = fig(rate=4000.0), fig(cached=500, rate=1000.0)
    assert ExpectedTtft().pick([slow, fast], 1000) == 1  # 0.25 s computing all beats 0.5 s for the rest


def test_expected_ttft_ties_go_round_the_replicas() -> None:
    rule = chooser(Routing.EXPECTED_TTFT)
    figures = [fig(), fig(), fig()]
    assert [rule.pick(figures, 100) for _ in range(4)] == [0, 1, 2, 0]


def test_a_hot_system_prompt_stays_where_it_is_cached_until_its_queue_costs_more_then_is_copied() -> None:
    """A small fleet of figures: 3 replicas at 1,000 tokens/s, turns of 2,000 tokens sharing a 1,800-token prompt.

    Each choice queues the request's uncached tokens there; no request finishes meanwhile (a burst).
    """
    prompt, shared = 2000, 1800
    cached = [shared, 0, 0]  # replica 0 holds the system prompt
    pending = [0, 0, 0]
    in_flight = [0, 0, 0]
    rule = ExpectedTtft()
    chosen = []
    for _ in range(36):
        figures = [fig(cached=c, in_flight=n, pending=p) for c, n, p in zip(cached, in_flight, pending)]
        i = rule.pick(figures, prompt)
        if cached[i] == 0:  # a copy: it costs no more than the cheapest replica holding the prompt
            holders = [f for f in figures if f.cached_tokens]
            assert min(rule.cost(f, prompt) for f in holders) >= rule.cost(figures[i], prompt)
        chosen.append(i)
        pending[i] += prompt - cached[i]
        in_flight[i] += 1
        cached[i] = shared  # the replica that computed the prompt now holds it too
    # the first turns group at replica 0 while its queue (200 tokens a turn) costs less than computing the
    # 2,000 tokens afresh and delaying those after by twice as much (6.0 s); then it is copied to one more
    assert chosen[:27] == [0] * 27
    assert chosen[27] == 1
    assert 2 not in chosen  # a third copy is not needed yet: replica 1 takes the turns its queue allows
    assert chosen.count(1) < chosen.count(0)


def test_threshold_gate_follows_the_match_above_its_share_else_the_least_loaded() -> None:
    figures = [fig(cached=400, in_flight=3), fig(in_flight=1)]
    assert threshold_gate(figures, 1000) == [0]  # 40% > 30%
    assert threshold_gate(figures, 2000) == [1]  # 20%: least loaded
    assert threshold_gate(figures, 1000, Thresholds(cache=0.5)) == [1]


def test_threshold_gate_balances_first_when_both_imbalance_tests_hold() -> None:
    cached_but_busy = fig(cached=1000, in_flight=100)
    assert threshold_gate([cached_but_busy, fig(in_flight=30)], 1000) == [1]  # 70 > 64 and 100 > 45
    assert threshold_gate([cached_but_busy, fig(in_flight=40)], 1000) == [0]  # 60 <= 64: the match
    assert threshold_gate([fig(cached=1000, in_flight=200), fig(in_flight=140)], 1000) == [0]  # 200 <= 210


def test_threshold_rule_ties_rotate() -> None:
    rule = ThresholdGate()
    assert [rule.pick([fig(), fig()], 10) for _ in range(3)] == [0, 1, 0]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("cached_tokens", -1),
        ("in_flight", 1.5),
        ("prefill_pending", True),
        ("prefill_tokens_per_s", 0.0),
        ("prefill_tokens_per_s", math.inf),
        ("decode_step_s", -0.1),
        ("decode_step_s", math.nan),
        ("chunk_tokens", 0),
    ],
)
def test_bad_figures_are_refused_by_name(field: str, value: object) -> None:
    given: dict[str, object] = {"cached_tokens": 0, "in_flight": 0, field: value}
    with pytest.raises(ConfigError, match=field):
        RoutingFigures(**given)  # type: ignore[arg-type]


def test_bad_calls_are_refused_by_name() -> None:
    with pytest.raises(ConfigError, match="at least one replica"):
        ExpectedTtft().pick([], 10)
    with pytest.raises(ConfigError, match="prompt_tokens"):
        ExpectedTtft().pick([fig()], -1)
    with pytest.raises(ConfigError, match="RoutingFigures"):
        ThresholdGate().pick([(0, 0)], 10)  # type: ignore[list-item]
    with pytest.raises(ConfigError, match="RoutingFigures"):
        ExpectedTtft().choose([0], [0.0])
    with pytest.raises(ConfigError, match="cache share"):
        Thresholds(cache=1.5)
    with pytest.raises(ConfigError, match="balance_rel"):
        Thresholds(balance_rel=0.5)


def test_every_rule_answers_pick() -> None:
    figures = [fig(cached=900, in_flight=1), fig(in_flight=0)]
    picks = {rule: chooser(rule).pick(figures, 1000) for rule in Routing}
    assert picks[Routing.PREFIX] == 0
    assert picks[Routing.LEAST_LOADED] == 1
    assert picks[Routing.ROUND_ROBIN] == 0
    assert picks[Routing.EXPECTED_TTFT] == 0
    assert picks[Routing.THRESHOLD] == 0
    assert {r for r in Routing if r.cache_aware} == {Routing.PREFIX, Routing.EXPECTED_TTFT, Routing.THRESHOLD}
