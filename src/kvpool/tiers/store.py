"""The contract every tier store keeps, the registry of tier kinds, and the one parser of tier specs.

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

A new kind of tier is one module (its target, with ``parse``, and its store) plus its
:class:`~kvpool.tiers.spec.TierKind` member and its line in :data:`BACKENDS`.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvpool.errors import ConfigError
from kvpool.tiers import disk, redis_store
from kvpool.tiers.counters import TierStats
from kvpool.tiers.disk import DiskTarget
from kvpool.tiers.entry import EntryCodec
from kvpool.tiers.redis_store import RedisTarget
from kvpool.tiers.spec import BlockStore, CpuTarget, TierBackend, TierKind, parse_size

__all__ = [
    "BACKENDS",
    "BlockStore",
    "CpuTarget",
    "DiskTarget",
    "TierStats",
    "TierTarget",
    "open_store",
    "parse_size",
    "parse_spec",
    "parse_specs",
]


#: A parsed tier spec: the kind's typed target (``.kind`` is its :class:`TierKind`).
TierTarget = CpuTarget | DiskTarget | RedisTarget

_CPU = TierBackend(kind=TierKind.CPU, prefixes=("cpu:",), parse=CpuTarget.parse, open=None, example="cpu:SIZE")

#: Every kind of tier, in the order specs are matched. One line per kind.
BACKENDS: dict[TierKind, TierBackend] = {
    backend.kind: backend
    for backend in (
        _CPU,
        disk.BACKEND,
        redis_store.BACKEND,
    )
}


def parse_spec(spec: str) -> TierTarget:
    """What ``spec`` names, checked without opening anything.

    ConfigError naming the spec if it is malformed, or if a Redis spec needs the missing redis client.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ConfigError(f"a KV tier spec must be a non-empty string such as 'cpu:4GiB', got {spec!r}")
    for backend in BACKENDS.values():
        if backend.names(spec):
            target: TierTarget = backend.parse(spec)
            return target
    expected = ", ".join(b.example for b in BACKENDS.values())
    raise ConfigError(f"unknown tier spec {spec!r}: expected {expected}")


def parse_specs(specs: Sequence[str]) -> tuple[TierTarget, ...]:
    """Tier specs in lookup order, parsed; each kind at most once (ConfigError naming the spec otherwise)."""
    if isinstance(specs, str) or not isinstance(specs, Sequence):
        raise ConfigError(f"KV tiers must be a list of tier specs such as 'cpu:4GiB', got {specs!r}")
    targets: list[TierTarget] = []
    for spec in specs:
        target = parse_spec(spec)
        if any(t.kind is target.kind for t in targets):
            raise ConfigError(
                f"KV tier {target.kind.value!r} is given twice ({spec!r}); each kind of tier appears once"
            )
        targets.append(target)
    return tuple(targets)


def open_store(spec: str | TierTarget, codec: EntryCodec) -> BlockStore:
    """The store ``spec`` names (a spec string or a parsed target); ConfigError naming it if it is malformed."""
    target = spec if isinstance(spec, CpuTarget | DiskTarget | RedisTarget) else parse_spec(spec)
    opener = BACKENDS[target.kind].open
    if opener is None:
        raise ConfigError(f"tier spec {spec!r} is host memory, which the engine keeps; open_store opens disk and Redis")
    return opener(target, codec)
