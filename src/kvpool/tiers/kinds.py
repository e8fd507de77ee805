"""What a tier is called and how it is written: the kinds, the write policies, and the host-memory spec.

Every tier below GPU memory is one :class:`TierKind`. A spec string names one
(``cpu:4GiB``, ``disk:/var/cache/kvpool:50GiB``, ``redis://host:6379/0``) and is
parsed once, by :func:`kvpool.tiers.store.parse_spec`, into the kind's typed
target (:class:`CpuTarget`, :class:`~kvpool.tiers.disk.DiskTarget`,
:class:`~kvpool.tiers.redis_store.RedisTarget`); everything downstream takes
the target. :class:`TierBackend` is what a kind registers: how its specs
start, how one is parsed, and how its store (a :class:`BlockStore`) is opened.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from kvpool import checks
from kvpool.errors import ConfigError

if TYPE_CHECKING:
    from kvpool.tiers.counters import TierStats
    from kvpool.tiers.entry import EntryCodec

__all__ = ["BlockStore", "CpuTarget", "TierBackend", "TierKind", "WritePolicy", "parse_size"]


class TierKind(Enum):
    """The tiers kvpool knows, by the names their specs, figures and events use."""

    CPU = "cpu"  # host memory, kept by the engine (its blocks are tensors, not entries)
    DISK = "disk"
    REDIS = "redis"


class WritePolicy(Enum):
    """When a block goes down to the tiers, chosen once when the tier hierarchy is built.

    * ``WRITE_THROUGH``: when it fills (computed, or loaded from a lower tier):
      every full block is saved once, at once; a block the pool later evicts is
      already below it.
    * ``WRITE_BACK``: when the GPU pool evicts it: blocks that are reused while
      still in the pool never cross the link, which saves bandwidth; a block
      that is never evicted is never saved (so another replica sharing a tier
      sees it only once this replica lets it go).
    """

    WRITE_THROUGH = "write-through"
    WRITE_BACK = "write-back"

    @classmethod
    def parse(cls, value: object) -> WritePolicy:
        """A policy, or its name; ConfigError naming ``value`` otherwise."""
        if isinstance(value, cls):
            return value
        for policy in cls:
            if value == policy.value:
                return policy
        raise ConfigError(f"unknown KV tier write policy {value!r}; choose one of {[p.value for p in cls]}")


class BlockStore(Protocol):
    """A tier below GPU memory, keyed by chained block hashes. Every method is safe to call at any time."""

    name: str  # its TierKind's value ("disk", "redis"); the engine's host-memory tier is "cpu"

    def contains_prefix(self, keys: Sequence[bytes]) -> int:
        """How many leading ``keys`` are stored: a hint, cheaper than reading them (``get_many`` may still miss)."""
        ...

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """The verified payload of each key, None for a miss (absent, corrupt, foreign, or the backend down)."""
        ...

    def get_many_into(self, keys: Sequence[bytes], out: Sequence[memoryview]) -> list[bool]:
        """Each key's verified payload written into its buffer in ``out``, which it must fill exactly; whether it was.

        The copy-free read: no payload object is made. A buffer whose key missed holds garbage.
        """
        ...

    def put_many(self, items: Sequence[tuple[bytes, bytes | bytearray | memoryview]]) -> int:
        """Store ``(key, payload)`` pairs (any contiguous buffer, not kept); how many are stored. Never raises on faults."""
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

    kind: ClassVar[TierKind] = TierKind.CPU

    @classmethod
    def parse(cls, spec: str) -> CpuTarget:
        """``cpu:SIZE``; ConfigError naming the spec."""
        return cls(parse_size(spec.removeprefix("cpu:"), field=f"size in tier spec {spec!r}"))


@dataclass(frozen=True, slots=True, kw_only=True)
class TierBackend:
    """One kind of tier, as the registry (:data:`kvpool.tiers.store.BACKENDS`) holds it.

    ``prefixes``: how its specs start (``"cpu:"``, ``"redis://"``, ...);
    ``parse``: a spec into the kind's typed target (ConfigError naming it);
    ``open``: a store for a target and an entry codec, or None for host memory,
    which the engine keeps itself; ``example``: a spec for error messages;
    ``shared``: whether anyone but this process can write what the tier holds
    (a directory, a Redis server), so its entries need a secret to be trusted
    (:func:`kvpool.tiers.store.check_tier_trust`);
    ``outlives_process``: whether its entries outlive the process that wrote
    them, so they must name the model's weights (another process, or a later
    one with other weights, reads them);
    ``fleet_wide``: whether one tier serves every replica of a fleet (a Redis
    server), not one machine (the simulator shares its store between replicas);
    ``link``: its default ``(bytes per second, seconds per transfer)``, what the
    simulator assumes when told nothing else;
    ``vllm_hit_source``: the ``CacheHitSource`` member vLLM files its hits under;
    ``event_medium``: the ``medium`` its blocks' KV events carry, spelt as vLLM's
    own tiers spell theirs (:data:`kvpool.events.MEDIUM_CPU` for host memory,
    :data:`kvpool.events.MEDIUM_STORAGE` for a disk or a server), so a router that
    credits vLLM's tiers credits kvpool's alike (:func:`kvpool.tiers.store.event_medium`).
    """

    kind: TierKind
    prefixes: tuple[str, ...]
    parse: Callable[[str], Any]
    open: Callable[[Any, EntryCodec], BlockStore] | None
    example: str
    shared: bool
    outlives_process: bool
    fleet_wide: bool
    link: tuple[float, float]
    vllm_hit_source: str
    event_medium: str

    def names(self, spec: str) -> bool:
        return spec.startswith(self.prefixes)


def parse_size(text: str, *, field: str = "size") -> int:
    """Bytes in ``text`` (50GiB, 500MB, 4096), in :func:`kvpool.checks.parse_size`'s units; at least one byte."""
    if not isinstance(text, str):
        raise ConfigError(f"{field} must be a size such as 50GiB, 500MB or 1048576 (bytes), got {text!r}")
    size = checks.parse_size(text, field=field)
    if size <= 0:
        raise ConfigError(f"{field} must be a positive size, got {text!r}")
    return size
