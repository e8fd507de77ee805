"""Where the event sockets attach (bind or connect), and who may read them (ZeroMQ CURVE).

Endpoints
---------

A publisher endpoint is a ZeroMQ endpoint, optionally marked::

    bind:tcp://127.0.0.1:5557     bound, on exactly that interface (loopback only here)
    connect:tcp://fwd.local:5557  connected to (a forwarder that subscribers reach instead)
    tcp://*:5557                  unmarked: vLLM's rule, bound (a wildcard host)
    tcp://127.0.0.1:5557          unmarked: vLLM's rule, connected to (a forwarder on this host)

Unmarked, an endpoint means what it means to vLLM, so a vLLM configuration
keeps its meaning: it is bound when it is ipc:// or inproc://, or when it
holds ``*`` or ``::`` (a wildcard host; vLLM's test also binds any IPv6
literal), and connected to otherwise. Refused, each with an error naming the
value: an unmarked ``tcp://0.0.0.0:PORT`` (vLLM would connect to it, which is
never what it means: write ``bind:`` or ``*``), ``connect:`` to a wildcard
host or to port 0, a tcp endpoint without a numeric port, and any other
scheme. The replay endpoint is always bound (``connect:`` is refused), and a
subscriber always connects (``bind:`` is refused).

CURVE
-----

Keys are ZeroMQ certificate files (``zmq.auth.create_certificates``): a
``NAME.key_secret`` file holds a key pair, a ``NAME.key`` file a public key
alone. A publisher with :class:`CurveServer` encrypts its PUB and replay
sockets and lets only the listed client public keys connect (a ZAP handler on
its own ZeroMQ context); a subscriber with :class:`CurveClient` authenticates
with its key pair and checks the publisher's public key. :class:`CurveTrust`
is a subscriber's key pair with the publisher keys it trusts, for a router
that learns each replica's key from the replica's announcement.
"""

from __future__ import annotations

import enum
import os
import re
from dataclasses import dataclass, field
from typing import Any

from kvpool.errors import ConfigError
from kvpool.kv_events.wire import import_extra
from kvpool.secret_files import read_key_file

__all__ = [
    "Attach",
    "CurveClient",
    "CurveKeyPair",
    "CurveServer",
    "CurveTrust",
    "Endpoint",
    "load_public_keys",
    "parse_publisher_endpoint",
    "parse_replay_endpoint",
    "parse_subscriber_endpoint",
]

_SCHEMES = ("tcp://", "ipc://", "inproc://")
_WILDCARD_HOSTS = ("*", "0.0.0.0", "[::]", "::")
_Z85_KEY = re.compile(rb"[0-9a-zA-Z.\-:+=^!/*?&<>()\[\]{}@%$#]{40}")


class Attach(enum.Enum):
    """What a socket does with its endpoint."""

    BIND = "bind"
    CONNECT = "connect"


@dataclass(frozen=True, slots=True, kw_only=True)
class Endpoint:
    """A ZeroMQ endpoint (``address``, without a marker) and whether it is bound or connected to."""

    address: str
    attach: Attach

    def __str__(self) -> str:
        return f"{self.attach.value}:{self.address}"


def _split(name: str, value: object) -> tuple[Attach | None, str]:
    """The marker (if any) and the ZeroMQ endpoint, checked; raises :class:`ConfigError` naming ``value``."""
    if not isinstance(value, str):
        raise ConfigError(f"{name} must be a ZeroMQ endpoint such as 'bind:tcp://127.0.0.1:5557', got {value!r}")
    marker: Attach | None = None
    address = value
    for attach in Attach:
        prefix = attach.value + ":"
        if value.startswith(prefix) and not value.startswith(prefix + "//"):
            marker, address = attach, value[len(prefix) :]
    if not address.startswith(_SCHEMES):
        raise ConfigError(
            f"{name} must be a ZeroMQ endpoint (tcp://, ipc:// or inproc://), optionally marked bind: or connect:, "
            f"such as 'bind:tcp://127.0.0.1:5557'; got {value!r}"
        )
    if address.startswith("tcp://"):
        host, sep, port = address[len("tcp://") :].rpartition(":")
        if not sep or not host or not port.isdigit() or int(port) > 65535:
            raise ConfigError(f"{name}: a tcp endpoint needs a host and a port number (tcp://HOST:PORT), got {value!r}")
    elif address.endswith("://"):
        raise ConfigError(f"{name}: {value!r} names no path")
    return marker, address


def _tcp_host_port(address: str) -> tuple[str, int] | None:
    if not address.startswith("tcp://"):
        return None
    host, _, port = address[len("tcp://") :].rpartition(":")
    return host, int(port)


def _vllm_binds(address: str) -> bool:
    """vLLM's rule for an unmarked endpoint: wildcard hosts and ipc/inproc endpoints are bound."""
    return "*" in address or "::" in address or address.startswith(("ipc://", "inproc://"))


def _check_connectable(name: str, value: str, address: str) -> None:
    tcp = _tcp_host_port(address)
    if tcp is not None and (tcp[0] in _WILDCARD_HOSTS or tcp[1] == 0):
        raise ConfigError(f"{name}: {value!r} names no peer to connect to (a wildcard host or port 0)")


def parse_publisher_endpoint(value: object, name: str = "endpoint") -> Endpoint:
    """A PUB endpoint by the rule in this module's docstring."""
    marker, address = _split(name, value)
    assert isinstance(value, str)
    if marker is None:
        tcp = _tcp_host_port(address)
        if tcp is not None and tcp[0] == "0.0.0.0":
            raise ConfigError(
                f"{name} {value!r} is ambiguous: vLLM's rule connects to it; "
                f"write 'bind:{address}' (or tcp://*:{tcp[1]}) to listen on every interface"
            )
        marker = Attach.BIND if _vllm_binds(address) else Attach.CONNECT
    if marker is Attach.CONNECT:
        _check_connectable(name, value, address)
    return Endpoint(address=address, attach=marker)


def parse_replay_endpoint(value: object, name: str = "replay_endpoint") -> Endpoint:
    """A replay (ROUTER) endpoint: always bound."""
    marker, address = _split(name, value)
    if marker is Attach.CONNECT:
        raise ConfigError(f"{name}: a replay socket is always bound, so {value!r} cannot be connected to")
    return Endpoint(address=address, attach=Attach.BIND)


def parse_subscriber_endpoint(value: object, name: str = "endpoint") -> str:
    """A SUB or replay-client endpoint (always connected to), without its marker."""
    marker, address = _split(name, value)
    assert isinstance(value, str)
    if marker is Attach.BIND:
        raise ConfigError(f"{name}: a subscriber connects, so {value!r} cannot be bound")
    _check_connectable(name, value, address)
    return address


# -- CURVE ------------------------------------------------------------------------------


def _key(value: object, what: str) -> bytes:
    """A Z85-encoded CURVE key (40 characters), as bytes."""
    raw = value.encode("ascii", "replace") if isinstance(value, str) else value
    if not isinstance(raw, bytes) or not _Z85_KEY.fullmatch(raw):
        raise ConfigError(f"{what} is not a Z85-encoded CURVE key (40 characters): {value!r}")
    return raw


def _certificate(path: str | os.PathLike[str], what: str) -> tuple[bytes, bytes | None]:
    """The public key and the secret key (None in a public certificate) of a ZeroMQ certificate file.

    Read as :func:`kvpool.secret_files.read_key_file` reads every key file (a regular file only,
    never waited on, bounded), then parsed as ``zmq.auth.load_certificate`` does: the first
    ``public-key = "..."`` and ``secret-key = "..."`` lines, ``#`` lines being comments.
    """
    source = os.fspath(path)
    data = read_key_file(source, purpose=what)
    public: bytes | None = None
    secret: bytes | None = None
    for raw in data.splitlines():
        line = raw.strip()
        if line.startswith(b"#") or b"=" not in line:
            continue
        name, value = (part.strip() for part in line.split(b"=", 1))
        if name == b"public-key" and public is None:
            public = value.strip(b" \t'\"")
        elif name == b"secret-key" and secret is None:
            secret = value.strip(b" \t'\"")
    if public is None:
        raise ConfigError(f"cannot read the {what} file {source!r}: it holds no public-key line (a ZeroMQ certificate)")
    return _key(public, f"the public key in {source!r}"), None if secret is None else _key(
        secret, f"the secret key in {source!r}"
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class CurveKeyPair:
    """A CURVE key pair, Z85-encoded (``zmq.curve_keypair()``'s form)."""

    public_key: bytes
    secret_key: bytes = field(repr=False)

    def __post_init__(self) -> None:
        _key(self.public_key, "public_key")
        _key(self.secret_key, "secret_key")

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> CurveKeyPair:
        """A secret certificate file (``NAME.key_secret``): both keys."""
        public, secret = _certificate(path, "CURVE secret key")
        if secret is None:
            raise ConfigError(f"{os.fspath(path)!r} holds a public key only; a key pair is its .key_secret file")
        return cls(public_key=public, secret_key=secret)


def load_public_keys(path: str | os.PathLike[str]) -> frozenset[bytes]:
    """The public keys in a certificate file, or in every ``*.key`` file of a directory (none: an error)."""
    source = os.fspath(path)
    if os.path.isdir(source):
        files = sorted(os.path.join(source, n) for n in os.listdir(source) if n.endswith(".key"))
    elif os.path.exists(source):
        files = [source]
    else:
        raise ConfigError(f"the public key file or directory {source!r} does not exist")
    keys = frozenset(_certificate(f, "CURVE public key")[0] for f in files)
    if not keys:
        raise ConfigError(f"{source!r} holds no public key (*.key certificate files)")
    return keys


@dataclass(frozen=True, slots=True, kw_only=True)
class CurveServer:
    """A publisher's CURVE setting: its key pair, and the client public keys allowed to subscribe."""

    keys: CurveKeyPair
    clients: frozenset[bytes]

    def __post_init__(self) -> None:
        if not self.clients:
            raise ConfigError("a CURVE publisher needs at least one allowed client public key")
        for key in self.clients:
            _key(key, "an allowed client key")

    @classmethod
    def load(cls, secret_key_file: str | os.PathLike[str], client_keys: str | os.PathLike[str]) -> CurveServer:
        return cls(keys=CurveKeyPair.load(secret_key_file), clients=load_public_keys(client_keys))

    def start_authenticator(self, context: Any) -> Any:
        """A running ZAP handler on ``context`` that admits the allowed keys only; stop it after the sockets close."""
        thread = import_extra("zmq.auth.thread")
        authenticator = thread.ThreadAuthenticator(context)
        authenticator.start()
        authenticator.configure_curve_callback("*", _Allowed(self.clients))
        return authenticator

    def secure(self, sock: Any, zmq: Any) -> None:
        """Make ``sock`` (before it binds or connects) a CURVE server with this key pair."""
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.keys.secret_key)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.keys.public_key)
        sock.setsockopt(zmq.CURVE_SERVER, 1)


class _Allowed:
    """The ZAP credentials provider: a client key is in or out."""

    __slots__ = ("_keys",)

    def __init__(self, keys: frozenset[bytes]) -> None:
        self._keys = keys

    def callback(self, domain: str, key: bytes) -> bool:
        return key in self._keys


@dataclass(frozen=True, slots=True, kw_only=True)
class CurveClient:
    """A subscriber's CURVE setting: its key pair and the one publisher key it accepts."""

    keys: CurveKeyPair
    server_key: bytes

    def __post_init__(self) -> None:
        _key(self.server_key, "server_key")

    @classmethod
    def load(cls, secret_key_file: str | os.PathLike[str], server_key_file: str | os.PathLike[str]) -> CurveClient:
        keys = load_public_keys(server_key_file)
        if len(keys) != 1:
            raise ConfigError(f"{os.fspath(server_key_file)!r} holds {len(keys)} public keys; a client trusts one")
        (server,) = keys
        return cls(keys=CurveKeyPair.load(secret_key_file), server_key=server)

    def secure(self, sock: Any, zmq: Any) -> None:
        """Make ``sock`` (before it connects) a CURVE client of the publisher holding ``server_key``."""
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.keys.secret_key)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.keys.public_key)
        sock.setsockopt(zmq.CURVE_SERVERKEY, self.server_key)


@dataclass(frozen=True, slots=True, kw_only=True)
class CurveTrust:
    """A subscriber's key pair and the publisher keys it trusts (a router following many replicas)."""

    keys: CurveKeyPair
    servers: frozenset[bytes]

    def __post_init__(self) -> None:
        if not self.servers:
            raise ConfigError("CURVE trust needs at least one publisher public key")

    @classmethod
    def load(cls, secret_key_file: str | os.PathLike[str], server_keys: str | os.PathLike[str]) -> CurveTrust:
        return cls(keys=CurveKeyPair.load(secret_key_file), servers=load_public_keys(server_keys))

    def client_for(self, server_key: object, publisher: str) -> CurveClient:
        """The client setting for ``publisher``, which says its key is ``server_key``: refused unless trusted."""
        key = _key(server_key, f"the CURVE public key {publisher} announces")
        if key not in self.servers:
            raise ConfigError(f"{publisher} announces the CURVE public key {key.decode()!r}, which is not trusted")
        return CurveClient(keys=self.keys, server_key=key)
