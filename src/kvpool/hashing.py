"""Chained block hashes: what makes prefix caching a dictionary lookup.

A full block's hash covers its parent's hash, its token IDs and the extra keys
that change what its KV means::

    h[0] = H(root      | tokens[0:B]   | extras(0))      root = H(seed)
    h[1] = H(h[0]      | tokens[B:2B]  | extras(1))
    h[k] = H(h[k-1]    | tokens[kB:(k+1)B] | extras(k))

Each hash folds in the one before it, so two equal hashes vouch for two equal
prefixes from token 0 on, and a lookup ends at the first block it does not
find. Only full blocks get a hash. Extra keys are the LoRA adapter name (every block), each multimodal
item whose placeholder range overlaps the block (its identifier and its offset
from the block start), and the request's cache salt (block 0 only; the chain
carries it to every later block).

The byte layout is fixed-width (parent digest, then ``B`` little-endian uint32
token IDs), followed by tagged, length-prefixed extra keys, so two different
inputs never serialise to the same bytes. The root is derived from an
injectable seed, so hashes are reproducible across processes and machines.

kvpool's own algorithms:

* ``kvpool_sha256`` (default, :attr:`HashAlgo.SHA256`): cryptographic. Use a
  cryptographic hash whenever mutually untrusted tenants share a replica: with
  a weak hash, crafted prompts can collide with another tenant's blocks and
  read their KV (CVE-2025-25183).
* ``xxh3_128`` (the ``fast`` extra): much faster, not collision resistant.
  kvpool then verifies every hit against the block's stored content and
  parent, so a collision costs a miss and can never serve another prompt's KV.

vLLM's algorithms, for fleets where routers or other engines compute the
hashes themselves: ``sha256_cbor`` (the ``events`` extra, for cbor2) and
``sha256`` (pickle-based) give block hashes bit-identical to vLLM 0.33's
prefix-caching hashes for the same tokens, block size, cache salt, LoRA
adapter and multimodal identifiers. Each block hashes the serialised triple
``(parent hash, token IDs, extra keys or None)``, where the extra keys are, in
this order, ``("lora", name, path)``, ``("mm", identifier, offset in the
block)`` per overlapping item and ``("cache_salt", salt)`` on block 0; the
root is the hash of the seed string: ``PYTHONHASHSEED`` when it is set, else
vLLM's fixed ``"vllm-none-hash"``. They cost 2-4 times kvpool's chain per
token (BENCHMARKS.md), about what they cost vLLM itself.
"""

from __future__ import annotations

import functools
import hashlib
import os
import pickle
import struct
import sys
from array import array
from collections.abc import Callable, Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from enum import Enum
from typing import Any, NewType, cast

from kvpool.checks import check_int
from kvpool.errors import ConfigError, InvalidTokenError

__all__ = [
    "DEFAULT_HASH_SEED",
    "VLLM_DEFAULT_SEED",
    "BlockHash",
    "BlockHasher",
    "HashAlgo",
    "MultiModalInput",
]

#: A block hash: the digest bytes of one full block and its whole prefix.
BlockHash = NewType("BlockHash", bytes)

#: One extra key of a block, readable: ``("lora", name)``, ``("cache_salt", salt)``
#: or ``("mm", identifier, offset in the block)``.
ExtraKey = tuple[str, str] | tuple[str, str, int]

#: Seed of the chain's root when none is given. Changing it changes every hash.
DEFAULT_HASH_SEED = b"kvpool/block-hash/v1"

#: vLLM's root seed when ``PYTHONHASHSEED`` is not set.
VLLM_DEFAULT_SEED = "vllm-none-hash"

# Token IDs are serialised as little-endian uint32.
_TOKEN_TYPECODE = "I"
if array(_TOKEN_TYPECODE).itemsize != 4:  # pragma: no cover - exotic platforms
    _TOKEN_TYPECODE = "L" if array("L").itemsize == 4 else "I"
_BIG_ENDIAN = sys.byteorder == "big"

_TAG_LORA = b"\x01"
_TAG_MM = b"\x02"
_TAG_SALT = b"\x03"


class HashAlgo(Enum):
    """Block hash algorithm: kvpool's own chain (fast) or one of vLLM's (reproducible by vLLM's tools)."""

    #: kvpool's chain over fixed-width bytes, SHA-256 (the default).
    SHA256 = "kvpool_sha256"
    #: kvpool's chain, xxHash3-128; every hit is verified.
    XXH3_128 = "xxh3_128"
    #: vLLM's ``sha256``: SHA-256 of the pickled block triple.
    VLLM_SHA256 = "sha256"
    #: vLLM's ``sha256_cbor``: SHA-256 of the canonical CBOR block triple.
    VLLM_SHA256_CBOR = "sha256_cbor"

    @property
    def is_cryptographic(self) -> bool:
        return self is not HashAlgo.XXH3_128

    @property
    def is_vllm(self) -> bool:
        """Whether the hashes are vLLM's (seeded by a string, serialised by pickle or CBOR)."""
        return self in (HashAlgo.VLLM_SHA256, HashAlgo.VLLM_SHA256_CBOR)

    @classmethod
    def parse(cls, value: object) -> HashAlgo:
        """``value`` as a :class:`HashAlgo`: a member, or its name (any case, ``-`` for ``_``).

        Takes any object, so a compiled build refuses a wrong type with this
        ConfigError, not a TypeError of its own.
        """
        if isinstance(value, HashAlgo):
            return value
        try:
            return cls(str(value).lower().replace("-", "_"))
        except ValueError:
            names = ", ".join(a.value for a in cls)
            raise ConfigError(f"unknown hash algorithm {value!r}; choose one of: {names}") from None


@dataclass(frozen=True, slots=True, kw_only=True, init=False)
class MultiModalInput:
    """A multimodal item in a prompt: its content identifier and placeholder range.

    ``identifier`` should be a hash of the item's content (an image, audio
    clip, ...); ``offset`` is the position of its first placeholder token and
    ``length`` the number of placeholder tokens.

    The constructor takes objects and checks them before any field is set
    (a compiled build's typed fields would otherwise refuse a wrong type with
    their own TypeError, and store ``True`` as ``1``).
    """

    identifier: str
    offset: int
    length: int

    def __init__(self, *, identifier: object, offset: object, length: object) -> None:
        problem = key_text_problem(identifier)
        if problem is not None:
            raise ConfigError(f"multimodal identifier must be {problem}")
        checked_offset = check_int("multimodal offset", offset, minimum=0)
        checked_length = check_int("multimodal length", length)
        # frozen: the fields are set once, here, as the dataclass's own __init__ sets them
        object.__setattr__(self, "identifier", identifier)
        object.__setattr__(self, "offset", checked_offset)
        object.__setattr__(self, "length", checked_length)


def key_text_problem(value: object) -> str | None:
    """Why ``value`` cannot be a text cache key (salt, LoRA name, media ID), or None if it can.

    A key must be a non-empty ``str`` that encodes to UTF-8, so that it
    serialises to exactly one byte string (a lone surrogate does not).
    """
    if not isinstance(value, str) or not value:
        return f"a non-empty string, got {value!r}"
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return f"valid Unicode text, got {value!r} (it holds a lone surrogate)"
    return None


def _key_text_or_none(name: str, value: object) -> str | None:
    """``value`` when it is None or a text cache key (:func:`key_text_problem`); ConfigError naming it otherwise."""
    if value is None:
        return None
    problem = key_text_problem(value)
    if problem is not None or not isinstance(value, str):
        raise ConfigError(f"{name} must be {problem}")
    return value


def text_key(tag: bytes, text: str) -> bytes:
    raw = text.encode("utf-8")
    return tag + struct.pack("<I", len(raw)) + raw


class BlockHasher:
    """Computes a request's chained block hashes, once and incrementally.

    One hasher belongs to one manager; requests bound to it get their prompt
    hashed once, and each block that becomes full as output tokens are appended
    is hashed at that moment. Nothing is rehashed per lookup.

    Args:
        block_size: tokens per block, an ``int``.
        algo: :class:`HashAlgo` or its name.
        seed: what the chain's root is derived from: bytes for kvpool's
            algorithms (None: :data:`DEFAULT_HASH_SEED`), a string for vLLM's
            (None: vLLM's rule, ``PYTHONHASHSEED`` when set, else
            :data:`VLLM_DEFAULT_SEED`).

    The arguments are taken as objects and checked here, so both builds
    refuse a wrong one with the same :class:`~kvpool.errors.ConfigError`.
    """

    __slots__ = ("block_size", "algo", "seed", "seed_name", "root", "stores_contents", "_sha", "_xxh", "_dumps")

    def __init__(self, block_size: object, algo: object = HashAlgo.SHA256, seed: object = None) -> None:
        self.block_size = check_int("block_size", block_size)
        self.algo = HashAlgo.parse(algo)
        self._sha = hashlib.sha256
        self._xxh = None
        self._dumps: Callable[[Any], bytes] | None = None
        self.seed: bytes | str
        if self.algo.is_vllm:
            self.seed, self.seed_name = _vllm_seed(seed)
            self._dumps = _pickle_dumps if self.algo is HashAlgo.VLLM_SHA256 else _cbor_dumps()
        else:
            if seed is None:
                seed, self.seed_name = DEFAULT_HASH_SEED, "kvpool-default"
            elif isinstance(seed, bytes | bytearray) and seed:
                self.seed_name = "custom"
            else:
                raise ConfigError(f"hash seed of {self.algo.value!r} must be non-empty bytes, got {seed!r}")
            self.seed = bytes(seed)
        if self.algo is HashAlgo.XXH3_128:
            try:
                import xxhash
            except ImportError:
                raise ConfigError(
                    "hash algorithm 'xxh3_128' needs the xxhash package: pip install 'kvpool[fast]'"
                ) from None
            self._xxh = xxhash.xxh3_128_digest
        # The verified index compares each hit block's content bytes.
        self.stores_contents = not self.algo.is_cryptographic
        if self._dumps is not None:
            self.root = BlockHash(self._sha(self._dumps(self.seed)).digest())
        else:
            self.root = self.digest(b"root:" + cast(bytes, self.seed))

    @property
    def signature(self) -> tuple[int, HashAlgo, bytes | str]:
        """Two hashers with equal signatures produce identical hashes."""
        return (self.block_size, self.algo, self.seed)

    def digest(self, data: bytes) -> BlockHash:
        if self._xxh is not None:
            return BlockHash(self._xxh(data))
        return BlockHash(self._sha(data).digest())

    def chain(
        self,
        parent: BlockHash | None,
        token_bytes: bytes,
        extras: Sequence[bytes] | None = None,
        suffix: bytes = b"",
    ) -> tuple[list[BlockHash], list[bytes] | None]:
        """The chained hashes of consecutive full blocks, after ``parent``.

        ``token_bytes`` holds ``k * block_size`` token IDs as little-endian
        uint32 (:func:`token_bytes`); ``parent`` is the hash of the block
        before the first (None: the chain's root). Block ``i``'s extra keys
        are ``extras[i]`` when given (:func:`extra_key_bytes`), else ``suffix``
        for every block. Returns the ``k`` hashes and, when this hasher's hits
        are verified, the ``k`` block contents (else None).

        Cost: one digest of ``len(parent) + 4 * block_size`` bytes (plus
        extra keys) per block.
        """
        width = 4 * self.block_size
        chained: bytes = self.root if parent is None else parent
        hashes: list[bytes] = []
        contents: list[bytes] | None = [] if self.stores_contents else None
        if extras is not None:
            digest = self.digest
            for i, off in enumerate(range(0, len(token_bytes), width)):
                content = token_bytes[off : off + width] + extras[i]
                chained = digest(chained + content)
                hashes.append(chained)
                if contents is not None:
                    contents.append(content)
        elif self._xxh is not None:
            xxh = self._xxh
            stored: list[bytes] = contents  # type: ignore[assignment]  # the fast hash always stores contents
            if suffix:
                for off in range(0, len(token_bytes), width):
                    content = token_bytes[off : off + width] + suffix
                    chained = xxh(chained + content)
                    hashes.append(chained)
                    stored.append(content)
            else:  # no extra keys (the common case): the block's tokens are its content
                for off in range(0, len(token_bytes), width):
                    content = token_bytes[off : off + width]
                    chained = xxh(chained + content)
                    hashes.append(chained)
                    stored.append(content)
        elif suffix:
            sha = self._sha
            for off in range(0, len(token_bytes), width):
                chained = sha(chained + token_bytes[off : off + width] + suffix).digest()
                hashes.append(chained)
        else:
            sha = self._sha
            for off in range(0, len(token_bytes), width):
                chained = sha(chained + token_bytes[off : off + width]).digest()
                hashes.append(chained)
        return cast(list[BlockHash], hashes), contents  # every digest is a block hash

    def chain_blocks(
        self,
        parent: BlockHash | None,
        token_bytes: bytes,
        first_block: int,
        *,
        lora_key: bytes = b"",
        salt_key: bytes = b"",
        mm_inputs: Sequence[MultiModalInput] = (),
    ) -> tuple[list[BlockHash], list[bytes] | None]:
        """:meth:`chain` for blocks ``first_block, first_block + 1, ...`` of a request with these keys.

        The keys' layout decides the cheapest exact path: without media, every
        block's extra keys are the LoRA key (and the salt, on block 0 only), a
        constant suffix; media overlap some blocks, so they take the per-block
        path. ``lora_key`` and ``salt_key`` come from :func:`lora_key` and
        :func:`salt_key`.
        """
        bs = self.block_size
        if self._dumps is not None:
            return self._chain_vllm(parent, token_bytes, first_block, lora_key, salt_key, mm_inputs), None
        if mm_inputs:
            count = len(token_bytes) // (4 * bs)
            extras = [
                extra_key_bytes(lora_key, salt_key, mm_inputs, k * bs, k * bs + bs)
                for k in range(first_block, first_block + count)
            ]
            return self.chain(parent, token_bytes, extras)
        if first_block == 0 and salt_key and token_bytes:
            width = 4 * bs
            head, head_contents = self.chain(parent, token_bytes[:width], [lora_key + salt_key])
            rest, rest_contents = self.chain(head[0], token_bytes[width:], suffix=lora_key)
            contents = head_contents + rest_contents if head_contents is not None else None  # type: ignore[operator]  # one hasher: both chains store contents or neither
            return head + rest, contents
        return self.chain(parent, token_bytes, suffix=lora_key)

    def _chain_vllm(
        self,
        parent: BlockHash | None,
        token_bytes: bytes,
        first_block: int,
        lora_key: bytes,
        salt_key: bytes,
        mm_inputs: Sequence[MultiModalInput],
        lora_path: str | None = None,
    ) -> list[BlockHash]:
        """vLLM's chain: each block hashes ``dumps((parent, tokens, extra keys or None))``.

        The keys arrive in kvpool's serialised form (:func:`lora_key`,
        :func:`salt_key`); vLLM's key tuples are built from their text.
        """
        bs = self.block_size
        tokens = array(_TOKEN_TYPECODE)
        tokens.frombytes(token_bytes)
        if _BIG_ENDIAN:  # pragma: no cover
            tokens.byteswap()
        ids = tokens.tolist()
        lora: tuple[tuple[str, ...], ...] = ()
        if lora_key:
            name = _key_text(lora_key)
            # vLLM's request holds the name and the path as two objects; pickle must see two.
            lora = (("lora", name, lora_path if lora_path is not None else _copy_text(name)),)
        salt = (("cache_salt", _key_text(salt_key)),) if salt_key else ()
        dumps, sha = cast(Callable[[Any], bytes], self._dumps), self._sha
        chained: bytes = self.root if parent is None else parent
        hashes: list[bytes] = []
        plain = lora or None  # the extra keys of a block without media, after block 0
        for k in range(len(ids) // bs):
            start = (first_block + k) * bs
            if mm_inputs:
                media = tuple(
                    ("mm", item.identifier, item.offset - start)
                    for item in mm_inputs
                    if item.offset < start + bs and item.offset + item.length > start
                )
                extras = (lora + media + salt if start == 0 else lora + media) or None
            else:
                extras = (lora + salt or None) if start == 0 else plain
            chained = sha(dumps((chained, tuple(ids[k * bs : (k + 1) * bs]), extras))).digest()
            hashes.append(chained)
        return cast(list[BlockHash], hashes)  # every digest is a block hash

    def hash_token_ids(
        self,
        token_ids: Sequence[int],
        *,
        cache_salt: object = None,
        lora_name: object = None,
        lora_path: object = None,
        mm_inputs: object = (),
    ) -> list[BlockHash]:
        """The block hashes of a token sequence, as a manager would compute them.

        For routers and tools that need the hashes without a manager. With
        vLLM's algorithms these are the bytes vLLM's request block hasher puts
        on a request with the same inputs; vLLM hashes the LoRA adapter's
        path beside its name, so pass ``lora_path`` as the vLLM replica loaded
        it (kvpool's own requests, which know adapters by name only, use the
        name as the path). kvpool's algorithms ignore ``lora_path``.

        ``cache_salt``, ``lora_name`` and ``lora_path`` are None or text,
        ``mm_inputs`` an iterable of :class:`MultiModalInput`; they are taken
        as objects and checked here (a :class:`~kvpool.errors.ConfigError`
        naming the value, in both builds).
        """
        tokens = to_token_array(token_ids, "token_ids", ordered=True)
        salt = _key_text_or_none("cache_salt", cache_salt)
        name = _key_text_or_none("lora_name", lora_name)
        path = _key_text_or_none("lora_path", lora_path)
        if path is not None and name is None:
            raise ConfigError(f"lora_path {path!r} was given without a lora_name")
        media = _media_items(mm_inputs)
        for item in media:  # Request's rule: a multimodal item lies within the tokens
            if item.offset + item.length > len(tokens):
                raise ConfigError(
                    f"multimodal item {item.identifier!r} covers positions {item.offset}..{item.offset + item.length - 1}, "
                    f"beyond the {len(tokens)} tokens"
                )
        items = tuple(sorted(media, key=lambda m: m.offset))
        bs = self.block_size
        num_blocks = len(tokens) // bs
        if self._dumps is not None:
            return self._chain_vllm(
                None,
                token_bytes(tokens[: num_blocks * bs]),
                0,
                lora_key(name),
                salt_key(salt),
                items,
                path,
            )
        return self.chain_blocks(
            None,
            token_bytes(tokens[: num_blocks * bs]),
            0,
            lora_key=lora_key(name),
            salt_key=salt_key(salt),
            mm_inputs=items,
        )[0]


def _media_items(mm_inputs: object) -> list[MultiModalInput]:
    """``mm_inputs`` as a list when it is an iterable of :class:`MultiModalInput` (not text); ConfigError otherwise.

    Read as objects, one pass, so a compiled build names a wrong item as the
    pure build does, and a generator is read once.
    """
    if isinstance(mm_inputs, str | bytes) or not isinstance(mm_inputs, Iterable):
        raise ConfigError(f"mm_inputs must be a sequence of MultiModalInput, got {mm_inputs!r}")
    listed: list[object] = list(mm_inputs)
    media: list[MultiModalInput] = []
    for item in listed:
        if not isinstance(item, MultiModalInput):
            raise ConfigError(f"mm_inputs must be a sequence of MultiModalInput, got {mm_inputs!r}")
        media.append(item)
    return media


def _vllm_seed(seed: object) -> tuple[str, str]:
    """vLLM's root seed and where it came from: ``PYTHONHASHSEED`` when set, else vLLM's fixed default."""
    if seed is not None:
        if not isinstance(seed, str) or not seed:
            raise ConfigError(f"the seed of vLLM's hash algorithms must be a non-empty string, got {seed!r}")
        return seed, "custom"
    env = os.environ.get("PYTHONHASHSEED")
    if env is not None:
        return env, "PYTHONHASHSEED"
    return VLLM_DEFAULT_SEED, "vllm-default"


def _pickle_dumps(value: Any) -> bytes:
    return pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)


def _cbor_dumps() -> Callable[[Any], bytes]:
    try:
        import cbor2
    except ImportError:
        raise ConfigError(
            "hash algorithm 'sha256_cbor' needs the cbor2 package, which comes with kvpool's 'events' extra: "
            "pip install 'kvpool[events]'"
        ) from None
    return functools.partial(cbor2.dumps, canonical=True)


def _key_text(key: bytes) -> str:
    """The text of a serialised key (:func:`lora_key`, :func:`salt_key`): tag, length, UTF-8."""
    return key[5:].decode("utf-8")


def _copy_text(text: str) -> str:
    """An equal string that is a distinct object (pickle writes a repeated object as a back-reference)."""
    return text.encode("utf-8").decode("utf-8")


def token_bytes(tokens: array[int]) -> bytes:
    """Token IDs (an ``array`` of :data:`TOKEN_TYPECODE`) as little-endian uint32 bytes."""
    if _BIG_ENDIAN:  # pragma: no cover
        tokens = tokens[:]
        tokens.byteswap()
    return tokens.tobytes()


def extra_key_bytes(
    lora_key: bytes, salt_key: bytes, mm_inputs: Sequence[MultiModalInput], start: int, end: int
) -> bytes:
    """Serialised extra keys of the block covering token positions ``[start, end)``."""
    parts = [lora_key]
    for item in mm_inputs:
        if item.offset >= end:
            break
        if item.offset + item.length > start:
            rel = item.offset - start
            parts.append(text_key(_TAG_MM, item.identifier) + struct.pack("<q", rel))
    if start == 0:
        parts.append(salt_key)
    return b"".join(parts)


def extra_keys_readable(
    lora_name: str | None,
    cache_salt: str | None,
    mm_inputs: Sequence[MultiModalInput],
    start: int,
    end: int,
) -> tuple[ExtraKey, ...] | None:
    """The extra keys of one block in readable form, for KV events."""
    keys: list[ExtraKey] = []
    if lora_name is not None:
        keys.append(("lora", lora_name))
    for item in mm_inputs:
        if item.offset >= end:
            break
        if item.offset + item.length > start:
            keys.append(("mm", item.identifier, item.offset - start))
    if start == 0 and cache_salt is not None:
        keys.append(("cache_salt", cache_salt))
    return tuple(keys) or None


def lora_key(lora_name: str | None) -> bytes:
    return b"" if lora_name is None else text_key(_TAG_LORA, lora_name)


def salt_key(cache_salt: str | None) -> bytes:
    return b"" if cache_salt is None else text_key(_TAG_SALT, cache_salt)


TOKEN_TYPECODE = _TOKEN_TYPECODE
TOKEN_LIMIT = 2**32


def to_token_array(token_ids: Iterable[int], what: str, *, ordered: bool = False) -> array[int]:
    """Token IDs as an ``array('I')``; anything else raises InvalidTokenError naming it.

    A mapping (a ``dict``) is refused: iterating it gives its keys, never tokens. With
    ``ordered`` (a prompt, a request's output, tokens to hash: their order is their meaning), a
    set (``set``, ``frozenset``, a dict's keys) is refused too: its order is one no one chose.
    A collection whose order does not matter (stop token IDs) may be a set.
    """
    if isinstance(token_ids, array) and token_ids.typecode == _TOKEN_TYPECODE:
        return array(_TOKEN_TYPECODE, token_ids)
    if isinstance(token_ids, range):
        if len(token_ids) and not (0 <= min(token_ids) and max(token_ids) < TOKEN_LIMIT):
            raise InvalidTokenError(_describe_bad_token(token_ids, what))
        return array(_TOKEN_TYPECODE, token_ids)
    if isinstance(token_ids, str | bytes | bytearray | memoryview) or not isinstance(token_ids, Iterable):
        raise InvalidTokenError(f"{what} must be a sequence of integer token IDs, got {type(token_ids).__name__}")
    if isinstance(token_ids, Mapping) or (ordered and isinstance(token_ids, AbstractSet)):
        raise InvalidTokenError(
            f"{what} must be a sequence of integer token IDs in order, got {type(token_ids).__name__} "
            "(a mapping or a set has no token order)"
        )
    try:
        values = token_ids if isinstance(token_ids, list | tuple) else list(token_ids)
        tokens = array(_TOKEN_TYPECODE, values)
    except (TypeError, OverflowError, ValueError):
        raise InvalidTokenError(_describe_bad_token(token_ids, what)) from None
    # ``array`` takes True as 1 and False as 0; a bool is a flag, never a token ID.
    if _holds_bool(values, tokens):
        raise InvalidTokenError(_describe_bad_token(values, what))
    return tokens


#: Past this many candidate 0s and 1s, :func:`_holds_bool` reads every item's type instead.
_FEW_FLAG_VALUES = 32
#: A token array's item holding 0, and holding 1, as the array stores them (native byte order).
_ZERO_ITEM = bytes(array(_TOKEN_TYPECODE).itemsize)
_ONE_ITEM = array(_TOKEN_TYPECODE, [1]).tobytes()


def _holds_bool(values: Sequence[object], tokens: array[int]) -> bool:
    """Whether ``values`` (the items ``tokens`` was built from, one for one) holds a ``bool``.

    Only an item stored as 0 or 1 can be one. Their positions are found by
    searching the array's bytes (``bytes.find``, C speed, no object per item);
    a match that does not start an item is skipped, and the items at the
    others are looked at one by one. With many candidates it reads every
    item's type instead (one C-level pass, about ten times slower). Exact
    either way.
    """
    raw = tokens.tobytes()
    width = len(_ZERO_ITEM)
    seen = 0
    for pattern in (_ZERO_ITEM, _ONE_ITEM):
        at = raw.find(pattern)
        while at >= 0:
            seen += 1
            if seen > _FEW_FLAG_VALUES:
                return bool in set(map(type, values))
            if at % width:
                at = raw.find(pattern, at + 1)
                continue
            if type(values[at // width]) is bool:
                return True
            at = raw.find(pattern, at + width)
    return False


def _describe_bad_token(token_ids: Iterable[object], what: str) -> str:
    # Items are objects, not ints: a compiled build would otherwise turn True into 1 as it reads them.
    try:
        items = list(token_ids)
    except TypeError:
        return f"{what} must be a sequence of integer token IDs, got {type(token_ids).__name__}"
    for i, t in enumerate(items):
        if not hasattr(t, "__index__") or isinstance(t, bool):
            return f"{what}[{i}] = {t!r} is not an integer token ID"
        value = t if isinstance(t, int) else t.__index__()
        if not 0 <= int(value) < TOKEN_LIMIT:
            return f"{what}[{i}] = {int(value)} is out of range: token IDs must be in [0, 2**32)"
    return f"{what} holds an invalid token ID"
