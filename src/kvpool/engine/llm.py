"""The offline API: ``LLM(model).generate(prompts)`` and ``LLM(model).chat(conversations)``.

::

    from kvpool.engine import LLM, SamplingParams

    llm = LLM("smollm2-135m", kv_cache_memory="512MiB")
    [out] = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                     SamplingParams(max_tokens=32))
    print(out.text, out.num_cached_tokens, out.time_to_first_token)

Every prompt of a call is checked before any is queued, so a bad one raises a
:class:`~kvpool.errors.KVPoolError` and leaves the engine as it was.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence

import torch

from kvpool.engine.llm_engine import LLMEngine, PreparedRequest, Prompt
from kvpool.engine.model_store import DEFAULT_MODEL
from kvpool.engine.outputs import RequestOutput
from kvpool.engine.sampling import SamplingParams
from kvpool.errors import ConfigError, RequestStateError

__all__ = ["LLM"]

Conversation = Sequence[Mapping[str, str]]


def _is_token_ids(value: object) -> bool:
    return (
        isinstance(value, Sequence)
        and not isinstance(value, (str, bytes))
        and len(value) > 0
        and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    )


def _as_list(value, count: int, what: str) -> list:
    """One value for every prompt, or a list with one per prompt."""
    if isinstance(value, (list, tuple)):
        if len(value) != count:
            raise ConfigError(f"{what} has {len(value)} entries for {count} prompts")
        return list(value)
    return [value] * count


class LLM:
    """A model with a paged KV cache, for offline batches (arguments as :class:`LLMEngine`)."""

    def __init__(
        self,
        model: str | os.PathLike[str] = DEFAULT_MODEL,
        *,
        block_size: int = 16,
        max_num_batched_tokens: int = 512,
        max_num_seqs: int = 64,
        max_model_len: int | None = None,
        kv_cache_memory: int | str | None = None,
        gpu_memory_utilization: float = 0.9,
        enable_prefix_caching: bool = True,
        dtype: torch.dtype | str | None = None,
        device: torch.device | str | None = None,
        log: Callable[[str], None] | None = None,
    ) -> None:
        self.engine = LLMEngine(
            model,
            block_size=block_size,
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
            kv_cache_memory=kv_cache_memory,
            gpu_memory_utilization=gpu_memory_utilization,
            enable_prefix_caching=enable_prefix_caching,
            dtype=dtype,
            device=device,
            log=log,
        )

    @property
    def tokenizer(self):
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
        if isinstance(prompts, str) or _is_token_ids(prompts):
            batch = [prompts]
        elif isinstance(prompts, Sequence) and not isinstance(prompts, bytes):
            batch = list(prompts)
        else:
            raise RequestStateError(f"prompts must be text, token IDs or a list of those, got {type(prompts).__name__}")
        if not batch:
            return []
        params = _as_list(
            SamplingParams() if sampling_params is None else sampling_params, len(batch), "sampling_params"
        )
        salts = _as_list(cache_salt, len(batch), "cache_salt")
        prepared = [self.engine.prepare(p, sp, cache_salt=salt) for p, sp, salt in zip(batch, params, salts)]
        return self._queue_and_run(prepared)

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
        if isinstance(messages, Sequence) and messages and isinstance(messages[0], Mapping):
            conversations = [messages]
        elif isinstance(messages, Sequence) and not isinstance(messages, (str, bytes)):
            conversations = list(messages)
        else:
            raise RequestStateError(f"messages must be a conversation or a list of them, got {type(messages).__name__}")
        if not conversations:
            return []
        texts = [self.engine.render_chat(c) for c in conversations]
        params = _as_list(
            SamplingParams() if sampling_params is None else sampling_params, len(texts), "sampling_params"
        )
        salts = _as_list(cache_salt, len(texts), "cache_salt")
        prepared = [
            self.engine.prepare(text, p, cache_salt=salt, add_special_tokens=False)
            for text, p, salt in zip(texts, params, salts)
        ]
        return self._queue_and_run(prepared)

    def _queue_and_run(self, prepared: list[PreparedRequest]) -> list[RequestOutput]:
        queued: list[str] = []
        try:
            for one in prepared:
                queued.append(self.engine.add_prepared(one))
            done = self.engine.run_until_done(queued)
        except BaseException:  # a refused request, or an interrupt: leave nothing half-done behind
            for rid in queued:
                self.engine.abort(rid)
            raise
        return [done[rid] for rid in queued]
