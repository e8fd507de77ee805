"""What every route of ``kvpool serve`` shares: the config, the engine loop, the metrics, the tokenizer thread.

:class:`ServeConfig` is what the server is, besides its engine; :class:`ServerState`
is one running server's state, and the questions every route asks of a request
(who is asking, its JSON body, whether it names the served model). The routes
themselves are in :mod:`kvpool.serve.generation_routes`,
:mod:`kvpool.serve.model_routes` and :mod:`kvpool.serve.operator_routes`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvpool.openai_http import parse_json, read_body, require_operator, tenant_for, tokenizer_turn
from kvpool.openai_http.errors import APIError
from kvpool.serve.engine_loop import EngineLoop, StepHook
from kvpool.serve.metrics import DEFAULT_PREFIX, ServerMetrics
from kvpool.serve.stats_log import StatsLog
from kvpool.serve.tokenizer_thread import TokenizerThread
from kvpool.tenancy import KeyRing, SaltPolicy

if TYPE_CHECKING:
    from starlette.requests import Request

    from kvpool.openai_http.protocol import GenerationRequest
    from kvpool.serve.served_engine import ServedEngine

__all__ = ["ServeConfig", "ServerState"]

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
        kv_events_snapshot: run on the engine thread between steps, the
            ``GET /kv-events/snapshot`` body (msgpack, see
            :mod:`kvpool.kv_events.snapshot`); None answers that route with 404.
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
    kv_events_snapshot: Callable[[ServedEngine], bytes] | None = None
    log_requests: bool = False
    stats_interval: float | None = 10.0


class ServerState:
    """The routes' shared state: one engine loop, the metrics, the config."""

    def __init__(self, engine: ServedEngine, config: ServeConfig, hooks: tuple[StepHook, ...]) -> None:
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
