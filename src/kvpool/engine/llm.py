"""The offline API: ``LLM(model).generate(prompts)`` and ``LLM(model).chat(conversations)``.

::

    from kvpool.engine import LLM, SamplingParams

    llm = LLM("smollm2-135m", kv_cache_memory="512MiB")
    [out] = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                     SamplingParams(max_tokens=32))
    print(out.text, out.num_cached_tokens, out.time_to_first_token)

Every prompt and option of a call is checked before any prompt is queued, so a
bad one raises a :class:`~kvpool.errors.KVPoolError` and leaves the engine as
it was.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

from kvpool.engine.llm_engine import LLMEngine, Prompt
from kvpool.engine.model_store import DEFAULT_MODEL
from kvpool.engine.outputs import RequestOutput
from kvpool.engine.sampling import SamplingParams
from kvpool.engine.startup import EngineOptions
from kvpool.errors import ConfigError, RequestStateError
from kvpool.prompts import CHAT_ADDS_SPECIAL_TOKENS, CHAT_GENERATION_PROMPT, TEXT_ADDS_SPECIAL_TOKENS

__all__ = ["LLM"]

Conversation = Sequence[Mapping[str, str]]


def _is_single_prompt(value: object) -> bool:
    """Text, or a sequence of token IDs (told from a list of prompts by its first item)."""
    if isinstance(value, str):
        return True
    return isinstance(value, Sequence) and len(value) > 0 and not isinstance(value[0], (str, bytes, Sequence))


def _as_list(value: Any, count: int, what: str) -> list[Any]:
    """One value for every prompt, or a list or tuple with one per prompt."""
    if isinstance(value, (list, tuple)):
        if len(value) != count:
            raise ConfigError(f"{what} has {len(value)} entries for {count} prompts")
        return list(value)
    return [value] * count


class LLM:
    """A model with a paged KV cache, for offline batches (arguments as :class:`LLMEngine`)."""

    def __init__(
        self,
        model: str | os.PathLike[str] | EngineOptions = DEFAULT_MODEL,
        *,
        log: Callable[[str], None] | None = None,
        **options: Any,
    ) -> None:
        self.engine = LLMEngine(model, log=log, **options)

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        cache_salt: str | None | Sequence[str | None] = None,
    ) -> list[RequestOutput]:
        """Complete every prompt; outputs come back in prompt order.

        Args:
            prompts: one prompt or a list; a prompt is text or a list of token IDs.
            sampling_params: one for all prompts or one per prompt (default:
                greedy, 16 tokens).
            cache_salt: one for all prompts or one per prompt; requests with
                different salts never share cached blocks.
        """
        batch: list[Prompt]
        if _is_single_prompt(prompts):
            batch = [cast(Prompt, prompts)]
        elif isinstance(prompts, Sequence) and not isinstance(prompts, bytes):
            batch = list(cast(Sequence[Prompt], prompts))  # not one prompt: a list of them
        else:
            raise RequestStateError(f"prompts must be text, token IDs or a list of those, got {prompts!r}")
        return self._run(batch, sampling_params, cache_salt, add_special_tokens=TEXT_ADDS_SPECIAL_TOKENS)

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        cache_salt: str | None | Sequence[str | None] = None,
    ) -> list[RequestOutput]:
        """Answer one conversation (a list of ``{"role", "content"}`` messages) or a list of them.

        Each conversation is written with the tokenizer's chat template and an
        assistant turn is generated; the outputs' ``prompt`` is that rendering.
        """
        conversations: list[Conversation]
        if isinstance(messages, Sequence) and messages and isinstance(messages[0], Mapping):
            conversations = [cast(Conversation, messages)]  # its first item is a message
        elif isinstance(messages, Sequence) and not isinstance(messages, (str, bytes)):
            conversations = list(cast(Sequence[Conversation], messages))
        else:
            raise RequestStateError(f"messages must be a conversation or a list of them, got {messages!r}")
        texts = [self.engine.render_chat(c, add_generation_prompt=CHAT_GENERATION_PROMPT) for c in conversations]
        return self._run(texts, sampling_params, cache_salt, add_special_tokens=CHAT_ADDS_SPECIAL_TOKENS)

    def _run(
        self,
        prompts: Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        cache_salt: str | None | Sequence[str | None],
        *,
        add_special_tokens: bool,
    ) -> list[RequestOutput]:
        """Queue every prompt (all or none), run them to the end; outputs in prompt order."""
        params = _as_list(sampling_params, len(prompts), "sampling_params")
        salts = _as_list(cache_salt, len(prompts), "cache_salt")
        queued = self.engine.add_requests(prompts, params, cache_salts=salts, add_special_tokens=add_special_tokens)
        try:
            done = self.engine.run_until_done(queued)
        except BaseException:  # an interrupt or a failed step: leave nothing half-done behind
            for rid in queued:
                self.engine.abort(rid)
            raise
        return [done[rid] for rid in queued]
