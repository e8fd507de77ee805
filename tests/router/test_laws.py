"""The router's figure laws: expected-ttft from the replicas' rates and prefill pending, the threshold gate."""

from __future__ import annotations

from kvpool.openai_http.protocol import GenerationEndpoint, parse_generation
from kvpool.replica_rates import ReplicaRates
from kvpool.router import MemoryIndex, RouteOptions, Router
from kvpool.router.ranking import PromptKeys
from kvpool.router.replica_config import parse_replica
from kvpool.routing import Routing
from kvpool.tenancy import DEFAULT_TENANT, SaltPolicy
from tests.router.fakes import ByteTokenizer


def router_with(routing: Routing, *, prefill_tokens_per_s: float = 1000.0) -> Router:
    specs = tuple(
        parse_replica(f"http://127.0.0.1:{port},events=tcp://127.0.0.1:{port + 1},block-size=16,hash=sha256")
        for port in (9301, 9401)
    )
    options = RouteOptions(
        replicas=specs,
        tokenizer=ByteTokenizer(),
        keys=None,
        salts=SaltPolicy.shared(),
        routing=routing,
        prefill_tokens_per_s=prefill_tokens_per_s,
    )
    router = Router(options, MemoryIndex())
    for replica in router.replicas:
        replica.up, replica.events = True, replica.described  # as the monitor would; nothing here talks to them
    assert router.prefix_mode_now == "precise"
    return router


def keys_of(router: Router, text: str) -> PromptKeys:
    request = parse_generation(GenerationEndpoint.CHAT, {"model": "m", "messages": [{"role": "user", "content": text}]})
    return router.prompt_keys(request, DEFAULT_TENANT)


def test_expected_ttft_keeps_a_hot_prefix_until_its_pending_prefill_costs_more_than_it_saves() -> None:
    router = router_with(Routing.EXPECTED_TTFT)
    system = "You are the guide for the whole team. " * 40  # 1,520 bytes: 95 blocks of 16
    holder, other = router.replicas
    first = keys_of(router, system + "q0")
    hashing = next(iter(first.hashes))
    router.index.store(holder.url, first.hashes[hashing][:95])
    chosen = []
    sent = []
    for n in range(12):
        keys = keys_of(router, system + f"question {n:02d}")
        replica, cached = router.rank(keys)[0]
        router.bookkeeping.sent(replica, keys, cached)  # a burst: nothing reaches its first token
        router.bookkeeping.accepted(replica, keys, cached)
        chosen.append(replica)
        sent.append((replica, keys))
    # each turn queues ~30 uncached tokens at the holder, against ~1,550 to compute elsewhere
    assert chosen[0] is holder and chosen.count(holder) >= 10
    assert router.ranker.prefill_pending[holder.url] > 0
    for replica, keys in sent:
        router.bookkeeping.first_token(keys)
        router.bookkeeping.ended(replica, keys)
    assert router.ranker.prefill_pending == {} and holder.in_flight == other.in_flight == 0


def test_expected_ttft_sends_a_prompt_elsewhere_once_the_holders_queue_costs_more_than_it_saves() -> None:
    router = router_with(Routing.EXPECTED_TTFT)
    holder, other = router.replicas
    keys = keys_of(router, "y" * 800)
    router.index.store(holder.url, keys.hashes[next(iter(keys.hashes))][:40])  # 640 of ~810 tokens
    assert router.rank(keys)[0][0] is holder
    router.ranker.prefill_pending[holder.url] = 1400  # (1400 + 170) + 2 x 170 tokens' seconds < 3 x 810
    holder.in_flight = 1
    assert router.rank(keys)[0][0] is holder
    router.ranker.prefill_pending[holder.url] = 2200  # (2200 + 170) + 2 x 170 > 3 x 810
    holder.in_flight = 1
    assert router.rank(keys)[0][0] is other


def test_expected_ttft_reads_each_replicas_advertised_rate_over_the_flag() -> None:
    router = router_with(Routing.EXPECTED_TTFT, prefill_tokens_per_s=1000.0)
    holder, fast = router.replicas
    keys = keys_of(router, "z" * 800)
    router.index.store(holder.url, keys.hashes[next(iter(keys.hashes))][:25])  # 400 held: 0.41 s left at 1,000/s
    assert router.rank(keys)[0][0] is holder
    fast.rates = ReplicaRates(prefill_tokens_per_s=4000.0, decode_step_s=0.0, source="measured")  # 0.2 s for all
    assert router.rank(keys)[0][0] is fast


def test_the_threshold_gate_takes_a_match_over_its_share_and_balances_past_its_thresholds() -> None:
    router = router_with(Routing.THRESHOLD)
    holder, other = router.replicas
    keys = keys_of(router, "w" * 800)
    router.index.store(holder.url, keys.hashes[next(iter(keys.hashes))][:20])  # 320 of ~810: 39% > 30%
    holder.in_flight = 60
    assert router.rank(keys)[0][0] is holder  # 60 - 0 <= 64: balanced enough
    holder.in_flight = 65
    assert router.rank(keys)[0][0] is other


def test_a_request_sent_without_its_keys_is_reserved_when_accepted_and_released_when_it_ends() -> None:
    router = router_with(Routing.EXPECTED_TTFT)
    replica = router.replicas[0]
    keys = keys_of(router, "v" * 100)
    router.bookkeeping.sent(replica)
    router.bookkeeping.accepted(replica, keys, 0)
    assert router.ranker.prefill_pending == {replica.url: keys.tokens}
    router.bookkeeping.ended(replica, keys)
    assert router.ranker.prefill_pending == {} and replica.in_flight == 0
