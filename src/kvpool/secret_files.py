"""Secrets: the one way kvpool reads a secret from a file, and the one rule a secret keeps.

A secret keys a MAC: a server's tenant salts (:mod:`kvpool.tenancy`, HMAC-SHA256) and the
signatures of KV tier entries (:mod:`kvpool.tiers.entry`, AES-256-GMAC, keyed BLAKE3 or
HMAC-SHA256). Both follow one rule:

* a file's secret is its bytes with trailing whitespace (a final newline) removed;
* a secret holds at least :data:`MIN_SECRET_BYTES` bytes. All three MACs take any
  length (GMAC and BLAKE3 through a derived key), but a short secret can be guessed offline from one signed value.

Every key or secret file (these and the CURVE key files of :mod:`kvpool.kv_events.transport`) is
read by :func:`read_key_file`: only a regular file (a link to one is followed), opened without
blocking (a FIFO or a device at the path never hangs start-up) and read up to a bound.

Errors are :class:`~kvpool.errors.ConfigError` naming the file (never the secret); a secret file's
errors also say how to make one (:func:`make_secret_command`).
"""

from __future__ import annotations

import os
import shlex
import stat

from kvpool.errors import ConfigError

__all__ = [
    "MAX_KEY_FILE_BYTES",
    "MIN_SECRET_BYTES",
    "check_secret",
    "make_secret_command",
    "read_key_file",
    "read_secret_file",
]

#: The shortest secret accepted, in bytes (16 bytes is the floor of guessing; HMAC-SHA256's block is 64).
MIN_SECRET_BYTES = 16

#: The largest key or secret file read, in bytes: far above any secret or certificate, far below harm.
MAX_KEY_FILE_BYTES = 64 * 1024

_OPEN_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC

_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def read_key_file(path: str | os.PathLike[str], *, purpose: str, limit: int = MAX_KEY_FILE_BYTES) -> bytes:
    """The bytes of the regular file at ``path``, at most ``limit`` of them; nothing else is read.

    The file is opened with ``O_NONBLOCK`` and checked with ``fstat`` on the open descriptor, so
    a FIFO, a device, a socket or a directory at the path is refused at once (never waited on),
    and a file longer than ``limit`` is refused after reading ``limit + 1`` bytes at most.

    Raises:
        ConfigError: naming ``purpose`` and the file, and what is wrong with it.
    """
    source = os.fspath(path)
    try:
        fd = os.open(source, _OPEN_FLAGS)
    except OSError as exc:
        raise ConfigError(f"cannot read the {purpose} file {source!r}: {exc.strerror or exc}") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = next((name for test, name in _KINDS if test(mode)), "of another kind")
            raise ConfigError(f"the {purpose} file {source!r} is {kind}, not a regular file")
        chunks: list[bytes] = []
        left = limit + 1
        while left > 0:
            chunk = os.read(fd, left)
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
    except OSError as exc:
        raise ConfigError(f"cannot read the {purpose} file {source!r}: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if len(data) > limit:
        raise ConfigError(f"the {purpose} file {source!r} holds more than {limit} bytes; a key file is far smaller")
    return data


def check_secret(secret: object, *, purpose: str) -> bytes:
    """``secret`` if it is bytes of at least :data:`MIN_SECRET_BYTES`; ConfigError naming ``purpose`` and its length."""
    if not isinstance(secret, bytes):
        raise ConfigError(f"the {purpose} must be bytes, got {type(secret).__name__}")
    if len(secret) < MIN_SECRET_BYTES:
        raise ConfigError(f"the {purpose} holds {len(secret)} bytes; it needs at least {MIN_SECRET_BYTES}")
    return secret


def make_secret_command(path: str | os.PathLike[str]) -> str:
    """A shell command that writes a good secret (32 random bytes, in hex) to the file at ``path``."""
    return f'python -c "import secrets; print(secrets.token_hex(32))" > {shlex.quote(os.fspath(path))}'


def read_secret_file(path: str | os.PathLike[str], *, purpose: str) -> bytes:
    """The secret in the file at ``path`` (trailing whitespace removed), checked by :func:`check_secret`.

    ``purpose`` names the secret in errors, e.g. ``"tenant secret"`` or ``"KV tier secret"``; every
    error also gives the command that makes a good secret file (:func:`make_secret_command`).
    """
    source = os.fspath(path)
    make = f"make one with: {make_secret_command(source)}"
    try:
        secret = read_key_file(source, purpose=purpose).rstrip()
    except ConfigError as exc:
        raise ConfigError(f"{exc}; {make}") from None
    if len(secret) < MIN_SECRET_BYTES:
        raise ConfigError(
            f"the {purpose} file {source!r} holds {len(secret)} bytes; it needs at least {MIN_SECRET_BYTES}; {make}"
        )
    return secret
