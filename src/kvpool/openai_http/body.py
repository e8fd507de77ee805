"""A request body under a byte limit, and its JSON with too-deep nesting refused."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Mapping
from typing import Protocol

from kvpool.openai_http.errors import APIError

__all__ = ["BodySource", "parse_json", "read_body"]


class BodySource(Protocol):
    """What :func:`read_body` reads: a request's headers and its body's chunks (Starlette's ``Request``)."""

    @property
    def headers(self) -> Mapping[str, str]: ...

    def stream(self) -> AsyncIterator[bytes]: ...


async def read_body(request: BodySource, limit: int) -> bytes:
    """The body, refused with 413 as soon as it is known to be over ``limit`` bytes (nothing more is read).

    A declared ``Content-Length`` over the limit is refused before the body is read, one
    that is not a byte count with 400; a body sent in chunks is refused as it passes the limit.
    """
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.strip().isdigit():
            raise APIError(400, f"Content-Length is not a byte count: {declared!r}", code="invalid_request")
        if int(declared) > limit:
            raise APIError(
                413, f"the request body is {int(declared)} bytes; the limit is {limit}", code="request_too_large"
            )
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise APIError(413, f"the request body is over {limit} bytes", code="request_too_large")
    return bytes(body)


def parse_json(body: bytes | bytearray) -> object:
    """The body's JSON value; 400 for text that is not JSON or nests deeper than the decoder goes."""
    try:
        return json.loads(body)
    except RecursionError:
        raise APIError(400, "the request body's JSON is nested too deeply", param="body", code="invalid_json") from None
    except ValueError as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc}", param="body", code="invalid_json") from None
