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
:class:`~kvpool.tiers.kinds.TierKind` member and its line in :data:`BACKENDS`.

Trust: a shared tier (disk, Redis: its backend says ``shared``) holds bytes anyone with write
access to the directory or the server can plant. :func:`check_tier_trust` is the one rule: such a
tier is opened with a secret (every entry signed and checked with a MAC: AES-256-GMAC, else keyed
BLAKE3, else HMAC-SHA256, as the installed packages allow), or only when the operator says
explicitly that its entries are unauthenticated (a checksum then catches damage, never
tampering). The engine's options, its start-up and the vLLM connector ask it.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvpool.errors import ConfigError
from kvpool.events import MEDIUM_CPU
from kvpool.tiers import disk, redis_store
from kvpool.tiers.counters import TierStats
from kvpool.tiers.disk import DiskTarget
from kvpool.tiers.entry import EntryCodec
from kvpool.tiers.kinds import BlockStore, CpuTarget, TierBackend, TierKind, parse_size
from kvpool.tiers.redis_store import RedisTarget

__all__ = [
    "BACKENDS",
    "BlockStore",
    "CpuTarget",
    "DiskTarget",
    "TierStats",
    "TierTarget",
    "check_tier_trust",
    "event_medium",
    "medium_links",
    "open_store",
    "parse_size",
    "parse_spec",
    "parse_specs",
]


#: A parsed tier spec: the kind's typed target (``.kind`` is its :class:`TierKind`).
TierTarget = CpuTarget | DiskTarget | RedisTarget

_CPU = TierBackend(
    kind=TierKind.CPU,
    prefixes=("cpu:",),
    parse=CpuTarget.parse,
    open=None,
    example="cpu:SIZE",
    shared=False,
    outlives_process=False,
    fleet_wide=False,
    link=(25e9, 10e-6),  # PCIe copies from pinned host memory
    vllm_hit_source="HOST",
    event_medium=MEDIUM_CPU,
)

#: Every kind of tier, in the order specs are matched. One line per kind.
BACKENDS: dict[TierKind, TierBackend] = {
    backend.kind: backend
    for backend in (
        _CPU,
        disk.BACKEND,
        redis_store.BACKEND,
    )
}


def event_medium(tier_name: str) -> str:
    """The ``medium`` the KV events of the tier named ``tier_name`` (``"cpu"``, ``"disk"``, ``"redis"``) carry.

    vLLM's spelling (``"CPU"``, ``"STORAGE"``), from the kind's registry line; ConfigError naming an unknown tier.
    """
    for kind, backend in BACKENDS.items():
        if tier_name == kind.value:
            return backend.event_medium
    raise ConfigError(f"unknown tier {tier_name!r}; the tiers are {[kind.value for kind in BACKENDS]}")


def medium_links() -> dict[str, tuple[float, float]]:
    """Each event medium's default link, ``(bytes per second, seconds per transfer)``, from the registry.

    Where several kinds share a medium (disk and Redis are both ``"STORAGE"``), the slowest
    of their links (the lower bandwidth, then the higher latency): a reader of events cannot
    tell which of them holds a block, and a figure that errs slow never promises a load
    faster than the one that happens.
    """
    links: dict[str, tuple[float, float]] = {}
    for backend in BACKENDS.values():
        known = links.get(backend.event_medium)
        if known is None or backend.link[0] < known[0] or (backend.link[0] == known[0] and backend.link[1] > known[1]):
            links[backend.event_medium] = backend.link
    return links


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


def check_tier_trust(
    targets: Sequence[TierTarget],
    *,
    secret: bool,
    unauthenticated: object,
    secret_name: str,
    unauthenticated_name: str,
) -> bool:
    """Whether ``targets`` may be opened as asked; ``unauthenticated``, checked. The one rule of tier trust.

    A shared tier (disk, Redis) needs a secret (``secret``: one is given) or ``unauthenticated``
    set: the operator's word that anyone who can write to the tier may plant KV the engine serves.
    ``unauthenticated`` with a secret, or without any shared tier, says nothing true and is refused.
    ``secret_name`` and ``unauthenticated_name`` are what the caller calls the two (an option, a
    config key) in errors.

    Raises:
        ConfigError: naming the shared tiers, or the value of ``unauthenticated``; nothing is opened.
    """
    if not isinstance(unauthenticated, bool):
        raise ConfigError(f"{unauthenticated_name} must be true or false, got {unauthenticated!r}")
    shared = [target for target in targets if BACKENDS[target.kind].shared]
    kinds = ", ".join(sorted({t.kind.value for t in shared}))
    if unauthenticated and secret:
        raise ConfigError(
            f"{unauthenticated_name} and {secret_name} are both given: with a secret every entry is signed "
            f"and checked; leave {unauthenticated_name} out"
        )
    if unauthenticated and not shared:
        raise ConfigError(
            f"{unauthenticated_name} is given, but no KV tier is shared (disk or Redis); "
            "the CPU tier is private to the process and needs no secret"
        )
    if shared and not secret and not unauthenticated:
        raise ConfigError(
            f"a shared KV tier ({kinds}) is opened without a secret: anyone who can write to it can plant KV "
            "this process would serve. "
            f"Give {secret_name} (a secret of at least 16 bytes, shared by the processes that share the tier) "
            f"to sign and check every entry, or {unauthenticated_name} to accept unauthenticated entries "
            "(their checksum catches damage, not tampering)"
        )
    return unauthenticated


def open_store(spec: str | TierTarget, codec: EntryCodec) -> BlockStore:
    """The store ``spec`` names (a spec string or a parsed target); ConfigError naming it if it is malformed."""
    target = spec if isinstance(spec, CpuTarget | DiskTarget | RedisTarget) else parse_spec(spec)
    opener = BACKENDS[target.kind].open
    if opener is None:
        raise ConfigError(f"tier spec {spec!r} is host memory, which the engine keeps; open_store opens disk and Redis")
    return opener(target, codec)
