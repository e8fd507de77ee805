"""A short run of benchmarks/bench_hostile_tenants.py: a hostile tenant costs honest tenants nothing they can see."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import bench_hostile_tenants  # noqa: E402
from bench_timing_leak import serving  # noqa: E402


@pytest.mark.slow
def test_honest_tenants_keep_their_answers_prefixes_and_blocks(tmp_path: Path) -> None:
    keys = bench_hostile_tenants.write_keys(tmp_path, 2)
    with serving(bench_hostile_tenants.server_flags(keys), threads=1) as server:
        attack = bench_hostile_tenants.Attack(
            hogs=1, near_bound=1
        )  # every kind, fewer at once: the checks, not the load
        result = bench_hostile_tenants.run(server.url, honest=2, rounds=2, questions=2, max_tokens=8, attack=attack)
    assert result["honest_failures"] == []
    assert result["honest_answers"] == 2 * 2 * 2 * 2  # tenants x questions x phases x rounds
    assert result["honest_answers_differing"] == []  # token for token what the quiet phases answered
    assert result["honest_prefix_lost"] == []  # the hostile tenant evicted and reset no honest prefix
    assert result["hostile_server_errors"] == {}  # every hostile request was served or refused with a 4xx
    sent = {key.rsplit(": ", 1)[0] for key in result["hostile_statuses"]}
    assert {label for label, _ in bench_hostile_tenants._bodies()} | {"dropped stream"} <= sent
    assert result["blocks_owned_after"] == 0 and result["invariants_after"] == "ok"
