"""ServerMetrics follows an engine's counters by their increments (a stand-in engine; no model)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from kvpool.errors import ConfigError
from kvpool.serve.metrics import ServerMetrics, check_prefix
from kvpool.stats import PrefixCacheStats


def _engine(queries: int, hits: int, preemptions: int, by_tier: dict[str, int]) -> Any:
    scheduler = SimpleNamespace(
        num_running=2, num_waiting=1, num_preemptions=preemptions, running_ids=lambda: [], waiting_ids=lambda: []
    )
    manager = SimpleNamespace(usage=0.25, prefix_cache_stats=PrefixCacheStats(queries=queries, hits=hits))
    return SimpleNamespace(scheduler=scheduler, manager=manager, cached_tokens_by_tier=by_tier)


def _value(metrics: ServerMetrics, sample: str) -> float:
    for line in metrics.render()[0].decode().splitlines():
        if line.startswith(sample + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no sample {sample}")


def test_counters_follow_the_engine_by_increments() -> None:
    metrics = ServerMetrics("m")
    metrics.after_step(_engine(100, 40, 1, {"gpu": 40}), [])
    metrics.after_step(_engine(150, 70, 3, {"gpu": 48, "cpu": 22}), [])
    assert _value(metrics, 'kvpool:prefix_cache_queries_total{model_name="m"}') == 150
    assert _value(metrics, 'kvpool:prefix_cache_hits_total{model_name="m"}') == 70
    assert _value(metrics, 'kvpool:num_preemptions_total{model_name="m"}') == 3
    assert _value(metrics, 'kvpool:prefix_cache_hits_by_tier_total{model_name="m",tier="gpu"}') == 48
    assert _value(metrics, 'kvpool:prefix_cache_hits_by_tier_total{model_name="m",tier="cpu"}') == 22
    assert _value(metrics, 'kvpool:num_requests_running{model_name="m"}') == 2
    assert _value(metrics, 'kvpool:kv_cache_usage_perc{model_name="m"}') == 0.25


@pytest.mark.parametrize("prefix", ["", "9x:", "vllm-", "kv pool:"])
def test_bad_prefixes_are_refused(prefix: str) -> None:
    with pytest.raises(ConfigError, match="metrics prefix"):
        check_prefix(prefix)
    assert check_prefix("vllm:") == "vllm:"
