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
from kvpool.router.upstream import UpstreamAnswer, UpstreamPool
from kvpool.router.usage import UsageScanner, cached_tokens_of

if TYPE_CHECKING:
    import httpx
    from starlette.requests import Request
    from starlette.responses import Response
    from starlette.types import Receive, Scope, Send

__all__ = ["Relay", "RelayedStream", "first_answer"]

log = logging.getLogger("kvpool.route")

# Response headers that describe one hop, not the answer; ``date`` and ``server`` are the replica's server's,
# and the router's own server writes its own (copied, a client would get each twice).
_HOP_HEADERS = frozenset(
    {"connection", "keep-alive", "transfer-encoding", "content-length", "content-encoding", "date", "server"}
)
# Request headers passed on to the replica.
_FORWARDED = ("authorization", "content-type", "accept")


def _answer_headers(response: httpx.Response | UpstreamAnswer) -> dict[str, str]:
    return {k: v for k, v in response.headers.items() if k.lower() not in _HOP_HEADERS}


class Relay:
    """The router's HTTP clients to its replicas: each request to the best replica that takes it, with retries.

    Requests go out on :class:`~kvpool.router.upstream.UpstreamPool`'s connections; the
    httpx client (:attr:`client`) serves the monitor and the router's own GETs.

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
        self._upstream: UpstreamPool | None = None

    @property
    def client(self) -> httpx.AsyncClient:
        assert self._client is not None, "the router's HTTP client is opened by the app's lifespan"
        return self._client

    def open(self) -> httpx.AsyncClient:
        """The client, opened: a replica silent for ``upstream_timeout`` seconds fails the request."""
        import httpx

        options = self.options
        # read: the longest silence from a replica (a stuck one must not hold a request, or a slot, for ever)
        timeout = httpx.Timeout(options.health_timeout, connect=options.connect_timeout, read=options.upstream_timeout)
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        self._client = httpx.AsyncClient(timeout=timeout, limits=limits)
        self._upstream = UpstreamPool(connect_timeout=options.connect_timeout, read_timeout=options.upstream_timeout)
        return self._client

    async def close(self) -> None:
        if self._upstream is not None:
            await self._upstream.aclose()
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
        ranked = self.bookkeeping.choose(keys)  # the first choice reserved on every router's board
        retries = 1  # after a failure the replica may have seen; refused connections do not count
        for position, (replica, cached) in enumerate(ranked):
            if not replica.up:
                continue  # marked down while an earlier choice was being tried
            self.bookkeeping.check_hashes(replica)
            try:
                response = await self._send(replica, path, body, headers, stream, keys, cached)
            except httpx.TransportError as exc:
                errors.append(f"{replica.url}: {type(exc).__name__}")
                if not isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout):
                    if not retries:
                        break
                    retries -= 1
                continue
            if response.status_code >= 500:
                replica.stats.server_errors += 1
                self.monitor.failed(replica, f"answered {response.status_code}")
                if retries and any(r.up for r, _ in ranked[position + 1 :]):
                    retries -= 1
                    self.bookkeeping.unsent(replica, keys)
                    errors.append(f"{replica.url}: answered {response.status_code}")
                    await response.aclose()
                    continue
            else:
                self.monitor.succeeded(replica)
            return self._answer(replica, response, keys, cached, path, stream)
        return self._unavailable(errors)

    async def _send(
        self,
        replica: Replica,
        path: str,
        body: bytes,
        headers: dict[str, str],
        stream: bool,
        keys: PromptKeys,
        cached: int,
    ) -> UpstreamAnswer:
        """``replica``'s answer (its headers; all of it unless ``stream``); a transport error is told to the monitor.

        The request's uncached prompt tokens are reserved at ``replica`` as it is sent (its prefill pending).
        """
        import httpx

        assert self._upstream is not None, "the relay's connections are opened by the app's lifespan"
        self.bookkeeping.sent(replica, keys, cached)
        try:
            response = await self._upstream.post(replica.base + path, body, headers)
            if not stream:
                await response.aread()
        except httpx.TransportError as exc:
            self.bookkeeping.unsent(replica, keys)
            replica.stats.transport_errors += 1
            self.monitor.suspect(replica, exc)
            raise
        except BaseException:
            self.bookkeeping.unsent(replica, keys)
            raise
        return response

    def _answer(
        self, replica: Replica, response: UpstreamAnswer, keys: PromptKeys, cached: int, path: str, stream: bool
    ) -> Response | RelayedStream:
        """``replica``'s answer on its way to the client: whole, or as a stream that closes the upstream however it ends."""
        from starlette.responses import Response, StreamingResponse

        predicted = self.bookkeeping.accepted(replica, keys, cached)
        log.debug("%s -> %s (%d cached blocks, %d tokens predicted)", path, replica.url, cached, predicted)
        out_headers = _answer_headers(response)
        out_headers["x-kvpool-replica"] = replica.url
        if not stream:
            self.bookkeeping.ended(replica, keys)
            if response.status_code == 200:
                self.bookkeeping.answered(replica, keys, predicted, cached_tokens_of(response.content))
            return Response(response.content, status_code=response.status_code, headers=out_headers)
        upstream = _Upstream(replica, response, functools.partial(self.bookkeeping.ended, replica, keys))
        scanner = UsageScanner() if response.status_code == 200 else None
        relay = StreamingResponse(
            self._relay(upstream, scanner, keys, predicted), status_code=response.status_code, headers=out_headers
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
        import httpx

        chunks = upstream.response
        first_token = self.bookkeeping.first_token
        started = False  # the first chunk: the request's prompt is computed, its prefill no longer pending
        try:
            if scanner is None:
                async for chunk in chunks:
                    if not started:
                        started = True
                        first_token(keys)
                    yield chunk
            else:
                feed = scanner.feed
                async for chunk in chunks:
                    if not started:
                        started = True
                        first_token(keys)
                    feed(chunk)
                    yield chunk
                self.bookkeeping.answered(upstream.replica, keys, predicted, scanner.cached_tokens)
        except httpx.TransportError as exc:
            # Bytes already went to the client: the request cannot move. End the stream; the
            # client sees it cut short, and the replica is checked.
            self.monitor.suspect(upstream.replica, exc)
        finally:
            await upstream.close()


class _Upstream:
    """A replica's streamed answer, closed exactly once however its relay ends (the in-flight count with it)."""

    __slots__ = ("replica", "response", "_open", "_ended")

    def __init__(self, replica: Replica, response: UpstreamAnswer, ended: Callable[[], None]) -> None:
        self.replica = replica
        self.response = response
        self._open = True
        self._ended = ended  # the bookkeeping's note that the request is out of flight and its blocks settled

    async def close(self) -> None:
        if self._open:
            self._open = False
            self._ended()
            await self.response.aclose()


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


async def first_answer(
    client: httpx.AsyncClient,
    replicas: Sequence[Replica],
    monitor: ReplicaMonitor,
    path: str,
    *,
    authorization: str | None,
    timeout: float,
) -> Response:
    """A GET (``/v1/models``) answered by the first replica up, in ``timeout`` seconds each.

    ``authorization`` is passed on when given; a replica that fails the GET is told to ``monitor``.
    """
    import httpx
    from starlette.responses import JSONResponse, Response

    headers = {"authorization": authorization} if authorization else {}
    for replica in [r for r in replicas if r.up]:  # a replica marked down gets nothing
        try:
            response = await client.get(replica.base + path, headers=headers, timeout=timeout)
        except httpx.TransportError as exc:
            monitor.suspect(replica, exc)
            continue
        return Response(response.content, status_code=response.status_code, headers=_answer_headers(response))
    return JSONResponse(
        error_body("no replica answers", type="service_unavailable", code="no_replica"), status_code=503
    )
