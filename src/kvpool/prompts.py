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
here too: a text longer than :func:`max_prompt_chars` is refused before it is
tokenized, and a long text is counted piece by piece (:func:`text_pieces`) so
that counting stops as soon as it passes the context. Torch-free, and free of
any tokenizer package: it only calls the encoder it is given.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Protocol

from kvpool.errors import RequestStateError

__all__ = [
    "CHAT_ADDS_SPECIAL_TOKENS",
    "CHAT_GENERATION_PROMPT",
    "TEXT_ADDS_SPECIAL_TOKENS",
    "PromptEncoder",
    "chat_text",
    "chat_token_ids",
    "check_conversation",
    "CHARS_PER_TOKEN_HEADROOM",
    "longest_token_chars",
    "max_prompt_chars",
    "measured_chars_per_token",
    "prompt_text_token_ids",
    "text_pieces",
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
    return prompt_text_token_ids(encoder, chat_text(encoder, messages), chat=True)


def chat_text(encoder: PromptEncoder, messages: Sequence[Mapping[str, str]]) -> str:
    """A conversation as its prompt's text: the chat template rendered with the generation prompt."""
    return encoder.render_chat(messages, add_generation_prompt=CHAT_GENERATION_PROMPT)


def text_token_ids(encoder: PromptEncoder, prompt: str) -> list[int]:
    """A text completion's prompt tokens, with the tokenizer's special tokens."""
    return prompt_text_token_ids(encoder, prompt, chat=False)


def prompt_text_token_ids(
    encoder: PromptEncoder, text: str, *, chat: bool, special_tokens: bool | None = None
) -> list[int]:
    """A prompt's text as tokens: a rendered chat (``chat``) without special tokens, a completion with them;
    ``special_tokens`` True or False overrides that (vLLM's ``add_special_tokens`` on ``/tokenize``)."""
    if special_tokens is None:
        special_tokens = CHAT_ADDS_SPECIAL_TOKENS if chat else TEXT_ADDS_SPECIAL_TOKENS
    return encoder.encode(text, add_special_tokens=special_tokens)


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


#: How many times the measured characters per token (:func:`measured_chars_per_token`) a prompt may
#: average before its length alone refuses it: prose, code and JSON average 3 to 5 characters a token,
#: text indented deeply or repeating long words somewhat more.
CHARS_PER_TOKEN_HEADROOM = 3

#: What the characters-per-token figure is measured on: prose, code, JSON and numbers, as prompts mix them.
_PROBE_TEXT = (
    "The quick brown fox jumps over the lazy dog while the committee reviews its quarterly figures. "
    "A key-value cache keeps every token's keys and values so that each new token reads them again. "
    "def schedule(requests, budget):\n    for request in sorted(requests, key=len):\n"
    "        if budget <= 0:\n            break\n        budget -= request.tokens\n    return budget\n"
    '{"id": 12345, "name": "warehouse-7", "items": [{"sku": "A-100", "qty": 3}, {"sku": "B-220", "qty": 17}]}\n'
    "Invoice 2024-11-03: 17 units at 4.25 each, 3 units at 12.10 each; total 108.55, paid 2024-11-30.\n"
    "Questions? Write to the support desk, or call between nine and five on weekdays. Thank you!\n"
)


def measured_chars_per_token(encoder: PromptEncoder) -> float:
    """Characters per token of a probe text of prose, code, JSON and numbers, encoded by ``encoder``."""
    tokens = len(encoder.encode(_PROBE_TEXT, add_special_tokens=False))
    return len(_PROBE_TEXT) / max(1, tokens)


def max_prompt_chars(max_model_len: int, longest_token: int | None, chars_per_token: float | None = None) -> int | None:
    """The most characters a prompt may have before its length alone refuses it; None: no bound known.

    Every token stands for at most ``longest_token`` characters, so a text of
    ``n`` characters needs at least ``n / longest_token`` tokens: past
    ``max_model_len * longest_token`` characters no text fits. That proven
    bound is loose (a long token is rare), so with a measured
    ``chars_per_token`` the bound is ``CHARS_PER_TOKEN_HEADROOM`` times that
    figure per token of context, when that is tighter: text compressed
    further than that is refused although it might have fitted. Either way a
    text under the bound is counted piece by piece and refused as soon as the
    count passes the context (:func:`text_pieces`).
    """
    if longest_token is None:
        return None
    per_token = longest_token
    if chars_per_token is not None:
        per_token = min(per_token, max(1, math.ceil(chars_per_token * CHARS_PER_TOKEN_HEADROOM)))
    return max_model_len * per_token


def text_pieces(text: str, size: int) -> list[str]:
    """``text`` cut into pieces of about ``size`` characters, each cut just before a single space between
    two other characters, so that a pre-tokenizer that splits before spaces (byte-level BPE's, SentencePiece's
    metaspace) sees the same words in the pieces as in the whole, and the pieces' token counts add up to
    the whole's; a piece with no such space within ``size`` characters is cut at ``size``."""
    pieces = []
    start = 0
    while len(text) - start > size:
        cut = start + size
        space = text.rfind(" ", start + size // 2, cut)
        while space > start and (text[space - 1].isspace() or text[space + 1 : space + 2].isspace()):
            space = text.rfind(" ", start + size // 2, space)
        if space > start:
            cut = space
        pieces.append(text[start:cut])
        start = cut
    pieces.append(text[start:])
    return pieces
