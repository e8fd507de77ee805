"""The OpenAI request bodies as pydantic models: types, ranges and refusals declared once.

Validation is strict (pydantic's strict mode on decoded JSON): ``true`` is not
an integer nor a number, ``1.0`` is not an integer, ``"1"`` is not anything but
a string, and NaN or infinities (which Python's JSON reader accepts) are not
numbers. Every string the server reads is refused if it holds a lone surrogate
(JSON can spell one; no tokenizer can encode it). The sampling fields are
declared here by their JSON types only: their ranges are checked once, by
:class:`~kvpool.sampling_params.SamplingParams`, when the request is built
from the body. Sizes are bounded: at most
:data:`MAX_CHOICES` sequences per request, :data:`MAX_STOP_STRINGS` stop
strings of at most :data:`MAX_STOP_CHARS` characters.

Options vLLM's OpenAI server knows but this server does not implement are
declared with the value that changes nothing (:data:`UNSUPPORTED`); any other
value is refused by name, never ignored. Fields no server knows are ignored,
as the OpenAI API does.

A check that needs a message of its own raises :class:`~kvpool.openai_http.protocol.APIError`
from inside a validator (pydantic lets exceptions other than ``ValueError``
through), so every refusal names its field.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

from kvpool.openai_http.errors import bad_request

__all__ = [
    "COMPLETION_MAX_TOKENS",
    "MAX_CHOICES",
    "MAX_STOP_CHARS",
    "MAX_STOP_STRINGS",
    "UNSUPPORTED",
    "ChatBody",
    "CompletionBody",
    "ResponseFormat",
]

#: Sequences one request may ask for (``n`` times the number of prompts).
MAX_CHOICES = 128
#: Stop strings one request may give, and the longest.
MAX_STOP_STRINGS = 32
MAX_STOP_CHARS = 1024
#: ``/v1/completions``' ``max_tokens`` when it is left out or null (OpenAI's and vLLM's 16); chat has no
#: such default and runs to the end of the context.
COMPLETION_MAX_TOKENS = 16


def utf8(text: str, param: str) -> str:
    """``text``, refused (400 naming ``param``) if it holds a lone surrogate."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise bad_request(f"'{param}' is not valid Unicode (it holds a lone surrogate)", param) from None
    return text


def _utf8_field(param: str) -> AfterValidator:
    return AfterValidator(lambda text: utf8(text, param))


def _off(value: object) -> bool:
    return value in (None, False, 0, "", [], {})


#: Options vLLM honours that this server does not: name -> "this value changes nothing".
UNSUPPORTED: dict[str, Callable[[Any], bool]] = {
    "suffix": _off,
    "logit_bias": _off,
    "tools": _off,
    "functions": _off,
    "function_call": lambda v: v in (None, "none"),
    "tool_choice": lambda v: v in (None, "none", "auto"),
    "use_beam_search": _off,
    "length_penalty": lambda v: v in (None, 1, 1.0),
    "prompt_logprobs": lambda v: v is None,
    "structured_outputs": _off,
    "guided_json": _off,
    "guided_regex": _off,
    "guided_choice": _off,
    "guided_grammar": _off,
    "allowed_token_ids": lambda v: v is None,
    "bad_words": _off,
    "truncate_prompt_tokens": lambda v: v is None,
    "skip_special_tokens": lambda v: v in (None, True),
    "spaces_between_special_tokens": lambda v: v in (None, True),
    "continue_final_message": _off,
    "chat_template": lambda v: v is None,
    "chat_template_kwargs": _off,
    "documents": _off,
    "priority": _off,
    "return_tokens_as_token_ids": _off,
    "return_token_ids": _off,
    "prompt_embeds": _off,
    "reasoning_effort": lambda v: v is None,
    "audio": _off,
    "modalities": lambda v: v in (None, ["text"]),
    "prediction": _off,
    "vllm_xargs": _off,
    "kv_transfer_params": _off,
}


class _Body(BaseModel):
    """What both generation endpoints share."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="ignore")

    model: Annotated[str, _utf8_field("model")] | None = None
    n: int = Field(default=1, ge=1, le=MAX_CHOICES)
    best_of: int | None = None
    # Checked as given: chat has two names for it and uses the newer, so SamplingParams may not see this one.
    max_tokens: int | None = Field(default=None, ge=1)
    # The sampling fields: JSON types here, ranges in SamplingParams (null is its default; top_k -1 is off).
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    stop: Any = None
    stop_token_ids: list[int] | None = Field(default=None, max_length=MAX_STOP_STRINGS)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    stream: bool = False
    stream_options: _StreamOptions | None = None
    cache_salt: Annotated[str, Field(min_length=1), _utf8_field("cache_salt")] | None = None
    user: Annotated[str, _utf8_field("user")] | None = None
    response_format: ResponseFormat | None = None

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            raise bad_request(f"the request body must be a JSON object, got {type(data).__name__}", "body")
        for name, harmless in UNSUPPORTED.items():
            if name in cls.model_fields:  # this body reads it (chat's tools): checked as its field
                continue
            if name in data and not harmless(data[name]):
                raise bad_request(
                    f"'{name}' is not supported by this server (got {data[name]!r})", name, "unsupported_parameter"
                )
        return data

    @field_validator("stop", mode="after")
    @classmethod
    def _stop(cls, stop: Any) -> tuple[str, ...]:
        if stop is None:
            return ()
        strings = [stop] if isinstance(stop, str) else stop
        if not isinstance(strings, list) or not all(isinstance(s, str) for s in strings):
            raise bad_request(f"'stop' must be a string or a list of strings, got {stop!r}", "stop")
        if len(strings) > MAX_STOP_STRINGS:
            raise bad_request(f"'stop' holds {len(strings)} strings; at most {MAX_STOP_STRINGS} are allowed", "stop")
        for s in strings:
            if len(s) > MAX_STOP_CHARS:
                raise bad_request(f"a 'stop' string has {len(s)} characters; at most {MAX_STOP_CHARS}", "stop")
            utf8(s, "stop")
        return tuple(s for s in strings if s)  # an empty stop string stops nothing

    @model_validator(mode="after")
    def _relations(self) -> _Body:
        if self.best_of is not None and self.best_of != self.n:
            raise bad_request(
                f"'best_of' ({self.best_of}) other than 'n' ({self.n}) is not supported by this server: it would "
                "rank more sequences than it returns",
                "best_of",
                "unsupported_value",
            )
        if self.stream_options is not None and not self.stream:
            raise bad_request("'stream_options' is only allowed with 'stream': true", "stream_options")
        return self


class _JSONSchema(BaseModel):
    """``response_format.json_schema``: OpenAI's (and vLLM's) shape; the schema is checked by the engine."""

    model_config = ConfigDict(strict=True, extra="ignore", populate_by_name=True)

    name: Annotated[str, Field(min_length=1, max_length=64), _utf8_field("response_format.json_schema.name")]
    description: str | None = None
    # "schema" would shadow pydantic's BaseModel.schema
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """``response_format``: ``text`` (the default), ``json_object`` or ``json_schema``."""

    model_config = ConfigDict(strict=True, extra="ignore")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: _JSONSchema | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise bad_request(
                "'response_format.json_schema' is required with type 'json_schema'", "response_format.json_schema"
            )
        if self.type != "json_schema" and self.json_schema is not None:
            raise bad_request(
                f"'response_format.json_schema' is only allowed with type 'json_schema', not {self.type!r}",
                "response_format.json_schema",
            )
        return self


class _StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    include_usage: bool = False
    continuous_usage_stats: Literal[False] = False


class CompletionBody(_Body):
    """``POST /v1/completions``."""

    prompt: Any = Field(default=None, validate_default=True)
    max_tokens: int | None = Field(default=COMPLETION_MAX_TOKENS, ge=1)
    echo: bool = False
    logprobs: int | None = None

    @field_validator("max_tokens", mode="before")
    @classmethod
    def _default_max_tokens(cls, max_tokens: Any) -> Any:
        """Null is the default, as left out: :data:`COMPLETION_MAX_TOKENS`."""
        return COMPLETION_MAX_TOKENS if max_tokens is None else max_tokens

    @field_validator("prompt", mode="after")
    @classmethod
    def _prompt(cls, prompt: Any) -> tuple[str | tuple[int, ...], ...]:
        """One prompt or several: text, or token IDs (non-empty, each >= 0)."""
        if prompt is None:
            raise bad_request("'prompt' is required", "prompt", "missing_required_parameter")
        if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt)):
            prompts = [prompt]
        elif isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
            prompts = prompt
        else:
            raise bad_request(
                f"'prompt' must be a string, a list of token IDs, or a non-empty list of either; got {_short(prompt)}",
                "prompt",
            )
        checked: list[str | tuple[int, ...]] = []
        for i, one in enumerate(prompts):
            where = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
            if isinstance(one, str):
                if not one:
                    raise bad_request(f"'{where}' is empty", where)
                checked.append(utf8(one, where))
            elif one and all(_is_int(t) for t in one):
                if any(t < 0 for t in one):
                    raise bad_request(f"'{where}' token IDs must be >= 0", where)
                checked.append(tuple(one))
            else:
                raise bad_request(f"'{where}' must be a string or a non-empty list of token IDs", where)
        return tuple(checked)

    @model_validator(mode="after")
    def _choices(self) -> CompletionBody:
        prompts: tuple[Any, ...] = self.prompt
        if len(prompts) * self.n > MAX_CHOICES:
            raise bad_request(
                f"{len(prompts)} prompts x n={self.n} asks for {len(prompts) * self.n} sequences; at most "
                f"{MAX_CHOICES} per request",
                "n",
            )
        if self.echo and self.logprobs is not None:
            raise bad_request(
                "'logprobs' with 'echo' needs the prompt's logprobs, which this server does not compute",
                "echo",
                "unsupported_value",
            )
        return self


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


class Message(BaseModel):
    """One chat message: text content (a string or text parts; none for an assistant turn)."""

    model_config = ConfigDict(strict=True, extra="ignore")

    role: Literal["system", "developer", "user", "assistant"]
    content: Any = None
    name: str | None = None

    @field_validator("content", mode="after")
    @classmethod
    def _content(cls, content: Any) -> str | None:
        """Text parts joined into one string (only text is served)."""
        if content is None or isinstance(content, str):
            return content
        if isinstance(content, list) and all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
        ):
            return "".join(p["text"] for p in content)
        raise ValueError("content: only a string or a list of text parts is supported")

    def text(self) -> str | None:
        content: str | None = self.content
        return content


class ChatBody(_Body):
    """``POST /v1/chat/completions``."""

    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: Literal[True] = True
    echo: Literal[False] = False
    #: Read so that the server can say why it refuses them (:func:`kvpool.serve.generation.check_tools`).
    tools: list[dict[str, Any]] | None = None

    @model_validator(mode="after")
    def _checks(self) -> ChatBody:
        for i, message in enumerate(self.messages):
            text = message.text()
            if text is None and message.role != "assistant":
                raise bad_request(
                    f"messages[{i}].content must be a string or a list of text parts", f"messages[{i}].content"
                )
            utf8(text or "", f"messages[{i}].content")
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        if self.n > MAX_CHOICES:
            raise bad_request(f"'n' must be <= {MAX_CHOICES}, got {self.n}", "n")
        return self


_Body.model_rebuild()
CompletionBody.model_rebuild()
ChatBody.model_rebuild()
