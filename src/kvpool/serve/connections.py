"""How long a client may hold a connection, how many it may hold, and whether it is local.

``kvpool serve`` and ``kvpool route`` both run uvicorn, which bounds an idle keep-alive
connection (``timeout_keep_alive``) but has no clock on a connection whose request
headers are still arriving: a client that opens sockets and sends half a request line
keeps each one, and its file descriptor, for ever. :func:`uvicorn_config` builds both
commands' server settings with

* a **header timeout**: a connection that is waiting for a request's headers (it has
  just opened, or its previous response is complete) and has not received all of them
  within ``header_timeout`` seconds is closed;
* a **connection cap**: a connection opened while ``max_connections`` are open is
  answered ``503`` and closed at once (it holds no descriptor), and uvicorn's own
  ``limit_concurrency`` refuses requests past the same bound;
* a bounded **graceful shutdown**: on SIGTERM, open requests get ``shutdown_timeout``
  seconds, then their tasks are cancelled (a router's upstream streams with them).

The HTTP parser is httptools' (C, llhttp) where it imports (the ``serve`` and ``route``
extras install it), h11's (pure Python) otherwise: :class:`HttpParser` chooses, and both
keep the same bounds. A streamed answer's chunks cost the server about half as much CPU on
httptools (its framing is written in one ``bytes`` join, not through h11's state machine).

The operator routes' test of "on this machine" is :func:`kvpool.openai_http.is_loopback`.
"""

from __future__ import annotations

import asyncio
import enum
import signal
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvpool.errors import ConfigError

if TYPE_CHECKING:
    import uvicorn

__all__ = ["ConnectionLimits", "HttpParser", "serve_many", "serve_on", "uvicorn_config"]

#: A connection past the cap gets this answer before it is closed.
_REFUSAL = (
    b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nconnection: close\r\n"
    b'content-length: 75\r\n\r\n{"error":{"message":"too many connections","type":"service_unavailable"}}\n'
)


@dataclass(frozen=True, slots=True, kw_only=True)
class ConnectionLimits:
    """The bounds :func:`uvicorn_config` puts on client connections (seconds and counts).

    ``header_timeout``: seconds a connection may wait for complete request headers.
    ``keep_alive``: seconds an idle connection between requests is kept (no byte sent).
    ``max_connections``: connections open at once; one more is answered 503 and closed.
    ``shutdown_timeout``: seconds open requests get on shutdown before they are cancelled.
    """

    header_timeout: float = 10.0
    keep_alive: int = 5
    max_connections: int = 1024
    shutdown_timeout: int = 10

    def __post_init__(self) -> None:
        value = self.header_timeout
        if not isinstance(value, int | float) or isinstance(value, bool) or not 0 < value < float("inf"):
            raise ConfigError(f"header_timeout must be a positive number of seconds, got {value!r}")
        for name in ("keep_alive", "max_connections", "shutdown_timeout"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ConfigError(f"{name} must be an integer >= 1, got {value!r}")


class HttpParser(enum.Enum):
    """Which HTTP/1.1 parser uvicorn's protocol uses: ``AUTO`` takes httptools when it imports, else h11."""

    AUTO = "auto"
    H11 = "h11"
    HTTPTOOLS = "httptools"

    def resolved(self) -> HttpParser:
        """``self``, with ``AUTO`` made concrete; ``HTTPTOOLS`` when httptools is missing is a ConfigError."""
        if self is HttpParser.H11:
            return self
        try:
            import httptools  # noqa: F401
        except ImportError:
            if self is HttpParser.HTTPTOOLS:
                raise ConfigError("the httptools HTTP parser is not installed (pip install 'kvpool[route]')") from None
            return HttpParser.H11
        return HttpParser.HTTPTOOLS


def _protocol_class(limits: ConnectionLimits, parser: HttpParser = HttpParser.AUTO) -> type[asyncio.Protocol]:
    """uvicorn's protocol for ``parser`` with the header clock and the connection cap (one class per server)."""
    if parser.resolved() is HttpParser.HTTPTOOLS:
        return _httptools_protocol_class(limits)
    return _h11_protocol_class(limits)


class _HeaderClock:
    """What both bounded protocols add to uvicorn's: the connection cap, and a clock on each wait for headers.

    Mixed in before uvicorn's protocol class, which defines ``transport``, ``connections`` and
    ``loop``; ``limits`` is set by the class that mixes it in; ``_headers_overdue`` is its own.
    """

    limits: ConnectionLimits
    transport: asyncio.Transport
    connections: set[Any]
    loop: asyncio.AbstractEventLoop
    _header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)  # type: ignore[misc]  # uvicorn's protocol, after this in the MRO
        if len(self.connections) > self.limits.max_connections:
            self.transport.write(_REFUSAL)
            self.transport.close()
            return
        self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_timer()
        super().connection_lost(exc)  # type: ignore[misc]  # as above

    def _arm_header_timer(self) -> None:
        self._disarm_header_timer()
        self._header_timer = self.loop.call_later(self.limits.header_timeout, self._headers_overdue)

    def _disarm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_overdue(self) -> None:
        raise NotImplementedError


def _httptools_protocol_class(limits: ConnectionLimits) -> type[asyncio.Protocol]:
    """uvicorn's httptools protocol with the header clock and the connection cap."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class BoundedHttpToolsProtocol(_HeaderClock, HttpToolsProtocol):
        """Starts a clock whenever the connection waits for request headers; stops it when they are complete.

        The connection waits for headers from its opening, and again from each complete
        response until the next request's headers are parsed (a pipelined request whose
        headers are already in starts no clock).
        """

        def on_headers_complete(self) -> None:
            self._disarm_header_timer()  # a request's headers are in (its body is the app's to read)
            super().on_headers_complete()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and (self.cycle is None or self.cycle.response_complete):
                self._arm_header_timer()  # the next request's headers are due as well

        def _headers_overdue(self) -> None:
            self._header_timer = None  # only a wait for headers arms it, and complete headers disarm it
            if not self.transport.is_closing():
                self.transport.close()

    BoundedHttpToolsProtocol.limits = limits
    return BoundedHttpToolsProtocol


def _h11_protocol_class(limits: ConnectionLimits) -> type[asyncio.Protocol]:
    """uvicorn's h11 protocol with the header clock and the connection cap."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class BoundedH11Protocol(_HeaderClock, H11Protocol):
        """Starts a clock whenever the connection waits for request headers; stops it when they are complete."""

        def handle_events(self) -> None:
            super().handle_events()
            if self.conn.their_state is not h11.IDLE:
                self._disarm_header_timer()  # a request's headers are in (its body is the app's to read)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
                self._arm_header_timer()  # the next request's headers are due as well

        def _headers_overdue(self) -> None:
            self._header_timer = None
            waiting = self.cycle is None or self.cycle.response_complete
            if waiting and self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.close()

    BoundedH11Protocol.limits = limits
    return BoundedH11Protocol


def uvicorn_config(
    app: Any,
    *,
    host: str,
    port: int,
    limits: ConnectionLimits,
    parser: HttpParser = HttpParser.AUTO,
    **extra: Any,
) -> uvicorn.Config:
    """A uvicorn configuration serving ``app`` on ``host:port`` within ``limits``, parsed by ``parser``
    (``extra``: other settings)."""
    import uvicorn

    return uvicorn.Config(
        app,
        host=host,
        port=port,
        http=_protocol_class(limits, parser),
        timeout_keep_alive=limits.keep_alive,
        limit_concurrency=limits.max_connections + 1,  # uvicorn counts the asking connection itself
        timeout_graceful_shutdown=limits.shutdown_timeout,
        **extra,
    )


def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` and listening; port 0 lets the OS choose a free port, race-free
    (read it back with ``getsockname()``)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except socket.gaierror as exc:
        raise ConfigError(f"cannot listen on host {host!r}: {exc.strerror}") from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return sock


def serve_on(
    config: uvicorn.Config, announce: Callable[[str], None], stopped: Callable[[str], None] | None = None
) -> None:
    """Run ``config``'s server until it stops, on a socket bound before it starts (``config.port`` 0: the OS
    chooses); ``announce`` gets the address it listens on, with the real port, before the first request, and
    ``stopped`` the same address once the server has stopped (its connections closed, the socket too)."""
    import uvicorn

    sock = listening_socket(config.host, config.port)
    url = _url(sock)
    # uvicorn shuts down on SIGTERM, then raises the signal again; its default action would end the process
    # there, before ``stopped``. The handler below only asks the server to stop (a signal landing before
    # uvicorn takes over its signals, or the one it raises again, included) and the exit, with status 143,
    # comes after ``stopped``. Raising from the handler instead could land in any code, a weakref callback
    # that swallows the exit among them. It is set before the announcement, so a signal sent once the
    # address is known always finds it.
    server = uvicorn.Server(config)
    terminated: list[int] = []

    def on_sigterm(signum: int, frame: object) -> None:
        terminated.append(signum)
        server.should_exit = True

    restore = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, on_sigterm)
        restore = signal.SIG_DFL if previous is None else previous
    try:
        announce(url)
        server.run(sockets=[sock])
    finally:
        sock.close()
        if restore is not None:
            signal.signal(signal.SIGTERM, restore)
        if stopped is not None:
            stopped(url)
    if terminated:
        raise SystemExit(128 + terminated[0])


def serve_many(
    configs: list[uvicorn.Config],
    announce: Callable[[str], None],
    stopped: Callable[[str], None] | None = None,
) -> None:
    """Run several servers on one event loop until SIGINT or SIGTERM stops them all (an emulated fleet).

    Every socket is bound before any server starts (port 0: the OS chooses), and ``announce`` gets each
    address, with its real port, in ``configs``' order, one call each; ``stopped`` gets them once every
    server has stopped. A bind that fails closes the sockets already bound and raises ``ConfigError``.
    """
    import contextlib

    import uvicorn

    class FleetServer(uvicorn.Server):
        """A uvicorn server that leaves the signals to :func:`serve_many`, which stops every server at once."""

        @contextlib.contextmanager
        def capture_signals(self) -> Any:
            yield

    sockets: list[socket.socket] = []
    try:
        for config in configs:
            sockets.append(listening_socket(config.host, config.port))
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    urls = [_url(sock) for sock in sockets]
    servers = [FleetServer(config) for config in configs]
    terminated: list[int] = []

    async def run_all() -> None:
        loop = asyncio.get_running_loop()

        def stop(signum: int) -> None:
            terminated.append(signum)
            for server in servers:
                server.should_exit = True

        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(signum, stop, signum)
        await asyncio.gather(*(server.serve(sockets=[sock]) for server, sock in zip(servers, sockets)))

    try:
        for url in urls:
            announce(url)
        asyncio.run(run_all())
    finally:
        for sock in sockets:
            sock.close()
        if stopped is not None:
            for url in urls:
                stopped(url)
    if terminated:
        raise SystemExit(128 + terminated[0])


def _url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}"
