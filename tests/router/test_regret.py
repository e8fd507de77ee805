"""Routing regret: per request, the cached tokens the chosen replica held against the most any replica held."""

from __future__ import annotations

from kvpool.router.metrics import render_metrics
from kvpool.router.ranking import NO_KEYS, REGRET_BUCKETS, RoutingRegret
from tests.router.test_rank import keys_of, precise_router


def metric(text: str, name: str) -> str:
    found = [line.split()[-1] for line in text.splitlines() if line.startswith(name + " ")]
    assert len(found) == 1, f"{name}: {len(found)} lines"
    return found[0]


def test_a_choice_away_from_the_best_replica_is_counted_against_it() -> None:
    router = precise_router(128)
    keys = keys_of(router, "x" * 400)  # three full blocks of 128; the last token is never cached
    holder, other = router.replicas
    router.index.store(holder.url, next(iter(keys.hashes.values()))[:2])  # 256 tokens held there
    assert router.rank(keys)[0][0] is holder  # the best: regret 1
    holder.in_flight = 3  # its load outweighs the 256 tokens: the other replica, which holds none
    assert router.rank(keys)[0][0] is other
    regret = router.ranker.regret
    assert (regret.requests, regret.achieved_tokens, regret.best_tokens) == (2, 256, 512)
    assert regret.ratios == 2 and regret.ratio_sum == 1.0
    text = render_metrics(router)
    assert metric(text, "kvpool_router_cached_tokens_achieved_total") == "256"
    assert metric(text, "kvpool_router_cached_tokens_best_available_total") == "512"
    assert metric(text, "kvpool_router_regret_requests_total") == "2"
    assert metric(text, 'kvpool_router_cached_tokens_ratio_bucket{le="0.0"}') == "1"
    assert metric(text, 'kvpool_router_cached_tokens_ratio_bucket{le="0.99"}') == "1"
    assert metric(text, 'kvpool_router_cached_tokens_ratio_bucket{le="1.0"}') == "2"
    assert metric(text, 'kvpool_router_cached_tokens_ratio_bucket{le="+Inf"}') == "2"
    assert metric(text, "kvpool_router_cached_tokens_ratio_count") == "2"


def test_a_prompt_nobody_holds_counts_but_has_no_ratio() -> None:
    router = precise_router(16)
    router.rank(keys_of(router, "a new conversation, nothing cached anywhere"))
    router.rank(NO_KEYS)  # not keyed (no tokenizer yet): routed by load, not counted
    regret = router.ranker.regret
    assert (regret.requests, regret.best_tokens, regret.ratios) == (1, 0, 0)


def test_the_histogram_buckets_hold_each_ratio_once() -> None:
    regret = RoutingRegret()
    for achieved, best in ((0, 10), (5, 10), (96, 100), (10, 10), (0, 0)):
        regret.note(achieved, best)
    assert sum(regret.buckets) == regret.ratios == 4
    assert regret.buckets[REGRET_BUCKETS.index(0.0)] == 1
    assert regret.buckets[REGRET_BUCKETS.index(0.5)] == 1
    assert regret.buckets[REGRET_BUCKETS.index(0.97)] == 1
    assert regret.buckets[REGRET_BUCKETS.index(1.0)] == 1
