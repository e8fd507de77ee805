"""A request's prompt as token IDs and block hashes, computed in the router as the replicas compute them.

The router needs a request's block hashes before it picks a replica, so it tokenizes
the prompt itself with the model's own tokenizer (only the tokenizer: transformers'
``AutoTokenizer`` over the model folder the engine converted, never the weights), and
renders a chat exactly as the engine does: the chat template with the generation
prompt, then encoded without adding special tokens; a text completion is encoded with
them. Asking a replica to tokenize would cost a round trip on every request and load
the replicas the router is trying to spare; the tokenizer loads once, in the
background, and until it has, requests are routed by load alone.

The cache salt comes from :mod:`kvpool.tenancy`, the rule the replicas use, so the
router's hashes for a tenant are the replica's hashes for that tenant.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from kvpool.errors import ConfigError
from kvpool.hashing import BlockHash, BlockHasher

__all__ = ["PromptTokenizer", "Tokenizer", "block_hashes"]


class Tokenizer(Protocol):
    """What the router asks of a tokenizer: prompts as the replicas' engine tokenizes them."""

    @property
    def loaded(self) -> bool: ...

    def load(self) -> None: ...

    def chat_tokens(self, messages: Sequence[dict[str, str]]) -> list[int]: ...

    def text_tokens(self, prompt: str) -> list[int]: ...


class PromptTokenizer:
    """The model's tokenizer and chat template, loaded from a model folder on first use."""

    __slots__ = ("folder", "_tokenizer")

    def __init__(self, folder: str | os.PathLike[str]) -> None:
        self.folder = Path(folder)
        if not (self.folder / "tokenizer_config.json").is_file():
            raise ConfigError(f"{os.fspath(folder)!r} holds no tokenizer (tokenizer_config.json is missing)")
        self._tokenizer: Any = None

    @property
    def loaded(self) -> bool:
        return self._tokenizer is not None

    def load(self) -> None:
        """Load the tokenizer (seconds: transformers is imported here); later calls return at once."""
        if self._tokenizer is not None:
            return
        try:
            from transformers import AutoTokenizer
        except ImportError:
            raise ConfigError("tokenizing prompts needs transformers: pip install 'kvpool[engine]'") from None
        self._tokenizer = AutoTokenizer.from_pretrained(os.fspath(self.folder), local_files_only=True)

    def chat_tokens(self, messages: Sequence[dict[str, str]]) -> list[int]:
        """A conversation's prompt: the chat template with the generation prompt, encoded as the engine does."""
        self.load()
        text: str = self._tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)
        return list(self._tokenizer.encode(text, add_special_tokens=False))

    def text_tokens(self, prompt: str) -> list[int]:
        """A text completion's prompt, with the tokenizer's own special tokens as the engine adds them."""
        self.load()
        return list(self._tokenizer.encode(prompt, add_special_tokens=True))


def block_hashes(hasher: BlockHasher, tokens: Sequence[int], cache_salt: str | None) -> list[BlockHash]:
    """The hashes of the prompt's full blocks, as a replica hashing with ``hasher`` computes them."""
    return hasher.hash_token_ids(tokens, cache_salt=cache_salt)
