"""The public surface: pinned names, and a core that imports without torch."""

from __future__ import annotations

import subprocess
import sys

import kvpool

EXPECTED = {
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
}


def test_public_names_are_pinned():
    assert set(kvpool.__all__) == EXPECTED
    for name in EXPECTED:
        assert getattr(kvpool, name) is not None


def test_errors_are_value_errors():
    for name in ("KVPoolError", "ConfigError", "InvalidTokenError", "RequestStateError", "CapacityError"):
        assert issubclass(getattr(kvpool, name), ValueError)
    assert issubclass(kvpool.InvariantViolation, AssertionError)


def test_the_documented_request_and_manager_api():
    request = kvpool.Request("A", prompt_token_ids=[1, 2, 3], cache_salt=None, lora_name=None)
    for attribute in ("request_id", "num_tokens", "num_prompt_tokens", "num_output_tokens", "num_computed_tokens"):
        assert hasattr(request, attribute)
    manager = kvpool.KVCacheManager(num_blocks=12, block_size=4)
    assert manager.enable_caching and manager.hasher.algo is kvpool.HashAlgo.SHA256
    for method in (
        "get_computed_blocks",
        "allocate_slots",
        "free",
        "get_block_ids",
        "free_queue_block_ids",
        "reset_prefix_cache",
        "take_events",
        "check_invariants",
        "hash_request",
    ):
        assert callable(getattr(manager, method))


def test_importing_the_core_does_not_import_torch():
    code = (
        "import sys, kvpool, kvpool.manager, kvpool.coordinator, kvpool.groups;"
        "bad = sorted(m for m in ('torch', 'numpy', 'transformers', 'click') if m in sys.modules);"
        "print(bad); sys.exit(1 if bad else 0)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
