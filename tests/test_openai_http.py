"""kvpool.openai_http: the HTTP rules kvpool serve and kvpool route share, each refusal with its status and body."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from kvpool.openai_http import APIError, is_loopback, parse_json, read_body, require_operator, tenant_for
from kvpool.tenancy import DEFAULT_TENANT, KeyRing

KEYS = KeyRing.from_mapping({"sk-alice": "alice"})
ADMIN = KeyRing.from_mapping({"sk-admin": "admin"})


class _Request:
    """Headers and a body's chunks; reading past ``readable`` chunks fails the test."""

    def __init__(self, headers: dict[str, str], chunks: list[bytes], readable: int | None = None) -> None:
        self.headers = headers
        self._chunks = chunks
        self._readable = len(chunks) if readable is None else readable

    async def stream(self) -> AsyncIterator[bytes]:
        for i, chunk in enumerate(self._chunks):
            assert i < self._readable, "read more of the body than needed"
            yield chunk


def test_the_tenant_comes_from_the_bearer_key() -> None:
    assert tenant_for(None, None) == DEFAULT_TENANT
    assert tenant_for(KEYS, "Bearer sk-alice") == "alice"
    with pytest.raises(APIError, match="missing API key") as missing:
        tenant_for(KEYS, None)
    with pytest.raises(APIError, match="incorrect API key") as wrong:
        tenant_for(KEYS, "Bearer sk-mallory")
    assert missing.value.status == wrong.value.status == 401
    assert wrong.value.body["error"]["type"] == "authentication_error"


@pytest.mark.parametrize(
    ("host", "admin", "authorization", "status"),
    [
        ("127.0.0.1", None, None, None),
        ("::ffff:127.0.0.2", None, None, None),
        ("10.0.0.5", None, "Bearer sk-admin", 403),
        ("10.0.0.5", ADMIN, "Bearer sk-alice", 401),
        ("10.0.0.5", ADMIN, "Bearer sk-admin", None),
        (None, ADMIN, None, 401),
    ],
)
def test_operator_routes_open_on_the_loopback_or_to_an_admin_key(
    host: str | None, admin: KeyRing | None, authorization: str | None, status: int | None
) -> None:
    if status is None:
        require_operator(host, admin, authorization)
        return
    with pytest.raises(APIError) as caught:
        require_operator(host, admin, authorization)
    assert caught.value.status == status
    assert is_loopback(host) is False


def test_a_body_over_the_limit_is_refused_as_soon_as_it_is_known() -> None:
    assert asyncio.run(read_body(_Request({}, [b"ab", b"cd"]), 4)) == b"abcd"
    with pytest.raises(APIError, match="the request body is 11 bytes; the limit is 10") as declared:
        asyncio.run(read_body(_Request({"content-length": "11"}, [b"x" * 11], readable=0), 10))
    with pytest.raises(APIError, match="over 10 bytes") as streamed:
        asyncio.run(read_body(_Request({}, [b"x" * 6, b"x" * 6, b"never read"], readable=2), 10))
    assert declared.value.status == streamed.value.status == 413
    with pytest.raises(APIError, match="Content-Length is not a byte count: '12abc'") as bad:
        asyncio.run(read_body(_Request({"content-length": "12abc"}, [], readable=0), 10))
    assert bad.value.status == 400


def test_json_that_is_not_json_or_nests_too_deeply_is_a_400_naming_the_body() -> None:
    assert parse_json(b'{"a": [1]}') == {"a": [1]}
    with pytest.raises(APIError, match="not valid JSON") as invalid:
        parse_json(b"{nope")
    with pytest.raises(APIError, match="nested too deeply") as deep:
        parse_json(b"[" * 100_000 + b"]" * 100_000)
    for refusal in (invalid.value, deep.value):
        assert refusal.status == 400 and refusal.body["error"]["param"] == "body"
