"""KV events from an app built in Python: ``build_app(..., events=publisher)`` publishes and describes them itself."""

from __future__ import annotations

import types
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from kvpool.errors import ConfigError
from kvpool.serve import ServeConfig, build_app
from kvpool.tenancy import SaltPolicy
from tests.serve.conftest import LiveServer

MODEL = "smollm2-135m"


def _config(**changes: Any) -> ServeConfig:
    return ServeConfig(model_name=MODEL, api_keys=None, salts=SaltPolicy.shared(), stats_interval=None, **changes)


@pytest.fixture(scope="module")
def engine() -> Iterator[Any]:
    import torch

    from kvpool.engine.llm_engine import LLMEngine

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield LLMEngine(
            kv_cache_memory="32MiB", max_model_len=512, enable_kv_events=True, threads=1, log=lambda line: None
        )
    finally:
        torch.set_num_threads(threads)


def test_a_python_built_app_publishes_block_stored_and_answers_kv_events(engine: Any) -> None:
    pytest.importorskip("zmq")
    from kvpool.events import BlockStored
    from kvpool.kv_events import KVEventPublisher, KVEventSubscriber

    publisher = KVEventPublisher("bind:tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0")
    live = LiveServer(build_app(engine, _config(), events=publisher))
    try:
        where = httpx.get(f"{live.url}/kv-events", timeout=30).json()
        assert where["enabled"] is True
        assert (where["endpoint"], where["replay_endpoint"]) == (publisher.endpoint, publisher.replay_endpoint)
        assert where["block_size"] == 16 and where["num_blocks"] == engine.num_blocks
        with KVEventSubscriber(publisher.endpoint, replay_endpoint=publisher.replay_endpoint) as subscriber:
            prompt = list(range(2000, 2040))  # two full blocks
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 1}
            response = httpx.post(f"{live.url}/v1/completions", json=body, timeout=60)
            assert response.status_code == 200, response.text
            # The hook publishes before the step's output reaches the response, and a replay asked for
            # after publish() returned holds that batch: no waiting.
            stored = [
                event for item in subscriber.replay(0) for event in item.batch.events if isinstance(event, BlockStored)
            ]
        assert [token for event in stored for token in event.token_ids][:32] == prompt[:32]
    finally:
        live.stop()
    with pytest.raises(ConfigError, match="closed"):  # the app closed its publisher when it stopped
        publisher.publish([])


def test_events_are_refused_for_an_engine_that_records_none_and_beside_a_kv_events_body() -> None:
    pytest.importorskip("zmq")
    from kvpool.kv_events import KVEventPublisher

    silent = types.SimpleNamespace(setup=types.SimpleNamespace(options=types.SimpleNamespace(enable_kv_events=False)))
    with KVEventPublisher("bind:tcp://127.0.0.1:0") as publisher:
        with pytest.raises(ConfigError, match="enable_kv_events=False"):
            build_app(silent, _config(), events=publisher)  # type: ignore[arg-type]  # only its options are read
        with pytest.raises(ConfigError, match="not both"):
            build_app(silent, _config(kv_events=lambda: {}), events=publisher)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="KVEventPublisher, got 'tcp://127.0.0.1:5557'"):
        build_app(silent, _config(), events="tcp://127.0.0.1:5557")  # type: ignore[arg-type]
