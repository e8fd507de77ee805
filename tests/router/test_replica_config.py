"""The router's replicas from its flags and config file (router.replica_config: replica_specs, replicas_isolate_tenants)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvpool.errors import ConfigError
from kvpool.router.replica_config import ReplicaSpec, replica_specs, replicas_isolate_tenants


def test_the_flags_replicas_come_first_then_the_files(tmp_path: Path) -> None:
    (tmp_path / "r.toml").write_text('[[replica]]\nurl = "http://10.0.0.3:8000"\nevents = "none"\n')
    specs = replica_specs(["http://10.0.0.1:8000", "http://10.0.0.2:8000,events=none"], tmp_path / "r.toml")
    assert [spec.url for spec in specs] == ["http://10.0.0.1:8000", "http://10.0.0.2:8000", "http://10.0.0.3:8000"]
    assert [spec.discover for spec in specs] == [True, False, False]


def test_no_replica_is_refused_saying_how_to_name_one(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no replica: name one with --replica URL"):
        replica_specs([])
    (tmp_path / "empty.toml").write_text("")
    with pytest.raises(ConfigError, match="no replica"):
        replica_specs([], tmp_path / "empty.toml")


@pytest.mark.parametrize(
    ("first", "second"),
    [
        ("http://10.0.0.1:8000", "http://10.0.0.1:8000"),
        ("http://10.0.0.1", "http://10.0.0.1:80"),  # the scheme's default port
        ("http://Replica.example:8000", "http://replica.example:8000"),  # the host in any case
    ],
)
def test_a_replica_named_twice_is_refused_naming_it(first: str, second: str) -> None:
    with pytest.raises(ConfigError, match="is named twice"):
        replica_specs([first, second])


def test_a_replica_in_the_flags_and_the_file_is_named_twice(tmp_path: Path) -> None:
    (tmp_path / "r.toml").write_text('[[replica]]\nurl = "http://10.0.0.1:8000"\n')
    with pytest.raises(ConfigError, match="is named twice"):
        replica_specs(["http://10.0.0.1:8000"], tmp_path / "r.toml")


def test_different_ports_are_different_replicas() -> None:
    assert len(replica_specs(["http://10.0.0.1:8000", "http://10.0.0.1:8001", "https://10.0.0.1:8000"])) == 3


KVPOOL = ReplicaSpec(url="http://10.0.0.1:8000")
VLLM = ReplicaSpec(url="http://10.0.0.2:8000", discover=False)


@pytest.mark.parametrize(
    ("specs", "no_isolation", "files", "isolated"),
    [
        ([KVPOOL], False, False, True),  # a kvpool replica isolates tenants by default
        ([KVPOOL, VLLM], False, False, True),
        ([VLLM], False, False, False),  # vLLM salts by the request's own cache_salt
        ([VLLM], False, True, True),  # a tenant secret or key file says the replicas isolate
        ([KVPOOL], True, True, False),  # --no-tenant-isolation wins
        ([VLLM], True, False, False),
    ],
)
def test_whether_the_replicas_isolate_tenants(
    specs: list[ReplicaSpec], no_isolation: bool, files: bool, isolated: bool
) -> None:
    assert replicas_isolate_tenants(specs, no_tenant_isolation=no_isolation, tenant_files_given=files) is isolated
