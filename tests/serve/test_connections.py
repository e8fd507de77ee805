"""Connection bounds shared by ``kvpool serve`` and ``kvpool route``: header timeout, cap, shutdown, loopback."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from kvpool.errors import ConfigError
from kvpool.openai_http import is_loopback
from kvpool.serve.connections import ConnectionLimits, HttpParser, uvicorn_config
from kvpool.serve.openai_server import _is_loopback
from tests.serve.conftest import bound_port

DEADLINE = 30.0  # generous: the machine may be loaded; the assertions wait for events, not for this


class Served:
    """A tiny app under :func:`uvicorn_config` on a thread: ``/`` answers, ``/forever`` streams without end."""

    def __init__(self, limits: ConnectionLimits, parser: HttpParser) -> None:
        self.stream_started = threading.Event()

        async def hello(request: Request) -> Response:
            return PlainTextResponse("hello")

        async def forever(request: Request) -> Response:
            async def chunks() -> AsyncIterator[bytes]:
                yield b"first\n"
                self.stream_started.set()
                await asyncio.Event().wait()  # never set: a stream that stays open
                yield b"never\n"

            return StreamingResponse(chunks())

        app = Starlette(routes=[Route("/", hello), Route("/forever", forever)])
        config = uvicorn_config(app, host="127.0.0.1", port=0, limits=limits, parser=parser, log_level="error")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + DEADLINE
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.02)
        self.port = bound_port(self.server)  # bound as port 0: the OS chose it, nothing raced for it

    def connect(self) -> socket.socket:
        sock = socket.create_connection(("127.0.0.1", self.port), timeout=DEADLINE)
        return sock

    def get(self, path: str = "/") -> httpx.Response:
        return httpx.get(f"http://127.0.0.1:{self.port}{path}", timeout=DEADLINE)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(DEADLINE)


@pytest.fixture(params=[HttpParser.H11, HttpParser.HTTPTOOLS], ids=["h11", "httptools"])
def parser(request: pytest.FixtureRequest) -> HttpParser:
    """Every bound holds on both parsers (httptools: the default where it imports)."""
    if request.param is HttpParser.HTTPTOOLS:
        pytest.importorskip("httptools")
    chosen: HttpParser = request.param
    return chosen


@pytest.fixture
def served(request: pytest.FixtureRequest, parser: HttpParser) -> Iterator[Served]:
    limits = getattr(request, "param", ConnectionLimits(header_timeout=0.5, keep_alive=1, max_connections=4))
    live = Served(limits, parser)
    yield live
    live.stop()


def closed_by_server(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (a blocking read: the close is the event)."""
    received = b""
    started = time.monotonic()
    while chunk := sock.recv(4096):
        received += chunk
    assert time.monotonic() - started < DEADLINE
    return received


def test_half_a_request_line_is_closed_after_the_header_timeout(served: Served) -> None:
    with served.connect() as slow:
        slow.sendall(b"GET / HT")
        assert served.get().text == "hello"  # others are served meanwhile
        assert closed_by_server(slow) == b""


def test_a_kept_alive_connection_must_finish_its_next_headers_in_time(served: Served) -> None:
    with served.connect() as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
        first = b""
        while b"hello" not in first:
            first += sock.recv(4096)
        assert first.startswith(b"HTTP/1.1 200")
        sock.sendall(b"GET / HTTP/1.1\r\nhost:")  # the keep-alive timer stops at the first byte; the header one not
        assert closed_by_server(sock) == b""


def test_a_request_whose_headers_arrive_in_time_is_answered(served: Served) -> None:
    with served.connect() as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        assert closed_by_server(sock).endswith(b"hello")


@pytest.mark.parametrize("served", [ConnectionLimits(header_timeout=60, max_connections=2)], indirect=True)
def test_a_connection_past_the_cap_is_answered_503_and_closed(served: Served) -> None:
    with served.connect() as a, served.connect() as b:
        a.sendall(b"GET / HT")
        b.sendall(b"GET / HT")
        with served.connect() as third:
            answer = closed_by_server(third)
        assert answer.startswith(b"HTTP/1.1 503") and b"too many connections" in answer
    # both idle ones closed: the server counts them gone once it notices, and then answers again
    deadline = time.monotonic() + DEADLINE
    while (reply := served.get()).status_code == 503:
        assert time.monotonic() < deadline, "the closed connections were never released"
    assert reply.text == "hello"


@pytest.mark.parametrize("served", [ConnectionLimits(shutdown_timeout=1)], indirect=True)
def test_shutdown_cancels_a_stream_that_never_ends(served: Served) -> None:
    with httpx.stream("GET", f"http://127.0.0.1:{served.port}/forever", timeout=DEADLINE) as response:
        assert served.stream_started.wait(DEADLINE)
        served.server.should_exit = True  # what SIGTERM does
        served.thread.join(DEADLINE)
        assert not served.thread.is_alive(), "shutdown waited on the open stream"
        assert response.status_code == 200


@pytest.mark.parametrize(
    ("field", "value"),
    [("header_timeout", 0), ("header_timeout", float("nan")), ("keep_alive", 0), ("max_connections", 0)],
)
def test_bad_limits_are_refused_by_name(field: str, value: Any) -> None:
    with pytest.raises(ConfigError, match=f"{field} .*{value!r}"):
        ConnectionLimits(**{field: value})


@pytest.mark.parametrize(
    ("host", "local"),
    [
        ("127.0.0.1", True),
        ("127.8.9.10", True),
        ("::1", True),
        ("::ffff:127.0.0.1", True),
        ("::1:2:3", False),  # an address that merely starts with "::1"
        ("::ffff:10.0.0.1", False),
        ("127.evil.example", False),
        ("1270::1", False),
        ("10.0.0.1", False),
        ("localhost", False),
        ("", False),
        (None, False),
    ],
)
def test_loopback_is_an_address_test_not_a_prefix(host: str | None, local: bool) -> None:
    assert is_loopback(host) is local
    request: Any = SimpleNamespace(client=None if host is None else SimpleNamespace(host=host))
    assert _is_loopback(request) is local  # serve's operator routes ask the same


def test_the_default_parser_is_httptools_where_it_imports() -> None:
    pytest.importorskip("httptools")
    config = uvicorn_config(Starlette(), host="127.0.0.1", port=0, limits=ConnectionLimits())
    assert HttpParser.AUTO.resolved() is HttpParser.HTTPTOOLS
    assert config.http.__name__ == "BoundedHttpToolsProtocol"  # type: ignore[union-attr]
    assert HttpParser.H11.resolved() is HttpParser.H11
