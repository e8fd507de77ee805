"""An emulated replica's KV events, decoded by the router's own decoder, carry the hashes its manager stored."""

from __future__ import annotations

from collections.abc import Callable

import pytest

pytest.importorskip("zmq")
pytest.importorskip("msgspec")
pytest.importorskip("starlette")
httpx = pytest.importorskip("httpx")

from kvpool.emulator import EmulatedEngine  # noqa: E402
from kvpool.events import BlockRemoved, BlockStored  # noqa: E402
from kvpool.kv_events import KVEventPublisher, KVEventSubscriber  # noqa: E402
from kvpool.router.prompt_hashes import block_hashes  # noqa: E402
from kvpool.serve import build_app  # noqa: E402
from tests.emulator.conftest import serve_config  # noqa: E402
from tests.serve.conftest import LiveServer  # noqa: E402


@pytest.mark.parametrize("hash_algo", ["sha256", "kvpool_sha256"])
def test_block_stored_events_carry_the_managers_hashes(
    make_engine: Callable[..., EmulatedEngine], hash_algo: str
) -> None:
    engine = make_engine(block_size=4, num_blocks=12, enable_kv_events=True, hash_algo=hash_algo)
    publisher = KVEventPublisher("bind:tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0")
    live = LiveServer(build_app(engine, serve_config(), events=publisher))
    prompts = [list(range(10, 30)), list(range(50, 86))]  # 5 blocks, then 9: the pool of 11 must evict
    try:
        described = httpx.get(f"{live.url}/kv-events", timeout=30).json()
        assert (described["endpoint"], described["block_size"]) == (publisher.endpoint, 4)
        with KVEventSubscriber(publisher.endpoint, replay_endpoint=publisher.replay_endpoint) as subscriber:
            for prompt in prompts:
                body = {"model": "emulated", "prompt": prompt, "max_tokens": 1}
                response = httpx.post(f"{live.base_url}/completions", json=body, timeout=30)
                assert response.status_code == 200, response.text
            # the step hook publishes before the answer leaves, so a replay asked for now holds every batch
            events = [event for item in subscriber.replay(0) for event in item.batch.events]
    finally:
        live.stop()
    stored = [h for e in events if isinstance(e, BlockStored) for h in e.block_hashes]
    removed = [h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes]
    router_hashes = [block_hashes(engine.manager.hasher, p, None) for p in prompts]  # what a router computes
    assert stored == router_hashes[0] + router_hashes[1]
    held = {block.block_hash for block in engine.manager.pool.blocks if block.block_hash is not None}
    assert set(stored) - set(removed) == held  # the stream says exactly what the pool holds
    assert removed  # the second prompt evicted some of the first's blocks, and said so
