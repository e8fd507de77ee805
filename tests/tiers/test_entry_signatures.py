"""Each signature kind: what it signs, what it refuses, and reading one kind with a codec that signs with another."""

from __future__ import annotations

import dataclasses
import hmac

import pytest

from kvpool.errors import ConfigError
from kvpool.tiers import CorruptEntry, CorruptKind, EntryCodec
from kvpool.tiers import entry as entry_module
from kvpool.tiers.entry import Signature
from tests.tiers.conftest import LAYOUT, block_key

pytest.importorskip("blake3")
#: Tests of GMAC itself need cryptography; the others run with the kinds this process computes.
needs_cryptography = pytest.mark.skipif(entry_module._aesgcm is None, reason="needs the cryptography package")

KEY = block_key(7)
SECRET = b"a shared tier secret"
PAYLOAD = bytes(range(256)) * 16
SIGNED = [Signature.HMAC_SHA256, Signature.BLAKE3_KEYED] + ([Signature.GMAC_AES256] if entry_module._aesgcm else [])


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
    assert codec.decode(KEY, head + bytes(body)) == PAYLOAD
    if signature is not Signature.GMAC_AES256:  # deterministic; GMAC draws a salt per entry
        assert head + bytes(body) == entry


@needs_cryptography
def test_gmac_is_the_default_where_cryptography_is_installed(monkeypatch):
    assert Signature.best_available() is Signature.GMAC_AES256
    assert EntryCodec(LAYOUT, SECRET).signature is Signature.GMAC_AES256
    assert EntryCodec(LAYOUT).signature is Signature.NONE
    monkeypatch.setattr(entry_module, "_aesgcm", None)
    assert Signature.best_available() is Signature.BLAKE3_KEYED
    assert EntryCodec(LAYOUT, SECRET).signature is Signature.BLAKE3_KEYED


def mac_field(entry: bytes) -> tuple[bytes, bytes]:
    """An entry's MAC field and the bytes it signs (header, key, payload) of a PAYLOAD entry."""
    mac_at = len(entry) - len(PAYLOAD) - 32
    return entry[mac_at : mac_at + 32], entry[:mac_at]


@needs_cryptography
def test_each_gmac_entry_has_a_key_of_its_own_derived_from_the_secret_and_its_salt():
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    codec = codec_of(Signature.GMAC_AES256, b"k" * 32)
    first, second = codec.encode(KEY, PAYLOAD), codec.encode(KEY, PAYLOAD)
    (mac, signed), (other_mac, _signed) = mac_field(first), mac_field(second)
    assert mac[:16] != other_mac[:16]  # a fresh salt per entry, so no key ever signs two
    root = hmac.digest(b"k" * 32, entry_module._GMAC_CONTEXT, "sha256")
    entry_key = hmac.digest(root, mac[:16], "sha256")
    assert mac[16:] == AESGCM(entry_key).encrypt(bytes(12), signed, PAYLOAD)[-16:]
    assert mac[16:] != AESGCM(hmac.digest(b"k" * 32, mac[:16], "sha256")).encrypt(bytes(12), signed, PAYLOAD)[-16:]


@needs_cryptography
def test_a_gmac_field_taken_from_another_entry_or_another_salt_is_refused():
    codec = codec_of(Signature.GMAC_AES256)
    entry = bytearray(codec.encode(KEY, PAYLOAD))
    other = codec.encode(KEY, b"q" + PAYLOAD[1:])
    mac_at = len(entry) - len(PAYLOAD) - 32
    salt_swapped = bytearray(entry)
    salt_swapped[mac_at : mac_at + 16] = other[mac_at : mac_at + 16]  # the other entry's salt, this entry's tag
    assert refused(codec, bytes(salt_swapped)) is CorruptKind.BAD_SIGNATURE
    tag_swapped = bytearray(entry)
    tag_swapped[mac_at + 16 : mac_at + 32] = other[mac_at + 16 : mac_at + 32]
    assert refused(codec, bytes(tag_swapped)) is CorruptKind.BAD_SIGNATURE
    # The other entry's whole field on this payload, with its checksum made good: still refused.
    forged = bytearray(other)
    forged[-len(PAYLOAD) :] = PAYLOAD
    forged[56:72] = entry[56:72]
    assert refused(codec, bytes(forged)) is CorruptKind.BAD_SIGNATURE


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


@pytest.mark.parametrize("signature", SIGNED)
def test_a_flipped_payload_byte_without_a_new_checksum_is_named_damage(signature):
    entry = bytearray(codec_of(signature).encode(KEY, PAYLOAD))
    entry[-1] ^= 1
    assert refused(codec_of(signature), bytes(entry)) is CorruptKind.CHECKSUM


@pytest.mark.parametrize("signature", SIGNED)
def test_a_signed_reader_makes_one_pass_the_checksum_only_when_the_mac_fails(monkeypatch, signature):
    """The MAC covers the payload and its checksum field both: a sound signed entry needs no checksum pass."""
    codec = codec_of(signature)
    entry = codec.encode(KEY, PAYLOAD)
    passes = []
    kind = codec.checksum
    real = entry_module._CHECKSUMS[kind]
    assert real is not None
    monkeypatch.setitem(entry_module._CHECKSUMS, kind, lambda data: passes.append(1) or real(data))
    assert codec.decode(KEY, entry) == PAYLOAD and passes == []
    assert EntryCodec(LAYOUT).decode(KEY, entry) == PAYLOAD and passes == [1]  # without the secret: the checksum
    assert refused(codec_of(signature, b"another secret, just as long"), entry) is CorruptKind.BAD_SIGNATURE
    assert passes == [1, 1]


@pytest.mark.parametrize("writer", SIGNED)
@pytest.mark.parametrize("reader", SIGNED)
def test_a_codec_reads_the_other_kind_made_with_the_same_secret(writer, reader):
    """So a fleet moves over: replicas signing with GMAC read the BLAKE3 and HMAC-SHA256 entries already stored."""
    assert codec_of(reader).decode(KEY, codec_of(writer).encode(KEY, PAYLOAD)) == PAYLOAD
    assert refused(codec_of(reader, b"another secret, just as long"), codec_of(writer).encode(KEY, PAYLOAD)) is (
        CorruptKind.BAD_SIGNATURE
    )


@pytest.mark.parametrize("writer", SIGNED)
@pytest.mark.parametrize("label", SIGNED)
def test_the_kind_byte_is_signed_too(writer, label):
    """Relabelling an entry as another kind is a bad signature, not a way around one."""
    if writer is label:
        return
    entry = bytearray(codec_of(writer).encode(KEY, PAYLOAD))
    entry[6] = label.value
    assert refused(codec_of(label), bytes(entry)) is CorruptKind.BAD_SIGNATURE


def test_an_unsigned_codec_reads_both_kinds():
    for signature in SIGNED:
        assert EntryCodec(LAYOUT).decode(KEY, codec_of(signature).encode(KEY, PAYLOAD)) == PAYLOAD


@pytest.mark.parametrize(
    "signature, package",
    [(Signature.BLAKE3_KEYED, "blake3"), pytest.param(Signature.GMAC_AES256, "cryptography", marks=needs_cryptography)],
)
def test_entries_of_a_kind_are_refused_cleanly_where_its_package_is_missing(monkeypatch, signature, package):
    entry = codec_of(signature).encode(KEY, PAYLOAD)
    hmac_entry = codec_of(Signature.HMAC_SHA256).encode(KEY, PAYLOAD)
    monkeypatch.setattr(entry_module, "_blake3", None)
    monkeypatch.setattr(entry_module, "_aesgcm", None)
    assert Signature.best_available() is Signature.HMAC_SHA256
    codec = EntryCodec(LAYOUT, SECRET)
    assert codec.signature is Signature.HMAC_SHA256
    assert not codec.can_verify(signature) and codec.can_verify(Signature.HMAC_SHA256)
    with pytest.raises(CorruptEntry, match=f"{signature.name} needs the {package} package") as info:
        codec.decode(KEY, entry)
    assert info.value.kind is CorruptKind.CHECK_KIND
    assert codec.decode(KEY, hmac_entry) == PAYLOAD
    assert EntryCodec(LAYOUT).decode(KEY, entry) == PAYLOAD  # no secret: only the checksum is checked
    with pytest.raises(ConfigError, match=f"{signature.name} needs the {package} package"):
        codec_of(signature)


@needs_cryptography
def test_blocks_longer_than_gmac_takes_are_signed_with_the_next_kind():
    """cryptography's AES-GCM takes at most 2**31 - 1 bytes of associated data: such layouts never use GMAC."""
    giant = dataclasses.replace(LAYOUT, num_layers=128, num_kv_heads=64, head_size=128, block_size=512)
    assert giant.block_bytes == 2**31  # one byte more than GMAC takes
    codec = EntryCodec(giant, SECRET)
    assert codec.signature is Signature.BLAKE3_KEYED and not codec.can_verify(Signature.GMAC_AES256)
    with pytest.raises(ConfigError, match=f"GMAC_AES256 signs payloads of at most {2**31 - 1} bytes"):
        EntryCodec(giant, SECRET, signature=Signature.GMAC_AES256)
    relabelled = bytearray(codec.encode(KEY, PAYLOAD))
    relabelled[6] = Signature.GMAC_AES256.value
    with pytest.raises(CorruptEntry, match="signs payloads of at most") as info:
        codec.decode(KEY, bytes(relabelled))
    assert info.value.kind is CorruptKind.CHECK_KIND


def test_mac_comparison_is_constant_time(monkeypatch):
    calls = []
    original = hmac.compare_digest

    def compare(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return original(a, b)

    monkeypatch.setattr(entry_module.hmac, "compare_digest", compare)
    for signature in SIGNED:
        codec_of(signature).decode(KEY, codec_of(signature).encode(KEY, PAYLOAD))
    assert len(calls) == len(SIGNED)


@pytest.mark.parametrize(
    "secret, signature, message",
    [
        (None, Signature.BLAKE3_KEYED, "signature BLAKE3_KEYED needs a secret"),
        (None, Signature.GMAC_AES256, "signature GMAC_AES256 needs a secret"),
        (None, Signature.HMAC_SHA256, "signature HMAC_SHA256 needs a secret"),
        (SECRET, Signature.NONE, "signature NONE with a secret"),
        (SECRET, "blake3", "signature must be a Signature, got 'blake3'"),
        (SECRET, 2, "signature must be a Signature, got 2"),
    ],
)
def test_bad_signature_arguments_name_the_value(secret, signature, message):
    with pytest.raises(ConfigError, match=message):
        EntryCodec(LAYOUT, secret, signature=signature)
