"""A request's bytes sent on to a replica, and its answer (whole, or streamed as it comes) back to the client.

A request that failed before any byte reached the client (a transport error, or an
answer with a status of 500 or more) is retried once, on the next best replica; a
refused connection (the request never reached the replica) does not use up that retry,
so the request moves on until a replica takes it. Once a byte was streamed to the
client the request never moves: its stream ends there. Every failure is told to the
:class:`~kvpool.router.monitor.ReplicaMonitor`, which takes a replica out of rotation
by its rules; the last 5xx answer is passed on as it came when no retry is left.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TYPE_CHECKING

from kvpool.openai_http import error_body
from kvpool.router.bookkeeping import Bookkeeping
from kvpool.router.monitor import ReplicaMonitor
from kvpool.router.ranking import PromptKeys, Ranker
from kvpool.router.replicas import Replica
from kvpool.router.route_options import RouteOptions
from kvpool.router.usage import UsageScanner, cached_tokens_of

if TYPE_CHECKING:
    import aiohttp
    import httpx
    from starlette.requests import Request
    from starlette.responses import Response
    from starlette.types import Receive, Scope, Send

__all__ = ["Relay", "RelayedStream"]

log = logging.getLogger("kvpool.route")

# Response headers that describe one hop, not the answer; ``date`` and ``server`` are the replica's server's,
# and the router's own server writes its own (copied, a client would get each twice).
_HOP_HEADERS = frozenset(
    {"connection", "keep-alive", "transfer-encoding", "content-length", "content-encoding", "date", "server"}
)
# Request headers passed on to the replica.
_FORWARDED = ("authorization", "content-type", "accept")


def _answer_headers(response: httpx.Response | aiohttp.ClientResponse) -> dict[str, str]:
    return {k: v for k, v in response.headers.items() if k.lower() not in _HOP_HEADERS}


def _as_httpx(error: BaseException) -> httpx.TransportError:
    """An aiohttp client failure as the httpx exception a router's monitor reads: refused, timed out, or broken."""
    import aiohttp
    import httpx

    message = str(error) or type(error).__name__
    if isinstance(error, aiohttp.ConnectionTimeoutError):
        return httpx.ConnectTimeout(message)
    if isinstance(error, aiohttp.ClientConnectorError):
        return httpx.ConnectError(message)
    if isinstance(error, TimeoutError):  # aiohttp's read timeout is one too
        return httpx.ReadTimeout(message)
    if isinstance(error, aiohttp.ServerDisconnectedError | aiohttp.ClientPayloadError):
        return httpx.RemoteProtocolError(message)
    return httpx.ReadError(message)


class Relay:
    """The router's HTTP client to its replicas: each request to the best replica that takes it, with retries.

    ``no_replica`` counts the requests answered 503 because no replica was up.
    """

    def __init__(
        self,
        options: RouteOptions,
        replicas: Sequence[Replica],
        ranker: Ranker,
        bookkeeping: Bookkeeping,
        monitor: ReplicaMonitor,
    ) -> None:
        self.options = options
        self.replicas = replicas
        self.ranker = ranker
        self.bookkeeping = bookkeeping
        self.monitor = monitor
        self.no_replica = 0
        self._client: httpx.AsyncClient | None = None
        self._session: aiohttp.ClientSession | None = None

    @property
    def client(self) -> httpx.AsyncClient:
        assert self._client is not None, "the router's HTTP client is opened by the app's lifespan"
        return self._client

    def open(self) -> httpx.AsyncClient:
        """The clients, opened (in the running loop): aiohttp's for the requests, a replica silent for
        ``upstream_timeout`` seconds failing its request; httpx's, returned, for GETs and health checks."""
        import aiohttp
        import httpx

        options = self.options
        # read: the longest silence from a replica (a stuck one must not hold a request, or a slot, for ever)
        timeout = httpx.Timeout(options.health_timeout, connect=options.connect_timeout, read=options.upstream_timeout)
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        self._client = httpx.AsyncClient(timeout=timeout, limits=limits)
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, use_dns_cache=True),
            timeout=aiohttp.ClientTimeout(
                total=None, connect=options.connect_timeout, sock_read=options.upstream_timeout
            ),
            auto_decompress=False,  # bytes pass through as the replica encoded them, as with httpx's raw stream
            skip_auto_headers=("User-Agent", "Content-Type", "Accept-Encoding"),
        )
        return self._client

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
        if self._client is not None:
            await self._client.aclose()

    async def forward(self, request: Request, body: bytes, keys: PromptKeys, stream: bool) -> Response | RelayedStream:
        """Send ``body`` to the best replica that is up; when it fails before any byte was answered, to the next.

        The retry rule is the module's: one retry after a failure where the request may have
        reached the replica (a 5xx, a broken connection, a timeout), any number after refused
        connections. With no replica up, or every one tried failing, the answer is a 503 in
        OpenAI's error shape; a 5xx with no retry left is passed on as it came.
        """
        import httpx

        headers = {name: request.headers[name] for name in _FORWARDED if name in request.headers}
        path = request.url.path
        errors: list[str] = []
        ranked = self.ranker.rank(keys)
        retries = 1  # after a failure the replica may have seen; refused connections do not count
        for position, (replica, cached) in enumerate(ranked):
            if not replica.up:
                continue  # marked down while an earlier choice was being tried
            self.bookkeeping.check_hashes(replica)
            try:
                response, content = await self._send(replica, path, body, headers, stream)
            except httpx.TransportError as exc:
                errors.append(f"{replica.url}: {type(exc).__name__}")
                if not isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout):
                    if not retries:
                        break
                    retries -= 1
                continue
            if response.status >= 500:
                replica.stats.server_errors += 1
                self.monitor.failed(replica, f"answered {response.status}")
                if retries and any(r.up for r, _ in ranked[position + 1 :]):
                    retries -= 1
                    self.bookkeeping.unsent(replica)
                    errors.append(f"{replica.url}: answered {response.status}")
                    response.close()
                    continue
            else:
                self.monitor.succeeded(replica)
            return self._answer(replica, response, content, keys, cached, path, stream)
        return self._unavailable(errors)

    async def _send(
        self, replica: Replica, path: str, body: bytes, headers: dict[str, str], stream: bool
    ) -> tuple[aiohttp.ClientResponse, bytes]:
        """``replica``'s answer and, unless ``stream``, its whole body (else ``b""``: the body is still to read);
        a transport error is told to the monitor and raised as httpx's."""
        import aiohttp

        assert self._session is not None, "the router's HTTP client is opened by the app's lifespan"
        self.bookkeeping.sent(replica)
        response: aiohttp.ClientResponse | None = None
        try:
            response = await self._session.post(replica.base + path, data=body, headers=headers)
            content = b"" if stream else await response.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            if response is not None:
                response.close()
            self.bookkeeping.unsent(replica)
            replica.stats.transport_errors += 1
            error = _as_httpx(exc)
            self.monitor.suspect(replica, error)
            raise error from exc
        except BaseException:
            if response is not None:
                response.close()
            self.bookkeeping.unsent(replica)
            raise
        return response, content

    def _answer(
        self,
        replica: Replica,
        response: aiohttp.ClientResponse,
        content: bytes,
        keys: PromptKeys,
        cached: int,
        path: str,
        stream: bool,
    ) -> Response | RelayedStream:
        """``replica``'s answer on its way to the client: whole, or as a stream that closes the upstream however it ends."""
        from starlette.responses import Response, StreamingResponse

        predicted = self.bookkeeping.accepted(replica, keys, cached)
        log.debug("%s -> %s (%d cached blocks, %d tokens predicted)", path, replica.url, cached, predicted)
        out_headers = _answer_headers(response)
        out_headers["x-kvpool-replica"] = replica.url
        if not stream:
            self.bookkeeping.ended(replica, keys)
            if response.status == 200:
                self.bookkeeping.answered(replica, keys, predicted, cached_tokens_of(content))
            return Response(content, status_code=response.status, headers=out_headers)
        upstream = _Upstream(replica, response, functools.partial(self.bookkeeping.ended, replica, keys))
        scanner = UsageScanner() if response.status == 200 else None
        relay = StreamingResponse(
            self._relay(upstream, scanner, keys, predicted), status_code=response.status, headers=out_headers
        )
        return RelayedStream(relay, upstream)

    def _unavailable(self, errors: list[str]) -> Response:
        from starlette.responses import JSONResponse

        if not errors:
            self.no_replica += 1
            message = "no replica is up" if self.replicas else "no replica is configured"
        else:
            message = "no replica could take the request: " + "; ".join(errors)
        return JSONResponse(error_body(message, type="service_unavailable", code="no_replica"), status_code=503)

    async def _relay(
        self, upstream: _Upstream, scanner: UsageScanner | None, keys: PromptKeys, predicted: int
    ) -> AsyncIterator[bytes]:
        """The replica's bytes as they arrive; closing early (a client gone) closes the upstream request too."""
        import aiohttp

        read = upstream.response.content.readany
        try:
            if scanner is None:
                while chunk := await read():
                    yield chunk
            else:
                feed = scanner.feed
                while chunk := await read():
                    feed(chunk)
                    yield chunk
                self.bookkeeping.answered(upstream.replica, keys, predicted, scanner.cached_tokens)
            upstream.complete = True
        except (aiohttp.ClientError, TimeoutError) as exc:
            # Bytes already went to the client: the request cannot move. End the stream; the
            # client sees it cut short, and the replica is checked.
            self.monitor.suspect(upstream.replica, _as_httpx(exc))
        finally:
            await upstream.close()

    async def forward_get(self, path: str, authorization: str | None) -> Response:
        """A GET (``/v1/models``) answered by the first replica that is up."""
        import httpx
        from starlette.responses import JSONResponse, Response

        headers = {"authorization": authorization} if authorization else {}
        for replica in [r for r in self.replicas if r.up]:  # a replica marked down gets nothing
            try:
                response = await self.client.get(
                    replica.base + path, headers=headers, timeout=self.options.health_timeout
                )
            except httpx.TransportError as exc:
                self.monitor.suspect(replica, exc)
                continue
            return Response(response.content, status_code=response.status_code, headers=_answer_headers(response))
        return JSONResponse(
            error_body("no replica answers", type="service_unavailable", code="no_replica"), status_code=503
        )


class _Upstream:
    """A replica's streamed answer, closed exactly once however its relay ends (the in-flight count with it).

    ``complete``: its body was read to the end, so its connection goes back to the pool; otherwise
    (a client gone, a broken stream) the connection is closed, and the replica stops generating.
    """

    __slots__ = ("replica", "response", "complete", "_open", "_ended")

    def __init__(self, replica: Replica, response: aiohttp.ClientResponse, ended: Callable[[], None]) -> None:
        self.replica = replica
        self.response = response
        self.complete = False
        self._open = True
        self._ended = ended  # the bookkeeping's note that the request is out of flight and its blocks settled

    async def close(self) -> None:
        if self._open:
            self._open = False
            self._ended()
            if self.complete:
                self.response.release()
            else:
                self.response.close()


class RelayedStream:
    """The streamed response, as an ASGI app that closes its upstream even when the stream never started.

    (A client that goes away before the first chunk cancels the response before its
    generator runs, so the generator's own ``finally`` would never close the upstream.)
    """

    __slots__ = ("inner", "upstream")

    def __init__(self, inner: Response, upstream: _Upstream) -> None:
        self.inner = inner
        self.upstream = upstream

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self.inner(scope, receive, send)
        finally:
            await self.upstream.close()
