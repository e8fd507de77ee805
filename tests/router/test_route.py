"""``kvpool route`` in front of fake replicas that publish real KV events: where requests go, and faults."""

from __future__ import annotations

import json
import sys
import threading
from collections import Counter
from collections.abc import Iterator

import pytest

from kvpool.router import MemoryIndex, RouteOptions, Router, index_from_url
from kvpool.tenancy import KeyRing, SaltPolicy
from tests.router.fakes import BLOCK_SIZE, ByteTokenizer, FakeReplica, RouterThread, wait_for

SALTS = SaltPolicy.isolated(b"s" * 32)


def system(i: int) -> dict[str, str]:
    """A long system prompt of its own per conversation (about 20 blocks), distinct from its first block on."""
    return {"role": "system", "content": f"{i:03d} You are assistant number {i}. " + f"Rule {i}: be brief. " * 16}


def ask(question: str) -> dict[str, str]:
    return {"role": "user", "content": question}


@pytest.fixture
def replicas() -> Iterator[list[FakeReplica]]:
    started = [FakeReplica(name, SALTS).start() for name in ("r0", "r1")]
    yield started
    for replica in started:
        if replica._thread is not None and replica._thread.is_alive():
            replica.kill()


def route(replicas: list[FakeReplica], index: object = None, **options: object) -> RouterThread:
    settings = RouteOptions(
        replicas=tuple(r.url for r in replicas),
        tokenizer=ByteTokenizer(),
        keys=options.pop("keys", None),  # type: ignore[arg-type]  # the tests pass a KeyRing or nothing
        salts=SALTS,
        health_interval=0.1,
        **options,  # type: ignore[arg-type]  # RouteOptions' own fields, by name
    )
    return RouterThread(Router(settings, index or MemoryIndex()))  # type: ignore[arg-type]  # an index


def up(router: RouterThread) -> bool:
    return all(r.up and r.url in router.router.monitor.feeds for r in router.router.replicas)


def test_importing_the_router_imports_no_engine() -> None:
    code = "import sys, kvpool.router, kvpool.cli.route; print(sorted({'torch', 'kvpool.engine', 'starlette', 'zmq'} & set(sys.modules)))"
    import subprocess

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_follow_ups_reach_the_replica_that_holds_their_prefix(replicas: list[FakeReplica]) -> None:
    router = route(replicas)
    try:
        wait_for(lambda: up(router), "both replicas up")
        first = {}
        for i in range(4):
            reply = router.chat([system(i), ask("hello")])
            assert reply.status_code == 200, reply.text
            first[i] = reply.json()["replica"]
            assert reply.headers["x-kvpool-replica"] == replicas[int(first[i][1])].url
        assert sorted(Counter(first.values()).values()) == [2, 2]  # new prefixes spread out
        blocks = [len(replicas[0].cached), len(replicas[1].cached)]
        wait_for(lambda: [router.router.index.num_blocks(r.url) for r in replicas] == blocks, "events indexed")
        for turn in range(2):
            for i in range(4):
                reply = router.chat([system(i), ask("hello"), {"role": "assistant", "content": "hi"}, ask(f"q{turn}")])
                assert reply.json()["replica"] == first[i]
                cached = reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
                assert cached >= len(ByteTokenizer().chat_tokens([system(i)])) - BLOCK_SIZE
    finally:
        router.stop()


def test_streaming_passes_through_with_the_serving_replica_usage(replicas: list[FakeReplica]) -> None:
    router = route(replicas)
    try:
        wait_for(lambda: up(router), "both replicas up")
        router.chat([system(7), ask("hello")])
        wait_for(lambda: sum(router.router.index.num_blocks(r.url) for r in replicas) > 0, "events indexed")
        with router.client.stream(
            "POST",
            "/v1/chat/completions",
            json={"model": "fake", "messages": [system(7), ask("again")], "stream": True},
        ) as response:
            assert response.headers["content-type"].startswith("text/event-stream")
            lines = [line for line in response.iter_lines() if line]
        assert lines[-1] == "data: [DONE]"
        usage = json.loads(lines[-2].removeprefix("data: "))["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] > 10 * BLOCK_SIZE
    finally:
        router.stop()


def test_load_is_not_piled_onto_the_replica_holding_the_prefix() -> None:
    held = [FakeReplica(name, SALTS).start() for name in ("r0", "r1")]
    router = route(held, load_cost=4.0)
    gate = threading.Event()
    threads: list[threading.Thread] = []
    try:
        wait_for(lambda: up(router), "both replicas up")
        warm = [system(1), ask("warm")]
        router.chat(warm)
        wait_for(lambda: sum(router.router.index.num_blocks(r.url) for r in held) > 0, "events indexed")
        holder = next(r for r in held if r.cached)
        other = next(r for r in held if r is not holder)
        for replica in held:
            replica.gate = gate
        routed: list[str] = []  # where each request went, in the order sent
        answered: list[str] = []

        def one(k: int) -> None:
            answered.append(router.chat([system(1), ask(f"{k} concurrent")]).json()["replica"])

        # One request at a time, each held at its replica until the end, and its KV events indexed before the
        # next is sent: the k-th request is routed with exactly k-1 in flight, however slowly the machine runs.
        for k in range(8):
            before = holder.served
            threads.append(threading.Thread(target=one, args=(k,)))
            threads[-1].start()
            wait_for(lambda k=k: holder.served + other.served == 1 + k + 1, f"request {k} at a replica", timeout=60)
            routed.append(holder.name if holder.served > before else other.name)
            for r in held:
                wait_for(lambda r=r: router.router.index.num_blocks(r.url) == len(r.cached), f"{r.name}'s events")
        gate.set()
        for t in threads:
            t.join()
        assert Counter(answered) == Counter(routed)
        # Every question differs from the others at its first character, so what the holder shares with each
        # request is the system turn, whatever it served since: `shared` blocks. Each request in flight costs 4
        # blocks: the holder takes requests while its prefix outweighs its load; the next goes to the idle one.
        tokens = ByteTokenizer()
        first, later = tokens.chat_tokens(warm), tokens.chat_tokens([system(1), ask("0 concurrent")])
        shared = next(i for i, (a, b) in enumerate(zip(first, later)) if a != b) // BLOCK_SIZE
        takes = -(-shared // 4)  # the smallest load L with 4 * L >= shared
        assert 1 < takes < 8, shared
        assert routed[: takes + 1] == [holder.name] * takes + [other.name], (shared, routed)
    finally:
        gate.set()
        for t in threads:
            t.join()
        router.stop()
        for r in held:
            r.kill()


def test_a_dead_replica_leaves_rotation_and_its_entries_come_back_with_it(replicas: list[FakeReplica]) -> None:
    router = route(replicas)
    try:
        wait_for(lambda: up(router), "both replicas up")
        for i in range(4):
            assert router.chat([system(i), ask("hello")]).status_code == 200
        dead, alive = replicas
        wait_for(lambda: router.router.index.num_blocks(dead.url) == len(dead.cached) > 0, "events indexed")
        dead.kill()
        for i in range(6):  # every request succeeds through the other replica, the first one by a retry
            reply = router.chat([system(i), ask("after")])
            assert reply.status_code == 200 and reply.json()["replica"] == alive.name
        state = {r.url: r for r in router.router.replicas}
        assert not state[dead.url].up and router.router.index.num_blocks(dead.url) == 0
        assert router.client.get("/health").json()["replicas"][0]["up"] is False

        dead.start()  # back, with an empty cache; it caches a prompt and the index learns it
        wait_for(lambda: state[dead.url].up and dead.url in router.router.monitor.feeds, "the replica back")
        for i in range(10, 14):
            assert router.chat([system(i), ask("new")]).status_code == 200
        assert dead.cached
        wait_for(lambda: router.router.index.num_blocks(dead.url) == len(dead.cached), "its entries rebuilt")
    finally:
        router.stop()


def test_with_every_replica_down_the_answer_is_503(replicas: list[FakeReplica]) -> None:
    router = route(replicas)
    try:
        wait_for(lambda: up(router), "both replicas up")
        for r in replicas:
            r.kill()
        reply = router.chat([system(0), ask("anyone?")])
        assert reply.status_code == 503 and reply.json()["error"]["code"] == "no_replica"
        assert router.client.get("/health").status_code == 503
    finally:
        router.stop()


def test_tenants_are_checked_at_the_door_and_the_key_is_forwarded(replicas: list[FakeReplica]) -> None:
    router = route(replicas, keys=KeyRing.from_mapping({"sk-alice": "alice"}))
    try:
        wait_for(lambda: up(router), "both replicas up")
        body = {"model": "fake", "messages": [system(0), ask("hi")]}
        missing = router.client.post("/v1/chat/completions", json=body)
        wrong = router.client.post("/v1/chat/completions", json=body, headers={"Authorization": "Bearer nope"})
        assert missing.status_code == wrong.status_code == 401
        assert wrong.json()["error"]["code"] == "invalid_api_key"
        assert sum(r.served for r in replicas) == 0
        ok = router.client.post("/v1/chat/completions", json=body, headers={"Authorization": "Bearer sk-alice"})
        assert ok.status_code == 200
        bad = router.client.post(
            "/v1/chat/completions", json={"model": "fake"}, headers={"Authorization": "Bearer sk-alice"}
        )
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages"
    finally:
        router.stop()


def test_two_routers_share_one_redis_index(replicas: list[FakeReplica], redis_url: str) -> None:
    import uuid

    prefix = f"test-route:{uuid.uuid4().hex}"
    first = route(replicas, index_from_url(redis_url, prefix=prefix))
    second = route(replicas, index_from_url(redis_url, prefix=prefix))
    try:
        wait_for(lambda: up(first) and up(second), "both routers following both replicas")
        holders = {}
        for i in range(4):
            holders[i] = first.chat([system(i), ask("hello")]).json()["replica"]
        wait_for(
            lambda: [second.router.index.num_blocks(r.url) for r in replicas] == [len(r.cached) for r in replicas],
            "the shared index",
        )
        for i in range(4):  # the second router sends each follow-up where the first one's went
            assert second.chat([system(i), ask("follow-up")]).json()["replica"] == holders[i]
    finally:
        first.stop()
        second.stop()


def test_kv_events_behind_an_admin_key_are_read_with_one() -> None:
    guarded = [FakeReplica(name, SALTS, admin_key="sk-admin").start() for name in ("r0", "r1")]
    without, with_key = route(guarded), route(guarded, admin_key="sk-admin")
    try:
        wait_for(lambda: up(with_key), "the replicas' events followed with the key")
        wait_for(lambda: all(r.up for r in without.router.replicas), "the replicas up without it")
        assert not without.router.monitor.feeds  # no events: its prefixes are remembered, not read
        assert without.router.prefix_mode_now == "approximate"
        assert "401" in (without.router.replicas[0].last_error or "")
        assert without.chat([system(0), ask("hi")]).status_code == 200
    finally:
        without.stop()
        with_key.stop()
        for r in guarded:
            r.kill()


def test_round_robin_for_comparison_ignores_prefixes(replicas: list[FakeReplica]) -> None:
    from kvpool.routing import Routing

    router = route(replicas, routing=Routing.ROUND_ROBIN)
    try:
        wait_for(lambda: all(r.up for r in router.router.replicas), "both replicas up")
        served = [router.chat([system(0), ask(f"q{k}")]).json()["replica"] for k in range(4)]
        assert served == ["r0", "r1", "r0", "r1"] and not router.router.prefix_routing
    finally:
        router.stop()


class BrokenTokenizer(ByteTokenizer):
    def chat_tokens(self, messages: object) -> list[int]:  # type: ignore[override]  # any messages
        raise RuntimeError("the chat template failed")


def test_a_prompt_that_cannot_be_hashed_is_routed_by_load(replicas: list[FakeReplica]) -> None:
    settings = RouteOptions(
        replicas=tuple(r.url for r in replicas),
        tokenizer=BrokenTokenizer(),
        keys=None,
        salts=SALTS,
        health_interval=0.1,
    )
    router = RouterThread(Router(settings, MemoryIndex()))
    try:
        wait_for(lambda: up(router), "both replicas up")
        served = [router.chat([system(0), ask(f"q{k}")]).json()["replica"] for k in range(2)]
        assert sorted(served) == ["r0", "r1"]  # no prefix known: the rule's ties rotate
    finally:
        router.stop()


def test_a_replica_back_from_a_stall_has_its_entries_rebuilt_from_its_replay_buffer(
    replicas: list[FakeReplica],
) -> None:
    router = route(replicas)
    try:
        wait_for(lambda: up(router), "both replicas up")
        for i in range(4):
            router.chat([system(i), ask("hello")])
        stalled = replicas[0]
        held = len(stalled.cached)
        wait_for(lambda: router.router.index.num_blocks(stalled.url) == held > 0, "events indexed")
        stalled.healthy = False
        wait_for(lambda: router.router.index.num_blocks(stalled.url) == 0, "its entries dropped")
        assert all(router.chat([system(i), ask("meanwhile")]).json()["replica"] == "r1" for i in range(2))
        stalled.healthy = True  # the same process, its cache intact: no request needed to relearn it
        wait_for(lambda: router.router.index.num_blocks(stalled.url) == held, "its entries replayed")
    finally:
        router.stop()


def test_a_client_gone_mid_stream_closes_the_replica_stream_and_frees_its_slot(replicas: list[FakeReplica]) -> None:
    router = route(replicas)
    try:
        wait_for(lambda: up(router), "both replicas up")
        hold = threading.Event()
        for r in replicas:
            r.hold_stream = hold  # the stream stays open after its first chunk, however slow the test thread
        body = {"model": "fake", "messages": [system(3), ask("long answer")], "stream": True}
        with router.client.stream("POST", "/v1/chat/completions", json=body) as response:
            lines = response.iter_lines()  # kept: a line iterator let go of closes the client's connection
            first = next(lines)
            assert first.startswith("data: ")
            assert sum(r.served for r in replicas) == 1

            def in_flight() -> int:
                return sum(r.in_flight for r in router.router.replicas)

            wait_for(lambda: in_flight() == 1, "one request in flight while its stream is open", timeout=10)
            in_flight_while_open = in_flight()
        # the client closed its connection after one chunk: the router closes its own to the replica
        wait_for(lambda: sum(r.in_flight for r in router.router.replicas) == 0, "the slot freed")
        wait_for(lambda: sum(r.streams_cut for r in replicas) == 1, "the replica's stream cut short", timeout=30)
        assert in_flight_while_open == 1
        hold.set()
    finally:
        router.stop()
