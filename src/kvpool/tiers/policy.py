"""The tier rules every driver follows, keyed by block hashes: one home for them.

kvpool's tiers are driven three ways: by the engine and the simulator (through
:class:`~kvpool.tiers.hierarchy.TierHierarchyConnector`, with kvpool's requests and
block tables) and inside vLLM (:class:`~kvpool.integrations.vllm.plan.TierPlanner`,
with vLLM's). Each translates its own requests into the chained block hashes and asks
:class:`TierPolicy`, which knows nothing of either:

* **lookup** (:meth:`TierPolicy.match`): after the local hit, each next block is taken
  from the first tier, in the configured order, that holds it, as a run as long as that
  tier holds; the next block is looked up from the first tier again; the match ends at
  the first block no tier holds. A CPU tier holding blocks 4-7 behind a Redis holding
  0-3 gives all eight blocks;
* **where a block goes down** (:meth:`TierPolicy.destinations`): a computed block to
  every tier, a loaded one to the tiers above the one it came from (a promotion);
* **the host slot** (:meth:`TierPolicy.place`): a save to the CPU tier takes a host
  block, evicting the least recently used one; a key already there, or no host block
  free of pins, drops the CPU tier from that save. The keys evicted come back with
  the placement, so no driver leaves them piling up.

The tiers it consults are :class:`HostTier` (host memory, bookkept in a block pool of
its own) and :class:`ByteTier` (a :class:`~kvpool.tiers.store.BlockStore`: disk,
Redis), whose faults are misses.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from kvpool.block import KVBlock
from kvpool.block_pool import BlockPool
from kvpool.checks import check_int
from kvpool.connector import GPU
from kvpool.errors import ConfigError, InvariantViolation
from kvpool.events import BlockRemoved
from kvpool.hashing import BlockHash
from kvpool.tiers.kinds import TierKind

__all__ = ["ByteTier", "HostTier", "Placement", "PrefixLookup", "Tier", "TierCounters", "TierPolicy"]

_LOGGER = logging.getLogger("kvpool.tiers")


@dataclass(slots=True)
class TierCounters:
    """Cumulative figures of one tier, as the connector sees it."""

    name: str
    hit_blocks: int = 0  # blocks promised from this tier at admission
    failed_blocks: int = 0  # promised blocks that were then computed (the load failed)
    saved_blocks: int = 0  # blocks sent to this tier
    lookup_errors: int = 0  # lookups that raised (a backend fault; counted as misses)


class HostTier:
    """The CPU tier's bookkeeping: host blocks in a :class:`~kvpool.block_pool.BlockPool` of their own.

    A host block holds one pool block's KV for every layer. The pool's prefix
    index maps a chained block hash to the host block holding it, and its
    free queue is the eviction order: a stored block rests in the queue as a
    cached block (least recently used first), a load or a save pins it for the
    step (reference count 1) and releases it to the back. The worker side owns
    the host memory and copies at the slots named here. O(1) per block.
    """

    name = TierKind.CPU.value

    def __init__(self, num_blocks: int) -> None:
        check_int("CPU tier blocks", num_blocks)
        self.num_blocks = num_blocks
        # Host block 0 is the pool's null block, never used; the pool's events name the keys it evicts.
        self.pool = BlockPool(num_blocks + 1, enable_events=True)

    def take_evicted(self) -> list[bytes]:
        """Keys evicted since the last call, oldest first (for the tier's ``BlockRemoved`` events)."""
        return [bytes(h) for e in self.pool.take_events() if isinstance(e, BlockRemoved) for h in e.block_hashes]

    def contains_prefix(self, keys: Sequence[bytes]) -> int:
        cached = self.pool.cached_block
        count = 0
        for key in keys:
            if cached(BlockHash(key)) is None:
                break
            count += 1
        return count

    def pin(self, key: bytes) -> int:
        """The host block holding ``key``, pinned until :meth:`release`."""
        block = self.pool.cached_block(BlockHash(key))
        if block is None:
            raise InvariantViolation(f"host block for key {key.hex()[:16]} was evicted between lookup and load")
        self.pool.touch([block])
        return block.block_id

    def reserve(self, key: bytes) -> int | None:
        """A host block to save ``key`` into, pinned and indexed; None if it is there already or all are pinned."""
        if self.pool.cached_block(BlockHash(key)) is not None or self.pool.num_free_blocks == 0:
            return None
        [block] = self.pool.get_new_blocks(1)  # evicts the least recently used cached block
        self.pool.cache_block(block, BlockHash(key))
        return block.block_id

    def release(self, slots: Sequence[int]) -> None:
        """Unpin host blocks: back of the queue, most recently used."""
        blocks: list[KVBlock] = [self.pool.block(slot) for slot in slots]
        self.pool.free_blocks(blocks)

    def discard(self, slots: Sequence[int]) -> None:
        """Unpin host blocks reserved for saves that will never be written, and forget their keys.

        No removal is announced: a reserved key is announced stored only once its save is done.
        """
        blocks: list[KVBlock] = [self.pool.block(slot) for slot in slots]
        for block in blocks:
            if block.block_hash is not None:
                self.pool.uncache(block)
        self.pool.take_events()  # only these removals since the last save was planned (take_evicted drains)
        self.pool.free_blocks(blocks)

    def clear(self) -> list[bytes]:
        """Forget every stored block and pin (after a step failed: a reserved block may never have been written).

        Returns the keys it forgot.
        """
        forgotten = [bytes(b.block_hash) for b in self.pool.blocks if b.block_hash is not None]
        self.pool = BlockPool(self.num_blocks + 1, enable_events=True)
        return forgotten

    @property
    def num_stored(self) -> int:
        return self.pool.num_cached()


class PrefixLookup(Protocol):
    """The part of a :class:`kvpool.tiers.store.BlockStore` the scheduler side uses."""

    name: str

    def contains_prefix(self, keys: Sequence[bytes]) -> int: ...


class ByteTier:
    """A tier whose entries are bytes in a :class:`kvpool.tiers.store.BlockStore` (disk, Redis).

    Only the lookup is made here; the worker side reads and writes the store.
    A store that raises is a miss, logged once: faults never stop serving.
    """

    def __init__(self, store: PrefixLookup) -> None:
        name = getattr(store, "name", None)
        if not isinstance(name, str) or not callable(getattr(store, "contains_prefix", None)):
            raise ConfigError(f"a byte tier needs a BlockStore (name, contains_prefix, ...), got {store!r}")
        self.name = name
        self.store = store
        self._warned = False
        self.lookup_errors = 0

    def contains_prefix(self, keys: Sequence[bytes]) -> int:
        try:
            found = self.store.contains_prefix(keys)
        except Exception as exc:  # noqa: BLE001  # a backend fault is a miss; serving goes on
            self.lookup_errors += 1
            if not self._warned:
                _LOGGER.warning("KV tier %s: lookup failed (%s); treated as a miss", self.name, exc)
                self._warned = True
            return 0
        self._warned = False
        return found if type(found) is int and 0 <= found <= len(keys) else 0


Tier = HostTier | ByteTier


@dataclass(frozen=True, slots=True)
class Placement:
    """Where one save goes: ``tiers`` (empty: nowhere), the CPU tier's ``host_slot`` (pinned) if it is
    among them, and the keys the CPU tier ``evicted`` to make room (for its ``BlockRemoved`` events)."""

    tiers: tuple[str, ...]
    host_slot: int | None = None
    evicted: tuple[bytes, ...] = ()


class TierPolicy:
    """Lookup, destinations and host placement over ``tiers``, in the order given (see the module).

    Torch-free and keyed by block hashes: the drivers translate their requests and block
    tables into keys and back. O(blocks looked up) per match, O(1) per placement.
    """

    def __init__(self, tiers: Sequence[Tier]) -> None:
        tiers = tuple(tiers)
        if not tiers:
            raise ConfigError("a tier hierarchy needs at least one tier")
        names = tuple(t.name for t in tiers)
        if len(set(names)) != len(names) or GPU in names:
            raise ConfigError(f"tier names must be distinct and not {GPU!r}, got {list(names)}")
        hosts = [t for t in tiers if isinstance(t, HostTier)]
        if len(hosts) > 1:
            raise ConfigError(f"at most one host-memory tier, got {list(names)}")
        self.tiers = tiers
        self.names = names
        self.host: HostTier | None = hosts[0] if hosts else None
        self._rank = {name: i for i, name in enumerate(names)}

    def match(self, keys: Sequence[bytes]) -> tuple[tuple[str, int], ...]:
        """Runs ``(tier name, blocks)`` that cover the longest prefix of ``keys`` the tiers hold (changes no tier)."""
        runs: list[tuple[str, int]] = []
        pos = 0
        while pos < len(keys):
            rest = keys[pos:]
            for tier in self.tiers:
                found = tier.contains_prefix(rest)
                if found:
                    runs.append((tier.name, found))
                    pos += found
                    break
            else:
                break
        return tuple(runs)

    def destinations(self, origin: str | None) -> tuple[str, ...]:
        """The tiers a block goes down to: every tier when computed (``origin`` None), else those above it."""
        if origin is None:
            return self.names
        rank = self._rank.get(origin)
        if rank is None:
            raise ConfigError(f"origin {origin!r} is not one of the tiers {list(self.names)}")
        return self.names[:rank]

    def place(self, key: bytes, tiers: tuple[str, ...]) -> Placement:
        """Where a save of ``key`` to ``tiers`` goes, a host block reserved for it if the CPU tier is one.

        ConfigError, with nothing reserved, for a key that is not bytes or a tier that is not one of these.
        """
        if not isinstance(key, bytes) or not key:
            raise ConfigError(f"a tier key must be non-empty bytes, got {key!r:.80}")
        if not isinstance(tiers, tuple) or not set(tiers) <= set(self.names):
            raise ConfigError(f"tiers must be a tuple of {list(self.names)}, got {tiers!r}")
        host = self.host
        if host is None or host.name not in tiers:
            return Placement(tiers)
        slot = host.reserve(key)
        evicted = tuple(host.take_evicted())
        if slot is None:  # already there, or every host block is pinned
            return Placement(tuple(t for t in tiers if t != host.name), None, evicted)
        return Placement(tiers, slot, evicted)
