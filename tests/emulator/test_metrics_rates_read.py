"""The router reads an emulated replica's ``/metrics`` as it reads a vLLM one's, and gets its profile's pace."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest

pytest.importorskip("prometheus_client")
pytest.importorskip("starlette")
httpx = pytest.importorskip("httpx")

from kvpool.emulator import EmulatedEngine, EmulatorOptions  # noqa: E402
from kvpool.router.index import MemoryIndex  # noqa: E402
from kvpool.router.metrics_rates import METRICS_SOURCE  # noqa: E402
from kvpool.router.monitor import ReplicaMonitor  # noqa: E402
from kvpool.router.replicas import Replica  # noqa: E402
from kvpool.serve import build_app  # noqa: E402
from kvpool.tokenizer_files import FolderTokenizer  # noqa: E402
from tests.emulator.conftest import PROFILE, serve_config  # noqa: E402
from tests.serve.conftest import LiveServer  # noqa: E402


def read_after_requests(engine: EmulatedEngine) -> Replica:
    """``engine`` served, described to a monitor as a vLLM replica is; its rates read before and after 3 requests."""
    live = LiveServer(build_app(engine, serve_config()))
    replica = Replica(live.url, up=True, discover=False)  # no /kv-events, no /rates: what vLLM has
    monitor = ReplicaMonitor([replica], MemoryIndex(), interval=1.0, timeout=10.0)

    async def read() -> None:
        async with httpx.AsyncClient() as client:
            monitor._client = client
            await monitor.read_rates(replica)

    try:
        asyncio.run(read())
        assert replica.rates is None and replica.rates_error is None  # the first read: nothing to difference
        for n in range(3):
            body = {"model": "emulated", "prompt": list(range(100 * n, 100 * n + 40)), "max_tokens": 4}
            assert httpx.post(f"{live.base_url}/completions", json=body, timeout=30).status_code == 200
        asyncio.run(read())
    finally:
        live.stop()
    assert replica.rates is not None and replica.rates.source == METRICS_SOURCE, replica.rates_error
    return replica


def test_a_described_emulated_replica_gets_its_prefill_rate_from_its_metrics(
    make_engine: Callable[..., EmulatedEngine],
) -> None:
    rates = read_after_requests(make_engine(block_size=4, num_blocks=64)).rates
    assert rates is not None
    # each 40-token prompt is one step on the manual clock: 0.01 s of overhead and 40 ms of tokens
    assert rates.prefill_tokens_per_s == pytest.approx(40 / (PROFILE.step_overhead_s + 40 * 0.001))


def test_its_decode_step_is_at_least_the_modelled_one_on_a_wall_clock(tokenizer_folder: Path) -> None:
    options = EmulatorOptions(profile=PROFILE, num_blocks=64, block_size=4, max_model_len=256)
    rates = read_after_requests(EmulatedEngine(options, FolderTokenizer(tokenizer_folder))).rates
    assert rates is not None
    # tokens stream at the modelled pace or slower (a loaded machine runs late, never early)
    assert rates.decode_step_s >= PROFILE.step_overhead_s + PROFILE.decode_s_per_seq
