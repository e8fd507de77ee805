"""The OpenAI API's requests: bodies checked (by the pydantic models of :mod:`.schema`) into typed values.

Parsing is strict at this boundary: every field kvpool reads is checked for
type and range, options vLLM honours that kvpool does not implement are refused
by name rather than ignored, and unknown fields are ignored, as the OpenAI API
does. Every refusal is an :class:`APIError` carrying the HTTP status and the
OpenAI error body, its ``param`` naming the field (``messages[2].content``).

Response bodies are the server's (:mod:`kvpool.serve.responses`). Nothing here imports torch; sampling
values are checked again by :class:`~kvpool.engine.sampling.SamplingParams`
when the server builds them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import Enum
from typing import Any

from kvpool.openai_http.errors import APIError, bad_request, error_body

__all__ = ["APIError", "GenerationEndpoint", "GenerationRequest", "Sampling", "error_body", "parse_generation"]


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
class Sampling:
    """The sampling fields of a request with vLLM's defaults filled in (``SamplingParams`` checks them again).

    ``max_tokens`` None is the rest of the context; ``top_k`` 0 is off (vLLM's
    -1 arrives as 0); ``logprobs`` None asks for none, k for the sampled
    token's logprob and the k most likely. ``structured`` is ``response_format``
    other than ``text``: its type (``json_object``, ``json_schema``) and, for a
    schema, the schema as JSON text.
    """

    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None
    structured: tuple[str, str | None] | None = None

    def engine_fields(self) -> dict[str, Any]:
        """The fields as ``SamplingParams`` keyword arguments."""
        return {name: getattr(self, name) for name in self.__dataclass_fields__}


#: Each field's value that changes nothing (an engine without the field can still serve it).
NEUTRAL = Sampling()


@dataclass(frozen=True, slots=True, kw_only=True)
class GenerationRequest:
    """One checked completion or chat request.

    Completions carry ``prompts`` (one or several, text or token IDs) and no
    ``messages``; chat carries ``messages`` and no prompts. Each prompt is
    answered with ``n`` choices.
    """

    endpoint: GenerationEndpoint
    model: str | None
    prompts: tuple[str | tuple[int, ...], ...]
    messages: tuple[dict[str, str], ...] | None
    sampling: Sampling
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


def _sampling(body: Any, max_tokens: int | None, logprobs: int | None) -> Sampling:
    given = {
        name: getattr(body, name)
        for name in (
            "temperature",
            "top_p",
            "min_p",
            "seed",
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
            "min_tokens",
            "include_stop_str_in_output",
            "ignore_eos",
        )
        if getattr(body, name) is not None
    }
    top_k = body.top_k
    return Sampling(
        structured=_structured(body.response_format),
        max_tokens=max_tokens,
        top_k=0 if top_k in (None, -1) else top_k,
        stop=body.stop or (),
        stop_token_ids=tuple(body.stop_token_ids or ()),
        logprobs=logprobs,
        **given,
    )


def _structured(response_format: Any) -> tuple[str, str | None] | None:
    """``response_format`` as :attr:`Sampling.structured`: None for text, else its type and schema (JSON text)."""
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return ("json_object", None)
    return ("json_schema", json.dumps(response_format.json_schema.schema_, ensure_ascii=False))


def _common(body: Any) -> dict[str, Any]:
    options = body.stream_options
    return {
        "model": body.model,
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
        sampling=_sampling(body, body.max_tokens, body.logprobs),
        echo=body.echo,
        **_common(body),
    )


def _chat(body: Any) -> GenerationRequest:
    messages = tuple(
        {"role": "system" if m.role == "developer" else m.role, "content": m.text() or ""} for m in body.messages
    )
    # The newer name wins over the older one, as in OpenAI's API.
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    return GenerationRequest(
        endpoint=GenerationEndpoint.CHAT,
        prompts=(),
        messages=messages,
        sampling=_sampling(body, max_tokens, logprobs),
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
