"""Tiers below GPU memory: their kinds and specs, their stores, and the hierarchy that uses them.

* :mod:`kvpool.tiers.kinds`: :class:`TierKind`, :class:`WritePolicy`, the host-memory spec.
* :mod:`kvpool.tiers.store`: the :class:`BlockStore` contract, the registry of kinds
  (:data:`~kvpool.tiers.store.BACKENDS`), :func:`parse_spec` (the one spec parser), :func:`open_store`
  and :func:`check_tier_trust` (a shared tier needs a secret, or the operator's word that it goes without).
* :mod:`kvpool.tiers.entry`: the entry format and :class:`EntryCodec` (header, checksum, MAC).
* :mod:`kvpool.tiers.disk`: :class:`DiskStore`, a directory bounded in bytes, LRU, restart-safe.
* :mod:`kvpool.tiers.redis_store`: :class:`RedisStore`, a Redis server or cluster shared by replicas.
* :mod:`kvpool.tiers.hierarchy`: :class:`TierHierarchyConnector`, the KV connector over the tiers,
  with its write policy; the engine moves its bytes, the simulator times them.

Torch-free; the Redis client is imported only when a Redis spec is parsed or a store opened (the
``tiers`` extra).
"""

from kvpool.tiers.counters import TierStats
from kvpool.tiers.disk import DiskStore, DiskTarget
from kvpool.tiers.entry import CorruptEntry, CorruptKind, EntryCodec, LayoutFingerprint
from kvpool.tiers.hierarchy import ByteTier, HostTier, TierCounters, TierHierarchyConnector
from kvpool.tiers.kinds import CpuTarget, TierKind, WritePolicy
from kvpool.tiers.redis_store import RedisStore, RedisTarget
from kvpool.tiers.store import (
    BACKENDS,
    BlockStore,
    TierTarget,
    check_tier_trust,
    open_store,
    parse_size,
    parse_spec,
    parse_specs,
)

__all__ = [
    "BACKENDS",
    "BlockStore",
    "ByteTier",
    "CorruptEntry",
    "CorruptKind",
    "CpuTarget",
    "DiskStore",
    "DiskTarget",
    "EntryCodec",
    "HostTier",
    "LayoutFingerprint",
    "RedisStore",
    "RedisTarget",
    "TierCounters",
    "TierHierarchyConnector",
    "TierKind",
    "TierStats",
    "TierTarget",
    "WritePolicy",
    "check_tier_trust",
    "open_store",
    "parse_size",
    "parse_spec",
    "parse_specs",
]
