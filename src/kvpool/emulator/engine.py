"""An emulated replica: vLLM's cache decisions, block for block, with no weights; time from a cost model.

:class:`EmulatedEngine` serves behind ``kvpool serve`` as kvpool's engine does (it meets
:class:`kvpool.serve.served_engine.ServedEngine`), and each :meth:`~EmulatedEngine.step`:

1. ``scheduler.schedule()`` picks the step's chunks, as in the real engine: the real
   :class:`~kvpool.scheduler.Scheduler` over the real :class:`~kvpool.manager.KVCacheManager`
   (chunked prefill, prefix-cache hits, preemption), so which blocks are cached, hit, evicted
   and announced in KV events is what vLLM's manager would decide;
2. the step lasts what the cost profile says
   (:meth:`~kvpool.cost_model.CostProfile.step_seconds` of its prefill tokens, its decoding
   sequences and the context they read), times ``time_scale``, on the engine's
   :class:`~kvpool.emulator.clock.StepClock`; back-to-back steps are paced against deadlines, so
   the time the engine itself spends between them is absorbed, not added, while it is shorter
   than a step;
3. each chunk that reaches the end of its known tokens gets one token from
   :class:`~kvpool.emulator.output_tokens.OutputTokens`, and ``scheduler.update`` applies the
   stop conditions (``max_tokens``, ``max_model_len``, stop tokens); stop strings end a request
   by its text, as in the real engine.

The output tokens are the model's ordinary vocabulary only (no special token, so never the
EOS): a request runs to its ``max_tokens`` (or the rest of the context), a stop token or a
stop string, and finishes with ``length`` unless one of those two ended it. What is not
emulated is refused when the request is added, naming the field: ``response_format``
(structured output needs a model's distribution). ``logprobs`` are those of the draw itself
(uniform over the ordinary vocabulary).
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

from kvpool.checks import check_flag, check_int
from kvpool.emulator.clock import StepClock, WallClock
from kvpool.emulator.options import EmulatorOptions
from kvpool.emulator.output_tokens import OutputTokens, TokenDraw
from kvpool.engine.outputs import IncrementalDetokenizer, RequestDelta, RequestOutput, TokenLogprobs
from kvpool.engine.stop_strings import StopStrings
from kvpool.errors import ConfigError, InvalidTokenError, KVPoolError, RequestStateError
from kvpool.hashing import to_token_array
from kvpool.manager import KVCacheManager
from kvpool.prompts import check_conversation
from kvpool.replica_rates import ReplicaRates, StepWindow
from kvpool.request import Request
from kvpool.sampling_params import SamplingParams
from kvpool.scheduler import (
    ChunkDetail,
    FinishReason,
    RequestMetrics,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
    StopConditions,
    check_output_bound,
)
from kvpool.tokenizer_files import FolderTokenizer

__all__ = ["EmulatedEngine", "EmulatedPool", "EmulatedSetup"]

#: The cache dtype an emulated pool reports (vLLM's default: the model's own).
_CACHE_DTYPE = "auto"


@dataclass(frozen=True, slots=True, kw_only=True)
class EmulatedPool:
    """The emulated KV pool's figures, as the real engine's plan reports them (``cache_config_info``)."""

    kv_dtype: str
    num_blocks: int
    pool_block_bytes: int
    kv_cache_tokens: int
    max_concurrency: float

    @classmethod
    def of(cls, options: EmulatorOptions) -> EmulatedPool:
        blocks_per_request = -(-options.max_model_len // options.block_size)
        return cls(
            kv_dtype=_CACHE_DTYPE,
            num_blocks=options.num_blocks,
            pool_block_bytes=options.block_size * options.profile.kv_bytes_per_token,
            kv_cache_tokens=options.num_blocks * options.block_size,
            max_concurrency=options.num_blocks / blocks_per_request,
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class EmulatedSetup:
    """How the emulated engine was started: its options and its pool (the real engine's ``setup``)."""

    options: EmulatorOptions
    plan: EmulatedPool
    startup_seconds: float = 0.0


class _EmulatedText:
    """One request's draw of tokens and the text it has shown (stop strings included)."""

    __slots__ = ("params", "prompt", "draw", "logprobs", "_tokenizer", "_detok", "_stops")

    def __init__(self, params: SamplingParams, prompt: str | None, tokenizer: FolderTokenizer, draw: TokenDraw) -> None:
        self.params = params
        self.prompt = prompt
        self.draw = draw
        self.logprobs: list[TokenLogprobs] | None = None if params.logprobs is None else []
        self._tokenizer = tokenizer
        self._detok = IncrementalDetokenizer(tokenizer)
        self._stops = (
            StopStrings(params.stop, include_in_output=params.include_stop_str_in_output, min_tokens=params.min_tokens)
            if params.stop
            else None
        )

    def take(self, token: int, num_output_tokens: int, *, ended: bool) -> str:
        """Record an output token; the text it lets show now (none for a stop token, unless kept)."""
        if self.logprobs is not None:
            self.logprobs.append(self.draw.logprobs(token, self.params.logprobs or 0))
        if ended and not self.params.include_stop_str_in_output:
            return ""
        piece = self._detok.push(token)
        return piece if self._stops is None else self._stops.add(piece, num_output_tokens)

    @property
    def stop_string(self) -> str | None:
        return None if self._stops is None else self._stops.matched

    def flush(self) -> str:
        rest = self._detok.flush()
        if self._stops is None:
            return rest
        if self._stops.matched is None:
            self._stops.add(rest, 0)
        return self._stops.flush()

    def final_text(self, output_token_ids: Sequence[int], *, ended: bool) -> str:
        if self._stops is not None:
            return self._stops.text
        ids = list(output_token_ids)
        if ended and ids and not self.params.include_stop_str_in_output:
            ids.pop()
        return self._tokenizer.decode(ids, skip_special_tokens=True)


class EmulatedEngine:
    """A replica without a model (see the module docstring).

    Args:
        options: the replica's settings (:class:`~kvpool.emulator.options.EmulatorOptions`).
        tokenizer: the model's tokenizer and chat template, read from its folder (no torch).
        clock: where steps' time passes; None: the wall clock (the modelled pace, in real time).
    """

    def __init__(self, options: EmulatorOptions, tokenizer: FolderTokenizer, *, clock: StepClock | None = None) -> None:
        if not isinstance(options, EmulatorOptions):
            raise ConfigError(f"options must be EmulatorOptions, got {options!r}")
        if not isinstance(tokenizer, FolderTokenizer):
            raise ConfigError(f"tokenizer must be a FolderTokenizer, got {tokenizer!r}")
        tokenizer.load()
        self.options = options
        self.clock: StepClock = WallClock() if clock is None else clock
        self.setup = EmulatedSetup(options=options, plan=EmulatedPool.of(options))
        self.manager = KVCacheManager(
            options.num_blocks,
            options.block_size,
            enable_caching=options.enable_prefix_caching,
            hash_algo=options.hash_algo,
            enable_events=options.enable_kv_events,
            max_model_len=options.max_model_len,
        )
        self.scheduler = Scheduler(
            self.manager,
            SchedulerConfig(
                max_num_batched_tokens=options.max_num_batched_tokens,
                max_num_seqs=options.max_num_seqs,
                max_model_len=options.max_model_len,
                chunk_detail=ChunkDetail.COUNTS,  # nothing reads block tables: no model runs
                tenant_weights=options.tenant_weights,
            ),
            clock=self.clock.now,
        )
        #: No KV offload tiers are emulated.
        self.kv_tiers: None = None
        self._tokenizer = tokenizer
        self._vocab_size = tokenizer.vocab_size
        self._eos = tokenizer.eos_token_id
        self._draws = OutputTokens(self._vocab_size, tokenizer.special_token_ids, seed=options.seed)
        self._live: dict[str, _EmulatedText] = {}
        self._next_id = 0
        self._due = -math.inf  # when the latest step ended, on the clock
        self._follows_busy_step = False  # the latest step left requests to run: the next one follows it at once
        #: Steps run, and the modelled seconds they took (before ``time_scale``).
        self.num_steps = 0
        self.modelled_seconds = 0.0
        self._window = StepWindow()  # the recent steps' modelled timings: GET /rates

    # -- what the server reads -------------------------------------------------------

    @property
    def tokenizer(self) -> FolderTokenizer:
        return self._tokenizer

    @property
    def max_model_len(self) -> int:
        return self.options.max_model_len

    @property
    def num_blocks(self) -> int:
        return self.options.num_blocks

    @property
    def pool_tokens(self) -> int:
        """The tokens the KV pool holds at once (its usable blocks)."""
        return self.options.pool_tokens

    @property
    def cached_tokens_by_tier(self) -> dict[str, int]:
        return dict(self.scheduler.cached_tokens_by_tier)

    @property
    def chat_template_supports_tools(self) -> bool:
        template = self._tokenizer.chat_template
        return isinstance(template, str) and "tools" in template

    # -- prompts -----------------------------------------------------------------------

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise RequestStateError(f"text to encode must be a str, got {text!r}")
        check_flag("add_special_tokens", add_special_tokens)
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, token_ids: Sequence[int]) -> str:
        return self._tokenizer.decode(self._vocab_tokens(token_ids, "token_ids").tolist(), skip_special_tokens=True)

    def check_token_ids(self, token_ids: Sequence[int], what: str) -> None:
        self._vocab_tokens(token_ids, what)

    def _vocab_tokens(self, token_ids: Sequence[int], what: str) -> array[int]:
        tokens = to_token_array(token_ids, what)
        vocab = self._vocab_size
        if tokens and max(tokens) >= vocab:
            i = next(i for i, t in enumerate(tokens) if t >= vocab)
            raise InvalidTokenError(f"{what}[{i}] = {tokens[i]} is not a token ID of this model, in [0, {vocab})")
        return tokens

    def render_chat(self, conversation: Sequence[Mapping[str, str]], *, add_generation_prompt: bool = True) -> str:
        if isinstance(conversation, (str, bytes, Mapping)) or not isinstance(conversation, Sequence):
            raise RequestStateError(f"a conversation is a list of messages, got {conversation!r}")
        check_flag("add_generation_prompt", add_generation_prompt)
        return self._tokenizer.render_chat(
            check_conversation(conversation), add_generation_prompt=add_generation_prompt
        )

    # -- requests ------------------------------------------------------------------------

    def add_requests(
        self,
        prompts: Sequence[str | Sequence[int]],
        sampling_params: Sequence[SamplingParams | None] | None = None,
        *,
        request_ids: Sequence[str | None] | None = None,
        cache_salts: Sequence[str | None] | None = None,
        add_special_tokens: bool = True,
        tenant: str | None = None,
        max_output_tokens: int | None = None,
    ) -> list[str]:
        """Check every request, then queue them all (as :meth:`LLMEngine.add_requests`); their IDs.

        Raises:
            RequestTooLarge: they may produce more than ``max_output_tokens`` tokens together.
            KVPoolError: a request is bad or asks for what is not emulated; none is queued.
        """
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
            raise RequestStateError(f"prompts must be a list of prompts, got {prompts!r}")
        count = len(prompts)
        params = _per_prompt(sampling_params, count, "sampling_params")
        salts = _per_prompt(cache_salts, count, "cache_salts")
        check_flag("add_special_tokens", add_special_tokens)
        ids, next_id = self._choose_ids(_per_prompt(request_ids, count, "request_ids"))
        prepared = [
            self._prepare(prompt, sp, rid, salt, add_special_tokens, tenant)
            for prompt, sp, rid, salt in zip(prompts, params, ids, salts)
        ]
        if max_output_tokens is not None:
            check_int("max_output_tokens", max_output_tokens)
            omitted = any(sp.max_tokens is None for sp in params)
            check_output_bound([stop for _, stop, _ in prepared], max_output_tokens, omitted=omitted)
        for request, stop, text in prepared:  # every check has passed: queuing cannot fail
            self.scheduler.add_request(request, stop, tenant=tenant)
            self._live[request.request_id] = text
        self._next_id = next_id
        return ids

    def _choose_ids(self, wanted: list[str | None]) -> tuple[list[str], int]:
        taken: set[str] = set()
        for rid in wanted:
            if rid is None:
                continue
            if not isinstance(rid, str) or not rid:
                raise RequestStateError(f"request_id must be a non-empty string, got {rid!r}")
            if rid in self._live or rid in taken:
                raise RequestStateError(f"request {rid!r} is already running or appears twice")
            taken.add(rid)
        ids, n = [], self._next_id
        for rid in wanted:
            while rid is None:
                candidate, n = str(n), n + 1
                if candidate not in self._live and candidate not in taken:
                    rid = candidate
            ids.append(rid)
        return ids, n

    def _prepare(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None,
        request_id: str,
        cache_salt: str | None,
        special: bool,
        tenant: str | None,
    ) -> tuple[Request, StopConditions, _EmulatedText]:
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise ConfigError(f"request {request_id!r}: sampling_params must be a SamplingParams, got {params!r}")
        if params.structured is not None:
            raise ConfigError(
                f"request {request_id!r}: response_format is not emulated (an emulated replica has no model "
                "whose output could follow a grammar)"
            )
        text: str | None = None
        if isinstance(prompt, str):
            if not prompt:
                raise RequestStateError(f"request {request_id!r}: the prompt is empty")
            text = prompt
            token_ids: Sequence[int] = self.encode(prompt, add_special_tokens=special)
        elif isinstance(prompt, (bytes, bytearray)) or not isinstance(prompt, Sequence):
            raise RequestStateError(
                f"request {request_id!r}: a prompt is text or a sequence of token IDs, got {prompt!r}"
            )
        else:
            token_ids = cast(Sequence[int], prompt)
        try:
            tokens = self._vocab_tokens(token_ids, "prompt token_ids")
            if params.stop_token_ids:
                self._vocab_tokens(params.stop_token_ids, "stop_token_ids")
        except KVPoolError as exc:
            raise type(exc)(f"request {request_id!r}: {exc}") from None
        request = Request(request_id, tokens, cache_salt=cache_salt)
        stop = StopConditions(
            max_tokens=params.max_tokens or max(1, self.options.max_model_len - len(tokens)),
            stop_token_ids=frozenset(params.stop_token_ids),
            eos_token_id=self._eos,
            ignore_eos=params.ignore_eos,
            min_tokens=params.min_tokens,
        )
        self.scheduler.check_request(request, stop, tenant=tenant)
        draw = self._draws.for_request(tokens, params.seed)
        return request, stop, _EmulatedText(params, text, self._tokenizer, draw)

    def abort(self, request_id: str) -> bool:
        """Stop a request; its blocks go back to the pool. Whether one was stopped."""
        if not isinstance(request_id, str):
            raise RequestStateError(f"a request ID is a string, got {request_id!r}")
        if request_id not in self._live:
            return False
        self.scheduler.abort(request_id)
        self.scheduler.forget(request_id)
        del self._live[request_id]
        return True

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # -- the loop -------------------------------------------------------------------------

    def step(self) -> list[RequestDelta]:
        """One scheduled step: its modelled time passes, then one delta per request that got a token."""
        plan = self.scheduler.schedule()
        if plan.is_empty:
            if self.scheduler.has_unfinished_requests():
                raise RequestStateError("the scheduler could not schedule any waiting request")
            return []
        prefill, decodes, context = self._work(plan)
        seconds = self.options.profile.step_seconds(prefill, decodes, context_tokens=context)
        self._window.note(prefill, decodes, seconds)
        self._pace(seconds)
        tokens = {c.request_id: self._live[c.request_id].draw.next() for c in plan.chunks if c.sample}
        finished = {m.request_id: m for m in self.scheduler.update(plan, tokens)}
        deltas = [self._deliver(rid, token, finished.get(rid)) for rid, token in tokens.items()]
        self._follows_busy_step = self.scheduler.has_unfinished_requests()
        return deltas

    def step_seconds(self, plan: SchedulerOutput) -> float:
        """The modelled seconds of ``plan`` (before ``time_scale``): its prefill, its decodes, the context read.

        A chunk of one token for a request that has output tokens is a decode; any other chunk (a
        prompt's, or a preempted request's recomputation) is prefill. Every chunk reads the KV
        before its first position.
        """
        prefill, decodes, context = self._work(plan)
        return self.options.profile.step_seconds(prefill, decodes, context_tokens=context)

    def _work(self, plan: SchedulerOutput) -> tuple[int, int, int]:
        """``plan``'s prefill tokens, decoding sequences and context tokens read (see :meth:`step_seconds`)."""
        prefill = decodes = context = 0
        for chunk in plan.chunks:
            if chunk.num_tokens == 1 and self.scheduler.request(chunk.request_id).num_output_tokens:
                decodes += 1
            else:
                prefill += chunk.num_tokens
            context += chunk.start_position
        return prefill, decodes, context

    def rates(self) -> ReplicaRates:
        """How fast this replica works, in modelled seconds (``GET /rates``).

        Measured over its recent steps once one prefilled; before that, its profile's figures at a
        full ``max_num_batched_tokens`` chunk (source ``"profile:<name>"``). No tiers are emulated.
        """
        measured = self._window.rates()
        if measured is not None:
            return measured
        return ReplicaRates.from_profile(self.options.profile, chunk_tokens=self.options.max_num_batched_tokens)

    def _pace(self, seconds: float) -> None:
        """Let ``seconds`` (scaled) pass, from the previous step's end when this step follows it at once.

        A step that follows a busy one starts where that one ended: the engine's own time between
        them (delivering tokens, scheduling) is part of the modelled step, as it is part of a real
        engine's measured one, unless it ran longer than this whole step (an overloaded machine:
        the lost time is not made up for by a burst). A step after an idle spell starts now.
        """
        scaled = seconds * self.options.time_scale
        now = self.clock.now()
        start = self._due if self._follows_busy_step and now - self._due < scaled else now
        self._due = start + scaled
        self.clock.sleep_until(self._due)
        self.num_steps += 1
        self.modelled_seconds += seconds

    def _deliver(self, rid: str, token: int, metrics: RequestMetrics | None) -> RequestDelta:
        text = self._live[rid]
        ended = metrics is not None and metrics.finish_reason in (FinishReason.STOP, FinishReason.EOS)
        piece = text.take(token, self.scheduler.request(rid).num_output_tokens, ended=ended)
        if metrics is None and text.stop_string is not None:
            self.scheduler.abort(rid, reason=FinishReason.STOP)
            metrics = self.scheduler.metrics(rid)
        logprobs = None if text.logprobs is None else (text.logprobs[-1],)
        if metrics is None:
            return RequestDelta(request_id=rid, token_ids=(token,), text=piece, finished=False, logprobs=logprobs)
        piece += text.flush()
        output = self._finish(rid, metrics)
        return RequestDelta(
            request_id=rid, token_ids=(token,), text=piece, finished=True, output=output, logprobs=logprobs
        )

    def _finish(self, request_id: str, metrics: RequestMetrics) -> RequestOutput:
        request = self.scheduler.request(request_id)
        self.scheduler.forget(request_id)
        text = self._live.pop(request_id)
        output_ids = tuple(request.output_token_ids)
        reason = cast(FinishReason, metrics.finish_reason)
        stop_reason: int | str | None = text.stop_string
        if reason is FinishReason.STOP and stop_reason is None and output_ids:
            stop_reason = output_ids[-1]
        ended = reason is FinishReason.EOS or (reason is FinishReason.STOP and text.stop_string is None)
        return RequestOutput.from_metrics(
            metrics,
            prompt=text.prompt,
            prompt_token_ids=tuple(request.prompt_token_ids),
            output_token_ids=output_ids,
            text=text.final_text(output_ids, ended=ended),
            stop_reason=stop_reason,
            logprobs=None if text.logprobs is None else tuple(text.logprobs),
        )

    def run_until_done(self) -> dict[str, RequestOutput]:
        """Step until every request has finished; their outputs by ID (offline use and tests)."""
        done: dict[str, RequestOutput] = {}
        while self.scheduler.has_unfinished_requests():
            for delta in self.step():
                if delta.output is not None:
                    done[delta.request_id] = delta.output
        return done


def _per_prompt(values: Sequence[Any] | None, count: int, what: str) -> list[Any]:
    if values is None:
        return [None] * count
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise ConfigError(f"{what} must be a list with one entry per prompt, got {values!r}")
    if len(values) != count:
        raise ConfigError(f"{what} has {len(values)} entries for {count} prompts")
    return list(values)
