"""Request traces: the :class:`TraceRequest` type and two JSON Lines formats.

A request describes its prompt as a tuple of *segments* and materialises token
IDs only when asked (:meth:`TraceRequest.prompt_token_ids`): a real trace
expanded to tokens is far too large to hold as Python objects. Segments
(frozen; each expands deterministically to uint32 tokens):
:class:`SharedSegment` (a prefix of a named stream, shared by every request
naming it), :class:`UniqueSegment` (tokens owned by one request),
:class:`TokenSegment` (explicit IDs), :class:`HashBlockSegment` (Mooncake
512-token blocks; hash ID ``h`` at offset ``j`` becomes token ``h * 512 + j``)
and :class:`OutputSegment` (a previous turn's output).

Formats (see ``docs/traces.md``): :attr:`TraceFormat.MOONCAKE` (read) and
kvpool's token-level :attr:`TraceFormat.TOKENS` (read and written by
:func:`write_trace`). Bad input raises :class:`TraceError`, whose message names
the file, the line number and the field. Sizes are bounded before anything is
built from them: a request holds at most :data:`MAX_REQUEST_TOKENS` tokens,
prompt and output together. Standard library only.
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
from array import array
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from enum import Enum
from os import PathLike
from pathlib import Path
from typing import Any, TypeAlias, cast

from kvpool.errors import ExternalDataError
from kvpool.hashing import TOKEN_LIMIT, TOKEN_TYPECODE
from kvpool.specs import cdiv

__all__ = [
    "MAX_REQUEST_TOKENS",
    "MOONCAKE_BLOCK_TOKENS",
    "HashBlockSegment",
    "OutputSegment",
    "Segment",
    "SharedSegment",
    "TokenSegment",
    "TraceError",
    "TraceFormat",
    "TraceRequest",
    "UniqueSegment",
    "detect_format",
    "iter_trace",
    "load_trace",
    "write_trace",
]

#: Tokens per Mooncake hash block.
MOONCAKE_BLOCK_TOKENS = 512
#: Largest hash ID whose expansion ``h * 512 + j`` still fits in uint32.
MAX_HASH_ID = TOKEN_LIMIT // MOONCAKE_BLOCK_TOKENS - 1
#: Most tokens one request may hold, prompt and output together (beyond any model's context).
MAX_REQUEST_TOKENS = 2**24
_BIG_ENDIAN = sys.byteorder == "big"


class TraceError(ExternalDataError):
    """A trace file or a trace request is malformed.

    ``file``, ``line`` and ``field`` (each may be ``None``) locate the problem;
    the message reads e.g. ``"t.jsonl line 17: field 'input_length' must be a
    non-negative integer, got -3"``.
    """

    def __init__(
        self, problem: str, *, file: str | None = None, line: int | None = None, field: str | None = None
    ) -> None:
        self.file, self.line, self.field, self.problem = file, line, field, problem
        where = file or ""
        if line is not None:
            where = f"{where} line {line}" if where else f"line {line}"
        text = f"field '{field}' {problem}" if field else problem
        super().__init__(f"{where}: {text}" if where else text)


class TraceFormat(Enum):
    """On-disk trace formats understood by :func:`load_trace`."""

    MOONCAKE = "mooncake"
    TOKENS = "tokens"


def _derived_tokens(tag: str, parts: tuple[str, ...], count: int) -> array[int]:
    """``count`` pseudo-random uint32 tokens from SHAKE-128 of (tag, parts).

    Every string is length-prefixed, so distinct inputs never feed the same
    bytes. O(count).
    """
    xof = hashlib.shake_128()
    for part in (tag, *parts):
        raw = part.encode("utf-8")
        xof.update(len(raw).to_bytes(8, "little"))
        xof.update(raw)
    out = array(TOKEN_TYPECODE)
    out.frombytes(xof.digest(4 * count))
    if _BIG_ENDIAN:
        out.byteswap()
    return out


def _bad_count(value: object) -> str | None:
    if type(value) is not int or value < 0:
        return f"must be a non-negative integer, got {value!r}"
    if value > MAX_REQUEST_TOKENS:
        return f"must be at most {MAX_REQUEST_TOKENS:,} (tokens in one request), got {value!r}"
    return None


def _bad_arrival(a: object) -> str | None:
    ok = type(a) in (int, float) and math.isfinite(cast(float, a)) and cast(float, a) >= 0  # an int or a float by now
    return None if ok else f"must be a finite number >= 0, got {a!r}"


def _require_count(value: object, name: str) -> None:
    if (problem := _bad_count(value)) is not None:
        raise TraceError(problem, field=name)


def _to_token_bytes(token_ids: Iterable[int], name: str) -> bytes:
    """Validate token IDs (integers in [0, 2**32)) and pack them little-endian."""
    values = list(token_ids)
    try:
        if any(type(t) is bool for t in values):
            raise TypeError
        packed = array(TOKEN_TYPECODE, values)
    except (TypeError, OverflowError, ValueError):
        for i, t in enumerate(values):
            if type(t) is not int or not 0 <= t < TOKEN_LIMIT:
                raise TraceError(f"must hold integers in [0, 2**32), got {t!r} at index {i}", field=name) from None
        raise
    if _BIG_ENDIAN:
        packed.byteswap()
    return packed.tobytes()


@dataclass(frozen=True, slots=True)
class SharedSegment:
    """The first ``length`` tokens of the stream called ``name``.

    Two requests naming the same stream get identical tokens for the common
    length, so a stream placed at the start of several prompts is a shared
    prefix (a system prompt, a tool description).
    """

    name: str
    length: int

    def __post_init__(self) -> None:
        if not isinstance(self.name, str):
            raise TraceError(f"must be a string, got {self.name!r}", field="shared")
        _require_count(self.length, "length")

    def token_ids(self) -> array[int]:
        """The tokens; O(length)."""
        return _derived_tokens("shared", (self.name,), self.length)


@dataclass(frozen=True, slots=True)
class UniqueSegment:
    """``length`` tokens that belong to request ``owner`` only.

    ``index`` (the segment's position in its owner's own segment list) keeps two
    unique segments of one request apart. ``owner=None`` is a placeholder that
    :meth:`TraceRequest.create` fills in; a request never stores it.
    """

    length: int
    owner: str | None = None
    index: int = 0

    def __post_init__(self) -> None:
        _require_count(self.length, "unique")
        _require_count(self.index, "index")
        if self.owner is not None and not isinstance(self.owner, str):
            raise TraceError(f"must be a string, got {self.owner!r}", field="owner")

    def token_ids(self) -> array[int]:
        """The tokens; O(length). Raises TraceError for an unowned placeholder."""
        if self.owner is None:
            raise TraceError("is unset: build the request with TraceRequest.create", field="owner")
        return _derived_tokens("unique", (self.owner, str(self.index)), self.length)


@dataclass(frozen=True, slots=True)
class TokenSegment:
    """Explicit token IDs, stored packed (``data``: little-endian uint32)."""

    data: bytes

    def __post_init__(self) -> None:
        if not isinstance(self.data, bytes) or len(self.data) % 4:
            raise TraceError("must be bytes of packed uint32 tokens", field="tokens")

    @classmethod
    def of(cls, token_ids: Iterable[int]) -> TokenSegment:
        """Build from integers in ``[0, 2**32)`` (TraceError otherwise); O(n)."""
        return cls(_to_token_bytes(token_ids, "tokens"))

    @property
    def length(self) -> int:
        return len(self.data) // 4

    def token_ids(self) -> array[int]:
        out = array(TOKEN_TYPECODE)
        out.frombytes(self.data)
        if _BIG_ENDIAN:
            out.byteswap()
        return out


@dataclass(frozen=True, slots=True)
class HashBlockSegment:
    """``length`` tokens named by Mooncake hash IDs, one per 512-token block.

    Hash ID ``h`` at offset ``j`` of its block expands to token ``h * 512 + j``:
    injective, so chained hashing at any block size dividing 512 shares exactly
    the blocks the IDs share. Requires ``len(hash_ids) == ceil(length / 512)``
    and every ID in ``[0, MAX_HASH_ID]``.
    """

    hash_ids: tuple[int, ...]
    length: int

    def __post_init__(self) -> None:
        _require_count(self.length, "length")
        if not isinstance(self.hash_ids, tuple):
            object.__setattr__(self, "hash_ids", tuple(self.hash_ids))
        if (problem := _bad_hash_ids(self.hash_ids, self.length)) is not None:
            raise TraceError(problem, field="hash_ids")

    def token_ids(self) -> array[int]:
        """The tokens; O(length)."""
        out = array(TOKEN_TYPECODE)
        for i, h in enumerate(self.hash_ids):
            base = h * MOONCAKE_BLOCK_TOKENS
            out.extend(range(base, base + min(MOONCAKE_BLOCK_TOKENS, self.length - i * MOONCAKE_BLOCK_TOKENS)))
        return out


def _bad_hash_ids(hash_ids: object, length: int) -> str | None:
    if not isinstance(hash_ids, list | tuple):
        return f"must be a list of integers, got {type(hash_ids).__name__}"
    for i, h in enumerate(hash_ids):
        if type(h) is not int or not 0 <= h <= MAX_HASH_ID:
            return f"must hold integers in [0, {MAX_HASH_ID}] (so h*512+511 < 2**32), got {h!r} at index {i}"
    need = cdiv(length, MOONCAKE_BLOCK_TOKENS)
    if len(hash_ids) != need:
        return f"has {len(hash_ids)} ids but a length of {length} tokens needs ceil({length}/512) = {need}"
    return None


@dataclass(frozen=True, slots=True)
class OutputSegment:
    """The ``length`` output tokens of request ``request_id`` (a previous turn)."""

    request_id: str
    length: int

    def __post_init__(self) -> None:
        _require_count(self.length, "length")

    def token_ids(self) -> array[int]:
        return _derived_tokens("output", (self.request_id,), self.length)


Segment: TypeAlias = SharedSegment | UniqueSegment | TokenSegment | HashBlockSegment | OutputSegment
_SEGMENT_TYPES = (SharedSegment, UniqueSegment, TokenSegment, HashBlockSegment, OutputSegment)


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace; its tokens are produced lazily.

    Contract: ``request_id`` is a non-empty string unique within its trace (the
    output tokens and unique segments derive from it); ``arrival_ms`` is a
    finite number >= 0 (stored as float); ``segments`` describe the whole
    prompt in order, ``prompt_length`` is their total (computed);
    ``output_length`` is how many tokens the simulated model generates;
    ``cache_salt`` / ``lora_name`` are optional extra cache keys; ``follows``
    records the ID of the previous turn this prompt extends (informational; the
    inherited tokens are already in ``segments``); ``outputs``, when given, are
    the output tokens themselves (``output_length`` of them), for instance what a
    real engine generated, so that blocks holding output tokens get the same
    hashes as there (a greedy engine answers a repeated prompt with the same
    tokens). Invalid values raise :class:`TraceError`.

    Memory is O(number of segments); tokens exist only while a caller holds the
    arrays returned by :meth:`prompt_token_ids` / :meth:`output_token_ids`.
    """

    request_id: str
    arrival_ms: float
    segments: tuple[Segment, ...]
    output_length: int
    cache_salt: str | None = None
    lora_name: str | None = None
    follows: str | None = None
    outputs: TokenSegment | None = None
    prompt_length: int = field(init=False)

    def __post_init__(self) -> None:
        if not isinstance(self.request_id, str) or not self.request_id:
            raise TraceError(f"must be a non-empty string, got {self.request_id!r}", field="id")
        if (problem := _bad_arrival(self.arrival_ms)) is not None:
            raise TraceError(problem, field="arrival_ms")
        object.__setattr__(self, "arrival_ms", float(self.arrival_ms))
        _require_count(self.output_length, "output_length")
        if self.outputs is not None and (
            not isinstance(self.outputs, TokenSegment) or self.outputs.length != self.output_length
        ):
            raise TraceError(
                f"must be a TokenSegment of output_length={self.output_length} tokens, got {self.outputs!r}",
                field="output_token_ids",
            )
        for name in ("cache_salt", "lora_name", "follows"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise TraceError(f"must be a string or null, got {value!r}", field=name)
        segments = tuple(self.segments)
        for i, seg in enumerate(segments):
            if not isinstance(seg, _SEGMENT_TYPES):
                raise TraceError(f"must be a segment, got {type(seg).__name__}", field=f"segments[{i}]")
            if isinstance(seg, UniqueSegment) and seg.owner is None:
                raise TraceError("is an unowned unique segment: use TraceRequest.create", field=f"segments[{i}]")
        object.__setattr__(self, "segments", segments)
        object.__setattr__(self, "prompt_length", sum(s.length for s in segments))
        if self.prompt_length + self.output_length > MAX_REQUEST_TOKENS:
            raise TraceError(
                f"holds {self.prompt_length:,} prompt + {self.output_length:,} output tokens; "
                f"a request may hold at most {MAX_REQUEST_TOKENS:,}",
                field="segments",
            )

    @classmethod
    def create(
        cls,
        request_id: str,
        arrival_ms: float,
        segments: Iterable[Segment],
        output_length: int,
        *,
        follows: TraceRequest | None = None,
        cache_salt: str | None = None,
        lora_name: str | None = None,
        outputs: TokenSegment | None = None,
    ) -> TraceRequest:
        """Build a request from its own new segments, optionally extending a turn.

        Each ``UniqueSegment(length)`` placeholder becomes owned by this request
        with ``index`` = its position in ``segments``. With ``follows=prev`` the
        prompt is ``prev``'s prompt + ``prev``'s output + ``segments``.
        ``outputs`` are explicit output tokens (see the class). O(len(prev.segments) + len(segments)).
        """
        own: list[Segment] = []
        for i, seg in enumerate(segments):
            if isinstance(seg, UniqueSegment) and seg.owner is None:
                seg = UniqueSegment(seg.length, request_id, i)
            own.append(seg)
        prefix: tuple[Segment, ...] = ()
        if follows is not None:
            prefix = (*follows.segments, follows.output_segment())
        previous = None if follows is None else follows.request_id
        return cls(request_id, arrival_ms, (*prefix, *own), output_length, cache_salt, lora_name, previous, outputs)

    def output_segment(self) -> TokenSegment | OutputSegment:
        """The output as a segment of a later turn's prompt: the explicit tokens, or the derived ones."""
        return self.outputs if self.outputs is not None else OutputSegment(self.request_id, self.output_length)

    @property
    def hash_ids(self) -> tuple[int, ...] | None:
        """The Mooncake hash IDs when the prompt is exactly one hash-block segment, else None."""
        if len(self.segments) == 1 and isinstance(self.segments[0], HashBlockSegment):
            return self.segments[0].hash_ids
        return None

    def prompt_token_ids(self) -> array[int]:
        """The prompt as a fresh ``array('I')`` of ``prompt_length`` tokens; O(prompt_length)."""
        out = array(TOKEN_TYPECODE)
        for seg in self.segments:
            out.extend(seg.token_ids())
        return out

    def output_token_ids(self) -> array[int]:
        """The ``output_length`` tokens the simulated model generates; O(output_length).

        Deterministic and derived from ``request_id``, so two requests' outputs
        never share tokens by accident; or ``outputs`` when given.
        """
        return self.output_segment().token_ids()


@dataclass(frozen=True, slots=True)
class _Where:
    file: str
    line: int

    def fail(self, field: str | None, problem: str) -> TraceError:
        return TraceError(problem, file=self.file, line=self.line, field=field)

    def count(self, obj: dict[str, Any], key: str, name: str | None = None) -> int:
        if key not in obj:
            raise self.fail(name or key, "is missing")
        if (problem := _bad_count(obj[key])) is not None:
            raise self.fail(name or key, problem)
        count: int = obj[key]  # _bad_count passed: an int
        return count

    def arrival(self, obj: dict[str, Any], key: str) -> float:
        if key not in obj:
            raise self.fail(key, "is missing")
        if (problem := _bad_arrival(obj[key])) is not None:
            raise self.fail(key, problem)
        return float(obj[key])

    def text(self, obj: dict[str, Any], key: str, *, required: bool = False) -> str | None:
        if required and key not in obj:
            raise self.fail(key, "is missing")
        if (value := obj.get(key)) is None and not required:
            return None
        if not isinstance(value, str) or (required and not value):
            raise self.fail(key, f"must be a {'non-empty ' if required else ''}string, got {value!r}")
        return value


class _MooncakeParser:
    """Parses Mooncake lines; checks that every hash ID keeps one position and parent."""

    def __init__(self, file: str, stem: str) -> None:
        self._file, self._stem = file, stem
        self._seen: dict[int, tuple[int, int, int]] = {}  # id -> (position, parent, line)

    def parse(self, obj: dict[str, Any], line: int) -> TraceRequest:
        where = _Where(self._file, line)
        arrival = where.arrival(obj, "timestamp")
        length = where.count(obj, "input_length")
        output = where.count(obj, "output_length")
        if "hash_ids" not in obj:
            raise where.fail("hash_ids", "is missing")
        ids = obj["hash_ids"]
        if (problem := _bad_hash_ids(ids, length)) is not None:
            raise where.fail("hash_ids", problem)
        parent = -1
        for pos, h in enumerate(ids):
            first = self._seen.setdefault(h, (pos, parent, line))
            if first[:2] != (pos, parent):
                raise where.fail(
                    "hash_ids",
                    f"id {h} is at position {pos} after {parent} here but at position {first[0]} "
                    f"after {first[1]} on line {first[2]} (ids must be chained prefix hashes; -1 = none)",
                )
            parent = h
        return TraceRequest(f"{self._stem}:{line}", arrival, (HashBlockSegment(tuple(ids), length),), output)


_TOKEN_FIELDS = frozenset(
    {"id", "arrival_ms", "output_length", "output_token_ids", "prompt_length", "token_ids", "segments"}
    | {"cache_salt", "lora_name", "follows"}
)


class _TokenParser:
    """Parses kvpool token-level lines; resolves ``follows`` against earlier lines."""

    def __init__(self, file: str) -> None:
        self._file = file
        self._by_id: dict[str, TraceRequest] = {}

    def parse(self, obj: dict[str, Any], line: int) -> TraceRequest:
        where = _Where(self._file, line)
        for key in obj:
            if key not in _TOKEN_FIELDS:
                raise where.fail(key, f"is not a field of the token-level format (known: {sorted(_TOKEN_FIELDS)})")
        rid = where.text(obj, "id", required=True)
        assert rid is not None
        if rid in self._by_id:
            raise where.fail("id", f"repeats request id {rid!r}")
        arrival = where.arrival(obj, "arrival_ms")
        output = where.count(obj, "output_length")
        salt, lora = where.text(obj, "cache_salt"), where.text(obj, "lora_name")
        prev = None
        if (follows := where.text(obj, "follows")) is not None:
            prev = self._by_id.get(follows)
            if prev is None:
                raise where.fail("follows", f"names {follows!r}, which no earlier line defines")
        segments: list[Segment] = []
        if "token_ids" in obj and "segments" in obj:
            raise where.fail("token_ids", "and 'segments' are exclusive; give one")
        if "token_ids" in obj:
            segments.append(self._tokens(where, obj["token_ids"], "token_ids"))
        elif "segments" in obj:
            if not isinstance(obj["segments"], list):
                raise where.fail("segments", f"must be a list, got {type(obj['segments']).__name__}")
            segments.extend(self._segment(where, s, i) for i, s in enumerate(obj["segments"]))
        elif prev is None:
            raise where.fail("segments", "is missing (give 'segments' or 'token_ids')")
        outputs = (
            self._tokens(where, obj["output_token_ids"], "output_token_ids") if "output_token_ids" in obj else None
        )
        req = TraceRequest.create(
            rid, arrival, segments, output, follows=prev, cache_salt=salt, lora_name=lora, outputs=outputs
        )
        if "prompt_length" in obj:
            claimed = where.count(obj, "prompt_length")
            if claimed != req.prompt_length:
                raise where.fail("prompt_length", f"is {claimed} but the segments hold {req.prompt_length} tokens")
        self._by_id[rid] = req
        return req

    @staticmethod
    def _tokens(where: _Where, value: object, name: str) -> TokenSegment:
        if not isinstance(value, list):
            raise where.fail(name, f"must be a list of token IDs, got {type(value).__name__}")
        try:
            return TokenSegment(_to_token_bytes(value, name))
        except TraceError as exc:
            raise where.fail(name, exc.problem) from None

    def _segment(self, where: _Where, seg: object, i: int) -> Segment:
        name = f"segments[{i}]"
        if not isinstance(seg, dict):
            raise where.fail(name, f"must be an object, got {type(seg).__name__}")
        kinds = [k for k in ("shared", "unique", "tokens", "hash_blocks") if k in seg]
        if len(kinds) != 1:
            raise where.fail(name, "must have exactly one of 'shared', 'unique', 'tokens', 'hash_blocks'")
        kind = kinds[0]
        allowed = {kind, "length"} if kind in ("shared", "hash_blocks") else {kind}
        for key in seg:
            if key not in allowed:
                raise where.fail(f"{name}.{key}", f"is not allowed in a '{kind}' segment")
        if kind == "unique":
            return UniqueSegment(where.count(seg, "unique", f"{name}.unique"))
        if kind == "tokens":
            return self._tokens(where, seg["tokens"], f"{name}.tokens")
        length = where.count(seg, "length", f"{name}.length")
        if kind == "shared":
            if not isinstance(seg["shared"], str) or not seg["shared"]:
                raise where.fail(f"{name}.shared", f"must be a non-empty string, got {seg['shared']!r}")
            return SharedSegment(seg["shared"], length)
        if (problem := _bad_hash_ids(seg["hash_blocks"], length)) is not None:
            raise where.fail(f"{name}.hash_blocks", problem)
        return HashBlockSegment(tuple(seg["hash_blocks"]), length)


def _coerce_format(format: TraceFormat | str | None) -> TraceFormat | None:
    if format is None or isinstance(format, TraceFormat):
        return format
    try:
        return TraceFormat(format)
    except ValueError:
        raise TraceError(f"unknown trace format {format!r}; use one of {[f.value for f in TraceFormat]}") from None


def _detect(obj: dict[str, Any], where: _Where) -> TraceFormat:
    if "hash_ids" in obj:
        return TraceFormat.MOONCAKE
    if "id" in obj:
        return TraceFormat.TOKENS
    raise where.fail(None, "cannot tell the format: a Mooncake line has 'hash_ids', a token-level line has 'id'")


def _records(path: Path) -> Iterator[tuple[_Where, dict[str, Any]]]:
    """Non-blank lines of ``path`` decoded as JSON objects, with their location.

    A file that cannot be opened or read raises :class:`TraceError` naming the path.
    """
    try:
        with path.open("rb") as f:
            for lineno, raw in enumerate(f, 1):
                if raw.strip():
                    yield _Where(path.name, lineno), _json_object(raw, _Where(path.name, lineno))
    except FileNotFoundError:
        raise TraceError("no such trace file", file=str(path)) from None
    except OSError as exc:
        raise TraceError(f"cannot read the trace file ({exc.strerror or exc})", file=str(path)) from None


def _json_object(raw: bytes, where: _Where) -> dict[str, Any]:
    try:
        obj = json.loads(raw)
    except ValueError as exc:  # bad JSON, bad UTF-8, or a number too long to read
        raise where.fail(None, f"malformed JSON ({exc})") from None
    except RecursionError:
        raise where.fail(None, "malformed JSON (nested too deeply)") from None
    if not isinstance(obj, dict):
        raise where.fail(None, f"must be a JSON object, got {type(obj).__name__}")
    return obj


def detect_format(path: str | PathLike[str]) -> TraceFormat:
    """The format of ``path``, judged from the fields of its first non-blank line."""
    for where, obj in _records(Path(path)):
        return _detect(obj, where)
    raise TraceError("file is empty (no requests)", file=Path(path).name)


def iter_trace(path: str | PathLike[str], format: TraceFormat | str | None = None) -> Iterator[TraceRequest]:
    """Stream the requests of ``path`` in file order.

    ``format=None`` detects it from the first line. Blank lines are skipped (but
    counted in line numbers). Raises :class:`TraceError` on the first bad line,
    or at the end if the file holds no request. Memory: O(segments) per request
    kept by the caller, plus an id table (Mooncake: one entry per distinct hash
    ID; token-level: one per request, for ``follows``). O(file size) time.
    """
    path = Path(path)
    fmt = _coerce_format(format)
    parser: _MooncakeParser | _TokenParser | None = None
    for where, obj in _records(path):
        if parser is None:
            fmt = fmt or _detect(obj, where)
            parser = _MooncakeParser(path.name, path.stem) if fmt is TraceFormat.MOONCAKE else _TokenParser(path.name)
        try:
            request = parser.parse(obj, where.line)
        except TraceError as exc:
            if exc.line is not None:
                raise
            raise where.fail(exc.field, exc.problem) from None  # raised by a segment or request: add the place
        yield request
    if parser is None:
        raise TraceError("file is empty (no requests)", file=path.name)


def load_trace(path: str | PathLike[str], format: TraceFormat | str | None = None) -> list[TraceRequest]:
    """All requests of ``path`` as a list (see :func:`iter_trace` for the contract)."""
    return list(iter_trace(path, format))


def _segment_record(seg: Segment, position: int, request_id: str) -> dict[str, Any]:
    if isinstance(seg, SharedSegment):
        return {"shared": seg.name, "length": seg.length}
    if isinstance(seg, HashBlockSegment):
        return {"hash_blocks": list(seg.hash_ids), "length": seg.length}
    if isinstance(seg, UniqueSegment) and seg.owner == request_id and seg.index == position:
        return {"unique": seg.length}
    return {"tokens": seg.token_ids().tolist()}  # anything else is written out explicitly


def _request_record(req: TraceRequest, written: dict[str, TraceRequest]) -> dict[str, Any]:
    own, follows = req.segments, None
    prev = written.get(req.follows) if req.follows is not None else None
    if prev is not None:
        k = len(prev.segments)
        if req.segments[:k] == prev.segments and req.segments[k : k + 1] == (prev.output_segment(),):
            own, follows = req.segments[k + 1 :], prev.request_id
    record: dict[str, Any] = {"id": req.request_id, "arrival_ms": req.arrival_ms}
    for key, value in (("cache_salt", req.cache_salt), ("lora_name", req.lora_name), ("follows", follows)):
        if value is not None:
            record[key] = value
    record["prompt_length"] = req.prompt_length
    record["output_length"] = req.output_length
    if req.outputs is not None:
        record["output_token_ids"] = req.outputs.token_ids().tolist()
    record["segments"] = [_segment_record(s, i, req.request_id) for i, s in enumerate(own)]
    return record


def write_trace(requests: Iterable[TraceRequest], path: str | PathLike[str]) -> int:
    """Write ``requests`` to ``path`` in the token-level format; return how many.

    Compact segments stay compact. A request whose ``follows`` names a request
    written earlier to the same file is written as that turn plus its new
    segments; otherwise its whole prompt is written out (``follows`` dropped).
    Unique and output segments that cannot be expressed on their line are
    written as explicit tokens. Reading the file back with :func:`load_trace`
    yields requests with the same tokens. O(total segments) time, plus the
    explicit tokens written.
    """
    written: dict[str, TraceRequest] = {}
    with Path(path).open("w", encoding="utf-8") as f:
        for req in requests:
            if req.request_id in written:
                raise TraceError(f"repeats request id {req.request_id!r}", field="id")
            f.write(json.dumps(_request_record(req, written), separators=(",", ":")) + "\n")
            written[req.request_id] = req
    return len(written)
