"""The relay's HTTP/1.1 connections (kvpool.router.upstream), against servers that send exactly the bytes a test says.

Each test runs its own event loop with a raw asyncio server on port 0, so the answers can be
malformed, cut short, held between chunks or never sent. Nothing sleeps: a held answer waits
for an ``asyncio.Event`` the test sets.
"""

from __future__ import annotations

import asyncio
import base64
import os
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import pytest

from kvpool.router.upstream import HIGH_WATER, UpstreamPool

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, "Server"], Awaitable[None]]


class Server:
    """A raw HTTP server on port 0: ``handler`` answers each connection; requests and connections are counted."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.requests: list[bytes] = []
        self.closed = asyncio.Event()  # set when the client closes a connection
        self.port = 0
        self._server: asyncio.Server | None = None

    async def __aenter__(self) -> Server:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1/completions"

    async def read_request(self, reader: asyncio.StreamReader) -> bytes | None:
        """One request, head and body (its content-length), or None when the client closed the connection."""
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, ConnectionError):
            return None
        length = 0
        for line in head.split(b"\r\n"):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":", 1)[1])
        request = head + await reader.readexactly(length)
        self.requests.append(request)
        return request

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            await self.handler(reader, writer, self)
        finally:
            writer.close()


def run(
    test: Callable[[], Awaitable[None]], loop_factory: Callable[[], asyncio.AbstractEventLoop] | None = None
) -> None:
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        runner.run(asyncio.wait_for(test(), 30))


def pool(**options: Any) -> UpstreamPool:
    return UpstreamPool(connect_timeout=options.pop("connect_timeout", 5.0), read_timeout=5.0, **options)


def whole(body: bytes, *extra: str) -> bytes:
    head = ["HTTP/1.1 200 OK", f"content-length: {len(body)}", "content-type: application/json", *extra]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


def chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


async def answer_each(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, server: Server) -> None:
    """Keep-alive: answer every request on the connection with its own body echoed."""
    while (request := await server.read_request(reader)) is not None:
        writer.write(whole(request.split(b"\r\n\r\n", 1)[1]))
        await writer.drain()


def test_a_kept_connection_serves_the_next_request() -> None:
    async def test() -> None:
        async with Server(answer_each) as server:
            upstream = pool()
            for body in (b'{"n": 1}', b'{"n": 2}', b'{"n": 3}'):
                answer = await upstream.post(server.url, body, {"content-type": "application/json"})
                assert answer.status_code == 200 and answer.headers["content-type"] == "application/json"
                assert await answer.aread() == body
            assert server.connections == 1
            head = server.requests[0].split(b"\r\n\r\n")[0].decode()
            assert head.splitlines()[0] == "POST /v1/completions HTTP/1.1"
            assert f"host: 127.0.0.1:{server.port}" in head and "content-type: application/json" in head
            await upstream.aclose()

    run(test)


def test_the_relay_runs_on_uvloop_too() -> None:
    """uvicorn runs the router on uvloop where it is installed (the route extra brings it); its transports
    are not asyncio.Transport subclasses."""
    try:
        import uvloop
    except ImportError:
        if os.environ.get("CI") == "true":
            raise
        pytest.skip("uvloop is not installed (the route extra brings it)")

    async def test() -> None:
        async with Server(answer_each) as server:
            upstream = pool()
            for body in (b"1", b"2"):
                answer = await upstream.post(server.url, body, {})
                assert await answer.aread() == body
            assert server.connections == 1
            await upstream.aclose()

    run(test, uvloop.new_event_loop)


def test_a_streamed_answer_arrives_piece_by_piece_as_it_is_sent() -> None:
    async def test() -> None:
        more = asyncio.Event()

        async def stream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, server: Server) -> None:
            await server.read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ncontent-type: text/event-stream\r\n\r\n")
            writer.write(chunk(b"data: one\n\n"))
            await writer.drain()
            await more.wait()  # the client must have the first piece before the second is sent
            writer.write(chunk(b"data: two\n\n") + chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
            await writer.drain()
            await server.read_request(reader)  # the connection stays open, kept alive

        async with Server(stream) as server:
            upstream = pool()
            answer = await upstream.post(server.url, b"{}", {})
            pieces = aiter(answer)
            assert await anext(pieces) == b"data: one\n\n"
            more.set()
            rest = [piece async for piece in pieces]
            assert b"".join(rest) == b"data: two\n\ndata: [DONE]\n\n"
            await answer.aclose()
            assert upstream.figures() == {"open": 1, "idle": 1}
            await upstream.aclose()

    run(test)


def test_an_answer_closed_before_its_end_closes_its_connection() -> None:
    async def test() -> None:
        async def held(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, server: Server) -> None:
            await server.read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n" + chunk(b"data: one\n\n"))
            await writer.drain()
            if await reader.read(1) == b"":  # the client let go of the stream: the connection ends
                server.closed.set()

        async with Server(held) as server:
            upstream = pool()
            answer = await upstream.post(server.url, b"{}", {})
            assert await anext(aiter(answer)) == b"data: one\n\n"
            await answer.aclose()
            await server.closed.wait()
            assert upstream.figures() == {"open": 0, "idle": 0}

    run(test)


@pytest.mark.parametrize(
    ("answer", "error", "words"),
    [
        (b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nshort", httpx.RemoteProtocolError, "before the answer's end"),
        (b"this is not HTTP\r\n\r\n", httpx.RemoteProtocolError, "malformed"),
        (b"", httpx.RemoteProtocolError, "before the answer's end"),
    ],
)
def test_a_broken_answer_raises_httpx_s_error_for_the_monitor(answer: bytes, error: type, words: str) -> None:
    async def test() -> None:
        async def broken(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, server: Server) -> None:
            await server.read_request(reader)
            writer.write(answer)
            await writer.drain()

        async with Server(broken) as server:
            upstream = pool()
            with pytest.raises(error, match=words):
                reply = await upstream.post(server.url, b"{}", {})
                await reply.aread()
            assert upstream.figures() == {"open": 0, "idle": 0}

    run(test)


def test_a_silent_replica_is_a_read_timeout_and_a_refused_one_a_connect_error() -> None:
    async def test() -> None:
        async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, server: Server) -> None:
            await server.read_request(reader)
            await reader.read(1)  # never answers; returns when the client gives up

        async with Server(silent) as server:
            upstream = UpstreamPool(connect_timeout=5.0, read_timeout=0.05)
            with pytest.raises(httpx.ReadTimeout, match="sent nothing for 0.05 s"):
                await upstream.post(server.url, b"{}", {})
            port = server.port
        refused = pool()
        with pytest.raises(httpx.ConnectError, match=f"127.0.0.1:{port}"):
            await refused.post(f"http://127.0.0.1:{port}/v1/completions", b"{}", {})

    run(test)


def test_connection_close_is_honoured_and_credentials_go_as_basic_auth() -> None:
    async def test() -> None:
        async def once(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, server: Server) -> None:
            await server.read_request(reader)
            writer.write(whole(b"{}", "connection: close"))
            await writer.drain()

        async with Server(once) as server:
            upstream = pool()
            url = server.url.replace("http://", "http://ops:pa%2055@")
            for _ in range(2):
                reply = await upstream.post(url, b"{}", {"authorization": "Bearer client-key"})
                assert await reply.aread() == b"{}"
            assert server.connections == 2  # the first answer said close: nothing was kept
            expected = "authorization: Basic " + base64.b64encode(b"ops:pa 55").decode()
            heads = [request.split(b"\r\n\r\n")[0].decode() for request in server.requests]
            assert all(expected in head and "client-key" not in head for head in heads)

    run(test)


def test_a_reader_that_falls_behind_stops_the_socket_being_read() -> None:
    async def test() -> None:
        piece = b"x" * 65536
        count = 4 * HIGH_WATER // len(piece)

        async def flood(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, server: Server) -> None:
            await server.read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
            for _ in range(count):
                writer.write(chunk(piece))
                await writer.drain()
            writer.write(b"0\r\n\r\n")
            await writer.drain()

        async with Server(flood) as server:
            upstream = pool()
            answer = await upstream.post(server.url, b"{}", {})
            paused = asyncio.get_running_loop().create_future()
            transport = answer.transport
            assert transport is not None
            original = transport.pause_reading

            def pause() -> None:
                original()
                if not paused.done():
                    paused.set_result(answer._queued)

            transport.pause_reading = pause  # type: ignore[method-assign]
            queued = await paused  # nothing was read: the connection stopped past the high-water mark
            assert HIGH_WATER < queued <= HIGH_WATER + len(piece) + 64
            total = sum([len(p) async for p in answer])
            assert total == count * len(piece)
            await upstream.aclose()

    run(test)
