"""One client cannot hurt the others through the server: failures stay with their request, prompts never stall steps.

* a 1e-300 temperature is greedy, beside honest requests that answer as alone;
* a forward pass failing on one request's chunk is that request's 500 (or a
  final SSE error event), the others answer as alone, their blocks stay cached;
* prompts are rendered and tokenized on the tokenizer thread, never the engine
  thread, and text too long to fit is refused before any tokenizer runs;
* integer fields refuse true and 1.0; a client leaving logs one line.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from kvpool.serve import ServeConfig, build_app
from kvpool.serve.tokenizer_thread import THREAD_NAME
from kvpool.tenancy import SaltPolicy
from tests.serve.conftest import LiveServer

MODEL = "smollm2-135m"
MAX_LEN = 128
MAX_BODY = 1 << 17
MARKER = 49_000  # a token ID no honest prompt here holds


@pytest.fixture(scope="module")
def engine() -> Iterator[Any]:
    import torch

    from kvpool.engine.llm_engine import LLMEngine

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield LLMEngine(
            kv_cache_memory="32MiB", max_model_len=MAX_LEN, max_num_batched_tokens=256, threads=1, log=lambda line: None
        )
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def server(engine: Any) -> Iterator[LiveServer]:
    config = ServeConfig(
        model_name=MODEL,
        api_keys=None,
        salts=SaltPolicy.isolated(b"a test secret of enough bytes"),
        max_body_bytes=MAX_BODY,
    )
    live = LiveServer(build_app(engine, config))
    try:
        yield live
    finally:
        live.stop()


def _health(server: LiveServer) -> dict[str, Any]:
    body: dict[str, Any] = httpx.get(f"{server.url}/health", params={"verbose": "1"}, timeout=30).json()
    return body


@pytest.fixture(autouse=True)
def _idle_after(server: LiveServer) -> Iterator[None]:
    yield
    deadline = time.monotonic() + 60
    while (health := _health(server))["running"] or health["waiting"]:
        assert time.monotonic() < deadline, health
        time.sleep(0.05)
    assert health["blocks_owned"] == 0 and health["invariants"] == "ok", health


def _post(server: LiveServer, body: Any, path: str = "/completions") -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", content=json.dumps(body).encode(), timeout=120)


def _text(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    return str(choice["text"] if "text" in choice else choice["message"]["content"])


def _together(server: LiveServer, bodies: list[dict[str, Any]]) -> list[httpx.Response]:
    """Post every body; the engine admits them all between the same two steps."""
    gate = threading.Event()
    held = threading.Event()

    def hold(engine: Any) -> None:
        held.set()
        gate.wait(60)

    server.engine_loop.run_soon(hold)
    assert held.wait(60)
    results: dict[int, httpx.Response] = {}
    threads = [
        threading.Thread(target=lambda i=i, b=b: results.__setitem__(i, _post(server, b))) for i, b in enumerate(bodies)
    ]
    for t in threads:
        t.start()
    inbox = server.engine_loop._inbox
    deadline = time.monotonic() + 60
    while inbox.qsize() < len(bodies):  # every admission waits behind the gate
        assert time.monotonic() < deadline
        time.sleep(0.01)
    gate.set()
    for t in threads:
        t.join(120)
    return [results[i] for i in range(len(bodies))]


_FACTS = "The capital of France is Paris. The capital of Italy is Rome. The capital of Germany is Berlin. "
HONEST = [  # prompts of more than two 16-token blocks, so a follow-up finds them cached
    {"model": MODEL, "prompt": _FACTS + "The capital of Spain is", "max_tokens": 6, "temperature": 0},
    {"model": MODEL, "prompt": _FACTS * 2 + "List three colours: red, green,", "max_tokens": 6, "temperature": 0},
]


def test_a_tiny_temperature_is_greedy_and_harms_no_one(server: LiveServer) -> None:
    alone = [_text(_post(server, body)) for body in HONEST]
    hostile = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 6, "temperature": 1e-300}
    greedy = _text(_post(server, {**hostile, "temperature": 0}))
    answers = _together(server, [*HONEST, hostile])
    assert [_text(r) for r in answers[:2]] == alone
    assert _text(answers[2]) == greedy
    usage = _post(server, HONEST[0]).json()["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] > 0  # the prefix cache kept its blocks


@pytest.fixture
def faulty(engine: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    real = engine.setup.runner.execute

    def execute(chunks: Any) -> Any:
        if any(MARKER in c.token_ids for c in chunks):
            raise RuntimeError("an injected fault")
        return real(chunks)

    monkeypatch.setattr(engine.setup.runner, "execute", execute)


@pytest.mark.usefixtures("faulty")
def test_a_forward_pass_failing_for_one_request_fails_only_it(server: LiveServer) -> None:
    alone = [_text(_post(server, body)) for body in HONEST]
    bad = {"model": MODEL, "prompt": [504, 3260, 314, MARKER, 28], "max_tokens": 6}
    answers = _together(server, [*HONEST, bad])
    assert [_text(r) for r in answers[:2]] == alone
    assert answers[2].status_code == 500, answers[2].text
    error = answers[2].json()["error"]
    assert error["type"] == "server_error" and error["code"] == "request_failed"
    assert "an injected fault" in error["message"]
    usage = _post(server, HONEST[1]).json()["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] > 0  # nothing reset the prefix cache


@pytest.mark.usefixtures("faulty")
def test_a_streamed_request_that_fails_ends_with_an_error_event(server: LiveServer) -> None:
    bad = {"model": MODEL, "prompt": [504, MARKER, 28], "max_tokens": 6, "stream": True}
    with httpx.stream("POST", f"{server.base_url}/completions", content=json.dumps(bad).encode(), timeout=60) as r:
        assert r.status_code == 200
        events = [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == "request_failed" and "an injected fault" in error["message"]


# -- prompts off the engine thread -------------------------------------------------------------


@pytest.fixture
def tokenizer_threads(engine: Any, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the threads that encode or render a prompt (a tokenizer's own calls)."""
    names: list[str] = []
    tokenizer = engine.tokenizer
    for method in ("encode", "apply_chat_template", "__call__"):
        real = getattr(tokenizer, method)

        def wrapped(*args: Any, _real: Any = real, **kwargs: Any) -> Any:
            names.append(threading.current_thread().name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(tokenizer, method, wrapped)
    return names


def test_huge_prompts_are_never_tokenized_on_the_engine_thread(
    server: LiveServer, tokenizer_threads: list[str]
) -> None:
    stop = threading.Event()
    statuses: queue.SimpleQueue[int] = queue.SimpleQueue()

    def flood() -> None:
        words = "lorem ipsum dolor sit amet " * 370  # ~10 000 characters: tokenized, then too long for 128 tokens
        while not stop.is_set():
            statuses.put(_post(server, {"model": MODEL, "prompt": words, "max_tokens": 2}).status_code)
            chat = {"model": MODEL, "messages": [{"role": "user", "content": words}], "max_tokens": 2}
            statuses.put(_post(server, chat, "/chat/completions").status_code)

    flooder = threading.Thread(target=flood)
    flooder.start()
    try:
        for _ in range(3):
            assert _text(_post(server, {"model": MODEL, "prompt": "Hello", "max_tokens": 2}))
            chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
            assert _text(_post(server, chat, "/chat/completions")) is not None
    finally:
        stop.set()
        flooder.join(120)
    assert statuses.get(timeout=60) == 400  # the flood was tokenized and refused for its length
    assert tokenizer_threads and "kvpool-engine" not in tokenizer_threads
    assert all(name.startswith(THREAD_NAME) for name in tokenizer_threads), set(tokenizer_threads)


def test_text_too_long_to_fit_is_refused_before_tokenizing(server: LiveServer, tokenizer_threads: list[str]) -> None:
    prompts = server.app.state.server.prompts
    size = prompts.max_chars + 1
    response = _post(server, {"model": MODEL, "prompt": "x" * size})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "context_length_exceeded" and error["param"] == "prompt"
    assert f"{size} characters" in error["message"] and str(MAX_LEN) in error["message"]
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "y" * size}]}
    assert _post(server, chat, "/chat/completions").json()["error"]["param"] == "messages"
    assert tokenizer_threads == []  # no tokenizer ran for either


# -- small ones ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [("n", True), ("n", 1.0), ("best_of", 1.0), ("best_of", True), ("top_k", -1.0), ("max_tokens", 2.0)],
)
def test_integer_fields_refuse_bools_and_floats(server: LiveServer, field: str, value: Any) -> None:
    response = _post(server, {"model": MODEL, "prompt": "hi", field: value})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == field and repr(value) in error["message"]


@pytest.mark.parametrize("prompt", [{"text": "hi"}, [{"text": "hi"}], [[1, 2], {"a": 1}], [1.0, 2.0]])
def test_prompts_other_than_text_or_token_ids_are_refused(server: LiveServer, prompt: Any) -> None:
    response = _post(server, {"model": MODEL, "prompt": prompt})
    assert response.status_code == 400 and response.json()["error"]["param"] == "prompt"


class _Records(logging.Handler):
    """Keeps every record; sets ``seen`` when one holds ``words``."""

    def __init__(self, words: str) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []
        self.seen = threading.Event()
        self.words = words

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)
        if self.words in record.getMessage():
            self.seen.set()


@pytest.fixture
def server_log() -> Iterator[_Records]:
    records = _Records("went away")
    loggers = [logging.getLogger(name) for name in ("kvpool", "uvicorn.error", "uvicorn")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.addHandler(records)
        lg.setLevel(logging.DEBUG)
    try:
        yield records
    finally:
        for lg, level in zip(loggers, levels):
            lg.removeHandler(records)
            lg.setLevel(level)


def _send_and_leave(server: LiveServer, raw: bytes, until: Any = None) -> None:
    import socket

    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(raw)
        deadline = time.monotonic() + 60
        while until is not None and not until():
            assert time.monotonic() < deadline
            time.sleep(0.01)


def test_a_client_leaving_logs_one_line(server: LiveServer, server_log: _Records) -> None:
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
    # While uploading: the body is cut short.
    _send_and_leave(server, head % 100_000 + b'{"model": "smollm2-135m", "prompt": "' + b"a" * 500)
    assert server_log.seen.wait(60)
    server_log.seen.clear()
    # Waiting for a whole answer: the request runs, then the client goes.
    body = json.dumps({"model": MODEL, "prompt": "Count: 1, 2,", "max_tokens": 100, "ignore_eos": True}).encode()
    _send_and_leave(server, head % len(body) + body, until=lambda: _health(server)["running"])
    assert server_log.seen.wait(60)
    ours = [r for r in server_log.records if "went away" in r.getMessage()]
    assert len(ours) == 2 and all(r.levelno <= logging.INFO for r in ours)
    assert not [r.getMessage() for r in server_log.records if r.exc_info or r.levelno >= logging.WARNING]
