"""kvpool.prompts: one rule for how a prompt becomes tokens, and the engine and the router agreeing on it."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from kvpool.errors import RequestStateError
from kvpool.prompts import (
    chat_token_ids,
    check_conversation,
    longest_token_chars,
    max_prompt_chars,
    text_token_ids,
)

FOLDER = Path.home() / ".cache" / "kvpool" / "models" / "smollm2-135m-instruct"

CHATS = [
    [{"role": "user", "content": "Hello there."}],
    [
        {"role": "system", "content": "You answer in one word."},
        {"role": "user", "content": "Which colour is the sky?"},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "And grass? <|im_end|> stays text here."},
    ],
    [{"role": "user", "content": "  leading spaces, émojis 🙂 and\ttabs\n\nnewlines  "}],
]
TEXTS = ["Hello there.", "  spaces first", "<|im_start|>user\nan added token inside<|im_end|>", "émojis 🙂"]


class _Recorder:
    """A PromptEncoder that says how it was asked."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, object]] = []

    def render_chat(self, conversation: Sequence[Mapping[str, str]], *, add_generation_prompt: bool = True) -> str:
        self.calls.append(("render_chat", add_generation_prompt))
        return "rendered"

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        self.calls.append((text, add_special_tokens))
        return [len(text)]


def test_a_chat_is_rendered_with_the_generation_prompt_and_encoded_without_special_tokens() -> None:
    recorder = _Recorder()
    assert chat_token_ids(recorder, [{"role": "user", "content": "hi"}]) == [len("rendered")]
    assert recorder.calls == [("render_chat", True), ("rendered", False)]


def test_a_text_completion_is_encoded_with_special_tokens() -> None:
    recorder = _Recorder()
    assert text_token_ids(recorder, "abc") == [3]
    assert recorder.calls == [("abc", True)]


@pytest.mark.parametrize(
    ("conversation", "words"),
    [
        ("hello", "a conversation is a list of messages, got 'hello'"),
        ({"role": "user", "content": "x"}, "a conversation is a list of messages"),
        ([], "at least one message"),
        ([{"role": "user", "content": 3}], "message 0 must be a mapping"),
        (
            [{"role": "user", "content": "x"}, "oops"],
            "message 1 must be a mapping with string 'role' and 'content', got 'oops'",
        ),
    ],
)
def test_a_bad_conversation_is_refused_naming_it(conversation: Any, words: str) -> None:
    with pytest.raises(RequestStateError, match=words.replace("(", r"\(")):
        check_conversation(conversation)


def test_the_size_bound_is_the_context_times_the_longest_token() -> None:
    assert longest_token_chars(["a", "abcd", "ab"]) == 4
    assert longest_token_chars([]) is None
    assert max_prompt_chars(512, 4) == 2048
    assert max_prompt_chars(512, None) is None


@pytest.fixture(scope="module")
def engine() -> Iterator[Any]:
    if not (FOLDER / "tokenizer.json").is_file():
        pytest.skip(f"the default model's folder {FOLDER} is absent (kvpool pull smollm2-135m-instruct)")
    for name in ("torch", "transformers", "tokenizers", "jinja2"):
        if importlib.util.find_spec(name) is None:
            pytest.skip(f"{name} is not installed")
    import torch

    from kvpool.engine.llm_engine import LLMEngine

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield LLMEngine(model=str(FOLDER), kv_cache_memory="32MiB", max_model_len=256, threads=1, log=lambda line: None)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("piece_chars", [0, 1 << 20])
def test_the_engine_and_the_router_make_the_same_tokens(engine: Any, piece_chars: int) -> None:
    from kvpool.router.prompt_hashes import PromptHasher

    router = PromptHasher(FOLDER, piece_chars=piece_chars)
    for _ in range(2):  # the second round, by pieces, comes from the router's piece cache
        for chat in CHATS:
            assert router.chat_tokens(chat) == chat_token_ids(engine, chat), chat
        for text in TEXTS:
            assert router.text_tokens(text) == text_token_ids(engine, text), text
    assert router.by_pieces is (piece_chars > 0)
