"""Several routers, one load board in Redis: each choice reserves at once, and every router sees it.

The routers here are in-process :class:`~kvpool.router.Router` objects on one real Redis
(a fresh prefix per test); nothing talks HTTP. A request is chosen and sent as the relay
does it (``bookkeeping.choose``, then ``sent`` to its first choice), reaches its first
token, and ends. The benchmark commands of docs/routing.md ("Several routers, one load
board") run here on tiny inputs (:func:`test_the_benchmark_runs_as_documented`).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import hypothesis.strategies as st
import pytest
import redis
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from kvpool.openai_http.protocol import GenerationEndpoint, parse_generation
from kvpool.router import RouteOptions, Router
from kvpool.router.index import RedisIndex
from kvpool.router.load_board import NoBoard, SharedBoard
from kvpool.router.ranking import PromptKeys
from kvpool.router.replica_config import parse_replica
from kvpool.routing import Routing
from kvpool.tenancy import DEFAULT_TENANT, SaltPolicy
from tests.router.fakes import ByteTokenizer

_prefixes = itertools.count()
SYSTEM = "You are the guide for the whole team. " * 8  # 19 blocks of 16 bytes


def fleet(url: str, routers: int, replicas: int, *, prefix: str, routing: Routing = Routing.PREFIX) -> list[Router]:
    """``routers`` routers in front of the same ``replicas`` (precise mode), on one Redis index and board."""
    specs = tuple(
        parse_replica(f"http://127.0.0.1:{port},events=tcp://127.0.0.1:{port + 1},block-size=16,hash=sha256")
        for port in range(9100, 9100 + 10 * replicas, 10)
    )
    options = RouteOptions(
        replicas=specs, tokenizer=ByteTokenizer(), keys=None, salts=SaltPolicy.shared(), routing=routing
    )
    out = []
    for _ in range(routers):
        router = Router(options, RedisIndex(redis.Redis.from_url(url), prefix=prefix))
        for replica in router.replicas:
            replica.up, replica.events = True, replica.described  # as the monitor would
        assert isinstance(router.board, SharedBoard)
        out.append(router)
    return out


def keys_of(router: Router, text: str) -> PromptKeys:
    request = parse_generation(GenerationEndpoint.CHAT, {"model": "m", "messages": [{"role": "user", "content": text}]})
    return router.prompt_keys(request, DEFAULT_TENANT)


def send(router: Router, keys: PromptKeys) -> str:
    """Choose and send as the relay does; the replica it went to."""
    replica, cached = router.bookkeeping.choose(keys)[0]
    router.bookkeeping.sent(replica, keys, cached)
    router.bookkeeping.accepted(replica, keys, cached)
    return replica.url


def board_totals(routers: list[Router]) -> dict[str, tuple[int, int]]:
    board = routers[0].board
    totals = board.totals([r.url for r in routers[0].replicas])
    assert totals is not None
    return totals


def own_sum(routers: list[Router]) -> dict[str, tuple[int, int]]:
    """The loads the board must show: every live router's own, summed."""
    out = {}
    for i, replica in enumerate(routers[0].replicas):
        out[replica.url] = (
            sum(r.replicas[i].in_flight for r in routers),
            sum(r.ranker.prefill_pending.get(replica.url, 0) for r in routers),
        )
    return out


@pytest.fixture
def prefix() -> Iterator[str]:
    yield f"test:board:{next(_prefixes)}:{id(object())}"


class Interleaved(RuleBasedStateMachine):
    """Routers reserving, reaching first tokens, ending and dying in any order, against one Redis."""

    def __init__(self, url: str, prefix: str) -> None:
        super().__init__()
        self.routers = fleet(url, 3, 4, prefix=prefix, routing=Routing.EXPECTED_TTFT)
        self.live = [True] * 3
        self.flying: list[tuple[int, str, PromptKeys, bool]] = []  # router, replica URL, keys, first token yet
        self.client = redis.Redis.from_url(url)
        self.stale: list[str] = []
        for router in self.routers:
            board = router.board
            assert isinstance(board, SharedBoard)
            claim = board.claim

            def checked(seen, url, counts, claim=claim):  # type: ignore[no-untyped-def]
                # what the choice ranked with must be what every live router holds: no stale load
                truth = {u: own_sum(self.alive())[u] for u in seen}
                if seen != truth:
                    self.stale.append(f"{seen} != {truth}")
                return claim(seen, url, counts)

            board.claim = checked  # type: ignore[method-assign]

    def alive(self) -> list[Router]:
        return [r for r, up in zip(self.routers, self.live) if up]

    @rule(n=st.integers(0, 2), question=st.sampled_from(["a", "b", "c" * 40, ""]))
    def reserve(self, n: int, question: str) -> None:
        if self.live[n]:
            router = self.routers[n]
            keys = keys_of(router, SYSTEM + question)
            self.flying.append((n, send(router, keys), keys, False))

    @precondition(lambda self: self.flying)
    @rule(data=st.data())
    def first_token(self, data: st.DataObject) -> None:
        j = data.draw(st.integers(0, len(self.flying) - 1))
        n, url, keys, _ = self.flying[j]
        self.routers[n].bookkeeping.first_token(keys)
        self.flying[j] = (n, url, keys, True)

    @precondition(lambda self: self.flying)
    @rule(data=st.data())
    def end(self, data: st.DataObject) -> None:
        n, url, keys, _ = self.flying.pop(data.draw(st.integers(0, len(self.flying) - 1)))
        router = self.routers[n]
        router.bookkeeping.ended(next(r for r in router.replicas if r.url == url), keys)

    @precondition(lambda self: sum(self.live) > 1)
    @rule(n=st.integers(0, 2))
    def die(self, n: int) -> None:
        """Its lease runs out: what the key's TTL does, without waiting for it."""
        if self.live[n]:
            board = self.routers[n].board
            assert isinstance(board, SharedBoard)
            self.client.delete(board.key)
            self.live[n] = False
            self.flying = [f for f in self.flying if f[0] != n]

    @invariant()
    def board_is_the_sum_of_live_reservations(self) -> None:
        assert not self.stale, self.stale
        assert board_totals(self.alive()) == own_sum(self.alive())

    @invariant()
    def board_computing_is_every_live_routers_computing(self) -> None:
        alive = self.alive()
        for question in ("a", "c" * 40):
            keys = keys_of(alive[0], SYSTEM + question)
            prompts = {r.url: alive[0].ranker.computing_blocks(r, keys) for r in alive[0].replicas}
            expected = {}
            for url, prompt in prompts.items():
                held = [set(router.bookkeeping.computing.get(url, {})) for router in alive]
                expected[url] = next(
                    (d for d in range(len(prompt)) if not any(prompt[d] in h for h in held)), len(prompt)
                )
            assert alive[0].board.survey([], prompts) == ({}, expected)


def test_interleaved_routers_keep_the_board_equal_to_their_live_reservations(redis_url: str, prefix: str) -> None:
    counter = itertools.count()
    run_state_machine_as_test(
        lambda: Interleaved(redis_url, f"{prefix}:{next(counter)}"),
        settings=settings(max_examples=25, stateful_step_count=25, deadline=None),
    )


def test_a_choice_made_on_loads_another_router_changed_is_ranked_again(redis_url: str, prefix: str) -> None:
    a, b = fleet(redis_url, 2, 2, prefix=prefix)
    keys = keys_of(a, SYSTEM + "q")
    rank = a.ranker.rank
    calls: list[dict[str, tuple[int, int]] | None] = []

    def rank_while_b_sends(keys_, seen=None, computing=None):  # type: ignore[no-untyped-def]
        calls.append(seen)
        ranked = rank(keys_, seen, computing)
        if len(calls) == 1:  # between a's read and its reservation, b reserves on a's choice
            b_replica = next(r for r in b.replicas if r.url == ranked[0][0].url)
            b.bookkeeping.sent(b_replica, keys_of(b, "other"), 0)
        return ranked

    a.ranker.rank = rank_while_b_sends  # type: ignore[method-assign]
    first_url = send(a, keys)
    assert len(calls) == 2 and calls[0] != calls[1]  # the claim saw b's reservation and ranked again
    board = a.board
    assert isinstance(board, SharedBoard) and board.conflicts == 1
    assert first_url != next(r.url for r in b.replicas if r.in_flight)  # the idle replica, as one router would
    assert board_totals([a, b]) == own_sum([a, b])


def test_a_prefix_another_router_is_computing_counts_as_held_until_its_request_ends(
    redis_url: str, prefix: str
) -> None:
    a, b = fleet(redis_url, 2, 4, prefix=prefix)
    asked = keys_of(a, SYSTEM + "q")
    url = send(a, asked)  # nothing published yet: the replica computes the whole prompt
    replica = next(r for r in b.replicas if r.url == url)
    mine = keys_of(b, SYSTEM + "another question")
    theirs, ours = a.ranker.computing_blocks(a.replicas[0], asked), b.ranker.computing_blocks(replica, mine)
    common = next(d for d in range(len(ours)) if d >= len(theirs) or theirs[d] != ours[d])
    assert common >= len(SYSTEM) // 16 - 1  # the system prompt's blocks, less the chat template's shift
    _, shared = b.board.survey([], {url: ours})
    assert shared == {url: common}
    others = {u.url: ours for u in b.replicas if u.url != url}
    assert b.board.survey([], others) == ({}, dict.fromkeys(others, 0))
    assert {r.url: n for r, n in b.ranker.rank(mine, board_totals([a, b]), shared)}[url] == common  # held there
    a.bookkeeping.ended(next(r for r in a.replicas if r.url == url), asked)
    assert b.board.survey([], {url: ours}) == ({}, {url: 0})
    assert not redis.Redis.from_url(redis_url).hkeys(a.board.key)[2:]  # fields at 0 deleted: i: and p: only


def burst(routers: list[Router], requests: int) -> list[int]:
    """``requests`` of one prefix, round-robin over ``routers``, none ending: the in-flight count per replica."""
    first = routers[0]
    for i in range(requests):
        router = routers[i % len(routers)]
        send(router, keys_of(router, SYSTEM + f"question {i}"))
    return [sum(r.replicas[j].in_flight for r in routers) for j in range(len(first.replicas))]


def test_a_burst_over_four_routers_spreads_as_one_router_would(redis_url: str, prefix: str) -> None:
    alone = fleet(redis_url, 1, 8, prefix=prefix + ":one")
    together = fleet(redis_url, 4, 8, prefix=prefix + ":four")
    for routers in (alone, together):  # the system prompt published by replica 0's events
        keys = keys_of(routers[0], SYSTEM)
        hashing = routers[0].replicas[0].events.hashing  # type: ignore[union-attr]
        routers[0].index.store(routers[0].replicas[0].url, keys.hashes[hashing])
    one, four = burst(alone, 64), burst(together, 64)
    # the board shares the loads and the blocks each router's requests are computing (precise mode's
    # unpublished blocks): four routers spread the burst exactly as one does
    assert sorted(four) == sorted(one), (one, four)
    assert max(four) / (sum(four) / len(four)) <= 1.2, four


def test_without_the_board_the_same_burst_piles_up(redis_url: str, prefix: str) -> None:
    routers = fleet(redis_url, 4, 8, prefix=prefix)
    for router in routers:
        router.bookkeeping.board = NoBoard()
    keys = keys_of(routers[0], SYSTEM)
    routers[0].index.store(routers[0].replicas[0].url, keys.hashes[routers[0].replicas[0].events.hashing])  # type: ignore[union-attr]
    alone = fleet(redis_url, 1, 8, prefix=prefix + ":one")
    alone[0].index.store(alone[0].replicas[0].url, keys.hashes[alone[0].replicas[0].events.hashing])  # type: ignore[union-attr]
    assert max(burst(routers, 64)) > max(burst(alone, 64))


def test_a_router_whose_lease_ends_leaves_no_load(redis_url: str, prefix: str) -> None:
    a, b = fleet(redis_url, 2, 2, prefix=prefix)
    send(a, keys_of(a, SYSTEM))
    send(b, keys_of(b, "something else entirely, and long enough to be keyed"))
    board = a.board
    assert isinstance(board, SharedBoard)
    client = redis.Redis.from_url(redis_url)
    assert 0 < client.pttl(board.key) <= board.ttl_s * 1000  # a lease, renewed by each write
    client.delete(board.key)  # what its TTL does when a stops renewing it
    assert board_totals([b]) == own_sum([b])
    assert not client.sismember(board.set_key, board.key)  # the reading script dropped it


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_with_its_redis_down_a_router_chooses_by_its_own_loads_and_writes_them_whole_after(
    redis_url: str, prefix: str
) -> None:
    from tests.services import free_port

    a, b = fleet(redis_url, 2, 2, prefix=prefix, routing=Routing.LEAST_LOADED)
    good = a.board
    assert isinstance(good, SharedBoard)
    clock = Clock()
    dead = redis.Redis.from_url(f"redis://127.0.0.1:{free_port()}/0", socket_connect_timeout=0.5)
    down = SharedBoard(dead, a.bookkeeping.all_counts, prefix=prefix, router_id=good.key.rsplit(":", 1)[1], clock=clock)
    a.bookkeeping.board = down
    send(b, keys_of(b, "b's request, on the board"))
    urls = [send(a, keys_of(a, SYSTEM + str(i))) for i in range(3)]  # routed, by a's own loads
    assert len(set(urls)) == 2 and down.outages == 1 and down.failures >= 3 and not down.available
    assert a.figures()["load_board"]["outages"] == 1
    down._totals, down._claim, down._write = good._totals, good._claim, good._write  # the server is back
    clock.now += 60
    assert down.totals([r.url for r in a.replicas]) == own_sum([a, b])  # a's counts written whole first
    assert down.available and down.outages == 1


def test_a_board_needs_a_positive_ttl(redis_url: str) -> None:
    with pytest.raises(ValueError, match="ttl_s must be positive, not 0"):
        SharedBoard(redis.Redis.from_url(redis_url), dict, ttl_s=0)


def test_the_benchmark_runs_as_documented(redis_url: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    trace = tmp_path / "trace.jsonl"
    rows = [{"timestamp": t, "input_length": 1100, "output_length": 3, "hash_ids": [0, t % 2, 9 + t]} for t in range(6)]
    trace.write_text("".join(json.dumps(row) + "\n" for row in rows))
    command = [sys.executable, str(root / "benchmarks" / "bench_load_board.py"), "--redis", redis_url, "--burst"]
    command += [
        "--replay",
        "--trace",
        str(trace),
        "--requests",
        "16",
        "--repeats",
        "1",
        "--system-blocks",
        "1",
        "--conversations",
        "1",
    ]
    env = {**os.environ, "PYTHONPATH": str(root / "src")}
    out = subprocess.run(command, capture_output=True, text=True, env=env, check=True, timeout=120)
    report = json.loads(out.stdout)
    assert report["replay % prompt tokens cached"]["requests"] == 6
    assert set(report["burst max/mean in flight (median)"]) == {"cold", "published"}


def test_a_lease_renewed_after_its_key_expired_brings_the_counts_back_whole(redis_url: str, prefix: str) -> None:
    a, b = fleet(redis_url, 2, 2, prefix=prefix)
    send(a, keys_of(a, SYSTEM))
    send(a, keys_of(a, "a second request of a's"))
    board = a.board
    assert isinstance(board, SharedBoard)
    redis.Redis.from_url(redis_url).delete(board.key)  # expired while a was busy elsewhere
    assert board_totals([b]) == own_sum([b])
    board.refresh()  # what keep_lease does every ttl_s / 3
    assert board_totals([a, b]) == own_sum([a, b]) and sum(n for n, _ in own_sum([a]).values()) == 2
