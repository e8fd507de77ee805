"""A replica spec's ``profile`` key: the rates the router weighs a server that answers no ``GET /rates`` by."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvpool.cost_model import CostProfile, load_profile
from kvpool.errors import ConfigError
from kvpool.replica_rates import ReplicaRates
from kvpool.router.replica_config import parse_replica

VLLM = "http://10.0.0.5:8000,events=tcp://10.0.0.5:5557,block-size=128,hash=sha256"


def test_a_described_replica_gets_its_profiles_rates() -> None:
    spec = parse_replica(VLLM + ",profile=llama-3.1-8b-h100")
    assert spec.rates == ReplicaRates.from_profile(load_profile("llama-3.1-8b-h100"))
    assert spec.rates is not None and spec.rates.source == "profile:llama-3.1-8b-h100"
    assert spec.events is not None and spec.events.block_size == 128


def test_a_profile_is_allowed_without_events_and_on_a_kvpool_replica() -> None:
    assert parse_replica("http://10.0.0.6:8000,events=none,profile=round-8b-h100").rates is not None
    kvpool = parse_replica("http://10.0.0.7:8000,profile=round-8b-h100")
    assert kvpool.discover and kvpool.rates is not None
    assert parse_replica("http://10.0.0.7:8000").rates is None


def test_a_calibrated_profile_file_is_read(tmp_path: Path) -> None:
    profile = CostProfile.flat(step_overhead_s=0.01, prefill_s_per_token=2e-4, decode_s_per_seq=0.003, name="mine")
    path = tmp_path / "calibrated.json"
    path.write_text(json.dumps(profile.to_dict()))
    spec = parse_replica(f"{VLLM},profile={path}")
    assert spec.rates is not None and spec.rates.prefill_tokens_per_s == pytest.approx(5000.0)
    assert spec.rates.source == "profile:mine"


def test_an_unknown_profile_is_refused_naming_the_replica_and_the_profile() -> None:
    with pytest.raises(ConfigError, match="replica http://10.0.0.5:8000: profile 'no-such-profile': .*neither"):
        parse_replica(VLLM + ",profile=no-such-profile")
    with pytest.raises(ConfigError, match="profile must name a cost profile"):
        parse_replica(VLLM + ",profile=")
