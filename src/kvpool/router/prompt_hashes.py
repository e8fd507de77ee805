"""A request's prompt as token IDs and block hashes, computed in the router as the replicas compute them.

The router needs a request's block hashes before it picks a replica, so it tokenizes
the prompt itself with the model's own tokenizer, read from the model folder with the
light ``route`` extra only (``tokenizers`` and ``jinja2``; never torch nor transformers):
:class:`~kvpool.tokenizer_files.FolderTokenizer` (the router's :data:`PromptHasher`), which
renders the chat template and encodes by :mod:`kvpool.prompts`' rule, the one the engine,
``kvpool serve`` and the emulated replicas follow, and keeps the tokens of recent chat
pieces so a conversation's earlier turns are not encoded again.

Asking a replica to tokenize would cost a round trip on every request and load the
replicas the router is trying to spare; the tokenizer loads once, in the background,
and until it has, requests are routed by load alone.

The cache salt comes from :mod:`kvpool.tenancy`, the rule the replicas use, so the
router's hashes for a tenant are the replica's hashes for that tenant.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from kvpool.hashing import BlockHash, BlockHasher
from kvpool.tokenizer_files import CHECKED_CHATS, PACKAGES, FolderTokenizer, PieceCache, missing_packages

__all__ = ["CHECKED_CHATS", "PACKAGES", "PieceCache", "PromptHasher", "Tokenizer", "block_hashes", "missing_packages"]

#: The model folder's tokenizer (:mod:`kvpool.tokenizer_files`, shared with the emulated replicas), under the
#: router's name for it.
PromptHasher = FolderTokenizer


class Tokenizer(Protocol):
    """What the router asks of a tokenizer: prompts as the replicas' engine tokenizes them."""

    @property
    def loaded(self) -> bool: ...

    def load(self) -> None: ...

    def chat_tokens(self, messages: Sequence[dict[str, str]]) -> list[int]: ...

    def text_tokens(self, prompt: str) -> list[int]: ...


def block_hashes(hasher: BlockHasher, tokens: Sequence[int], cache_salt: str | None) -> list[BlockHash]:
    """The hashes of the prompt's full blocks, as a replica hashing with ``hasher`` computes them."""
    return hasher.hash_token_ids(tokens, cache_salt=cache_salt)
