"""The OpenAI API's answers, shaped as vLLM's OpenAI server shapes them.

A choice carries ``finish_reason`` (``stop`` or ``length``; ``abort`` for a
request cut short) and ``stop_reason`` (the stop token ID or stop string that
ended it; None for the end-of-sequence token or the length limit). Usage
carries ``prompt_tokens_details.cached_tokens``. Logprobs follow each
endpoint's shape: for completions ``tokens``, ``token_logprobs``,
``top_logprobs`` (a token -> logprob object holding the sampled token and the
k most likely) and ``text_offset``; for chat ``content``, a list of
``{token, logprob, bytes, top_logprobs}``.

Nothing here imports torch: logprob entries are anything with the engine's
``TokenLogprobs`` fields (``token_id``, ``logprob``, ``top``), and token text
comes from a ``token_text`` function the caller provides.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from kvpool.openai_http.protocol import GenerationEndpoint

__all__ = ["Choice", "LogprobEntry", "Usage", "chunk_body", "completion_body", "logprobs_body"]

TokenText = Callable[[int], str]


class LogprobEntry(Protocol):
    """One generated token's logprobs (the engine's ``TokenLogprobs``)."""

    @property
    def token_id(self) -> int: ...
    @property
    def logprob(self) -> float: ...
    @property
    def top(self) -> Sequence[tuple[int, float]]: ...


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int

    def body(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class Choice:
    """One sequence's part of an answer (whole, or a streamed piece of it)."""

    index: int
    text: str
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: dict[str, Any] | None = None


def _number(value: float) -> float | str:
    """A logprob as JSON can carry it (``-inf`` is not JSON: vLLM writes -9999.0)."""
    return value if math.isfinite(value) else -9999.0


def logprobs_body(
    endpoint: GenerationEndpoint, entries: Sequence[LogprobEntry], token_text: TokenText, *, text_offset: int = 0
) -> dict[str, Any]:
    """The logprobs of ``entries`` in ``endpoint``'s shape; completions' offsets start at ``text_offset``."""
    if endpoint is GenerationEndpoint.CHAT:
        content = []
        for entry in entries:
            token = token_text(entry.token_id)
            content.append(
                {
                    "token": token,
                    "logprob": _number(entry.logprob),
                    "bytes": list(token.encode("utf-8")),
                    "top_logprobs": [
                        {"token": (t := token_text(tid)), "logprob": _number(lp), "bytes": list(t.encode("utf-8"))}
                        for tid, lp in entry.top
                    ],
                }
            )
        return {"content": content}
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    offset = text_offset
    for entry in entries:
        token = token_text(entry.token_id)
        tokens.append(token)
        token_logprobs.append(_number(entry.logprob))
        top = {token: _number(entry.logprob)}  # the sampled token first, then the most likely
        for tid, lp in entry.top:
            top.setdefault(token_text(tid), _number(lp))
        top_logprobs.append(top)
        offsets.append(offset)
        offset += len(token)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs, "text_offset": offsets}


def _choice_body(endpoint: GenerationEndpoint, choice: Choice, *, delta: bool, role: bool = False) -> dict[str, Any]:
    body: dict[str, Any] = {"index": choice.index}
    if endpoint is GenerationEndpoint.COMPLETIONS:
        body["text"] = choice.text
    elif delta:
        message: dict[str, Any] = {"role": "assistant"} if role else {}
        if choice.text or role:
            message["content"] = choice.text
        body["delta"] = message
    else:
        body["message"] = {"role": "assistant", "content": choice.text}
    body["logprobs"] = choice.logprobs
    body["finish_reason"] = choice.finish_reason
    if not delta or choice.finish_reason is not None or endpoint is GenerationEndpoint.COMPLETIONS:
        body["stop_reason"] = choice.stop_reason
    return body


def completion_body(
    endpoint: GenerationEndpoint, response_id: str, created: int, model: str, choices: Sequence[Choice], usage: Usage
) -> dict[str, Any]:
    """A whole (not streamed) response."""
    return {
        "id": response_id,
        "object": endpoint.object_name,
        "created": created,
        "model": model,
        "choices": [_choice_body(endpoint, c, delta=False) for c in choices],
        "usage": usage.body(),
    }


def chunk_body(
    endpoint: GenerationEndpoint,
    response_id: str,
    created: int,
    model: str,
    *,
    choice: Choice | None = None,
    role: bool = False,
    usage: Usage | None = None,
) -> dict[str, Any]:
    """One streamed chunk: one choice's piece, or (``usage`` given) the usage chunk, which has no choices."""
    chunk: dict[str, Any] = {
        "id": response_id,
        "object": endpoint.chunk_object_name,
        "created": created,
        "model": model,
    }
    if usage is not None:
        chunk["choices"] = []
        chunk["usage"] = usage.body()
        return chunk
    assert choice is not None  # a chunk is a choice's or the usage's
    chunk["choices"] = [_choice_body(endpoint, choice, delta=True, role=role)]
    return chunk
