"""``kvpool serve``'s plain ``/health``: 200 while the engine thread takes requests, 503 once it has stopped.

A router trusts this answer (it is what its health checks ask), so a server whose engine
thread died must not look alive there.
"""

from __future__ import annotations

import asyncio
from typing import Any
from unittest import mock

import httpx
import pytest

from kvpool.serve.openai_server import ServeConfig, build_app
from kvpool.tenancy import SaltPolicy


def _stub_engine() -> Any:
    """Enough of an engine for the app to start: idle, until ``has_unfinished_requests`` raises."""
    engine = mock.MagicMock(name="engine")
    engine.max_model_len = 512
    engine.has_unfinished_requests.return_value = False
    return engine


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the engine's death, on purpose
def test_plain_health_is_503_once_the_engine_thread_has_stopped() -> None:
    engine = _stub_engine()
    app = build_app(engine, ServeConfig(model_name="stub", api_keys=None, salts=SaltPolicy.shared()))
    loop = app.state.server.loop

    async def scenario() -> tuple[int, int, dict[str, Any]]:
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app, client=("203.0.113.7", 4000))  # anyone, off the loopback
            async with httpx.AsyncClient(transport=transport, base_url="http://serve") as client:
                before = (await client.get("/health")).status_code
                # the engine thread dies: its next look at the engine raises, and the thread ends
                engine.has_unfinished_requests.side_effect = RuntimeError("the engine broke")
                loop.run_soon(lambda _engine: None)  # wakes the idle thread, which then looks and dies
                await asyncio.to_thread(lambda: loop._thread.join())  # an event: the thread has ended
                after = await client.get("/health")
                return before, after.status_code, after.json()

    before, after, body = asyncio.run(scenario())
    assert before == 200
    assert after == 503, body
    assert body["status"] == "engine stopped"
    assert not loop.running
