"""The OpenAI API's requests: bodies checked (by the pydantic models of :mod:`.schema`) into typed values.

Parsing is strict at this boundary: every field kvpool reads is checked for
type and range, options vLLM honours that kvpool does not implement are refused
by name rather than ignored, and unknown fields are ignored, as the OpenAI API
does. Every refusal is an :class:`APIError` carrying the HTTP status and the
OpenAI error body, its ``param`` naming the field (``messages[2].content``).

The sampling fields become a :class:`~kvpool.sampling_params.SamplingParams`
here, built directly from the body: the body's schema declares their JSON types,
``SamplingParams`` their ranges, and its refusal is a 400 naming the field. What
only the OpenAI API has (``n``, ``echo``, ``stream``, ``response_format``) stays
on :class:`GenerationRequest`. Response bodies are the server's
(:mod:`kvpool.serve.responses`). Nothing here imports torch.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, fields
from enum import Enum
from typing import Any

from kvpool.errors import KVPoolError
from kvpool.openai_http.errors import APIError, bad_request, error_body
from kvpool.sampling_params import SamplingParams, field_at_fault

__all__ = ["APIError", "GenerationEndpoint", "GenerationRequest", "error_body", "parse_generation"]


class GenerationEndpoint(Enum):
    """The two generation endpoints: their paths, and the object names their bodies carry."""

    COMPLETIONS = "/v1/completions"
    CHAT = "/v1/chat/completions"

    @property
    def object_name(self) -> str:
        return "text_completion" if self is GenerationEndpoint.COMPLETIONS else "chat.completion"

    @property
    def chunk_object_name(self) -> str:
        return "text_completion" if self is GenerationEndpoint.COMPLETIONS else "chat.completion.chunk"

    @property
    def id_prefix(self) -> str:
        return "cmpl" if self is GenerationEndpoint.COMPLETIONS else "chatcmpl"


@dataclass(frozen=True, slots=True, kw_only=True)
class GenerationRequest:
    """One checked completion or chat request.

    Completions carry ``prompts`` (one or several, text or token IDs) and no
    ``messages``; chat carries ``messages`` and no prompts. Each prompt is
    answered with ``n`` choices, each sampled as ``sampling`` says (the server
    gives sequence ``i`` of a seeded request ``seed + i``). ``response_format``
    other than ``text`` is its type (``json_object``, ``json_schema``) and, for a
    schema, the schema as JSON text: the engine compiles it into
    ``SamplingParams.structured``.
    """

    endpoint: GenerationEndpoint
    model: str | None
    prompts: tuple[str | tuple[int, ...], ...]
    messages: tuple[dict[str, str], ...] | None
    sampling: SamplingParams
    response_format: tuple[str, str | None] | None = None
    n: int = 1
    echo: bool = False
    stream: bool = False
    include_usage: bool = False
    cache_salt: str | None = None
    #: Chat's ``tools``, as given (the server refuses them: see ``kvpool.serve.generation.check_tools``).
    tools: tuple[dict[str, Any], ...] = ()

    @property
    def prompt(self) -> str | tuple[int, ...] | None:
        """The first prompt (what a router hashes), None for chat."""
        return self.prompts[0] if self.prompts else None


def parse_generation(endpoint: GenerationEndpoint, body: object) -> GenerationRequest:
    """A decoded JSON request body, checked; raises :class:`APIError` (400) naming the first bad field."""
    from pydantic import ValidationError

    from kvpool.openai_http.schema import ChatBody, CompletionBody

    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {type(body).__name__}", "body")
    try:
        if endpoint is GenerationEndpoint.CHAT:
            chat = ChatBody.model_validate(body)
            return _chat(chat)
        return _completion(CompletionBody.model_validate(body))
    except ValidationError as exc:
        raise validation_error(exc) from None


#: The OpenAI API's temperature when a request leaves it out (vLLM's too); ``SamplingParams``' own is greedy.
OPENAI_TEMPERATURE = 1.0

#: ``SamplingParams`` fields a body does not give as they are: each endpoint's ``max_tokens`` and ``logprobs``,
#: the temperature's default, ``top_k``'s -1 (off) and the grammar (the engine's, from ``response_format``).
_TRANSLATED = frozenset({"max_tokens", "logprobs", "temperature", "top_k", "structured"})
#: The others: a body field of the same name and meaning (null is ``SamplingParams``' default).
_AS_GIVEN = tuple(f.name for f in fields(SamplingParams) if f.name not in _TRANSLATED)


def _sampling(body: Any, max_tokens: int | None, logprobs: int | None, renamed: Mapping[str, str]) -> SamplingParams:
    """The body's sampling fields as ``SamplingParams``; its refusal is a 400 naming the body's field.

    ``renamed`` maps a ``SamplingParams`` field to the body field it came from when their names differ.
    """
    given = {name: getattr(body, name) for name in _AS_GIVEN if getattr(body, name) is not None}
    top_k = body.top_k
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=OPENAI_TEMPERATURE if body.temperature is None else body.temperature,
            top_k=0 if top_k in (None, -1) else top_k,
            logprobs=logprobs,
            **given,
        )
    except KVPoolError as exc:
        field = field_at_fault(exc)
        if field is None or field not in renamed:
            raise bad_request(str(exc), field) from None
        raise bad_request(f"'{renamed[field]}': {exc}", renamed[field]) from None


def _structured(response_format: Any) -> tuple[str, str | None] | None:
    """``response_format`` as :attr:`GenerationRequest.response_format`: None for text, else its type and schema."""
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return ("json_object", None)
    return ("json_schema", json.dumps(response_format.json_schema.schema_, ensure_ascii=False))


def _common(body: Any) -> dict[str, Any]:
    options = body.stream_options
    return {
        "model": body.model,
        "response_format": _structured(body.response_format),
        "n": body.n,
        "stream": body.stream,
        "include_usage": bool(options is not None and options.include_usage),
        "cache_salt": body.cache_salt,
    }


def _completion(body: Any) -> GenerationRequest:
    return GenerationRequest(
        endpoint=GenerationEndpoint.COMPLETIONS,
        prompts=body.prompt,
        messages=None,
        sampling=_sampling(body, body.max_tokens, body.logprobs, {}),
        echo=body.echo,
        **_common(body),
    )


def _chat(body: Any) -> GenerationRequest:
    messages = tuple(
        {"role": "system" if m.role == "developer" else m.role, "content": m.text() or ""} for m in body.messages
    )
    # The newer name wins over the older one, as in OpenAI's API.
    newer = body.max_completion_tokens is not None
    max_tokens = body.max_completion_tokens if newer else body.max_tokens
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    renamed = {"logprobs": "top_logprobs"} | ({"max_tokens": "max_completion_tokens"} if newer else {})
    return GenerationRequest(
        endpoint=GenerationEndpoint.CHAT,
        prompts=(),
        messages=messages,
        sampling=_sampling(body, max_tokens, logprobs, renamed),
        tools=tuple(body.tools or ()),
        **_common(body),
    )


# -- pydantic's errors, as the server words them ---------------------------------------


def _param(loc: tuple[int | str, ...]) -> str | None:
    """``("messages", 2, "content")`` -> ``messages[2].content``."""
    text = ""
    for part in loc:
        if isinstance(part, int):
            text += f"[{part}]"
        elif not part.startswith(("function-", "tagged-union")):  # pydantic's own validator names
            text += f".{part}" if text else part
    return text or None


_WANTED = {
    "int_type": "an integer",
    "int_parsing": "an integer",
    "int_from_float": "an integer",
    "float_type": "a number",
    "float_parsing": "a number",
    "finite_number": "a finite number",
    "bool_type": "true or false",
    "bool_parsing": "true or false",
    "string_type": "a string",
    "list_type": "a list",
    "dict_type": "an object",
    "model_type": "an object",
    "model_attributes_type": "an object",
}

_BOUNDS = {
    "greater_than_equal": (">=", "ge"),
    "greater_than": (">", "gt"),
    "less_than_equal": ("<=", "le"),
    "less_than": ("<", "lt"),
}


def validation_error(exc: Any) -> APIError:
    """The first of a pydantic ``ValidationError``'s errors as a 400 naming its field."""
    error = exc.errors(include_url=False)[0]
    kind, loc, ctx = error["type"], tuple(error["loc"]), error.get("ctx") or {}
    param = _param(loc)
    name = f"'{param}'" if param else "the request body"
    given = repr(error.get("input"))
    if len(given) > 80:
        given = given[:77] + "..."
    if kind == "missing":
        return bad_request(f"{name} is required", param, "missing_required_parameter")
    if kind in _WANTED:
        return bad_request(f"{name} must be {_WANTED[kind]}, got {given}", param)
    if kind in _BOUNDS:
        sign, key = _BOUNDS[kind]
        return bad_request(f"{name} must be {sign} {ctx[key]}, got {given}", param)
    if kind == "literal_error":
        return bad_request(f"{name} must be {ctx.get('expected')}, got {given}", param)
    if kind == "too_short":
        return bad_request(f"{name} must be non-empty", param)
    if kind == "too_long":
        return bad_request(f"{name} holds too many items (at most {ctx.get('max_length')})", param)
    return bad_request(f"{name}: {error['msg']}, got {given}", param)
