"""One reader and one minimum for every secret file: the tenant secret and the KV tier secret agree."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvpool.errors import ConfigError
from kvpool.secret_files import MIN_SECRET_BYTES, check_secret, read_secret_file
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


def test_secrets_given_as_bytes_keep_the_same_minimum():
    short = b"x" * (MIN_SECRET_BYTES - 1)
    for build in (lambda s: EntryCodec(LAYOUT, s), SaltPolicy.isolated, lambda s: check_secret(s, purpose="x")):
        with pytest.raises(ConfigError, match=f"at least {MIN_SECRET_BYTES}"):
            build(short)
        build(GOOD)
    with pytest.raises(ConfigError, match="must be bytes, got str"):
        check_secret("k" * 32, purpose="KV tier secret")
