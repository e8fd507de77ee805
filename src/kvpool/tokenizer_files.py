"""A model's tokenizer and chat template read from its folder, with no torch and no transformers.

The router (``kvpool route``) and the emulated replicas (``kvpool serve --emulate``) both turn
prompts into token IDs as a replica's engine does, with the light ``route`` extra only
(``tokenizers`` and ``jinja2``): :class:`FolderTokenizer` reads

* the tokenizer from the folder's ``tokenizer.json`` (Hugging Face ``tokenizers``);
* the chat template from ``chat_template.jinja`` or, failing that, the ``chat_template``
  of ``tokenizer_config.json``, rendered as transformers and vLLM render it (a sandboxed
  Jinja environment with ``trim_blocks`` and ``lstrip_blocks``, the generation prompt
  added, the special tokens of ``tokenizer_config.json`` as variables).

What is encoded with or without special tokens is :mod:`kvpool.prompts`' rule.

A conversation comes back with every turn, so most of a chat's text was encoded before.
The tokenizer cuts a text at its added tokens (``<|im_start|>``...) before anything
else and encodes the pieces between them one by one, so a piece's tokens do not depend
on its neighbours; :class:`FolderTokenizer` keeps the tokens of recent pieces
(:class:`PieceCache`, bounded in characters) and encodes only the new ones. It does so
only where that cut is exact: no added token strips the whitespace beside it or must
stand as a whole word, and none is matched after a normalizer.

A long piece (a long system prompt, a completion's whole text) is cut further, at the
first *word boundary* after every :data:`CHUNK_CHARS` characters: a single space between
two letters, where a byte-level BPE's pre-tokenizer always splits (the space starts the
next word's token). The cuts depend only on the text before them, so two prompts that
share a prefix share its chunks, and a follow-up encodes only its new text. A completion
(special tokens asked for) goes by pieces too where the tokenizer adds none.

The first texts encoded by pieces are also encoded whole and compared; a difference turns
the pieces off for good, with a warning (a tokenizer whose cut is not exact, such as one
that marks a word's start rather than a space, is caught there).

Besides encoding, it answers what a server asks of a tokenizer (``decode``, ``get_vocab``,
``chat_template``, the special tokens' IDs), so an emulated replica serves with it alone.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from kvpool.errors import ConfigError
from kvpool.prompts import chat_token_ids, text_token_ids

__all__ = ["CHECKED_CHATS", "CHUNK_CHARS", "PACKAGES", "FolderTokenizer", "PieceCache", "missing_packages"]

log = logging.getLogger("kvpool.route")

#: Chats encoded both ways (by pieces and whole) and compared before the pieces are trusted alone.
CHECKED_CHATS = 16
#: A piece longer than this is cut at its first word boundary after every multiple of it.
CHUNK_CHARS = 2048

#: What tokenizing from a model folder imports (the ``route`` extra brings both).
PACKAGES = ("tokenizers", "jinja2")


def missing_packages() -> list[str]:
    """The packages of :data:`PACKAGES` this Python lacks (empty: prompts can be tokenized)."""
    import importlib.util

    return [name for name in PACKAGES if importlib.util.find_spec(name) is None]


def _special(config: dict[str, Any], name: str) -> str | None:
    """A special token of ``tokenizer_config.json``: a string, or a dict with its ``content``."""
    value = config.get(name)
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class PieceCache:
    """Token IDs of text pieces, the least recently used dropped first once ``max_chars`` characters are kept.

    ``get`` and ``put`` are O(1) (plus hashing the piece) and safe from several threads (a
    long prompt is tokenized off the event loop); a piece longer than ``max_chars`` is never kept.
    """

    __slots__ = ("max_chars", "chars", "_entries", "_lock")

    def __init__(self, max_chars: int) -> None:
        if type(max_chars) is not int or max_chars < 1:
            raise ConfigError(f"max_chars must be an integer >= 1, got {max_chars!r}")
        self.max_chars = max_chars
        self.chars = 0
        self._entries: OrderedDict[str, list[int]] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, piece: str) -> list[int] | None:
        with self._lock:
            ids = self._entries.get(piece)
            if ids is not None:
                self._entries.move_to_end(piece)
            return ids

    def put(self, piece: str, ids: list[int]) -> None:
        with self._lock:
            if len(piece) > self.max_chars or piece in self._entries:
                return
            self._entries[piece] = ids
            self.chars += len(piece)
            while self.chars > self.max_chars:
                old, _ = self._entries.popitem(last=False)
                self.chars -= len(old)


class FolderTokenizer:
    """The model's tokenizer and chat template, read from a model folder on first use.

    Construction checks only that the folder holds ``tokenizer.json``; :meth:`load`
    reads it and finds the chat template, raising :class:`ConfigError` naming the file
    that is missing or unreadable. ``piece_chars``: the characters of chat text whose
    tokens are kept for the next turns (0: every chat is encoded whole).
    """

    __slots__ = (
        "folder",
        "_tokenizer",
        "_template",
        "_template_source",
        "_specials",
        "_cut",
        "_added",
        "_pieces",
        "_checks_left",
        "_adds_no_specials",
    )

    def __init__(self, folder: str | os.PathLike[str], *, piece_chars: int = 8 * 2**20) -> None:
        self.folder = Path(folder)
        if not (self.folder / "tokenizer.json").is_file():
            raise ConfigError(f"{os.fspath(folder)!r} holds no tokenizer (tokenizer.json is missing)")
        if type(piece_chars) is not int or piece_chars < 0:
            raise ConfigError(f"piece_chars must be an integer >= 0, got {piece_chars!r}")
        self._tokenizer: Any = None
        self._template: Any = None
        self._template_source: str | None = None
        self._specials: dict[str, str] = {}
        self._cut: re.Pattern[str] | None = None  # splits a text at its added tokens (None: encode it whole)
        self._added: dict[str, int] = {}
        self._pieces = PieceCache(piece_chars) if piece_chars else None
        self._checks_left = CHECKED_CHATS
        self._adds_no_specials = False  # encoding with special tokens adds none (a completion goes by pieces)

    @property
    def by_pieces(self) -> bool:
        """Whether chats are encoded piece by piece, with the pieces' tokens kept."""
        return self._cut is not None and self._pieces is not None

    @property
    def loaded(self) -> bool:
        return self._tokenizer is not None

    def load(self) -> None:
        """Read the tokenizer and the chat template; later calls return at once."""
        if self._tokenizer is not None:
            return
        missing = missing_packages()
        if missing:
            raise ConfigError(f"tokenizing prompts needs {' and '.join(missing)}: pip install 'kvpool[route]'")
        from jinja2.sandbox import ImmutableSandboxedEnvironment
        from tokenizers import Tokenizer as HFTokenizer

        config: dict[str, Any] = {}
        config_path = self.folder / "tokenizer_config.json"
        if config_path.is_file():
            try:
                loaded = json.loads(config_path.read_text(encoding="utf-8"))
            except (OSError, ValueError) as exc:
                raise ConfigError(f"cannot read {os.fspath(config_path)!r}: {exc}") from None
            config = loaded if isinstance(loaded, dict) else {}
        source = None
        template_path = self.folder / "chat_template.jinja"
        if template_path.is_file():
            source = template_path.read_text(encoding="utf-8")
        elif isinstance(config.get("chat_template"), str):
            source = config["chat_template"]
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        env.filters["tojson"] = lambda value, indent=None: json.dumps(value, ensure_ascii=False, indent=indent)
        template = None if source is None else env.from_string(source)
        self._specials = {
            name: token
            for name in ("bos_token", "eos_token", "unk_token", "pad_token")
            if (token := _special(config, name)) is not None
        }
        try:
            tokenizer = HFTokenizer.from_file(os.fspath(self.folder / "tokenizer.json"))
        except Exception as exc:  # noqa: BLE001 - tokenizers raises its own Exception type
            raise ConfigError(f"cannot read {os.fspath(self.folder / 'tokenizer.json')!r}: {exc}") from None
        self._template = template
        self._template_source = source
        self._cut, self._added = _added_token_cut(tokenizer)
        self._adds_no_specials = all(
            tokenizer.encode(probe, add_special_tokens=True).ids
            == tokenizer.encode(probe, add_special_tokens=False).ids
            for probe in ("", "a", "a b")
        )
        self._tokenizer = tokenizer

    @property
    def chat_template(self) -> str | None:
        """The chat template's source (None: the folder has none), as transformers' tokenizers name it."""
        self.load()
        return self._template_source

    @property
    def vocab_size(self) -> int:
        """Token IDs are in ``[0, vocab_size)``: the model's vocabulary with its added tokens."""
        self.load()
        size: int = self._tokenizer.get_vocab_size(with_added_tokens=True)
        return size

    @property
    def special_token_ids(self) -> frozenset[int]:
        """The IDs of the added tokens marked special (``<|im_start|>``, the EOS...)."""
        self.load()
        return frozenset(i for i, token in self._tokenizer.get_added_tokens_decoder().items() if token.special)

    @property
    def eos_token_id(self) -> int | None:
        """The ID of ``tokenizer_config.json``'s ``eos_token``, or None where it names none the tokenizer knows."""
        self.load()
        eos = self._specials.get("eos_token")
        found: int | None = None if eos is None else self._tokenizer.token_to_id(eos)
        return found

    def get_vocab(self) -> dict[str, int]:
        """Token text -> ID, added tokens included (transformers' ``get_vocab``)."""
        self.load()
        vocab: dict[str, int] = self._tokenizer.get_vocab(with_added_tokens=True)
        return vocab

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """The text of ``token_ids`` (transformers' ``decode``; special tokens left out by default)."""
        self.load()
        text: str = self._tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)
        return text

    def chat_tokens(self, messages: Sequence[dict[str, str]]) -> list[int]:
        """A conversation's prompt, by :func:`kvpool.prompts.chat_token_ids`: the replicas' rule."""
        return chat_token_ids(self, messages)

    def text_tokens(self, prompt: str) -> list[int]:
        """A text completion's prompt, by :func:`kvpool.prompts.text_token_ids`: the replicas' rule."""
        return text_token_ids(self, prompt)

    def render_chat(self, conversation: Sequence[Mapping[str, str]], *, add_generation_prompt: bool = True) -> str:
        """The conversation as the model's chat template writes it."""
        self.load()
        if self._template is None:
            raise ConfigError(f"the model folder {os.fspath(self.folder)!r} has no chat template")
        text: str = self._template.render(
            messages=list(conversation), add_generation_prompt=add_generation_prompt, **self._specials
        )
        return text

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token IDs of ``text``; without special tokens, a chat's text goes by pieces where that is exact."""
        self.load()
        if (add_special_tokens and not self._adds_no_specials) or not self.by_pieces:
            return list(self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)
        tokens = self._encode_pieces(text)
        if self._checks_left > 0:
            self._checks_left -= 1
            whole = list(self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)
            if whole != tokens:
                log.warning("this tokenizer's pieces do not add up to its whole encoding: prompts are encoded whole")
                self._cut = None
                return whole
        return tokens

    def _encode_pieces(self, text: str) -> list[int]:
        """``text``'s tokens: each added token's ID, each piece between them from the cache or encoded now."""
        assert self._cut is not None and self._pieces is not None
        tokens: list[int] = []
        cache = self._pieces
        for i, piece in enumerate(self._cut.split(text)):
            if i % 2:  # the split keeps its separators at odd places: an added token
                tokens.append(self._added[piece])
            elif piece:
                for chunk in _chunks(piece):
                    ids = cache.get(chunk)
                    if ids is None:
                        ids = list(self._tokenizer.encode(chunk, add_special_tokens=False).ids)
                        cache.put(chunk, ids)
                    tokens += ids
        return tokens


def _chunks(piece: str, every: int = CHUNK_CHARS) -> list[str]:
    """``piece`` cut at its first word boundary (a single space between two letters) after every multiple of
    ``every`` characters: each cut depends only on the text before it, so a shared prefix gives shared chunks."""
    if len(piece) <= every:
        return [piece]
    chunks: list[str] = []
    begin, mark, end = 0, every, len(piece)
    while mark < end:
        i = piece.find(" ", mark)
        while i != -1 and not (i + 1 < end and piece[i - 1].isalpha() and piece[i + 1].isalpha()):
            i = piece.find(" ", i + 1)
        if i == -1:
            break
        chunks.append(piece[begin:i])
        begin = i
        mark = (i // every + 1) * every
    chunks.append(piece[begin:])
    return chunks


def _added_token_cut(tokenizer: Any) -> tuple[re.Pattern[str] | None, dict[str, int]]:
    """A pattern that cuts a text where ``tokenizer`` cuts it before encoding, and the added tokens' IDs.

    (None, {}) where the cut would not be exact: an added token that takes the whitespace
    beside it, or must stand as a word, or is matched on normalized text behind a normalizer.
    """
    added = tokenizer.get_added_tokens_decoder()
    has_normalizer = tokenizer.normalizer is not None
    for token in added.values():
        if token.lstrip or token.rstrip or token.single_word or (token.normalized and has_normalizer):
            return None, {}
    ids = {token.content: token_id for token_id, token in added.items() if token.content}
    if not ids:
        return None, {}
    # the longest first: at one place, the tokenizer takes the longest added token that matches
    pattern = "|".join(re.escape(content) for content in sorted(ids, key=len, reverse=True))
    return re.compile(f"({pattern})"), ids


def _raise_exception(message: str) -> None:
    raise ConfigError(f"the chat template refused the conversation: {message}")
