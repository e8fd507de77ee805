"""Every per-kind fact of a tier lives in its backend's registry line, and the drivers read it there."""

from __future__ import annotations

from kvpool.integrations.vllm.plan import ConnectorOptions
from kvpool.tiers import TierKind
from kvpool.tiers.store import BACKENDS


def test_every_kind_has_one_backend_with_every_fact() -> None:
    assert set(BACKENDS) == set(TierKind)
    for kind, backend in BACKENDS.items():
        assert backend.kind is kind
        bandwidth, latency = backend.link
        assert bandwidth > 0 and latency >= 0, kind
        assert backend.vllm_hit_source in {"HOST", "DISK", "EXTERNAL_UNSPECIFIED"}, kind
        # a tier another process can write, or that outlives this one, is a store; host memory is neither
        assert (backend.open is None) == (not backend.outlives_process), kind


def test_the_facts_as_written() -> None:
    cpu, disk, redis = (BACKENDS[k] for k in (TierKind.CPU, TierKind.DISK, TierKind.REDIS))
    assert (cpu.shared, cpu.outlives_process, cpu.fleet_wide) == (False, False, False)
    assert (disk.shared, disk.outlives_process, disk.fleet_wide) == (True, True, False)
    assert (redis.shared, redis.outlives_process, redis.fleet_wide) == (True, True, True)


def test_the_vllm_connector_names_the_weights_exactly_where_the_registry_says(tmp_path) -> None:
    host_only = ConnectorOptions.from_extra_config({"tiers": ["cpu:1GiB"]})
    assert not host_only.needs_weights
    disk = ConnectorOptions.from_extra_config({"tiers": ["cpu:1GiB", f"disk:{tmp_path}:1GiB"], "unauthenticated": True})
    assert disk.needs_weights
