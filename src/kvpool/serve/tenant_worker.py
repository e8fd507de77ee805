"""One worker thread whose queue takes turns between tenants.

A server's tokenizer is one thread (a tokenizer must not be entered by two
encodes at once), so whoever queues work there delays whoever queues after.
:class:`TenantWorker` keeps a queue per tenant and runs one task of each
tenant with work in turn (round-robin), so a tenant's backlog (many huge
prompts, each cut into pieces) delays another tenant's next task by at most
one task of each other tenant, never by the whole backlog. A task whose
waiter gave up (its future cancelled) is dropped unrun.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from kvpool.errors import ServiceError

__all__ = ["TenantWorker"]

T = TypeVar("T")

_Task = tuple[Future[Any], Callable[..., Any], tuple[Any, ...]]


class TenantWorker:
    """Runs submitted calls on one thread, taking turns between tenants (see the module docstring).

    Args:
        name: the thread's name.
    """

    def __init__(self, name: str) -> None:
        self._name = name
        self._queues: dict[str | None, deque[_Task]] = {}
        self._turns: deque[str | None] = deque()  # tenants with queued work, next turn first
        self._wake = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False

    def start(self) -> None:
        with self._wake:
            if self._thread is None and not self._closed:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()

    def close(self) -> None:
        """Stop after the running task; queued ones are cancelled."""
        with self._wake:
            self._closed = True
            for tasks in self._queues.values():
                for future, _, _ in tasks:
                    future.cancel()
            self._queues.clear()
            self._turns.clear()
            self._wake.notify_all()

    def submit(self, tenant: str | None, fn: Callable[..., T], *args: Any) -> Future[T]:
        """Queue ``fn(*args)`` in ``tenant``'s queue; its future."""
        future: Future[T] = Future()
        with self._wake:
            if self._closed:
                raise ServiceError("the tokenizer thread has stopped")
            queue = self._queues.get(tenant)
            if queue is None:
                queue = self._queues[tenant] = deque()
                self._turns.append(tenant)
            queue.append((future, fn, args))
            self._wake.notify()
        self.start()
        return future

    async def run(self, tenant: str | None, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` run in ``tenant``'s turn; cancelling the caller drops the task if it has not started."""
        return await asyncio.wrap_future(self.submit(tenant, fn, *args))

    def queued(self, tenant: str | None) -> int:
        """Tasks of ``tenant`` waiting for their turn."""
        with self._wake:
            queue = self._queues.get(tenant)
            return 0 if queue is None else len(queue)

    def _next(self) -> _Task | None:
        with self._wake:
            while not self._turns and not self._closed:
                self._wake.wait()
            if self._closed:
                return None
            tenant = self._turns.popleft()
            queue = self._queues[tenant]
            task = queue.popleft()
            if queue:
                self._turns.append(tenant)  # its next task after every other tenant's
            else:
                del self._queues[tenant]
            return task

    def _run(self) -> None:
        while (task := self._next()) is not None:
            future, fn, args = task
            if not future.set_running_or_notify_cancel():
                continue  # its waiter gave up
            try:
                result = fn(*args)
            except BaseException as exc:
                future.set_exception(exc)
            else:
                future.set_result(result)
