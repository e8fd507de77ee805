"""One reader and one minimum for every secret file: the tenant secret and the KV tier secret agree."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpool.errors import ConfigError
from kvpool.secret_files import (
    MAX_KEY_FILE_BYTES,
    MIN_SECRET_BYTES,
    check_secret,
    make_secret_command,
    read_key_file,
    read_secret_file,
)
from kvpool.tenancy import SaltPolicy, load_secret
from kvpool.tiers import EntryCodec
from tests.tiers.conftest import LAYOUT

GOOD = b"k" * MIN_SECRET_BYTES


def tier_secret(path: Path) -> bytes:
    """What the engine reads for ``kv_tier_secret_file`` (engine.kv_transfer.build_kv_tiers), then signs with."""
    secret = read_secret_file(path, purpose="KV tier secret")
    EntryCodec(LAYOUT, secret)
    return secret


def tenant_secret(path: Path) -> bytes:
    secret, generated = load_secret(path)
    assert not generated
    SaltPolicy.isolated(secret)
    return secret


@pytest.mark.parametrize("reader", [tier_secret, tenant_secret], ids=["tier", "tenant"])
def test_both_callers_take_the_same_file_the_same_way(reader, tmp_path):
    path = tmp_path / "secret"
    path.write_bytes(GOOD + b" \n")
    assert reader(path) == GOOD  # trailing whitespace (the newline) is not part of the secret
    path.write_bytes(b"  " + GOOD)
    assert reader(path) == b"  " + GOOD  # leading bytes are


@pytest.mark.parametrize("reader", [tier_secret, tenant_secret], ids=["tier", "tenant"])
@pytest.mark.parametrize("content", [b"", b"\n", b"x", b"x" * (MIN_SECRET_BYTES - 1) + b"\n"])
def test_both_callers_refuse_a_short_secret_naming_the_file(reader, content, tmp_path):
    path = tmp_path / "short"
    path.write_bytes(content)
    with pytest.raises(ConfigError, match=f"{str(path)!r} holds .* bytes; it needs at least {MIN_SECRET_BYTES}"):
        reader(path)


@pytest.mark.parametrize("reader", [tier_secret, tenant_secret], ids=["tier", "tenant"])
def test_both_callers_name_a_missing_file(reader, tmp_path):
    with pytest.raises(ConfigError, match="cannot read the .* file .*nowhere"):
        reader(tmp_path / "nowhere")


@pytest.mark.parametrize("reader", [tier_secret, tenant_secret], ids=["tier", "tenant"])
@pytest.mark.parametrize("content", [None, b"short\n"], ids=["missing", "short"])
def test_the_error_gives_a_command_that_makes_a_good_secret_file(reader, content, tmp_path):
    path = tmp_path / "my secret"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(ConfigError, match="make one with: ") as info:
        reader(path)
    command = re.search(r"make one with: (.*)$", str(info.value)).group(1)
    assert command == make_secret_command(path)
    path.unlink(missing_ok=True)
    subprocess.run(["bash", "-ec", command], check=True, timeout=60)  # as a reader would paste it
    secret = reader(path)
    assert len(secret) >= MIN_SECRET_BYTES


def test_every_secret_file_made_so_is_new(tmp_path):
    made = []
    for name in ("a", "b"):
        subprocess.run(["bash", "-ec", make_secret_command(tmp_path / name)], check=True, timeout=60)
        made.append(read_secret_file(tmp_path / name, purpose="tenant secret"))
    assert made[0] != made[1] and len(made[0]) == 64  # 32 random bytes, in hex


def test_secrets_given_as_bytes_keep_the_same_minimum():
    short = b"x" * (MIN_SECRET_BYTES - 1)
    for build in (lambda s: EntryCodec(LAYOUT, s), SaltPolicy.isolated, lambda s: check_secret(s, purpose="x")):
        with pytest.raises(ConfigError, match=f"at least {MIN_SECRET_BYTES}"):
            build(short)
        build(GOOD)
    with pytest.raises(ConfigError, match="must be bytes, got str"):
        check_secret("k" * 32, purpose="KV tier secret")


# -- what is at the path: a regular file, read without blocking, bounded -------------------------


@contextlib.contextmanager
def fifo_with_a_writer(path: Path, data: bytes) -> Iterator[Path]:
    """A FIFO at ``path`` whose writer, once a reader opens it, writes ``data``: a reader that waits gets it.

    On leaving, the FIFO is opened for reading here (without blocking), which releases a writer
    still waiting for a reader, and the writer is joined.
    """
    os.mkfifo(path)

    def write() -> None:
        with open(path, "wb") as f:  # blocks until someone opens the FIFO for reading
            with contextlib.suppress(BrokenPipeError):
                f.write(data)

    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    try:
        yield path
    finally:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        writer.join()
        os.close(fd)


@pytest.mark.parametrize("reader", [tier_secret, tenant_secret], ids=["tier", "tenant"])
def test_a_fifo_is_refused_at_once_not_waited_on(reader, tmp_path):
    with fifo_with_a_writer(tmp_path / "secret", GOOD + b"\n") as path:
        with pytest.raises(ConfigError, match=f"{str(path)!r} is a FIFO, not a regular file"):
            reader(path)


@pytest.mark.parametrize("reader", [tier_secret, tenant_secret], ids=["tier", "tenant"])
def test_a_device_or_a_directory_is_refused_naming_it(reader, tmp_path):
    with pytest.raises(ConfigError, match="'/dev/null' is a character device, not a regular file"):
        reader(Path("/dev/null"))
    with pytest.raises(ConfigError, match=f"{str(tmp_path)!r} is a directory, not a regular file"):
        reader(tmp_path)


@pytest.mark.parametrize("reader", [tier_secret, tenant_secret], ids=["tier", "tenant"])
def test_a_huge_file_is_refused_after_a_bounded_read(reader, tmp_path):
    path = tmp_path / "huge"
    path.write_bytes(b"k" * (MAX_KEY_FILE_BYTES + 1))
    with pytest.raises(ConfigError, match=f"{str(path)!r} holds more than {MAX_KEY_FILE_BYTES} bytes"):
        reader(path)


def test_a_link_to_a_regular_file_is_followed(tmp_path):
    (tmp_path / "real").write_bytes(GOOD)
    (tmp_path / "link").symlink_to(tmp_path / "real")  # how mounted secrets often appear
    assert read_key_file(tmp_path / "link", purpose="KV tier secret") == GOOD
