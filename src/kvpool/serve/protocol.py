"""The OpenAI API's shapes: request bodies checked into typed values, responses and errors as JSON.

Parsing is strict at this boundary: every field kvpool reads is checked for
type and range, unsupported options that would change the result (``n > 1``,
``logprobs``, stop strings, ...) are refused by name rather than ignored, and
unknown fields are ignored, as the OpenAI API does. Every refusal is an
:class:`APIError` that carries the HTTP status and the OpenAI error body.

Nothing here imports torch; sampling values are checked by
:class:`~kvpool.engine.sampling.SamplingParams` when the engine builds them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

__all__ = [
    "APIError",
    "Endpoint",
    "GenerationRequest",
    "Sampling",
    "Usage",
    "chunk_body",
    "completion_body",
    "error_body",
    "parse_generation",
]

#: Tokens generated when a request names no ``max_tokens`` (the OpenAI completions default).
DEFAULT_MAX_TOKENS = 16
_MAX_SEED = 2**63


class APIError(Exception):
    """A refused request: its HTTP status and the OpenAI-style error it is answered with."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    @property
    def body(self) -> dict[str, Any]:
        return error_body(self.message, type=self.type, param=self.param, code=self.code)


def error_body(
    message: str, *, type: str = "invalid_request_error", param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


class Endpoint(Enum):
    """The two generation endpoints: their paths, and the object names their bodies carry."""

    COMPLETIONS = "/v1/completions"
    CHAT = "/v1/chat/completions"

    @property
    def object_name(self) -> str:
        return "text_completion" if self is Endpoint.COMPLETIONS else "chat.completion"

    @property
    def chunk_object_name(self) -> str:
        return "text_completion" if self is Endpoint.COMPLETIONS else "chat.completion.chunk"

    @property
    def id_prefix(self) -> str:
        return "cmpl" if self is Endpoint.COMPLETIONS else "chatcmpl"


@dataclass(frozen=True, slots=True, kw_only=True)
class Sampling:
    """The sampling fields of a request, as given (the engine's SamplingParams checks them again)."""

    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    ignore_eos: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class GenerationRequest:
    """One checked completion or chat request.

    Exactly one of ``prompt`` (text or token IDs, completions) and ``messages``
    (a conversation, chat) is set.
    """

    endpoint: Endpoint
    model: str
    prompt: str | tuple[int, ...] | None
    messages: tuple[dict[str, str], ...] | None
    sampling: Sampling
    stream: bool
    include_usage: bool
    cache_salt: str | None


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


# -- field readers -----------------------------------------------------------------------


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(body: Mapping[str, Any], name: str, default: float, low: float, high: float, *, open_low: bool) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise bad_request(f"'{name}' must be a number, got {value!r}", name)
    if value > high or value < low or (open_low and value == low):
        bracket = "(" if open_low else "["
        raise bad_request(f"'{name}' must be in {bracket}{low}, {high}], got {value!r}", name)
    return float(value)


def _int(body: Mapping[str, Any], name: str, default: int | None, low: int, high: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if not _is_int(value):
        raise bad_request(f"'{name}' must be an integer, got {value!r}", name)
    if value < low or (high is not None and value >= high):
        limit = f">= {low}" if high is None else f"in [{low}, {high})"
        raise bad_request(f"'{name}' must be an integer {limit}, got {value!r}", name)
    return int(value)


def _bool(body: Mapping[str, Any], name: str, default: bool) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(f"'{name}' must be true or false, got {value!r}", name)
    return value


def _utf8(text: str, param: str) -> str:
    """``text``, refused if it holds a lone surrogate (JSON can carry one; no tokenizer can encode it)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise bad_request(f"'{param}' is not valid Unicode (it holds a lone surrogate)", param) from None
    return text


def _refuse_unsupported(body: Mapping[str, Any]) -> None:
    """Options that would change the answer and that kvpool does not implement: refused, not ignored."""
    for name in ("n", "best_of"):  # an integer field: true and 1.0 are not 1
        value = _int(body, name, None, 0)
        if value is not None and value != 1:
            raise bad_request(f"'{name}' must be 1 (one choice per request), got {value!r}", name, "unsupported_value")
    for name in ("logprobs", "top_logprobs", "echo", "suffix", "tools", "functions", "response_format"):
        value = body.get(name)
        if value not in (None, False, 0, [], {}) and not (name == "response_format" and _is_text_format(value)):
            raise bad_request(f"'{name}' is not supported by this server", name, "unsupported_parameter")
    stop = body.get("stop")
    if stop not in (None, [], ""):
        raise bad_request("'stop' strings are not supported by this server", "stop", "unsupported_parameter")
    for name in ("logit_bias",):
        if body.get(name):
            raise bad_request(f"'{name}' is not supported by this server", name, "unsupported_parameter")


def _is_text_format(value: object) -> bool:
    return isinstance(value, Mapping) and value.get("type") == "text"


def _sampling(body: Mapping[str, Any], max_tokens_names: Sequence[str]) -> Sampling:
    max_tokens: int | None = None
    for name in max_tokens_names:  # chat's newer name wins over the older one
        value = _int(body, name, None, 1)
        if value is not None:
            max_tokens = value
            break
    return Sampling(
        max_tokens=DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens,
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0, open_low=False),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0, open_low=True),
        top_k=_top_k(body),
        seed=_int(body, "seed", None, 0, _MAX_SEED),
        ignore_eos=_bool(body, "ignore_eos", False),
    )


def _top_k(body: Mapping[str, Any]) -> int:
    value = body.get("top_k")
    if _is_int(value) and value == -1:  # vLLM's "off" (an integer: -1.0 is refused like any float)
        return 0
    top_k = _int(body, "top_k", 0, 0)
    return 0 if top_k is None else top_k


def _stream_options(body: Mapping[str, Any], stream: bool) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, Mapping):
        raise bad_request(f"'stream_options' must be an object, got {options!r}", "stream_options")
    if not stream:
        raise bad_request("'stream_options' is only allowed with 'stream': true", "stream_options")
    return _bool(options, "include_usage", False)


def _cache_salt(body: Mapping[str, Any]) -> str | None:
    salt = body.get("cache_salt")
    if salt is None:
        return None
    if not isinstance(salt, str) or not salt:
        raise bad_request(f"'cache_salt' must be a non-empty string, got {salt!r}", "cache_salt")
    return _utf8(salt, "cache_salt")


def _prompt(body: Mapping[str, Any]) -> str | tuple[int, ...]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise bad_request("'prompt' is empty", "prompt")
        return _utf8(prompt, "prompt")
    if isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        if any(t < 0 for t in prompt):
            raise bad_request("'prompt' token IDs must be >= 0", "prompt")
        return tuple(prompt)
    if prompt is None:
        raise bad_request("'prompt' is required", "prompt", "missing_required_parameter")
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        raise bad_request("'prompt' holds several prompts; send one per request", "prompt", "unsupported_value")
    raise bad_request("'prompt' must be a string or a list of token IDs", "prompt")


def _content(message: Mapping[str, Any], i: int) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return _utf8(content, f"messages[{i}].content")
    if isinstance(content, list):  # content parts: only text is served
        texts = []
        for part in content:
            if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad_request(f"messages[{i}].content: only text parts are supported", f"messages[{i}].content")
            texts.append(_utf8(part["text"], f"messages[{i}].content"))
        return "".join(texts)
    if content is None and message.get("role") == "assistant":
        return ""
    raise bad_request(f"messages[{i}].content must be a string or a list of text parts", f"messages[{i}].content")


def _messages(body: Mapping[str, Any]) -> tuple[dict[str, str], ...]:
    messages = body.get("messages")
    if messages is None:
        raise bad_request("'messages' is required", "messages", "missing_required_parameter")
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty list", "messages")
    checked = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise bad_request(f"messages[{i}] must be an object", f"messages[{i}]")
        role = message.get("role")
        if role not in ("system", "developer", "user", "assistant"):
            raise bad_request(
                f"messages[{i}].role must be system, developer, user or assistant, got {role!r}", f"messages[{i}].role"
            )
        checked.append({"role": "system" if role == "developer" else role, "content": _content(message, i)})
    return tuple(checked)


def parse_generation(endpoint: Endpoint, body: object) -> GenerationRequest:
    """A request body checked field by field; raises :class:`APIError` (400) naming the first bad one."""
    if not isinstance(body, Mapping):
        raise bad_request("the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("'model' is required and must be a string", "model", "missing_required_parameter")
    _refuse_unsupported(body)
    stream = _bool(body, "stream", False)
    if endpoint is Endpoint.CHAT:
        prompt, messages = None, _messages(body)
        sampling = _sampling(body, ("max_completion_tokens", "max_tokens"))
    else:
        prompt, messages = _prompt(body), None
        sampling = _sampling(body, ("max_tokens",))
    return GenerationRequest(
        endpoint=endpoint,
        model=model,
        prompt=prompt,
        messages=messages,
        sampling=sampling,
        stream=stream,
        include_usage=_stream_options(body, stream),
        cache_salt=_cache_salt(body),
    )


# -- responses ---------------------------------------------------------------------------


def _choice(endpoint: Endpoint, text: str, finish_reason: str | None, *, delta: bool) -> dict[str, Any]:
    if endpoint is Endpoint.COMPLETIONS:
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
    if delta:
        return {
            "index": 0,
            "delta": {"content": text} if text else {},
            "logprobs": None,
            "finish_reason": finish_reason,
        }
    return {
        "index": 0,
        "message": {"role": "assistant", "content": text},
        "logprobs": None,
        "finish_reason": finish_reason,
    }


def completion_body(
    endpoint: Endpoint, response_id: str, created: int, model: str, text: str, finish_reason: str, usage: Usage
) -> dict[str, Any]:
    """A whole (not streamed) response."""
    return {
        "id": response_id,
        "object": endpoint.object_name,
        "created": created,
        "model": model,
        "choices": [_choice(endpoint, text, finish_reason, delta=False)],
        "usage": usage.body(),
    }


def chunk_body(
    endpoint: Endpoint,
    response_id: str,
    created: int,
    model: str,
    *,
    text: str = "",
    finish_reason: str | None = None,
    role: bool = False,
    usage: Usage | None = None,
    include_usage: bool = False,
) -> dict[str, Any]:
    """One streamed chunk; a usage-only chunk (``usage`` given) has no choices, as OpenAI sends it."""
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
    choice = _choice(endpoint, text, finish_reason, delta=True)
    if role:
        choice["delta"] = {"role": "assistant", "content": text}
    chunk["choices"] = [choice]
    if include_usage:
        chunk["usage"] = None
    return chunk
