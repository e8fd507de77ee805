"""The serving loop: requests in, one scheduled forward pass per step, tokens out.

Each :meth:`LLMEngine.step`:

1. ``scheduler.schedule()`` picks this step's chunks under the token budget
   (chunked prefill, prefix-cache hits, preemption when blocks run out);
2. ``runner.execute`` computes the scheduler's
   :class:`~kvpool.scheduler.ScheduledChunk` objects, as they are, in one
   forward pass, writing K/V into the preallocated cache through their block
   tables;
3. the last-token logits of chunks that reach the end of their known tokens
   are sampled, each request with its own :class:`SamplingParams` (its
   ``min_tokens`` mask and penalties, then temperature, min-p, top-k, top-p),
   its own seeded generator and, if it asked, its log-probabilities;
4. ``scheduler.update`` appends the tokens, applies the stop conditions (stop
   tokens and EOS past ``min_tokens``, ``max_tokens``, ``max_model_len``) and
   frees finished requests' blocks, which stay in the prefix cache until
   evicted; the engine then ends a request whose text reached one of its stop
   strings (:class:`~kvpool.engine.live_request.LiveRequest`), or whose
   structured output's grammar is complete (:mod:`~kvpool.engine.structured`:
   its matcher is made when the request is added, masks the row before it is
   sampled and advances with each token; a schema it cannot compile is refused).

``max_tokens=None`` is resolved when a request is added: the rest of the
context, ``max_model_len`` minus the prompt. Requests with one prompt added
together (the ``n`` sequences of one API request) share its blocks through
the prefix cache: the first computes it, the others hit its full blocks in
the same step.

A prefix hit is never recomputed: the scheduler starts the request's first
chunk at the number of cached tokens. Every public method checks all of its
arguments before it changes anything, so a bad request (or batch) raises a
:class:`~kvpool.errors.KVPoolError` naming the value, with nothing queued, and
the engine keeps serving.

A failure during a step is contained to the requests that cause it:

* **Sampling** is per row: a request whose logits cannot be sampled (NaN, no
  finite logit) fails alone; its K/V was written, so its blocks stay cached.
* **The forward pass**: if it raises, the step's chunks are run again one at a
  time (:mod:`~kvpool.engine.containment`); a request whose chunk fails alone
  fails, the others keep the logits of their lone run. A request that reads a
  block a failed request was to fill in this step fails with it.
* **Anything else** in the step (a KV tier's transfer hooks, the sampler
  itself) is a failure no single request explains: every request of the step
  fails (an interrupt then goes on to the caller).

A failed request finishes with ``FinishReason.ERROR`` and a
:class:`~kvpool.errors.RequestFailed` (its ``output.error``) that names it and
the cause; it comes back as a finished :class:`RequestDelta`. Its blocks go
back to the pool, and the blocks this step was to fill for it leave the prefix
cache (their K/V was never written), nothing else: blocks filled by earlier
steps stay cached, and no KV tier is reset (the CPU tier forgets only the host
blocks reserved for its unwritten saves). Requests the step did not schedule
are not touched.
"""

from __future__ import annotations

import logging
import math
import os
import time
from array import array
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch

from kvpool.checks import check_int
from kvpool.engine.containment import dependants, forward_contained
from kvpool.engine.kv_transfer import KVTiers, build_kv_tiers
from kvpool.engine.live_request import LiveRequest
from kvpool.engine.model_store import DEFAULT_MODEL
from kvpool.engine.outputs import RequestDelta, RequestOutput, TokenLogprobs
from kvpool.engine.sampling import SampledToken, SamplingFailure, SamplingParams, sample_rows
from kvpool.engine.startup import EngineOptions, EngineSetup, start_engine
from kvpool.engine.structured import GrammarCompiler, GrammarMatcher
from kvpool.errors import (
    ConfigError,
    InvalidTokenError,
    KVPoolError,
    RequestFailed,
    RequestStateError,
)
from kvpool.hashing import to_token_array
from kvpool.manager import KVCacheManager
from kvpool.prompts import check_conversation
from kvpool.replica_rates import ReplicaRates, StepWindow
from kvpool.request import Request
from kvpool.scheduler import (
    FinishReason,
    RequestMetrics,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
    StopConditions,
    check_output_bound,
)
from kvpool.tiers.store import event_medium

if TYPE_CHECKING:
    from kvpool.engine.kv_cache import KVCaches
    from kvpool.engine.model_runner import ModelRunner

__all__ = ["LLMEngine", "Prompt"]

#: A prompt: text (needs a tokenizer) or token IDs.
Prompt = str | Sequence[int]

_LOGGER = logging.getLogger("kvpool.engine")

#: With nothing to compute while tier loads run, how long a step waits for one to end before it
#: returns (the serving loop then takes new requests: none waits longer than this for a slow tier).
_IDLE_WAIT_S = 0.005


def _check_bool(name: str, value: object) -> None:
    if type(value) is not bool:
        raise ConfigError(f"{name} must be a bool, got {value!r}")


def _per_prompt(values: Sequence[Any] | None, count: int, what: str) -> list[Any]:
    """One value per prompt (None for each when ``values`` is None)."""
    if values is None:
        return [None] * count
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise ConfigError(f"{what} must be a list with one entry per prompt, got {values!r}")
    if len(values) != count:
        raise ConfigError(f"{what} has {len(values)} entries for {count} prompts")
    return list(values)


@dataclass(frozen=True, slots=True)
class _Prepared:
    """A request that passed every check and only waits to be queued."""

    request: Request
    stop: StopConditions
    params: SamplingParams
    prompt: str | None
    grammar: GrammarMatcher | None = None


class LLMEngine:
    """A paged-KV inference engine over one model (see the module docstring).

    Args:
        model: a known model name (``"smollm2-135m"``), a local model folder,
            or a whole :class:`~kvpool.engine.startup.EngineOptions`.
        log: receives the startup lines; None sends them to the
            ``kvpool.engine`` logger at INFO.
        **options: the other fields of :class:`~kvpool.engine.startup.EngineOptions`
            (``block_size``, ``max_model_len``, ``kv_cache_memory``, ...), where
            each option is stated and documented once.

    Raises:
        KVPoolError: a bad option, an unknown model, or a KV budget too small
            for one ``max_model_len`` request.
    """

    def __init__(
        self,
        model: str | os.PathLike[str] | EngineOptions = DEFAULT_MODEL,
        *,
        log: Callable[[str], None] | None = None,
        **options: Any,
    ) -> None:
        if log is not None and not callable(log):
            raise ConfigError(f"log must be callable or None, got {log!r}")
        if isinstance(model, EngineOptions) and options:
            raise ConfigError(f"give an EngineOptions or option keywords, not both; got also {sorted(options)}")
        chosen = model if isinstance(model, EngineOptions) else EngineOptions(model=model, **options)
        lines: list[str] = []
        sink = log if log is not None else _LOGGER.info

        def record(line: str) -> None:
            lines.append(line)
            sink(line)

        self.setup: EngineSetup = start_engine(chosen, record)
        setup = self.setup
        self.manager = KVCacheManager(
            setup.plan.num_blocks,
            chosen.block_size,
            enable_caching=chosen.enable_prefix_caching,
            max_model_len=setup.max_model_len,
            groups=setup.groups,
            hash_algo=chosen.hash_algo,
            enable_events=chosen.enable_kv_events,
        )
        #: The KV offload tiers (``kv_tiers``), or None.
        self.kv_tiers: KVTiers | None = build_kv_tiers(
            chosen.kv_tiers, chosen.kv_tier_secret_file, setup.kv_caches, self.manager,
            (getattr(setup.model.config, "architectures", None) or [type(setup.model).__name__])[0], record,
            model_folder=setup.model_path, namespace=chosen.kv_tier_namespace, write=chosen.kv_tier_write,
            unauthenticated=chosen.kv_tier_unauthenticated, targets=chosen.kv_tier_targets,
            load_deadline_s=chosen.kv_tier_load_deadline, always_load=chosen.kv_tier_always_load,
        )  # fmt: skip
        if self.kv_tiers is not None:
            setup.runner.kv_load_wait = self.kv_tiers.worker.wait_for_layer_load
        self.startup_log: tuple[str, ...] = tuple(lines)
        self.scheduler = Scheduler(
            self.manager,
            SchedulerConfig(
                max_num_batched_tokens=chosen.max_num_batched_tokens,
                max_num_seqs=chosen.max_num_seqs,
                max_model_len=setup.max_model_len,
                tenant_weights=chosen.tenant_weights,
            ),
            connector=None if self.kv_tiers is None else self.kv_tiers.connector,
        )
        self._live: dict[str, LiveRequest] = {}
        self._grammars = GrammarCompiler(setup.tokenizer, setup.runner.vocab_size, setup.eos_token_ids)
        self._next_id = 0  # automatic request IDs are str(n), n counting up from here
        self._window = StepWindow()  # the recent forward passes' timings: rates()

    # -- properties ----------------------------------------------------------------

    @property
    def runner(self) -> ModelRunner:
        return self.setup.runner

    @property
    def kv_caches(self) -> KVCaches:
        return self.setup.kv_caches

    @property
    def tokenizer(self) -> Any:
        return self.setup.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.setup.max_model_len

    @property
    def capacity_line(self) -> str:
        return self.setup.plan.capacity_line

    @property
    def num_blocks(self) -> int:
        return self.setup.plan.num_blocks

    @property
    def cached_tokens_by_tier(self) -> dict[str, int]:
        """Prompt tokens taken from each source since start-up: ``"gpu"`` (the pool) and each KV tier."""
        return dict(self.scheduler.cached_tokens_by_tier)

    def kv_tier_figures(self) -> dict[str, dict[str, Any]]:
        """Per KV tier: blocks and bytes moved, failed loads, and the store's own counters (empty without tiers)."""
        return {} if self.kv_tiers is None else self.kv_tiers.figures()

    # -- prompts ----------------------------------------------------------------------

    def _require_tokenizer(self, what: str) -> Any:
        if self.setup.tokenizer is None:
            raise ConfigError(f"model {self.setup.model_name!r} has no tokenizer; {what}")
        return self.setup.tokenizer

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token IDs of ``text``; ``add_special_tokens`` adds the tokenizer's own (e.g. BOS)."""
        if not isinstance(text, str):
            raise RequestStateError(f"text to encode must be a str, got {text!r}")
        _check_bool("add_special_tokens", add_special_tokens)
        tokenizer = self._require_tokenizer("pass token IDs instead of text")
        return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, token_ids: Sequence[int]) -> str:
        tokenizer = self._require_tokenizer("cannot decode text")
        text: str = tokenizer.decode(self._vocab_tokens(token_ids, "token_ids").tolist(), skip_special_tokens=True)
        return text

    def check_token_ids(self, token_ids: Sequence[int], what: str) -> None:
        """Refuse (``InvalidTokenError`` naming ``what``) token IDs that are not this model's.

        Reads only the model's vocabulary size, so any thread may call it."""
        self._vocab_tokens(token_ids, what)

    def _vocab_tokens(self, token_ids: Sequence[int], what: str) -> array[int]:
        """``token_ids`` as an array, refused unless every one is in the model's vocabulary."""
        tokens = to_token_array(token_ids, what)  # the core's rule: integers in [0, 2**32)
        vocab = self.setup.runner.vocab_size
        if tokens and max(tokens) >= vocab:
            i = next(i for i, t in enumerate(tokens) if t >= vocab)
            raise InvalidTokenError(f"{what}[{i}] = {tokens[i]} is not a token ID of this model, in [0, {vocab})")
        return tokens

    @property
    def chat_template_supports_tools(self) -> bool:
        """Whether the model's chat template can write tools into a prompt (it reads a ``tools`` variable)."""
        tokenizer = self.setup.tokenizer
        template = getattr(tokenizer, "chat_template", None) if tokenizer is not None else None
        return isinstance(template, str) and "tools" in template

    def render_chat(self, conversation: Sequence[Mapping[str, str]], *, add_generation_prompt: bool = True) -> str:
        """The conversation as the model's chat template writes it (encode it as :mod:`kvpool.prompts` says)."""
        if isinstance(conversation, (str, bytes, Mapping)) or not isinstance(conversation, Sequence):
            raise RequestStateError(f"a conversation is a list of messages, got {conversation!r}")
        _check_bool("add_generation_prompt", add_generation_prompt)
        tokenizer = self._require_tokenizer("chat needs one")
        if not getattr(tokenizer, "chat_template", None):
            raise ConfigError(f"the tokenizer of model {self.setup.model_name!r} has no chat template")
        messages = check_conversation(conversation)
        rendered: str = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        return rendered

    # -- requests -----------------------------------------------------------------------

    def add_request(
        self,
        prompt: Prompt,
        sampling_params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        cache_salt: str | None = None,
        add_special_tokens: bool = True,
        tenant: str | None = None,
    ) -> str:
        """Check and queue one request; returns its ID (see :meth:`add_requests`)."""
        [rid] = self.add_requests(
            [prompt],
            [sampling_params],
            request_ids=[request_id],
            cache_salts=[cache_salt],
            add_special_tokens=add_special_tokens,
            tenant=tenant,
        )
        return rid

    def add_requests(
        self,
        prompts: Sequence[Prompt],
        sampling_params: Sequence[SamplingParams | None] | None = None,
        *,
        request_ids: Sequence[str | None] | None = None,
        cache_salts: Sequence[str | None] | None = None,
        add_special_tokens: bool = True,
        tenant: str | None = None,
        max_output_tokens: int | None = None,
    ) -> list[str]:
        """Check every request, then queue them all; returns their IDs in prompt order.

        Args:
            prompts: text (needs a tokenizer) or token IDs, one per request.
            sampling_params: one per prompt; None (for all, or for one) means
                greedy, 16 tokens.
            request_ids: one per prompt; None (for all, or for one) takes the
                next free number.
            cache_salts: one per prompt, or None; requests with different
                salts never share cached blocks.
            add_special_tokens: encode text prompts with the tokenizer's own
                special tokens (False for text that already holds them, such
                as a rendered chat template).
            tenant: whose requests these are: tenants share the batch, the
                pool and each step fairly (:mod:`kvpool.fair_share`); None is
                the one unnamed tenant.

        Raises:
            max_output_tokens: the most tokens these requests together may
                produce (a server's bound on one API request: its prompts
                times ``n``), each counted at its ``max_tokens`` or, without
                one, at the rest of the context; their ``min_tokens`` are
                bounded the same way. None: no bound (what an offline batch
                wants; :attr:`pool_tokens` is the bound that fits the pool).

        Raises:
            RequestTooLarge: the requests ask for more than ``max_output_tokens``.
            KVPoolError: any request is bad; then none is queued and no
                automatic ID is used up.
        """
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
            raise RequestStateError(f"prompts must be a list of prompts, got {prompts!r}")
        count = len(prompts)
        params = _per_prompt(sampling_params, count, "sampling_params")
        salts = _per_prompt(cache_salts, count, "cache_salts")
        _check_bool("add_special_tokens", add_special_tokens)
        ids, next_id = self._choose_ids(_per_prompt(request_ids, count, "request_ids"))
        prepared = [
            self._prepare(prompt, sp, rid, salt, add_special_tokens, tenant)
            for prompt, sp, rid, salt in zip(prompts, params, ids, salts)
        ]
        if max_output_tokens is not None:
            check_int("max_output_tokens", max_output_tokens)
            _check_request_size(prepared, max_output_tokens)
        for one in prepared:  # every check has passed: queuing cannot fail
            self.scheduler.add_request(one.request, one.stop, tenant=tenant)
            self._live[one.request.request_id] = LiveRequest(
                one.params, one.prompt, self.setup.tokenizer, self.setup.eos_token_ids, one.grammar
            )
        self._next_id = next_id
        return ids

    @property
    def pool_tokens(self) -> int:
        """The tokens the KV pool holds at once (its usable blocks): the bound of a request that fits the pool."""
        return (self.manager.num_blocks - 1) * self.manager.block_size

    def _choose_ids(self, wanted: list[str | None]) -> tuple[list[str], int]:
        """Given IDs checked, None replaced by fresh numbers; and the counter after them."""
        taken: set[str] = set()
        for rid in wanted:
            if rid is None:
                continue
            if not isinstance(rid, str) or not rid:
                raise RequestStateError(f"request_id must be a non-empty string, got {rid!r}")
            if rid in self._live:
                raise RequestStateError(f"request {rid!r} is already running")
            if rid in taken:
                raise RequestStateError(f"request ID {rid!r} appears twice in one batch")
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
        prompt: Prompt,
        params: SamplingParams | None,
        request_id: str,
        cache_salt: str | None,
        special: bool,
        tenant: str | None,
    ) -> _Prepared:
        """A request checked by every rule that applies to it; nothing is queued."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise ConfigError(f"request {request_id!r}: sampling_params must be a SamplingParams, got {params!r}")
        text: str | None = None
        token_ids: Sequence[int]
        if isinstance(prompt, str):
            if not prompt:
                raise RequestStateError(f"request {request_id!r}: the prompt is empty")
            text = prompt
            token_ids = self.encode(prompt, add_special_tokens=special)
        else:
            token_ids = prompt
            if isinstance(token_ids, (bytes, bytearray)) or not isinstance(token_ids, Sequence):
                raise RequestStateError(
                    f"request {request_id!r}: a prompt is text or a sequence of token IDs, got {prompt!r}"
                )
        try:
            tokens = self._vocab_tokens(token_ids, "prompt token_ids")
        except KVPoolError as exc:
            raise type(exc)(f"request {request_id!r}: {exc}") from None
        request = Request(request_id, tokens, cache_salt=cache_salt)  # checks the salt and that tokens exist
        if params.stop_token_ids:
            try:
                self._vocab_tokens(params.stop_token_ids, "stop_token_ids")
            except KVPoolError as exc:
                raise type(exc)(f"request {request_id!r}: {exc}") from None
        if params.stop and self.setup.tokenizer is None:
            raise ConfigError(
                f"request {request_id!r}: stop strings {list(params.stop)!r} need a tokenizer; "
                f"model {self.setup.model_name!r} has none"
            )
        eos = self.setup.eos_token_ids
        # A model may name several end tokens; the first is "the" EOS, the others stop like it.
        extra_eos = frozenset() if params.ignore_eos else frozenset(eos[1:])
        # None: the rest of the context (at least 1, so a prompt too long is refused below by length).
        max_tokens = params.max_tokens or max(1, self.setup.max_model_len - len(tokens))
        stop = StopConditions(
            max_tokens=max_tokens,
            stop_token_ids=frozenset(params.stop_token_ids) | extra_eos,
            eos_token_id=eos[0] if eos else None,
            ignore_eos=params.ignore_eos,
            min_tokens=params.min_tokens,
        )
        self.scheduler.check_request(request, stop, tenant=tenant)  # room under max_model_len, in the pool, a free ID
        grammar = None
        if params.structured is not None:
            try:
                grammar = self._grammars.matcher(params.structured)
            except KVPoolError as exc:
                raise type(exc)(f"request {request_id!r}: {exc}") from None
        return _Prepared(request=request, stop=stop, params=params, prompt=text, grammar=grammar)

    def abort(self, request_id: str) -> bool:
        """Stop a request; its blocks go back to the pool.

        Returns whether one was stopped: an unknown or finished ID changes nothing.
        """
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

    @property
    def num_unfinished_requests(self) -> int:
        return self.scheduler.num_waiting + self.scheduler.num_running + self.scheduler.num_loading

    # -- the loop -----------------------------------------------------------------------

    def step(self) -> list[RequestDelta]:
        """Run one scheduled forward pass; one delta per request that got a token or failed.

        A request that failed in this step (see the module docstring) gets a
        finished delta without a token whose ``output.error`` says why; the
        step goes on for the others. Only an interrupt (``BaseException``
        that is not an ``Exception``) is raised, after the step's requests failed.
        """
        tiers = self.kv_tiers
        if tiers is not None:  # requests whose tier loads ended wait again, first in line
            tiers.poll(self.scheduler)
        plan = self.scheduler.schedule()
        if plan.is_empty:
            if tiers is not None and (self.scheduler.num_loading or tiers.busy):
                tiers.before_forward(self.scheduler, plan)  # the loads it planned start; nothing to compute yet
                if tiers.busy:
                    tiers.wait_for_loads(_IDLE_WAIT_S)
                return []
            if self.scheduler.has_unfinished_requests():
                raise RequestStateError("the scheduler could not schedule any waiting request")
            return []
        failed: dict[str, str] = {}
        dropped: set[str] = set()
        sampled: dict[str, SampledToken] = {}
        try:
            if tiers is not None:  # loads first; a failed one is computed in this very pass
                plan = tiers.before_forward(self.scheduler, plan)
            # the scheduler's chunks, as they are: checked when they were made
            started = time.perf_counter()
            result = forward_contained(self.setup.runner.execute, plan.chunks)
            took = time.perf_counter() - started
            if tiers is not None:
                tiers.note_step(plan.num_batched_tokens, took)
            self._note_step(plan, took)
            failed.update(result.failed)
            failed.update(dependants(self.manager, plan.chunks, failed))
            self._drop_unwritten(plan, failed, dropped)
            if tiers is not None:
                plan = tiers.after_forward(self.scheduler, plan, skip=frozenset(failed))
            sampled = self._sample(result.rows, result.batched if not failed else None, failed)
        except BaseException as exc:
            # No single request explains it: every request of the step fails.
            cause = f"the step failed: {type(exc).__name__}: {exc}"
            everyone = {c.request_id: failed.get(c.request_id, cause) for c in plan.chunks}
            self._drop_unwritten(plan, everyone, dropped)
            deltas = self._fail(everyone)
            self.scheduler.update(plan, {})
            if not isinstance(exc, Exception):
                raise
            _LOGGER.warning("a step failed; its %d requests failed with it: %s", len(everyone), cause)
            return deltas
        failures = self._fail(failed)
        tokens = {rid: s.token_id for rid, s in sampled.items()}
        finished = {m.request_id: m for m in self.scheduler.update(plan, tokens)}
        return [self._deliver(rid, one, finished.get(rid)) for rid, one in sampled.items()] + failures

    def _note_step(self, plan: SchedulerOutput, seconds: float) -> None:
        """A forward pass's prefill tokens, decodes and seconds, into the window :meth:`rates` reads."""
        prefill = decodes = 0
        for chunk in plan.chunks:
            if chunk.num_tokens == 1 and self.scheduler.request(chunk.request_id).num_output_tokens:
                decodes += 1
            else:
                prefill += chunk.num_tokens
        self._window.note(prefill, decodes, seconds)

    def rates(self) -> ReplicaRates | None:
        """How fast this engine works (``GET /rates``): measured over its recent forward passes, with each
        KV tier's load rate in tokens a second (by its event medium, ``CPU``, ``STORAGE``): the load-or-compute
        rule's estimate, measured from the loads it timed, its link's prior until then.

        None until a pass prefilled: an engine has no profile to fall back on.
        """
        tiers: dict[str, float] = {}
        chooser = None if self.kv_tiers is None else self.kv_tiers.chooser
        if chooser is not None:
            bytes_per_token = self.setup.plan.pool_block_bytes / self.manager.block_size
            for name, figures in chooser.figures()["tiers"].items():
                if math.isfinite(rate := figures["load_bandwidth_bytes_per_s"]) and rate > 0:
                    tiers[_medium(name)] = rate / bytes_per_token
        return self._window.rates(tiers)

    def _deliver(self, rid: str, sampled: SampledToken, metrics: RequestMetrics | None) -> RequestDelta:
        """The delta of a request that got a token; it finishes here if the token ended it or its text did."""
        state = self._live[rid]
        token = sampled.token_id
        ended = metrics is not None and metrics.finish_reason in (FinishReason.STOP, FinishReason.EOS)
        request = self.scheduler.request(rid)
        piece = state.take(token, sampled.logprobs, request.num_output_tokens, ended=ended)
        if metrics is None and (state.stop_string is not None or state.grammar_done):
            # the text reached a stop string, or the output is a whole document of its grammar
            self.scheduler.abort(rid, reason=FinishReason.STOP)
            metrics = self.scheduler.metrics(rid)
        logprobs = None if sampled.logprobs is None else (sampled.logprobs,)
        if metrics is None:
            return RequestDelta(request_id=rid, token_ids=(token,), text=piece, finished=False, logprobs=logprobs)
        piece += state.flush()
        output = self._finish(rid, metrics)
        return RequestDelta(
            request_id=rid, token_ids=(token,), text=piece, finished=True, output=output, logprobs=logprobs
        )

    def _sample(
        self, rows: Mapping[str, torch.Tensor], batched: torch.Tensor | None, failed: dict[str, str]
    ) -> dict[str, SampledToken]:
        """Tokens of the sampled requests that have not failed; a row that cannot be sampled joins ``failed``."""
        ids = [rid for rid in rows if rid not in failed]
        if not ids:
            return {}
        logits = batched if batched is not None else torch.stack([rows[rid] for rid in ids])
        live = [self._live[rid] for rid in ids]
        contexts = [s.row_context(self.scheduler.request(rid)) for rid, s in zip(ids, live)]
        picks = sample_rows(logits, [s.params for s in live], [s.generator for s in live], contexts)
        sampled: dict[str, SampledToken] = {}
        for rid, state, token in zip(ids, live, picks):
            if isinstance(token, SamplingFailure):
                failed[rid] = f"its next token cannot be sampled: {token.reason}"
                continue
            refused = None if state.grammar is None else state.grammar.accept(token.token_id)
            if refused is not None:
                failed[rid] = f"its token {token.token_id} does not follow its grammar: {refused}"
            else:
                sampled[rid] = token
        return sampled

    def _drop_unwritten(self, plan: SchedulerOutput, failed: Mapping[str, str], dropped: set[str]) -> None:
        """Forget what the failed requests' chunks were to write: their new blocks' cache entries, their saves.

        ``dropped`` holds the requests already handled (and receives these).
        """
        todo = frozenset(failed).difference(dropped)
        if not todo:
            return
        dropped.update(todo)
        if self.kv_tiers is not None:
            self.kv_tiers.drop_requests(plan, todo)
        for chunk in plan.chunks:
            if chunk.request_id in todo:
                request = self.scheduler.request(chunk.request_id)
                self.manager.uncache_from(request, chunk.start_position)

    def _fail(self, failed: Mapping[str, str]) -> list[RequestDelta]:
        """End each failed request with its error; their finished deltas."""
        deltas = []
        for rid, cause in failed.items():
            if rid not in self._live:
                continue
            _LOGGER.warning("request %r failed: %s", rid, cause)
            self.scheduler.abort(rid, reason=FinishReason.ERROR)
            piece = self._live[rid].flush()
            output = self._finish(rid, self.scheduler.metrics(rid), error=RequestFailed(rid, cause))
            deltas.append(RequestDelta(request_id=rid, token_ids=(), text=piece, finished=True, output=output))
        return deltas

    def _finish(self, request_id: str, metrics: RequestMetrics, *, error: RequestFailed | None = None) -> RequestOutput:
        request = self.scheduler.request(request_id)
        self.scheduler.forget(request_id)
        state = self._live.pop(request_id)
        output_ids = tuple(request.output_token_ids)
        reason = cast(FinishReason, metrics.finish_reason)  # a finished request has its reason
        # STOP by a token: the token is the reason; by a stop string: the string; by a complete grammar: none.
        by_text = state.stop_string is not None or (reason is FinishReason.STOP and state.grammar_done)
        stop_reason: int | str | None = state.stop_string
        if reason is FinishReason.STOP and not by_text and output_ids:
            stop_reason = output_ids[-1]
        ended = reason is FinishReason.EOS or (reason is FinishReason.STOP and not by_text)
        logprobs: tuple[TokenLogprobs, ...] | None = None if state.logprobs is None else tuple(state.logprobs)
        return RequestOutput.from_metrics(
            metrics,
            prompt=state.prompt,
            prompt_token_ids=tuple(request.prompt_token_ids),
            output_token_ids=output_ids,
            text=state.final_text(output_ids, ended=ended),
            error=error,
            stop_reason=stop_reason,
            logprobs=logprobs,
        )

    def run_until_done(self, request_ids: Sequence[str] | None = None) -> dict[str, RequestOutput]:
        """Step until the given requests (default: all) have finished; their outputs by ID.

        Other requests advance too; their outputs are not returned here.
        """
        if request_ids is None:
            wanted = set(self._live)
        elif isinstance(request_ids, (str, bytes)) or not isinstance(request_ids, Sequence):
            raise RequestStateError(f"request_ids must be a list of request IDs, got {request_ids!r}")
        else:
            wanted = set()
            for rid in request_ids:
                if not isinstance(rid, str) or rid not in self._live:
                    raise RequestStateError(f"request {rid!r} is not running in this engine")
                wanted.add(rid)
        done: dict[str, RequestOutput] = {}
        while wanted - done.keys():
            if not self.scheduler.has_unfinished_requests():
                missing = sorted(wanted - done.keys())
                raise RequestStateError(f"requests {missing} are not running in this engine")
            for delta in self.step():
                if delta.output is not None and delta.request_id in wanted:
                    done[delta.request_id] = delta.output
        return done


def _check_request_size(prepared: Sequence[_Prepared], limit: int) -> None:
    """Refuse requests that together may produce more than ``limit`` tokens (the scheduler's rule)."""
    check_output_bound([p.stop for p in prepared], limit, omitted=any(p.params.max_tokens is None for p in prepared))


def _medium(tier_name: str) -> str:
    """The event medium of a tier (``CPU``, ``STORAGE``), or its own name where the registry has none."""
    try:
        return event_medium(tier_name)
    except ConfigError:
        return tier_name
