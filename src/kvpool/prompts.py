"""How a prompt becomes token IDs: the one rule the engine, the server and the router follow.

A replica's prefix cache and a router's prefix index meet only if both turn a
request into the same tokens. The rule:

* a chat is the model's chat template rendered over the messages with the
  generation prompt added (:data:`CHAT_GENERATION_PROMPT`), then encoded
  without the tokenizer's special tokens (:data:`CHAT_ADDS_SPECIAL_TOKENS`):
  the template wrote them;
* a text completion is encoded with them (:data:`TEXT_ADDS_SPECIAL_TOKENS`),
  as vLLM does;
* token IDs are used as given.

Whoever tokenizes implements :class:`PromptEncoder` (the engine over
transformers' tokenizer, the router over ``tokenizers`` and ``jinja2``) and
asks :func:`chat_token_ids` and :func:`text_token_ids`. The size bound lives
here too: a text longer than :func:`max_prompt_chars` cannot fit the context,
whatever the tokenizer does with it. Torch-free, and free of any tokenizer
package: it only calls the encoder it is given.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Protocol

from kvpool.errors import RequestStateError

__all__ = [
    "CHAT_ADDS_SPECIAL_TOKENS",
    "CHAT_GENERATION_PROMPT",
    "TEXT_ADDS_SPECIAL_TOKENS",
    "PromptEncoder",
    "chat_token_ids",
    "check_conversation",
    "longest_token_chars",
    "max_prompt_chars",
    "text_token_ids",
]

#: A chat's rendering ends with the assistant's turn opened, so the model answers.
CHAT_GENERATION_PROMPT = True
#: A rendered chat is encoded without the tokenizer's special tokens: the template wrote them.
CHAT_ADDS_SPECIAL_TOKENS = False
#: A text completion is encoded with the tokenizer's special tokens (e.g. BOS), as vLLM encodes it.
TEXT_ADDS_SPECIAL_TOKENS = True


class PromptEncoder(Protocol):
    """A model's chat template and tokenizer, as the rule needs them."""

    def render_chat(self, conversation: Sequence[Mapping[str, str]], *, add_generation_prompt: bool = True) -> str:
        """The conversation as the model's chat template writes it."""
        ...

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token IDs of ``text``; ``add_special_tokens`` adds the tokenizer's own."""
        ...


def chat_token_ids(encoder: PromptEncoder, messages: Sequence[Mapping[str, str]]) -> list[int]:
    """A conversation's prompt tokens: rendered with the generation prompt, encoded without special tokens."""
    text = encoder.render_chat(messages, add_generation_prompt=CHAT_GENERATION_PROMPT)
    return encoder.encode(text, add_special_tokens=CHAT_ADDS_SPECIAL_TOKENS)


def text_token_ids(encoder: PromptEncoder, prompt: str) -> list[int]:
    """A text completion's prompt tokens, with the tokenizer's special tokens."""
    return encoder.encode(prompt, add_special_tokens=TEXT_ADDS_SPECIAL_TOKENS)


def check_conversation(conversation: object) -> list[Mapping[str, str]]:
    """``conversation`` as a list of messages, refused unless each has string ``role`` and ``content``.

    Raises:
        RequestStateError: naming the conversation or the message at fault.
    """
    if isinstance(conversation, (str, bytes, Mapping)) or not isinstance(conversation, Sequence):
        raise RequestStateError(f"a conversation is a list of messages, got {conversation!r}")
    messages = list(conversation)
    if not messages:
        raise RequestStateError("a conversation needs at least one message")
    for i, message in enumerate(messages):
        if (
            not isinstance(message, Mapping)
            or not isinstance(message.get("role"), str)
            or not isinstance(message.get("content"), str)
        ):
            raise RequestStateError(f"message {i} must be a mapping with string 'role' and 'content', got {message!r}")
    return messages


def longest_token_chars(vocabulary: Iterable[str]) -> int | None:
    """Characters of the longest token of ``vocabulary`` (its token strings); None for an empty one.

    A byte-level vocabulary spells each byte as one character, so a token
    covers at most that many bytes, hence at most that many characters.
    """
    return max((len(token) for token in vocabulary), default=0) or None


def max_prompt_chars(max_model_len: int, longest_token: int | None) -> int | None:
    """The most characters a prompt may have and still fit ``max_model_len`` tokens; None: no bound known.

    Every token stands for at most ``longest_token`` characters, so a text of
    ``n`` characters needs at least ``n / longest_token`` tokens. That holds
    for tokenizers that keep every character in some token (byte-level BPE,
    byte-fallback SentencePiece); one that drops characters may see a text
    refused that would have fitted, never one let through that would not.
    """
    return None if longest_token is None else max_model_len * longest_token
