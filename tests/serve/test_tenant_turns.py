"""The tokenizer thread takes turns between tenants, and a long text is counted in pieces (issue 25, class 2).

No model: a fake engine whose tokenizer splits on spaces, so the counts are known exactly.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from kvpool import prompts as prompt_rule
from kvpool.openai_http.errors import APIError
from kvpool.openai_http.protocol import GenerationEndpoint, GenerationRequest
from kvpool.sampling_params import SamplingParams
from kvpool.serve.tenant_worker import TenantWorker
from kvpool.serve.tokenizer_thread import PIECE_CHARS, TokenizerThread


def test_a_tenants_backlog_waits_behind_one_task_of_each_other_tenant() -> None:
    worker = TenantWorker("test-turns")
    order: list[str] = []
    gate, holding = threading.Event(), threading.Event()

    def hold() -> None:
        holding.set()
        gate.wait(600)

    worker.submit("mallory", hold)  # holds the thread while the queues fill
    assert holding.wait(600)  # the worker took mallory's first task: her queue is empty again
    futures = [worker.submit("mallory", order.append, f"m{i}") for i in range(10)]
    futures.append(worker.submit("alice", order.append, "a0"))
    futures.append(worker.submit("bob", order.append, "b0"))
    gate.set()
    for future in futures:
        future.result(30)
    assert order[:3] == ["m0", "a0", "b0"]  # mallory's other nine wait behind alice's and bob's one
    assert order[3:] == [f"m{i}" for i in range(1, 10)]
    worker.close()


def test_a_cancelled_task_is_never_run_and_errors_reach_their_waiter() -> None:
    worker = TenantWorker("test-cancel")
    gate = threading.Event()
    ran: list[int] = []
    worker.submit(None, gate.wait, 30)
    dropped = worker.submit(None, ran.append, 1)
    assert dropped.cancel()
    failing = worker.submit("a", int, "not a number")
    kept = worker.submit("a", ran.append, 2)
    gate.set()
    kept.result(30)
    with pytest.raises(ValueError):
        failing.result(30)
    assert ran == [2]
    worker.close()
    with pytest.raises(Exception, match="stopped"):
        worker.submit(None, ran.append, 3)


class _SpaceTokenizer:
    """A tokenizer of whole words: one token per space-separated word."""

    chat_template = "x"

    def get_vocab(self) -> dict[str, int]:
        return {"a" * 40: 0, "b": 1}

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return " ".join(map(str, ids))


class _FakeEngine:
    def __init__(self, max_model_len: int) -> None:
        self.tokenizer = _SpaceTokenizer()
        self.max_model_len = max_model_len
        self.pieces_encoded: list[int] = []

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        self.pieces_encoded.append(len(text))
        return [len(w) for w in text.split()]

    def render_chat(self, conversation: Any, *, add_generation_prompt: bool = True) -> str:
        return " ".join(m["content"] for m in conversation)


def _gen(prompt: str) -> GenerationRequest:
    return GenerationRequest(
        endpoint=GenerationEndpoint.COMPLETIONS, model=None, prompts=(prompt,), messages=None, sampling=SamplingParams()
    )


def test_the_size_bound_follows_the_measured_characters_per_token() -> None:
    engine = _FakeEngine(max_model_len=1000)
    tokenizer = TokenizerThread(engine)  # type: ignore[arg-type]
    measured = prompt_rule.measured_chars_per_token(engine)
    assert 4 < measured < 9  # words of the probe text and their spaces
    # the proven bound would be 40 characters a token (the longest token); the measured one is far tighter
    assert tokenizer.max_chars == 1000 * min(40, -(-measured * prompt_rule.CHARS_PER_TOKEN_HEADROOM // 1))
    assert tokenizer.max_chars < 1000 * 40


def test_a_long_text_is_refused_as_soon_as_its_count_passes_the_context() -> None:
    engine = _FakeEngine(max_model_len=2000)
    tokenizer = TokenizerThread(engine)  # type: ignore[arg-type]
    engine.pieces_encoded.clear()  # the probe text measured at start
    text = "abcdefghijklmn " * 2700  # 40,500 characters, under the bound; 2,700 tokens: more than the context
    assert tokenizer.max_chars is not None and len(text) < tokenizer.max_chars
    with pytest.raises(APIError, match="more than") as refused:
        asyncio.run(tokenizer.token_ids(_gen(text)))
    assert refused.value.status == 400
    pieces = len(prompt_rule.text_pieces(text, PIECE_CHARS))
    assert len(engine.pieces_encoded) < pieces  # it stopped counting early, and never encoded the whole
    assert max(engine.pieces_encoded) <= PIECE_CHARS
    tokenizer.close()


def test_a_long_text_that_fits_is_counted_then_encoded_whole() -> None:
    engine = _FakeEngine(max_model_len=20_000)
    tokenizer = TokenizerThread(engine)  # type: ignore[arg-type]
    text = "ab " * 10_000
    tokens = asyncio.run(tokenizer.token_ids(_gen(text)))
    assert len(tokens) == 10_000
    assert engine.pieces_encoded[-1] == len(text)  # the last encode is the whole text: exact tokens
    tokenizer.close()


@pytest.mark.parametrize("text", ["", "a", "word " * 5000, "x" * 20_000, "a  b   c " * 3000, " lead and trail "])
def test_pieces_put_back_together_are_the_text(text: str) -> None:
    pieces = prompt_rule.text_pieces(text, 1000)
    assert "".join(pieces) == text
    assert all(len(p) <= 1000 for p in pieces)
    for a, b in zip(pieces, pieces[1:]):  # cut before a single space between two other characters, where there is one
        if " " in a[500:]:
            assert b.startswith(" ") and not b[1:2].isspace() and not a[-1:].isspace()
