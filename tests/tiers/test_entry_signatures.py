"""Each signature kind: what it signs, what it refuses, and reading one kind with a codec that signs with another."""

from __future__ import annotations

import hmac

import pytest

from kvpool.errors import ConfigError
from kvpool.tiers import CorruptEntry, CorruptKind, EntryCodec
from kvpool.tiers import entry as entry_module
from kvpool.tiers.entry import Signature
from tests.tiers.conftest import LAYOUT, block_key

pytest.importorskip("blake3")

KEY = block_key(7)
SECRET = b"a shared tier secret"
PAYLOAD = bytes(range(256)) * 16
SIGNED = [Signature.HMAC_SHA256, Signature.BLAKE3_KEYED]


def refused(codec: EntryCodec, data: bytes, key: bytes = KEY) -> CorruptKind:
    with pytest.raises(CorruptEntry) as info:
        codec.decode(key, data)
    return info.value.kind


def codec_of(signature: Signature, secret: bytes = SECRET) -> EntryCodec:
    return EntryCodec(LAYOUT, secret, signature=signature)


@pytest.mark.parametrize("signature", SIGNED)
def test_round_trip_with_each_kind(signature):
    codec = codec_of(signature)
    entry = codec.encode(KEY, PAYLOAD)
    assert entry[6] == signature.value
    assert codec.decode(KEY, entry) == PAYLOAD
    assert len(entry) == codec.max_entry_bytes(len(KEY)) - LAYOUT.block_bytes + len(PAYLOAD)  # a 32-byte MAC
    head, body = codec.encode_parts(KEY, memoryview(PAYLOAD))
    assert head + bytes(body) == entry


def test_blake3_is_the_default_where_it_is_installed():
    assert Signature.best_available() is Signature.BLAKE3_KEYED
    assert EntryCodec(LAYOUT, SECRET).signature is Signature.BLAKE3_KEYED
    assert EntryCodec(LAYOUT).signature is Signature.NONE


def test_the_blake3_key_is_derived_from_the_secret_not_the_secret_itself():
    import blake3

    entry = codec_of(Signature.BLAKE3_KEYED, b"k" * 32).encode(KEY, PAYLOAD)
    mac_at = len(entry) - len(PAYLOAD) - 32
    mac = entry[mac_at : mac_at + 32]
    signed = entry[:mac_at] + PAYLOAD
    assert mac != blake3.blake3(signed, key=b"k" * 32).digest()  # a 32-byte secret is not used as the key
    derived = blake3.blake3(b"k" * 32, derive_key_context=entry_module._BLAKE3_CONTEXT).digest()
    assert mac == blake3.blake3(signed, key=derived).digest()


@pytest.mark.parametrize("signature", SIGNED)
def test_another_secret_is_refused(signature):
    entry = codec_of(signature).encode(KEY, PAYLOAD)
    assert refused(codec_of(signature, b"another secret, just as long"), entry) is CorruptKind.BAD_SIGNATURE


@pytest.mark.parametrize("signature", SIGNED)
@pytest.mark.parametrize("where", ["payload", "header", "key"])
def test_a_changed_byte_with_its_checksum_made_good_is_refused(signature, where):
    """Whoever changes a signed entry can recompute the checksum and layout digest; the MAC still refuses it."""
    codec = codec_of(signature)
    unsigned = EntryCodec(LAYOUT)
    other_payload = b"q" + PAYLOAD[1:]
    entry = bytearray(codec.encode(KEY, PAYLOAD))
    if where == "payload":
        entry[-len(PAYLOAD)] = ord("q")
        entry[56:72] = unsigned.encode(KEY, other_payload)[56:72]  # the forged payload's own checksum
    elif where == "header":
        entry[16:24] = (len(PAYLOAD) - 1).to_bytes(8, "little")  # claims one byte less, and drops it
        del entry[-1]
        entry[56:72] = unsigned.encode(KEY, PAYLOAD[:-1])[56:72]
    else:
        entry[72] ^= 0xFF  # the key inside the entry; the reader asks for that changed key
        forged_key = bytes(entry[72 : 72 + len(KEY)])
        assert refused(codec, bytes(entry), key=forged_key) is CorruptKind.BAD_SIGNATURE
        return
    assert refused(codec, bytes(entry)) is CorruptKind.BAD_SIGNATURE


def test_a_flipped_payload_byte_without_a_new_checksum_fails_the_checksum_first():
    entry = bytearray(codec_of(Signature.BLAKE3_KEYED).encode(KEY, PAYLOAD))
    entry[-1] ^= 1
    assert refused(codec_of(Signature.BLAKE3_KEYED), bytes(entry)) is CorruptKind.CHECKSUM


@pytest.mark.parametrize("writer, reader", [(SIGNED[0], SIGNED[1]), (SIGNED[1], SIGNED[0])])
def test_a_codec_reads_the_other_kind_made_with_the_same_secret(writer, reader):
    """So a fleet moves over: replicas signing with BLAKE3 read the HMAC-SHA256 entries already stored."""
    assert codec_of(reader).decode(KEY, codec_of(writer).encode(KEY, PAYLOAD)) == PAYLOAD
    assert refused(codec_of(reader, b"another secret, just as long"), codec_of(writer).encode(KEY, PAYLOAD)) is (
        CorruptKind.BAD_SIGNATURE
    )


def test_the_kind_byte_is_signed_too():
    """Relabelling an HMAC-SHA256 entry as BLAKE3 (or back) is a bad signature, not a way around one."""
    codec = codec_of(Signature.BLAKE3_KEYED)
    entry = bytearray(codec_of(Signature.HMAC_SHA256).encode(KEY, PAYLOAD))
    entry[6] = Signature.BLAKE3_KEYED.value
    assert refused(codec, bytes(entry)) is CorruptKind.BAD_SIGNATURE


def test_an_unsigned_codec_reads_both_kinds():
    for signature in SIGNED:
        assert EntryCodec(LAYOUT).decode(KEY, codec_of(signature).encode(KEY, PAYLOAD)) == PAYLOAD


def test_blake3_entries_are_refused_cleanly_where_blake3_is_missing(monkeypatch):
    entry = codec_of(Signature.BLAKE3_KEYED).encode(KEY, PAYLOAD)
    hmac_entry = codec_of(Signature.HMAC_SHA256).encode(KEY, PAYLOAD)
    monkeypatch.setattr(entry_module, "_blake3", None)
    assert Signature.best_available() is Signature.HMAC_SHA256
    codec = EntryCodec(LAYOUT, SECRET)
    assert codec.signature is Signature.HMAC_SHA256
    assert not codec.can_verify(Signature.BLAKE3_KEYED) and codec.can_verify(Signature.HMAC_SHA256)
    with pytest.raises(CorruptEntry, match="BLAKE3_KEYED needs blake3") as info:
        codec.decode(KEY, entry)
    assert info.value.kind is CorruptKind.CHECK_KIND
    assert codec.decode(KEY, hmac_entry) == PAYLOAD
    assert EntryCodec(LAYOUT).decode(KEY, entry) == PAYLOAD  # no secret: only the checksum is checked
    with pytest.raises(ConfigError, match="BLAKE3_KEYED needs the blake3 package"):
        codec_of(Signature.BLAKE3_KEYED)


def test_mac_comparison_is_constant_time(monkeypatch):
    calls = []
    original = hmac.compare_digest

    def compare(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return original(a, b)

    monkeypatch.setattr(entry_module.hmac, "compare_digest", compare)
    for signature in SIGNED:
        codec_of(signature).decode(KEY, codec_of(signature).encode(KEY, PAYLOAD))
    assert len(calls) == 2


@pytest.mark.parametrize(
    "secret, signature, message",
    [
        (None, Signature.BLAKE3_KEYED, "signature BLAKE3_KEYED needs a secret"),
        (None, Signature.HMAC_SHA256, "signature HMAC_SHA256 needs a secret"),
        (SECRET, Signature.NONE, "signature NONE with a secret"),
        (SECRET, "blake3", "signature must be a Signature, got 'blake3'"),
        (SECRET, 2, "signature must be a Signature, got 2"),
    ],
)
def test_bad_signature_arguments_name_the_value(secret, signature, message):
    with pytest.raises(ConfigError, match=message):
        EntryCodec(LAYOUT, secret, signature=signature)
