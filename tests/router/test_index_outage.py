"""A shared index Redis that dies or hangs: requests are routed by load, one line per outage, then it heals."""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Iterator

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvpool.router import RouteOptions, Router
from kvpool.router.index import REDIS_TIMEOUT_S, RedisIndex
from kvpool.router.index_guard import GuardedIndex
from kvpool.tenancy import SaltPolicy
from tests.router.fakes import ByteTokenizer, FakeReplica, RouterThread, wait_for
from tests.services import free_port

ERRORS = (redis.RedisError, OSError)
H = [bytes([i]) * 32 for i in range(6)]


def client_for(url: str) -> redis.Redis:
    return redis.Redis.from_url(
        url, socket_timeout=REDIS_TIMEOUT_S, socket_connect_timeout=REDIS_TIMEOUT_S, retry=Retry(NoBackoff(), 0)
    )


class Hanging:
    """A TCP server that accepts connections and never answers a byte."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.url = f"redis://127.0.0.1:{self.sock.getsockname()[1]}/0"
        self.accepted: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted.append(conn)

    def close(self) -> None:
        self.sock.close()
        for conn in self.accepted:
            conn.close()


@pytest.fixture
def hanging() -> Iterator[Hanging]:
    server = Hanging()
    yield server
    server.close()


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Counting:
    """An index whose every method call is counted on its way to ``inner``: the calls that reach the server."""

    def __init__(self, inner: object) -> None:
        self.inner = inner
        self.calls = 0

    def __getattr__(self, name: str) -> object:
        attr = getattr(self.inner, name)
        if not callable(attr):
            return attr

        def counted(*args: object, **kwargs: object) -> object:
            self.calls += 1
            return attr(*args, **kwargs)

        return counted


@pytest.mark.parametrize("dead", ["closed port", "hangs"])
def test_a_dead_index_answers_nothing_cached_and_logs_one_line_per_outage(
    dead: str, redis_url: str, hanging: Hanging, caplog: pytest.LogCaptureFixture
) -> None:
    url = f"redis://127.0.0.1:{free_port()}/0" if dead == "closed port" else hanging.url
    clock = Clock()
    dead_index = Counting(RedisIndex(client_for(url), prefix=f"test:{time.monotonic_ns()}"))
    guard = GuardedIndex(dead_index, ERRORS, clock=clock)  # type: ignore[arg-type]  # an index, counted
    recovered: list[set[str]] = []
    guard.on_recovered = recovered.append
    with caplog.at_level(logging.WARNING, logger="kvpool.route"):
        for _ in range(50):
            guard.store("r0", H[:3])
            assert guard.match(H, ["r0", "r1"]) == [0, 0]  # route by load, no exception
        assert dead_index.calls == 1  # one try per retry interval (the clock stands still), not one per call
        assert guard.failures == 100 and guard.outages == 1 and not guard.available
        assert sum("does not answer" in r.getMessage() for r in caplog.records) == 1
        assert guard.match_media(H, ["r0", "r1"]) == [(), ()]  # no media either: every replica credited nothing
        # the server comes back (here: the same index, reached at the real server)
        guard.inner = RedisIndex(client_for(redis_url), prefix=f"test:{time.monotonic_ns()}")
        guard.inner.store("r0", H[:2])  # a claim a lost removal would have left behind
        clock.now += 1.0
        assert guard.match(H, ["r0"]) == [0]  # r0's lost writes: its entries were cleared on recovery
        assert guard.available and recovered == [{"r0"}]
        assert sum("answers again" in r.getMessage() for r in caplog.records) == 1
        guard.store("r0", H[:4])
        assert guard.match(H, ["r0", "r1"]) == [4, 0]


def test_the_router_routes_by_load_while_its_index_redis_is_down(redis_url: str) -> None:
    salts = SaltPolicy.isolated(b"s" * 32)
    replicas = [FakeReplica(name, salts).start() for name in ("r0", "r1")]
    index = GuardedIndex(RedisIndex(client_for(f"redis://127.0.0.1:{free_port()}/0")), ERRORS)
    options = RouteOptions(
        replicas=tuple(r.url for r in replicas), tokenizer=ByteTokenizer(), keys=None, salts=salts, health_interval=0.1
    )
    router = RouterThread(Router(options, index))
    try:
        wait_for(lambda: all(r.up for r in router.router.replicas), "both replicas up")
        for i in range(4):
            reply = router.chat([{"role": "user", "content": f"question {i} " * 10}])
            assert reply.status_code == 200, reply.text
        figures = router.client.get("/health", params={"verbose": "1"}).json()["index"]
        assert figures["kind"] == "redis" and figures["available"] is False and figures["outages"] == 1
        assert figures["failures"] > 0
    finally:
        router.stop()
        for replica in replicas:
            replica.kill()
