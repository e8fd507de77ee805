"""What an emulated replica is: its cost profile, its KV pool, its step limits, its pace.

:class:`EmulatorOptions` is checked once, at construction (a
:class:`~kvpool.errors.ConfigError` naming the field); the engine trusts it after.
The pool is given in blocks (vLLM's ``num_gpu_blocks``, the reserved block 0
included), or sized from a memory budget by the profile's ``kv_bytes_per_token``
(:func:`blocks_for_memory`), the way vLLM sizes its pool from the memory left.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kvpool.checks import check_flag, check_int
from kvpool.cost_model import CostProfile
from kvpool.errors import ConfigError
from kvpool.fair_share import TenantWeights
from kvpool.hashing import HashAlgo
from kvpool.model_names import DEFAULT_MODEL

__all__ = ["EmulatorOptions", "blocks_for_memory"]


def blocks_for_memory(profile: CostProfile, kv_cache_bytes: int, block_size: int) -> int:
    """Blocks of ``block_size`` tokens that ``kv_cache_bytes`` hold at the profile's bytes per token."""
    check_int("kv_cache_bytes", kv_cache_bytes)
    check_int("block_size", block_size)
    blocks = kv_cache_bytes // (block_size * profile.kv_bytes_per_token)
    if blocks < 2:
        raise ConfigError(
            f"a KV cache of {kv_cache_bytes} bytes holds {blocks} blocks of {block_size} tokens at "
            f"{profile.kv_bytes_per_token} bytes per token (profile {profile.name!r}); an emulated pool needs "
            "at least 2 (block 0 is reserved)"
        )
    return blocks


@dataclass(frozen=True, slots=True, kw_only=True)
class EmulatorOptions:
    """One emulated replica's settings.

    Attributes:
        profile: how long each step takes (:class:`~kvpool.cost_model.CostProfile`).
        num_blocks: blocks in the KV pool, block 0 (reserved) included, as vLLM counts them.
        block_size: tokens per block.
        max_model_len: tokens one request may hold (prompt and output).
        max_num_seqs: requests running at once at most.
        max_num_batched_tokens: tokens one step computes at most (chunked prefill).
        enable_prefix_caching: share cached prompt blocks between requests.
        enable_kv_events: record KV events for a publisher.
        hash_algo: the block hash, a :class:`~kvpool.hashing.HashAlgo` name (vLLM's ``sha256`` / ``sha256_cbor`` for hashes identical to vLLM's).
        time_scale: real seconds per modelled second (2.0 runs the replica at half the modelled speed).
        seed: mixed into every request's draw of output tokens (replicas given different seeds answer
            the same prompt differently).
        tenant_weights: each tenant's weight in the fair share of the batch, the pool and a step.
        model_name: the model whose tokenizer the replica uses (reported, never loaded as weights).
    """

    profile: CostProfile
    num_blocks: int
    block_size: int = 16
    max_model_len: int = 8192
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    enable_kv_events: bool = False
    hash_algo: str = HashAlgo.SHA256.value
    time_scale: float = 1.0
    seed: int = 0
    tenant_weights: TenantWeights = field(default_factory=TenantWeights)
    model_name: str = DEFAULT_MODEL

    def __post_init__(self) -> None:
        if not isinstance(self.profile, CostProfile):
            raise ConfigError(f"profile must be a CostProfile, got {self.profile!r}")
        check_int("num_blocks", self.num_blocks, minimum=2)
        for name in ("block_size", "max_model_len", "max_num_seqs", "max_num_batched_tokens"):
            check_int(name, getattr(self, name))
        check_int("seed", self.seed, minimum=0)
        check_flag("enable_prefix_caching", self.enable_prefix_caching)
        check_flag("enable_kv_events", self.enable_kv_events)
        scale = self.time_scale
        if isinstance(scale, bool) or not isinstance(scale, int | float) or not 0 < scale < math.inf:
            raise ConfigError(f"time_scale must be a finite number > 0, got {scale!r}")
        object.__setattr__(self, "hash_algo", HashAlgo.parse(self.hash_algo).value)
        if not isinstance(self.tenant_weights, TenantWeights):
            object.__setattr__(self, "tenant_weights", TenantWeights(self.tenant_weights))
        if not isinstance(self.model_name, str) or not self.model_name:
            raise ConfigError(f"model_name must be a non-empty string, got {self.model_name!r}")

    @property
    def pool_tokens(self) -> int:
        """Tokens the pool holds at once (its usable blocks)."""
        return (self.num_blocks - 1) * self.block_size
