"""The sampler that turns logits into next tokens, each row as its request's :class:`SamplingParams` asks.

:class:`SamplingParams` (with :data:`GREEDY_BELOW` and :data:`MAX_LOGPROBS`) lives,
torch-free, in :mod:`kvpool.sampling_params` and is re-exported here.

A row is first masked and penalised where its request asks (a structured
output's grammar keeps the tokens it does not allow at ``-inf``, before
anything else reads the row, its log-probabilities too, as in vLLM; ``min_tokens``
keeps EOS and the stop tokens at ``-inf``; presence, frequency and repetition
penalties follow :mod:`~kvpool.engine.penalties`), in vLLM's order.
Greedy decoding is then an argmax and needs no randomness. A temperature below
:data:`GREEDY_BELOW` (``1e-5``, the cut vLLM uses) is greedy too: dividing
logits by a temperature that small overflows float32 (``1e-300`` makes every
logit infinite and the softmax NaN), and the distribution it would describe is
an argmax anyway. Otherwise the logits are divided by the temperature, cut to
the tokens at least ``min_p`` times as likely as the most likely one, to
the ``top_k`` most likely tokens and then to the smallest set whose
probability reaches ``top_p``, and one token is drawn with the request's own
:class:`torch.Generator`. A request with a ``seed`` therefore draws the same
tokens on every run, whatever else is in the batch.

Each row is sampled on its own terms: a row with nothing to draw from (NaN
logits, every logit ``-inf``, or probabilities that are not finite or sum to
zero after the filters) is not sampled; :func:`sample_tokens` hands back a
:class:`SamplingFailure` naming why in that row's place and samples the other
rows as usual, so one request's bad numbers fail that request alone.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvpool.engine.logprobs import token_logprobs
from kvpool.engine.outputs import TokenLogprobs
from kvpool.engine.penalties import apply_penalties
from kvpool.errors import ConfigError
from kvpool.sampling_params import GREEDY_BELOW, MAX_LOGPROBS, SamplingParams

__all__ = [
    "GREEDY_BELOW",
    "MAX_LOGPROBS",
    "RowContext",
    "SampledToken",
    "SamplingFailure",
    "SamplingParams",
    "make_generator",
    "sample_rows",
    "sample_tokens",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class SamplingFailure:
    """A row :func:`sample_tokens` could not sample, and why (its request fails; the others go on)."""

    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class RowContext:
    """What a row's penalties and ``min_tokens`` need to know of its request.

    Attributes:
        prompt_token_ids: The prompt (for the repetition penalty).
        output_token_ids: The tokens generated so far.
        end_token_ids: The tokens masked (logit ``-inf``) while fewer than
            ``min_tokens`` tokens were generated: EOS and the stop tokens.
        allowed_tokens: ``[V]`` bool, True for each token the request's grammar
            allows next (the others are masked first); None when unconstrained.
    """

    prompt_token_ids: Sequence[int] = ()
    output_token_ids: Sequence[int] = ()
    end_token_ids: Sequence[int] = ()
    allowed_tokens: torch.Tensor | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class SampledToken:
    """One row's token and, when its request asked for them, its log-probabilities."""

    token_id: int
    logprobs: TokenLogprobs | None = None


def make_generator(params: SamplingParams, device: torch.device | str = "cpu") -> torch.Generator | None:
    """The random source of one request: None when greedy, else seeded from ``params.seed``.

    Create it once per request and pass it to every :func:`sample_tokens` call
    for that request, so its draws form one reproducible stream.
    """
    if params.greedy:
        return None
    seed = params.seed if params.seed is not None else secrets.randbits(63)
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


def _processed_row(logits: torch.Tensor, params: SamplingParams, context: RowContext | None) -> torch.Tensor | None:
    """The row after the ``min_tokens`` mask and the penalties, or None when neither applies."""
    if context is None:
        return None
    blocking = params.min_tokens > len(context.output_token_ids) and len(context.end_token_ids) > 0
    if not blocking and not params.has_penalties:
        return None
    row = logits.float().clone()
    if blocking:
        vocab = row.shape[-1]
        ends = [t for t in context.end_token_ids if t < vocab]
        row[ends] = float("-inf")
    if params.has_penalties:
        row = apply_penalties(
            row,
            context.prompt_token_ids,
            context.output_token_ids,
            presence=params.presence_penalty,
            frequency=params.frequency_penalty,
            repetition=params.repetition_penalty,
        )
    return row


def _filtered_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """``[V]`` logits -> ``[V]`` float32 probabilities after temperature, min-p, top-k, top-p (vLLM's order)."""
    scaled = logits.float() / params.temperature
    vocab = scaled.shape[-1]
    if params.min_p > 0.0:
        probs = torch.softmax(scaled, dim=-1)
        # Relative to the most likely token, so the most likely token always stays.
        scaled = scaled.masked_fill(probs < params.min_p * probs.max(), float("-inf"))
    if 0 < params.top_k < vocab:
        kth = torch.topk(scaled, params.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(scaled, descending=True)
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        # Mass strictly before each token: a token stays if the tokens ranked above
        # it have not reached top_p yet, so the most likely token always stays.
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        drop_sorted = mass_before >= params.top_p
        # Spelled out, not left to the arithmetic: a top_p below float32's smallest subnormal
        # compares as 0 and would drop every token.
        drop_sorted[0] = False
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        scaled = scaled.masked_fill(drop, float("-inf"))
    return torch.softmax(scaled, dim=-1)


def _row_problem(probs: torch.Tensor) -> str | None:
    """Why ``probs`` cannot be drawn from, or None when it can."""
    if not bool(torch.isfinite(probs).all()):
        return "its probabilities are not finite (NaN or infinite logits)"
    total = float(probs.sum())
    if not total > 0:
        return "its probabilities sum to zero (every token was filtered out)"
    return None


def _logits_problem(row: torch.Tensor) -> str | None:
    """Why no token can be picked from ``row`` at all, or None."""
    if bool(torch.isnan(row).any()):
        return "its logits hold NaN"
    if bool((row == float("-inf")).all()):
        return "every logit is -inf"
    return None


def sample_rows(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    contexts: Sequence[RowContext | None] | None = None,
) -> list[SampledToken | SamplingFailure]:
    """Pick one token per row, with its log-probabilities where asked; a row that cannot be sampled fails alone.

    Each row goes through, in vLLM's order: its grammar's mask (the tokens its
    ``allowed_tokens`` leaves out at ``-inf``, as though the model gave them so:
    the log-probabilities see it too), the ``min_tokens`` mask (EOS and
    stop tokens at ``-inf`` while too few tokens were generated), the
    penalties (:mod:`~kvpool.engine.penalties`), then either an argmax
    (greedy) or temperature, min-p, top-k, top-p and one draw from the row's
    generator. The mask and the penalties need the row's :class:`RowContext`;
    a row without one (or ``contexts`` None) skips them. Log-probabilities
    (:mod:`~kvpool.engine.logprobs`) are of the raw row and are computed only
    for rows whose ``params.logprobs`` is not None.

    Args:
        logits: ``[N, V]`` next-token logits (any float dtype), one row per request.
        params: ``N`` sampling settings, row for row.
        generators: ``N`` generators from :func:`make_generator` (None for greedy rows).
        contexts: ``N`` row contexts (None for a row that needs none), or None.

    Returns:
        ``N`` entries, row for row: a :class:`SampledToken` with a token ID in
        ``[0, V)``, or the failure of that row alone (NaN logits, no finite
        logit, or probabilities that are not finite or sum to zero).

    Raises:
        ConfigError: the argument lengths disagree, or a sampled row has no generator
            (a caller's mistake, refused before any row is sampled).
    """
    rows = contexts if contexts is not None else [None] * len(params)
    if (
        logits.dim() != 2
        or logits.shape[0] != len(params)
        or len(params) != len(generators)
        or len(rows) != len(params)
    ):
        raise ConfigError(
            f"need logits [N, V] with N == len(params) == len(generators) == len(contexts); got logits "
            f"{tuple(logits.shape)}, {len(params)} params, {len(generators)} generators, {len(rows)} contexts"
        )
    for row, (p, generator) in enumerate(zip(params, generators)):
        if not p.greedy and generator is None:
            raise ConfigError(f"row {row} samples with temperature {p.temperature} but has no generator")
    logits = _grammar_masked(logits, rows)
    # Rows left as the model gave them share one batched argmax and problem check.
    has_nan = torch.isnan(logits).any(dim=-1).tolist()
    no_token = (logits == float("-inf")).all(dim=-1).tolist()
    argmax = logits.argmax(dim=-1).tolist()
    out: list[SampledToken | SamplingFailure] = []
    for i, (p, generator, context) in enumerate(zip(params, generators, rows)):
        processed = _processed_row(logits[i], p, context)
        choice: int | SamplingFailure
        if processed is None:
            if has_nan[i]:
                choice = SamplingFailure(reason="its logits hold NaN")
            elif no_token[i]:
                choice = SamplingFailure(reason="every logit is -inf")
            else:
                choice = int(argmax[i]) if p.greedy else _draw(logits[i], p, generator)
        else:
            problem = _logits_problem(processed)
            if problem is not None:
                choice = SamplingFailure(reason=f"{problem} after its penalties and min_tokens mask")
            else:
                choice = int(processed.argmax()) if p.greedy else _draw(processed, p, generator)
        if isinstance(choice, SamplingFailure):
            out.append(choice)
        elif p.logprobs is None:
            out.append(SampledToken(token_id=choice))
        else:
            out.append(SampledToken(token_id=choice, logprobs=token_logprobs(logits[i], choice, p.logprobs)))
    return out


def _grammar_masked(logits: torch.Tensor, rows: Sequence[RowContext | None]) -> torch.Tensor:
    """``logits`` with each constrained row's disallowed tokens at ``-inf`` (a copy; the same tensor if none is)."""
    constrained = [(i, c.allowed_tokens) for i, c in enumerate(rows) if c is not None and c.allowed_tokens is not None]
    if not constrained:
        return logits
    masked = logits.clone()
    for i, allowed in constrained:
        if allowed.shape != (logits.shape[-1],):
            raise ConfigError(f"row {i}: allowed_tokens has shape {tuple(allowed.shape)}, not [{logits.shape[-1]}]")
        masked[i].masked_fill_(~allowed.to(device=logits.device, dtype=torch.bool), float("-inf"))
    return masked


def sample_tokens(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    contexts: Sequence[RowContext | None] | None = None,
) -> list[int | SamplingFailure]:
    """:func:`sample_rows` without the log-probabilities: a token ID or a :class:`SamplingFailure` per row."""
    return [
        row if isinstance(row, SamplingFailure) else row.token_id
        for row in sample_rows(logits, params, generators, contexts)
    ]


def _draw(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int | SamplingFailure:
    """One token drawn from one row's filtered distribution, or why it cannot be."""
    assert generator is not None  # sample_tokens checked every sampled row has one
    probs = _filtered_probs(logits, params)
    problem = _row_problem(probs)
    if problem is not None:
        return SamplingFailure(reason=f"{problem} at temperature {params.temperature!r}")
    # multinomial on the generator's device keeps the stream independent of the batch.
    return int(torch.multinomial(probs.to(generator.device), 1, generator=generator))
