"""The ASGI application: OpenAI routes, health, metrics and KV events over one engine.

:func:`build_app` takes a started engine (:class:`~kvpool.serve.served_engine.ServedEngine`:
kvpool's, or an emulated replica's) and a :class:`ServeConfig`; the app's lifespan starts and stops the engine
thread (:class:`~kvpool.serve.engine_loop.EngineLoop`). Any ASGI server runs
it; ``kvpool serve`` uses uvicorn.

This module only wires routes to their handlers, which live by group:

* :mod:`kvpool.serve.generation_routes`: ``/v1/completions`` and ``/v1/chat/completions``;
* :mod:`kvpool.serve.model_routes`: ``/v1/models``, ``/tokenize`` and ``/detokenize``;
* :mod:`kvpool.serve.operator_routes`: ``/health``, ``/metrics``, ``/kv-events``, ``/rates`` and ``/version``;

over one :class:`~kvpool.serve.server_state.ServerState`.

Every refusal is an OpenAI-style error body with its status (see
:mod:`kvpool.openai_http.protocol`), and every way a request can end early (a
refusal after admission, a client that goes away, a failed step) aborts it on
the engine, so its blocks go back to the pool at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING

from kvpool.errors import ConfigError
from kvpool.openai_http import is_loopback
from kvpool.openai_http.errors import APIError, error_body, error_type
from kvpool.serve.engine_loop import StepHook
from kvpool.serve.generation_routes import EventStream, GenerationRoutes
from kvpool.serve.model_routes import ModelRoutes
from kvpool.serve.operator_routes import OperatorRoutes, pool_health
from kvpool.serve.server_state import ServeConfig, ServerState
from kvpool.serve.stats_log import StatsLog

if TYPE_CHECKING:
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import Response

    from kvpool.kv_events import KVEventPublisher
    from kvpool.serve.served_engine import ServedEngine

__all__ = ["ServeConfig", "build_app", "pool_health"]

_LOGGER = logging.getLogger("kvpool.serve")

_Handler = Callable[["Request"], Awaitable["Response | EventStream"]]


def _is_loopback(request: Request) -> bool:
    client = request.client
    return client is not None and is_loopback(client.host)


def build_app(
    engine: ServedEngine,
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
    from starlette.routing import Route

    close_events: Callable[[], None] | None = None
    if events is not None:
        config, hooks, close_events = _with_events(engine, config, hooks, events)
    state = ServerState(engine, config, hooks)
    generation, model, operator = GenerationRoutes(state), ModelRoutes(state), OperatorRoutes(state)
    routes = [
        Route("/v1/completions", _answers(generation.completions), methods=["POST"]),
        Route("/v1/chat/completions", _answers(generation.chat), methods=["POST"]),
        Route("/v1/models", _answers(model.models), methods=["GET"]),
        Route("/health", _answers(operator.health), methods=["GET"]),
        Route("/metrics", _answers(operator.metrics), methods=["GET"]),
        Route("/kv-events", _answers(operator.kv_events), methods=["GET"]),
        Route("/kv-events/snapshot", _answers(operator.kv_events_snapshot), methods=["GET"]),
        Route("/rates", _answers(operator.rates), methods=["GET"]),
        Route("/tokenize", _answers(model.tokenize), methods=["POST"]),
        Route("/detokenize", _answers(model.detokenize), methods=["POST"]),
        Route("/version", _answers(operator.version), methods=["GET"]),
    ]
    app = Starlette(
        routes=routes,
        exception_handlers={HTTPException: _http_error, Exception: _http_error},
        lifespan=_lifespan(state, close_events),
    )
    app.state.server = state
    return app


def _with_events(
    engine: ServedEngine, config: ServeConfig, hooks: tuple[StepHook, ...], events: KVEventPublisher
) -> tuple[ServeConfig, tuple[StepHook, ...], Callable[[], None]]:
    """The config, hooks and closing call of a server that publishes the pool's events through ``events``."""
    from kvpool.serve.events import event_wiring

    if config.kv_events is not None:
        raise ConfigError(
            f"give events={events!r} or ServeConfig.kv_events={config.kv_events!r}, not both: "
            "the publisher describes its own events"
        )
    wiring = event_wiring(engine, events)
    config = dataclasses.replace(config, kv_events=wiring.describe, kv_events_snapshot=wiring.snapshot)
    return config, (*hooks, wiring.hook), wiring.close


def _answers(handler: _Handler) -> _Handler:
    """``handler`` with its refusals answered: an :class:`APIError` as its body, a client gone mid-body as 499."""
    from starlette.requests import ClientDisconnect
    from starlette.responses import JSONResponse, Response

    async def run(request: Request) -> Response | EventStream:
        try:
            return await handler(request)
        except APIError as exc:
            return JSONResponse(exc.body, status_code=exc.status, headers=exc.headers)
        except ClientDisconnect:  # it left while sending its body: nobody reads an answer
            _LOGGER.info("%s %s: the client went away while sending its request", request.method, request.url.path)
            return Response(status_code=499)

    return run


async def _http_error(request: Request, exc: Exception) -> Response:
    """Starlette's own refusals (404, 405) and any unexpected failure (500), in OpenAI's error shape."""
    from starlette.exceptions import HTTPException
    from starlette.responses import JSONResponse

    status = exc.status_code if isinstance(exc, HTTPException) else 500
    detail = exc.detail if isinstance(exc, HTTPException) else "internal server error"
    return JSONResponse(error_body(str(detail), type=error_type(status), code=str(status)), status_code=status)


def _lifespan(
    state: ServerState, close_events: Callable[[], None] | None
) -> Callable[[Starlette], contextlib.AbstractAsyncContextManager[None]]:
    """The app's lifespan: the engine and tokenizer threads (and the stats log) run while the app does."""

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        state.loop.start()
        state.prompts.start()
        interval = state.config.stats_interval
        stats = None if interval is None else asyncio.ensure_future(_log_stats(state.stats, interval))
        try:
            yield
        finally:
            if stats is not None:
                stats.cancel()
                await asyncio.gather(stats, return_exceptions=True)
            state.prompts.close()
            state.loop.stop()
            if close_events is not None:  # after the last step: its events are sent too
                close_events()

    return lifespan


async def _log_stats(stats: StatsLog, interval: float) -> None:
    """A stats line every ``interval`` seconds while anything happens (the log's heartbeat, not a test's clock)."""
    while True:
        await asyncio.sleep(interval)
        line = stats.line()
        if line is not None:
            _LOGGER.info("%s", line)
