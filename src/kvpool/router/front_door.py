"""The router's HTTP front door: OpenAI's endpoints, each request sent on to the replica that suits it.

For a generation request the router

1. finds the tenant from the API key (the replicas' key file; a missing or wrong key
   is refused here with 401, as a replica would) and derives the request's cache salt
   with :mod:`kvpool.tenancy`;
2. tokenizes the prompt (:mod:`kvpool.router.prompt_hashes`) and hashes its full blocks as
   the replicas do (:class:`~kvpool.router.ranking.Ranker`);
3. asks the block index how many leading blocks each replica that is up holds, and
   lets the ``prefix`` routing rule (:mod:`kvpool.routing`) weigh that against each
   replica's load; its ties go round the replicas in turn, so new prefixes spread out.
   The rule weighs cached tokens, counted in blocks of :data:`LOAD_COST_TOKENS` tokens
   whatever a replica's block size, so ``load_cost`` means the same before 16-token
   and 128-token blocks. In precise mode the blocks of the requests a replica is
   computing now count as held there too: their events come only once they are
   computed, and several conversations that start at once on one system prompt
   should meet on one replica, not each compute it;
4. forwards the request's bytes unchanged, with the client's ``Authorization``, and
   streams the answer back as it comes (:class:`~kvpool.router.relay.Relay`). The
   replica that served writes the usage, ``cached_tokens`` included; what the router
   notes of each request in flight is :class:`~kvpool.router.bookkeeping.Bookkeeping`'s.

A request that failed before any byte reached the client (a transport error, or an
answer with a status of 500 or more) is retried once, on the next best replica; a
refused connection (the request never reached the replica) does not use up that retry,
so the request moves on until a replica takes it. Once a byte was streamed to the
client the request never moves: its stream ends there. A refused connection marks the
replica down at once, a replica silent for longer than ``upstream_timeout`` is taken out
of rotation for ``quarantine`` seconds; a 5xx answer or a broken connection counts
against the replica, and ``eject_after`` of them in a row eject it for a back-off period
(:class:`~kvpool.router.monitor.Ejection`). A replica marked down gets no request; with
none up the answer is a 503 in OpenAI's error shape (``code: no_replica``). The last 5xx
answer is passed on as it came when no retry is left.

A replica URL's credentials (``http://user:secret@host:port``) go with the requests to
it and are shown nowhere: ``/health``, ``/metrics``, the log and the
``x-kvpool-replica`` header name the replica by
:func:`~kvpool.router.replicas.redact_url`.

Where the cached prefixes come from is the :class:`~kvpool.routing.PrefixMode`: the
replicas' KV events (``precise``), the router's own memory of where it sent each
prefix (``approximate``: a :class:`MemoryIndex` of the prompts' blocks, hashed at
``approx_block_size``, bounded by ``approx_max_blocks``), or each where it can
(``auto``). Every answer's ``cached_tokens`` is read back (the JSON body, or the
streamed chunk that carries the usage) and compared with the prediction
(:mod:`kvpool.router.stats`; ``/metrics``).

What a client sends is checked before it costs the router anything: the API key from
the headers (401 before the body is read), a declared ``Content-Length`` over the limit
(413 before the body is read), a chunked body as it arrives (413 as soon as it passes
the limit), and JSON nested too deeply (400). ``/health?verbose=1`` (the index and
event figures) is open on the loopback interface, elsewhere only with an admin key.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from kvpool.openai_http import APIError, parse_json, read_body, require_operator, tenant_for
from kvpool.openai_http.protocol import GenerationEndpoint, GenerationRequest, parse_generation
from kvpool.router.bookkeeping import Bookkeeping
from kvpool.router.index import BlockIndex, MemoryIndex
from kvpool.router.index_guard import GuardedIndex, guarded
from kvpool.router.load_board import LoadBoard, SharedBoard, board_for, keep_lease
from kvpool.router.metrics import render_metrics
from kvpool.router.monitor import ReplicaMonitor
from kvpool.router.ranking import LOAD_COST_TOKENS, NO_KEYS, PromptKeys, Ranker
from kvpool.router.relay import Relay, RelayedStream, first_answer
from kvpool.router.replica_config import ReplicaSpec
from kvpool.router.replicas import Replica, check_replica_url
from kvpool.router.route_options import RouteOptions

if TYPE_CHECKING:
    import httpx
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import Response

    from kvpool.hashing import BlockHash, BlockHasher
    from kvpool.routing import ReplicaChooser

__all__ = ["LOAD_COST_TOKENS", "NO_KEYS", "OFF_LOOP_BYTES", "PromptKeys", "RouteOptions", "Router", "build_app"]

log = logging.getLogger("kvpool.route")

# A request body past this many bytes is tokenized and hashed on a worker thread (the tokenizer
# lets go of the GIL), so a long prompt does not hold up the streams the event loop is relaying;
# below it the thread hop would cost more than the work (a few microseconds per hundred bytes).
OFF_LOOP_BYTES = 64 * 1024


class Router:
    """Routing state: the replicas, the block index, the rule; one per ``kvpool route`` process.

    A facade over its parts: :attr:`monitor` (the replicas' health and event feeds),
    :attr:`ranker` (the order to try replicas in), :attr:`bookkeeping` (what each request
    routed leaves noted) and :attr:`relay` (the HTTP client, retries and streams).
    """

    def __init__(self, options: RouteOptions, index: BlockIndex) -> None:
        self.options = options
        self.index = guarded(index)  # a shared index that fails routes by load
        self.replicas = [_replica(entry) for entry in options.replicas]
        # where this router sent each prefix (approximate mode): its own, never shared
        self.approx = MemoryIndex(
            max_blocks=options.approx_max_blocks, max_blocks_per_replica=options.approx_max_blocks
        )
        self.monitor = ReplicaMonitor(
            self.replicas,
            self.index,
            options.health_interval,
            options.health_timeout,
            options.admin_key,
            quarantine=options.quarantine,
            ejection=options.ejection,
            trust=options.event_trust,
        )
        self.monitor.on_down = self.approx.clear  # a replica that went down lost its cache
        if isinstance(self.index, GuardedIndex):
            self.index.on_recovered = self.monitor.resync  # entries lost in an outage come back from the replicas
        # per replica URL: how many requests in flight there hold each block (precise mode's unpublished blocks)
        computing: dict[str, dict[BlockHash, int]] = {}
        self.ranker = Ranker(options, self.replicas, self.monitor, self.index, self.approx, computing)
        self.bookkeeping = Bookkeeping(self.ranker, self.monitor, self.index, self.approx, computing)
        # routers on one Redis index share their loads too: each choice reserves on every router's board
        self.bookkeeping.board = board_for(self.index, self.bookkeeping.all_counts, computing)
        self._lease: asyncio.Task[None] | None = None
        self.relay = Relay(options, self.replicas, self.ranker, self.bookkeeping, self.monitor)
        self._loading: asyncio.Future[None] | None = None

    # -- its parts' state, by the names the metrics and tests read --------------------------------

    @property
    def client(self) -> httpx.AsyncClient:
        return self.relay.client

    @property
    def no_replica(self) -> int:
        """Requests answered 503 because no replica was up."""
        return self.relay.no_replica

    @property
    def computing(self) -> dict[str, dict[BlockHash, int]]:
        return self.bookkeeping.computing

    @property
    def approx_hasher(self) -> BlockHasher:
        return self.ranker.approx_hasher

    @property
    def board(self) -> LoadBoard:
        return self.bookkeeping.board

    @property
    def load_cost(self) -> float:
        return self.ranker.load_cost

    @property
    def rule(self) -> ReplicaChooser:
        return self.ranker.rule

    # -- lifetime ------------------------------------------------------------------------------

    async def start(self) -> None:
        await self.monitor.start(self.relay.open())
        if isinstance(self.board, SharedBoard):
            self._lease = asyncio.get_running_loop().create_task(keep_lease(self.board, self.board.ttl_s))
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
        if self._lease is not None:
            self._lease.cancel()
        await self.monitor.stop()
        await self.relay.close()

    def figures(self) -> dict[str, Any]:
        """What ``/health?verbose=1`` adds: the index per replica, each replica's event stream, the tier credit."""
        return {
            "index_blocks": {r.url: self.index.num_blocks(r.url) for r in self.replicas},
            "index": self.index.figures(),
            "events": {url: feed.figures() for url, feed in self.monitor.feeds.items()},
            "approximate": {r.url: self.approx.num_blocks(r.url) for r in self.replicas},
            "tier_credit": self.options.credit.figures(),
            "load_board": self.board.figures(),
        }

    def metrics(self) -> str:
        """The Prometheus text of ``/metrics``."""
        for replica in self.replicas:
            self.check_hashes(replica)
        return render_metrics(self)

    # -- who is asking, and what --------------------------------------------------------------

    def require_operator(self, request: Request) -> None:
        """The loopback interface, or an admin key: what sees the index and the replicas' event figures."""
        client = request.client
        require_operator(
            None if client is None else client.host, self.options.admin_keys, request.headers.get("authorization")
        )

    async def read_body(self, request: Request) -> bytes:
        """The request body, refused with 413 as soon as it is known to be over the limit (nothing more read)."""
        return await read_body(request, self.options.max_body_bytes)

    def tenant(self, authorization: str | None) -> str:
        """The tenant an ``Authorization`` header names; raises 401 for a missing or unknown key."""
        return tenant_for(self.options.keys, authorization)

    # -- choosing (the ranker's) -----------------------------------------------------------------

    @property
    def prefix_routing(self) -> bool:
        """Whether requests are routed by cached prefix now (precisely or approximately)."""
        return self.prefix_mode_now != "load only"

    @property
    def prefix_mode_now(self) -> str:
        """``precise``, ``approximate``, ``mixed`` or ``load only``: :attr:`Ranker.prefix_mode_now`."""
        return self.ranker.prefix_mode_now

    def precise_for(self, replica: Replica) -> bool:
        return self.ranker.precise_for(replica)

    def approximate_for(self, replica: Replica) -> bool:
        return self.ranker.approximate_for(replica)

    def prompt_keys(self, request: GenerationRequest, tenant: str) -> PromptKeys:
        return self.ranker.prompt_keys(request, tenant)

    def rank(self, keys: PromptKeys) -> list[tuple[Replica, int]]:
        return self.ranker.rank(keys)

    def block_size(self, replica: Replica, keys: PromptKeys) -> int:
        return self.ranker.block_size(replica, keys)

    def predicted_tokens(self, replica: Replica, keys: PromptKeys, cached_blocks: int) -> int:
        return self.ranker.predicted_tokens(replica, keys, cached_blocks)

    # -- what a request leaves noted (the bookkeeping's) ------------------------------------------

    def check_hashes(self, replica: Replica) -> None:
        self.bookkeeping.check_hashes(replica)

    def routed(self, replica: Replica, keys: PromptKeys) -> None:
        self.bookkeeping.routed(replica, keys)

    def settled(self, replica: Replica, keys: PromptKeys) -> None:
        self.bookkeeping.settled(replica, keys)

    def answered(self, replica: Replica, keys: PromptKeys, predicted: int, cached_tokens: int | None) -> None:
        self.bookkeeping.answered(replica, keys, predicted, cached_tokens)

    # -- forwarding (the relay's) ----------------------------------------------------------------

    async def forward(self, request: Request, body: bytes, keys: PromptKeys, stream: bool) -> Response | RelayedStream:
        """``body`` to the best replica that takes it (:meth:`Relay.forward`)."""
        return await self.relay.forward(request, body, keys, stream)

    async def forward_get(self, path: str, authorization: str | None) -> Response:
        """A GET (``/v1/models``) answered by the first replica that is up."""
        relay = self.relay
        timeout = self.options.health_timeout
        return await first_answer(
            relay.client, relay.replicas, relay.monitor, path, authorization=authorization, timeout=timeout
        )


class _FrontDoor:
    """The router's routes: the two generation endpoints, ``/v1/models``, ``/health`` and ``/metrics``."""

    def __init__(self, router: Router) -> None:
        self.router = router

    async def chat(self, request: Request) -> Response | RelayedStream:
        return await self.generate(request, GenerationEndpoint.CHAT)

    async def completions(self, request: Request) -> Response | RelayedStream:
        return await self.generate(request, GenerationEndpoint.COMPLETIONS)

    async def generate(self, request: Request, endpoint: GenerationEndpoint) -> Response | RelayedStream:
        router = self.router
        try:
            tenant = router.tenant(request.headers.get("authorization"))  # before a byte of the body is read
            body = await router.read_body(request)
            parsed = parse_generation(endpoint, parse_json(body))
            try:
                if len(body) > OFF_LOOP_BYTES:
                    keys = await asyncio.to_thread(router.prompt_keys, parsed, tenant)
                else:
                    keys = router.prompt_keys(parsed, tenant)
            except Exception as exc:  # noqa: BLE001 - the hashes are a hint: without them, route by load
                # (the replica that takes the request reports what is wrong with it, if anything is)
                log.warning("routing by load: the prompt could not be hashed: %r", exc)
                keys = NO_KEYS
        except APIError as error:
            return _refuse(error)
        return await router.forward(request, body, keys, parsed.stream)

    async def models(self, request: Request) -> Response:
        try:
            self.router.tenant(request.headers.get("authorization"))
        except APIError as error:
            return _refuse(error)
        return await self.router.forward_get("/v1/models", request.headers.get("authorization"))

    async def health(self, request: Request) -> Response:
        """Whether a replica is up, for anyone; which replicas, their errors and the figures, for operators."""
        from starlette.responses import JSONResponse

        router = self.router
        verbose = request.query_params.get("verbose", "0") not in ("", "0", "false")
        try:
            router.require_operator(request)
            operator = True
        except APIError as error:
            if verbose:
                return _refuse(error)
            operator = False
        up = sum(r.up for r in router.replicas)
        body: dict[str, Any] = {
            "status": "ok" if up else "no replica up",
            "prefix_routing": router.prefix_routing,
            "prefix_mode": router.prefix_mode_now,
            "replicas_up": up,
            "replicas_total": len(router.replicas),
        }
        if operator:  # replica addresses and their last errors say more than a client needs
            body["replicas"] = [r.describe() for r in router.replicas]
        if verbose:
            body.update(router.figures())
        return JSONResponse(body, status_code=200 if up else 503)

    async def metrics(self, request: Request) -> Response:
        from starlette.responses import PlainTextResponse

        try:
            self.router.require_operator(request)
        except APIError as error:
            return _refuse(error)
        return PlainTextResponse(self.router.metrics(), media_type="text/plain; version=0.0.4")

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        await self.router.start()
        try:
            yield
        finally:
            await self.router.stop()


def _refuse(error: APIError) -> Response:
    from starlette.responses import JSONResponse

    return JSONResponse(error.body, status_code=error.status, headers=error.headers)


def build_app(router: Router) -> Starlette:
    """The Starlette application serving ``router``."""
    from starlette.applications import Starlette
    from starlette.routing import Route

    door = _FrontDoor(router)
    return Starlette(
        routes=[
            Route("/v1/chat/completions", door.chat, methods=["POST"]),
            Route("/v1/completions", door.completions, methods=["POST"]),
            Route("/v1/models", door.models, methods=["GET"]),
            Route("/health", door.health, methods=["GET"]),
            Route("/metrics", door.metrics, methods=["GET"]),
        ],
        lifespan=door.lifespan,
    )


def _replica(entry: str | ReplicaSpec) -> Replica:
    """The router's record of a replica named by URL (kvpool: discovered) or by a spec (credentials redacted)."""
    if isinstance(entry, str):
        return Replica(check_replica_url(entry))
    return Replica(entry.url, discover=entry.discover, described=entry.events, rates=entry.rates)
