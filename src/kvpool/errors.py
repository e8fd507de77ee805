"""Exceptions raised by kvpool, rooted by who is at fault.

An expected shortage is not an exception: ``allocate_slots`` returns ``None``
when the free blocks cannot cover a step, and the caller preempts or waits.
Every exception kvpool defines sits under one of five roots, each naming who
is at fault:

1. **The caller** (:class:`KVPoolError`, a ``ValueError``): a Python caller
   passed a wrong value or made a call the state forbids. The message names
   the value; nothing has changed when it is raised, and the pool's
   invariants hold afterwards.
2. **Data from outside** (:class:`ExternalDataError`, a ``ValueError`` too,
   but not a ``KVPoolError``): bytes that came from another process or a file
   are malformed or must not be trusted (a tier entry, a KV event message, a
   trace). The caller did nothing wrong: a tier turns a bad entry into a miss,
   an event subscriber skips the message, a command reports the file and line.
   It stays a ``ValueError`` as Python's own decoders' errors do
   (``json.JSONDecodeError``, ``UnicodeDecodeError``), so ``except ValueError``
   still catches every bad input, and ``except KVPoolError`` only misuse.
3. **The service** (:class:`ServiceError`, a ``RuntimeError``): the server is
   overloaded or stopped, or refuses a remote client's request with an HTTP
   error (``APIError``, whose status says whose fault it is: 4xx the client's,
   429 and 5xx the server's). Retrying later may succeed.
4. **One request in the engine** (:class:`RequestFailed`, a ``RuntimeError``):
   its logits could not be sampled, or the forward pass raised on its chunk
   alone. It is not raised: the engine hands the request back finished,
   carrying it, and every other request goes on.
5. **kvpool itself** (:class:`InvariantViolation`, an ``AssertionError``):
   internal bookkeeping is inconsistent. Its message says it is a bug; the
   pool should not be used any further.

The tree (``tests/test_errors_tree.py`` checks that it lists every exception
class of the package, under its real base)::

    ValueError
     ├── KVPoolError                  the caller: a wrong value or call
     │    ├── ConfigError             bad construction argument (block_size, algo, ...)
     │    ├── InvalidTokenError       a token ID that is not an integer in [0, 2**32)
     │    ├── RequestStateError       a call that contradicts the request's state
     │    │    └── ReadOnlyFieldError    assigning a field fixed at construction (also an AttributeError)
     │    └── CapacityError           a request that can never fit: pool or max_model_len
     │         └── RequestTooLarge    a request asking more than its server allows one request
     └── ExternalDataError            data from outside: malformed or untrusted
          ├── CorruptEntry            a KV tier entry (kvpool.tiers.entry); its kind says why
          ├── EventStreamError        a KV event message (kvpool.kv_events.wire)
          ├── SnapshotUnavailable     a replica's snapshot not answered (kvpool.router.snapshot_loader)
          └── TraceError              a trace file or record (kvpool.sim.traces)
    RuntimeError
     ├── ServiceError                 the service: overloaded, stopped, or refusing
     │    ├── QueueFull               the waiting queue is full (kvpool.serve.engine_loop)
     │    ├── EngineStopped           the engine thread has stopped (kvpool.serve.engine_loop)
     │    └── APIError                an HTTP refusal with its status (kvpool.openai_http.errors)
     └── RequestFailed                one request failed in the engine (carried by its output, not raised)
    AssertionError
     └── InvariantViolation           kvpool's own bookkeeping is inconsistent (a bug)
"""

from __future__ import annotations

__all__ = [
    "CapacityError",
    "ReadOnlyFieldError",
    "ConfigError",
    "ExternalDataError",
    "InvalidTokenError",
    "InvariantViolation",
    "KVPoolError",
    "RequestFailed",
    "RequestStateError",
    "RequestTooLarge",
    "ServiceError",
]


class KVPoolError(ValueError):
    """Base class of every error a caller can cause."""


class ConfigError(KVPoolError):
    """A construction argument is out of range or unknown."""


class InvalidTokenError(KVPoolError):
    """A token ID is not an integer in ``[0, 2**32)``."""


class RequestStateError(KVPoolError):
    """A call contradicts what the manager knows about the request."""


class ReadOnlyFieldError(RequestStateError, AttributeError):
    """An attempt to assign a field that is fixed at construction (a cache key, the prompt, an ID).

    It is also an ``AttributeError``, what Python raises for any read-only attribute.
    """


class CapacityError(KVPoolError):
    """A request can never fit: more blocks than the whole pool holds, or more tokens than ``max_model_len``."""


class RequestTooLarge(CapacityError):
    """One request (its prompts times ``n``) asks for more tokens than the server allows a request.

    Attributes:
        param: the request field at fault (``"max_tokens"`` or ``"min_tokens"``).
    """

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param

    def __reduce__(self) -> tuple[type[RequestTooLarge], tuple[str, str]]:
        return (RequestTooLarge, (str(self), self.param))


class ExternalDataError(ValueError):
    """Data from outside the process (a tier entry, an event message, a trace) is malformed or untrusted."""


class ServiceError(RuntimeError):
    """The service cannot serve now: it is overloaded, stopped, or refuses the request (retry may succeed)."""


class InvariantViolation(AssertionError):
    """kvpool's bookkeeping is inconsistent. This is a bug in kvpool."""

    def __init__(self, message: str) -> None:
        super().__init__(f"kvpool invariant violated (this is a bug in kvpool): {message}")


class RequestFailed(RuntimeError):
    """One request could not be served; the engine goes on with the others.

    Attributes:
        request_id: the request that failed.
        cause: why, in words (the sampler's reason, or the forward pass's error).
    """

    def __init__(self, request_id: str, cause: str) -> None:
        super().__init__(f"request {request_id!r} failed: {cause}")
        self.request_id = request_id
        self.cause = cause

    def __reduce__(self) -> tuple[type[RequestFailed], tuple[str, str]]:
        return (RequestFailed, (self.request_id, self.cause))
