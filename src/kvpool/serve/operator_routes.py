"""``GET /health``, ``/metrics``, ``/kv-events``, ``/rates`` and ``/version``: what an operator (or a router) asks.

Plain ``/health``, ``/rates`` (how fast the engine works, no tenant's figures) and ``/version`` are open to anyone; ``/health?verbose=1``,
``/metrics`` and ``/kv-events`` show every tenant's figures, so only the
loopback interface or an admin key sees them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvpool.build_info import VERSION
from kvpool.openai_http.errors import APIError
from kvpool.replica_rates import NOT_MEASURED_YET, ReplicaRates
from kvpool.serve.engine_loop import EngineStopped

if TYPE_CHECKING:
    from starlette.requests import Request
    from starlette.responses import Response

    from kvpool.serve.served_engine import ServedEngine
    from kvpool.serve.server_state import ServerState

__all__ = ["OperatorRoutes", "pool_health"]


def pool_health(engine: ServedEngine) -> dict[str, Any]:
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


def _rates_of(engine: ServedEngine) -> ReplicaRates | None:
    """The engine's rates (run on the engine thread, between steps: its step window is the engine's own)."""
    return engine.rates()


class OperatorRoutes:
    """Liveness, the pool's health, the Prometheus text, the KV events' whereabouts and the version."""

    def __init__(self, state: ServerState) -> None:
        self.state = state

    async def health(self, request: Request) -> Response:
        """Plain: 503 once the engine thread no longer takes requests (liveness a router can trust); verbose: the pool."""
        from starlette.responses import JSONResponse

        state = self.state
        if request.query_params.get("verbose", "0") in ("", "0", "false"):
            if not state.loop.running:
                return JSONResponse({"status": "engine stopped"}, status_code=503)
            return JSONResponse({"status": "ok"})
        state.require_operator(request)
        try:
            figures = await state.loop.call(pool_health)
        except EngineStopped as exc:
            raise APIError(503, str(exc), type="server_error", code="unavailable") from None
        ok = figures["invariants"] == "ok"
        return JSONResponse({"status": "ok" if ok else "broken", **figures}, status_code=200 if ok else 500)

    async def metrics(self, request: Request) -> Response:
        from starlette.responses import Response

        self.state.require_operator(request)
        text, content_type = self.state.metrics.render()
        return Response(text, media_type=content_type)

    async def kv_events(self, request: Request) -> Response:
        from starlette.responses import JSONResponse, Response

        describe = self.state.config.kv_events
        if describe is None:
            raise APIError(404, "KV events are not configured on this server", code="not_found")
        self.state.require_operator(request)
        body = describe()
        if isinstance(body, (bytes, str)):
            return Response(body, media_type="application/json")
        return JSONResponse(body)

    async def kv_events_snapshot(self, request: Request) -> Response:
        """What the pool caches, taken on the engine thread between steps, after the last batch published."""
        from starlette.responses import Response

        snapshot = self.state.config.kv_events_snapshot
        if snapshot is None:
            raise APIError(404, "this server has no KV event snapshot (it publishes no KV events)", code="not_found")
        self.state.require_operator(request)
        try:
            body = await self.state.loop.call(snapshot)
        except EngineStopped as exc:
            raise APIError(503, str(exc), type="server_error", code="unavailable") from None
        return Response(body, media_type="application/vnd.msgpack")

    async def rates(self, request: Request) -> Response:
        """The engine's :class:`~kvpool.replica_rates.ReplicaRates` as JSON, or ``{"source": "none yet"}``
        (200 too) while it cannot say (a real engine before its first prefill); 503 once the engine stopped."""
        from starlette.responses import JSONResponse

        try:
            rates = await self.state.loop.call(_rates_of)
        except EngineStopped as exc:
            raise APIError(503, str(exc), type="server_error", code="unavailable") from None
        return JSONResponse({"source": NOT_MEASURED_YET} if rates is None else rates.to_json())

    async def version(self, request: Request) -> Response:
        from starlette.responses import JSONResponse

        return JSONResponse({"version": VERSION})
