"""Entries that cannot lie: what decode refuses, and that it gives back exactly what was encoded."""

from __future__ import annotations

import dataclasses
import hashlib
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.errors import ConfigError, ExternalDataError, KVPoolError
from kvpool.secret_files import MIN_SECRET_BYTES
from kvpool.tiers import CorruptEntry, CorruptKind, EntryCodec
from kvpool.tiers import entry as entry_module
from kvpool.tiers.entry import FORMAT_VERSION, Checksum, Signature
from tests.tiers.conftest import LAYOUT, block_key

KEY = block_key(7)


def refused(codec: EntryCodec, data: bytes, key: bytes = KEY) -> CorruptKind:
    with pytest.raises(CorruptEntry) as info:
        codec.decode(key, data)
    return info.value.kind


def test_round_trip_signed_and_unsigned(codec, signed_codec):
    payload = bytes(range(256)) * 40
    assert codec.decode(KEY, codec.encode(KEY, payload)) == payload
    assert signed_codec.decode(KEY, signed_codec.encode(KEY, payload)) == payload
    assert codec.decode(KEY, codec.encode(KEY, memoryview(payload))) == payload
    assert codec.decode(KEY, codec.encode(KEY, b"")) == b""


@settings(max_examples=200, deadline=None)
@given(
    payload=st.binary(max_size=4096),
    key=st.binary(min_size=1, max_size=64),
    secret=st.none() | st.binary(min_size=MIN_SECRET_BYTES),
)
def test_round_trip_any_payload(payload, key, secret):
    codec = EntryCodec(LAYOUT, secret)
    assert codec.decode(key, codec.encode(key, payload)) == payload


@settings(max_examples=200, deadline=None)
@given(payload=st.binary(min_size=1, max_size=512), data=st.data())
def test_any_single_bit_flip_is_refused(payload, data):
    codec = EntryCodec(LAYOUT, b"a secret of sixteen bytes")
    entry = bytearray(codec.encode(KEY, payload))
    bit = data.draw(st.integers(0, len(entry) * 8 - 1))
    entry[bit // 8] ^= 1 << (bit % 8)
    with pytest.raises(CorruptEntry):
        codec.decode(KEY, bytes(entry))


@pytest.mark.parametrize("cut", [0, 10, 79, 80, 100, 111, 112, 150, -1])
def test_truncated(signed_codec, cut):
    entry = signed_codec.encode(KEY, b"p" * 100)
    assert refused(signed_codec, entry[:cut]) is CorruptKind.TRUNCATED


def test_trailing_bytes_are_malformed(codec):
    assert refused(codec, codec.encode(KEY, b"p" * 100) + b"x") is CorruptKind.MALFORMED
    assert refused(codec, b"GIF89a" + bytes(200)) is CorruptKind.MALFORMED


def test_payload_bit_flip_fails_the_checksum(codec):
    entry = bytearray(codec.encode(KEY, b"p" * 100))
    entry[-1] ^= 0x01
    assert refused(codec, bytes(entry)) is CorruptKind.CHECKSUM


@pytest.mark.parametrize("version", [1, 2, 3, 5, 255])
def test_other_version(codec, version):
    entry = bytearray(codec.encode(KEY, b"p"))
    entry[4] = version
    assert refused(codec, bytes(entry)) is CorruptKind.VERSION


def test_a_version_1_entry_is_refused_as_another_version(codec, signed_codec):
    """Version 1 (SHA-256 checksum, 80-byte header), as kvpool wrote it before, is a counted miss, not garbage."""
    payload = b"p" * 100
    header = struct.Struct("<4sBBHQ32s32s").pack(
        b"KVPE", 1, 0, len(KEY), len(payload), LAYOUT.digest(), hashlib.sha256(payload).digest()
    )
    assert refused(codec, header + KEY + payload) is CorruptKind.VERSION
    assert refused(signed_codec, header + KEY + payload) is CorruptKind.VERSION


def test_a_version_2_entry_is_refused_as_another_version(codec, signed_codec):
    """Version 2 (the same 72-byte header, HMAC-SHA256 the only MAC), as kvpool wrote it before, is refused."""
    hmac_codec = EntryCodec(LAYOUT, b"a shared tier secret", signature=Signature.HMAC_SHA256)
    for writer in (codec, hmac_codec):
        entry = bytearray(writer.encode(KEY, b"p" * 100))
        entry[4] = 2
        assert refused(codec, bytes(entry)) is CorruptKind.VERSION
        assert refused(signed_codec, bytes(entry)) is CorruptKind.VERSION


def test_the_header_names_the_checksum_and_signature_kind(codec, signed_codec):
    entry = codec.encode(KEY, b"p" * 100)
    assert entry[4:7] == bytes([FORMAT_VERSION, Checksum.best_available().value, Signature.NONE.value])
    assert signed_codec.encode(KEY, b"p")[6] == Signature.best_available().value == signed_codec.signature.value


@pytest.mark.parametrize("offset, value", [(5, 0), (5, 9), (6, 4), (6, 200)])
def test_unknown_checksum_or_signature_kind_is_refused(codec, offset, value):
    entry = bytearray(codec.encode(KEY, b"p" * 100))
    entry[offset] = value
    assert refused(codec, bytes(entry)) is CorruptKind.CHECK_KIND


@pytest.mark.parametrize("offset", [7, 10, 15])
def test_reserved_header_bytes_must_be_zero(codec, offset):
    entry = bytearray(codec.encode(KEY, b"p" * 100))
    entry[offset] = 1
    assert refused(codec, bytes(entry)) is CorruptKind.MALFORMED


def test_crc32_entries_read_with_any_codec(codec, signed_codec):
    crc = EntryCodec(LAYOUT, checksum=Checksum.CRC32)
    entry = crc.encode(KEY, b"p" * 100)
    assert entry[5] == Checksum.CRC32.value
    assert codec.decode(KEY, entry) == b"p" * 100
    damaged = bytearray(entry)
    damaged[-1] ^= 1
    assert refused(codec, bytes(damaged)) is CorruptKind.CHECKSUM
    signed_crc = EntryCodec(LAYOUT, b"a shared tier secret", checksum=Checksum.CRC32)
    assert signed_codec.decode(KEY, signed_crc.encode(KEY, b"q")) == b"q"


def test_xxh3_entries_are_refused_cleanly_where_xxhash_is_missing(codec, monkeypatch):
    entry = EntryCodec(LAYOUT, checksum=Checksum.XXH3_128).encode(KEY, b"p" * 100)
    monkeypatch.setitem(entry_module._CHECKSUMS, Checksum.XXH3_128, None)
    assert refused(codec, entry) is CorruptKind.CHECK_KIND
    assert Checksum.best_available() is Checksum.CRC32
    with pytest.raises(ConfigError, match="XXH3_128 needs the xxhash package"):
        EntryCodec(LAYOUT, checksum=Checksum.XXH3_128)


def test_decode_into_fills_the_buffer_only_when_sound(codec, signed_codec):
    payload = bytes(range(256)) * 4
    out = bytearray(len(payload))
    signed_codec.decode_into(KEY, signed_codec.encode(KEY, payload), memoryview(out))
    assert out == payload
    damaged = bytearray(signed_codec.encode(KEY, b"x" * len(payload)))
    damaged[-1] ^= 1
    with pytest.raises(CorruptEntry) as info:
        signed_codec.decode_into(KEY, bytes(damaged), memoryview(out))
    assert info.value.kind is CorruptKind.CHECKSUM and out == payload  # untouched
    with pytest.raises(CorruptEntry) as info:
        codec.decode_into(KEY, codec.encode(KEY, b"short"), memoryview(out))
    assert info.value.kind is CorruptKind.MALFORMED and "5 payload bytes, a block is 1024" in str(info.value)


def test_encode_parts_is_the_entry_without_copying_the_payload(signed_codec):
    payload = bytearray(b"p" * 100)
    head, body = signed_codec.encode_parts(KEY, payload)
    assert signed_codec.decode(KEY, head + bytes(body)) == payload
    entry = signed_codec.encode(KEY, payload)
    mac_at = len(head) - 32  # the MAC field may differ (GMAC draws a salt per entry); all else is the same
    assert len(entry) == len(head) + len(body) and entry[:mac_at] == head[:mac_at] and entry[len(head) :] == body
    payload[0:1] = b"q"
    assert bytes(body[:1]) == b"q"  # a view of the caller's buffer


@pytest.mark.parametrize(
    "change",
    [
        {"num_layers": 31},
        {"num_kv_heads": 4},
        {"head_size": 128},
        {"dtype": "float16"},
        {"block_size": 32},
        {"hash_algo": "xxh3_128"},
        {"hash_seed": "00"},
        {"architecture": "Qwen2ForCausalLM"},
    ],
)
def test_foreign_layout(codec, change):
    other = EntryCodec(dataclasses.replace(LAYOUT, **change))
    assert refused(codec, other.encode(KEY, b"p")) is CorruptKind.FOREIGN_LAYOUT


def test_the_layout_digest_sits_where_the_format_says(codec):
    """``LAYOUT_DIGEST_AT`` (what tools flip to fake another model's entry) is the digest's offset."""
    data = bytearray(codec.encode(KEY, b"p"))
    assert data[entry_module.LAYOUT_DIGEST_AT : entry_module.LAYOUT_DIGEST_AT + 32] == codec.fingerprint.digest()
    data[entry_module.LAYOUT_DIGEST_AT] ^= 0xFF
    assert refused(codec, bytes(data)) is CorruptKind.FOREIGN_LAYOUT


def test_entry_replayed_under_another_key(codec):
    assert refused(codec, codec.encode(block_key(8), b"p"), key=KEY) is CorruptKind.FOREIGN_KEY


def test_unsigned_and_wrongly_signed(codec, signed_codec):
    assert refused(signed_codec, codec.encode(KEY, b"p")) is CorruptKind.UNSIGNED
    other = EntryCodec(LAYOUT, secret=b"another secret, just as long")
    assert refused(signed_codec, other.encode(KEY, b"p")) is CorruptKind.BAD_SIGNATURE
    # a planted entry whose payload and checksum were both replaced still fails the MAC
    forged = bytearray(signed_codec.encode(KEY, b"p"))
    forged[56:72] = codec.encode(KEY, b"q")[56:72]
    forged[-1:] = b"q"
    assert refused(signed_codec, bytes(forged)) is CorruptKind.BAD_SIGNATURE
    # without a secret, a signed entry's checksum is still checked and it reads
    assert codec.decode(KEY, signed_codec.encode(KEY, b"p")) == b"p"


def test_corrupt_entry_is_bad_data_from_outside_not_caller_misuse():
    assert issubclass(CorruptEntry, ExternalDataError) and not issubclass(CorruptEntry, KVPoolError)


def test_fingerprint_digest_is_stable_and_distinct():
    assert LAYOUT.digest() == dataclasses.replace(LAYOUT).digest()
    assert len(LAYOUT.digest()) == 32
    assert LAYOUT.digest() != dataclasses.replace(LAYOUT, hash_seed="01").digest()


@pytest.mark.parametrize(
    "change",
    [{"num_layers": 0}, {"block_size": True}, {"dtype": ""}, {"hash_algo": "md5"}, {"architecture": None}],
)
def test_bad_fingerprint_names_the_field(change):
    ((name, value),) = change.items()
    with pytest.raises(ConfigError, match=name):
        dataclasses.replace(LAYOUT, **change)


def test_bad_codec_arguments(codec):
    with pytest.raises(ConfigError, match="secret"):
        EntryCodec(LAYOUT, secret=b"")
    with pytest.raises(ConfigError, match=f"holds 15 bytes; it needs at least {MIN_SECRET_BYTES}"):
        EntryCodec(LAYOUT, secret=b"x" * 15)  # the floor tenancy keeps too (kvpool.secret_files)
    with pytest.raises(ConfigError, match="fingerprint"):
        EntryCodec("llama")  # type: ignore[arg-type]  # the wrong type on purpose
    with pytest.raises(ConfigError, match="key"):
        codec.encode(b"", b"p")


def test_fingerprint_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        LAYOUT.num_layers = 2  # type: ignore[misc]  # assigning a frozen field on purpose
