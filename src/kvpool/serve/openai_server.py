"""The ASGI application: OpenAI routes, health, metrics and KV events over one engine.

:func:`build_app` takes a started :class:`~kvpool.engine.llm_engine.LLMEngine`
and a :class:`ServeConfig`; the app's lifespan starts and stops the engine
thread (:class:`~kvpool.serve.engine_loop.EngineLoop`). Any ASGI server runs
it; ``kvpool serve`` uses uvicorn.

Every refusal is an OpenAI-style error body with its status (see
:mod:`kvpool.openai_http.protocol`), and every way a request can end early (a
refusal after admission, a client that goes away, a failed step) aborts it on
the engine, so its blocks go back to the pool at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvpool.build_info import VERSION
from kvpool.errors import ConfigError, KVPoolError, RequestTooLarge
from kvpool.openai_http import is_loopback, parse_json, read_body, require_operator, tenant_for, tokenizer_turn
from kvpool.openai_http.errors import APIError, error_body, error_type
from kvpool.openai_http.protocol import GenerationEndpoint, GenerationRequest, parse_generation
from kvpool.serve.engine_loop import EngineLoop, EngineStopped, QueueFull, StepHook
from kvpool.serve.generation import Plan, check_tools, collect, events, plan_jobs, whole_body
from kvpool.serve.metrics import DEFAULT_PREFIX, ServerMetrics
from kvpool.serve.stats_log import StatsLog
from kvpool.serve.tokenizer_thread import TokenizerThread
from kvpool.tenancy import KeyRing, SaltPolicy

if TYPE_CHECKING:
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import Response
    from starlette.types import Receive, Scope, Send

    from kvpool.engine.llm_engine import LLMEngine
    from kvpool.kv_events import KVEventPublisher

__all__ = ["ServeConfig", "build_app", "pool_health"]

_LOGGER = logging.getLogger("kvpool.serve")
#: Bodies up to this size are parsed on the event loop (a few hundred microseconds at most).
_PARSE_ON_LOOP_BYTES = 64 << 10


@dataclass(frozen=True, slots=True, kw_only=True)
class ServeConfig:
    """What the server is, besides its engine.

    Attributes:
        model_name: the name requests must give as ``model`` (and ``/v1/models`` lists).
        api_keys: API key -> tenant; None serves one tenant, no key needed.
        salts: how a tenant's cache salt is derived (isolated, or shared by all).
        admin_keys: keys that open ``/metrics``, ``/health?verbose`` and
            ``/kv-events`` to clients not on the loopback interface.
        max_body_bytes: the largest request body read; a larger one is 413.
        max_waiting: requests that may wait for admission, per tenant; one more is 429.
        max_request_tokens: the most tokens one request may ask for: ``n``
            times its prompts times ``max_tokens`` (the rest of the context
            where a chat leaves it out), and apart its ``min_tokens``; more
            is 400 ``request_too_large``. None: the KV pool's tokens.
        retry_after: seconds a 429 asks the client to wait.
        metrics_prefix: the metric names' prefix (``vllm:``, vLLM's; ``kvpool:`` for names of kvpool's own).
        kv_events: returns the ``GET /kv-events`` body (a JSON-able value);
            None answers that route with 404.
        log_requests: log a line per request when admitted and when finished.
        stats_interval: seconds between stats lines in the log (throughput,
            running/waiting, KV usage, prefix hit rate); None logs none.
    """

    model_name: str
    api_keys: KeyRing | None
    salts: SaltPolicy
    admin_keys: KeyRing | None = None
    max_body_bytes: int = 1 << 20
    max_waiting: int = 256
    max_request_tokens: int | None = None
    retry_after: int = 1
    metrics_prefix: str = DEFAULT_PREFIX
    kv_events: Callable[[], object] | None = None
    log_requests: bool = False
    stats_interval: float | None = 10.0


def pool_health(engine: LLMEngine) -> dict[str, Any]:
    """The engine's bookkeeping at a glance (run on the engine thread, between steps)."""
    manager = engine.manager
    scheduler = engine.scheduler
    owned = sum(1 for block in manager.pool.blocks[1:] if block.ref_cnt > 0)
    try:
        manager.check_invariants()
        invariants = "ok"
    except AssertionError as exc:
        invariants = str(exc)
    return {
        "running": scheduler.num_running,
        "waiting": scheduler.num_waiting,
        "blocks_owned": owned,
        "free_blocks": manager.num_free_blocks,
        "num_blocks": manager.num_blocks,
        "kv_cache_usage": manager.usage,
        "invariants": invariants,
    }


def _is_loopback(request: Request) -> bool:
    client = request.client
    return client is not None and is_loopback(client.host)


def _sse(payload: Mapping[str, Any] | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


class _EventStream:
    """A server-sent event response that stops (and closes its source) as soon as the client goes away.

    It listens for ``http.disconnect`` while it streams, whatever the ASGI
    server's version, so a client that leaves while its request is still
    waiting (nothing sent yet) is noticed too.
    """

    def __init__(self, events: AsyncIterator[bytes], on_abandon: Callable[[], None]) -> None:
        self._events = events
        self._on_abandon = on_abandon  # a stream cut short (even before it began) calls this

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        done = asyncio.Event()

        async def listen() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass

        async def stream() -> None:
            headers = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            async with contextlib.aclosing(self._events) as events:  # type: ignore[type-var]  # an async generator
                async for chunk in events:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            done.set()

        streamer = asyncio.ensure_future(stream())
        listener = asyncio.ensure_future(listen())
        try:
            await asyncio.wait({streamer, listener}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (streamer, listener):
                task.cancel()
            await asyncio.gather(streamer, listener, return_exceptions=True)
            if not done.is_set():
                self._on_abandon()
        failure = None if streamer.cancelled() else streamer.exception()
        if failure is not None and not isinstance(failure, OSError):  # a closed connection is the client leaving
            raise failure


class _Server:
    """The routes' shared state: one engine loop, the metrics, the config."""

    def __init__(self, engine: LLMEngine, config: ServeConfig, hooks: tuple[StepHook, ...]) -> None:
        self.config = config
        self.metrics = ServerMetrics(config.model_name, config.metrics_prefix, engine=engine)
        self.stats = StatsLog()
        self.loop = EngineLoop(
            engine,
            max_waiting=config.max_waiting,
            max_request_tokens=config.max_request_tokens,
            hooks=(self.metrics.after_step, self.stats.after_step, *hooks),
        )
        self.max_model_len = engine.max_model_len
        self.prompts = TokenizerThread(engine)  # prompts are tokenized on its thread, never the engine's
        self.created = int(time.time())

    # -- who is asking ---------------------------------------------------------------------

    def tenant(self, request: Request) -> str:
        return tenant_for(self.config.api_keys, request.headers.get("authorization"))

    def tokenizer_turn(self, request: Request) -> str | None:
        """``/tokenize`` and ``/detokenize``: no key needed, as in vLLM (:func:`kvpool.openai_http.tokenizer_turn`)."""
        return tokenizer_turn(self.config.api_keys, request.headers.get("authorization"))

    def require_operator(self, request: Request) -> None:
        """The loopback interface, or an admin key: what sees every tenant's figures."""
        client = request.client
        require_operator(
            None if client is None else client.host, self.config.admin_keys, request.headers.get("authorization")
        )

    # -- reading a request -----------------------------------------------------------------------

    async def read_json(self, request: Request) -> object:
        body = await read_body(request, self.config.max_body_bytes)
        if len(body) > _PARSE_ON_LOOP_BYTES:  # a large body is parsed beside the loop, not on it
            return await asyncio.to_thread(parse_json, body)
        return parse_json(body)

    def check_model(self, gen: GenerationRequest) -> None:
        """The request's ``model`` must be the served one (vLLM's rule: leaving it out means that one)."""
        if gen.model is not None and gen.model != self.config.model_name:
            raise APIError(
                404,
                f"the model {gen.model!r} does not exist; this server serves {self.config.model_name!r}",
                param="model",
                code="model_not_found",
            )

    async def plan(self, tenant: str, gen: GenerationRequest, response_id: str) -> Plan:
        """The request's engine requests: fields checked, then every prompt tokenized on the tokenizer thread."""
        self.check_model(gen)
        check_tools(gen, self.loop.engine.chat_template_supports_tools)
        max_tokens = gen.sampling.max_tokens
        if max_tokens is not None and max_tokens > self.max_model_len:
            raise APIError(
                400,
                f"'max_tokens' ({max_tokens}) cannot be greater than the context of {self.max_model_len} tokens",
                param="max_tokens",
                code="invalid_value",
            )
        if gen.sampling.stop_token_ids:
            try:
                self.loop.engine.check_token_ids(gen.sampling.stop_token_ids, "stop_token_ids")
            except KVPoolError as exc:
                raise APIError(400, str(exc), param="stop_token_ids", code="invalid_value") from None
        sequences = gen.n * max(1, len(gen.prompts))
        if sequences > self.config.max_waiting:  # never admissible: a 429 would invite a retry in vain
            raise APIError(
                400,
                f"the request asks for {sequences} sequences; this server queues at most "
                f"{self.config.max_waiting} waiting",
                param="n",
                code="invalid_value",
            )
        try:
            salt = self.config.salts.cache_salt(tenant, gen.cache_salt)
        except KVPoolError as exc:
            raise APIError(400, str(exc), param="cache_salt", code="invalid_value") from None
        return await plan_jobs(gen, response_id, salt, self.prompts, tenant)

    async def admit(self, plan: Plan) -> asyncio.Queue[Any]:
        self.metrics.expect(plan.jobs, plan.gen.n)  # before the engine thread can finish them
        try:
            counts, stream = await self.loop.submit_all(plan.jobs)
        except QueueFull as exc:
            self.metrics.not_admitted(plan.jobs, queue_full=True)
            raise APIError(
                429,
                str(exc),
                type="rate_limit_error",
                code="queue_full",
                headers={"Retry-After": str(self.config.retry_after)},
            ) from None
        except EngineStopped as exc:
            self.metrics.not_admitted(plan.jobs)
            raise APIError(503, str(exc), type="server_error", code="unavailable") from None
        except RequestTooLarge as exc:
            self.metrics.not_admitted(plan.jobs)
            raise APIError(400, str(exc), param=exc.param, code="request_too_large") from None
        except KVPoolError as exc:
            self.metrics.not_admitted(plan.jobs)
            raise APIError(400, str(exc), param="prompt", code="invalid_prompt") from None
        plan.admitted(counts)
        if self.config.log_requests:
            _LOGGER.info(
                "request %s: %d prompt(s) of %s tokens, %d sequence(s), %s",
                plan.response_id,
                len(plan.prompt_tokens),
                "/".join(map(str, plan.prompt_tokens)),
                len(plan.jobs),
                plan.jobs[0].params,
            )
        return stream

    # -- answers -----------------------------------------------------------------------------------

    async def generate(self, request: Request, endpoint: GenerationEndpoint) -> Response | _EventStream:
        from starlette.responses import JSONResponse

        tenant = self.tenant(request)
        gen = parse_generation(endpoint, await self.read_json(request))
        response_id = f"{endpoint.id_prefix}-{uuid.uuid4().hex}"
        plan = await self.plan(tenant, gen, response_id)
        stream = await self.admit(plan)
        created = int(time.time())
        model = self.config.model_name
        if gen.stream:
            finished = False

            def on_finish() -> None:
                nonlocal finished
                finished = True

            def abandon() -> None:
                if not finished:
                    self.abort(plan)

            chunks = events(plan, created, model, stream, self.prompts, _sse, on_finish)
            return _EventStream(self._logged(plan, chunks), abandon)
        collected = asyncio.ensure_future(collect(plan, stream))
        gone = asyncio.ensure_future(_disconnected(request.receive))
        try:
            await asyncio.wait({collected, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            left = not collected.done()
            if left:
                collected.cancel()
            if left or collected.cancelled() or collected.exception() is not None:
                self.abort(plan)  # finished ones are left alone
            await asyncio.gather(collected, gone, return_exceptions=True)
        if left:
            _LOGGER.info("request %s: the client went away before its answer; aborted", response_id)
            return JSONResponse(error_body("the client went away"), status_code=499)
        collected.result()  # raises the APIError of a failed request
        self._log_finished(plan)
        return JSONResponse(await whole_body(plan, created, model, self.prompts))

    def abort(self, plan: Plan) -> None:
        for request_id in plan.request_ids:
            self.loop.abort(request_id)

    async def _logged(self, plan: Plan, chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        async with contextlib.aclosing(chunks) as source:  # type: ignore[type-var]  # an async generator
            async for chunk in source:
                yield chunk
        self._log_finished(plan)

    def _log_finished(self, plan: Plan) -> None:
        if not self.config.log_requests:
            return
        from kvpool.engine.outputs import request_log_line

        for seq in plan.sequences.values():
            if seq.output is not None:
                _LOGGER.info("%s", request_log_line(seq.output))


async def _log_stats(stats: StatsLog, interval: float) -> None:
    """A stats line every ``interval`` seconds while anything happens (the log's heartbeat, not a test's clock)."""
    while True:
        await asyncio.sleep(interval)
        line = stats.line()
        if line is not None:
            _LOGGER.info("%s", line)


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def build_app(
    engine: LLMEngine,
    config: ServeConfig,
    *,
    hooks: tuple[StepHook, ...] = (),
    events: KVEventPublisher | None = None,
) -> Starlette:
    """The ASGI app serving ``engine``; ``hooks`` run on the engine thread after every step.

    With ``events`` (a publisher, for an engine built with
    ``enable_kv_events=True``) the app publishes the pool's events after every
    step, answers ``GET /kv-events`` with where they are (see
    :mod:`kvpool.serve.events`), and closes the publisher when it stops; it
    then owns the publisher. ``config.kv_events`` is for a server that
    publishes its events some other way, so giving both is refused.
    """
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.requests import ClientDisconnect
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    close_events: Callable[[], None] | None = None
    if events is not None:
        from kvpool.serve.events import event_wiring

        if config.kv_events is not None:
            raise ConfigError(
                f"give events={events!r} or ServeConfig.kv_events={config.kv_events!r}, not both: "
                "the publisher describes its own events"
            )
        wiring = event_wiring(engine, events)
        config = dataclasses.replace(config, kv_events=wiring.describe)
        hooks = (*hooks, wiring.hook)
        close_events = wiring.close
    server = _Server(engine, config, hooks)

    def answers(
        handler: Callable[[Request], Awaitable[Response | _EventStream]],
    ) -> Callable[[Request], Awaitable[Response | _EventStream]]:
        async def run(request: Request) -> Response | _EventStream:
            try:
                return await handler(request)
            except APIError as exc:
                return JSONResponse(exc.body, status_code=exc.status, headers=exc.headers)
            except ClientDisconnect:  # it left while sending its body: nobody reads an answer
                _LOGGER.info("%s %s: the client went away while sending its request", request.method, request.url.path)
                return Response(status_code=499)

        return run

    async def completions(request: Request) -> Response | _EventStream:
        return await server.generate(request, GenerationEndpoint.COMPLETIONS)

    async def chat(request: Request) -> Response | _EventStream:
        return await server.generate(request, GenerationEndpoint.CHAT)

    async def models(request: Request) -> Response:
        server.tenant(request)
        card = {
            "id": config.model_name,
            "object": "model",
            "created": server.created,
            "owned_by": "kvpool",
            "max_model_len": server.max_model_len,
        }
        return JSONResponse({"object": "list", "data": [card]})

    async def health(request: Request) -> Response:
        if request.query_params.get("verbose", "0") in ("", "0", "false"):
            # liveness that a router can trust: 503 once the engine thread no longer takes requests
            if not server.loop.running:
                return JSONResponse({"status": "engine stopped"}, status_code=503)
            return JSONResponse({"status": "ok"})
        server.require_operator(request)
        try:
            figures = await server.loop.call(pool_health)
        except EngineStopped as exc:
            raise APIError(503, str(exc), type="server_error", code="unavailable") from None
        ok = figures["invariants"] == "ok"
        return JSONResponse({"status": "ok" if ok else "broken", **figures}, status_code=200 if ok else 500)

    async def metrics(request: Request) -> Response:
        server.require_operator(request)
        text, content_type = server.metrics.render()
        return Response(text, media_type=content_type)

    async def kv_events(request: Request) -> Response:
        if config.kv_events is None:
            raise APIError(404, "KV events are not configured on this server", code="not_found")
        server.require_operator(request)
        body = config.kv_events()
        if isinstance(body, (bytes, str)):
            return Response(body, media_type="application/json")
        return JSONResponse(body)

    async def tokenize(request: Request) -> Response:
        from kvpool.serve.tokenize import tokenize_body

        tenant = server.tokenizer_turn(request)
        body = await tokenize_body(await server.read_json(request), server.prompts, server.check_model, tenant)
        return JSONResponse(body)

    async def detokenize(request: Request) -> Response:
        from kvpool.serve.tokenize import detokenize_body

        tenant = server.tokenizer_turn(request)
        body = await detokenize_body(await server.read_json(request), server.prompts, server.check_model, tenant)
        return JSONResponse(body)

    async def version(request: Request) -> Response:
        return JSONResponse({"version": VERSION})

    async def http_error(request: Request, exc: Exception) -> Response:
        status = exc.status_code if isinstance(exc, HTTPException) else 500
        detail = exc.detail if isinstance(exc, HTTPException) else "internal server error"
        return JSONResponse(error_body(str(detail), type=error_type(status), code=str(status)), status_code=status)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        server.loop.start()
        server.prompts.start()
        stats = (
            None
            if config.stats_interval is None
            else asyncio.ensure_future(_log_stats(server.stats, config.stats_interval))
        )
        try:
            yield
        finally:
            if stats is not None:
                stats.cancel()
                await asyncio.gather(stats, return_exceptions=True)
            server.prompts.close()
            server.loop.stop()
            if close_events is not None:  # after the last step: its events are sent too
                close_events()

    routes = [
        Route("/v1/completions", answers(completions), methods=["POST"]),
        Route("/v1/chat/completions", answers(chat), methods=["POST"]),
        Route("/v1/models", answers(models), methods=["GET"]),
        Route("/health", answers(health), methods=["GET"]),
        Route("/metrics", answers(metrics), methods=["GET"]),
        Route("/kv-events", answers(kv_events), methods=["GET"]),
        Route("/tokenize", answers(tokenize), methods=["POST"]),
        Route("/detokenize", answers(detokenize), methods=["POST"]),
        Route("/version", answers(version), methods=["GET"]),
    ]
    app = Starlette(
        routes=routes,
        exception_handlers={HTTPException: http_error, Exception: http_error},
        lifespan=lifespan,
    )
    app.state.server = server
    return app
