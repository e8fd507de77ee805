"""The stored form of one KV block: a header that says what the bytes are, then the bytes.

Every tier below GPU memory keeps blocks as self-describing entries, so a reader never has to
trust where the bytes came from. One entry, little-endian::

    offset  size  field
         0     4  magic            b"KVPE"
         4     1  format version   1
         5     1  flags            bit 0: signed (an HMAC follows the key)
         6     2  key length       K
         8     8  payload length   N
        16    32  layout digest    SHA-256 of the LayoutFingerprint (the model's weights included)
        48    32  payload checksum SHA-256 of the payload
        80     K  key              the chained block hash the entry was stored under
    80 + K    32  HMAC-SHA256      (signed entries only) over bytes [0, 80 + K)
         ...   N  payload

The HMAC covers the header and the key, and the header holds a SHA-256 of the payload, so one
pass over the payload (the checksum) serves both integrity and authentication: forging a signed
entry for other KV needs the secret or a SHA-256 collision.

:meth:`EntryCodec.decode` refuses, with a :class:`CorruptEntry` naming a :class:`CorruptKind`,
an entry that is truncated or garbled, from another format version, from another model or KV
layout, longer than any entry of this layout can be, stored under another key (a valid entry
replayed under another hash), whose payload does not match its checksum, or, when the codec has a
secret, one that is unsigned or signed with another secret. A codec without a secret reads signed
entries too (it checks the checksum only).

:meth:`EntryCodec.max_entry_bytes` bounds an entry's size from the layout alone (header, key,
HMAC and one block's KV), so a store can refuse a bigger stored object before reading it.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import struct
from dataclasses import asdict, dataclass
from enum import Enum

from kvpool.checks import check_int
from kvpool.errors import ConfigError, ExternalDataError
from kvpool.hashing import HashAlgo
from kvpool.secret_files import check_secret
from kvpool.specs import KVDtype

__all__ = ["FORMAT_VERSION", "CorruptEntry", "CorruptKind", "EntryCodec", "LayoutFingerprint", "Payload"]

#: Version of the entry layout above; an entry of any other version is refused.
FORMAT_VERSION = 1

#: What ``encode`` takes as a payload: any contiguous buffer of bytes.
Payload = bytes | bytearray | memoryview

_MAGIC = b"KVPE"
_HEADER = struct.Struct("<4sBBHQ32s32s")
_SIGNED = 0x01
_MAC_SIZE = hashlib.sha256().digest_size
_MAX_KEY = 0xFFFF


class CorruptKind(Enum):
    """Why an entry was refused."""

    TRUNCATED = "truncated"
    MALFORMED = "malformed"  # not an entry at all, or trailing bytes after the payload
    VERSION = "version"  # another format version
    FOREIGN_LAYOUT = "foreign layout"  # other weights, another model, dtype, block size or hash seed
    OVERSIZED = "oversized"  # longer than any entry of this layout (refused before it is read)
    NOT_A_FILE = "not a file"  # a disk entry's path holds a link, a FIFO, a device or a directory
    FOREIGN_KEY = "foreign key"  # stored under another block hash
    CHECKSUM = "checksum"  # payload bytes changed
    UNSIGNED = "unsigned"  # the codec has a secret, the entry has no HMAC
    BAD_SIGNATURE = "bad signature"  # an HMAC made with another secret, or a changed header


class CorruptEntry(ExternalDataError):
    """An entry that must not be used; ``kind`` says why. Stores turn it into a counted miss."""

    def __init__(self, kind: CorruptKind, detail: str) -> None:
        super().__init__(f"{kind.value} entry: {detail}")
        self.kind = kind


@dataclass(frozen=True)
class LayoutFingerprint:
    """Everything that decides what a block's KV bytes mean; entries of another fingerprint are foreign.

    ``weights`` names the weights the KV was computed with: ``"sha256:<hex>"``, a digest of the
    model folder's files (:func:`kvpool.engine.model_store.model_digest`), or ``"namespace:<name>"``,
    a name the operator vouches for (``--kv-tier-namespace``). Two models of the same shapes (a
    fine-tune, a folder updated in place) therefore never read each other's entries. ``dtype`` is
    the KV cache dtype's name (``"bfloat16"``); ``hash_algo`` a :class:`~kvpool.hashing.HashAlgo`
    value; ``hash_seed`` the block-hash seed as text (for instance its hex), so two deployments with
    different seeds never read each other's blocks.
    """

    architecture: str
    num_layers: int
    num_kv_heads: int
    head_size: int
    dtype: str
    block_size: int
    hash_algo: str
    hash_seed: str
    weights: str

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_size", "block_size"):
            check_int(name, getattr(self, name))
        for name in ("architecture", "dtype", "hash_seed", "weights"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ConfigError(f"{name} must be a non-empty string, got {value!r}")
        KVDtype.parse(self.dtype, field="dtype")
        if self.hash_algo not in {algo.value for algo in HashAlgo}:
            raise ConfigError(f"hash_algo must be one of {[a.value for a in HashAlgo]}, got {self.hash_algo!r}")

    @property
    def block_bytes(self) -> int:
        """One block's KV for every layer, in bytes: the payload of every entry the engine stores."""
        itemsize = KVDtype.parse(self.dtype).itemsize
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_size * itemsize

    def digest(self) -> bytes:
        """SHA-256 of a canonical encoding of every field (32 bytes), stable across processes."""
        text = json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(b"kvpool/layout/v2\0" + text.encode()).digest()


class EntryCodec:
    """Encodes payloads into entries for one layout and decodes them back, refusing anything else.

    ``secret``: at least :data:`~kvpool.secret_files.MIN_SECRET_BYTES` bytes; with it, ``encode`` signs every entry and ``decode`` refuses unsigned entries and
    entries signed with another secret. Share it between the replicas that share a tier.
    Both directions cost one SHA-256 pass over the payload plus one copy.
    """

    def __init__(self, fingerprint: LayoutFingerprint, secret: bytes | None = None) -> None:
        if not isinstance(fingerprint, LayoutFingerprint):
            raise ConfigError(f"fingerprint must be a LayoutFingerprint, got {fingerprint!r}")
        if secret is not None:
            check_secret(secret, purpose="KV tier secret")
        self.fingerprint = fingerprint
        self._layout = fingerprint.digest()
        self._secret = secret

    @property
    def namespace(self) -> str:
        """A short hex name of the layout: stores keep each layout's entries apart under it."""
        return self._layout.hex()[:16]

    @property
    def signed(self) -> bool:
        return self._secret is not None

    def max_entry_bytes(self, key_len: int) -> int:
        """The longest entry of this layout under a key of ``key_len`` bytes (signed, one whole block)."""
        return _HEADER.size + key_len + _MAC_SIZE + self.fingerprint.block_bytes

    def encode(self, key: bytes, payload: Payload) -> bytes:
        """The entry for ``payload`` stored under ``key``."""
        if not isinstance(key, bytes) or not 0 < len(key) <= _MAX_KEY:
            raise ConfigError(f"an entry key must be 1 to {_MAX_KEY} bytes, got {key!r:.80}")
        body = memoryview(payload).cast("B")
        if body.nbytes > self.fingerprint.block_bytes:
            raise ConfigError(
                f"a payload of {body.nbytes} bytes exceeds one block of this layout ({self.fingerprint.block_bytes})"
            )
        flags = _SIGNED if self._secret is not None else 0
        header = _HEADER.pack(
            _MAGIC, FORMAT_VERSION, flags, len(key), body.nbytes, self._layout, hashlib.sha256(body).digest()
        )
        mac = b"" if self._secret is None else hmac.digest(self._secret, header + key, "sha256")
        return b"".join((header, key, mac, body))

    def decode(self, key: bytes, data: bytes) -> bytes:
        """The payload of ``data`` if it is a sound entry of this layout stored under ``key``; CorruptEntry if not."""
        if len(data) < _HEADER.size:
            raise CorruptEntry(CorruptKind.TRUNCATED, f"{len(data)} bytes, shorter than the {_HEADER.size}-byte header")
        magic, version, flags, key_len, payload_len, layout, checksum = _HEADER.unpack_from(data)
        if magic != _MAGIC:
            raise CorruptEntry(CorruptKind.MALFORMED, f"magic {magic!r} is not {_MAGIC!r}")
        if version != FORMAT_VERSION:
            raise CorruptEntry(CorruptKind.VERSION, f"format version {version}, this kvpool reads {FORMAT_VERSION}")
        if layout != self._layout:
            raise CorruptEntry(CorruptKind.FOREIGN_LAYOUT, "written for other weights, another model or KV layout")
        if payload_len > self.fingerprint.block_bytes:
            raise CorruptEntry(
                CorruptKind.MALFORMED,
                f"header says {payload_len} payload bytes, a block is {self.fingerprint.block_bytes}",
            )
        key_end = _HEADER.size + key_len
        payload_start = key_end + (_MAC_SIZE if flags & _SIGNED else 0)
        if len(data) < payload_start:
            raise CorruptEntry(CorruptKind.TRUNCATED, f"{len(data)} bytes end inside the key or signature")
        if data[_HEADER.size : key_end] != key:
            raise CorruptEntry(CorruptKind.FOREIGN_KEY, "stored under another block hash")
        if self._secret is not None:
            if not flags & _SIGNED:
                raise CorruptEntry(CorruptKind.UNSIGNED, "no HMAC, and this tier requires one")
            expected = hmac.digest(self._secret, data[:key_end], "sha256")
            if not hmac.compare_digest(expected, data[key_end:payload_start]):
                raise CorruptEntry(
                    CorruptKind.BAD_SIGNATURE, "HMAC does not match (another secret or a changed header)"
                )
        if len(data) != payload_start + payload_len:
            kind = CorruptKind.TRUNCATED if len(data) < payload_start + payload_len else CorruptKind.MALFORMED
            raise CorruptEntry(kind, f"{len(data) - payload_start} payload bytes, header says {payload_len}")
        payload = data[payload_start:]
        if hashlib.sha256(payload).digest() != checksum:
            raise CorruptEntry(CorruptKind.CHECKSUM, "payload does not match its checksum")
        return payload
