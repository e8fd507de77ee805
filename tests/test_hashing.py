"""Chained block hashes: reproducible, incremental, keyed by salt, LoRA and media."""

from __future__ import annotations

import hashlib
import importlib.util
from array import array

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool import BlockHasher, ConfigError, HashAlgo, KVCacheManager, KVPoolError, MultiModalInput, Request
from kvpool.hashing import TOKEN_TYPECODE, extra_key_bytes, lora_key, salt_key, token_bytes

TOKENS = list(range(1000, 1040))  # 10 blocks of 4


def test_hashes_are_reproducible_and_depend_on_the_seed():
    one = BlockHasher(4).hash_token_ids(TOKENS)
    two = BlockHasher(4).hash_token_ids(TOKENS)
    other = BlockHasher(4, seed=b"another deployment").hash_token_ids(TOKENS)
    assert one == two
    assert len(one) == 10 and len(set(one)) == 10
    assert all(len(h) == 32 for h in one)
    assert not set(one) & set(other)


def test_the_chain_matches_its_documented_definition():
    hasher = BlockHasher(4)
    hashes = hasher.hash_token_ids(TOKENS[:8])
    root = hashlib.sha256(b"root:" + hasher.seed).digest()
    block0 = b"".join(t.to_bytes(4, "little") for t in TOKENS[:4])
    block1 = b"".join(t.to_bytes(4, "little") for t in TOKENS[4:8])
    h0 = hashlib.sha256(root + block0).digest()
    assert hashes == [h0, hashlib.sha256(h0 + block1).digest()]


def test_only_full_blocks_are_hashed():
    assert len(BlockHasher(4).hash_token_ids(TOKENS[:11])) == 2
    assert BlockHasher(16).hash_token_ids(TOKENS[:15]) == []


def test_a_block_hash_identifies_the_whole_prefix():
    hasher = BlockHasher(4)
    base = hasher.hash_token_ids(TOKENS)
    changed = TOKENS.copy()
    changed[0] += 1  # first block differs, so every later hash differs too
    assert not set(base) & set(hasher.hash_token_ids(changed))
    tail = TOKENS.copy()
    tail[-1] += 1
    assert hasher.hash_token_ids(tail)[:-1] == base[:-1]


def test_incremental_hashing_equals_hashing_at_once():
    mgr = KVCacheManager(64, 4)
    req = Request("r", TOKENS[:6])
    mgr.hash_request(req)
    assert len(req.block_hashes) == 1
    for token in TOKENS[6:]:
        req.append_output_token_ids(token)
    assert req.block_hashes == BlockHasher(4).hash_token_ids(TOKENS)


def test_salt_enters_block_zero_and_the_chain_carries_it():
    hasher = BlockHasher(4)
    plain = hasher.hash_token_ids(TOKENS)
    salted = hasher.hash_token_ids(TOKENS, cache_salt="tenant-a")
    other = hasher.hash_token_ids(TOKENS, cache_salt="tenant-b")
    assert all(p != s for p, s in zip(plain, salted))
    assert all(s != o for s, o in zip(salted, other))


def test_lora_name_enters_every_block():
    hasher = BlockHasher(4)
    plain = hasher.hash_token_ids(TOKENS)
    lora = hasher.hash_token_ids(TOKENS, lora_name="sql-adapter")
    assert all(p != q for p, q in zip(plain, lora))


def test_multimodal_items_change_only_the_blocks_they_overlap_and_later():
    hasher = BlockHasher(4)
    image_a = MultiModalInput(identifier="img-a", offset=9, length=6)  # blocks 2 and 3
    image_b = MultiModalInput(identifier="img-b", offset=9, length=6)
    plain = hasher.hash_token_ids(TOKENS)
    with_a = hasher.hash_token_ids(TOKENS, mm_inputs=[image_a])
    with_b = hasher.hash_token_ids(TOKENS, mm_inputs=[image_b])
    assert with_a[:2] == plain[:2]
    assert with_a[2] != plain[2] and with_a[2] != with_b[2]
    shifted = hasher.hash_token_ids(TOKENS, mm_inputs=[MultiModalInput(identifier="img-a", offset=10, length=5)])
    assert shifted[2] != with_a[2]  # the offset within the block is part of the key


@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor"])
@pytest.mark.parametrize(("offset", "length"), [(40, 1), (38, 3), (10_000, 2)])
def test_media_beyond_the_tokens_is_refused_as_a_request_refuses_it(algo, offset, length):
    hasher = BlockHasher(4, algo)
    beyond = MultiModalInput(identifier="img-far", offset=offset, length=length)
    with pytest.raises(
        ConfigError, match=rf"'img-far' covers positions {offset}\.\.{offset + length - 1}, beyond the 40"
    ):
        hasher.hash_token_ids(TOKENS, mm_inputs=[beyond])
    with pytest.raises(KVPoolError, match="img-far"):
        Request("r", TOKENS, mm_inputs=[beyond])
    last = MultiModalInput(identifier="img-end", offset=36, length=4)  # up to the last token: fine
    assert len(hasher.hash_token_ids(TOKENS, mm_inputs=[last])) == 10


def test_xxh3_algorithm_is_available_and_different():
    pytest.importorskip("xxhash")
    fast = BlockHasher(4, "xxh3_128").hash_token_ids(TOKENS)
    assert len(fast) == 10 and all(len(h) == 16 for h in fast)
    assert fast == BlockHasher(4, HashAlgo.XXH3_128).hash_token_ids(TOKENS)
    assert HashAlgo.SHA256.is_cryptographic and not HashAlgo.XXH3_128.is_cryptographic


@pytest.mark.parametrize("algo", ["md5", "", "sha-1"])
def test_unknown_algorithm_is_rejected_by_name(algo):
    with pytest.raises(ConfigError, match="unknown hash algorithm"):
        KVCacheManager(8, 4, hash_algo=algo)


def test_a_request_cannot_move_to_a_manager_with_other_hashing():
    first, second = KVCacheManager(8, 4), KVCacheManager(8, 8)
    req = Request("r", TOKENS)
    first.hash_request(req)
    with pytest.raises(ValueError, match="block_size=4"):
        second.hash_request(req)


@settings(max_examples=200, deadline=None)
@given(
    tokens=st.lists(st.integers(min_value=0, max_value=2**32 - 1), max_size=40),
    block_size=st.sampled_from([1, 2, 4]),
    salt=st.sampled_from([None, "t", "tenant-b"]),
    lora=st.sampled_from([None, "adapter"]),
    media=st.lists(st.tuples(st.integers(0, 30), st.integers(1, 6)), max_size=3),
    split=st.integers(min_value=0, max_value=40),
    algo=st.sampled_from(["kvpool_sha256", "xxh3_128"] if importlib.util.find_spec("xxhash") else ["kvpool_sha256"]),
)
def test_every_key_layout_hashes_like_the_per_block_definition(tokens, block_size, salt, lora, media, split, algo):
    """The fast paths (no keys, a LoRA suffix, a salted first block) equal the per-block definition."""
    items = tuple(
        sorted(
            (
                MultiModalInput(identifier=f"img{i}", offset=o, length=n)
                for i, (o, n) in enumerate(media)
                if o + n <= len(tokens)
            ),
            key=lambda m: m.offset,
        )
    )
    hasher = BlockHasher(block_size, algo)
    lk, sk = lora_key(lora), salt_key(salt)
    full = len(tokens) // block_size
    extras = [extra_key_bytes(lk, sk, items, k * block_size, (k + 1) * block_size) for k in range(full)]
    raw = array(TOKEN_TYPECODE, tokens[: full * block_size])
    expected, expected_contents = hasher.chain(None, token_bytes(raw), extras)
    assert hasher.hash_token_ids(tokens, cache_salt=salt, lora_name=lora, mm_inputs=items) == expected
    # the same, grown token by token after a prompt of `split` tokens, as a request is
    if tokens:
        cut = max(1, min(split, len(tokens)))
        request = Request(
            "r",
            tokens[:cut],
            cache_salt=salt,
            lora_name=lora,
            mm_inputs=[m for m in items if m.offset + m.length <= cut],
        )
        if len(request.mm_inputs) == len(items):
            request._bind(hasher)
            for t in tokens[cut:]:
                request.append_output_token_ids(t)
            assert request.block_hashes == expected
            assert request._block_contents == expected_contents
