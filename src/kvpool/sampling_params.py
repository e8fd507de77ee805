"""A request's sampling options: the one home of their fields, defaults and ranges (torch-free).

:class:`SamplingParams` says how to pick a request's next tokens and when to
stop, with vLLM's fields and meanings. Every front door builds it directly: the
offline API (:class:`~kvpool.engine.LLM`), ``kvpool generate``, and the OpenAI
layer (:mod:`kvpool.openai_http.protocol`) from a request body, which turns a
refusal into a 400 naming the field (:func:`field_at_fault`). The sampler that
reads it is the engine's (:mod:`kvpool.engine.sampling`, torch); this module
imports nothing but the checks and the errors, so the router and the OpenAI
layer use it without torch.

Every field is checked when the object is made (and again by
``dataclasses.replace``); a bad value raises a
:class:`~kvpool.errors.ConfigError` (:class:`~kvpool.errors.InvalidTokenError`
for ``stop_token_ids``) whose message begins with the field's name and carries
the value. Bounds that depend on the model (a stop token inside the vocabulary,
``max_tokens`` inside the context) are the engine's, checked when the request is
added.

``structured`` holds the engine's grammar spec
(:class:`~kvpool.engine.structured.StructuredOutput`): it is compiled with the
``structured`` extra and served by the engine, so it is named here only as a type.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

from kvpool.checks import check_int
from kvpool.errors import ConfigError, InvalidTokenError, KVPoolError

if TYPE_CHECKING:
    from kvpool.engine.structured import StructuredOutput

__all__ = ["GREEDY_BELOW", "MAX_LOGPROBS", "MAX_REPETITION", "SEED_LIMIT", "SamplingParams", "field_at_fault"]

#: Seeds are in ``[0, SEED_LIMIT)`` (vLLM's 63 bits).
SEED_LIMIT = 2**63

#: Most ``logprobs`` a request may ask for (vLLM's default ``max_logprobs``).
MAX_LOGPROBS = 20

#: Temperatures below this are greedy (an argmax): smaller ones overflow the scaled logits.
GREEDY_BELOW = 1e-5

#: The repetition penalty's bound either way: a logit divided or multiplied by more leaves float32's range.
MAX_REPETITION = 1e6

#: Token IDs are unsigned 32-bit: :data:`kvpool.hashing.TOKEN_LIMIT`, which sits a layer above this
#: module (a test pins the two equal).
_TOKEN_LIMIT = 2**32


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_flag(name: str, value: object) -> None:
    if type(value) is not bool:
        raise ConfigError(f"{name} must be a bool, got {value!r}")


def _check_number(name: str, value: object, *, low: float, high: float, low_open: bool = False) -> None:
    """Refuse anything but a finite int or float in ``[low, high]`` (``(low, high]`` when ``low_open``)."""
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value < low
        or (low_open and value == low)
        or value > high
    ):
        interval = f"{'(' if low_open else '['}{low:g}, {high:g}]"
        raise ConfigError(f"{name} must be a finite number in {interval}, got {value!r}")


def _stop_strings(stop: object) -> tuple[str, ...]:
    """``stop`` as a tuple of non-empty strings (one string alone is one stop string, as in vLLM)."""
    if isinstance(stop, str):
        stop = (stop,)
    if isinstance(stop, (bytes, bytearray)) or not isinstance(stop, Sequence):
        raise ConfigError(f"stop must be a string or a sequence of strings, got {stop!r}")
    strings = tuple(stop)
    for i, one in enumerate(strings):
        if not isinstance(one, str) or not one:
            raise ConfigError(f"stop[{i}] must be a non-empty string, got {one!r}")
    return strings


def _stop_token_ids(token_ids: object) -> tuple[int, ...]:
    """``token_ids`` as a tuple of token IDs; their order does not matter, so a set will do (a mapping will not)."""
    if isinstance(token_ids, Mapping):  # iterating a mapping would silently take its keys
        raise InvalidTokenError(f"stop_token_ids must be a sequence of token IDs, got {token_ids!r}")
    if isinstance(token_ids, (str, bytes, bytearray, memoryview)) or not isinstance(token_ids, Iterable):
        raise InvalidTokenError(
            f"stop_token_ids must be a sequence of integer token IDs, got {type(token_ids).__name__}"
        )
    ids = tuple(token_ids)
    for i, token in enumerate(ids):
        if not _is_int(token):
            raise InvalidTokenError(f"stop_token_ids[{i}] = {token!r} is not an integer token ID")
        if not 0 <= token < _TOKEN_LIMIT:
            raise InvalidTokenError(f"stop_token_ids[{i}] = {token} is out of range: token IDs must be in [0, 2**32)")
    return ids


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick a request's next tokens and when to stop (vLLM's fields and meanings).

    Every field is checked when the object is made; a bad value raises a
    :class:`~kvpool.errors.ConfigError` (or :class:`~kvpool.errors.InvalidTokenError`)
    whose message begins with the field's name (:func:`field_at_fault`).

    Attributes:
        max_tokens: Most tokens to generate (>= 1); None generates up to the end
            of the context (``max_model_len`` minus the prompt), resolved when the
            request is added.
        temperature: 0 for greedy; otherwise logits are divided by it. Below
            :data:`GREEDY_BELOW` (``1e-5``) it is greedy as well.
        top_p: Nucleus mass in (0, 1]; 1 keeps every token.
        top_k: Keep only the k most likely tokens (tokens tied with the k-th
            are kept too); 0 turns the cut off.
        seed: Seeds the request's generator, for reproducible sampling; None
            draws a fresh seed. In ``[0, 2**63)``.
        stop_token_ids: Tokens that end the request (the token is kept in
            ``output_token_ids``; its text is left out of ``text`` unless
            ``include_stop_str_in_output``). Each must be inside the model's
            vocabulary, which the engine checks when the request is added.
        ignore_eos: Keep generating past the model's end-of-sequence token.
        presence_penalty: In [-2, 2]; subtracted once from the logit of every
            token already generated (positive discourages repeats).
        frequency_penalty: In [-2, 2]; subtracted from a token's logit once per
            time it was generated.
        repetition_penalty: In [1e-6, 1e6]; a token seen in the prompt or the
            output has a positive logit divided by it and a negative one
            multiplied by it (1 turns it off). Within that range a penalised
            logit stays finite in float32 even at the lowest temperature.
        min_p: In [0, 1]; after temperature, tokens whose probability is below
            ``min_p`` times the most likely token's are dropped (0 turns it off).
        min_tokens: Tokens generated before EOS, a stop token or a stop string
            may end the request (EOS and stop tokens are masked until then);
            at most ``max_tokens``.
        stop: Strings that end the request when the generated text contains one,
            across token boundaries; ``text`` is cut before it.
        include_stop_str_in_output: Keep the stop string (or the stop token's
            text) at the end of ``text``.
        logprobs: None for no log-probabilities; k in [0, 20] for the sampled
            token's log-probability and the k most likely tokens', each step.
        structured: None, or the grammar the output must follow (JSON, a JSON
            Schema: :class:`~kvpool.engine.structured.StructuredOutput`, the
            engine's); the request ends with ``stop`` once its grammar is complete.
    """

    max_tokens: int | None = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    structured: StructuredOutput | None = None

    def __post_init__(self) -> None:
        if self.max_tokens is not None:
            check_int("max_tokens", self.max_tokens)
        if (
            isinstance(self.temperature, bool)
            or not isinstance(self.temperature, (int, float))
            or not math.isfinite(self.temperature)
            or self.temperature < 0
        ):
            raise ConfigError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ConfigError(f"top_k must be an int >= 0 (0 = off), got {self.top_k!r}")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < SEED_LIMIT):
            raise ConfigError(f"seed must be None or an int in [0, 2**63), got {self.seed!r}")
        object.__setattr__(self, "stop_token_ids", _stop_token_ids(self.stop_token_ids))
        _check_flag("ignore_eos", self.ignore_eos)
        _check_flag("include_stop_str_in_output", self.include_stop_str_in_output)
        for name in ("presence_penalty", "frequency_penalty"):
            _check_number(name, getattr(self, name), low=-2.0, high=2.0)
        _check_number("repetition_penalty", self.repetition_penalty, low=1.0 / MAX_REPETITION, high=MAX_REPETITION)
        _check_number("min_p", self.min_p, low=0.0, high=1.0)
        check_int("min_tokens", self.min_tokens, minimum=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ConfigError(f"min_tokens ({self.min_tokens}) must be at most max_tokens ({self.max_tokens})")
        object.__setattr__(self, "stop", _stop_strings(self.stop))
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ConfigError(f"logprobs must be None or an int >= 0 and <= {MAX_LOGPROBS}, got {self.logprobs!r}")
        # The spec's own type is the engine's; what this layer can see is that it carries a grammar.
        if self.structured is not None and not isinstance(getattr(self.structured, "grammar", None), str):
            raise ConfigError(f"structured must be None or a StructuredOutput, got {self.structured!r}")
        for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p"):
            object.__setattr__(self, name, float(getattr(self, name)))

    @property
    def has_penalties(self) -> bool:
        """True when a presence, frequency or repetition penalty changes the logits."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def greedy(self) -> bool:
        """True when the next token is simply the argmax (``temperature < GREEDY_BELOW``)."""
        return self.temperature < GREEDY_BELOW


_FIELDS = frozenset(f.name for f in fields(SamplingParams))
_LEADING_NAME = re.compile(r"[a-z_]+")


def field_at_fault(error: KVPoolError) -> str | None:
    """The :class:`SamplingParams` field a refusal of it names (its message begins with it), or None.

    ``stop[1] must be ...`` and ``min_tokens (20) must be at most max_tokens (10)``
    name ``stop`` and ``min_tokens``.
    """
    match = _LEADING_NAME.match(str(error))
    return match.group() if match is not None and match.group() in _FIELDS else None
