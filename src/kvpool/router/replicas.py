"""What the router knows about each replica: whether it is up, how loaded, how it hashes blocks.

A replica is named by its base URL (``http://127.0.0.1:8001``); that name is its key in
the block index. Its state changes only on the router's event loop, so nothing here
locks.

A replica URL may carry credentials (``http://user:secret@10.0.0.5:8000``, for a proxy in
front of the replica that asks for HTTP basic authentication). They are kept for the
requests the router sends there (:attr:`Replica.base`) and nowhere else: the replica's
name (:attr:`Replica.url`: its index key, its ``/health`` and ``/metrics`` entries, the
log, the ``x-kvpool-replica`` header, error messages) is :func:`redact_url`'s, with the
user information replaced by ``***``.
"""

from __future__ import annotations

import enum
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from kvpool.errors import ConfigError
from kvpool.hashing import BlockHash
from kvpool.kv_events.transport import CurveClient, CurveTrust
from kvpool.replica_rates import ReplicaRates
from kvpool.router.stats import ReplicaStats

__all__ = [
    "MAX_BLOCK_SIZE",
    "EventsInfo",
    "HashForm",
    "Hashing",
    "Replica",
    "check_block_size",
    "check_distinct",
    "check_replica_url",
    "connectable_endpoint",
    "redact_url",
    "replica_identity",
    "shown",
]

#: The most tokens per block a replica may be described with (vLLM's largest are a few hundred; a
#: hybrid model's a few thousand): past it a block size is a typo, and no prompt would fill a block.
MAX_BLOCK_SIZE = 2**16


class HashForm(enum.Enum):
    """How a replica's events spell a block hash.

    ``BYTES``: the whole digest (kvpool; vLLM with ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``).
    ``INT64``: an integer, the digest's low 64 bits (vLLM's default); events decode it to
    its 8 big-endian bytes, which are the digest's last 8 bytes.
    """

    BYTES = "bytes"
    INT64 = "int64"

    def published(self, hashes: list[BlockHash]) -> list[BlockHash]:
        """The router's full-digest hashes as this form publishes them (what the index holds)."""
        if self is HashForm.INT64:
            return [BlockHash(h[-8:]) for h in hashes]
        return hashes


#: How a replica hashes blocks: (block size, algorithm, seed name, hash form). Equal values, equal hashes.
Hashing = tuple[int, str, str | None, HashForm]


def shown(value: object, limit: int = 80) -> str:
    """``value`` as an error message names it: its ``repr`` (one line), cut at ``limit`` characters.

    A table or a list (from a TOML file) is named by its kind alone: nested deeply
    enough, its ``repr`` would not even finish.
    """
    if isinstance(value, dict | list | tuple | set):
        return f"a {type(value).__name__} ({len(value)} items)"
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def redact_url(url: str) -> str:
    """``url`` as the router shows it: its user information (``user:password@``), if any, as ``***@``.

    The one redaction of a replica URL: every place that shows a replica shows this.
    """
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    # up to the last "@" anywhere: a password may hold "/" or "?", and a replica URL has no path to keep
    _, at, host = rest.rpartition("@")
    return f"{scheme}://***@{host}" if at else url


def check_replica_url(url: object) -> str:
    """``url`` as a replica's base: ``http(s)://host:port``, without a trailing slash (credentials kept).

    Refused, with a :class:`ConfigError` naming the URL (redacted): another scheme, no host,
    a path, query or fragment, a port that is not in 1..65535, and spaces or control
    characters (which would end up in the log and in response headers).
    """
    if not isinstance(url, str):
        raise ConfigError(f"a replica is an http:// or https:// URL, got {shown(url)}")
    named = shown(redact_url(url))
    if not url.isprintable() or any(c.isspace() for c in url):
        raise ConfigError(f"a replica URL holds no spaces or control characters, got {named}")
    try:
        parts = urlsplit(url)
        host = parts.hostname
        port = parts.port  # raises on a port that is not a number or out of range
    except ValueError:
        raise ConfigError(f"replica {named} is not a URL with a host and a port number (1-65535)") from None
    if parts.scheme not in ("http", "https") or not host:
        raise ConfigError(f"a replica is an http:// or https:// URL with a host, got {named}")
    if parts.query or parts.fragment or parts.path not in ("", "/"):
        raise ConfigError(f"a replica URL is a bare base such as http://127.0.0.1:8001, got {named}")
    if port == 0 or (port is None and parts.netloc.endswith(":")):
        raise ConfigError(f"the port of replica {named} must be in 1-65535")
    return url.rstrip("/")


def replica_identity(url: str) -> tuple[str, str, int]:
    """What makes two replica URLs the same replica: scheme, host (any case) and port (the scheme's default)."""
    parts = urlsplit(check_replica_url(url))
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return parts.scheme, (parts.hostname or "").lower(), port


def check_distinct(urls: Sequence[str]) -> None:
    """Each replica named once: the same scheme, host and port twice is a ConfigError naming it."""
    seen: dict[tuple[str, str, int], str] = {}
    for url in urls:
        identity = replica_identity(url)  # checks the URL too
        if identity in seen:
            raise ConfigError(
                f"replica {redact_url(url)} is named twice (as {seen[identity]} too): name each replica once"
            )
        seen[identity] = redact_url(url)


def check_block_size(value: object, what: str) -> int:
    """A replica's tokens per block: an integer in 1..:data:`MAX_BLOCK_SIZE`; ConfigError naming ``what`` and it."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_BLOCK_SIZE:
        raise ConfigError(f"{what}: block-size must be an integer from 1 to {MAX_BLOCK_SIZE}, got {shown(value)}")
    return value


def connectable_endpoint(endpoint: str, replica_url: str) -> str:
    """A ZeroMQ endpoint a replica advertises, as this router can connect to it.

    A replica binds ``tcp://*:5557`` (every interface); the router connects to the same
    port on the host it reaches the replica's HTTP server at. A replica that binds its
    loopback alone (``tcp://127.0.0.1:5557``) is followed only by a router that reaches
    it on the loopback too: elsewhere that address is another machine's.
    """
    scheme, sep, rest = endpoint.partition("://")
    if not sep:
        raise ConfigError(f"replica {replica_url} advertises events at {endpoint!r}, which is not a ZeroMQ endpoint")
    if scheme != "tcp":
        return endpoint  # ipc:// and inproc:// name the same place from anywhere on the machine
    host, _, port = rest.rpartition(":")
    replica_host = urlsplit(replica_url).hostname or "127.0.0.1"
    if host in ("*", "0.0.0.0", "[::]", "::", ""):
        host = f"[{replica_host}]" if ":" in replica_host else replica_host
    elif _loopback(host.strip("[]")) and not _loopback(replica_host):
        raise ConfigError(
            f"replica {replica_url} publishes its events on its loopback interface only ({endpoint!r}), "
            "which this router, reaching it from elsewhere, cannot connect to"
        )
    return f"tcp://{host}:{port}"


def _loopback(host: str) -> bool:
    return host == "localhost" or host == "::1" or host.startswith("127.")


def _curve(announced: object, replica_url: str, trust: CurveTrust | None) -> CurveClient | None:
    """How to subscribe to a replica that announces ``announced`` as its CURVE key (None: no CURVE)."""
    if announced is None and trust is not None:
        raise ConfigError(
            f"replica {replica_url} publishes its KV events without CURVE, and this router follows only "
            "replicas holding one of its --kv-events-server-keys"
        )
    if announced is not None and trust is None:
        raise ConfigError(
            f"replica {replica_url} publishes its KV events under CURVE: give this router "
            "--kv-events-secret-key and --kv-events-server-keys"
        )
    return None if trust is None else trust.client_for(announced, f"replica {replica_url}")


@dataclass(frozen=True, slots=True, kw_only=True)
class EventsInfo:
    """Where a replica publishes its KV events and how it hashes blocks (its ``GET /kv-events``)."""

    endpoint: str
    replay_endpoint: str | None
    hash_algorithm: str
    hash_seed: str | None
    block_size: int
    num_blocks: int | None = None  # the most blocks it can hold, over all its media, when it says
    hash_form: HashForm = HashForm.BYTES
    configured: bool = False  # described on the router's command line, not read from GET /kv-events
    curve: CurveClient | None = None  # the router's CURVE keys and the replica's public key
    snapshot: str | None = None  # the path of its snapshot (GET /kv-events/snapshot) when it has one

    @classmethod
    def from_json(cls, body: object, replica_url: str, trust: CurveTrust | None = None) -> EventsInfo:
        """Read a ``GET /kv-events`` body; raises :class:`ConfigError` naming what is missing.

        A replica that announces a CURVE public key (``curve_public_key``) is followed
        only with ``trust``, and only when ``trust`` holds that key; with ``trust``, a
        replica announcing none is not followed either (its stream would be plain text).
        """
        if not isinstance(body, Mapping):
            raise ConfigError(f"replica {replica_url}: GET /kv-events is not a JSON object: {body!r}")
        endpoint = body.get("endpoint")
        if not isinstance(endpoint, str) or not endpoint:
            raise ConfigError(f"replica {replica_url} publishes no KV events (start it with --kv-events-endpoint)")
        replay = body.get("replay_endpoint")
        algo = body.get("hash_algorithm")
        seed = body.get("hash_seed")
        block_size = body.get("block_size")
        if not isinstance(algo, str) or not isinstance(block_size, int) or block_size < 1:
            raise ConfigError(f"replica {replica_url}: GET /kv-events lacks hash_algorithm or block_size: {body!r}")
        check_block_size(block_size, f"replica {replica_url}'s GET /kv-events")
        return cls(
            endpoint=connectable_endpoint(endpoint, replica_url),
            replay_endpoint=connectable_endpoint(replay, replica_url) if isinstance(replay, str) and replay else None,
            hash_algorithm=algo,
            hash_seed=seed if isinstance(seed, str) else None,
            block_size=block_size,
            num_blocks=capacity if type(capacity := body.get("num_blocks")) is int and capacity > 0 else None,
            curve=_curve(body.get("curve_public_key"), replica_url, trust),
            snapshot=path if isinstance(path := body.get("snapshot"), str) and path.startswith("/") else None,
        )

    @property
    def hashing(self) -> Hashing:
        """Replicas with equal ``hashing`` give the same block the same hash."""
        return (self.block_size, self.hash_algorithm, self.hash_seed, self.hash_form)


@dataclass(slots=True)
class Replica:
    """One replica behind the router.

    ``url`` is its name (credentials redacted, see the module); ``base`` the URL its
    requests go to (credentials kept; by default the URL it was given). ``load`` is what
    the routing rule weighs: the requests this router has in flight there (sent, and not
    yet answered to the end). ``held_until``: the monotonic time before which health
    checks do not bring it back (a quarantine or an ejection; 0: none).
    ``consecutive_failures``: failed answers in a row (5xx, broken connections) since its
    last good one; ``ejections``: ejections in a row with no good answer between (the
    back-off's exponent); ``ejected``: all its ejections. ``rates``: how fast it works (its
    ``GET /rates``, or the profile its spec names); ``None`` while unknown, when the router
    weighs it by its ``--prefill-tokens-per-s`` option.
    """

    url: str
    base: str = field(default="", repr=False)
    up: bool = False
    events: EventsInfo | None = None
    discover: bool = True  # read GET /kv-events (kvpool); otherwise ``described`` is what it publishes
    described: EventsInfo | None = None
    in_flight: int = 0
    routed: int = 0
    failures: int = 0
    held_until: float = 0.0
    consecutive_failures: int = 0
    ejections: int = 0
    ejected: int = 0
    last_error: str | None = field(default=None, repr=False)
    stats: ReplicaStats = field(default_factory=ReplicaStats, repr=False)
    rates: ReplicaRates | None = None
    rates_error: str | None = field(default=None, repr=False)  # why its last GET /rates was refused
    heard_at: float = field(default=-math.inf, repr=False)  # monotonic time of its last good answer to a request

    def __post_init__(self) -> None:
        if not self.base:
            self.base = self.url
        self.url = redact_url(self.url)

    @property
    def load(self) -> int:
        return self.in_flight

    def describe(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "up": self.up,
            "load": self.load,
            "in_flight": self.in_flight,
            "routed": self.routed,
            "events": None if self.events is None else self.events.endpoint,
            "described": not self.discover,
            "last_error": self.last_error,
            "quarantined": self.held_until > time.monotonic(),
            "consecutive_failures": self.consecutive_failures,
            "ejected": self.ejected,
            "hash_check": self.stats.verdict.value,
            "rates": None if self.rates is None else self.rates.to_json(),
            "rates_error": self.rates_error,
        }
