"""``kvpool serve``: an OpenAI-compatible HTTP server over kvpool's engine (the ``serve`` extra).

* :mod:`.responses` and :mod:`.generation`: response bodies; the OpenAI requests, authentication, body
  limits and error bodies are :mod:`kvpool.openai_http`'s, shared with ``kvpool route``.
* :mod:`.engine_loop`: the engine on a thread of its own, fed through a queue; per-request streams.
* :mod:`.metrics`: Prometheus metrics under vLLM's names, in the server's own registry.
* :mod:`.events`: the step hook that publishes the pool's KV events and the ``/kv-events`` body.
* :mod:`.openai_server`: the ASGI application (Starlette): :func:`build_app`, wiring each route to its
  handler in :mod:`.generation_routes`, :mod:`.model_routes` or :mod:`.operator_routes`, over the shared
  :mod:`.server_state` (:class:`ServeConfig`).

Tenants and cache salts are :mod:`kvpool.tenancy`'s rules. Importing this
package imports neither torch nor Starlette; they load when an app is built.
"""

from __future__ import annotations

from kvpool.openai_http.protocol import APIError
from kvpool.serve.engine_loop import EngineLoop, Job, QueueFull
from kvpool.serve.metrics import ServerMetrics
from kvpool.serve.openai_server import ServeConfig, build_app, pool_health

__all__ = ["APIError", "EngineLoop", "Job", "QueueFull", "ServeConfig", "ServerMetrics", "build_app", "pool_health"]
