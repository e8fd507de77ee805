"""Prompts into token IDs, off the engine thread and off the event loop.

Rendering a chat template and tokenizing cost time in proportion to the text:
done on the engine thread, one client's huge prompts would hold up every
other request's steps; done on the event loop, every connection would wait.
:class:`PromptTokenizer` does both on one thread of its own (one thread, so
the tokenizer is never entered by two encodes at once), and the engine only
receives token IDs.

Before any of that, text whose length alone proves it cannot fit is refused
(the bound is :func:`kvpool.prompts.max_prompt_chars`); how text becomes
tokens is :mod:`kvpool.prompts`' rule, the one the router follows too.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar

from kvpool import prompts as prompt_rule
from kvpool.openai_http.protocol import APIError, GenerationRequest

if TYPE_CHECKING:
    from kvpool.engine.llm_engine import LLMEngine

__all__ = ["PromptTokenizer", "longest_token_chars", "prompt_chars"]

#: The tokenizer thread's name (tests look for it).
THREAD_NAME = "kvpool-tokenizer"
#: Token texts remembered for logprobs before the memory is cleared.
_MAX_REMEMBERED = 65536

T = TypeVar("T")


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


class PromptTokenizer:
    """Turns checked requests into token IDs on a thread of its own.

    Args:
        engine: its tokenizer, chat template and ``max_model_len`` are used
            (read-only: :meth:`LLMEngine.encode` and :meth:`LLMEngine.render_chat`
            touch nothing else of the engine).
    """

    def __init__(self, engine: LLMEngine) -> None:
        self._engine = engine
        self.max_model_len = engine.max_model_len
        longest = longest_token_chars(engine.tokenizer) if engine.tokenizer is not None else None
        #: Text longer than this (in characters) cannot fit ``max_model_len``; None: no bound known.
        self.max_chars = prompt_rule.max_prompt_chars(self.max_model_len, longest)
        self._executor: ThreadPoolExecutor | None = None
        self._texts: dict[int, str] = {}

    def start(self) -> None:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=THREAD_NAME)

    def close(self) -> None:
        executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=False, cancel_futures=True)

    def check_size(self, gen: GenerationRequest, source: str | tuple[int, ...] | None = None) -> None:
        """Refuse (400) text that cannot fit ``max_model_len`` by its length alone; O(messages)."""
        if self.max_chars is None:
            return
        chars = prompt_chars(gen, source)
        if chars > self.max_chars:
            param = "prompt" if gen.messages is None else "messages"
            raise APIError(
                400,
                f"the prompt has {chars} characters; no text over {self.max_chars} characters fits the "
                f"context of {self.max_model_len} tokens (the longest token has {self.max_chars // self.max_model_len})",
                param=param,
                code="context_length_exceeded",
            )

    async def token_ids(self, gen: GenerationRequest, source: str | tuple[int, ...] | None = None) -> tuple[int, ...]:
        """One prompt of the request as token IDs: ``source`` (a completions prompt), or its messages
        with the chat template applied; text that cannot fit is refused before it is tokenized.

        Raises:
            APIError: 400 for text too long to fit.
            KVPoolError: the tokenizer or template refused it (no tokenizer, no template).
        """
        if source is None and gen.messages is None:
            source = gen.prompt
        if isinstance(source, tuple):
            return source
        self.check_size(gen, source)
        return await self._run(self._encode, gen, source)

    async def decode(self, token_ids: Sequence[int]) -> str:
        """The text of ``token_ids`` (special tokens left out), decoded on the tokenizer thread."""
        return await self._run(self._engine.decode, token_ids)

    async def token_texts(self, token_ids: Iterable[int]) -> dict[int, str]:
        """Each token's own text (for logprobs), decoded on the tokenizer thread and remembered."""
        missing = sorted({t for t in token_ids if t not in self._texts})
        if missing:
            texts = await self._run(self._decode_each, missing)
            if len(self._texts) > _MAX_REMEMBERED:
                self._texts.clear()
            self._texts.update(texts)
        return self._texts

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        self.start()
        assert self._executor is not None  # just started
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def _decode_each(self, token_ids: list[int]) -> dict[int, str]:
        tokenizer = self._engine.tokenizer
        return {t: tokenizer.decode([t], skip_special_tokens=False) for t in token_ids}

    def _encode(self, gen: GenerationRequest, source: str | None) -> tuple[int, ...]:
        if source is None:
            assert gen.messages is not None  # a request has text, token IDs or messages
            return tuple(prompt_rule.chat_token_ids(self._engine, list(gen.messages)))
        return tuple(prompt_rule.text_token_ids(self._engine, source))
