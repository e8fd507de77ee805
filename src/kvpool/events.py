"""KV cache events: what a router needs to know about this replica's cache.

A router that sends requests to the replica already holding their prefix
follows these events. They are recorded only when the manager is built with
``enable_events=True`` and are drained with ``KVCacheManager.take_events()``;
:mod:`kvpool.kv_events` puts them on the wire in vLLM's format.

Every event names the ``medium`` that holds (or held) its blocks, spelt as
vLLM spells it: :data:`MEDIUM_GPU` for the manager's own pool,
:data:`MEDIUM_CPU` for host memory, :data:`MEDIUM_STORAGE` for anything
below it (a disk, a Redis server; vLLM's file-system and object-store tiers).
Each kvpool tier's medium is a fact of its backend
(:func:`kvpool.tiers.store.event_medium`); a router may meet other spellings
from other servers and takes them as they come. A stored block's ``group_id`` is its KV cache group
(hybrid models have several), described by ``spec_kind`` (a
:class:`kvpool.specs.LayerKind` value) and, for sliding-window groups,
``sliding_window``.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpool.hashing import BlockHash, ExtraKey

__all__ = [
    "MEDIUM_CPU",
    "MEDIUM_GPU",
    "MEDIUM_STORAGE",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "KVCacheEvent",
]

#: The medium of blocks in a manager's own pool (vLLM: ``vllm.distributed.kv_events.MEDIUM_GPU``).
MEDIUM_GPU = "GPU"
#: Host memory below the pool (vLLM: ``Medium.CPU`` of ``vllm.v1.kv_offload.base``).
MEDIUM_CPU = "CPU"
#: Storage below host memory, local or shared (vLLM: ``Medium.STORAGE``, its file-system and object tiers).
MEDIUM_STORAGE = "STORAGE"


@dataclass(frozen=True, slots=True, kw_only=True)
class BlockStored:
    """Consecutive full blocks of one request entered the prefix cache.

    ``parent_block_hash`` is the hash of the block before the first one (None
    when the first stored block is the request's block 0). ``token_ids`` holds
    ``len(block_hashes) * block_size`` tokens; ``extra_keys`` has one entry per
    block (None for a block without extra keys).
    """

    block_hashes: tuple[BlockHash, ...]
    parent_block_hash: BlockHash | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_name: str | None
    extra_keys: tuple[tuple[ExtraKey, ...] | None, ...]
    group_id: int = 0
    medium: str = MEDIUM_GPU
    spec_kind: str | None = None
    sliding_window: int | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class BlockRemoved:
    """Cached blocks were evicted (their memory is being reused)."""

    block_hashes: tuple[BlockHash, ...]
    group_id: int = 0
    medium: str = MEDIUM_GPU


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The whole prefix cache was reset."""


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared
