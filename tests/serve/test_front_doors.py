"""What a vLLM user types works as they expect (issue 30): the completions default, /tokenize as vLLM's.

The first tests need no model: a fake engine whose tokenizer adds a BOS token when asked. The live ones
serve SmolLM2 with API keys set.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from kvpool.openai_http import tokenizer_turn
from kvpool.openai_http.protocol import GenerationEndpoint, GenerationRequest, parse_generation
from kvpool.openai_http.schema import COMPLETION_MAX_TOKENS
from kvpool.serve.tokenize import tokenize_body
from kvpool.serve.tokenizer_thread import TokenizerThread
from kvpool.tenancy import DEFAULT_TENANT, KeyRing, SaltPolicy
from tests.serve.conftest import LiveServer

BOS = 1
KEYS = KeyRing.from_mapping({"sk-alice": "alice"})


def test_completions_default_to_16_tokens_and_null_means_16_while_chat_runs_to_the_context() -> None:
    assert COMPLETION_MAX_TOKENS == 16
    left_out = parse_generation(GenerationEndpoint.COMPLETIONS, {"prompt": "Hi"})
    null = parse_generation(GenerationEndpoint.COMPLETIONS, {"prompt": "Hi", "max_tokens": None})
    given = parse_generation(GenerationEndpoint.COMPLETIONS, {"prompt": "Hi", "max_tokens": 100})
    assert (left_out.sampling.max_tokens, null.sampling.max_tokens, given.sampling.max_tokens) == (16, 16, 100)
    chat = parse_generation(GenerationEndpoint.CHAT, {"messages": [{"role": "user", "content": "Hi"}]})
    assert chat.sampling.max_tokens is None  # the rest of the context


class _BosTokenizer:
    chat_template = "x"

    def get_vocab(self) -> dict[str, int]:
        return {"<s>": BOS, "word": 2}

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return " ".join(map(str, ids))


class _BosEngine:
    """Each word is token 2 plus its length; ``add_special_tokens`` puts BOS first."""

    def __init__(self) -> None:
        self.tokenizer = _BosTokenizer()
        self.max_model_len = 1000

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return ([BOS] if add_special_tokens else []) + [2 + len(w) for w in text.split()]

    def render_chat(self, conversation: Any, *, add_generation_prompt: bool = True) -> str:
        return " ".join(m["content"] for m in conversation)


def _tokenize(body: dict[str, Any]) -> list[int]:
    prompts = TokenizerThread(_BosEngine())  # type: ignore[arg-type]
    prompts.start()

    def any_model(gen: GenerationRequest) -> None:
        pass

    try:
        answer = asyncio.run(tokenize_body(body, prompts, any_model, None))
    finally:
        prompts.close()
    tokens: list[int] = answer["tokens"]
    return tokens


def test_add_special_tokens_follows_vllm_for_a_prompt_and_for_messages() -> None:
    assert _tokenize({"prompt": "ab c"}) == [BOS, 4, 3]  # a prompt: added by default
    assert _tokenize({"prompt": "ab c", "add_special_tokens": True}) == [BOS, 4, 3]
    assert _tokenize({"prompt": "ab c", "add_special_tokens": False}) == [4, 3]
    messages = [{"role": "user", "content": "ab c"}]
    assert _tokenize({"messages": messages}) == [4, 3]  # messages: the template wrote them
    assert _tokenize({"messages": messages, "add_special_tokens": False}) == [4, 3]
    assert _tokenize({"messages": messages, "add_special_tokens": True}) == [BOS, 4, 3]  # on top of the template's


def test_add_special_tokens_must_be_true_or_false() -> None:
    from kvpool.openai_http.errors import APIError

    with pytest.raises(APIError) as caught:
        _tokenize({"prompt": "ab", "add_special_tokens": "no"})
    assert caught.value.status == 400 and caught.value.body["error"]["param"] == "add_special_tokens"


def test_tokenize_takes_a_tenants_turns_with_its_key_and_one_shared_turn_without() -> None:
    assert tokenizer_turn(None, None) == DEFAULT_TENANT  # no keys: every request is the default tenant's
    assert tokenizer_turn(KEYS, "Bearer sk-alice") == "alice"
    # no key and a wrong key are alike: one turn for all of them, and nothing tells a wrong key from none
    assert tokenizer_turn(KEYS, None) is None
    assert tokenizer_turn(KEYS, "Bearer sk-wrong") is None
    assert tokenizer_turn(KEYS, "Basic abc") is None


# -- live: SmolLM2 behind API keys ----------------------------------------------------------------

MODEL = "m"


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    import torch

    from kvpool.engine.llm_engine import LLMEngine
    from kvpool.serve import ServeConfig, build_app

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    engine = LLMEngine(
        kv_cache_memory="64MiB", max_model_len=512, max_num_batched_tokens=256, threads=1, log=lambda line: None
    )
    config = ServeConfig(
        model_name=MODEL,
        api_keys=KEYS,
        salts=SaltPolicy.isolated(b"a test secret of enough bytes"),
        stats_interval=None,
    )
    live = LiveServer(build_app(engine, config))
    try:
        yield live
    finally:
        live.stop()
        torch.set_num_threads(threads)


def _post(server: LiveServer, path: str, body: dict[str, Any], key: str | None = None) -> httpx.Response:
    headers = {} if key is None else {"Authorization": f"Bearer {key}"}
    return httpx.post(f"{server.url}{path}", json=body, headers=headers, timeout=120)


def test_a_completion_without_max_tokens_stops_at_16(server: LiveServer) -> None:
    for body in ({"prompt": "Hi"}, {"prompt": "Hi", "max_tokens": None}):
        answer = _post(server, "/v1/completions", {**body, "ignore_eos": True}, "sk-alice")
        assert answer.status_code == 200, answer.text
        assert answer.json()["usage"]["completion_tokens"] == 16
        assert answer.json()["choices"][0]["finish_reason"] == "length"


def test_tokenize_and_detokenize_need_no_key_while_v1_does(server: LiveServer) -> None:
    expected = None
    for key in (None, "sk-alice", "sk-wrong"):
        tokens = _post(server, "/tokenize", {"prompt": "The capital of France is", "add_special_tokens": False}, key)
        assert tokens.status_code == 200, tokens.text
        expected = expected or tokens.json()["tokens"]
        assert tokens.json()["tokens"] == expected
        text = _post(server, "/detokenize", {"tokens": expected}, key)
        assert text.status_code == 200 and text.json() == {"prompt": "The capital of France is"}
    refused = _post(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 1})
    assert refused.status_code == 401
    assert _post(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 1}, "sk-wrong").status_code == 401


def test_a_keyless_tokenize_is_still_bounded(server: LiveServer) -> None:
    prompts = server.app.state.server.prompts
    assert prompts.max_chars is not None
    huge = _post(server, "/tokenize", {"prompt": "a" * (prompts.max_chars + 1)})
    assert huge.status_code == 400 and huge.json()["error"]["code"] == "context_length_exceeded"
    model = _post(server, "/tokenize", {"model": "other", "prompt": "Hi"})
    assert model.status_code == 404


@pytest.mark.slow
def test_a_vllm_launch_line_serves_and_says_when_it_stops(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from bench_timing_leak import ServeProcess

    monkeypatch.setenv("VLLM_API_KEY", "sk-from-env")
    args = ["--dtype", "float32", "--tensor-parallel-size", "1", "--max-model-len", "1k", "--kv-cache-memory", "64MiB"]
    server = ServeProcess(args, threads=1).start()
    try:
        models = httpx.get(f"{server.url}/v1/models", timeout=30)
        assert models.status_code == 401  # the key from the environment guards /v1
        models = httpx.get(f"{server.url}/v1/models", headers={"Authorization": "Bearer sk-from-env"}, timeout=30)
        assert models.status_code == 200 and models.json()["data"][0]["max_model_len"] == 1000
        assert httpx.post(f"{server.url}/tokenize", json={"prompt": "Hi"}, timeout=30).status_code == 200
        server.stop()
        log = server.log()
        assert "API key from $VLLM_API_KEY" in log and "1 tenant, 1 API key" in log, log
        assert f"stopped serving 'smollm2-135m' on {server.url}/v1" in log, log
    finally:
        server.stop()
        if server.log_path is not None:
            server.log_path.unlink(missing_ok=True)
