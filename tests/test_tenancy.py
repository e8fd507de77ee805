"""Tenants' keys and the cache salts a server derives for them (kvpool.tenancy)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvpool import KVCacheManager, Request
from kvpool.errors import ConfigError
from kvpool.tenancy import DEFAULT_TENANT, MIN_SECRET_BYTES, KeyRing, SaltPolicy, bearer_token, load_secret

SECRET = b"s" * MIN_SECRET_BYTES


@pytest.mark.parametrize(
    ("header", "key"),
    [
        ("Bearer sk-1", "sk-1"),
        ("bearer   sk-1 ", "sk-1"),
        (None, None),
        ("", None),
        ("Bearer", None),
        ("Bearer ", None),
        ("Basic sk-1", None),
    ],
)
def test_bearer_token(header: str | None, key: str | None) -> None:
    assert bearer_token(header) == key


def test_key_ring_names_only_its_keys(tmp_path: Path) -> None:
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"sk-a": "alice", "sk-a2": "alice", "sk-b": "bob"}))
    ring = KeyRing.load_json(path)
    assert ring.name_for("sk-a") == ring.name_for("sk-a2") == "alice"
    assert ring.name_for("sk-b") == "bob"
    assert ring.name_for("sk-c") is None and ring.name_for(None) is None and ring.name_for("sk-a ") is None
    assert ring.names == {"alice", "bob"} and len(ring) == 3
    assert "sk-a" not in repr(ring)  # keys are held as digests, never shown


@pytest.mark.parametrize(
    ("content", "words"),
    [
        ("{", "not JSON"),
        ("[]", "must map API keys"),
        ("{}", "names no API key"),
        ('{"": "alice"}', "non-empty string"),
        ('{" sk": "alice"}', "surrounding spaces"),
        ('{"sk": ""}', "tenant of a key"),
        ('{"sk": 3}', "tenant of a key"),
    ],
)
def test_bad_key_files_are_refused_by_name(tmp_path: Path, content: str, words: str) -> None:
    path = tmp_path / "keys.json"
    path.write_text(content)
    with pytest.raises(ConfigError, match=words) as info:
        KeyRing.load_json(path)
    assert str(path) in str(info.value)
    with pytest.raises(ConfigError, match="cannot read"):
        KeyRing.load_json(tmp_path / "missing.json")


def test_admin_keys_one_a_line(tmp_path: Path) -> None:
    path = tmp_path / "admin"
    path.write_text("\nadmin-1\n  admin-2  \n\n")
    ring = KeyRing.load_lines(path, "admin")
    assert ring.name_for("admin-1") == ring.name_for("admin-2") == "admin"
    path.write_text("\n\n")
    with pytest.raises(ConfigError, match="names no API key"):
        KeyRing.load_lines(path, "admin")


def test_secrets_from_a_file_or_generated(tmp_path: Path) -> None:
    path = tmp_path / "secret"
    path.write_bytes(SECRET + b"\n")
    assert load_secret(path) == (SECRET, False)
    path.write_bytes(b"short\n")
    with pytest.raises(ConfigError, match=f"at least {MIN_SECRET_BYTES}"):
        load_secret(path)
    first, generated = load_secret(None)
    assert generated and len(first) >= MIN_SECRET_BYTES and load_secret(None)[0] != first


def test_isolated_salts_depend_on_tenant_secret_and_client_salt() -> None:
    policy = SaltPolicy.isolated(SECRET)
    alice = policy.cache_salt("alice", None)
    assert alice == policy.cache_salt("alice", None)  # stable: the tenant keeps its cache
    assert alice != policy.cache_salt("bob", None)
    assert alice != SaltPolicy.isolated(SECRET + b"x").cache_salt("alice", None)  # the secret keys it
    team = policy.cache_salt("alice", "team")
    assert team not in (alice, policy.cache_salt("bob", "team"), "team")  # folded under the tenant
    # a client cannot reach another tenant's salt by sending it as its own cache_salt
    assert policy.cache_salt("bob", alice) != alice
    # framing: moving text between the tenant name and the client salt changes the salt
    assert policy.cache_salt("ab", "c") != policy.cache_salt("a", "bc")
    assert policy.isolates_tenants and not SaltPolicy.shared().isolates_tenants


def test_shared_salts_pass_the_clients_value_through() -> None:
    shared = SaltPolicy.shared()
    assert shared.cache_salt("alice", None) is None and shared.cache_salt("bob", "x") == "x"
    assert shared.tenant_salt(DEFAULT_TENANT) is None


def test_bad_policy_input_is_refused() -> None:
    with pytest.raises(ConfigError, match="at least"):
        SaltPolicy.isolated(b"short")
    policy = SaltPolicy.isolated(SECRET)
    with pytest.raises(ConfigError, match="tenant"):
        policy.cache_salt("", None)
    with pytest.raises(ConfigError, match="cache_salt"):
        policy.cache_salt("alice", 3)  # type: ignore[arg-type]  # the wrong type, on purpose


def test_tenants_never_share_blocks_through_derived_salts() -> None:
    """The derived salts do what they are for: the manager finds no block across tenants."""
    policy = SaltPolicy.isolated(SECRET)
    mgr = KVCacheManager(num_blocks=16, block_size=4)
    prompt = list(range(1, 14))
    first = Request("a1", prompt, cache_salt=policy.cache_salt("alice", None))
    hit, n = mgr.get_computed_blocks(first)
    mgr.allocate_slots(first, first.num_tokens - n, n, hit)
    first.num_computed_tokens = first.num_tokens
    mgr.free(first)
    again = Request("a2", prompt, cache_salt=policy.cache_salt("alice", None))
    assert mgr.get_computed_blocks(again)[1] == 12
    for tenant, client in (("bob", None), ("bob", policy.cache_salt("alice", None)), ("alice", "team")):
        other = Request("b", prompt, cache_salt=policy.cache_salt(tenant, client))
        assert mgr.get_computed_blocks(other)[1] == 0


def test_a_key_file_may_weigh_its_tenants_in_the_fair_share(tmp_path) -> None:
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"sk-a": "alice", "sk-b": {"tenant": "bob", "weight": 3}, "sk-b2": {"tenant": "bob"}}))
    ring = KeyRing.load_json(path)
    assert ring.name_for("sk-b") == ring.name_for("sk-b2") == "bob"
    assert dict(ring.weights) == {"bob": 3.0}


@pytest.mark.parametrize(
    "value",
    [
        {"tenant": "bob", "weight": 0},
        {"tenant": "bob", "weight": -2},
        {"tenant": "bob", "weight": True},
        {"tenant": "bob", "weight": "2"},
        {"tenant": "bob", "weight": 1e9},
        {"tenant": "bob", "weigth": 2},
        {"weight": 2},
        {"tenant": 7},
    ],
)
def test_bad_weights_in_a_key_file_are_refused_by_name(value) -> None:
    with pytest.raises(ConfigError, match="tenant|weight"):
        KeyRing.from_mapping({"sk-b": value})


def test_one_tenant_with_two_weights_is_refused() -> None:
    with pytest.raises(ConfigError, match="two weights"):
        KeyRing.from_mapping({"sk-1": {"tenant": "bob", "weight": 1}, "sk-2": {"tenant": "bob", "weight": 2}})
    ring = KeyRing.from_mapping({"sk-1": {"tenant": "bob", "weight": 1}})
    with pytest.raises(ConfigError, match="two weights"):
        ring.merged(KeyRing.from_mapping({"sk-2": {"tenant": "bob", "weight": 2}}))
    assert ring.merged(KeyRing.from_mapping({"sk-3": "carol"})).name_for("sk-3") == "carol"
