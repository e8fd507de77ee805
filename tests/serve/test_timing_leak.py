"""A short run of benchmarks/bench_timing_leak.py: tenant salts close the channel, shared caches leak."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import bench_timing_leak  # noqa: E402


def test_roc_auc_and_curve() -> None:
    Trial = bench_timing_leak.Trial
    separated = [Trial(True, 0.1, 0), Trial(True, 0.2, 0), Trial(False, 0.3, 0), Trial(False, 0.4, 0)]
    assert bench_timing_leak.roc_auc(separated) == 1.0
    assert bench_timing_leak.roc_curve(separated) == ([0.0, 0.0, 0.0, 0.5, 1.0], [0.0, 0.5, 1.0, 1.0, 1.0])
    mixed = [Trial(True, 0.1, 0), Trial(False, 0.2, 0), Trial(True, 0.3, 0), Trial(False, 0.3, 0)]
    assert bench_timing_leak.roc_auc(mixed) == pytest.approx((1 + 1 + 0 + 0.5) / 4)


@pytest.mark.slow
def test_tenant_salts_close_the_timing_channel() -> None:
    # 6 positive and 6 negative trials: with no signal, an AUC >= 0.95 has a chance of 2 in 924
    results = bench_timing_leak.measure(
        trials=12, prompt_tokens=192, seed=1, extra_args=["--kv-cache-memory", "64MiB"], progress=False
    )
    isolated, shared = results["tenant salts"], results["no tenant isolation"]
    assert all(t.cached_tokens == 0 for t in isolated)  # no hit on the victim's blocks, so none reported
    assert bench_timing_leak.roc_auc(isolated) < 0.95
    assert all(t.cached_tokens >= 176 for t in shared if t.positive)  # the victim's blocks, found and reported
    assert bench_timing_leak.roc_auc(shared) > 0.75
