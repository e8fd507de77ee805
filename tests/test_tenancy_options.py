"""The tenant options as a server and the router read them (kvpool.tenancy: SaltPolicy.from_options, KeyRing.from_options)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvpool.errors import ConfigError
from kvpool.tenancy import DEFAULT_TENANT, MIN_SECRET_BYTES, KeyRing, SaltPolicy, SecretSource

SECRET = b"s" * MIN_SECRET_BYTES


def test_isolation_off_shares_the_cache_and_never_reads_the_secret_file(tmp_path: Path) -> None:
    salts, source = SaltPolicy.from_options(isolate=False, secret_file=tmp_path / "absent")
    assert source is SecretSource.NONE and not salts.isolates_tenants
    assert salts.cache_salt("alice", "c") == "c" and salts.cache_salt("alice", None) is None


def test_isolation_with_a_secret_file_derives_the_salts_every_holder_of_the_file_derives(tmp_path: Path) -> None:
    (tmp_path / "secret").write_bytes(SECRET + b"\n")
    salts, source = SaltPolicy.from_options(isolate=True, secret_file=tmp_path / "secret")
    assert source is SecretSource.FILE and salts.isolates_tenants
    again, _ = SaltPolicy.from_options(isolate=True, secret_file=str(tmp_path / "secret"))
    assert (
        salts.cache_salt("alice", None)
        == again.cache_salt("alice", None)
        == SaltPolicy.isolated(SECRET).cache_salt("alice", None)
    )


def test_isolation_without_a_file_generates_a_secret_no_other_process_shares() -> None:
    one, source = SaltPolicy.from_options(isolate=True, secret_file=None)
    two, _ = SaltPolicy.from_options(isolate=True, secret_file=None)
    assert source is SecretSource.GENERATED and one.isolates_tenants
    assert one.cache_salt("alice", None) != two.cache_salt("alice", None)


def test_a_short_secret_file_is_refused_with_its_size(tmp_path: Path) -> None:
    (tmp_path / "short").write_text("tiny")
    with pytest.raises(ConfigError, match="at least 16"):
        SaltPolicy.from_options(isolate=True, secret_file=tmp_path / "short")


def test_no_key_file_and_no_key_is_one_tenant_without_keys() -> None:
    assert KeyRing.from_options(None, ()) is None


def test_single_keys_name_the_default_tenant(tmp_path: Path) -> None:
    ring = KeyRing.from_options(None, ("k1", "k2"))
    assert ring is not None and ring.name_for("k1") == ring.name_for("k2") == DEFAULT_TENANT and len(ring) == 2


def test_single_keys_join_the_key_file_tenants(tmp_path: Path) -> None:
    (tmp_path / "keys.json").write_text(json.dumps({"ka": "alice", "kd": DEFAULT_TENANT}))
    ring = KeyRing.from_options(tmp_path / "keys.json", ("kd", "k1"))
    assert ring is not None and ring.names == {"alice", DEFAULT_TENANT}
    assert (ring.name_for("ka"), ring.name_for("kd"), ring.name_for("k1")) == ("alice", DEFAULT_TENANT, DEFAULT_TENANT)
    only_file = KeyRing.from_options(tmp_path / "keys.json")
    assert only_file is not None and only_file.name_for("k1") is None


def test_a_single_key_that_is_another_tenants_key_is_refused_naming_the_tenant(tmp_path: Path) -> None:
    (tmp_path / "keys.json").write_text(json.dumps({"k1": "alice"}))
    with pytest.raises(ConfigError, match="also a key of tenant 'alice'"):
        KeyRing.from_options(tmp_path / "keys.json", ("k1",))
