"""The router's chat tokenizing by pieces: the same tokens as a whole encoding, fewer encoded; long prompts off the loop."""

from __future__ import annotations

import json
import random
import threading
from collections.abc import Sequence
from pathlib import Path

import pytest

from kvpool.errors import ConfigError
from kvpool.router import MemoryIndex, RouteOptions, Router
from kvpool.router.prompt_hashes import CHECKED_CHATS, PieceCache, PromptHasher, missing_packages
from kvpool.tenancy import SaltPolicy
from tests.router.fakes import ByteTokenizer, FakeReplica, RouterThread, wait_for

needs_extra = pytest.mark.skipif(bool(missing_packages()), reason="needs the route extra (tokenizers, jinja2)")

TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
WORDS = [
    "alpha",
    "beta",
    "gamma",
    "delta",
    " ",
    "  ",
    "\n",
    "you",
    "are",
    "brief",
    ".",
    "!",
    "é",
    "日本",
    "<",
    "|",
    ">",
]


def model_folder(tmp_path: Path, *, lstrip: bool = False) -> Path:
    """A small byte-level BPE tokenizer with chat tokens, trained here, and a chat template."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    rng = random.Random(0)
    corpus = [" ".join(rng.choice(WORDS) for _ in range(30)) for _ in range(200)]
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(corpus, trainer)
    tokenizer.add_special_tokens(
        [AddedToken(t, lstrip=lstrip, normalized=False) for t in ("<|im_start|>", "<|im_end|>")]
    )
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "chat_template.jinja").write_text(TEMPLATE)
    return tmp_path


def chat(rng: random.Random, turns: int) -> list[dict[str, str]]:
    def text() -> str:
        return "".join(rng.choice(WORDS) for _ in range(rng.randrange(0, 40)))

    messages = [{"role": "system", "content": text()}]
    for _ in range(turns):
        messages += [{"role": "user", "content": text()}, {"role": "assistant", "content": text()}]
    return messages + [{"role": "user", "content": text()}]


def whole(folder: Path, messages: Sequence[dict[str, str]]) -> list[int]:
    tokenizer = PromptHasher(folder, piece_chars=0)
    return tokenizer.chat_tokens(messages)


@needs_extra
def test_chats_by_pieces_are_the_whole_encoding(tmp_path: Path) -> None:
    folder = model_folder(tmp_path)
    tokenizer = PromptHasher(folder)
    reference = PromptHasher(folder, piece_chars=0)
    rng = random.Random(1)
    for _ in range(3 * CHECKED_CHATS):  # past the chats checked both ways: the pieces alone decide
        messages = chat(rng, rng.randrange(0, 4))
        assert tokenizer.chat_tokens(messages) == reference.chat_tokens(messages)
        # a follow-up: the earlier turns' pieces come from the cache
        messages += [{"role": "assistant", "content": "ok <|im_end|> again"}, {"role": "user", "content": "and?"}]
        assert tokenizer.chat_tokens(messages) == reference.chat_tokens(messages)
    assert tokenizer.by_pieces and not reference.by_pieces


@needs_extra
def test_a_follow_up_encodes_only_its_new_pieces(tmp_path: Path) -> None:
    tokenizer = PromptHasher(model_folder(tmp_path))
    tokenizer.load()
    encoded: list[str] = []
    real = tokenizer._tokenizer

    class Counting:
        def __getattr__(self, name: str) -> object:
            return getattr(real, name)

        def encode(self, text: str, add_special_tokens: bool = True) -> object:
            encoded.append(text)
            return real.encode(text, add_special_tokens=add_special_tokens)

    messages = [{"role": "system", "content": "you are brief"}, {"role": "user", "content": "alpha beta"}]
    tokenizer.chat_tokens(messages)
    tokenizer._checks_left = 0  # the pieces alone, as after the first chats
    tokenizer._tokenizer = Counting()
    tokenizer.chat_tokens(messages + [{"role": "assistant", "content": "gamma"}, {"role": "user", "content": "delta"}])
    assert encoded == ["assistant\ngamma", "user\ndelta"]


@needs_extra
def test_an_added_token_that_takes_whitespace_means_whole_encodings(tmp_path: Path) -> None:
    tokenizer = PromptHasher(model_folder(tmp_path, lstrip=True))
    messages = chat(random.Random(2), 2)
    tokens = tokenizer.chat_tokens(messages)
    assert not tokenizer.by_pieces
    assert tokens == whole(tmp_path, messages)


@needs_extra
def test_pieces_that_differ_from_the_whole_turn_the_cache_off(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    import re

    tokenizer = PromptHasher(model_folder(tmp_path))
    tokenizer.load()
    tokenizer._cut = re.compile(f"({re.escape('<|im_start|>')}|{re.escape('<|im_end|>')}|a)")  # a cut inside words
    tokenizer._added = {**tokenizer._added, "a": 0}
    messages = [{"role": "user", "content": "alpha gamma"}]
    assert tokenizer.chat_tokens(messages) == whole(tmp_path, messages)
    assert not tokenizer.by_pieces
    assert "encoded whole" in caplog.text


def test_the_piece_cache_keeps_the_most_recent_characters() -> None:
    cache = PieceCache(10)
    cache.put("aaaa", [1])
    cache.put("bbbb", [2])
    assert cache.get("aaaa") == [1]  # now the most recent
    cache.put("cccc", [3])  # 12 characters: the least recently used goes
    assert cache.get("bbbb") is None and cache.get("aaaa") == [1] and cache.get("cccc") == [3]
    assert cache.chars == 8 and len(cache) == 2
    cache.put("x" * 11, [4])  # longer than the whole cache: never kept
    assert cache.get("x" * 11) is None and cache.chars == 8


@pytest.mark.parametrize("bad", [0, -1, 1.5, "10", True])
def test_a_piece_cache_size_that_is_not_a_positive_integer_is_named(bad: object) -> None:
    with pytest.raises(ConfigError, match=repr(bad).replace(".", r"\.")):
        PieceCache(bad)  # type: ignore[arg-type]  # the wrong type is the point


@needs_extra
@pytest.mark.parametrize("bad", [-1, 2.0, "1"])
def test_a_piece_chars_that_is_not_a_count_is_named(tmp_path: Path, bad: object) -> None:
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(ConfigError, match=repr(bad).replace(".", r"\.")):
        PromptHasher(tmp_path, piece_chars=bad)  # type: ignore[arg-type]  # the wrong type is the point


class ThreadNoting(ByteTokenizer):
    """A byte tokenizer that notes the thread each chat is tokenized on."""

    def __init__(self) -> None:
        self.threads: list[threading.Thread] = []

    def chat_tokens(self, messages: Sequence[dict[str, str]]) -> list[int]:
        self.threads.append(threading.current_thread())
        return super().chat_tokens(messages)


def test_a_long_prompt_is_tokenized_off_the_event_loop() -> None:
    salts = SaltPolicy.isolated(b"s" * 32)
    replica = FakeReplica("r0", salts).start()
    tokenizer = ThreadNoting()
    options = RouteOptions(replicas=(replica.url,), tokenizer=tokenizer, keys=None, salts=salts, health_interval=0.1)
    router = RouterThread(Router(options, MemoryIndex()))
    try:
        wait_for(lambda: all(r.up for r in router.router.replicas), "the replica up")
        short = router.chat([{"role": "user", "content": "hello"}])
        long = router.chat([{"role": "user", "content": "hello " * 20_000}])  # 120 kB: past OFF_LOOP_BYTES
        assert short.status_code == long.status_code == 200, (short.text, long.text)
        loop_thread, worker = tokenizer.threads
        assert loop_thread is router._thread and worker is not router._thread
        assert json.loads(long.text)["usage"]["prompt_tokens"] > 100_000  # the whole prompt went through
    finally:
        router.stop()
        replica.kill()
