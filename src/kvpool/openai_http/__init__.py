"""The OpenAI-style HTTP surface that ``kvpool serve`` and ``kvpool route`` share.

* :mod:`.errors`: refusals as OpenAI error bodies (:class:`APIError`), with vLLM's error types.
* :mod:`.access`: who is asking, from the headers alone (before any body is read):
  API key -> tenant, and the operator routes' gate (the loopback interface or an admin key).
* :mod:`.body`: a request body read under a byte limit, and decoded as JSON with
  too-deep nesting refused.
* :mod:`.protocol` (with the pydantic models of :mod:`.schema`): the completions and
  chat request bodies checked into typed values.

Both servers ask these, so a change to authentication, a limit or an error body is made
once. Importing this package imports no web framework: a request is anything with
``headers``, ``client`` and an async ``stream()`` (Starlette's ``Request`` is one).
"""

from __future__ import annotations

from kvpool.openai_http.access import is_loopback, require_operator, tenant_for, tokenizer_turn
from kvpool.openai_http.body import parse_json, read_body
from kvpool.openai_http.errors import APIError, bad_request, error_body, error_type

__all__ = [
    "APIError",
    "bad_request",
    "error_body",
    "error_type",
    "is_loopback",
    "parse_json",
    "read_body",
    "require_operator",
    "tenant_for",
    "tokenizer_turn",
]
