"""Tiers below GPU memory, as byte stores: blocks keyed by chained block hash, kept as entries that cannot lie.

* :mod:`kvpool.tiers.entry`: the entry format and :class:`EntryCodec` (header, checksum, HMAC).
* :mod:`kvpool.tiers.store`: the :class:`BlockStore` contract and :func:`open_store` for a spec.
* :mod:`kvpool.tiers.disk`: :class:`DiskStore`, a directory bounded in bytes, LRU, restart-safe.
* :mod:`kvpool.tiers.redis_store`: :class:`RedisStore`, a Redis server or cluster shared by replicas.

Torch-free; the Redis client is imported only when a Redis store is opened (the ``tiers`` extra).
"""

from kvpool.tiers.counters import TierStats
from kvpool.tiers.disk import DiskStore
from kvpool.tiers.entry import CorruptEntry, CorruptKind, EntryCodec, LayoutFingerprint
from kvpool.tiers.redis_store import RedisStore, RedisTarget
from kvpool.tiers.store import BlockStore, CpuTarget, DiskTarget, open_store, parse_size, parse_spec

__all__ = [
    "BlockStore",
    "CorruptEntry",
    "CorruptKind",
    "CpuTarget",
    "DiskStore",
    "DiskTarget",
    "EntryCodec",
    "LayoutFingerprint",
    "RedisStore",
    "RedisTarget",
    "TierStats",
    "open_store",
    "parse_size",
    "parse_spec",
]
