"""The router's HTTP front door: OpenAI's endpoints, each request sent on to the replica that suits it.

For a generation request the router

1. finds the tenant from the API key (the replicas' key file; a missing or wrong key
   is refused here with 401, as a replica would) and derives the request's cache salt
   with :mod:`kvpool.tenancy`;
2. tokenizes the prompt (:mod:`kvpool.router.prompts`) and hashes its full blocks as
   the replicas do;
3. asks the block index how many leading blocks each replica that is up holds, and
   lets the ``prefix`` routing rule (:mod:`kvpool.routing`) weigh that against each
   replica's load; its ties go round the replicas in turn, so new prefixes spread out;
4. forwards the request's bytes unchanged, with the client's ``Authorization``, and
   streams the answer back as it comes. The replica that served writes the usage,
   ``cached_tokens`` included.

A transport error before any byte came back retries the request on the next best
replica; a refused connection marks the replica down at once, a replica silent for
longer than ``upstream_timeout`` is taken out of rotation for ``quarantine`` seconds,
any other error has it checked at once. A replica believed down is never chosen while
one is up.

What a client sends is checked before it costs the router anything: the API key from
the headers (401 before the body is read), a declared ``Content-Length`` over the limit
(413 before the body is read), a chunked body as it arrives (413 as soon as it passes
the limit), and JSON nested too deeply (400). ``/health?verbose=1`` (the index and
event figures) is open on the loopback interface, elsewhere only with an admin key.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvpool.errors import ConfigError
from kvpool.hashing import BlockHash
from kvpool.router.index import BlockIndex
from kvpool.router.index_guard import GuardedIndex, guarded
from kvpool.router.monitor import ReplicaMonitor
from kvpool.router.prompts import Tokenizer, block_hashes
from kvpool.router.replicas import Hashing, Replica
from kvpool.routing import Routing, chooser, prefix_aware
from kvpool.serve.connections import is_loopback
from kvpool.serve.protocol import APIError, Endpoint, GenerationRequest, error_body, parse_generation
from kvpool.tenancy import DEFAULT_TENANT, KeyRing, SaltPolicy, bearer_token

if TYPE_CHECKING:
    import httpx
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import Response
    from starlette.types import Receive, Scope, Send

__all__ = ["RouteOptions", "Router", "build_app"]

log = logging.getLogger("kvpool.route")

# Response headers that describe one hop, not the answer.
_HOP_HEADERS = frozenset({"connection", "keep-alive", "transfer-encoding", "content-length", "content-encoding"})
# Request headers passed on to the replica.
_FORWARDED = ("authorization", "content-type", "accept")


@dataclass(frozen=True, slots=True, kw_only=True)
class RouteOptions:
    """Everything ``kvpool route`` is told on its command line, checked.

    ``load_cost``: cached blocks one request queued or running at a replica is worth
    (the ``prefix`` rule's exchange rate); ``routing``: the rule (the others, for comparison, ignore prefixes). ``admin_key``: sent to the replicas'
    ``/kv-events``, which only their loopback interface may read without one. ``admin_keys``: the keys that
    open the router's own ``/health?verbose=1`` to clients off its loopback interface (None: loopback only).
    ``keys`` None: the replicas are
    single-tenant. ``salts`` must be the replicas' own rule (the same secret file, or
    shared when they run without tenant isolation), or no prefix will ever match.
    ``upstream_timeout``: the longest a replica may stay silent (seconds without a byte: before its
    answer starts, which for a request that does not stream is the whole generation, and between
    streamed chunks); one that does is out of rotation for ``quarantine`` seconds.
    """

    replicas: tuple[str, ...]
    tokenizer: Tokenizer | None
    keys: KeyRing | None
    salts: SaltPolicy
    load_cost: float = 8.0
    admin_key: str | None = None
    admin_keys: KeyRing | None = None
    routing: Routing = Routing.PREFIX
    health_interval: float = 0.5
    health_timeout: float = 2.0
    connect_timeout: float = 2.0
    upstream_timeout: float = 300.0
    quarantine: float = 30.0
    max_body_bytes: int = 8 * 2**20

    def __post_init__(self) -> None:
        for name in ("health_interval", "health_timeout", "connect_timeout", "upstream_timeout", "quarantine"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or isinstance(value, bool) or not 0 < value < float("inf"):
                raise ConfigError(f"{name} must be a positive number of seconds, got {value!r}")


class Router:
    """Routing state: the replicas, the block index, the rule; one per ``kvpool route`` process."""

    def __init__(self, options: RouteOptions, index: BlockIndex) -> None:
        self.options = options
        self.index = guarded(index)  # a shared index that fails routes by load
        self.replicas = [Replica(url) for url in options.replicas]
        self.rule = chooser(options.routing, load_cost=options.load_cost)
        self.monitor = ReplicaMonitor(
            self.replicas,
            self.index,
            options.health_interval,
            options.health_timeout,
            options.admin_key,
            quarantine=options.quarantine,
        )
        if isinstance(self.index, GuardedIndex):
            self.index.on_recovered = self.monitor.resync  # entries lost in an outage come back from the replicas
        self._client: httpx.AsyncClient | None = None
        self._loading: asyncio.Future[None] | None = None

    @property
    def client(self) -> httpx.AsyncClient:
        assert self._client is not None, "the router's HTTP client is opened by the app's lifespan"
        return self._client

    async def start(self) -> None:
        import httpx

        options = self.options
        # read: the longest silence from a replica (a stuck one must not hold a request, or a slot, for ever)
        timeout = httpx.Timeout(options.health_timeout, connect=options.connect_timeout, read=options.upstream_timeout)
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        self._client = httpx.AsyncClient(timeout=timeout, limits=limits)
        await self.monitor.start(self._client)
        if self.options.tokenizer is not None:
            # Seconds (transformers loads); until then requests are routed by load alone.
            self._loading = asyncio.get_running_loop().run_in_executor(None, self._load_tokenizer)

    def _load_tokenizer(self) -> None:
        assert self.options.tokenizer is not None
        try:
            self.options.tokenizer.load()
            log.info("tokenizer loaded: routing by cached prefix")
        except Exception as exc:  # noqa: BLE001 - any failure leaves the router routing by load, and says so
            log.warning("the tokenizer did not load (%r): routing by load only", exc)

    async def stop(self) -> None:
        await self.monitor.stop()
        if self._client is not None:
            await self._client.aclose()

    def figures(self) -> dict[str, Any]:
        """What ``/health?verbose=1`` adds: the index per replica and each replica's event stream."""
        return {
            "index_blocks": {r.url: self.index.num_blocks(r.url) for r in self.replicas},
            "index": self.index.figures(),
            "events": {url: feed.figures() for url, feed in self.monitor.feeds.items()},
        }

    # -- choosing -------------------------------------------------------------------------

    @property
    def prefix_routing(self) -> bool:
        """Whether requests are routed by cached prefix now: a tokenizer loaded and a replica's hashing known."""
        tokenizer = self.options.tokenizer
        if self.options.routing is not Routing.PREFIX or tokenizer is None:
            return False
        return tokenizer.loaded and bool(self.monitor.hashers())

    def require_operator(self, request: Request) -> None:
        """The loopback interface, or an admin key: what sees the index and the replicas' event figures."""
        if request.client is not None and is_loopback(request.client.host):
            return
        admin = self.options.admin_keys
        if admin is None:
            raise APIError(403, "this route is open on the loopback interface only", type="permission_error")
        if admin.name_for(bearer_token(request.headers.get("authorization"))) is None:
            raise APIError(401, "this route needs an admin key", type="authentication_error", code="invalid_api_key")

    async def read_body(self, request: Request) -> bytes:
        """The request body, refused with 413 as soon as it is known to be over the limit (nothing more read)."""
        limit = self.options.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None:
            if not declared.strip().isdigit():
                raise APIError(400, f"Content-Length is not a byte count: {declared!r}", code="invalid_request")
            if int(declared) > limit:
                raise APIError(
                    413, f"the request body is {int(declared)} bytes; the limit is {limit}", code="request_too_large"
                )
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise APIError(413, f"the request body is over {limit} bytes", code="request_too_large")
        return bytes(body)

    def tenant(self, authorization: str | None) -> str:
        """The tenant an ``Authorization`` header names; raises 401 for a missing or unknown key."""
        if self.options.keys is None:
            return DEFAULT_TENANT
        key = bearer_token(authorization)
        if key is None:
            raise APIError(
                401,
                "missing API key: send it as 'Authorization: Bearer KEY'",
                type="authentication_error",
                code="invalid_api_key",
            )
        tenant = self.options.keys.name_for(key)
        if tenant is None:
            raise APIError(401, "incorrect API key", type="authentication_error", code="invalid_api_key")
        return tenant

    def prompt_hashes(self, request: GenerationRequest, tenant: str) -> dict[Hashing, list[BlockHash]]:
        """The request's block hashes under each hashing the replicas use (usually one); empty until tokenized."""
        tokenizer = self.options.tokenizer
        if tokenizer is None or not tokenizer.loaded or self.options.routing is not Routing.PREFIX:
            return {}
        if request.messages is not None:
            tokens = tokenizer.chat_tokens(request.messages)
        elif isinstance(request.prompt, str):
            tokens = tokenizer.text_tokens(request.prompt)
        else:
            tokens = list(request.prompt or ())
        salt = self.options.salts.cache_salt(tenant, request.cache_salt)
        return {hashing: block_hashes(hasher, tokens, salt) for hashing, hasher in self.monitor.hashers().items()}

    def rank(self, hashes: dict[Hashing, list[BlockHash]]) -> list[tuple[Replica, int]]:
        """Replicas in the order to try them, each with the blocks of the prompt it holds.

        Replicas that are up come first, best first by the ``prefix`` rule; those believed
        down follow (tried only when every replica that is up has failed).
        """
        candidates = [r for r in self.replicas if r.up]
        down = [r for r in self.replicas if not r.up]
        ranked: list[tuple[Replica, int]] = []
        if candidates:
            cached = self._cached_blocks(candidates, hashes)
            i = self.rule.choose(cached, [r.load for r in candidates])  # its ties rotate: new prefixes spread
            while True:
                ranked.append((candidates.pop(i), cached.pop(i)))
                if not candidates:
                    break
                # the fallbacks, for a retry: the same rule, without moving the chooser's rotation
                i = prefix_aware(cached, [r.load for r in candidates], load_cost=self.options.load_cost)
        return ranked + [(r, 0) for r in down]

    def _cached_blocks(self, candidates: Sequence[Replica], hashes: dict[Hashing, list[BlockHash]]) -> list[int]:
        cached = [0] * len(candidates)
        for hashing, prompt in hashes.items():
            group = [i for i, r in enumerate(candidates) if r.events is not None and r.events.hashing == hashing]
            if group and prompt:
                found = self.index.match(prompt, [candidates[i].url for i in group])
                for i, n in zip(group, found):
                    cached[i] = n
        return cached

    # -- forwarding -----------------------------------------------------------------------

    async def forward(
        self, request: Request, body: bytes, hashes: dict[Hashing, list[BlockHash]], stream: bool
    ) -> Response | _Relay:
        """Send ``body`` to the best replica; on a connection error before any answer, to the next."""
        import httpx
        from starlette.responses import JSONResponse, Response, StreamingResponse

        headers = {name: request.headers[name] for name in _FORWARDED if name in request.headers}
        path = request.url.path
        errors: list[str] = []
        for replica, cached in self.rank(hashes):
            outgoing = self.client.build_request("POST", replica.url + path, content=body, headers=headers)
            replica.in_flight += 1
            try:
                response = await self.client.send(outgoing, stream=True)
                if not stream:
                    await response.aread()
            except httpx.TransportError as exc:
                replica.in_flight -= 1
                errors.append(f"{replica.url}: {type(exc).__name__}")
                self.monitor.suspect(replica, exc)
                continue
            except BaseException:
                replica.in_flight -= 1
                raise
            replica.routed += 1
            log.debug("%s -> %s (%d cached blocks)", path, replica.url, cached)
            out_headers = {k: v for k, v in response.headers.items() if k.lower() not in _HOP_HEADERS}
            out_headers["x-kvpool-replica"] = replica.url
            if not stream:
                replica.in_flight -= 1
                return Response(response.content, status_code=response.status_code, headers=out_headers)
            upstream = _Upstream(replica, response)
            relay = StreamingResponse(self._relay(upstream), status_code=response.status_code, headers=out_headers)
            return _Relay(relay, upstream)
        message = "no replica could take the request: " + ("; ".join(errors) or "none is configured")
        return JSONResponse(error_body(message, type="service_unavailable", code="no_replica"), status_code=503)

    async def _relay(self, upstream: _Upstream) -> AsyncIterator[bytes]:
        """The replica's bytes as they arrive; closing early (a client gone) closes the upstream request too."""
        import httpx

        try:
            async for chunk in upstream.response.aiter_raw():
                yield chunk
        except httpx.TransportError as exc:
            # Bytes already went to the client: the request cannot move. End the stream; the
            # client sees it cut short, and the replica is checked.
            self.monitor.suspect(upstream.replica, exc)
        finally:
            await upstream.close()

    async def forward_get(self, path: str, authorization: str | None) -> Response:
        """A GET (``/v1/models``) answered by the first replica that is up."""
        import httpx
        from starlette.responses import JSONResponse, Response

        headers = {"authorization": authorization} if authorization else {}
        for replica in [r for r in self.replicas if r.up] + [r for r in self.replicas if not r.up]:
            try:
                response = await self.client.get(
                    replica.url + path, headers=headers, timeout=self.options.health_timeout
                )
            except httpx.TransportError as exc:
                self.monitor.suspect(replica, exc)
                continue
            out_headers = {k: v for k, v in response.headers.items() if k.lower() not in _HOP_HEADERS}
            return Response(response.content, status_code=response.status_code, headers=out_headers)
        return JSONResponse(error_body("no replica answers", type="service_unavailable"), status_code=503)


class _Upstream:
    """A replica's streamed answer, closed exactly once however its relay ends (the in-flight count with it)."""

    __slots__ = ("replica", "response", "_open")

    def __init__(self, replica: Replica, response: httpx.Response) -> None:
        self.replica = replica
        self.response = response
        self._open = True

    async def close(self) -> None:
        if self._open:
            self._open = False
            self.replica.in_flight -= 1
            await self.response.aclose()


class _Relay:
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


def build_app(router: Router) -> Starlette:
    """The Starlette application serving ``router``."""
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    def refuse(error: APIError) -> Response:
        return JSONResponse(error.body, status_code=error.status, headers=error.headers)

    async def generate(request: Request, endpoint: Endpoint) -> Response | _Relay:
        try:
            tenant = router.tenant(request.headers.get("authorization"))  # before a byte of the body is read
            body = await router.read_body(request)
            try:
                payload = json.loads(body)
            except RecursionError:
                raise APIError(400, "the request body's JSON is nested too deeply", code="invalid_json") from None
            except ValueError as exc:
                raise APIError(400, f"the request body is not JSON: {exc}", code="invalid_json") from None
            parsed = parse_generation(endpoint, payload)
            try:
                hashes = router.prompt_hashes(parsed, tenant)
            except Exception as exc:  # noqa: BLE001 - the hashes are a hint: without them, route by load
                # (the replica that takes the request reports what is wrong with it, if anything is)
                log.warning("routing by load: the prompt could not be hashed: %r", exc)
                hashes = {}
        except APIError as error:
            return refuse(error)
        return await router.forward(request, body, hashes, parsed.stream)

    async def chat(request: Request) -> Response | _Relay:
        return await generate(request, Endpoint.CHAT)

    async def completions(request: Request) -> Response | _Relay:
        return await generate(request, Endpoint.COMPLETIONS)

    async def models(request: Request) -> Response:
        try:
            router.tenant(request.headers.get("authorization"))
        except APIError as error:
            return refuse(error)
        return await router.forward_get("/v1/models", request.headers.get("authorization"))

    async def health(request: Request) -> Response:
        verbose = request.query_params.get("verbose", "0") not in ("", "0", "false")
        if verbose:
            try:
                router.require_operator(request)
            except APIError as error:
                return refuse(error)
        up = sum(r.up for r in router.replicas)
        body: dict[str, Any] = {"status": "ok" if up else "no replica up", "prefix_routing": router.prefix_routing}
        body["replicas"] = [r.describe() for r in router.replicas]
        if verbose:
            body.update(router.figures())
        return JSONResponse(body, status_code=200 if up else 503)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await router.start()
        try:
            yield
        finally:
            await router.stop()

    return Starlette(
        routes=[
            Route("/v1/chat/completions", chat, methods=["POST"]),
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
        ],
        lifespan=lifespan,
    )
