"""The router's HTTP/1.1 connections to its replicas: a request's bytes out, its answer back as it arrives.

This is the relay's hot path, and nothing else uses it. A streamed completion is dozens of
small chunks, and through httpx each one cost the router about 0.3 ms of CPU (a cancel
scope and several layers of streams per read, BENCHMARKS.md); here a chunk is one
``data_received`` call, one pass of httptools' C parser, and one wake-up of the reader.

What it keeps of httpx's behaviour, because the relay's and the monitor's rules read it:

- Failures raise httpx's own exception types (the monitor tells a refused connection from
  a timeout from a broken answer by them): :class:`httpx.ConnectError` (refused or
  unreachable), :class:`httpx.ConnectTimeout`, :class:`httpx.ReadTimeout` (the replica
  silent for ``read_timeout`` seconds, while the headers or the body are awaited),
  :class:`httpx.RemoteProtocolError` (a malformed answer, or one cut short).
- Connections are kept alive per replica, at most ``keepalive`` idle ones each; an answer
  closed before its end closes its connection (the replica sees the client go), and a
  connection the replica closed while idle is never reused.
- Credentials in a replica's URL (``http://user:password@host``) go as HTTP basic
  authentication, in place of any ``Authorization`` passed on.
- A reader that falls behind stops the socket being read past :data:`HIGH_WATER` bytes
  queued, so a slow client slows its replica instead of filling the router's memory.
"""

from __future__ import annotations

import asyncio
import base64
import ssl
from collections import deque
from collections.abc import AsyncIterator, Mapping
from typing import Any, cast
from urllib.parse import unquote, urlsplit

__all__ = ["HIGH_WATER", "UpstreamAnswer", "UpstreamPool"]

#: Bytes of an answer queued unread before the connection stops reading the socket.
HIGH_WATER = 1 << 20


def _errors() -> Any:
    import httpx  # the route extra's; imported when the first request goes out

    return httpx


class UpstreamAnswer(asyncio.Protocol):
    """One connection to a replica and the answer in progress on it (one answer at a time).

    ``status_code`` and ``headers`` are set once the headers arrived; the body is read
    with :meth:`aread` (whole) or by iterating (each piece as it arrives, or all that
    arrived since the last one; chunked encoding removed). :meth:`aclose` returns a finished connection to its pool and closes
    any other.
    """

    def __init__(self, pool: UpstreamPool, key: tuple[str, str, int]) -> None:
        from httptools import HttpResponseParser

        self._pool = pool
        self._key = key
        self._loop = asyncio.get_running_loop()
        self._parser = HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.status_code = 0
        self._header_list: list[tuple[str, str]] = []
        self.headers: dict[str, str] = {}
        self.content = b""
        self._chunks: deque[bytes] = deque()
        self._queued = 0
        self._paused = False
        self._headers_done = False
        self._complete = False
        self._error: Exception | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._deadline = 0.0  # the loop's time by which the replica must have sent something
        self._timer: asyncio.TimerHandle | None = None
        self._reusable = False
        self._closed = False
        self._busy = False  # between a request sent and its answer closed

    # -- asyncio's side --------------------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # a TCP connection's transport: asyncio's, or uvloop's (which does not subclass asyncio.Transport)
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        if self._complete or self._closed or not self._busy:
            self._fail(_errors().RemoteProtocolError("the replica sent bytes that answer no request"))
            return
        self._deadline = self._loop.time() + self._pool.read_timeout
        from httptools import HttpParserError

        try:
            self._parser.feed_data(data)
        except HttpParserError as exc:
            self._fail(_errors().RemoteProtocolError(f"a malformed answer: {exc}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed = True
        self._reusable = False
        self._pool.forget(self._key, self)
        if not self._complete:
            why = f": {exc}" if exc is not None else ""
            self._fail(_errors().RemoteProtocolError(f"the replica closed the connection before the answer's end{why}"))

    def pause_writing(self) -> None:  # the request body is written whole; nothing to pause
        pass

    def resume_writing(self) -> None:
        pass

    # -- httptools' callbacks --------------------------------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_list.append((name.decode("latin-1").lower(), value.decode("latin-1")))

    def on_headers_complete(self) -> None:
        self.status_code = self._parser.get_status_code()
        headers: dict[str, str] = {}
        for name, value in self._header_list:
            headers[name] = f"{headers[name]}, {value}" if name in headers else value
        self.headers = headers
        self._headers_done = True
        self._wake()

    def on_body(self, body: bytes) -> None:
        self._chunks.append(body)
        self._queued += len(body)
        if self._queued > HIGH_WATER and not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        self._complete = True
        self._reusable = self._parser.should_keep_alive()
        self._stop_timer()
        self._wake()

    # -- the relay's side ------------------------------------------------------------------------------------------

    def send(self, head: bytes, body: bytes) -> None:
        """Write one request; its answer is then awaited with :meth:`headers_arrived`."""
        assert self.transport is not None
        if self._complete:
            self._reset()  # a kept connection: its last answer was read to its end
        self._busy = True
        self.transport.write(head + body if len(body) < 65536 else head)
        if len(body) >= 65536:
            self.transport.write(body)
        self._deadline = self._loop.time() + self._pool.read_timeout
        self._timer = self._loop.call_at(self._deadline, self._check_silence)

    async def headers_arrived(self) -> None:
        while not self._headers_done:
            await self._wait()

    async def aread(self) -> bytes:
        """The whole body (the connection is then back in its pool, or closed)."""
        parts = []
        async for piece in self:
            parts.append(piece)
        self.content = b"".join(parts)
        await self.aclose()
        return self.content

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self._pieces()

    async def _pieces(self) -> AsyncIterator[bytes]:
        chunks = self._chunks
        while True:
            if chunks:
                # what arrived while the reader was away goes on as one piece: one write to the client, not several
                piece = chunks.popleft() if len(chunks) == 1 else b"".join(chunks)
                chunks.clear()
                self._queued = 0
                if self._paused and self.transport is not None:
                    self._paused = False
                    self.transport.resume_reading()
                yield piece
            elif self._complete:
                return
            else:
                await self._wait()

    async def aclose(self) -> None:
        """Done with the answer: a finished connection goes back to its pool, any other is closed."""
        self._stop_timer()
        self._busy = False
        if self._complete and self._reusable and not self._closed and not self._chunks:
            self._pool.release(self._key, self)
        elif not self._closed:
            self._closed = True
            self._pool.forget(self._key, self)
            if self.transport is not None:
                self.transport.close()

    # -- inside ---------------------------------------------------------------------------------------------------

    async def _wait(self) -> None:
        if self._error is not None:
            raise self._error
        self._waiter = self._loop.create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None
        if self._error is not None and not (self._complete or self._chunks):
            raise self._error

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _fail(self, error: Exception) -> None:
        if self._error is None:
            self._error = error
        self._stop_timer()
        if not self._closed and self.transport is not None:
            self._closed = True
            self._pool.forget(self._key, self)
            self.transport.close()
        self._wake()

    def _check_silence(self) -> None:
        """One timer per answer, moved on lazily: each chunk only writes a new deadline."""
        self._timer = None
        if self._complete or self._closed:
            return
        if self._paused:  # the reader is behind, not the replica: its silence starts when reading resumes
            self._deadline = self._loop.time() + self._pool.read_timeout
        if self._loop.time() < self._deadline:
            self._timer = self._loop.call_at(self._deadline, self._check_silence)
            return
        silent = self._pool.read_timeout
        self._fail(_errors().ReadTimeout(f"the replica sent nothing for {silent:g} s"))

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _reset(self) -> None:
        from httptools import HttpResponseParser

        self._parser = HttpResponseParser(self)
        self.status_code = 0
        self._header_list = []
        self.headers = {}
        self.content = b""
        self._headers_done = self._complete = self._reusable = False
        self._error = None


class UpstreamPool:
    """Kept-alive HTTP/1.1 connections to the replicas, at most ``keepalive`` idle ones per replica.

    ``tls``: the context for ``https`` replicas (None: the system's default certificates,
    loaded once when the first one is met).
    """

    def __init__(
        self, *, connect_timeout: float, read_timeout: float, keepalive: int = 64, tls: ssl.SSLContext | None = None
    ) -> None:
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.keepalive = keepalive
        self._tls = tls
        self._idle: dict[tuple[str, str, int], list[UpstreamAnswer]] = {}
        self._open: set[UpstreamAnswer] = set()

    async def post(self, url: str, body: bytes, headers: Mapping[str, str]) -> UpstreamAnswer:
        """Send ``POST url`` and return once the answer's headers arrived (its body is read from the answer)."""
        parts = urlsplit(url)
        scheme, host = parts.scheme, parts.hostname or ""
        port = parts.port or (443 if scheme == "https" else 80)
        key = (scheme, host, port)
        netloc = host if parts.port is None else f"{host}:{port}"
        if ":" in host:
            netloc = f"[{host}]" if parts.port is None else f"[{host}]:{port}"
        target = parts.path or "/"
        if parts.query:
            target += "?" + parts.query
        lines = [f"POST {target} HTTP/1.1", f"host: {netloc}", f"content-length: {len(body)}"]
        if parts.username is not None:
            pair = f"{unquote(parts.username)}:{unquote(parts.password or '')}".encode()
            headers = {k: v for k, v in headers.items() if k.lower() != "authorization"}
            lines.append("authorization: Basic " + base64.b64encode(pair).decode("ascii"))
        lines += [f"{name}: {value}" for name, value in headers.items()]
        head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
        answer = self._idle_connection(key) or await self._connect(key)
        answer.send(head, body)
        try:
            await answer.headers_arrived()
        except BaseException:
            await answer.aclose()
            raise
        return answer

    def release(self, key: tuple[str, str, int], answer: UpstreamAnswer) -> None:
        idle = self._idle.setdefault(key, [])
        if len(idle) < self.keepalive:
            idle.append(answer)
        else:
            self.forget(key, answer)
            if answer.transport is not None:
                answer.transport.close()

    def forget(self, key: tuple[str, str, int], answer: UpstreamAnswer) -> None:
        self._open.discard(answer)
        idle = self._idle.get(key)
        if idle and answer in idle:
            idle.remove(answer)

    async def aclose(self) -> None:
        for answer in list(self._open):
            if answer.transport is not None:
                answer.transport.close()
        self._open.clear()
        self._idle.clear()

    def figures(self) -> dict[str, int]:
        return {"open": len(self._open), "idle": sum(len(v) for v in self._idle.values())}

    def _idle_connection(self, key: tuple[str, str, int]) -> UpstreamAnswer | None:
        idle = self._idle.get(key)
        while idle:
            answer = idle.pop()
            if not answer._closed:
                return answer
        return None

    async def _connect(self, key: tuple[str, str, int]) -> UpstreamAnswer:
        httpx = _errors()
        scheme, host, port = key
        tls: ssl.SSLContext | None = None
        if scheme == "https":
            if self._tls is None:
                self._tls = httpx.create_ssl_context()
            tls = self._tls
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout):
                _, answer = await loop.create_connection(lambda: UpstreamAnswer(self, key), host, port, ssl=tls)
        except TimeoutError:
            raise httpx.ConnectTimeout(f"no connection to {host}:{port} within {self.connect_timeout:g} s") from None
        except OSError as exc:
            raise httpx.ConnectError(f"cannot connect to {host}:{port}: {exc}") from None
        self._open.add(answer)
        return answer
