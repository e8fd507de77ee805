"""How the router ranks replicas in precise mode: requests being computed, and a load cost in tokens."""

from __future__ import annotations

from kvpool.openai_http.protocol import GenerationEndpoint, parse_generation
from kvpool.router import MemoryIndex, RouteOptions, Router
from kvpool.router.replica_config import parse_replica
from kvpool.tenancy import DEFAULT_TENANT, SaltPolicy
from tests.router.fakes import ByteTokenizer


def precise_router(block_size: int) -> Router:
    specs = tuple(
        parse_replica(f"http://127.0.0.1:{port},events=tcp://127.0.0.1:{port + 1},block-size={block_size},hash=sha256")
        for port in (9101, 9201)
    )
    options = RouteOptions(replicas=specs, tokenizer=ByteTokenizer(), keys=None, salts=SaltPolicy.shared())
    router = Router(options, MemoryIndex())
    for replica in router.replicas:
        replica.up, replica.events = True, replica.described  # as the monitor would; nothing here talks to them
    assert router.prefix_mode_now == "precise"
    return router


def keys_of(router: Router, text: str):  # type: ignore[no-untyped-def]  # PromptKeys
    request = parse_generation(GenerationEndpoint.CHAT, {"model": "m", "messages": [{"role": "user", "content": text}]})
    return router.prompt_keys(request, DEFAULT_TENANT)


def test_a_prefix_being_computed_draws_its_followers_to_that_replica() -> None:
    router = precise_router(16)
    system = "You are the guide for the whole team. " * 20  # 40+ blocks of 16 bytes
    first = keys_of(router, system + "first question")
    chosen, cached = router.rank(first)[0]
    assert cached == 0  # nothing published anywhere yet
    chosen.in_flight += 1
    router.routed(chosen, first)
    # a second conversation on the same system prompt, before any event: it meets the first
    second = keys_of(router, system + "another question")
    best, cached = router.rank(second)[0]
    assert best is chosen and cached == len(system) // 16
    router.settled(chosen, first)
    chosen.in_flight -= 1
    assert router.computing[chosen.url] == {}
    assert [n for _, n in router.rank(second)] == [0, 0]  # computed, but unpublished: the index decides again


def test_the_load_cost_is_in_16_token_blocks_whatever_the_block_size() -> None:
    router = precise_router(128)
    text = "x" * 400  # three full blocks of 128
    keys = keys_of(router, text)
    holder, other = router.replicas
    hashing = next(iter(keys.hashes))
    router.index.store(holder.url, keys.hashes[hashing][:2])  # 256 tokens held
    holder.in_flight = 1  # one request in flight is worth 8 x 16 = 128 tokens: the 256 held win
    assert router.rank(keys)[0] == (holder, 2)
    holder.in_flight = 3  # 384 tokens of load: the other replica
    assert router.rank(keys)[0] == (other, 0)
