"""The rules of every count and size argument.

A count or size argument is an ``int`` (never a ``bool``) at or above a minimum;
a memory size may also be written with a unit (:func:`parse_size`); a switch
is ``True`` or ``False`` and nothing else (:func:`check_flag`).

Every public entry point that takes a count or a size asks :func:`check_int`,
so each such argument is refused the same way, with a
:class:`~kvpool.errors.ConfigError` naming the argument and the value::

    check_int("block_size", 0)            # block_size must be a positive integer, got 0
    check_int("num_blocks", 1, minimum=2) # num_blocks must be an integer >= 2, got 1

The compiled build (mypyc) checks a typed argument itself, before the
function body runs: it raises its own ``TypeError`` and reads ``True`` as
``1``. So a public entry point of a compiled module takes such an argument as
``object`` and asks these checks, which run before the typed code sees the
value and decide exactly as in the pure build.

:data:`MIN_MODEL_LEN` is the one minimum of ``max_model_len`` wherever a
request generates: a prompt token plus one generated token.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from fractions import Fraction

from kvpool.errors import ConfigError

__all__ = [
    "DEFAULT_THREADS",
    "GB",
    "KB",
    "MB",
    "MIN_MODEL_LEN",
    "TB",
    "THREADS_AUTO",
    "GiB",
    "KiB",
    "MiB",
    "TiB",
    "check_flag",
    "check_int",
    "counted",
    "format_bytes",
    "parse_size",
    "parse_threads",
    "parse_token_count",
]

#: Shortest ``max_model_len`` a serving loop accepts: one prompt token and one output token.
MIN_MODEL_LEN = 2


def check_int(name: str, value: object, *, minimum: int = 1) -> int:
    """``value`` when it is an ``int`` (not a ``bool``) of at least ``minimum``; ConfigError naming both otherwise."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        bound = {0: "a non-negative integer", 1: "a positive integer"}.get(minimum, f"an integer >= {minimum}")
        raise ConfigError(f"{name} must be {bound}, got {value!r}")
    return value


def check_flag(name: str, value: object) -> bool:
    """``value`` when it is ``True`` or ``False``; ConfigError naming both otherwise (1, None and "yes" are not flags)."""
    if type(value) is not bool:
        raise ConfigError(f"{name} must be True or False, got {value!r}")
    return value


KB, MB, GB, TB = 10**3, 10**6, 10**9, 10**12
KiB, MiB, GiB, TiB = 2**10, 2**20, 2**30, 2**40

_UNITS = {"": 1, "b": 1, "kb": KB, "mb": MB, "gb": GB, "tb": TB, "kib": KiB, "mib": MiB, "gib": GiB, "tib": TiB}
_SIZE_RE = re.compile(r"^\s*([0-9][0-9_]*(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int, *, field: str = "size") -> int:
    """Parse a memory size into bytes.

    ``"80GB"`` is 80 * 10**9 bytes, ``"80GiB"`` is 80 * 2**30; KB/MB/TB and
    KiB/MiB/TiB likewise, ``B`` or no unit means bytes; units ignore case and
    fractional values are allowed (``"74.5GiB"``), rounded down to whole bytes.
    A bare ``G``/``M``/``K``/``T`` is rejected as ambiguous. Raises
    :class:`ConfigError` naming ``field`` and the text for malformed or
    negative input.
    """
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 0:
            raise ConfigError(f"{field} must not be negative, got {text}")
        return text
    if not isinstance(text, str):
        raise ConfigError(f"{field} must be a size such as '80GB' or '80GiB', got {text!r}")
    if text.strip().startswith("-"):
        raise ConfigError(f"{field} must not be negative, got {text!r}")
    match = _SIZE_RE.match(text)
    if match is None:
        raise ConfigError(
            f"{field} {text!r} is not a size; write e.g. 80GB (10^9 bytes), 80GiB (2^30) or 1000000 (bytes)"
        )
    number, unit = match.groups()
    unit = unit.lower()
    if unit in ("k", "m", "g", "t"):
        raise ConfigError(
            f"{field} {text!r} has an ambiguous unit {match.group(2)!r}: write {unit.upper()}B "
            f"(powers of 10) or {unit.upper()}iB (powers of 2)"
        )
    if unit not in _UNITS:
        raise ConfigError(
            f"{field} {text!r} has an unknown unit {match.group(2)!r}; use B, KB, MB, GB, TB, KiB, MiB, GiB or TiB"
        )
    try:
        value = Fraction(Decimal(number.replace("_", "")))
    except InvalidOperation:
        raise ConfigError(f"{field} {text!r} is not a size") from None
    return int(value * _UNITS[unit])


_COUNT_RE = re.compile(r"([0-9]+(?:\.[0-9]+)?)([kKmMgGtT])")
_DECIMAL_SUFFIXES = {"k": KB, "m": MB, "g": GB, "t": TB}
_BINARY_SUFFIXES = {"K": KiB, "M": MiB, "G": GiB, "T": TiB}


def parse_token_count(text: str | int, *, field: str = "count", minimum: int = 1) -> int:
    """Parse a token count as vLLM reads ``--max-model-len``: ``"4096"``, or a number with a suffix.

    A lower-case suffix is a power of 10 and may follow a decimal (``"4k"`` is 4,000, ``"25.6k"``
    25,600, ``"1m"`` 1,000,000); an upper-case one a power of 2 and only after a whole number
    (``"4K"`` is 4,096, ``"1M"`` 1,048,576); ``g``/``G`` and ``t``/``T`` likewise. Raises
    :class:`ConfigError` naming ``field`` and the text for anything else or a count below ``minimum``.
    """
    if isinstance(text, int) and not isinstance(text, bool):
        return check_int(field, text, minimum=minimum)
    if not isinstance(text, str):
        raise ConfigError(f"{field} must be a token count such as 4096, 4k or 4K, got {text!r}")
    given = text.strip()
    match = _COUNT_RE.fullmatch(given)
    if match is None:
        if not given.isascii() or not given.isdigit():
            raise ConfigError(
                f"{field} {text!r} is not a token count; write e.g. 4096, 4k (4,000), 25.6k or 4K (4,096)"
            )
        count = int(given)
    else:
        number, suffix = match.groups()
        if suffix in _BINARY_SUFFIXES:
            if "." in number:
                raise ConfigError(
                    f"{field} {text!r}: a decimal does not go with the binary suffix {suffix!r}; "
                    f"did you mean {number}{suffix.lower()}?"
                )
            count = int(number) * _BINARY_SUFFIXES[suffix]
        else:
            count = int(Fraction(Decimal(number)) * _DECIMAL_SUFFIXES[suffix])
    if count < minimum:
        raise ConfigError(f"{field} must be at least {minimum}, got {text!r}")
    return count


def counted(count: int, noun: str, nouns: str | None = None) -> str:
    """``count`` and its noun as a message writes them: ``"1 tenant"``, ``"2 tenants"``, ``"0 tenants"``.

    ``nouns`` is the plural when it is not ``noun`` + ``"s"``.
    """
    return f"{count} {noun if count == 1 else (nouns or noun + 's')}"


def format_bytes(n: int) -> str:
    """``1536`` -> ``'1.50 KiB'`` (binary units): how sizes read in kvpool's logs."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


#: ``threads="auto"``: a CPU step's threads follow the cores other processes leave free
#: (:mod:`kvpool.engine.threads`).
THREADS_AUTO = "auto"

#: The engine's ``threads`` when none is given (``EngineOptions``, ``LLM()``, ``--threads``).
DEFAULT_THREADS = THREADS_AUTO


def parse_threads(value: object) -> int | str | None:
    """``None`` (leave torch's setting), ``"auto"``, or a thread count >= 1; anything else is refused.

    Raises:
        ConfigError: naming the value.
    """
    if value is None or value == THREADS_AUTO:
        return value  # type: ignore[return-value]  # None or the string "auto"
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"threads must be an int >= 1, 'auto' or None, got {value!r}")
    return value
