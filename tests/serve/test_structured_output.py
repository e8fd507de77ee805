"""``response_format`` on ``kvpool serve``: a JSON schema answered end to end, and the refusals naming it;
``tools`` refused with the reason (SmolLM2's chat template has no place for them).

The structured tests need llguidance (the ``structured`` extra): skipped without it, failed under ``CI=true``.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from kvpool.serve import ServeConfig, build_app
from kvpool.tenancy import SaltPolicy
from tests.serve.conftest import LiveServer
from tests.services import unavailable

MODEL = "m"
CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 40}, "country": {"type": "string", "maxLength": 40}},
    "required": ["city", "country"],
    "additionalProperties": False,
}


@pytest.fixture
def _llguidance() -> None:
    if importlib.util.find_spec("llguidance") is None:
        unavailable("llguidance is not installed (pip install 'kvpool[structured]')")


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
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
        stats_interval=None,
    )
    live = LiveServer(build_app(engine, config))
    try:
        yield live
    finally:
        live.stop()
        torch.set_num_threads(threads)


def _chat(server: LiveServer, response_format: Any, **extra: Any) -> httpx.Response:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Where is the Eiffel Tower?"}],
        "max_tokens": 100,
        "response_format": response_format,
        **extra,
    }
    return httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120)


@pytest.mark.slow
@pytest.mark.usefixtures("_llguidance")
def test_a_json_schema_chat_request_answers_a_document_of_the_schema(server: LiveServer) -> None:
    response = _chat(server, {"type": "json_schema", "json_schema": {"name": "place", "schema": CITY, "strict": True}})
    assert response.status_code == 200, response.text
    [choice] = response.json()["choices"]
    document = json.loads(choice["message"]["content"])
    assert set(document) == {"city", "country"} and all(isinstance(v, str) for v in document.values()), document
    assert choice["finish_reason"] == "stop"


@pytest.mark.slow
@pytest.mark.usefixtures("_llguidance")
def test_a_streamed_json_object_request_answers_an_object(server: LiveServer) -> None:
    pieces, reasons = [], []
    with httpx.stream(
        "POST",
        f"{server.url}/v1/chat/completions",
        json={
            "model": MODEL,
            "messages": [{"role": "user", "content": "Name a fruit."}],
            "max_tokens": 100,
            "response_format": {"type": "json_object"},
            # Greedy: a sampled object may still be open at max_tokens (one CI run drew a 100-digit number).
            "temperature": 0,
            "stream": True,
        },
        timeout=120,
    ) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: {"):
                [choice] = json.loads(line[len("data: ") :])["choices"]
                pieces.append(choice["delta"].get("content") or "")
                reasons.append(choice["finish_reason"])
    assert isinstance(json.loads("".join(pieces)), dict), pieces
    assert reasons[-1] == "stop"


@pytest.mark.usefixtures("_llguidance")
@pytest.mark.parametrize(
    ("response_format", "param", "words"),
    [
        (
            {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}},
            "response_format",
            "cannot be served",
        ),
        ({"type": "json_schema"}, "response_format.json_schema", "required"),
        ({"type": "json_schema", "json_schema": {"schema": CITY}}, "response_format.json_schema.name", "required"),
        (
            {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}},
            "response_format.json_schema.schema",
            "",
        ),
        ({"type": "xml"}, "response_format.type", "xml"),
        ({"type": "json_object", "json_schema": {"name": "x", "schema": {}}}, "response_format.json_schema", "only"),
    ],
)
def test_a_response_format_that_cannot_be_served_is_a_400_naming_it(
    server: LiveServer, response_format: Any, param: str, words: str
) -> None:
    response = _chat(server, response_format)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"], error


@pytest.mark.usefixtures("_llguidance")
def test_text_is_the_default_format(server: LiveServer) -> None:
    response = _chat(server, {"type": "text"}, max_tokens=4)
    assert response.status_code == 200, response.text


TOOL = {"type": "function", "function": {"name": "weather", "parameters": {"type": "object", "properties": {}}}}


def test_tools_are_refused_naming_the_templates_lack(server: LiveServer) -> None:
    assert server.app.state.server.loop.engine.chat_template_supports_tools is False  # SmolLM2's template
    response = _chat(server, None, tools=[TOOL])
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "tools" and "chat template does not support tools" in error["message"], error
    # No tools, or an empty list, is a plain chat request.
    assert _chat(server, None, tools=[], max_tokens=2).status_code == 200


def test_tools_with_a_template_that_takes_them_are_refused_until_tool_calls_are_parsed() -> None:
    from kvpool.openai_http.protocol import APIError, GenerationEndpoint, parse_generation
    from kvpool.serve.generation import check_tools

    gen = parse_generation(GenerationEndpoint.CHAT, {"messages": [{"role": "user", "content": "x"}], "tools": [TOOL]})
    assert gen.tools == (TOOL,)
    with pytest.raises(APIError, match="tool calls are not parsed") as caught:
        check_tools(gen, True)
    assert caught.value.status == 400 and caught.value.param == "tools"
    check_tools(parse_generation(GenerationEndpoint.CHAT, {"messages": [{"role": "user", "content": "x"}]}), False)
