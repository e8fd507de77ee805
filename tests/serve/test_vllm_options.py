"""vLLM's request options on ``kvpool serve``: n choices sharing their prompt, stop strings, logprobs, echo,
several prompts, /tokenize and /detokenize, the stats line and the request log.

One engine and one server for the module; after every test no block is owned.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from kvpool.serve import ServeConfig, build_app
from kvpool.serve.stats_log import StatsLog
from kvpool.tenancy import SaltPolicy
from tests.serve.conftest import LiveServer

MODEL = "m"
PROMPT = list(range(1000, 1064))  # 64 token IDs: four full blocks of 16


class _BlockWatch:
    """A step hook recording each request's block IDs after its first step (engine thread)."""

    def __init__(self) -> None:
        self.blocks: dict[str, list[int]] = {}
        self.lock = threading.Lock()

    def __call__(self, engine: Any, deltas: Any) -> None:
        for delta in deltas:
            with self.lock:
                if delta.request_id not in self.blocks and not delta.finished:
                    self.blocks[delta.request_id] = list(engine.manager.get_block_ids(delta.request_id)[0])


@pytest.fixture(scope="module")
def watch() -> _BlockWatch:
    return _BlockWatch()


@pytest.fixture(scope="module")
def server(watch: _BlockWatch) -> Iterator[LiveServer]:
    import torch

    from kvpool.engine.llm_engine import LLMEngine

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    engine = LLMEngine(
        kv_cache_memory="64MiB", max_model_len=512, max_num_batched_tokens=256, threads=1, log=lambda line: None
    )
    config = ServeConfig(
        model_name=MODEL,
        api_keys=None,
        salts=SaltPolicy.isolated(b"a test secret of enough bytes"),
        log_requests=True,
        stats_interval=None,
    )
    live = LiveServer(build_app(engine, config, hooks=(watch,)))
    try:
        yield live
    finally:
        live.stop()
        torch.set_num_threads(threads)


def _post(server: LiveServer, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=120)


def _ok(server: LiveServer, path: str, body: dict[str, Any]) -> dict[str, Any]:
    response = _post(server, path, body)
    assert response.status_code == 200, response.text
    answer: dict[str, Any] = response.json()
    return answer


@pytest.fixture(autouse=True)
def _idle_after(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    if "server" in request.fixturenames:
        live = request.getfixturevalue("server")
        health = httpx.get(f"{live.url}/health", params={"verbose": "1"}, timeout=30).json()
        assert health["running"] == 0 and health["waiting"] == 0 and health["blocks_owned"] == 0, health


def test_n_choices_share_the_prompts_blocks(server: LiveServer, watch: _BlockWatch) -> None:
    prompt = [t + 1 for t in PROMPT]  # never seen before: nothing cached yet
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 3, "temperature": 1.0, "n": 3, "seed": 11}
    answer = _ok(server, "/v1/completions", body)
    assert [c["index"] for c in answer["choices"]] == [0, 1, 2]
    usage = answer["usage"]
    assert usage["prompt_tokens"] == 64  # the prompt counts once, as vLLM counts it
    assert usage["completion_tokens"] == 9
    assert usage["prompt_tokens_details"]["cached_tokens"] >= 48  # sequences 2 and 3 took the prompt's blocks
    ids = [rid for rid in watch.blocks if rid.startswith(answer["id"])]
    assert len(ids) == 3
    prompt_blocks = [tuple(watch.blocks[rid][:3]) for rid in ids]  # the 4th holds the token computed anew
    assert len(set(prompt_blocks)) == 1, prompt_blocks  # the same physical blocks, computed once
    again = _ok(server, "/v1/completions", body)
    assert [c["text"] for c in again["choices"]] == [c["text"] for c in answer["choices"]]  # seed + i per choice


def test_several_prompts_answer_in_order(server: LiveServer) -> None:
    body = {"model": MODEL, "prompt": ["The capital of France is", PROMPT], "max_tokens": 2, "temperature": 0, "n": 2}
    answer = _ok(server, "/v1/completions", body)
    texts = [c["text"] for c in answer["choices"]]
    assert [c["index"] for c in answer["choices"]] == [0, 1, 2, 3]
    assert texts[0] == texts[1] and texts[2] == texts[3]  # greedy: a prompt's two choices agree
    single = _ok(
        server,
        "/v1/completions",
        {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 2, "temperature": 0},
    )
    assert single["choices"][0]["text"] == texts[0]


def test_a_stop_string_cuts_the_text_and_is_reported(server: LiveServer) -> None:
    base = {"model": MODEL, "prompt": "Count: 1, 2, 3,", "max_tokens": 20, "temperature": 0}
    free = _ok(server, "/v1/completions", base)["choices"][0]["text"]
    assert " 5" in free
    cut = _ok(server, "/v1/completions", {**base, "stop": [" 5"]})["choices"][0]
    assert cut["text"] == free[: free.index(" 5")]
    assert cut["finish_reason"] == "stop" and cut["stop_reason"] == " 5"
    kept = _ok(server, "/v1/completions", {**base, "stop": " 5", "include_stop_str_in_output": True})["choices"][0]
    assert kept["text"] == free[: free.index(" 5") + 2]


def test_completion_logprobs_and_echo(server: LiveServer) -> None:
    prompt = "The capital of France is"
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 3, "temperature": 0, "logprobs": 2}
    choice = _ok(server, "/v1/completions", body)["choices"][0]
    logprobs = choice["logprobs"]
    assert "".join(logprobs["tokens"]) == choice["text"]
    assert len(logprobs["token_logprobs"]) == 3 and all(lp <= 0 for lp in logprobs["token_logprobs"])
    assert all(2 <= len(top) <= 3 and token in top for top, token in zip(logprobs["top_logprobs"], logprobs["tokens"]))
    offsets = logprobs["text_offset"]
    assert offsets[0] == 0 and offsets[1] == len(logprobs["tokens"][0])
    echoed = _ok(
        server, "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 3, "temperature": 0, "echo": True}
    )
    assert echoed["choices"][0]["text"] == prompt + choice["text"]


def test_chat_logprobs_stream_and_usage(server: LiveServer) -> None:
    messages = [{"role": "user", "content": "Say hello."}]
    body = {
        "model": MODEL,
        "messages": messages,
        "max_tokens": 3,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 2,
    }
    whole = _ok(server, "/v1/chat/completions", body)["choices"][0]
    content = whole["logprobs"]["content"]
    assert len(content) == 3 and all(len(entry["top_logprobs"]) == 2 for entry in content)
    assert "".join(entry["token"] for entry in content) == whole["message"]["content"]
    assert content[0]["bytes"] == list(content[0]["token"].encode())
    stream_body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=stream_body, timeout=120) as response:
        lines = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    import json

    chunks = [json.loads(line) for line in lines[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3
    streamed = [e for c in chunks[1:-1] for e in (c["choices"][0]["logprobs"] or {"content": []})["content"]]
    # The same tokens; the logprobs up to float noise (the stream's prompt came from the prefix cache).
    assert [e["token"] for e in streamed] == [e["token"] for e in content]
    assert [e["logprob"] for e in streamed] == pytest.approx([e["logprob"] for e in content], abs=1e-3)


def test_tokenize_and_detokenize_round_trip(server: LiveServer) -> None:
    tokens = _ok(server, "/tokenize", {"model": MODEL, "prompt": "The capital of France is"})
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == 512
    text = _ok(server, "/detokenize", {"model": MODEL, "tokens": tokens["tokens"]})
    assert text == {"prompt": "The capital of France is"}
    chat = _ok(server, "/tokenize", {"messages": [{"role": "user", "content": "hi"}]})
    assert chat["count"] > 3
    bad = _post(server, "/detokenize", {"model": MODEL, "tokens": [1, True]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens[1]"
    assert httpx.get(f"{server.url}/version", timeout=30).json()["version"]


def test_the_request_log_has_a_line_per_request(server: LiveServer, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="kvpool.serve"):
        answer = _ok(server, "/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 2})
    lines = [r.getMessage() for r in caplog.records if answer["id"] in r.getMessage()]
    assert len(lines) == 2, lines
    assert "64 tokens" in lines[0] and "2 output tokens" in lines[1]


def test_the_stats_line_reads_like_vllms() -> None:
    from types import SimpleNamespace

    from kvpool.stats import PrefixCacheStats

    now = [100.0]
    log = StatsLog(clock=lambda: now[0])
    assert log.line() is None  # nothing happened
    scheduler = SimpleNamespace(num_running=1, num_waiting=2, request=lambda rid: SimpleNamespace(num_prompt_tokens=40))
    manager = SimpleNamespace(usage=0.25, prefix_cache_stats=PrefixCacheStats(queries=40, hits=30))
    engine: Any = SimpleNamespace(scheduler=scheduler, manager=manager)
    log.after_step(engine, [SimpleNamespace(request_id="a", token_ids=(5,), finished=False, output=None)])
    log.after_step(engine, [SimpleNamespace(request_id="a", token_ids=(6,), finished=False, output=None)])
    now[0] = 110.0
    assert log.line() == (
        "Avg prompt throughput: 4.0 tokens/s, Avg generation throughput: 0.2 tokens/s, Running: 1 reqs, "
        "Waiting: 2 reqs, KV cache usage: 25.0%, Prefix cache hit rate: 75.0%"
    )
