"""Who is asking, read from the headers before the body: a tenant's API key, an operator's place or key."""

from __future__ import annotations

import ipaddress

from kvpool.openai_http.errors import APIError
from kvpool.tenancy import DEFAULT_TENANT, KeyRing, bearer_token

__all__ = ["is_loopback", "require_operator", "tenant_for", "tokenizer_turn"]


def is_loopback(host: str | None) -> bool:
    """Whether ``host`` (a peer address as the ASGI server gives it) is this machine's loopback interface.

    IPv4 ``127.0.0.0/8``, IPv6 ``::1`` and IPv4-mapped ``::ffff:127.x.y.z``; a name or
    anything that is not an IP address is not loopback.
    """
    if not host:
        return False
    try:
        address = ipaddress.ip_address(host.split("%", 1)[0])  # a scope ID (fe80::1%eth0) is not part of it
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped.is_loopback
    return address.is_loopback


def tenant_for(keys: KeyRing | None, authorization: str | None) -> str:
    """The tenant the ``Authorization`` header's API key names; every request is one tenant's without ``keys``.

    Raises:
        APIError: 401 for a missing or unknown key.
    """
    if keys is None:
        return DEFAULT_TENANT
    key = bearer_token(authorization)
    if key is None:
        raise APIError(
            401,
            "missing API key: send it as 'Authorization: Bearer KEY'",
            type="authentication_error",
            code="invalid_api_key",
        )
    tenant = keys.name_for(key)
    if tenant is None:
        raise APIError(401, "incorrect API key", type="authentication_error", code="invalid_api_key")
    return tenant


def tokenizer_turn(keys: KeyRing | None, authorization: str | None) -> str | None:
    """Whose turns on the tokenizer thread a ``/tokenize`` or ``/detokenize`` request takes; never refuses.

    As in vLLM, whose ``--api-key`` guards only the ``/v1`` routes, these need no
    key: they read no tenant's data (no cache, no request of anyone's), only the
    model's tokenizer. A valid key's request takes its tenant's turns; every
    request without one (no key, or a key that names nobody: it is not checked,
    so nothing tells a valid key from a wrong one) shares a single turn (None), so
    keyless callers together wait behind each tenant's next task, never in front
    of its backlog. Without ``keys`` every request is the default tenant's.
    """
    if keys is None:
        return DEFAULT_TENANT
    return keys.name_for(bearer_token(authorization))


def require_operator(client_host: str | None, admin_keys: KeyRing | None, authorization: str | None) -> None:
    """Let through the loopback interface, or elsewhere an admin key: what sees every tenant's figures.

    Raises:
        APIError: 403 off the loopback interface without admin keys configured; 401 without a valid admin key.
    """
    if is_loopback(client_host):
        return
    if admin_keys is None:
        raise APIError(403, "this route is open on the loopback interface only", type="permission_error")
    if admin_keys.name_for(bearer_token(authorization)) is None:
        raise APIError(401, "this route needs an admin key", type="authentication_error", code="invalid_api_key")
