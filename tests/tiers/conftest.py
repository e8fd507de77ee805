"""Fixtures of the tier store tests: one layout and its codecs."""

from __future__ import annotations

import pytest

from kvpool.tiers import EntryCodec, LayoutFingerprint

LAYOUT = LayoutFingerprint(
    architecture="LlamaForCausalLM",
    num_layers=30,
    num_kv_heads=3,
    head_size=64,
    dtype="bfloat16",
    block_size=16,
    hash_algo="sha256",
    hash_seed="6b76706f6f6c",
    weights="sha256:" + "5e" * 32,
)


def block_key(i: int) -> bytes:
    """A 32-byte key standing in for a chained block hash."""
    return i.to_bytes(4, "big") * 8


@pytest.fixture
def codec() -> EntryCodec:
    return EntryCodec(LAYOUT)


@pytest.fixture
def signed_codec() -> EntryCodec:
    return EntryCodec(LAYOUT, secret=b"a shared tier secret")
