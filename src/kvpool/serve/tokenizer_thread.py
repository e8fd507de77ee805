"""Prompts into token IDs, off the engine thread and off the event loop, in turns between tenants.

Rendering a chat template and tokenizing cost time in proportion to the text:
done on the engine thread, one client's huge prompts would hold up every
other request's steps; done on the event loop, every connection would wait.
:class:`TokenizerThread` does both on one thread of its own (one thread, so
the tokenizer is never entered by two encodes at once), and the engine only
receives token IDs. The thread's queue takes turns between tenants
(:class:`~kvpool.serve.tenant_worker.TenantWorker`), so one tenant's backlog
never sits in front of another tenant's prompt.

A text is refused before any of that when its length alone says it cannot
fit: past :func:`kvpool.prompts.max_prompt_chars` (the context times a
characters-per-token figure measured for the model at start, with headroom).
A text under that bound but longer than :data:`PIECE_CHARS` is counted piece
by piece (:func:`kvpool.prompts.text_pieces`), each piece one turn, and
refused as soon as the count passes the context; only a text that may fit is
then encoded whole. How text becomes tokens is :mod:`kvpool.prompts`' rule,
the one the router follows too.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from kvpool import prompts as prompt_rule
from kvpool.openai_http.protocol import APIError, GenerationRequest
from kvpool.serve.tenant_worker import TenantWorker

if TYPE_CHECKING:
    from kvpool.serve.served_engine import ServedEngine

__all__ = ["PIECE_CHARS", "TokenizerThread", "longest_token_chars", "prompt_chars"]

#: The tokenizer thread's name (tests look for it).
THREAD_NAME = "kvpool-tokenizer"
#: Token texts remembered for logprobs before the memory is cleared.
_MAX_REMEMBERED = 65536
#: A text longer than this (in characters) is counted in pieces of about this size, one turn each.
PIECE_CHARS = 8192


def longest_token_chars(tokenizer: Any) -> int | None:
    """Characters of the longest token in ``tokenizer``'s vocabulary; None without a vocabulary."""
    get_vocab = getattr(tokenizer, "get_vocab", None)
    return None if get_vocab is None else prompt_rule.longest_token_chars(get_vocab())


def prompt_chars(gen: GenerationRequest, source: str | tuple[int, ...] | None = None) -> int:
    """Characters of one prompt's text: ``source``, or every message's content (a template only adds)."""
    if isinstance(source, str):
        return len(source)
    if source is None and gen.messages is None:  # a completions request: its longest prompt
        return max((len(p) for p in gen.prompts if isinstance(p, str)), default=0)
    return sum(len(m["content"]) for m in gen.messages or ())


class TokenizerThread:
    """Turns checked requests into token IDs on a thread of its own, in turns between tenants.

    Args:
        engine: its tokenizer, chat template and ``max_model_len`` are used
            (read-only: its ``encode`` and ``render_chat``
            touch nothing else of the engine).
    """

    def __init__(self, engine: ServedEngine) -> None:
        self._engine = engine
        self.max_model_len = engine.max_model_len
        longest = None
        #: The model's characters per token on a probe text (None without a tokenizer).
        self.chars_per_token: float | None = None
        if engine.tokenizer is not None:
            longest = longest_token_chars(engine.tokenizer)
            self.chars_per_token = prompt_rule.measured_chars_per_token(engine)
        #: Text longer than this (in characters) is refused unread; None: no bound known.
        self.max_chars = prompt_rule.max_prompt_chars(self.max_model_len, longest, self.chars_per_token)
        self._worker = TenantWorker(THREAD_NAME)
        self._texts: dict[int, str] = {}

    def start(self) -> None:
        self._worker.start()

    def close(self) -> None:
        self._worker.close()

    def check_size(self, gen: GenerationRequest, source: str | tuple[int, ...] | None = None) -> None:
        """Refuse (400) text too long to be read by its length alone; O(messages)."""
        if self.max_chars is None:
            return
        chars = prompt_chars(gen, source)
        if chars > self.max_chars:
            param = "prompt" if gen.messages is None else "messages"
            raise APIError(
                400,
                f"the prompt has {chars} characters; this server reads at most {self.max_chars} characters "
                f"for its context of {self.max_model_len} tokens ({self.max_chars // self.max_model_len} a token)",
                param=param,
                code="context_length_exceeded",
            )

    async def token_ids(
        self,
        gen: GenerationRequest,
        source: str | tuple[int, ...] | None = None,
        *,
        tenant: str | None = None,
        special_tokens: bool | None = None,
    ) -> tuple[int, ...]:
        """One prompt of the request as token IDs: ``source`` (a completions prompt), or its messages
        with the chat template applied; text that cannot fit is refused before it is tokenized whole.
        The work runs in ``tenant``'s turns. ``special_tokens`` True or False overrides whether the
        tokenizer's special tokens are added (:func:`kvpool.prompts.prompt_text_token_ids`).

        Raises:
            APIError: 400 for text too long to fit.
            KVPoolError: the tokenizer or template refused it (no tokenizer, no template).
        """
        if source is None and gen.messages is None:
            source = gen.prompt
        if isinstance(source, tuple):
            return source
        self.check_size(gen, source)
        chat = source is None
        if source is None:
            assert gen.messages is not None  # a request has text, token IDs or messages
            text = await self._worker.run(tenant, prompt_rule.chat_text, self._engine, list(gen.messages))
        else:
            text = source
        if len(text) > PIECE_CHARS:
            await self._count(tenant, text, "messages" if chat else "prompt")
        return tuple(
            await self._worker.run(
                tenant,
                functools.partial(
                    prompt_rule.prompt_text_token_ids, self._engine, text, chat=chat, special_tokens=special_tokens
                ),
            )
        )

    async def _count(self, tenant: str | None, text: str, param: str) -> None:
        """Count ``text``'s tokens piece by piece (one turn each); refuse it once the count passes the context.

        A piece's count may exceed its share of the whole by the token a cut
        splits, so each piece counted allows one token of slack.
        """
        pieces = prompt_rule.text_pieces(text, PIECE_CHARS)
        count = 0
        for i, piece in enumerate(pieces):
            count += await self._worker.run(tenant, self._piece_tokens, piece)
            if count > self.max_model_len + i + 1:
                raise APIError(
                    400,
                    f"the prompt has more than {count - i - 1} tokens (counted in its first {i + 1} of "
                    f"{len(pieces)} pieces); the context holds {self.max_model_len}",
                    param=param,
                    code="context_length_exceeded",
                )

    def _piece_tokens(self, piece: str) -> int:
        return len(self._engine.encode(piece, add_special_tokens=False))

    async def decode(self, token_ids: Sequence[int], *, tenant: str | None = None) -> str:
        """The text of ``token_ids`` (special tokens left out), decoded on the tokenizer thread."""
        return await self._worker.run(tenant, self._engine.decode, token_ids)

    async def token_texts(self, token_ids: Iterable[int], *, tenant: str | None = None) -> dict[int, str]:
        """Each token's own text (for logprobs), decoded on the tokenizer thread and remembered."""
        missing = sorted({t for t in token_ids if t not in self._texts})
        if missing:
            texts = await self._worker.run(tenant, self._decode_each, missing)
            if len(self._texts) > _MAX_REMEMBERED:
                self._texts.clear()
            self._texts.update(texts)
        return self._texts

    def _decode_each(self, token_ids: list[int]) -> dict[int, str]:
        tokenizer = self._engine.tokenizer
        return {t: tokenizer.decode([t], skip_special_tokens=False) for t in token_ids}
