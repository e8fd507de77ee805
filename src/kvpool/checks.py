"""The one integer rule: a count or size argument is an ``int`` (never a ``bool``) at or above a minimum.

Every public entry point that takes a count or a size asks :func:`check_int`,
so each such argument is refused the same way, with a
:class:`~kvpool.errors.ConfigError` naming the argument and the value::

    check_int("block_size", 0)            # block_size must be a positive integer, got 0
    check_int("num_blocks", 1, minimum=2) # num_blocks must be an integer >= 2, got 1

:data:`MIN_MODEL_LEN` is the one minimum of ``max_model_len`` wherever a
request generates: a prompt token plus one generated token.
"""

from __future__ import annotations

from kvpool.errors import ConfigError

__all__ = ["MIN_MODEL_LEN", "check_int"]

#: Shortest ``max_model_len`` a serving loop accepts: one prompt token and one output token.
MIN_MODEL_LEN = 2


def check_int(name: str, value: object, *, minimum: int = 1) -> int:
    """``value`` when it is an ``int`` (not a ``bool``) of at least ``minimum``; ConfigError naming both otherwise."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        bound = {0: "a non-negative integer", 1: "a positive integer"}.get(minimum, f"an integer >= {minimum}")
        raise ConfigError(f"{name} must be {bound}, got {value!r}")
    return value
