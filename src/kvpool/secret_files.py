"""Secrets: the one way kvpool reads a secret from a file, and the one rule a secret keeps.

A secret keys an HMAC: a server's tenant salts (:mod:`kvpool.tenancy`) and the
signatures of KV tier entries (:mod:`kvpool.tiers.entry`). Both follow one rule:

* a file's secret is its bytes with trailing whitespace (a final newline) removed;
* a secret holds at least :data:`MIN_SECRET_BYTES` bytes. HMAC-SHA256 takes any
  length, but a short secret can be guessed offline from one signed value.

Errors are :class:`~kvpool.errors.ConfigError` naming the file (never the secret).
"""

from __future__ import annotations

import os

from kvpool.errors import ConfigError

__all__ = ["MIN_SECRET_BYTES", "check_secret", "read_secret_file"]

#: The shortest secret accepted, in bytes (16 bytes is the floor of guessing; HMAC-SHA256's block is 64).
MIN_SECRET_BYTES = 16


def check_secret(secret: object, *, purpose: str) -> bytes:
    """``secret`` if it is bytes of at least :data:`MIN_SECRET_BYTES`; ConfigError naming ``purpose`` and its length."""
    if not isinstance(secret, bytes):
        raise ConfigError(f"the {purpose} must be bytes, got {type(secret).__name__}")
    if len(secret) < MIN_SECRET_BYTES:
        raise ConfigError(f"the {purpose} holds {len(secret)} bytes; it needs at least {MIN_SECRET_BYTES}")
    return secret


def read_secret_file(path: str | os.PathLike[str], *, purpose: str) -> bytes:
    """The secret in the file at ``path`` (trailing whitespace removed), checked by :func:`check_secret`.

    ``purpose`` names the secret in errors, e.g. ``"tenant secret"`` or ``"KV tier secret"``.
    """
    source = os.fspath(path)
    try:
        with open(source, "rb") as f:
            secret = f.read().rstrip()
    except OSError as exc:
        raise ConfigError(f"cannot read the {purpose} file {source!r}: {exc.strerror or exc}") from None
    if len(secret) < MIN_SECRET_BYTES:
        raise ConfigError(
            f"the {purpose} file {source!r} holds {len(secret)} bytes; it needs at least {MIN_SECRET_BYTES}"
        )
    return secret
