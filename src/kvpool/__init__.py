"""kvpool: a paged KV cache manager for LLM inference.

All KV memory is one pool of fixed-size blocks allocated once; serving is
bookkeeping on block IDs: a free queue whose order is the eviction policy,
reference counts for shared prefixes, and chained block hashes that make
prefix caching a dictionary lookup.

The core (this package's top level) needs only the standard library.
"""

from kvpool.errors import (
    CapacityError,
    ConfigError,
    InvalidTokenError,
    InvariantViolation,
    KVPoolError,
    RequestStateError,
)
from kvpool.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from kvpool.hashing import DEFAULT_HASH_SEED, BlockHash, BlockHasher, HashAlgo, MultiModalInput
from kvpool.manager import HitBlocks, KVCacheManager
from kvpool.request import Request
from kvpool.stats import PrefixCacheStats

__version__ = "0.1.0"

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
    "Request",
    "RequestStateError",
]
