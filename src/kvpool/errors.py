"""Exceptions raised by kvpool.

kvpool reports trouble in three tiers:

1. An expected shortage is not an exception. ``allocate_slots`` returns
   ``None`` when the free blocks cannot cover a step; the caller preempts or
   waits.
2. Caller misuse raises a :class:`KVPoolError`, a ``ValueError`` subclass whose
   message names the offending value. Nothing has changed when it is raised:
   the pool's invariants hold afterwards.
3. Internal corruption raises :class:`InvariantViolation`. Its message says it
   is a bug in kvpool; the pool should not be used any further.

Besides these, one request can fail while it is being served (its logits
cannot be sampled, or the forward pass raises on its chunk alone). That is
not raised: the engine hands the request back finished, carrying a
:class:`RequestFailed` that names it and the cause, and every other request
goes on.

::

    ValueError
     └── KVPoolError
          ├── ConfigError            bad construction argument (block_size, algo, ...)
          ├── InvalidTokenError      a token ID that is not an integer in [0, 2**32)
          ├── RequestStateError      a call that contradicts the request's state
          │    └── ReadOnlyFieldError   assigning a field fixed at construction (also an AttributeError)
          └── CapacityError          a request that can never fit: pool or max_model_len
    AssertionError
     └── InvariantViolation          kvpool's own bookkeeping is inconsistent (a bug)
    RuntimeError
     └── RequestFailed               one request could not be served (carried by its output, not raised)
"""

from __future__ import annotations

__all__ = [
    "CapacityError",
    "ReadOnlyFieldError",
    "ConfigError",
    "InvalidTokenError",
    "InvariantViolation",
    "KVPoolError",
    "RequestFailed",
    "RequestStateError",
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
