"""``POST /tokenize`` and ``POST /detokenize``, with vLLM's request and answer shapes.

``/tokenize`` takes ``prompt`` (text) or ``messages`` (rendered with the chat
template, as a chat request would be) and answers ``{count, max_model_len,
tokens, token_strs}``; ``/detokenize`` takes ``tokens`` and answers
``{prompt}``. Both run on the tokenizer thread, with the same checks as a
generation request (strict types, lone surrogates, the size bound before
tokenizing), and in turns between tenants; as in vLLM they need no API key
(:func:`kvpool.openai_http.tokenizer_turn`: keyless requests share one turn).

``add_special_tokens`` is vLLM's: for a ``prompt`` it defaults to true (the
tokenizer's special tokens, such as BOS, are added, as a completion's are) and
false encodes the text alone; for ``messages`` it defaults to false (the chat
template wrote them) and true adds the tokenizer's on top of the template's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kvpool.errors import KVPoolError
from kvpool.openai_http.errors import APIError, bad_request
from kvpool.openai_http.protocol import GenerationEndpoint, GenerationRequest, validation_error
from kvpool.openai_http.schema import Message, utf8
from kvpool.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kvpool.serve.tokenizer_thread import TokenizerThread

__all__ = ["detokenize_body", "tokenize_body"]

#: A tokenize request is a generation request that is never run: its sampling is the default.
_NOT_SAMPLED = SamplingParams()


class _Tokenize(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    model: str | None = None
    prompt: str | None = None
    messages: list[Message] | None = Field(default=None, min_length=1)
    add_special_tokens: bool | None = None  # None: vLLM's default, true for a prompt and false for messages
    return_token_strs: bool = False


class _Detokenize(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    model: str | None = None
    tokens: list[int] = Field(max_length=1 << 20)


def _validate(model: type[BaseModel], body: object) -> Any:
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {type(body).__name__}", "body")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise validation_error(exc) from None


async def tokenize_body(
    body: object,
    prompts: TokenizerThread,
    check_model: Callable[[GenerationRequest], None],
    tenant: str | None = None,
) -> dict[str, Any]:
    request: _Tokenize = _validate(_Tokenize, body)
    if (request.prompt is None) == (request.messages is None):
        raise bad_request("give exactly one of 'prompt' and 'messages'", "prompt")
    if request.prompt is not None:
        gen = GenerationRequest(
            endpoint=GenerationEndpoint.COMPLETIONS,
            model=request.model,
            prompts=(utf8(request.prompt, "prompt"),),
            messages=None,
            sampling=_NOT_SAMPLED,
        )
    else:
        messages = []
        for i, m in enumerate(request.messages or ()):
            messages.append(
                {
                    "role": "system" if m.role == "developer" else m.role,
                    "content": utf8(m.text() or "", f"messages[{i}].content"),
                }
            )
        gen = GenerationRequest(
            endpoint=GenerationEndpoint.CHAT,
            model=request.model,
            prompts=(),
            messages=tuple(messages),
            sampling=_NOT_SAMPLED,
        )
    check_model(gen)
    try:
        tokens = list(await prompts.token_ids(gen, tenant=tenant, special_tokens=request.add_special_tokens))
    except KVPoolError as exc:
        raise APIError(400, str(exc), param="prompt" if request.prompt is not None else "messages") from None
    strs = None
    if request.return_token_strs:
        texts = await prompts.token_texts(tokens, tenant=tenant)
        strs = [texts[t] for t in tokens]
    return {"count": len(tokens), "max_model_len": prompts.max_model_len, "tokens": tokens, "token_strs": strs}


async def detokenize_body(
    body: object,
    prompts: TokenizerThread,
    check_model: Callable[[GenerationRequest], None],
    tenant: str | None = None,
) -> dict[str, Any]:
    request: _Detokenize = _validate(_Detokenize, body)
    check_model(
        GenerationRequest(
            endpoint=GenerationEndpoint.COMPLETIONS,
            model=request.model,
            prompts=(),
            messages=None,
            sampling=_NOT_SAMPLED,
        )
    )
    try:
        text = await prompts.decode(request.tokens, tenant=tenant)
    except KVPoolError as exc:
        raise APIError(400, str(exc), param="tokens") from None
    return {"prompt": text}
