"""An emulated replica's ``GET /rates``: its profile's figures before it steps, its steps' afterwards."""

from __future__ import annotations

from collections.abc import Callable

import pytest

pytest.importorskip("starlette")
httpx = pytest.importorskip("httpx")

from kvpool.emulator import EmulatedEngine  # noqa: E402
from kvpool.replica_rates import ReplicaRates  # noqa: E402
from kvpool.serve import build_app  # noqa: E402
from tests.emulator.conftest import PROFILE, serve_config  # noqa: E402
from tests.serve.conftest import LiveServer  # noqa: E402


def test_rates_come_from_the_profile_then_from_the_steps(make_engine: Callable[..., EmulatedEngine]) -> None:
    engine = make_engine(block_size=4, num_blocks=64)
    live = LiveServer(build_app(engine, serve_config()))
    try:
        before = ReplicaRates.from_json(httpx.get(f"{live.url}/rates", timeout=30).content, "before")
        body = {"model": "emulated", "prompt": list(range(10, 50)), "max_tokens": 4}
        assert httpx.post(f"{live.base_url}/completions", json=body, timeout=30).status_code == 200
        after = ReplicaRates.from_json(httpx.get(f"{live.url}/rates", timeout=30).content, "after")
    finally:
        live.stop()
    assert before == ReplicaRates.from_profile(PROFILE, chunk_tokens=engine.options.max_num_batched_tokens)
    assert before.source == f"profile:{PROFILE.name}"
    assert after is not None and after.source == "measured"
    # three decode steps of one sequence reading 40, 41, 42 tokens of context: 0.01 + 0.002 + 0.0001 x context
    decode_step_s = 0.012 + 0.0001 * 41
    assert after.decode_step_s == pytest.approx(decode_step_s)
    # one prefill step of 40 tokens (0.01 overhead + 40 x 0.001), less the decode step: its overhead is
    # paid with or without the prompt, so the rate is near the profile's marginal 1,000 tokens a second
    assert after.prefill_tokens_per_s == pytest.approx(40 / (0.01 + 40 * 0.001 - decode_step_s))
    assert after.tier_load_tokens_per_s == {}
