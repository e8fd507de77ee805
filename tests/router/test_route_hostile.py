"""``kvpool route`` against hostile clients and stuck replicas: refusals before the body, gated figures, timeouts."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from kvpool.errors import ConfigError
from kvpool.router import MemoryIndex, RouteOptions, Router, build_app
from kvpool.serve.connections import ConnectionLimits, uvicorn_config
from kvpool.tenancy import KeyRing, SaltPolicy
from tests.router.fakes import ByteTokenizer, FakeReplica, serve_in_thread, wait_for
from tests.services import free_port

SALTS = SaltPolicy.isolated(b"s" * 32)
DEADLINE = 30.0
KEYS = KeyRing.from_mapping({"sk-alice": "alice"})
ADMIN = KeyRing.from_mapping({"sk-admin": "admin"})
LIMIT = 4096


def options(replicas: tuple[str, ...], **changes: Any) -> RouteOptions:
    fields: dict[str, Any] = {
        "replicas": replicas,
        "tokenizer": ByteTokenizer(),
        "keys": KEYS,
        "salts": SALTS,
        "health_interval": 0.1,
        "max_body_bytes": LIMIT,
    }
    fields.update(changes)
    return RouteOptions(**fields)


class Served:
    """An ASGI app under uvicorn on a thread (with :func:`uvicorn_config` when ``limits`` is given)."""

    def __init__(self, app: Any, limits: ConnectionLimits | None = None) -> None:
        if limits is None:
            config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="error")
        else:
            config = uvicorn_config(app, host="127.0.0.1", port=0, limits=limits, log_level="error")
        self.server, self.thread, self.port = serve_in_thread(config)  # port 0, read back
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(DEADLINE)


class StuckReplica:
    """Answers /health but never a generation: requests hang before any byte, streams after the first chunk."""

    def __init__(self) -> None:
        self.hits = 0
        self.streams_open = 0

        async def generate(request: Request) -> Response:
            self.hits += 1
            body = json.loads(await request.body())
            if not body.get("stream"):
                await asyncio.Event().wait()  # never answers
            self.streams_open += 1

            async def chunks() -> AsyncIterator[bytes]:
                try:
                    yield b'data: {"choices": []}\n\n'
                    await asyncio.Event().wait()
                    yield b""
                finally:
                    self.streams_open -= 1

            return StreamingResponse(chunks(), media_type="text/event-stream")

        async def health(request: Request) -> Response:
            return JSONResponse({"status": "ok"})

        async def no_events(request: Request) -> Response:
            return JSONResponse({"error": {"message": "no events"}}, status_code=404)

        app = Starlette(
            routes=[
                Route("/v1/chat/completions", generate, methods=["POST"]),
                Route("/health", health),
                Route("/kv-events", no_events),
            ]
        )
        self.served = Served(app)
        self.url = self.served.url


@pytest.fixture
def stuck() -> Iterator[StuckReplica]:
    replica = StuckReplica()
    yield replica
    replica.served.server.force_exit = True
    replica.served.stop()


@pytest.fixture
def front() -> Iterator[Served]:
    """A router whose only replica is a closed port: what is tested here is refused before any routing."""
    served = Served(build_app(Router(options((f"http://127.0.0.1:{free_port()}",)), MemoryIndex())))
    yield served
    served.stop()


def answer_to(port: int, head: bytes, body: bytes = b"") -> bytes:
    """Send ``head`` (and ``body``), never the rest, and read the answer until the server's response is whole."""
    with socket.create_connection(("127.0.0.1", port), timeout=DEADLINE) as sock:
        sock.sendall(head + body)
        received = b""
        while b"\r\n\r\n" not in received or not received.rstrip().endswith(b"}"):
            chunk = sock.recv(4096)  # a timeout here (the server waiting for the body) fails the test
            if not chunk:
                break
            received += chunk
        return received


def test_a_missing_key_is_refused_before_the_body_is_read(front: Served) -> None:
    head = b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 1000\r\n\r\n"
    answer = answer_to(front.port, head, b'{"model": ')  # the other 990 bytes never come
    assert answer.startswith(b"HTTP/1.1 401") and b"missing API key" in answer


def test_a_declared_body_over_the_limit_is_refused_before_it_is_read(front: Served) -> None:
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer sk-alice\r\n"
        b"content-length: %d\r\n\r\n" % (LIMIT + 1)
    )
    answer = answer_to(front.port, head)
    assert answer.startswith(b"HTTP/1.1 413") and str(LIMIT).encode() in answer


def test_a_chunked_body_is_refused_as_soon_as_it_passes_the_limit(front: Served) -> None:
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer sk-alice\r\n"
        b"transfer-encoding: chunked\r\n\r\n"
    )
    chunk = b"%x\r\n%s\r\n" % (LIMIT + 1, b" " * (LIMIT + 1))  # and no last chunk: the body never ends
    answer = answer_to(front.port, head, chunk)
    assert answer.startswith(b"HTTP/1.1 413") and str(LIMIT).encode() in answer


def test_a_content_length_that_is_not_a_number_is_refused_by_name() -> None:
    router = Router(options(("http://127.0.0.1:1",)), MemoryIndex())
    transport = httpx.ASGITransport(app=build_app(router))

    async def send() -> httpx.Response:
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as client:
            request = client.build_request(
                "POST", "/v1/chat/completions", content=b"{}", headers={"authorization": "Bearer sk-alice"}
            )
            request.headers["content-length"] = "12abc"
            return await client.send(request)

    response = asyncio.run(send())
    assert response.status_code == 400 and "'12abc'" in response.json()["error"]["message"]


def test_json_nested_too_deeply_is_a_400_that_says_so(front: Served) -> None:
    deep = b'{"model": "fake", "messages": ' + b"[" * 1900 + b"]" * 1900 + b"}"
    response = httpx.post(
        front.url + "/v1/chat/completions", content=deep, headers={"authorization": "Bearer sk-alice"}, timeout=DEADLINE
    )
    assert response.status_code == 400 and "nested too deeply" in response.json()["error"]["message"]


@pytest.mark.parametrize(
    ("client", "admin_keys", "key", "status"),
    [
        ("127.0.0.1", None, None, 200),
        ("::1", None, None, 200),
        ("::ffff:127.0.0.1", None, None, 200),
        ("::1:2:3", None, None, 403),  # not loopback, though it starts like it
        ("203.0.113.7", None, "sk-admin", 403),  # no admin keys: loopback only
        ("203.0.113.7", ADMIN, None, 401),
        ("203.0.113.7", ADMIN, "sk-alice", 401),  # a tenant's key is not an admin key
        ("203.0.113.7", ADMIN, "sk-admin", 200),
    ],
)
def test_verbose_health_is_for_the_loopback_or_an_admin_key(
    client: str, admin_keys: KeyRing | None, key: str | None, status: int
) -> None:
    router = Router(options(("http://127.0.0.1:1",), admin_keys=admin_keys), MemoryIndex())
    router.replicas[0].up = True  # (no lifespan here: the monitor does not run)
    transport = httpx.ASGITransport(app=build_app(router), client=(client, 4000))
    headers = {"authorization": f"Bearer {key}"} if key else {}

    async def get(path: str) -> httpx.Response:
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as http:
            return await http.get(path, headers=headers)

    verbose = asyncio.run(get("/health?verbose=1"))
    assert verbose.status_code == status, verbose.text
    if status == 200:
        assert "index_blocks" in verbose.json() and "events" in verbose.json()
    plain = asyncio.run(get("/health"))
    assert plain.status_code == 200 and "index_blocks" not in plain.json()
    assert plain.json()["replicas_up"] == 1
    # the replicas' addresses and last errors are for operators only
    assert ("replicas" in plain.json()) == (status == 200), plain.json()


def test_a_stuck_replica_times_out_and_leaves_rotation(stuck: StuckReplica) -> None:
    good = FakeReplica("good", SALTS).start()
    router = Router(options((stuck.url, good.url), keys=None, upstream_timeout=0.5, quarantine=600.0), MemoryIndex())
    served = Served(build_app(router))
    try:
        wait_for(lambda: all(r.up for r in router.replicas), "both replicas up", timeout=DEADLINE)
        url = served.url + "/v1/chat/completions"
        asked = 0
        while stuck.hits == 0:  # until the router has tried the stuck one (ties go round the replicas)
            reply = httpx.post(
                url, json={"model": "fake", "messages": [{"role": "user", "content": f"{asked}"}]}, timeout=DEADLINE
            )
            assert reply.status_code == 200 and reply.json()["replica"] == "good", reply.text
            asked += 1
            assert asked < 10
        stuck_state = router.replicas[0]
        assert not stuck_state.up and stuck_state.describe()["quarantined"]
        assert "ReadTimeout" in (stuck_state.last_error or "")
        for i in range(4):  # health checks pass, but the quarantine holds: every request goes to the good one
            reply = httpx.post(
                url, json={"model": "fake", "messages": [{"role": "user", "content": f"x{i}"}]}, timeout=DEADLINE
            )
            assert reply.json()["replica"] == "good"
        assert stuck.hits == 1 and not router.replicas[0].up
    finally:
        served.stop()
        good.kill()


def test_shutdown_cuts_an_upstream_stream_that_never_ends(stuck: StuckReplica) -> None:
    router = Router(options((stuck.url,), keys=None), MemoryIndex())
    served = Served(build_app(router), ConnectionLimits(shutdown_timeout=1))
    wait_for(lambda: router.replicas[0].up, "the replica up", timeout=DEADLINE)
    body = {"model": "fake", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    with httpx.stream("POST", served.url + "/v1/chat/completions", json=body, timeout=DEADLINE) as response:
        chunks = response.iter_raw()  # (held: a dropped iterator would close the stream)
        assert next(chunks).startswith(b"data:")
        assert router.replicas[0].in_flight == 1 and stuck.streams_open == 1
        served.server.should_exit = True  # what SIGTERM does
        served.thread.join(DEADLINE)
        assert not served.thread.is_alive(), "the router waited on the open stream"
    assert router.replicas[0].in_flight == 0  # the upstream stream was closed, not left open
    wait_for(lambda: stuck.streams_open == 0, "the replica to see its stream closed", timeout=DEADLINE)


def test_bad_timeouts_are_refused_by_name() -> None:
    with pytest.raises(ConfigError, match="upstream_timeout .*0"):
        options(("http://127.0.0.1:1",), upstream_timeout=0)


def test_the_command_refuses_bad_connection_and_timeout_flags() -> None:
    from click.testing import CliRunner

    from kvpool.cli.commands import cli

    for flag, value in (
        ("--upstream-timeout", "0"),
        ("--header-timeout", "nan"),
        ("--max-connections", "0"),
        ("--shutdown-timeout", "0"),
    ):
        result = CliRunner().invoke(cli, ["route", "--replica", "http://127.0.0.1:1", flag, value])
        assert result.exit_code == 2 and flag in result.output, (flag, result.output)
