"""The engine's side of a request it serves: its sampling state and the text it has shown.

A :class:`LiveRequest` holds what the step loop needs beyond the scheduler's
record: the request's :class:`~kvpool.engine.sampling.SamplingParams` and
generator, the :class:`~kvpool.engine.sampling.RowContext` its penalties and
``min_tokens`` mask need, the log-probabilities gathered so far, and its
text: the incremental detokenizer and, when it has stop strings, their
:class:`~kvpool.engine.stop_strings.StopStrings` matcher; and, for a
structured output, its :class:`~kvpool.engine.structured.GrammarMatcher`.

What its ``text`` holds, as vLLM shows it: the text of every output token,
except the text of the stop token or EOS that ended it (kept with
``include_stop_str_in_output``), cut before a stop string that ended it (or
after it, with ``include_stop_str_in_output``). A request its complete grammar
ended keeps all of its text: its last token is part of the document.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kvpool.engine.outputs import IncrementalDetokenizer, TokenLogprobs
from kvpool.engine.sampling import RowContext, SamplingParams, make_generator
from kvpool.engine.stop_strings import StopStrings
from kvpool.engine.structured import GrammarMatcher
from kvpool.request import Request

__all__ = ["LiveRequest"]


class LiveRequest:
    """One queued or running request's engine state (see the module docstring)."""

    __slots__ = (
        "params",
        "generator",
        "prompt",
        "logprobs",
        "grammar",
        "_end_token_ids",
        "_tokenizer",
        "_detok",
        "_stops",
    )

    def __init__(
        self,
        params: SamplingParams,
        prompt: str | None,
        tokenizer: Any,
        end_token_ids: Sequence[int],
        grammar: GrammarMatcher | None = None,
    ) -> None:
        self.params = params
        #: The request's place in its structured output's grammar, or None.
        self.grammar = grammar
        self.generator: torch.Generator | None = make_generator(params, "cpu")
        self.prompt = prompt
        #: One entry per output token, when the request asked for log-probabilities.
        self.logprobs: list[TokenLogprobs] | None = None if params.logprobs is None else []
        # What min_tokens masks: EOS (even with ignore_eos, as vLLM) and the stop tokens.
        self._end_token_ids = tuple(sorted(set(end_token_ids) | set(params.stop_token_ids)))
        self._tokenizer = tokenizer
        self._detok = IncrementalDetokenizer(tokenizer) if tokenizer is not None else None
        self._stops = (
            StopStrings(params.stop, include_in_output=params.include_stop_str_in_output, min_tokens=params.min_tokens)
            if params.stop and tokenizer is not None
            else None
        )

    def row_context(self, request: Request) -> RowContext | None:
        """What the sampler's penalties and min_tokens mask need, or None when the row needs neither."""
        p = self.params
        if self.grammar is None and not p.has_penalties and p.min_tokens <= request.num_output_tokens:
            return None
        return RowContext(
            prompt_token_ids=request.prompt_token_ids,
            output_token_ids=request.output_token_ids,
            end_token_ids=self._end_token_ids,
            allowed_tokens=None if self.grammar is None else self.grammar.allowed(),
        )

    def take(self, token: int, logprobs: TokenLogprobs | None, num_output_tokens: int, *, ended: bool) -> str:
        """Record an output token; return the text that may be shown for it now.

        ``ended`` says the token ended the request as a stop token or EOS: its
        text is then left out unless ``include_stop_str_in_output``.
        """
        if self.logprobs is not None and logprobs is not None:
            self.logprobs.append(logprobs)
        if self._detok is None or (ended and not self.params.include_stop_str_in_output):
            return ""
        piece = self._detok.push(token)
        if self._stops is None:
            return piece
        return self._stops.add(piece, num_output_tokens)

    @property
    def grammar_done(self) -> bool:
        """True once the request's grammar is complete (its output is a whole document)."""
        return self.grammar is not None and self.grammar.done

    @property
    def stop_string(self) -> str | None:
        """The stop string that ended the text, once one did."""
        return None if self._stops is None else self._stops.matched

    def flush(self) -> str:
        """The text held back so far (a character still incomplete, a possible stop string)."""
        if self._detok is None:
            return ""
        rest = self._detok.flush()
        if self._stops is None:
            return rest
        if self._stops.matched is None:
            self._stops.add(rest, 0)  # counts as no new token: the request is over, nothing more matches
        return self._stops.flush()

    def final_text(self, output_token_ids: Sequence[int], *, ended: bool) -> str:
        """The whole text of a finished request (see the module docstring)."""
        if self._tokenizer is None:
            return ""
        if self._stops is not None:
            return self._stops.text
        ids = list(output_token_ids)
        if ended and ids and not self.params.include_stop_str_in_output:
            ids.pop()
        text: str = self._tokenizer.decode(ids, skip_special_tokens=True)
        return text
