"""One tenant cannot take the server: request limits, a queue per tenant, fair admission, small refusals.

Issue 25, class 1 and the small ones of class 7, end to end on a live ``kvpool serve`` (SmolLM2-135M).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from kvpool.serve import ServeConfig, build_app
from kvpool.tenancy import KeyRing, SaltPolicy
from tests.serve.conftest import LiveServer

MODEL = "smollm2-135m"
KEYS = {"key-alice": "alice", "key-mallory": "mallory"}
#: How long a wait for an event may take before the test calls the server stuck: generous, for a loaded machine
#: (the tests wait for states, never for a time; this only ends a wait that would never end).
STUCK = 900


@pytest.fixture(scope="module")
def engine() -> Iterator[Any]:
    import torch

    from kvpool.engine.llm_engine import LLMEngine

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield LLMEngine(
            kv_cache_memory="16MiB",
            max_model_len=256,
            max_num_batched_tokens=128,
            max_num_seqs=8,
            threads=1,
            log=lambda _: None,
        )
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def server(engine: Any) -> Iterator[LiveServer]:
    config = ServeConfig(
        model_name=MODEL,
        api_keys=KeyRing.from_mapping(KEYS),
        salts=SaltPolicy.isolated(b"a test secret of enough bytes"),
        max_waiting=4,
        stats_interval=None,
    )
    live = LiveServer(build_app(engine, config))
    try:
        yield live
    finally:
        live.stop()


def _post(server: LiveServer, body: dict[str, Any], key: str = "key-alice") -> httpx.Response:
    return httpx.post(
        f"{server.base_url}/completions", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=STUCK
    )


def _health(server: LiveServer) -> dict[str, Any]:
    body: dict[str, Any] = httpx.get(f"{server.url}/health", params={"verbose": "1"}, timeout=30).json()
    return body


@pytest.fixture(autouse=True)
def _idle_after(server: LiveServer) -> Iterator[None]:
    yield
    deadline = time.monotonic() + STUCK
    while (health := _health(server))["running"] or health["waiting"]:
        assert time.monotonic() < deadline, health
        time.sleep(0.05)
    assert health["blocks_owned"] == 0 and health["invariants"] == "ok", health


def test_n_times_the_rest_of_the_context_is_refused_with_the_figures(server: LiveServer, engine: Any) -> None:
    """The high defect of issue 25: n=128, no max_tokens, ignore_eos. Refused at once, naming the values."""
    limit = engine.pool_tokens
    response = _post(server, {"model": MODEL, "prompt": "Hi", "n": 2, "max_tokens": 4}, key="key-mallory")
    assert response.status_code == 200
    # n=4 (the queue's limit here) x the rest of the 256-token context: more than the pool's tokens. A chat
    # without max_tokens runs to the end of the context (a completion stops at 16, as in vLLM).
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "n": 4, "ignore_eos": True}
    response = httpx.post(
        f"{server.base_url}/chat/completions", json=chat, headers={"Authorization": "Bearer key-mallory"}, timeout=STUCK
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "request_too_large" and error["param"] == "max_tokens"
    assert "4 sequences" in error["message"] and str(limit) in error["message"]
    assert "rest of the context" in error["message"]


def test_min_tokens_is_bounded_the_same_way(server: LiveServer) -> None:
    response = _post(server, {"model": MODEL, "prompt": "Hi", "min_tokens": 10**30, "max_tokens": None})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "min_tokens"
    response = _post(server, {"model": MODEL, "prompt": "Hi", "n": 2, "min_tokens": 200, "max_tokens": 200})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["code"] == "request_too_large"


def test_out_of_vocabulary_stop_token_ids_are_400(server: LiveServer, engine: Any) -> None:
    vocab = engine.runner.vocab_size
    response = _post(server, {"model": MODEL, "prompt": "Hi", "max_tokens": 2, "stop_token_ids": [5, vocab]})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "stop_token_ids" and str(vocab) in error["message"]


@pytest.mark.parametrize("penalty", [1e-300, 5e-324, 1e300])
def test_an_extreme_repetition_penalty_is_400_naming_it(server: LiveServer, penalty: float) -> None:
    response = _post(server, {"model": MODEL, "prompt": "Hi", "max_tokens": 2, "repetition_penalty": penalty})
    assert response.status_code == 400, response.text
    assert "repetition_penalty" in response.json()["error"]["message"]


def test_one_tenants_full_queue_leaves_anothers_open(server: LiveServer) -> None:
    """max_waiting counts per tenant: mallory's backlog earns mallory a 429, never alice."""
    gate = threading.Event()
    server.engine_loop.run_soon(lambda engine: gate.wait(STUCK))  # hold the engine thread: admissions pile up
    results: dict[str, list[int]] = {"alice": [], "mallory": []}

    def send(who: str) -> None:
        body = {"model": MODEL, "prompt": "Count: 1, 2,", "max_tokens": 2}
        results[who].append(_post(server, body, key=f"key-{who}").status_code)

    senders = [threading.Thread(target=send, args=("mallory",)) for _ in range(6)]
    for t in senders:
        t.start()
    inbox = server.engine_loop._inbox
    deadline = time.monotonic() + STUCK
    while inbox.qsize() < 6:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    alice = threading.Thread(target=send, args=("alice",))
    alice.start()
    while inbox.qsize() < 7:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    gate.set()
    for t in [*senders, alice]:
        t.join(STUCK)
    assert sorted(results["mallory"]) == [200] * 4 + [429] * 2
    assert results["alice"] == [200]


def test_another_tenants_request_is_served_while_one_tenant_fills_the_pool(server: LiveServer) -> None:
    """mallory's requests run to the end of the context and hold the pool; alice's short request is
    admitted beside them (mallory's latest is preempted for it) and answers while mallory's still run."""
    mallory_done: list[float] = []
    streams: list[httpx.Response] = []
    started = threading.Event()
    client = httpx.Client(timeout=STUCK)

    def hog(i: int) -> None:
        body = {"model": MODEL, "prompt": f"Story {i}:", "max_tokens": 250, "ignore_eos": True, "stream": True}
        try:
            with client.stream(
                "POST", f"{server.base_url}/completions", json=body, headers={"Authorization": "Bearer key-mallory"}
            ) as response:
                streams.append(response)
                for line in response.iter_lines():
                    if line.startswith("data: {"):
                        started.set()
                    if line == "data: [DONE]":
                        mallory_done.append(time.monotonic())
                        return
        except httpx.HTTPError:  # the test closed the stream: mallory left
            return

    hogs = [threading.Thread(target=hog, args=(i,), daemon=True) for i in range(3)]
    for t in hogs:
        t.start()
    assert started.wait(STUCK)
    deadline = time.monotonic() + STUCK
    while _health(server)["waiting"] < 1:  # 3 x 254 tokens are more than the pool holds: one was preempted
        assert time.monotonic() < deadline
        time.sleep(0.02)
    answer = _post(server, {"model": MODEL, "prompt": "Hi", "max_tokens": 4, "ignore_eos": True})
    assert answer.status_code == 200, answer.text
    assert json.loads(answer.text)["usage"]["completion_tokens"] == 4
    assert not mallory_done, "alice's answer came only after mallory's sequences ended"
    for response in streams:
        response.close()  # mallory leaves: its requests are aborted
    client.close()
    for t in hogs:
        t.join(STUCK)
