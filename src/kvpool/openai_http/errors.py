"""Refused requests as OpenAI-style error bodies, with the status and error type vLLM gives.

An error body is ``{"error": {"message", "type", "param", "code"}}``. The
``type`` follows vLLM's server for the same status (``BadRequestError`` for a
400, ``NotFoundError`` for a 404, ...) unless a more precise one is given;
``param`` names the field at fault; ``code`` is a short string naming the
problem (vLLM puts the status number there; OpenAI's own API a string, as here).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvpool.errors import ServiceError

__all__ = ["APIError", "bad_request", "error_body", "error_type"]

_TYPES = {
    400: "BadRequestError",
    401: "authentication_error",
    403: "permission_error",
    404: "NotFoundError",
    413: "BadRequestError",
    429: "rate_limit_error",
    499: "BadRequestError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


def error_type(status: int) -> str:
    """vLLM's error type for an HTTP status."""
    return _TYPES.get(status, "BadRequestError" if status < 500 else "InternalServerError")


class APIError(ServiceError):
    """A refused request: its HTTP status and the OpenAI-style error it is answered with."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str | None = None,
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = error_type(status) if type is None else type
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    @property
    def body(self) -> dict[str, Any]:
        return error_body(self.message, type=self.type, param=self.param, code=self.code)


def error_body(
    message: str, *, type: str = "BadRequestError", param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str = "invalid_value") -> APIError:
    """A 400 naming ``param``."""
    return APIError(400, message, param=param, code=code)
