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


def test_the_fallback_order_is_the_prefix_rule_applied_to_those_left() -> None:
    from kvpool.openai_http.protocol import GenerationEndpoint, parse_generation
    from kvpool.router import MemoryIndex, RouteOptions, Router
    from kvpool.router.replica_config import parse_replica
    from kvpool.routing import prefix_aware
    from kvpool.tenancy import DEFAULT_TENANT, SaltPolicy
    from tests.router.fakes import ByteTokenizer

    specs = tuple(
        parse_replica(f"http://127.0.0.1:{port},events=tcp://127.0.0.1:{port + 1},block-size=16,hash=sha256")
        for port in range(9300, 9320, 2)
    )
    router = Router(
        RouteOptions(replicas=specs, tokenizer=ByteTokenizer(), keys=None, salts=SaltPolicy.shared()), MemoryIndex()
    )
    for replica in router.replicas:
        replica.up, replica.events = True, replica.described
    request = parse_generation(
        GenerationEndpoint.CHAT, {"model": "m", "messages": [{"role": "user", "content": "y" * 300}]}
    )
    keys = router.prompt_keys(request, DEFAULT_TENANT)
    prompt = next(iter(keys.hashes.values()))
    for n, replica in enumerate(router.replicas):  # depths and loads that tie, and that trade against each other
        router.index.store(replica.url, prompt[: (n * 7) % 12])
        replica.in_flight = (n * 5) % 3
    ranked = router.rank(keys)
    assert sorted(r.url for r, _ in ranked) == sorted(r.url for r in router.replicas)
    left = [r for r in router.replicas if r is not ranked[0][0]]
    tokens = {r.url: n * 16 for r, n in ranked}
    expected = []
    while left:  # the rule's choice among those left, one at a time
        i = prefix_aware([tokens[r.url] for r in left], [r.load for r in left], load_cost=router.ranker.load_cost)
        expected.append(left.pop(i))
    assert [r for r, _ in ranked[1:]] == expected
