"""A model folder's tokenizer by pieces: long texts cut at word boundaries, the same tokens as a whole encoding."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")

from kvpool.tokenizer_files import CHUNK_CHARS, FolderTokenizer, _chunks  # noqa: E402
from tests.router.test_prompt_pieces import model_folder  # noqa: E402

WORDS = ["alpha", "beta", "gamma", "you", "are", "é", "日本", "it's", "42", ".", "!", "  ", "\n", "<", "|", ">"]


def text(rng: random.Random, words: int) -> str:
    return "".join(rng.choice(WORDS) + (" " if rng.random() < 0.8 else "") for _ in range(words))


def test_chunks_cut_at_word_boundaries_that_depend_only_on_the_text_before():
    rng = random.Random(3)
    long = text(rng, 3000)
    chunks = _chunks(long, every=256)
    assert "".join(chunks) == long and len(chunks) > 10
    for chunk in chunks[1:]:  # each later chunk starts with the space of a boundary between two letters
        assert chunk[0] == " " and chunk[1].isalpha()
    edited = long[:2000] + "different tail " + long[2000:]
    shared = [c for c in _chunks(edited, every=256) if c in chunks]
    assert sum(map(len, shared)) >= 2000 - 2 * 256  # all but the chunk holding the edit and the next
    assert _chunks("short text", every=256) == ["short text"]
    assert _chunks("x" * 1000, every=256) == ["x" * 1000]  # no boundary: one chunk


def test_long_completions_and_chats_by_pieces_are_the_whole_encoding(tmp_path: Path):
    folder = model_folder(tmp_path)
    tokenizer = FolderTokenizer(folder)
    reference = FolderTokenizer(folder, piece_chars=0)
    rng = random.Random(5)
    for _ in range(40):
        prompt = text(rng, rng.randrange(10, 3 * CHUNK_CHARS // 4))
        assert tokenizer.text_tokens(prompt) == reference.text_tokens(prompt)
        messages = [{"role": "system", "content": prompt}, {"role": "user", "content": text(rng, 30)}]
        assert tokenizer.chat_tokens(messages) == reference.chat_tokens(messages)
    assert tokenizer.by_pieces  # the checks never found a difference
    fresh = FolderTokenizer(folder)
    prompt = text(rng, 3 * CHUNK_CHARS)
    assert fresh.text_tokens(prompt) == reference.text_tokens(prompt)
    assert len(fresh._pieces or ()) >= len(prompt) // CHUNK_CHARS  # one completion, kept in chunks


def test_a_completion_goes_whole_where_the_tokenizer_adds_special_tokens(tmp_path: Path):
    from tokenizers import Tokenizer, processors

    folder = model_folder(tmp_path)
    raw = Tokenizer.from_file(str(folder / "tokenizer.json"))
    bos = raw.token_to_id("<|im_start|>")
    raw.post_processor = processors.TemplateProcessing(single="<|im_start|> $A", special_tokens=[("<|im_start|>", bos)])
    raw.save(str(folder / "tokenizer.json"))
    tokenizer = FolderTokenizer(folder)
    prompt = text(random.Random(7), 2000)
    tokens = tokenizer.text_tokens(prompt)
    assert tokens[0] == bos and tokens == list(raw.encode(prompt, add_special_tokens=True).ids)
    assert len(tokenizer._pieces or ()) == 0  # encoded whole: nothing kept
