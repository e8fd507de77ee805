"""The contract every tier store keeps, and :func:`open_store`, which builds one from its spec.

A store maps keys (chained block hashes, as bytes) to payloads (one block's KV bytes). It keeps
them as entries (:mod:`kvpool.tiers.entry`), so what ``get_many`` returns is always a payload
that was stored under that key for this layout; anything else is a miss. A store never raises on
a backend fault: a full disk or a Redis that is down costs misses and unsaved blocks, counted in
``stats.errors`` and logged once, and serving goes on.

Specs::

    cpu:4GiB                            host memory (the engine keeps it: its blocks are tensors, not entries)
    disk:/var/cache/kvpool:50GiB        a directory bounded to 50 GiB (sizes: 4GiB, 500MB, bytes)
    redis://[:password@]host:6379/0     a Redis server (rediss:// for TLS, unix:///path.sock)
    redis+cluster://host:7000           a Redis Cluster, from any one node (rediss+cluster:// for TLS)
    ...?ttl=3600                        Redis entries expire after an hour (default: never)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Protocol

from kvpool import checks
from kvpool.errors import ConfigError
from kvpool.tiers.counters import TierStats
from kvpool.tiers.disk import DiskStore
from kvpool.tiers.entry import EntryCodec
from kvpool.tiers.redis_store import REDIS_SCHEMES, RedisStore, RedisTarget

__all__ = ["BlockStore", "CpuTarget", "DiskTarget", "TierStats", "open_store", "parse_size", "parse_spec"]


class BlockStore(Protocol):
    """A tier below GPU memory, keyed by chained block hashes. Every method is safe to call at any time."""

    name: str  # "disk" | "redis" (the engine's host-memory tier is "cpu")

    def contains_prefix(self, keys: Sequence[bytes]) -> int:
        """How many leading ``keys`` are stored: a hint, cheaper than reading them (``get_many`` may still miss)."""
        ...

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """The verified payload of each key, None for a miss (absent, corrupt, foreign, or the backend down)."""
        ...

    def put_many(self, items: Sequence[tuple[bytes, bytes]]) -> int:
        """Store ``(key, payload)`` pairs; how many are stored when it returns. Never raises on backend faults."""
        ...

    @property
    def stats(self) -> TierStats:
        """A snapshot of the store's counters."""
        ...

    def close(self) -> None:
        """Release files and connections; the store serves nothing afterwards."""
        ...


@dataclass(frozen=True, slots=True)
class CpuTarget:
    """A host-memory tier spec, checked: its bound in bytes. The engine keeps this tier, not a store."""

    capacity_bytes: int

    kind: ClassVar[str] = "cpu"


@dataclass(frozen=True, slots=True)
class DiskTarget:
    """A disk tier spec, checked: the directory and its bound in bytes."""

    path: str
    capacity_bytes: int

    kind: ClassVar[str] = "disk"


def parse_spec(spec: str) -> CpuTarget | DiskTarget | RedisTarget:
    """What ``spec`` names, checked without opening anything (``.kind`` is "cpu", "disk" or "redis").

    ConfigError naming the spec if it is malformed, or if a Redis spec needs the missing redis client.
    """
    if not isinstance(spec, str):
        raise ConfigError(f"a tier spec must be a string, got {spec!r}")
    if spec.startswith("cpu:"):
        return CpuTarget(parse_size(spec[len("cpu:") :], field=f"size in tier spec {spec!r}"))
    if spec.startswith("disk:"):
        path, sep, size = spec[len("disk:") :].rpartition(":")
        if not sep or not path:
            raise ConfigError(f"disk tier spec {spec!r} must be disk:PATH:SIZE, e.g. disk:/var/cache/kvpool:50GiB")
        return DiskTarget(path, parse_size(size, field=f"size in tier spec {spec!r}"))
    if spec.partition("://")[0] in REDIS_SCHEMES and "://" in spec:
        return RedisTarget.parse(spec)
    raise ConfigError(
        f"unknown tier spec {spec!r}: expected cpu:SIZE, disk:PATH:SIZE, redis://HOST:PORT/DB, rediss://... (TLS), "
        "redis+cluster://HOST:PORT or unix:///PATH"
    )


def open_store(spec: str, codec: EntryCodec) -> BlockStore:
    """The store ``spec`` names (see the module docstring); ConfigError naming the spec if it is malformed."""
    target = parse_spec(spec)
    if isinstance(target, CpuTarget):
        raise ConfigError(f"tier spec {spec!r} is host memory, which the engine keeps; open_store opens disk and Redis")
    if isinstance(target, DiskTarget):
        return DiskStore(target.path, target.capacity_bytes, codec)
    return RedisStore(target, codec)


def parse_size(text: str, *, field: str = "size") -> int:
    """Bytes in ``text`` (50GiB, 500MB, 4096), in :func:`kvpool.checks.parse_size`'s units; at least one byte."""
    if not isinstance(text, str):
        raise ConfigError(f"{field} must be a size such as 50GiB, 500MB or 1048576 (bytes), got {text!r}")
    size = checks.parse_size(text, field=field)
    if size <= 0:
        raise ConfigError(f"{field} must be a positive size, got {text!r}")
    return size
