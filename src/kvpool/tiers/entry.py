"""The stored form of one KV block: a header that says what the bytes are, then the bytes.

Every tier below GPU memory keeps blocks as self-describing entries, so a reader never has to
trust where the bytes came from. One entry, little-endian::

    offset  size  field
         0     4  magic            b"KVPE"
         4     1  format version   4
         5     1  checksum kind    1: XXH3-128, 2: CRC-32 (:class:`Checksum`)
         6     1  signature kind   0: none, 1: HMAC-SHA256, 2: keyed BLAKE3, 3: AES-256-GMAC (:class:`Signature`)
         7     1  zero
         8     2  key length       K
        10     6  zero
        16     8  payload length   N
        24    32  layout digest    SHA-256 of the LayoutFingerprint (the model's weights included)
        56    16  payload checksum the checksum kind's digest of the payload (CRC-32: 4 bytes, then zeros)
        72     K  key              the chained block hash the entry was stored under
    72 + K    32  MAC              (signed entries only) the signature kind's MAC of bytes [0, 72 + K), then the payload
         ...   N  payload

Integrity and authenticity are separate checks, each at the speed it needs. The checksum is not
cryptographic: it catches damage (a torn write, a flipped bit, a truncated value) at memory speed
(XXH3-128 with the ``fast`` or ``tiers`` extra, else CRC-32). The signature is what a secret buys:
a 32-byte MAC over the header, the key and the payload itself, so forging a signed entry for other
KV needs the secret, whatever the checksum. Every entry carries its checksum, so a reader without
the secret still checks a signed entry for damage; a reader with the secret checks the MAC alone,
which covers the payload and the checksum field both (an entry needs its integrity checked once),
and computes the checksum only when the MAC fails, to tell damage (CHECKSUM) from another secret or
a forgery (BAD_SIGNATURE).

The MAC kinds, the fastest this process can compute signing new entries
(:meth:`Signature.best_available`):

* AES-256-GMAC (``cryptography`` package): a polynomial hash over GF(2^128) keyed by AES, run by
  AES-NI and carry-less multiplication at several times BLAKE3's speed. Its MAC field is a random
  16-byte salt and the 16-byte tag. Each entry has a key of its own, HMAC-SHA256 of the salt under
  a key derived from the secret (:data:`_GMAC_CONTEXT`), so no AES-GCM key ever sees two messages
  and the 96-bit nonce (zeros) never repeats under one; the tag is AES-GCM's over the header and
  key (as plaintext, whose ciphertext is dropped) and the payload (as associated data), read in
  place. A forger who reuses a stored salt faces GHASH under an unknown key: a forgery succeeds
  with probability below 2^-100 for one block.
* keyed BLAKE3 (``blake3``): keyed with a 32-byte key derived from the secret in BLAKE3's key
  derivation mode under :data:`_BLAKE3_CONTEXT`, so the raw secret (of any length) is never the key.
* HMAC-SHA256 (the standard library's), where neither package is installed.

The header names the kind, so a codec verifies any kind it can compute: a fleet moves to a faster
kind by installing its package, and reads what it wrote before. HMAC over a fast
non-cryptographic hash (XXH3, say) is not offered: it is no MAC, since collisions of the inner hash
are easy to find and a forger swaps in a payload of the same digest.

:meth:`EntryCodec.decode` refuses, with a :class:`CorruptEntry` naming a :class:`CorruptKind`,
an entry that is truncated or garbled, from another format version (versions 1 to 3 included),
from another model or KV layout, longer than any entry of this layout can be, stored under
another key (a valid entry replayed under another hash), that names a checksum kind this process
cannot compute (or, when the codec has a secret, a signature kind), whose payload does not match
its checksum, or, when the codec has a secret, one that is unsigned or signed with another secret.
A codec without a secret reads signed entries too (it checks the checksum only).

Copies: :meth:`EntryCodec.encode_parts` gives the head and the payload apart, for writers that
send both without joining them (``os.writev``); :meth:`EntryCodec.decode_into` checks an entry
and copies its payload into the caller's buffer; :meth:`EntryCodec.parse_head` and
:meth:`EntryCodec.verify` let a reader place the payload straight in its buffer (``os.preadv``)
and check it there.

:meth:`EntryCodec.max_entry_bytes` bounds an entry's size from the layout alone (header, key,
MAC and one block's KV), so a store can refuse a bigger stored object before reading it.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import struct
import zlib
from collections.abc import Callable
from dataclasses import asdict, dataclass
from enum import Enum
from types import ModuleType

from kvpool.checks import check_int
from kvpool.errors import ConfigError, ExternalDataError
from kvpool.hashing import HashAlgo
from kvpool.secret_files import check_secret
from kvpool.specs import KVDtype

__all__ = [
    "FORMAT_VERSION",
    "LAYOUT_DIGEST_AT",
    "MAX_NAMESPACE_CHARS",
    "check_namespace",
    "Checksum",
    "CorruptEntry",
    "CorruptKind",
    "EntryCodec",
    "EntryHead",
    "LayoutFingerprint",
    "Payload",
    "Signature",
]

#: Version of the entry layout above; an entry of any other version is refused.
FORMAT_VERSION = 4

#: What ``encode`` takes as a payload: any contiguous buffer of bytes.
Payload = bytes | bytearray | memoryview

_MAGIC = b"KVPE"
_HEADER = struct.Struct("<4sBBBBH6sQ32s16s")
_CHECKSUM_AT = 56  # offset of the checksum field in the header
#: Offset of the layout digest in an entry (the table above): what names the model and layout an entry is for.
LAYOUT_DIGEST_AT = 24
_MAC_SIZE = 32  # every signature kind's MAC field: HMAC-SHA256's digest, BLAKE3's default output, GMAC's salt and tag
_GMAC_SALT = 16  # GMAC's MAC field: the salt its entry key is derived from, then the 16-byte tag
_GMAC_NONCE = bytes(12)  # AES-GCM's nonce: fixed, because no entry key is ever used twice
_GMAC_MAX_PAYLOAD = 2**31 - 1  # the most associated data cryptography's AES-GCM takes
_MAX_KEY = 0xFFFF
_ZEROS = bytes(16)


class Checksum(Enum):
    """How an entry's payload is checksummed (for damage, not for forgery: that is the signature's job)."""

    XXH3_128 = 1
    CRC32 = 2

    @classmethod
    def best_available(cls) -> Checksum:
        """XXH3-128 when ``xxhash`` is installed (tens of GB/s), else CRC-32 (the standard library's)."""
        return cls.XXH3_128 if _CHECKSUMS[cls.XXH3_128] is not None else cls.CRC32


class Signature(Enum):
    """How an entry is signed; the header names it. Every kind but NONE is a 32-byte MAC."""

    NONE = 0
    HMAC_SHA256 = 1
    BLAKE3_KEYED = 2
    GMAC_AES256 = 3

    @classmethod
    def best_available(cls) -> Signature:
        """The fastest kind this process computes: AES-256-GMAC (``cryptography``), keyed BLAKE3 (``blake3``), else HMAC-SHA256.

        What a codec with a secret signs with by default, unless its blocks are longer than GMAC
        takes (2 GiB), where it signs with the next kind.
        """
        if _aesgcm is not None:
            return cls.GMAC_AES256
        return cls.BLAKE3_KEYED if _blake3 is not None else cls.HMAC_SHA256


def _import_blake3() -> ModuleType | None:
    try:
        import blake3
    except ImportError:
        return None
    return blake3


#: The ``blake3`` module, or None where it is not installed (tests set it to None to play that).
_blake3: ModuleType | None = _import_blake3()

#: BLAKE3's key derivation context for entry MACs: the key is derived from the secret under it.
_BLAKE3_CONTEXT = "kvpool 2026-12-02 KV tier entry MAC v3"


def _import_aesgcm() -> type | None:
    try:
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM
    except ImportError:
        return None
    return AESGCM


#: ``cryptography``'s AES-GCM class, or None where it is not installed (tests set it to None to play that).
_aesgcm: type | None = _import_aesgcm()

#: The signature kinds, fastest first: a codec with a secret signs with the first it computes.
_FASTEST_FIRST = (Signature.GMAC_AES256, Signature.BLAKE3_KEYED, Signature.HMAC_SHA256)

#: The package each signature kind beyond the standard library's needs.
_PACKAGES = {Signature.BLAKE3_KEYED: "blake3", Signature.GMAC_AES256: "cryptography"}

#: What GMAC's root key is derived from the secret under (HMAC-SHA256); each entry's key from the root and its salt.
_GMAC_CONTEXT = b"kvpool 2026-12-02 KV tier entry GMAC root key v4"


def _xxh3_128() -> Callable[[Payload], bytes] | None:
    try:
        import xxhash
    except ImportError:
        return None
    digest: Callable[[Payload], bytes] = xxhash.xxh3_128_digest
    return digest


def _crc32(payload: Payload) -> bytes:
    return zlib.crc32(payload).to_bytes(4, "little") + _ZEROS[:12]


#: Each checksum kind's 16-byte digest, or None where this process cannot compute it (no xxhash).
_CHECKSUMS: dict[Checksum, Callable[[Payload], bytes] | None] = {Checksum.XXH3_128: _xxh3_128(), Checksum.CRC32: _crc32}


def _checksum_function(kind: Checksum) -> Callable[[Payload], bytes] | None:
    return _CHECKSUMS[kind]


#: The longest operator namespace that may name a model's weights in place of their digest.
MAX_NAMESPACE_CHARS = 128


def check_namespace(value: object, what: str) -> str | None:
    """``value`` as an operator namespace for the weights (1 to 128 printable ASCII characters, no spaces), or None.

    Raises:
        ConfigError: naming ``what`` and the value.
    """
    if value is None:
        return None
    if (
        not isinstance(value, str)
        or not 0 < len(value) <= MAX_NAMESPACE_CHARS
        or not (value.isascii() and value.isprintable())
        or any(c.isspace() for c in value)
    ):
        raise ConfigError(
            f"{what} must be 1 to {MAX_NAMESPACE_CHARS} printable ASCII characters without spaces, got {value!r}"
        )
    return value


class CorruptKind(Enum):
    """Why an entry was refused."""

    TRUNCATED = "truncated"
    MALFORMED = "malformed"  # not an entry at all, or trailing bytes after the payload
    VERSION = "version"  # another format version
    FOREIGN_LAYOUT = "foreign layout"  # other weights, another model, dtype, block size or hash seed
    OVERSIZED = "oversized"  # longer than any entry of this layout (refused before it is read)
    NOT_A_FILE = "not a file"  # a disk entry's path holds a link, a FIFO, a device or a directory
    FOREIGN_KEY = "foreign key"  # stored under another block hash
    CHECK_KIND = "check kind"  # a checksum or signature kind this process cannot compute
    CHECKSUM = "checksum"  # payload bytes changed
    UNSIGNED = "unsigned"  # the codec has a secret, the entry has no MAC
    BAD_SIGNATURE = "bad signature"  # a MAC made with another secret, or a changed header or payload


class CorruptEntry(ExternalDataError):
    """An entry that must not be used; ``kind`` says why. Stores turn it into a counted miss."""

    def __init__(self, kind: CorruptKind, detail: str) -> None:
        super().__init__(f"{kind.value} entry: {detail}")
        self.kind = kind


@dataclass(frozen=True)
class LayoutFingerprint:
    """Everything that decides what a block's KV bytes mean; entries of another fingerprint are foreign.

    ``weights`` names the weights the KV was computed with: ``"sha256:<hex>"``, a digest of the
    model folder's files (:func:`kvpool.tiers.weights.model_digest`), or ``"namespace:<name>"``,
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


@dataclass(frozen=True, slots=True)
class EntryHead:
    """An entry's head, checked (:meth:`EntryCodec.parse_head`): where its payload starts and how long it is."""

    size: int  # bytes before the payload: header, key and MAC
    payload_len: int
    checksum: Checksum
    signature: Signature


class EntryCodec:
    """Encodes payloads into entries for one layout and decodes them back, refusing anything else.

    ``secret``: at least :data:`~kvpool.secret_files.MIN_SECRET_BYTES` bytes; with it, ``encode``
    signs every entry and ``decode`` refuses unsigned entries and entries signed with another
    secret. Share it between the replicas that share a tier. ``checksum``: what new entries are
    checksummed with (default :meth:`Checksum.best_available`); entries of either kind are read.
    ``signature``: what new entries are signed with when there is a secret (default
    :meth:`Signature.best_available`); entries of any kind this process can compute are verified,
    so a codec that signs with GMAC still reads BLAKE3 and HMAC-SHA256 entries made with the same
    secret. Unsigned, each direction costs one checksum pass over the payload (XXH3-128: far above
    memory bandwidth); signed, encoding costs one MAC pass more and decoding the MAC pass alone.
    """

    def __init__(
        self,
        fingerprint: LayoutFingerprint,
        secret: bytes | None = None,
        *,
        checksum: Checksum | None = None,
        signature: Signature | None = None,
    ) -> None:
        if not isinstance(fingerprint, LayoutFingerprint):
            raise ConfigError(f"fingerprint must be a LayoutFingerprint, got {fingerprint!r}")
        if secret is not None:
            check_secret(secret, purpose="KV tier secret")
        kind = Checksum.best_available() if checksum is None else checksum
        if not isinstance(kind, Checksum):
            raise ConfigError(f"checksum must be a Checksum, got {checksum!r}")
        function = _checksum_function(kind)
        if function is None:
            raise ConfigError(f"checksum {kind.name} needs the xxhash package: pip install 'kvpool[fast]'")
        if signature is not None and not isinstance(signature, Signature):
            raise ConfigError(f"signature must be a Signature, got {signature!r}")
        # Fixed here, so a codec's behaviour never changes under it: the packages and the keys derived for them.
        self.fingerprint = fingerprint
        self._secret = secret
        self._blake3 = _blake3 if secret is not None else None
        self._blake3_key = (
            None if self._blake3 is None else self._blake3.blake3(secret, derive_key_context=_BLAKE3_CONTEXT).digest()
        )
        self._aesgcm = _aesgcm if secret is not None else None
        self._gmac_root = (
            None if secret is None or self._aesgcm is None else hmac.digest(secret, _GMAC_CONTEXT, "sha256")
        )
        if secret is None:
            if signature is not None and signature is not Signature.NONE:
                raise ConfigError(f"signature {signature.name} needs a secret")
            signs = Signature.NONE
        elif signature is None:
            signs = next(kind for kind in _FASTEST_FIRST if self.can_verify(kind))
        elif signature is Signature.NONE:
            raise ConfigError("signature NONE with a secret: a codec with a secret signs every entry")
        elif not self.can_verify(signature):
            raise ConfigError(f"signature {signature.name} {self._cannot(signature)}")
        else:
            signs = signature
        self.checksum = kind
        self.signature = signs
        self._checksum = function
        self._layout = fingerprint.digest()

    @property
    def namespace(self) -> str:
        """A short hex name of the layout: stores keep each layout's entries apart under it."""
        return self._layout.hex()[:16]

    @property
    def signed(self) -> bool:
        return self._secret is not None

    def can_verify(self, signature: Signature) -> bool:
        """Whether this codec computes ``signature``'s MAC (BLAKE3 needs ``blake3``, GMAC ``cryptography``); False without a secret."""
        if self._secret is None or signature is Signature.NONE:
            return False
        if signature is Signature.BLAKE3_KEYED:
            return self._blake3 is not None
        if signature is Signature.GMAC_AES256:
            return self._aesgcm is not None and self.fingerprint.block_bytes <= _GMAC_MAX_PAYLOAD
        return True

    def _cannot(self, signature: Signature) -> str:
        """Why this codec cannot compute ``signature``'s MAC (for messages; the caller checked can_verify)."""
        if signature is Signature.GMAC_AES256 and self._aesgcm is not None:
            return f"signs payloads of at most {_GMAC_MAX_PAYLOAD} bytes, a block of this layout is {self.fingerprint.block_bytes}"
        return f"needs the {_PACKAGES[signature]} package: pip install 'kvpool[tiers]'"

    def _mac(self, signature: Signature, header: Payload, key: Payload, payload: Payload, salt: bytes) -> bytes:
        """``signature``'s 32-byte MAC field for header, key and payload; the caller checked can_verify.

        ``salt`` (GMAC only; 16 bytes): what the entry's own key is derived from, the field's first half.
        """
        if signature is Signature.GMAC_AES256:
            assert self._aesgcm is not None and self._gmac_root is not None
            entry_key = hmac.digest(self._gmac_root, salt, "sha256")
            # The header and key are the plaintext (their ciphertext is dropped), the payload the associated
            # data: AES-GCM authenticates both, and reads the payload where it lies.
            sealed: bytes = self._aesgcm(entry_key).encrypt(_GMAC_NONCE, b"".join((header, key)), payload)
            return salt + sealed[-16:]
        if signature is Signature.BLAKE3_KEYED:
            assert self._blake3 is not None and self._blake3_key is not None
            hasher = self._blake3.blake3(header, key=self._blake3_key)
            hasher.update(key)
            hasher.update(payload)
            digest: bytes = hasher.digest()
            return digest
        assert self._secret is not None
        mac = hmac.new(self._secret, header, "sha256")
        mac.update(key)
        mac.update(payload)
        return mac.digest()

    def max_entry_bytes(self, key_len: int) -> int:
        """The longest entry of this layout under a key of ``key_len`` bytes (signed, one whole block)."""
        return _HEADER.size + key_len + _MAC_SIZE + self.fingerprint.block_bytes

    def max_head_bytes(self, key_len: int) -> int:
        """The longest head (everything before the payload) under a key of ``key_len`` bytes."""
        return _HEADER.size + key_len + _MAC_SIZE

    # -- encoding ---------------------------------------------------------------------------

    def encode(self, key: bytes, payload: Payload) -> bytes:
        """The entry for ``payload`` stored under ``key``."""
        head, body = self.encode_parts(key, payload)
        return b"".join((head, body))

    def encode_parts(self, key: bytes, payload: Payload) -> tuple[bytes, memoryview]:
        """The entry for ``payload`` as its head and the payload itself (not copied): written one after the other."""
        if not isinstance(key, bytes) or not 0 < len(key) <= _MAX_KEY:
            raise ConfigError(f"an entry key must be 1 to {_MAX_KEY} bytes, got {key!r:.80}")
        body = memoryview(payload).cast("B")
        if body.nbytes > self.fingerprint.block_bytes:
            raise ConfigError(
                f"a payload of {body.nbytes} bytes exceeds one block of this layout ({self.fingerprint.block_bytes})"
            )
        header = _HEADER.pack(
            _MAGIC,
            FORMAT_VERSION,
            self.checksum.value,
            self.signature.value,
            0,
            len(key),
            _ZEROS[:6],
            body.nbytes,
            self._layout,
            self._checksum(body),
        )
        if self._secret is None:
            return header + key, body
        salt = secrets.token_bytes(_GMAC_SALT) if self.signature is Signature.GMAC_AES256 else b""
        return b"".join((header, key, self._mac(self.signature, header, key, body, salt))), body

    # -- decoding ---------------------------------------------------------------------------

    def decode(self, key: bytes, data: Payload) -> bytes:
        """The payload of ``data`` if it is a sound entry of this layout stored under ``key``; CorruptEntry if not."""
        view = memoryview(data).cast("B")
        head = self.parse_head(key, view, view.nbytes)
        payload = view[head.size :]
        self.verify(head, view[: head.size], payload)
        return payload.tobytes()

    def decode_into(self, key: bytes, data: Payload, out: memoryview) -> None:
        """Check ``data`` as :meth:`decode` does and copy its payload into ``out``, which it must fill exactly.

        CorruptEntry (MALFORMED) for a sound entry whose payload is not ``len(out)`` bytes; ``out``
        is written only once the entry passed every check.
        """
        view = memoryview(data).cast("B")
        head = self.parse_head(key, view, view.nbytes)
        if head.payload_len != out.nbytes:
            raise CorruptEntry(CorruptKind.MALFORMED, f"{head.payload_len} payload bytes, a block is {out.nbytes}")
        payload = view[head.size :]
        self.verify(head, view[: head.size], payload)
        out[:] = payload

    def parse_head(self, key: bytes, data: Payload, entry_len: int) -> EntryHead:
        """Check an entry's head (``data``: at least its head) for an entry of ``entry_len`` bytes under ``key``.

        Everything but the payload's checksum and signature: magic, version, layout, lengths, key,
        check kinds, and the signature's presence when the codec has a secret. CorruptEntry if not sound.
        """
        if len(data) < _HEADER.size:
            raise CorruptEntry(CorruptKind.TRUNCATED, f"{len(data)} bytes, shorter than the {_HEADER.size}-byte header")
        magic, version, checksum, signature, zero, key_len, zeros, payload_len, layout, _sum = _HEADER.unpack_from(data)
        if magic != _MAGIC:
            raise CorruptEntry(CorruptKind.MALFORMED, f"magic {magic!r} is not {_MAGIC!r}")
        if version != FORMAT_VERSION:
            raise CorruptEntry(CorruptKind.VERSION, f"format version {version}, this kvpool reads {FORMAT_VERSION}")
        if zero or zeros != _ZEROS[:6]:
            raise CorruptEntry(CorruptKind.MALFORMED, "reserved header bytes are not zero")
        if layout != self._layout:
            raise CorruptEntry(CorruptKind.FOREIGN_LAYOUT, "written for other weights, another model or KV layout")
        if payload_len > self.fingerprint.block_bytes:
            raise CorruptEntry(
                CorruptKind.MALFORMED,
                f"header says {payload_len} payload bytes, a block is {self.fingerprint.block_bytes}",
            )
        try:
            checksum_kind = Checksum(checksum)
            signature_kind = Signature(signature)
        except ValueError:
            raise CorruptEntry(
                CorruptKind.CHECK_KIND, f"checksum kind {checksum} or signature kind {signature} is unknown here"
            ) from None
        key_end = _HEADER.size + key_len
        size = key_end + (0 if signature_kind is Signature.NONE else _MAC_SIZE)
        if len(data) < size:
            raise CorruptEntry(CorruptKind.TRUNCATED, f"{len(data)} bytes end inside the key or signature")
        if data[_HEADER.size : key_end] != key:
            raise CorruptEntry(CorruptKind.FOREIGN_KEY, "stored under another block hash")
        if _checksum_function(checksum_kind) is None:
            raise CorruptEntry(
                CorruptKind.CHECK_KIND, f"checksum {checksum_kind.name} needs xxhash: pip install 'kvpool[fast]'"
            )
        if self._secret is not None and signature_kind is Signature.NONE:
            raise CorruptEntry(CorruptKind.UNSIGNED, "no signature, and this tier requires one")
        if self._secret is not None and not self.can_verify(signature_kind):
            raise CorruptEntry(
                CorruptKind.CHECK_KIND, f"signature {signature_kind.name} {self._cannot(signature_kind)}"
            )
        if entry_len != size + payload_len:
            kind = CorruptKind.TRUNCATED if entry_len < size + payload_len else CorruptKind.MALFORMED
            raise CorruptEntry(kind, f"{entry_len - size} payload bytes, header says {payload_len}")
        return EntryHead(size=size, payload_len=payload_len, checksum=checksum_kind, signature=signature_kind)

    def verify(self, head: EntryHead, head_bytes: Payload, payload: Payload) -> None:
        """Check ``payload``: its MAC when the codec has a secret, else its checksum; CorruptEntry if not.

        ``head`` is what :meth:`parse_head` made of ``head_bytes`` (the entry's first ``head.size`` bytes).
        One pass over the payload: a MAC that matches covers the checksum field and the payload both,
        so the checksum is computed only when it fails, to name the fault (CHECKSUM: damage;
        BAD_SIGNATURE: another secret, or a change made with the checksum made good).
        """
        view = memoryview(head_bytes)
        if self._secret is not None:
            key_end = head.size - _MAC_SIZE
            stored = view[key_end : head.size]
            mac = self._mac(
                head.signature, view[: _HEADER.size], view[_HEADER.size : key_end], payload, bytes(stored[:_GMAC_SALT])
            )
            if hmac.compare_digest(mac, stored):
                return
        function = _checksum_function(head.checksum)
        if function is None or function(payload) != view[_CHECKSUM_AT : _HEADER.size]:
            raise CorruptEntry(CorruptKind.CHECKSUM, "payload does not match its checksum")
        if self._secret is not None:
            raise CorruptEntry(
                CorruptKind.BAD_SIGNATURE,
                f"{head.signature.name} does not match (another secret, or a changed header or payload)",
            )
