"""Structured output: a request's grammar, and the matcher that keeps its tokens inside it.

A request asks for JSON with a :class:`StructuredOutput` in its
:class:`~kvpool.engine.sampling.SamplingParams`: ``json_object`` (any JSON
object) or ``json_schema`` (a document the given JSON Schema accepts). The
grammar is served by `llguidance <https://github.com/guidance-ai/llguidance>`_
(the ``structured`` extra): it has no dependencies of its own, compiles a
schema in a few milliseconds (the engine thread compiles at admission, so a
slow compile would stall every running request) and never raises for a bad
grammar or token, which leaves its matcher in an error state the engine turns
into that request's failure alone. ``benchmarks/bench_structured.py`` measures
it against xgrammar on SmolLM2's vocabulary.

The spec is checked when it is made: a schema llguidance cannot compile is a
:class:`~kvpool.errors.ConfigError` naming ``structured`` (the server answers
400 naming ``response_format``). The engine then gives each request its own
:class:`GrammarMatcher` (:meth:`GrammarCompiler.matcher`): each step it says
which tokens may come next (the sampler sets the others' logits to ``-inf``,
greedy and sampled rows alike), it advances with each accepted token, and once
the grammar is complete the request ends (``finish_reason`` ``stop``).

JSON is written with the separators ``json.dumps`` uses (``", "`` and
``": "``) and no other whitespace: a small model given free whitespace can spend
its whole budget on newlines.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch

from kvpool.errors import ConfigError

__all__ = ["JSON_OBJECT", "JSON_SCHEMA", "GrammarCompiler", "GrammarMatcher", "StructuredOutput"]

#: Any JSON object.
JSON_OBJECT = "json_object"
#: A JSON document that a given JSON Schema accepts.
JSON_SCHEMA = "json_schema"
_KINDS = (JSON_OBJECT, JSON_SCHEMA)

#: How the JSON is written: ``json.dumps``' separators, no free whitespace.
_JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

#: Compiled grammars kept per engine (fresh matchers, copied for each request that asks the same).
_CACHED_GRAMMARS = 64


def _llguidance() -> ModuleType:
    try:
        import llguidance
    except ImportError:
        raise ConfigError("structured output needs the llguidance package: pip install 'kvpool[structured]'") from None
    return llguidance


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    """What a request's output must be (see the module docstring).

    Attributes:
        kind: :data:`JSON_OBJECT` or :data:`JSON_SCHEMA`.
        schema: for :data:`JSON_SCHEMA`, the schema as JSON text (an object, or
            ``true``); None for :data:`JSON_OBJECT`.
    """

    kind: str
    schema: str | None = None
    _grammar: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ConfigError(f"structured.kind must be one of {', '.join(_KINDS)}, got {self.kind!r}")
        if self.kind == JSON_OBJECT:
            if self.schema is not None:
                raise ConfigError(f"structured.schema must be None for {JSON_OBJECT}, got {self.schema!r}")
            schema: Any = {"type": "object"}
        else:
            if not isinstance(self.schema, str):
                raise ConfigError(f"structured.schema must be JSON text for {JSON_SCHEMA}, got {self.schema!r}")
            try:
                schema = json.loads(self.schema)
            except ValueError as exc:
                raise ConfigError(f"structured.schema is not valid JSON: {exc}") from None
            if not isinstance(schema, dict) and schema is not True:
                raise ConfigError(f"structured.schema must be a JSON object (a JSON Schema), got {self.schema!r}")
        matcher = _llguidance().LLMatcher
        try:
            grammar = matcher.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS)
        except ValueError as exc:
            raise ConfigError(f"structured.schema cannot be compiled: {exc}") from None
        problem = matcher.validate_grammar(grammar)
        if problem:
            raise ConfigError(f"structured.schema cannot be compiled: {problem}")
        object.__setattr__(self, "_grammar", grammar)

    @classmethod
    def json_schema(cls, schema: object) -> StructuredOutput:
        """A :data:`JSON_SCHEMA` spec from a schema given as a dict (or as JSON text)."""
        if isinstance(schema, str):
            return cls(JSON_SCHEMA, schema)
        try:
            text = json.dumps(schema, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"structured.schema must be JSON, got {schema!r}: {exc}") from None
        return cls(JSON_SCHEMA, text)

    @property
    def grammar(self) -> str:
        """The grammar llguidance compiles (checked when the spec was made)."""
        return self._grammar


class GrammarMatcher:
    """One request's place in its grammar: the tokens allowed next, advanced token by token."""

    __slots__ = ("_matcher", "_vocab")

    def __init__(self, matcher: Any, vocab_size: int) -> None:
        self._matcher = matcher
        self._vocab = vocab_size

    def allowed(self) -> torch.Tensor:
        """A ``[vocab_size]`` bool tensor: True for each token the grammar allows next."""
        bias = torch.frombuffer(bytearray(self._matcher.compute_logit_bias()), dtype=torch.uint8)
        allowed = bias != 0
        if allowed.numel() < self._vocab:  # tokens the tokenizer does not know: never allowed
            allowed = torch.cat([allowed, torch.zeros(self._vocab - allowed.numel(), dtype=torch.bool)])
        return allowed[: self._vocab]

    def accept(self, token_id: int) -> str | None:
        """Advance past ``token_id``; None, or why the grammar does not accept it (the matcher is then spent)."""
        if self._matcher.consume_token(token_id):
            return None
        return str(self._matcher.get_error() or f"token {token_id} is not allowed here")

    @property
    def done(self) -> bool:
        """True once the grammar is complete: nothing more may follow."""
        return bool(self._matcher.is_stopped())

    def copy(self) -> GrammarMatcher:
        """A matcher in the same place, advancing on its own."""
        return GrammarMatcher(self._matcher.deep_copy(), self._vocab)


class GrammarCompiler:
    """An engine's grammars: llguidance's view of its tokenizer (built at the first use, once) and a
    few compiled grammars, so that the ``n`` sequences of a request, or requests asking the same, compile once.

    Args:
        tokenizer: the engine's Hugging Face tokenizer (a fast one), or None.
        vocab_size: the width of the model's logits.
        eos_token_ids: the model's end tokens; the first ends a complete grammar.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self._tokenizer = tokenizer
        self._vocab = vocab_size
        self._eos = list(eos_token_ids)
        self._ll_tokenizer: Any = None
        self._fresh: OrderedDict[StructuredOutput, GrammarMatcher] = OrderedDict()

    def _view(self) -> Any:
        if self._ll_tokenizer is None:
            if self._tokenizer is None:
                raise ConfigError("structured output needs the model's tokenizer; this model has none")
            _llguidance()  # installed, or a ConfigError naming the extra
            from llguidance.hf import from_tokenizer

            eos = self._eos[0] if self._eos else None
            try:
                self._ll_tokenizer = from_tokenizer(self._tokenizer, n_vocab=self._vocab, eos_token=eos)
            except ValueError as exc:
                raise ConfigError(f"structured output cannot use this model's tokenizer: {exc}") from None
        return self._ll_tokenizer

    def matcher(self, spec: StructuredOutput) -> GrammarMatcher:
        """A fresh matcher of ``spec``'s grammar; ConfigError if it cannot be compiled for this tokenizer."""
        if not isinstance(spec, StructuredOutput):
            raise ConfigError(f"structured must be a StructuredOutput, got {spec!r}")
        fresh = self._fresh.get(spec)
        if fresh is None:
            matcher = _llguidance().LLMatcher(self._view(), spec.grammar, log_level=0)
            if matcher.is_error():
                raise ConfigError(f"structured.schema cannot be compiled: {matcher.get_error()}")
            fresh = GrammarMatcher(matcher, self._vocab)
            self._fresh[spec] = fresh
            if len(self._fresh) > _CACHED_GRAMMARS:
                self._fresh.popitem(last=False)
        else:
            self._fresh.move_to_end(spec)
        return fresh.copy()
