"""``POST /v1/completions`` and ``POST /v1/chat/completions``: a request checked, admitted, answered or streamed.

Every way a request can end early (a refusal after admission, a client that
goes away, a failed step) aborts it on the engine, so its blocks go back to
the pool at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from typing import TYPE_CHECKING, Any

from kvpool.errors import KVPoolError, RequestTooLarge
from kvpool.openai_http.errors import APIError, error_body
from kvpool.openai_http.protocol import GenerationEndpoint, GenerationRequest, parse_generation
from kvpool.serve.engine_loop import EngineStopped, QueueFull
from kvpool.serve.generation import Plan, check_tools, collect, events, plan_jobs, whole_body

if TYPE_CHECKING:
    from starlette.requests import Request
    from starlette.responses import Response
    from starlette.types import Receive, Scope, Send

    from kvpool.serve.server_state import ServerState

__all__ = ["EventStream", "GenerationRoutes"]

_LOGGER = logging.getLogger("kvpool.serve")


def _sse(payload: Mapping[str, Any] | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class EventStream:
    """A server-sent event response that stops (and closes its source) as soon as the client goes away.

    It listens for ``http.disconnect`` while it streams, whatever the ASGI
    server's version, so a client that leaves while its request is still
    waiting (nothing sent yet) is noticed too.
    """

    def __init__(self, events: AsyncIterator[bytes], on_abandon: Callable[[], None]) -> None:
        self._events = events
        self._on_abandon = on_abandon  # a stream cut short (even before it began) calls this

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        done = asyncio.Event()

        async def stream() -> None:
            headers = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            async with contextlib.aclosing(self._events) as events:  # type: ignore[type-var]  # an async generator
                async for chunk in events:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            done.set()

        streamer = asyncio.ensure_future(stream())
        listener = asyncio.ensure_future(_disconnected(receive))
        try:
            await asyncio.wait({streamer, listener}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (streamer, listener):
                task.cancel()
            await asyncio.gather(streamer, listener, return_exceptions=True)
            if not done.is_set():
                self._on_abandon()
        failure = None if streamer.cancelled() else streamer.exception()
        if failure is not None and not isinstance(failure, OSError):  # a closed connection is the client leaving
            raise failure


class GenerationRoutes:
    """The two generation routes over one server's state: checking, admission, the answer or its stream."""

    def __init__(self, state: ServerState) -> None:
        self.state = state

    async def completions(self, request: Request) -> Response | EventStream:
        return await self.generate(request, GenerationEndpoint.COMPLETIONS)

    async def chat(self, request: Request) -> Response | EventStream:
        return await self.generate(request, GenerationEndpoint.CHAT)

    async def generate(self, request: Request, endpoint: GenerationEndpoint) -> Response | EventStream:
        """The request parsed, planned and admitted; then its stream, or its whole answer once finished."""
        state = self.state
        tenant = state.tenant(request)
        gen = parse_generation(endpoint, await state.read_json(request))
        response_id = f"{endpoint.id_prefix}-{uuid.uuid4().hex}"
        plan = await self.plan(tenant, gen, response_id)
        stream = await self.admit(plan)
        created = int(time.time())
        if gen.stream:
            return self._streamed(plan, stream, created)
        return await self._answered(request, plan, stream, created)

    # -- before the engine -------------------------------------------------------------------

    async def plan(self, tenant: str, gen: GenerationRequest, response_id: str) -> Plan:
        """The request's engine requests: fields checked, then every prompt tokenized on the tokenizer thread."""
        state = self.state
        state.check_model(gen)
        check_tools(gen, state.loop.engine.chat_template_supports_tools)
        self._check_sizes(gen)
        try:
            salt = state.config.salts.cache_salt(tenant, gen.cache_salt)
        except KVPoolError as exc:
            raise APIError(400, str(exc), param="cache_salt", code="invalid_value") from None
        return await plan_jobs(gen, response_id, salt, state.prompts, tenant)

    def _check_sizes(self, gen: GenerationRequest) -> None:
        """``max_tokens`` within the context, stop tokens in the vocabulary, never more sequences than may wait."""
        state = self.state
        max_tokens = gen.sampling.max_tokens
        if max_tokens is not None and max_tokens > state.max_model_len:
            raise APIError(
                400,
                f"'max_tokens' ({max_tokens}) cannot be greater than the context of {state.max_model_len} tokens",
                param="max_tokens",
                code="invalid_value",
            )
        if gen.sampling.stop_token_ids:
            try:
                state.loop.engine.check_token_ids(gen.sampling.stop_token_ids, "stop_token_ids")
            except KVPoolError as exc:
                raise APIError(400, str(exc), param="stop_token_ids", code="invalid_value") from None
        sequences = gen.n * max(1, len(gen.prompts))
        if sequences > state.config.max_waiting:  # never admissible: a 429 would invite a retry in vain
            raise APIError(
                400,
                f"the request asks for {sequences} sequences; this server queues at most "
                f"{state.config.max_waiting} waiting",
                param="n",
                code="invalid_value",
            )

    async def admit(self, plan: Plan) -> asyncio.Queue[Any]:
        """``plan``'s requests queued on the engine, all or none; a refusal is the matching API error."""
        state = self.state
        state.metrics.expect(plan.jobs, plan.gen.n)  # before the engine thread can finish them
        try:
            counts, stream = await state.loop.submit_all(plan.jobs)
        except QueueFull as exc:
            state.metrics.not_admitted(plan.jobs, queue_full=True)
            raise APIError(
                429,
                str(exc),
                type="rate_limit_error",
                code="queue_full",
                headers={"Retry-After": str(state.config.retry_after)},
            ) from None
        except EngineStopped as exc:
            state.metrics.not_admitted(plan.jobs)
            raise APIError(503, str(exc), type="server_error", code="unavailable") from None
        except RequestTooLarge as exc:
            state.metrics.not_admitted(plan.jobs)
            raise APIError(400, str(exc), param=exc.param, code="request_too_large") from None
        except KVPoolError as exc:
            state.metrics.not_admitted(plan.jobs)
            raise APIError(400, str(exc), param="prompt", code="invalid_prompt") from None
        plan.admitted(counts)
        if state.config.log_requests:
            _LOGGER.info(
                "request %s: %d prompt(s) of %s tokens, %d sequence(s), %s",
                plan.response_id,
                len(plan.prompt_tokens),
                "/".join(map(str, plan.prompt_tokens)),
                len(plan.jobs),
                plan.jobs[0].params,
            )
        return stream

    # -- answers -----------------------------------------------------------------------------------

    def _streamed(self, plan: Plan, stream: asyncio.Queue[Any], created: int) -> EventStream:
        """The answer as server-sent events; a stream abandoned before its end aborts the request."""
        finished = False

        def on_finish() -> None:
            nonlocal finished
            finished = True

        def abandon() -> None:
            if not finished:
                self.abort(plan)

        model = self.state.config.model_name
        chunks = events(plan, created, model, stream, self.state.prompts, _sse, on_finish)
        return EventStream(self._logged(plan, chunks), abandon)

    async def _answered(self, request: Request, plan: Plan, stream: asyncio.Queue[Any], created: int) -> Response:
        """The whole answer once every sequence finished; a client gone first aborts it (499)."""
        from starlette.responses import JSONResponse

        collected = asyncio.ensure_future(collect(plan, stream))
        gone = asyncio.ensure_future(_disconnected(request.receive))
        try:
            await asyncio.wait({collected, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            left = not collected.done()
            if left:
                collected.cancel()
            if left or collected.cancelled() or collected.exception() is not None:
                self.abort(plan)  # finished ones are left alone
            await asyncio.gather(collected, gone, return_exceptions=True)
        if left:
            _LOGGER.info("request %s: the client went away before its answer; aborted", plan.response_id)
            return JSONResponse(error_body("the client went away"), status_code=499)
        collected.result()  # raises the APIError of a failed request
        self._log_finished(plan)
        model = self.state.config.model_name
        return JSONResponse(await whole_body(plan, created, model, self.state.prompts))

    def abort(self, plan: Plan) -> None:
        for request_id in plan.request_ids:
            self.state.loop.abort(request_id)

    async def _logged(self, plan: Plan, chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        async with contextlib.aclosing(chunks) as source:  # type: ignore[type-var]  # an async generator
            async for chunk in source:
                yield chunk
        self._log_finished(plan)

    def _log_finished(self, plan: Plan) -> None:
        if not self.state.config.log_requests:
            return
        from kvpool.engine.outputs import request_log_line

        for seq in plan.sequences.values():
            if seq.output is not None:
                _LOGGER.info("%s", request_log_line(seq.output))
