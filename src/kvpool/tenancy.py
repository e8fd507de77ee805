"""Tenants: who sent a request, and the cache salt a server derives for it.

A request's cache salt decides which cached blocks it may hit (it enters the
first block's hash), so it is the tenant boundary of the prefix cache. A
client must never choose it: a tenant who could send another tenant's salt
would hit that tenant's blocks and learn, from ``cached_tokens`` or from time
to first token, which prompts the other tenant sent (CVE-2025-46570).

So the salt is derived on the server::

    tenant salt = HMAC-SHA256(server secret, "tenant" | name)
    request salt = HMAC-SHA256(tenant salt, "client" | client's cache_salt)   (when the client sends one)

The server secret never leaves the server, so no client can compute another
tenant's salt, and a client's own ``cache_salt`` only partitions its tenant's
blocks further: whatever it sends lands under its tenant's salt. Every part is
length-prefixed, so no two (tenant, client salt) pairs derive the same input.

API keys are held as SHA-256 digests and looked up by the digest of the key a
request presents, so the lookup's time does not depend on how much of a
stored key a guess matches.

This is the one home of these rules: the server and the router both ask it.
Standard library only.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import json
import os
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from kvpool.errors import ConfigError
from kvpool.fair_share import check_weight
from kvpool.secret_files import MIN_SECRET_BYTES, check_secret, read_secret_file

__all__ = [
    "API_KEY_FILE_EXAMPLE",
    "DEFAULT_TENANT",
    "MIN_SECRET_BYTES",
    "KeyRing",
    "SaltPolicy",
    "SecretSource",
    "bearer_token",
    "load_secret",
]

#: The tenant of every request on a server without an API key file.
DEFAULT_TENANT = "default"
#: What an API key file holds, as its errors show it.
API_KEY_FILE_EXAMPLE = '{"sk-alice-key": "alice", "sk-bob-key": {"tenant": "bob", "weight": 2}}'
_GENERATED_SECRET_BYTES = 32


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


def _framed(*parts: str) -> bytes:
    """The parts, each prefixed with its length: distinct tuples give distinct bytes."""
    out = bytearray()
    for part in parts:
        raw = part.encode("utf-8")
        out += len(raw).to_bytes(4, "big") + raw
    return bytes(out)


def bearer_token(authorization: str | None) -> str | None:
    """The key of an ``Authorization: Bearer KEY`` header; None when absent or of another scheme."""
    if authorization is None:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        return None
    return token


@dataclass(frozen=True, slots=True)
class KeyRing:
    """Secret keys and whom each one names, held as digests of the keys.

    ``KeyRing.from_mapping({"sk-a": "alice"})``; :meth:`name_for` a presented
    key gives ``"alice"``, or None for any other key. A key may also name its
    tenant with a weight in the fair share of the server
    (``{"sk-b": {"tenant": "bob", "weight": 2}}``, see :mod:`kvpool.fair_share`);
    :attr:`weights` holds them.
    """

    _names: Mapping[bytes, str] = field(repr=False)
    #: Tenant -> its weight in the fair share, for the tenants the keys give one.
    weights: Mapping[str, float] = field(default_factory=dict)

    @classmethod
    def from_mapping(cls, keys: Mapping[str, str], *, source: str = "the key mapping") -> KeyRing:
        """Keys (non-empty strings) to names (non-empty strings)."""
        if not isinstance(keys, Mapping):
            raise ConfigError(f"{source} must map API keys to tenant names, got {type(keys).__name__}")
        if not keys:
            raise ConfigError(f"{source} names no API key")
        names: dict[bytes, str] = {}
        weights: dict[str, float] = {}
        for key, value in keys.items():
            if not isinstance(key, str) or not key.strip() or key != key.strip():
                raise ConfigError(f"{source}: an API key must be a non-empty string without surrounding spaces")
            name, weight = value, None
            if isinstance(value, Mapping):
                if set(value) - {"tenant", "weight"} or "tenant" not in value:
                    raise ConfigError(
                        f"{source}: a key's tenant is a name or an object with 'tenant' and optionally 'weight', "
                        f"got {sorted(map(str, value))!r}"
                    )
                name, weight = value["tenant"], value.get("weight")
            if not isinstance(name, str) or not name:
                raise ConfigError(f"{source}: the tenant of a key must be a non-empty string, got {name!r}")
            if weight is not None:
                weight = check_weight(f"{source}: the weight of tenant {name!r}", weight)
                if weights.get(name, weight) != weight:
                    raise ConfigError(f"{source}: tenant {name!r} has two weights, {weights[name]:g} and {weight:g}")
                weights[name] = weight
            names[_digest(key)] = name
        return cls(names, weights)

    @classmethod
    def from_options(cls, api_key_file: str | os.PathLike[str] | None, api_keys: Sequence[str] = ()) -> KeyRing | None:
        """A server's tenants: the API key file's, and each single key in ``api_keys`` for :data:`DEFAULT_TENANT`.

        None when neither is given (one tenant, no key needed). A single key may
        repeat one of the file's own default-tenant keys, but a key the file gives
        another tenant is a :class:`ConfigError` naming that tenant: which of the
        two the key stands for would otherwise be a guess.
        """
        if api_key_file is None and not api_keys:
            return None
        given = cls.from_mapping(dict.fromkeys(api_keys, DEFAULT_TENANT), source="--api-key") if api_keys else None
        if api_key_file is None:
            return given
        ring = cls.load_json(api_key_file)
        if given is None:
            return ring
        for key in api_keys:
            if ring.name_for(key) not in (None, DEFAULT_TENANT):
                raise ConfigError(f"an --api-key is also a key of tenant {ring.name_for(key)!r} in --api-key-file")
        return ring.merged(given)

    def merged(self, other: KeyRing) -> KeyRing:
        """Both rings' keys (``other``'s win for a key in both) and weights."""
        for name, weight in other.weights.items():
            if self.weights.get(name, weight) != weight:
                raise ConfigError(f"tenant {name!r} has two weights, {self.weights[name]:g} and {weight:g}")
        return KeyRing({**self._names, **other._names}, {**self.weights, **other.weights})

    @classmethod
    def load_json(cls, path: str | os.PathLike[str]) -> KeyRing:
        """A JSON file holding one object: API key -> tenant name (or ``{"tenant": name, "weight": w}``)."""
        source = os.fspath(path)
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except OSError as exc:
            raise ConfigError(f"cannot read the API key file {source!r}: {exc.strerror or exc}") from None
        except (ValueError, UnicodeDecodeError) as exc:
            raise ConfigError(
                f"the API key file {source!r} is not JSON ({exc}); it must hold one JSON object of API key -> "
                f"tenant, e.g. {API_KEY_FILE_EXAMPLE} (a file of one key per line is not this format: "
                f"give each key a tenant, or pass a single key with --api-key)"
            ) from None
        if not isinstance(data, dict):
            raise ConfigError(
                f"the API key file {source!r} holds a JSON {type(data).__name__}; it must map API keys to tenant "
                f"names as one JSON object, e.g. {API_KEY_FILE_EXAMPLE}"
            )
        return cls.from_mapping(data, source=f"the API key file {source!r}")

    @classmethod
    def load_lines(cls, path: str | os.PathLike[str], name: str) -> KeyRing:
        """A text file with one key per line (blank lines skipped), every key naming ``name``."""
        source = os.fspath(path)
        try:
            with open(path, encoding="utf-8") as f:
                lines = [line.strip() for line in f]
        except OSError as exc:
            raise ConfigError(f"cannot read the key file {source!r}: {exc.strerror or exc}") from None
        except UnicodeDecodeError as exc:
            raise ConfigError(f"the key file {source!r} is not text: {exc}") from None
        return cls.from_mapping({key: name for key in lines if key}, source=f"the key file {source!r}")

    def name_for(self, key: str | None) -> str | None:
        """Whom ``key`` names; None for a missing or unknown key."""
        if key is None:
            return None
        return self._names.get(_digest(key))

    @property
    def names(self) -> frozenset[str]:
        return frozenset(self._names.values())

    def __len__(self) -> int:
        return len(self._names)


def load_secret(path: str | os.PathLike[str] | None) -> tuple[bytes, bool]:
    """The server secret from ``path`` (its bytes, trailing whitespace stripped), or a fresh one.

    Returns the secret and whether it was generated. A generated secret lives
    as long as the process: salts (and so cached blocks) do not carry over a
    restart, which costs only cache hits.
    """
    if path is None:
        return secrets.token_bytes(_GENERATED_SECRET_BYTES), True
    return read_secret_file(path, purpose="tenant secret"), False


class SecretSource(enum.Enum):
    """Where a :class:`SaltPolicy`'s secret came from, as a server says it at start."""

    #: Tenants share one prefix cache: there is no secret.
    NONE = "none"
    #: Read from the tenant secret file: salts (and cached blocks) carry over a restart.
    FILE = "file"
    #: Generated at start: salts last as long as the process, and no other process can derive them.
    GENERATED = "generated"


@dataclass(frozen=True, slots=True)
class SaltPolicy:
    """How a request's cache salt follows from its tenant and the client's ``cache_salt``.

    :meth:`isolated` derives salts with a server secret (see the module
    docstring); :meth:`shared` passes the client's value through unchanged,
    so every tenant shares one prefix cache (what a server without tenants
    does, and what the timing leak benchmark measures against).
    """

    _secret: bytes | None = field(repr=False)

    @classmethod
    def isolated(cls, secret: bytes) -> SaltPolicy:
        return cls(check_secret(secret, purpose="tenant secret"))

    @classmethod
    def shared(cls) -> SaltPolicy:
        return cls(None)

    @classmethod
    def from_options(
        cls, *, isolate: bool, secret_file: str | os.PathLike[str] | None
    ) -> tuple[SaltPolicy, SecretSource]:
        """The policy a server's tenant options give, and where its secret came from.

        ``isolate`` off (``--no-tenant-isolation``): :meth:`shared`, and the
        secret file is not read. On: :meth:`isolated` under the secret in
        ``secret_file``, or under a fresh one (:func:`load_secret`) without it.
        The server and the router both ask this, so a router given the replicas'
        options derives the replicas' salts.
        """
        if not isolate:
            return cls.shared(), SecretSource.NONE
        secret, generated = load_secret(secret_file)
        return cls.isolated(secret), SecretSource.GENERATED if generated else SecretSource.FILE

    @property
    def isolates_tenants(self) -> bool:
        return self._secret is not None

    def tenant_salt(self, tenant: str) -> bytes | None:
        """The tenant's own key (None when tenants share the cache)."""
        if self._secret is None:
            return None
        return hmac.new(self._secret, b"tenant" + _framed(tenant), hashlib.sha256).digest()

    def cache_salt(self, tenant: str, client_salt: str | None) -> str | None:
        """The salt a request of ``tenant`` carrying ``client_salt`` is served under."""
        if not isinstance(tenant, str) or not tenant:
            raise ConfigError(f"a tenant is a non-empty string, got {tenant!r}")
        if client_salt is not None and not isinstance(client_salt, str):
            raise ConfigError(f"cache_salt must be a string, got {client_salt!r}")
        tenant_key = self.tenant_salt(tenant)
        if tenant_key is None:
            return client_salt
        if client_salt is None:
            return tenant_key.hex()
        return hmac.new(tenant_key, b"client" + _framed(client_salt), hashlib.sha256).hexdigest()
