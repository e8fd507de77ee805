"""``kvpool serve``'s ``GET /rates``: the engine's rates as JSON, ``{"source": "none yet"}`` before it can say."""

from __future__ import annotations

import asyncio
from typing import Any
from unittest import mock

import httpx

from kvpool.replica_rates import NOT_MEASURED_YET, ReplicaRates
from kvpool.serve.openai_server import ServeConfig, build_app
from kvpool.tenancy import SaltPolicy


def _answers(rates: ReplicaRates | None) -> tuple[int, Any]:
    engine = mock.MagicMock(name="engine")
    engine.max_model_len = 512
    engine.has_unfinished_requests.return_value = False
    engine.rates.return_value = rates
    app = build_app(engine, ServeConfig(model_name="stub", api_keys=None, salts=SaltPolicy.shared()))

    async def scenario() -> tuple[int, Any]:
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app, client=("203.0.113.7", 4000))  # off the loopback: still open
            async with httpx.AsyncClient(transport=transport, base_url="http://serve") as client:
                response = await client.get("/rates")
                return response.status_code, response.json()

    return asyncio.run(scenario())


def test_an_engine_that_cannot_say_yet_answers_none_yet_and_the_router_reads_it_as_unknown() -> None:
    status, body = _answers(None)
    assert (status, body) == (200, {"source": NOT_MEASURED_YET})
    assert ReplicaRates.from_json(body, "GET /rates") is None


def test_measured_rates_are_answered_as_the_router_reads_them() -> None:
    rates = ReplicaRates(
        prefill_tokens_per_s=3000.0, decode_step_s=0.03, tier_load_tokens_per_s={"CPU": 9e4}, source="measured"
    )
    status, body = _answers(rates)
    assert status == 200 and ReplicaRates.from_json(body, "GET /rates") == rates
