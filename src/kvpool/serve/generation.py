"""One generation request's life on the server: its engine requests, their deltas, its answer.

A request with ``P`` prompts and ``n`` choices becomes ``P * n`` engine
requests, added in ONE ``add_requests`` call (all or none): the ``n``
sequences of a prompt are admitted together, so the engine computes the
prompt once and the others take its blocks from the prefix cache. Choice
``p * n + i`` is the ``i``-th sequence of prompt ``p`` (vLLM's order); a
seeded request's sequence ``i`` draws with ``seed + i``, so its choices differ
and every run gives the same ones.

Usage counts each prompt once (as vLLM does); its ``cached_tokens`` counts,
per prompt, the most prompt tokens any of its sequences found cached (so a
prompt whose ``n`` sequences shared its blocks shows them cached), never more
than the prompt.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from kvpool.errors import KVPoolError
from kvpool.openai_http.errors import APIError, error_body
from kvpool.openai_http.protocol import GenerationEndpoint, GenerationRequest
from kvpool.sampling_params import SEED_LIMIT, SamplingParams
from kvpool.serve.engine_loop import Job
from kvpool.serve.responses import Choice, Usage, chunk_body, completion_body, logprobs_body

if TYPE_CHECKING:
    from kvpool.engine.outputs import RequestDelta, RequestOutput
    from kvpool.engine.structured import StructuredOutput
    from kvpool.serve.tokenizer_thread import TokenizerThread

__all__ = ["Plan", "check_tools", "finish_reason", "plan_jobs", "sequence_params"]

_FINISH_REASONS = {"length": "length", "stop": "stop", "eos": "stop", "aborted": "abort", "error": "error"}


def finish_reason(output: RequestOutput) -> str:
    """OpenAI's name for how a request ended (``eos`` and ``stop`` are both ``stop``)."""
    return _FINISH_REASONS[output.finish_reason.value]


def sequence_params(gen: GenerationRequest) -> list[SamplingParams]:
    """The ``SamplingParams`` of each of a prompt's ``n`` sequences: ``gen.sampling`` with its grammar.

    A seeded request's sequence ``i`` draws with ``seed + i`` (modulo ``2**63``).
    The ``response_format`` is compiled once for all of them; one the engine
    cannot serve (a schema it cannot compile, no grammar library) is a 400 naming it.
    """
    base = gen.sampling
    structured = _structured(gen.response_format)
    if structured is not None:
        base = replace(base, structured=structured)
    if base.seed is None:
        return [base] * gen.n
    return [replace(base, seed=(base.seed + i) % SEED_LIMIT) for i in range(gen.n)]


def _structured(spec: tuple[str, str | None] | None) -> StructuredOutput | None:
    """The engine's ``StructuredOutput`` of a request's ``response_format``, or None (400 naming it if refused)."""
    if spec is None:
        return None
    try:
        from kvpool.engine.structured import StructuredOutput
    except ImportError as exc:  # an emulated replica on a torch-free install: no engine to follow a grammar
        raise APIError(
            400,
            f"'response_format' cannot be served here: {exc.name or exc} is not installed",
            param="response_format",
            code="invalid_value",
        ) from None

    kind, schema = spec
    try:
        return StructuredOutput(kind, schema)
    except KVPoolError as exc:
        raise APIError(
            400, f"'response_format' cannot be served: {exc}", param="response_format", code="invalid_value"
        ) from None


def check_tools(gen: GenerationRequest, template_supports_tools: bool) -> None:
    """Refuse (400 naming ``tools``) a request that gives tools: a model whose chat template has no place
    for them cannot be told of them, and tool calls are not parsed out of any model's answer yet."""
    if not gen.tools:
        return
    if not template_supports_tools:
        raise APIError(
            400,
            "'tools' cannot be served: the model's chat template does not support tools",
            param="tools",
            code="unsupported_parameter",
        )
    raise APIError(
        400,
        "'tools' is not supported by this server yet: the model's chat template takes tools, but tool calls "
        "are not parsed from its answers",
        param="tools",
        code="unsupported_parameter",
    )


@dataclass(slots=True)
class _Sequence:
    """What one choice has received so far."""

    index: int
    prompt: int
    pieces: list[str] = field(default_factory=list)
    logprobs: list[Any] = field(default_factory=list)
    output: RequestOutput | None = None


@dataclass(slots=True, kw_only=True)
class Plan:
    """A request's engine requests: their jobs and which choice each one is."""

    gen: GenerationRequest
    response_id: str
    jobs: list[Job]
    echoes: list[str]  # per prompt: the text echoed before its choices ("" without echo)
    sequences: dict[str, _Sequence]  # engine request ID -> its choice
    prompt_tokens: list[int] = field(default_factory=list)  # per prompt, once admitted

    @property
    def request_ids(self) -> list[str]:
        return [job.request_id for job in self.jobs]

    @property
    def tenant(self) -> str | None:
        return self.jobs[0].tenant if self.jobs else None

    def usage(self) -> Usage:
        completion = sum(len(s.output.output_token_ids) for s in self.sequences.values() if s.output is not None)
        cached = [0] * len(self.prompt_tokens)
        for seq in self.sequences.values():
            if seq.output is not None:
                cached[seq.prompt] = max(
                    cached[seq.prompt], min(seq.output.num_cached_tokens, self.prompt_tokens[seq.prompt])
                )
        return Usage(sum(self.prompt_tokens), completion, sum(cached))

    def admitted(self, counts: Sequence[int]) -> None:
        n = self.gen.n
        self.prompt_tokens = [counts[p * n] for p in range(len(counts) // n)]


async def plan_jobs(
    gen: GenerationRequest, response_id: str, salt: str | None, prompts: TokenizerThread, tenant: str | None = None
) -> Plan:
    """The engine requests of ``tenant``'s ``gen``: every prompt tokenized (on the tokenizer thread, in
    ``tenant``'s turn), ``n`` jobs each."""
    params = sequence_params(gen)
    sources: list[Any] = list(gen.prompts) if gen.messages is None else [None]
    jobs, echoes, sequences = [], [], {}
    for p, source in enumerate(sources):
        try:
            token_ids = await prompts.token_ids(gen, source, tenant=tenant)
        except KVPoolError as exc:
            param = "messages" if gen.messages is not None else ("prompt" if len(sources) == 1 else f"prompt[{p}]")
            raise APIError(400, str(exc), param=param, code="invalid_prompt") from None
        if gen.echo:
            echoes.append(source if isinstance(source, str) else await prompts.decode(token_ids, tenant=tenant))
        else:
            echoes.append("")
        for i in range(gen.n):
            request_id = f"{response_id}-{p}-{i}" if len(sources) * gen.n > 1 else response_id
            jobs.append(
                Job(request_id=request_id, prompt_token_ids=token_ids, params=params[i], cache_salt=salt, tenant=tenant)
            )
            sequences[request_id] = _Sequence(index=p * gen.n + i, prompt=p)
    return Plan(gen=gen, response_id=response_id, jobs=jobs, echoes=echoes, sequences=sequences)


def _failure(output: RequestOutput) -> APIError:
    assert output.error is not None  # called for failed requests
    return APIError(500, f"the request failed: {output.error.cause}", type="server_error", code="request_failed")


async def collect(plan: Plan, stream: asyncio.Queue[Any]) -> None:
    """Every delta of ``plan``'s requests into its sequences, until all have finished."""
    left = len(plan.sequences)
    while left:
        item = await stream.get()
        if isinstance(item, BaseException):
            raise APIError(500, f"the request failed: {item}", type="server_error")
        seq = plan.sequences[item.request_id]
        seq.pieces.append(item.text)
        if item.logprobs:
            seq.logprobs.extend(item.logprobs)
        if item.output is not None:
            if item.output.error is not None:
                raise _failure(item.output)
            seq.output = item.output
            left -= 1


async def whole_body(plan: Plan, created: int, model: str, prompts: TokenizerThread) -> dict[str, Any]:
    """The answer of a request whose sequences have all finished."""
    endpoint = plan.gen.endpoint
    choices = []
    for seq in sorted(plan.sequences.values(), key=lambda s: s.index):
        assert seq.output is not None  # collected
        echo = plan.echoes[seq.prompt]
        logprobs = None
        if plan.gen.sampling.logprobs is not None:
            texts = await prompts.token_texts(_token_ids(seq.logprobs), tenant=plan.tenant)
            logprobs = logprobs_body(endpoint, seq.logprobs, texts.__getitem__)
        choices.append(
            Choice(
                index=seq.index,
                text=echo + "".join(seq.pieces),
                finish_reason=finish_reason(seq.output),
                stop_reason=seq.output.stop_reason,
                logprobs=logprobs,
            )
        )
    return completion_body(endpoint, plan.response_id, created, model, choices, plan.usage())


def _token_ids(entries: Sequence[Any]) -> list[int]:
    ids = []
    for entry in entries:
        ids.append(entry.token_id)
        ids.extend(tid for tid, _ in entry.top)
    return ids


async def events(
    plan: Plan,
    created: int,
    model: str,
    stream: asyncio.Queue[Any],
    prompts: TokenizerThread,
    sse: Callable[[Any], bytes],
    on_finish: Callable[[], None],
) -> AsyncIterator[bytes]:
    """The server-sent events of a streamed request; ``on_finish`` is called once every sequence has ended."""
    gen = plan.gen
    endpoint = gen.endpoint

    def chunk(choice: Choice, role: bool = False) -> bytes:
        return sse(chunk_body(endpoint, plan.response_id, created, model, choice=choice, role=role))

    offsets = {seq.index: len(plan.echoes[seq.prompt]) for seq in plan.sequences.values()}
    for seq in sorted(plan.sequences.values(), key=lambda s: s.index):
        if endpoint is GenerationEndpoint.CHAT:
            yield chunk(Choice(index=seq.index, text=""), role=True)
        elif plan.echoes[seq.prompt]:
            yield chunk(Choice(index=seq.index, text=plan.echoes[seq.prompt]))
    left = len(plan.sequences)
    while left:
        item = await stream.get()
        if isinstance(item, BaseException):
            on_finish()  # the engine dropped them already
            yield sse(error_body(f"the request failed: {item}", type="server_error"))
            yield sse("[DONE]")
            return
        delta: RequestDelta = item
        seq = plan.sequences[delta.request_id]
        output = delta.output
        if output is not None and output.error is not None:
            # The engine finished this one with its error; the caller aborts the others.
            if delta.text:
                yield chunk(Choice(index=seq.index, text=delta.text))
            yield sse(_failure(output).body)
            yield sse("[DONE]")
            return
        if output is not None:
            seq.output = output
            left -= 1
            if left == 0:
                on_finish()
        logprobs = None
        if gen.sampling.logprobs is not None and delta.logprobs:
            texts = await prompts.token_texts(_token_ids(delta.logprobs), tenant=plan.tenant)
            logprobs = logprobs_body(endpoint, delta.logprobs, texts.__getitem__, text_offset=offsets[seq.index])
            offsets[seq.index] += sum(len(texts[e.token_id]) for e in delta.logprobs)
        reason = None if output is None else finish_reason(output)
        if delta.text or reason is not None or logprobs is not None:
            stop_reason = None if output is None else output.stop_reason
            yield chunk(
                Choice(
                    index=seq.index, text=delta.text, finish_reason=reason, stop_reason=stop_reason, logprobs=logprobs
                )
            )
    if gen.include_usage:
        yield sse(chunk_body(endpoint, plan.response_id, created, model, usage=plan.usage()))
    yield sse("[DONE]")
