"""A signed disk tier through both read paths: every entry it cannot vouch for is a counted miss, never a block.

Each signature kind, read with ``get_many`` (a copy) and ``get_many_into`` (straight into the
caller's buffer, verified there): a changed payload byte (with its checksum made good, as a forger
would), a changed header (its checksum kind, with a matching checksum), another layout, a wrong secret, a truncated file and an entry of an older format
are refused, counted by kind and removed; the buffer of a refused key is never reported filled.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from kvpool.tiers import DiskStore, EntryCodec
from kvpool.tiers.entry import Checksum, Signature
from tests.tiers.conftest import LAYOUT, block_key

SECRET = b"a shared tier secret"
SIZE = 4096
KINDS = [Signature.HMAC_SHA256]
if EntryCodec(LAYOUT, SECRET).can_verify(Signature.BLAKE3_KEYED):
    KINDS.append(Signature.BLAKE3_KEYED)
if EntryCodec(LAYOUT, SECRET).can_verify(Signature.GMAC_AES256):
    KINDS.append(Signature.GMAC_AES256)


def payload(i: int) -> bytes:
    return bytes((i + j) % 251 for j in range(SIZE))


def entry_path(store: DiskStore, i: int) -> Path:
    name = block_key(i).hex()
    return store.root / name[:2] / f"{name}.kv"


def read_one(store: DiskStore, into: bool) -> bytes | None:
    """Block 0 through the chosen read path: its payload, or None for a miss."""
    if not into:
        return store.get_many([block_key(0)])[0]
    buffer = bytearray(SIZE)
    return bytes(buffer) if store.get_many_into([block_key(0)], [memoryview(buffer)]) == [True] else None


def with_checksum_of(data: bytearray, body: bytes) -> bytearray:
    """``data`` with its checksum field recomputed for ``body``: what whoever changes an entry would do."""
    data[56:72] = EntryCodec(LAYOUT).encode(block_key(0), body)[56:72]
    return data


def tamper_payload(data: bytearray) -> bytearray:
    data[-100] ^= 0x01
    return with_checksum_of(data, bytes(data[-SIZE:]))


def relabel_checksum(data: bytearray) -> bytearray:
    """The header's checksum kind changed to CRC-32, with a CRC-32 that matches: only the MAC can tell."""
    data[5] = Checksum.CRC32.value
    data[56:72] = EntryCodec(LAYOUT, checksum=Checksum.CRC32).encode(block_key(0), bytes(data[-SIZE:]))[56:72]
    return data


def foreign_layout(data: bytearray) -> bytearray:
    data[24] ^= 0x01  # the layout digest: refused before any MAC
    return data


def resign(secret: bytes) -> Callable[[bytearray], bytearray]:
    def change(data: bytearray) -> bytearray:
        return bytearray(EntryCodec(LAYOUT, secret).encode(block_key(0), payload(0)))

    return change


def truncate(data: bytearray) -> bytearray:
    return data[:-1]


def older_format(data: bytearray) -> bytearray:
    data[4] = 3
    return data


DAMAGE = {
    "tampered payload": (tamper_payload, "bad signature"),
    "relabelled checksum": (relabel_checksum, "bad signature"),
    "foreign layout": (foreign_layout, "foreign layout"),
    "wrong secret": (resign(b"another secret, just as long"), "bad signature"),
    "truncated": (truncate, "truncated"),
    "older format": (older_format, "version"),
}


@pytest.mark.parametrize("signature", KINDS, ids=lambda s: s.name)
@pytest.mark.parametrize("into", [False, True], ids=["get_many", "get_many_into"])
@pytest.mark.parametrize("damage", DAMAGE)
def test_an_entry_the_store_cannot_vouch_for_is_a_counted_miss(tmp_path, signature, into, damage):
    store = DiskStore(tmp_path, 1 << 20, EntryCodec(LAYOUT, SECRET, signature=signature))
    assert store.put_many([(block_key(0), payload(0)), (block_key(1), payload(1))]) == 2
    assert read_one(store, into) == payload(0)
    change, kind = DAMAGE[damage]
    path = entry_path(store, 0)
    path.write_bytes(bytes(change(bytearray(path.read_bytes()))))
    assert read_one(store, into) is None
    stats = store.stats
    assert stats.corrupt == 1 and stats.corrupt_by_kind == {kind: 1} and stats.hits == 1
    assert not path.exists() and store.contains_prefix([block_key(0)]) == 0  # removed, to be saved again
    assert store.get_many([block_key(1)]) == [payload(1)]  # the neighbour is untouched
    store.check_invariants()


@pytest.mark.parametrize("signature", KINDS, ids=lambda s: s.name)
def test_damage_is_told_from_forgery(tmp_path, signature):
    """A flipped payload byte whose checksum was not made good is damage; with it made good, a bad signature."""
    store = DiskStore(tmp_path, 1 << 20, EntryCodec(LAYOUT, SECRET, signature=signature))
    store.put_many([(block_key(0), payload(0))])
    path = entry_path(store, 0)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x80
    path.write_bytes(bytes(data))
    assert read_one(store, into=True) is None
    assert store.stats.corrupt_by_kind == {"checksum": 1}


@pytest.mark.parametrize("signature", KINDS, ids=lambda s: s.name)
def test_a_store_without_the_secret_reads_signed_entries_by_their_checksum(tmp_path, signature):
    DiskStore(tmp_path, 1 << 20, EntryCodec(LAYOUT, SECRET, signature=signature)).put_many([(block_key(0), payload(0))])
    reader = DiskStore(tmp_path, 1 << 20, EntryCodec(LAYOUT))
    assert read_one(reader, into=True) == payload(0)
    path = entry_path(reader, 0)
    path.write_bytes(os.urandom(16) + path.read_bytes()[16:])  # the magic and version garbled
    assert read_one(reader, into=True) is None and reader.stats.corrupt == 1
