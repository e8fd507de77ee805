"""The engine beside the HTTP loop: one thread owns the engine; requests reach it through a queue.

::

    HTTP handlers (asyncio)                      engine thread
    ----------------------                      -------------
    submit(job) ---- inbox (thread-safe) ---->  admit: check, queue in the scheduler
       await admission  <-- call_soon_threadsafe --  (or the error that refused it)
    abort(id)   ---- inbox ---------------------->  engine.abort: blocks freed
    async for delta in stream  <-- one call_soon_threadsafe per step --  step(): deltas

Every engine call happens on the engine thread, so the engine needs no lock.
A job reaches it as token IDs: rendering a chat template and tokenizing are
done before :meth:`EngineLoop.submit` (the server does them on a tokenizer
thread of its own), so a huge prompt never holds up the steps of the others.
The thread steps while any request is unfinished, and between steps it takes
every command waiting in the inbox (admissions and aborts), so a request
arriving mid-batch joins at the next step and an abort frees its blocks
before the next step is scheduled. With nothing to do the thread sleeps on the
inbox. Deltas are handed to the event loop once per step for all requests.

A request that fails in a step comes back from
:meth:`LLMEngine.step <kvpool.engine.llm_engine.LLMEngine.step>` (or an emulated engine's) as a finished
delta whose ``output.error`` says why; its stream gets that delta like any
other, and every other request goes on. Should a step itself raise (a bug in
the engine, not a request's doing), every open stream gets the error and the
thread goes on serving.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from kvpool.checks import check_int
from kvpool.errors import RequestStateError, ServiceError

if TYPE_CHECKING:
    from kvpool.engine.outputs import RequestDelta
    from kvpool.engine.sampling import SamplingParams
    from kvpool.serve.served_engine import ServedEngine

__all__ = ["EngineLoop", "Job", "QueueFull", "StepHook", "StreamItem"]

_LOGGER = logging.getLogger("kvpool.serve")

T = TypeVar("T")

#: Called on the engine thread after every step with the engine and the step's deltas.
StepHook = Callable[["ServedEngine", "Sequence[RequestDelta]"], None]
#: What a request's stream yields: a delta, or the error that ended the request.
StreamItem = "RequestDelta | BaseException"


class QueueFull(ServiceError):
    """The tenant's waiting queue holds ``max_waiting`` requests: come back later."""

    def __init__(self, max_waiting: int) -> None:
        super().__init__(f"your waiting queue on this server is full ({max_waiting} requests); retry later")
        self.max_waiting = max_waiting


class EngineStopped(ServiceError):
    """The engine thread has stopped; no request is served any more."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Job:
    """A request as the engine takes it: its prompt already tokenized."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    cache_salt: str | None
    tenant: str | None = None


def _resolve(future: asyncio.Future[Any], value: Any) -> None:
    """Settle ``future`` (in the event loop) unless its waiter gave up on it."""
    if future.done():
        return
    if isinstance(value, BaseException):
        future.set_exception(value)
    else:
        future.set_result(value)


def _deliver(items: list[tuple[asyncio.Queue[Any], Any]]) -> None:
    for stream, item in items:
        stream.put_nowait(item)


class EngineLoop:
    """Runs ``engine`` on a thread of its own; the async side submits, streams and aborts.

    Args:
        engine: the engine; after :meth:`start` only the engine thread touches it.
        max_waiting: requests the scheduler may hold waiting for one tenant;
            one more of that tenant is refused with :class:`QueueFull` (so one
            tenant's backlog never fills another's queue).
        max_request_tokens: the most tokens one submission (one API request:
            its prompts times ``n``) may ask for; None: the engine's pool
            tokens (see :meth:`LLMEngine.add_requests`' ``max_output_tokens``).
        hooks: called on the engine thread after each step (metrics, events).
    """

    def __init__(
        self,
        engine: ServedEngine,
        *,
        max_waiting: int,
        max_request_tokens: int | None = None,
        hooks: Sequence[StepHook] = (),
    ) -> None:
        if max_request_tokens is not None:
            check_int("max_request_tokens", max_request_tokens)
        self.engine = engine
        self.max_waiting = max_waiting
        #: What one submission may ask for (:meth:`LLMEngine.add_requests`' ``max_output_tokens``).
        self.max_request_tokens = engine.pool_tokens if max_request_tokens is None else max_request_tokens
        self._hooks = tuple(hooks)
        self._inbox: queue.SimpleQueue[Callable[[], object] | None] = queue.SimpleQueue()
        self._streams: dict[str, asyncio.Queue[Any]] = {}  # engine thread only
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False

    # -- life cycle (event loop side) -------------------------------------------------------

    def start(self) -> None:
        """Start the engine thread; call from the event loop that will await the results."""
        if self._thread is not None:
            raise RequestStateError("the engine loop is already started")
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="kvpool-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the thread after its current step; requests still running are aborted."""
        thread = self._thread
        if thread is None:
            return
        self._inbox.put(None)
        thread.join(timeout)
        self._thread = None

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # -- requests (event loop side) -----------------------------------------------------------

    async def submit(self, job: Job) -> tuple[int, asyncio.Queue[Any]]:
        """Queue ``job`` on the engine; returns its prompt's token count and its stream (see :meth:`submit_all`)."""
        [count], stream = await self.submit_all([job])
        return count, stream

    async def submit_all(self, jobs: Sequence[Job]) -> tuple[list[int], asyncio.Queue[Any]]:
        """Queue ``jobs`` (of one tenant) on the engine in one ``add_requests`` (all or none); their prompt
        sizes and one stream.

        The stream yields every job's deltas (each names its request) and, should
        a step fail, the error. Jobs with the same prompt share its blocks
        through the prefix cache: they are admitted together, so the prompt is
        computed once.

        Raises what refused them: :class:`QueueFull`, or the engine's
        ``KVPoolError`` (a prompt too long for the context, a bad token, ...).
        If the caller is cancelled while waiting, the requests are aborted.
        """
        loop = self._require_loop()
        admitted: asyncio.Future[list[int]] = loop.create_future()
        stream: asyncio.Queue[Any] = asyncio.Queue()
        jobs = list(jobs)
        self._inbox.put(lambda: self._admit(jobs, admitted, stream))
        try:
            return await admitted, stream
        except asyncio.CancelledError:
            for job in jobs:  # queued after the admission: it finds the requests if they were admitted
                self.abort(job.request_id)
            raise

    def abort(self, request_id: str) -> None:
        """Abort a request (thread-safe, returns at once); a finished or unknown one is left alone."""
        self._inbox.put(lambda: self._abort(request_id))

    def run_soon(self, fn: Callable[[ServedEngine], object]) -> None:
        """Run ``fn(engine)`` on the engine thread before its next step (thread-safe, returns at once)."""
        self._inbox.put(lambda: fn(self.engine))

    async def call(self, fn: Callable[[ServedEngine], T]) -> T:
        """``fn(engine)`` run on the engine thread between steps; its result (or error)."""
        loop = self._require_loop()
        done: asyncio.Future[T] = loop.create_future()

        def run() -> None:
            try:
                value: Any = fn(self.engine)
            except Exception as exc:
                value = exc
            loop.call_soon_threadsafe(_resolve, done, value)

        self._inbox.put(run)
        return await done

    def _require_loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None or not self.running:
            raise EngineStopped("the engine is not running")
        return self._loop

    # -- the engine thread ------------------------------------------------------------------

    def _admit(self, jobs: list[Job], admitted: asyncio.Future[list[int]], stream: asyncio.Queue[Any]) -> None:
        engine = self.engine
        try:
            if self._stopping:
                raise EngineStopped("the server is shutting down")
            tenants = {job.tenant for job in jobs}
            if len(tenants) > 1:
                raise RequestStateError(f"one submission is one tenant's, got jobs of {sorted(map(str, tenants))}")
            tenant = jobs[0].tenant if jobs else None
            if engine.scheduler.num_waiting_for(tenant) + len(jobs) > self.max_waiting:
                raise QueueFull(self.max_waiting)
            engine.add_requests(
                [job.prompt_token_ids for job in jobs],
                [job.params for job in jobs],
                request_ids=[job.request_id for job in jobs],
                cache_salts=[job.cache_salt for job in jobs],
                tenant=tenant,
                max_output_tokens=self.max_request_tokens,
            )
        except Exception as exc:
            self._send(_resolve, admitted, exc)
            return
        for job in jobs:
            self._streams[job.request_id] = stream
        self._send(_resolve, admitted, [engine.scheduler.request(job.request_id).num_prompt_tokens for job in jobs])

    def _abort(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        self.engine.abort(request_id)

    def _send(self, fn: Callable[..., None], *args: Any) -> None:
        assert self._loop is not None  # set before the thread starts
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the event loop has closed: nobody is listening any more
            pass

    def _run(self) -> None:
        engine = self.engine
        try:
            while True:
                commands = [] if engine.has_unfinished_requests() else [self._inbox.get()]
                while True:
                    try:
                        commands.append(self._inbox.get_nowait())
                    except queue.Empty:
                        break
                for command in commands:
                    if command is None:
                        return
                    try:
                        command()
                    except Exception:  # a command's own failure must not stop the engine thread
                        _LOGGER.exception("an engine command failed")
                if engine.has_unfinished_requests():
                    self._step()
                else:
                    self._run_hooks([])  # the figures follow admissions and aborts while idle too
        finally:
            self._shut_down()

    def _shut_down(self) -> None:
        """Refuse what is still queued, abort what runs, and tell every open stream."""
        self._stopping = True
        while True:
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                break
            if command is not None:
                command()  # an admission now refuses with EngineStopped
        stopped = EngineStopped("the server is shutting down")
        open_streams = [(stream, stopped) for stream in {id(q): q for q in self._streams.values()}.values()]
        for request_id in list(self._streams):
            self._abort(request_id)
        self._send(_deliver, open_streams)

    def _run_hooks(self, deltas: Sequence[RequestDelta]) -> None:
        for hook in self._hooks:
            try:
                hook(self.engine, deltas)
            except Exception:
                _LOGGER.exception("a step hook failed")

    def _step(self) -> None:
        engine = self.engine
        try:
            deltas = engine.step()
        except Exception as exc:
            _LOGGER.exception("an engine step failed; its requests are dropped")
            failed = [(stream, exc) for stream in {id(q): q for q in self._streams.values()}.values()]
            for request_id in list(self._streams):
                engine.abort(request_id)
            self._streams.clear()
            self._send(_deliver, failed)
            return
        self._run_hooks(deltas)
        items = []
        for delta in deltas:
            stream = self._streams.get(delta.request_id)
            if stream is None:
                continue
            items.append((stream, delta))
            if delta.finished:
                del self._streams[delta.request_id]
        if items:
            self._send(_deliver, items)
