"""The router's HTTP front door: OpenAI's endpoints, each request sent on to the replica that suits it.

For a generation request the router

1. finds the tenant from the API key (the replicas' key file; a missing or wrong key
   is refused here with 401, as a replica would) and derives the request's cache salt
   with :mod:`kvpool.tenancy`;
2. tokenizes the prompt (:mod:`kvpool.router.prompt_hashes`) and hashes its full blocks as
   the replicas do;
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
   streams the answer back as it comes. The replica that served writes the usage,
   ``cached_tokens`` included.

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
import functools
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvpool.errors import ConfigError
from kvpool.hashing import BlockHash, BlockHasher
from kvpool.openai_http import APIError, error_body, parse_json, read_body, require_operator, tenant_for
from kvpool.openai_http.protocol import GenerationEndpoint, GenerationRequest, parse_generation
from kvpool.router.index import BlockIndex, MemoryIndex
from kvpool.router.index_guard import GuardedIndex, guarded
from kvpool.router.metrics import render_metrics
from kvpool.router.monitor import Ejection, ReplicaMonitor
from kvpool.router.prompt_hashes import Tokenizer, block_hashes
from kvpool.router.replica_config import ReplicaSpec
from kvpool.router.replicas import MAX_BLOCK_SIZE, Hashing, Replica, check_distinct, check_replica_url
from kvpool.router.stats import HashVerdict
from kvpool.router.usage import UsageScanner, cached_tokens_of
from kvpool.routing import PrefixMode, Routing, chooser, prefix_aware
from kvpool.tenancy import KeyRing, SaltPolicy

if TYPE_CHECKING:
    import httpx
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import Response
    from starlette.types import Receive, Scope, Send

    from kvpool.kv_events import CurveTrust

__all__ = ["RouteOptions", "Router", "build_app"]

log = logging.getLogger("kvpool.route")

# Response headers that describe one hop, not the answer; ``date`` and ``server`` are the replica's server's,
# and the router's own server writes its own (copied, a client would get each twice).
_HOP_HEADERS = frozenset(
    {"connection", "keep-alive", "transfer-encoding", "content-length", "content-encoding", "date", "server"}
)
#: The tokens of one "block" in the routing rule's exchange rate: ``load_cost`` such blocks
#: cached are worth one request in flight, whatever block size the replicas use.
LOAD_COST_TOKENS = 16
# Request headers passed on to the replica.
_FORWARDED = ("authorization", "content-type", "accept")
# A request body past this many bytes is tokenized and hashed on a worker thread (the tokenizer
# lets go of the GIL), so a long prompt does not hold up the streams the event loop is relaying;
# below it the thread hop would cost more than the work (a few microseconds per hundred bytes).
OFF_LOOP_BYTES = 64 * 1024


@dataclass(frozen=True, slots=True, kw_only=True)
class PromptKeys:
    """A request's prompt as the router keys it: its length, and its blocks under each hashing in use.

    ``hashes``: per replica hashing, the prompt's full blocks as that replica's events spell
    them; ``approx``: the blocks the router's own memory keys prompts by.
    """

    tokens: int = 0
    hashes: dict[Hashing, list[BlockHash]] = field(default_factory=dict)
    approx: list[BlockHash] = field(default_factory=list)


#: A request that could not be keyed: routed by load.
NO_KEYS = PromptKeys()


@dataclass(frozen=True, slots=True, kw_only=True)
class RouteOptions:
    """Everything ``kvpool route`` is told on its command line, checked.

    ``load_cost``: cached blocks of :data:`LOAD_COST_TOKENS` tokens one request queued or
    running at a replica is worth (the ``prefix`` rule's exchange rate; 8: 128 tokens); ``routing``: the rule (the others, for comparison, ignore prefixes). ``admin_key``: sent to the replicas'
    ``/kv-events``, which only their loopback interface may read without one. ``admin_keys``: the keys that
    open the router's own ``/health?verbose=1`` to clients off its loopback interface (None: loopback only).
    ``keys`` None: the replicas are
    single-tenant. ``salts`` must be the replicas' own rule (the same secret file, or
    shared when they run without tenant isolation), or no prefix will ever match.
    ``upstream_timeout``: the longest a replica may stay silent (seconds without a byte: before its
    answer starts, which for a request that does not stream is the whole generation, and between
    streamed chunks); one that does is out of rotation for ``quarantine`` seconds.
    ``eject_after``, ``eject_time``, ``eject_max_time``: the passive health rule
    (:class:`~kvpool.router.monitor.Ejection`): that many failed answers in a row (5xx, broken
    connections) take a replica out of rotation for ``eject_time`` seconds, doubled for each
    further ejection in a row up to ``eject_max_time``. Each replica is named once (the same
    scheme, host and port twice is refused).
    """

    replicas: tuple[str | ReplicaSpec, ...]  # a URL: a kvpool replica (GET /kv-events); a spec: as described
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
    eject_after: int = 3
    eject_time: float = 10.0
    eject_max_time: float = 300.0
    max_body_bytes: int = 8 * 2**20
    prefix_mode: PrefixMode = PrefixMode.AUTO
    approx_block_size: int = 16
    approx_max_blocks: int = 2**18
    event_trust: CurveTrust | None = None  # CURVE keys for replicas' event streams (None: plain streams only)

    def __post_init__(self) -> None:
        for name in ("approx_block_size", "approx_max_blocks"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ConfigError(f"{name} must be an integer >= 1, got {value!r}")
        if self.approx_block_size > MAX_BLOCK_SIZE:
            raise ConfigError(f"approx_block_size must be at most {MAX_BLOCK_SIZE}, got {self.approx_block_size!r}")
        _ = self.ejection  # checks the eject_* fields, naming the bad one
        check_distinct([entry if isinstance(entry, str) else entry.url for entry in self.replicas])
        for name in ("health_interval", "health_timeout", "connect_timeout", "upstream_timeout", "quarantine"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or isinstance(value, bool) or not 0 < value < float("inf"):
                raise ConfigError(f"{name} must be a positive number of seconds, got {value!r}")

    @property
    def ejection(self) -> Ejection:
        """The passive health rule the ``eject_*`` fields make."""
        return Ejection(after=self.eject_after, time=self.eject_time, max_time=self.eject_max_time)


class Router:
    """Routing state: the replicas, the block index, the rule; one per ``kvpool route`` process."""

    def __init__(self, options: RouteOptions, index: BlockIndex) -> None:
        self.options = options
        self.index = guarded(index)  # a shared index that fails routes by load
        self.replicas = [_replica(entry) for entry in options.replicas]
        # where this router sent each prefix (approximate mode): its own, never shared
        self.approx = MemoryIndex(
            max_blocks=options.approx_max_blocks, max_blocks_per_replica=options.approx_max_blocks
        )
        self.approx_hasher = BlockHasher(options.approx_block_size)
        self.no_replica = 0  # requests answered 503 because no replica was up
        self.load_cost = options.load_cost * LOAD_COST_TOKENS  # in cached tokens
        self.rule = chooser(options.routing, load_cost=self.load_cost)
        # per replica URL: how many requests in flight there hold each block (precise mode's unpublished blocks)
        self.computing: dict[str, dict[BlockHash, int]] = {}
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
            "approximate": {r.url: self.approx.num_blocks(r.url) for r in self.replicas},
        }

    def metrics(self) -> str:
        """The Prometheus text of ``/metrics``."""
        for replica in self.replicas:
            self.check_hashes(replica)
        return render_metrics(self)

    # -- choosing -------------------------------------------------------------------------

    @property
    def prefix_routing(self) -> bool:
        """Whether requests are routed by cached prefix now (precisely or approximately)."""
        return self.prefix_mode_now != "load only"

    def precise_for(self, replica: Replica) -> bool:
        """Whether ``replica``'s cached prefixes come from its events (else, in approximate modes, from memory)."""
        mode = self.options.prefix_mode
        if mode is PrefixMode.APPROXIMATE or replica.events is None:
            return False
        return replica.events.hashing in self.monitor.hashers()

    def approximate_for(self, replica: Replica) -> bool:
        mode = self.options.prefix_mode
        return mode is PrefixMode.APPROXIMATE or (mode is PrefixMode.AUTO and not self.precise_for(replica))

    @property
    def prefix_mode_now(self) -> str:
        """``precise``, ``approximate``, ``mixed`` (some replicas each way) or ``load only``, for the replicas up."""
        tokenizer = self.options.tokenizer
        if self.options.routing is not Routing.PREFIX or tokenizer is None or not tokenizer.loaded:
            return "load only"
        up = [r for r in self.replicas if r.up]
        precise = sum(self.precise_for(r) for r in up)
        approximate = sum(self.approximate_for(r) for r in up)
        if precise and approximate:
            return "mixed"
        return "precise" if precise else "approximate" if approximate else "load only"

    def check_hashes(self, replica: Replica) -> None:
        """Update ``replica``'s hash check; say once, loudly, when its events never match the prompts sent there."""
        stats = replica.stats
        feed = self.monitor.feeds.get(replica.url)
        if not self.precise_for(replica) or feed is None:
            return
        before = stats.verdict
        stats.verdict = stats.check.verify(lambda h: self.index.match([h], [replica.url])[0] > 0, feed.stored)
        if stats.verdict is not before and stats.verdict in (HashVerdict.UNMATCHED, HashVerdict.SILENT):
            info = replica.events
            assert info is not None
            what = (
                "its KV events never name the blocks of the prompts sent to it"
                if stats.verdict is HashVerdict.UNMATCHED
                else "no KV event arrived from it"
            )
            log.warning(
                "%s: %s (%d prompts answered; described as block-size=%d, hash=%s, seed=%s, block-hash=%s): "
                "its settings, or the router's --model, are not the replica's; it is routed by load meanwhile",
                replica.url,
                what,
                stats.check.answered,
                info.block_size,
                info.hash_algorithm,
                info.hash_seed,
                info.hash_form.value,
            )

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

    def prompt_keys(self, request: GenerationRequest, tenant: str) -> PromptKeys:
        """The request's prompt length and block hashes under each hashing in use; :data:`NO_KEYS` until tokenized."""
        tokenizer = self.options.tokenizer
        if tokenizer is None or not tokenizer.loaded or self.options.routing is not Routing.PREFIX:
            return NO_KEYS
        if request.messages is not None:
            tokens = tokenizer.chat_tokens(request.messages)
        elif isinstance(request.prompt, str):
            tokens = tokenizer.text_tokens(request.prompt)
        else:
            tokens = list(request.prompt or ())
        salt = self.options.salts.cache_salt(tenant, request.cache_salt)
        up = [r for r in self.replicas if r.up]
        hashes = {
            hashing: hashing[3].published(block_hashes(hasher, tokens, salt))
            for hashing, hasher in self.monitor.hashers().items()
            if self.options.prefix_mode is not PrefixMode.APPROXIMATE
        }
        approx = block_hashes(self.approx_hasher, tokens, salt) if any(map(self.approximate_for, up)) else []
        return PromptKeys(tokens=len(tokens), hashes=hashes, approx=approx)

    def rank(self, keys: PromptKeys) -> list[tuple[Replica, int]]:
        """The replicas that are up, in the order to try them, each with the blocks of the prompt it holds.

        Best first by the ``prefix`` rule; a replica marked down is not in the list.
        """
        candidates = [r for r in self.replicas if r.up]
        ranked: list[tuple[Replica, int]] = []
        if candidates:
            cached = self._cached_blocks(candidates, keys)
            tokens = [n * self.block_size(r, keys) for r, n in zip(candidates, cached)]
            i = self.rule.choose(tokens, [r.load for r in candidates])  # its ties rotate: new prefixes spread
            while True:
                ranked.append((candidates.pop(i), cached.pop(i)))
                tokens.pop(i)
                if not candidates:
                    break
                # the fallbacks, for a retry: the same rule, without moving the chooser's rotation
                i = prefix_aware(tokens, [r.load for r in candidates], load_cost=self.load_cost)
        return ranked

    def block_size(self, replica: Replica, keys: PromptKeys) -> int:
        """The tokens of one of ``replica``'s blocks as the router counts them (0: it counts none)."""
        if self.precise_for(replica):
            assert replica.events is not None
            return replica.events.block_size
        return self.options.approx_block_size if keys.approx else 0

    def _cached_blocks(self, candidates: Sequence[Replica], keys: PromptKeys) -> list[int]:
        cached = [0] * len(candidates)
        for hashing, prompt in keys.hashes.items():
            group = [
                i
                for i, r in enumerate(candidates)
                if r.events is not None and r.events.hashing == hashing and self.precise_for(r)
            ]
            if group and prompt:
                found = self.index.match(prompt, [candidates[i].url for i in group])
                for i, n in zip(group, found):
                    computing = self.computing.get(candidates[i].url)
                    while computing and n < len(prompt) and prompt[n] in computing:
                        n += 1  # held, then being computed there now: its events are on their way
                    cached[i] = n
        if keys.approx:
            # in the approximate unit; the rule compares blocks, so scale to the events' unit where both meet
            group = [i for i, r in enumerate(candidates) if self.approximate_for(r)]
            found = self.approx.match(keys.approx, [candidates[i].url for i in group])
            for i, n in zip(group, found):
                cached[i] = n
        return cached

    def predicted_tokens(self, replica: Replica, keys: PromptKeys, cached_blocks: int) -> int:
        """The prompt tokens ``replica`` should serve from its cache: whole blocks, never the prompt's last token."""
        block_size = self.block_size(replica, keys)
        if not block_size:
            return 0
        usable = max(0, keys.tokens - 1) // block_size  # the last token is always computed
        return min(cached_blocks, usable) * block_size

    def routed(self, replica: Replica, keys: PromptKeys) -> None:
        """``replica`` accepted a request: the approximate memory notes where its prefix now lives.

        In precise mode its blocks count as being computed there until :meth:`settled`.
        """
        if keys.approx and self.approximate_for(replica):
            self.approx.store(replica.url, keys.approx)
        blocks = self._computing_blocks(replica, keys)
        if blocks:
            computing = self.computing.setdefault(replica.url, {})
            for h in blocks:
                computing[h] = computing.get(h, 0) + 1

    def settled(self, replica: Replica, keys: PromptKeys) -> None:
        """A request :meth:`routed` to ``replica`` ended (answered, failed or cut): its blocks are no longer computing."""
        blocks = self._computing_blocks(replica, keys)
        computing = self.computing.get(replica.url)
        if not blocks or computing is None:
            return
        for h in blocks:
            left = computing.get(h, 0) - 1
            if left > 0:
                computing[h] = left
            else:
                computing.pop(h, None)

    def _computing_blocks(self, replica: Replica, keys: PromptKeys) -> list[BlockHash]:
        if replica.events is None or not self.precise_for(replica):
            return []
        return keys.hashes.get(replica.events.hashing, [])

    def answered(self, replica: Replica, keys: PromptKeys, predicted: int, cached_tokens: int | None) -> None:
        """``replica`` answered to the end, reporting ``cached_tokens`` (None: no usage in the answer)."""
        if cached_tokens is not None:
            replica.stats.report(predicted, cached_tokens)
        if replica.events is not None:
            prompt = keys.hashes.get(replica.events.hashing)
            if prompt:
                replica.stats.check.note(prompt[0])

    # -- forwarding -----------------------------------------------------------------------

    async def forward(self, request: Request, body: bytes, keys: PromptKeys, stream: bool) -> Response | _Relay:
        """Send ``body`` to the best replica that is up; when it fails before any byte was answered, to the next.

        The retry rule is the module's: one retry after a failure where the request may have
        reached the replica (a 5xx, a broken connection, a timeout), any number after refused
        connections. With no replica up, or every one tried failing, the answer is a 503 in
        OpenAI's error shape; a 5xx with no retry left is passed on as it came.
        """
        import httpx
        from starlette.responses import JSONResponse, Response, StreamingResponse

        headers = {name: request.headers[name] for name in _FORWARDED if name in request.headers}
        path = request.url.path
        errors: list[str] = []
        ranked = self.rank(keys)
        retries = 1  # after a failure the replica may have seen; refused connections do not count
        for position, (replica, cached) in enumerate(ranked):
            if not replica.up:
                continue  # marked down while an earlier choice was being tried
            self.check_hashes(replica)
            outgoing = self.client.build_request("POST", replica.base + path, content=body, headers=headers)
            replica.in_flight += 1
            try:
                response = await self.client.send(outgoing, stream=True)
                if not stream:
                    await response.aread()
            except httpx.TransportError as exc:
                replica.in_flight -= 1
                replica.stats.transport_errors += 1
                errors.append(f"{replica.url}: {type(exc).__name__}")
                self.monitor.suspect(replica, exc)
                if not isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout):
                    if not retries:
                        break
                    retries -= 1
                continue
            except BaseException:
                replica.in_flight -= 1
                raise
            if response.status_code >= 500:
                replica.stats.server_errors += 1
                self.monitor.failed(replica, f"answered {response.status_code}")
                if retries and any(r.up for r, _ in ranked[position + 1 :]):
                    retries -= 1
                    replica.in_flight -= 1
                    errors.append(f"{replica.url}: answered {response.status_code}")
                    await response.aclose()
                    continue
            else:
                self.monitor.succeeded(replica)
            replica.routed += 1
            predicted = self.predicted_tokens(replica, keys, cached)
            replica.stats.requests += 1
            replica.stats.prompt_tokens += keys.tokens
            replica.stats.predicted_cached_tokens += predicted
            self.routed(replica, keys)
            log.debug("%s -> %s (%d cached blocks, %d tokens predicted)", path, replica.url, cached, predicted)
            out_headers = {k: v for k, v in response.headers.items() if k.lower() not in _HOP_HEADERS}
            out_headers["x-kvpool-replica"] = replica.url
            if not stream:
                replica.in_flight -= 1
                self.settled(replica, keys)
                if response.status_code == 200:
                    self.answered(replica, keys, predicted, cached_tokens_of(response.content))
                return Response(response.content, status_code=response.status_code, headers=out_headers)
            upstream = _Upstream(replica, response, functools.partial(self.settled, replica, keys))
            scanner = UsageScanner() if response.status_code == 200 else None
            relay = StreamingResponse(
                self._relay(upstream, scanner, keys, predicted), status_code=response.status_code, headers=out_headers
            )
            return _Relay(relay, upstream)
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

        try:
            async for chunk in upstream.response.aiter_raw():
                if scanner is not None:
                    scanner.feed(chunk)
                yield chunk
            if scanner is not None:
                self.answered(upstream.replica, keys, predicted, scanner.cached_tokens)
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
        for replica in [r for r in self.replicas if r.up]:  # a replica marked down gets nothing
            try:
                response = await self.client.get(
                    replica.base + path, headers=headers, timeout=self.options.health_timeout
                )
            except httpx.TransportError as exc:
                self.monitor.suspect(replica, exc)
                continue
            out_headers = {k: v for k, v in response.headers.items() if k.lower() not in _HOP_HEADERS}
            return Response(response.content, status_code=response.status_code, headers=out_headers)
        return JSONResponse(
            error_body("no replica answers", type="service_unavailable", code="no_replica"), status_code=503
        )


class _Upstream:
    """A replica's streamed answer, closed exactly once however its relay ends (the in-flight count with it)."""

    __slots__ = ("replica", "response", "_open", "_settled")

    def __init__(self, replica: Replica, response: httpx.Response, settled: Callable[[], None]) -> None:
        self.replica = replica
        self.response = response
        self._open = True
        self._settled = settled  # the router's note that the request's blocks are no longer computing

    async def close(self) -> None:
        if self._open:
            self._open = False
            self.replica.in_flight -= 1
            self._settled()
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
    from starlette.responses import JSONResponse, PlainTextResponse
    from starlette.routing import Route

    def refuse(error: APIError) -> Response:
        return JSONResponse(error.body, status_code=error.status, headers=error.headers)

    async def generate(request: Request, endpoint: GenerationEndpoint) -> Response | _Relay:
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
            return refuse(error)
        return await router.forward(request, body, keys, parsed.stream)

    async def chat(request: Request) -> Response | _Relay:
        return await generate(request, GenerationEndpoint.CHAT)

    async def completions(request: Request) -> Response | _Relay:
        return await generate(request, GenerationEndpoint.COMPLETIONS)

    async def models(request: Request) -> Response:
        try:
            router.tenant(request.headers.get("authorization"))
        except APIError as error:
            return refuse(error)
        return await router.forward_get("/v1/models", request.headers.get("authorization"))

    async def health(request: Request) -> Response:
        """Whether a replica is up, for anyone; which replicas, their errors and the figures, for operators."""
        verbose = request.query_params.get("verbose", "0") not in ("", "0", "false")
        try:
            router.require_operator(request)
            operator = True
        except APIError as error:
            if verbose:
                return refuse(error)
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

    async def metrics(request: Request) -> Response:
        try:
            router.require_operator(request)
        except APIError as error:
            return refuse(error)
        return PlainTextResponse(router.metrics(), media_type="text/plain; version=0.0.4")

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
            Route("/metrics", metrics, methods=["GET"]),
        ],
        lifespan=lifespan,
    )


def _replica(entry: str | ReplicaSpec) -> Replica:
    """The router's record of a replica named by URL (kvpool: discovered) or by a spec (credentials redacted)."""
    if isinstance(entry, str):
        return Replica(check_replica_url(entry))
    return Replica(entry.url, discover=entry.discover, described=entry.events)
