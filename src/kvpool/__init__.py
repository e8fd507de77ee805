"""kvpool: a paged KV cache manager for LLM inference.

KV memory is reserved once, as a pool of fixed-size blocks. At run time
kvpool only moves block IDs around: a linked free list ordered for eviction,
per-block owner counts so prompts can share a cached prefix, and a hash
chain over full blocks so that finding a cached prefix is a dict lookup.

The core (this package's top level) needs only the standard library.
"""

from kvpool.build_info import VERSION
from kvpool.build_info import build as _build
from kvpool.errors import (
    CapacityError,
    ConfigError,
    InvalidTokenError,
    InvariantViolation,
    KVPoolError,
    ReadOnlyFieldError,
    RequestStateError,
)
from kvpool.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from kvpool.hashing import DEFAULT_HASH_SEED, BlockHash, BlockHasher, HashAlgo, MultiModalInput
from kvpool.manager import HitBlocks, KVCacheManager
from kvpool.request import Request
from kvpool.stats import PrefixCacheStats

__version__ = VERSION
#: Which build runs: ``"pure"`` (interpreted, the reference), ``"compiled"`` (the core
#: compiled with mypyc: ``KVPOOL_COMPILE=1 pip install .``) or ``"mixed"`` (a partial build).
BUILD = _build()

__all__ = [
    "DEFAULT_HASH_SEED",
    "AllBlocksCleared",
    "BlockHash",
    "BlockHasher",
    "BlockRemoved",
    "BlockStored",
    "CapacityError",
    "ConfigError",
    "HashAlgo",
    "HitBlocks",
    "InvalidTokenError",
    "InvariantViolation",
    "KVCacheEvent",
    "KVCacheManager",
    "KVPoolError",
    "MultiModalInput",
    "PrefixCacheStats",
    "ReadOnlyFieldError",
    "Request",
    "RequestStateError",
]
