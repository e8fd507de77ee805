"""Eviction policies: the free-queue interface and the policies behind it.

The block pool keeps every free block (``ref_cnt == 0``) in one *free queue*
object, and the order in which that object hands blocks out *is* the eviction
policy. Every policy here implements :class:`FreeQueuePolicy` and shares four
rules with the default (vLLM's order, :class:`~kvpool.free_queue.FreeBlockQueue`):

1. Released blocks without a hash (partial blocks, caching off) are reused
   first, most recently released first (they hold nothing worth keeping).
2. Blocks never handed out come next, in block-ID order, materialised lazily
   (a pool of a million blocks is built in O(1)).
3. Cached blocks come last, in the policy's own order.
4. A policy never drops a hash itself: the pool evicts a block's hash from the
   prefix-cache index only when it takes that block for new data (lazy
   eviction), so a cached free block can still be hit until that moment.

Policies are deterministic (no wall-clock time, no randomness): their clocks
count blocks handed out, so two identical replays give identical orders.

Every policy keeps its free blocks in :class:`~kvpool.linked_blocks.FreeList`
objects (linked through the block records, O(1) per block) and adds only its
ordering rules: which list a released block joins, which list the next block
comes from.

Registry (:data:`POLICIES`, read-only):

========== ==================================================== ===============
name       policy                                               module
========== ==================================================== ===============
lru        vLLM's order: least recently released first          free_queue
frequency  frequency classes with age scaled per class           frequency
waiting    ``frequency`` + protection of waiting requests'       waiting
           prefixes (hints from ``KVCacheManager.note_waiting``)
========== ==================================================== ===============

Optional capabilities, detected once when the pool is built:

* :class:`SupportsHitReports` (``on_hit``): the pool reports every prefix hit,
  on free blocks and on blocks in use. Policies without it cost the pool
  nothing extra.
* :class:`SupportsWaitingHints` (``note_waiting``): the manager forwards the
  scheduler's waiting queue.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from types import MappingProxyType
from typing import Protocol, TypeAlias, runtime_checkable

from kvpool.block import KVBlock
from kvpool.errors import ConfigError
from kvpool.free_queue import FreeBlockQueue
from kvpool.hashing import BlockHash

__all__ = [
    "POLICIES",
    "FreeQueueFactory",
    "FreeQueuePolicy",
    "SupportsHitReports",
    "SupportsWaitingHints",
    "resolve_policy",
]


@runtime_checkable
class FreeQueuePolicy(Protocol):
    """What the block pool asks of a free queue (an eviction policy).

    A policy is built as ``factory(blocks, num_blocks)``: ``blocks`` is the
    pool's list of block records indexed by block ID (it holds the records
    below ``len(blocks)``, which start *not* free); IDs from ``len(blocks)`` to
    ``num_blocks - 1`` start free and never used, and the policy appends their
    records to ``blocks`` in ID order as it hands them out.

    Attributes:
        num_free_blocks: free blocks, never-used ones included. O(1) to read.
    """

    num_free_blocks: int

    def popleft_n(self, n: int) -> list[KVBlock]:
        """Hand out ``n`` free blocks in eviction order (raises InvariantViolation if fewer)."""
        ...

    def take(self, n: int) -> list[KVBlock]:
        """Alias of :meth:`popleft_n`."""
        ...

    def remove(self, block: KVBlock) -> None:
        """Take one specific free block out (a lookup found it cached while it was free)."""
        ...

    def release(self, reuse_first: list[KVBlock], reuse_last: list[KVBlock]) -> None:
        """Blocks just freed: ``reuse_first`` hold no hash; ``reuse_last`` are cached,
        in eviction order (a request's blocks tail first)."""
        ...

    def prepend_n(self, blocks: list[KVBlock]) -> None:
        """Free blocks to reuse before anything else, ``blocks[0]`` first."""
        ...

    def append_n(self, blocks: list[KVBlock]) -> None:
        """Free cached blocks to keep, as :meth:`release` does with ``reuse_last``."""
        ...

    def block_ids(self) -> Iterator[int]:
        """Every free block ID in the order blocks would be handed out now."""
        ...

    def materialised_free_blocks(self) -> Iterator[KVBlock]:
        """The free blocks that have records (skips the never-used range)."""
        ...

    @property
    def num_never_used(self) -> int:
        """Block IDs never handed out."""
        ...

    def check(self) -> None:
        """Verify the structure (O(free blocks)); raise InvariantViolation if broken."""
        ...


@runtime_checkable
class SupportsHitReports(Protocol):
    """A policy that wants to see prefix hits, including hits on blocks in use."""

    def on_hit(self, blocks: list[KVBlock]) -> None:
        """``blocks`` just gained an owner through a prefix hit (free ones were
        already taken out with :meth:`FreeQueuePolicy.remove`). May include the
        null block, which must be ignored."""
        ...


@runtime_checkable
class SupportsWaitingHints(Protocol):
    """A policy that can protect the prefixes waiting requests will look up."""

    def note_waiting(self, waiting: Mapping[str, Sequence[BlockHash]]) -> None:
        """The waiting queue now: request ID -> its block hashes. Replaces the previous one."""
        ...


#: Builds a free queue over the pool's block records: ``factory(blocks, num_blocks)``.
FreeQueueFactory: TypeAlias = Callable[[list[KVBlock], int], FreeQueuePolicy]


def _registry() -> Mapping[str, FreeQueueFactory]:
    from kvpool.eviction.frequency import FrequencyAgedQueue
    from kvpool.eviction.waiting import WaitingAwareQueue

    return MappingProxyType({"lru": FreeBlockQueue, "frequency": FrequencyAgedQueue, "waiting": WaitingAwareQueue})


#: Policy name -> factory (read-only). ``"lru"`` is the default free queue.
POLICIES: Mapping[str, FreeQueueFactory] = _registry()


def resolve_policy(policy: str | FreeQueueFactory) -> tuple[str, FreeQueueFactory]:
    """``(name, factory)`` for a registry name or a factory (named after its ``__name__``)."""
    if isinstance(policy, str):
        try:
            return policy, POLICIES[policy]
        except KeyError:
            raise ConfigError(f"unknown eviction policy {policy!r}; choose one of {sorted(POLICIES)}") from None
    if not callable(policy):
        raise ConfigError(f"eviction policy must be a name or a factory, got {policy!r}")
    for name, factory in POLICIES.items():
        if factory is policy:
            return name, factory
    return getattr(policy, "__name__", type(policy).__name__), policy
