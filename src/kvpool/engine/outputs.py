"""What the engine hands back: finished requests, streamed deltas, and their log lines.

Nothing here imports torch; a tokenizer is any object with a Hugging Face
style ``decode(ids, skip_special_tokens=...)``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, cast

from kvpool.errors import RequestFailed
from kvpool.scheduler import FinishReason, RequestMetrics

__all__ = [
    "IncrementalDetokenizer",
    "RequestDelta",
    "RequestOutput",
    "TokenLogprobs",
    "prompt_tokens_computed",
    "request_log_line",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class TokenLogprobs:
    """The log-probabilities of one generated token.

    They are those of the model's own distribution at that step (a
    log-softmax of the raw logits, before penalties, temperature and the
    top-k/top-p/min-p cuts), as vLLM returns them by default. ``top`` holds
    the ``logprobs`` most likely ``(token_id, logprob)`` pairs, best first
    (it may or may not include ``token_id``).
    """

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestOutput:
    """A finished request.

    Times are seconds from the request's arrival (``add_request``):
    ``queue_time`` until first scheduled, ``time_to_first_token`` until its
    first output token was sampled, ``latency`` until it finished.
    ``num_cached_tokens`` counts prompt tokens served by the prefix cache (all
    admissions, so a preempted request that hits its own blocks counts them
    again); ``cached_tokens_by_tier`` splits them by source, ``"gpu"`` (the
    pool) and each KV tier (``"cpu"``, ``"disk"``, ``"redis"``);
    ``num_computed_tokens`` counts tokens fed to the model for it,
    recomputation included. A request that failed while served has
    ``finish_reason`` ``ERROR`` and its :class:`~kvpool.errors.RequestFailed`
    in ``error`` (None otherwise); its output holds the tokens it got before.

    ``stop_reason`` is the stop token ID or stop string that ended it (None
    when it ended on EOS, length, abort or error). A stop string is cut from
    ``text`` (kept with ``include_stop_str_in_output``), and so is the text of
    a stop token or EOS; ``output_token_ids`` keeps every token generated.
    ``logprobs`` holds one :class:`TokenLogprobs` per output token when the
    request asked for them (``SamplingParams.logprobs``), else None.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: tuple[int, ...]
    output_token_ids: tuple[int, ...]
    text: str
    finish_reason: FinishReason
    num_cached_tokens: int
    num_computed_tokens: int
    time_to_first_token: float | None
    queue_time: float | None
    latency: float | None
    num_preemptions: int
    cached_tokens_by_tier: Mapping[str, int] = field(default_factory=dict)
    error: RequestFailed | None = None
    stop_reason: int | str | None = None
    logprobs: tuple[TokenLogprobs, ...] | None = None

    @classmethod
    def from_metrics(
        cls,
        metrics: RequestMetrics,
        *,
        prompt: str | None,
        prompt_token_ids: tuple[int, ...],
        output_token_ids: tuple[int, ...],
        text: str,
        error: RequestFailed | None = None,
        stop_reason: int | str | None = None,
        logprobs: tuple[TokenLogprobs, ...] | None = None,
    ) -> RequestOutput:
        """A finished request's output, its counts and times read from the scheduler's ``metrics``."""
        finished_at = metrics.finish_time
        return cls(
            request_id=metrics.request_id,
            prompt=prompt,
            prompt_token_ids=prompt_token_ids,
            output_token_ids=output_token_ids,
            text=text,
            finish_reason=cast(FinishReason, metrics.finish_reason),  # a finished request has its reason
            num_cached_tokens=metrics.num_cached_tokens,
            cached_tokens_by_tier=dict(metrics.cached_tokens_by_tier),
            num_computed_tokens=metrics.num_computed_tokens,
            time_to_first_token=metrics.time_to_first_token,
            queue_time=metrics.queue_time,
            latency=None if finished_at is None else finished_at - metrics.arrival_time,
            num_preemptions=metrics.num_preemptions,
            error=error,
            stop_reason=stop_reason,
            logprobs=logprobs,
        )

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def tokens_per_second(self) -> float | None:
        """Output tokens over the request's whole latency (None if it took no measurable time)."""
        if not self.latency:
            return None
        return self.num_output_tokens / self.latency


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestDelta:
    """What one engine step produced for one request.

    ``text`` is the newly decodable text (possibly empty while a multi-byte
    character is incomplete); ``output`` is set on the step that finished it.
    A request that failed gets a finished delta with no token and
    ``output.error`` set. ``text`` never holds text that a stop string later
    removes: text that could still grow into a stop string is held back until
    it cannot (or the request finishes). ``logprobs`` holds one
    :class:`TokenLogprobs` per token of ``token_ids`` when the request asked
    for them, else None.
    """

    request_id: str
    token_ids: tuple[int, ...]
    text: str
    finished: bool
    output: RequestOutput | None = None
    logprobs: tuple[TokenLogprobs, ...] | None = None


class IncrementalDetokenizer:
    """Turns a growing list of token IDs into text pieces as they become final.

    Each new token is decoded together with the tokens since the last piece
    handed out (so a tokenizer that merges or spaces tokens sees their
    context) and the text beyond what those tokens alone decode to is the new
    piece. While that text ends in U+FFFD, a character whose bytes are still
    arriving, nothing is handed out. Each push decodes a few tokens, not the
    whole output.
    """

    __slots__ = ("_tokenizer", "_ids", "_prefix_offset", "_read_offset")

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._ids: list[int] = []
        self._prefix_offset = 0  # start of the tokens decoded for context
        self._read_offset = 0  # end of the tokens whose text was handed out

    def _decode(self, ids: list[int]) -> str:
        text: str = self._tokenizer.decode(ids, skip_special_tokens=True)
        return text

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes (maybe empty)."""
        self._ids.append(token_id)
        return self._advance(final=False)

    def flush(self) -> str:
        """The rest of the text, even if it ends in an incomplete character."""
        return self._advance(final=True)

    def _advance(self, *, final: bool) -> str:
        ids = self._ids
        before = self._decode(ids[self._prefix_offset : self._read_offset])
        after = self._decode(ids[self._prefix_offset :])
        if len(after) <= len(before) or not after.startswith(before) or (after.endswith("\ufffd") and not final):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(ids)
        return after[len(before) :]


def _by_tier(output: RequestOutput) -> str:
    """``": 32 gpu, 16 cpu"`` when a KV tier supplied some of the cached tokens, else nothing."""
    shares = {tier: n for tier, n in output.cached_tokens_by_tier.items() if n}
    if not shares or set(shares) == {"gpu"}:
        return ""
    return ": " + ", ".join(f"{n} {tier}" for tier, n in shares.items())


def prompt_tokens_computed(output: RequestOutput) -> int:
    """Tokens the model ran as prompt (prefill) for ``output``, recomputation after a preemption included.

    Of the tokens fed to the model (``num_computed_tokens``) the decode steps fed
    every output token but the last; the rest were prefill.
    """
    return max(0, output.num_computed_tokens - max(0, output.num_output_tokens - 1))


def request_log_line(output: RequestOutput) -> str:
    """One line of figures per finished request, for a serving log.

    ``40 prompt tokens (32 cached, 8 computed), 4 output tokens``: of the prompt,
    how many came from the cache and how many the model ran
    (:func:`prompt_tokens_computed`: after a preemption, recomputation makes this
    more than the rest of the prompt), then the tokens generated.
    """
    ttft = "-" if output.time_to_first_token is None else f"{output.time_to_first_token * 1000:.0f} ms"
    rate = output.tokens_per_second
    tiers = _by_tier(output)
    return (
        f"request {output.request_id}: {output.num_prompt_tokens} prompt tokens ({output.num_cached_tokens} "
        f"cached{tiers}{'; ' if tiers else ', '}{prompt_tokens_computed(output)} computed), "
        f"{output.num_output_tokens} output tokens; time to first token {ttft}; "
        f"{'-' if rate is None else f'{rate:.1f}'} tokens/s; finished: {output.finish_reason.value}"
        + (f"; preempted {output.num_preemptions}x" if output.num_preemptions else "")
        + ("" if output.error is None else f" ({output.error.cause})")
    )
