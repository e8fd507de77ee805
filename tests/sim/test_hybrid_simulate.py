"""kvpool simulate over a hybrid model's layer groups (--layer-groups) with a tier, window-aware saves on and off."""

from __future__ import annotations

import pytest

from kvpool import ConfigError
from kvpool.sim.options import SimulateOptions
from kvpool.sim.study import load_requests, run_study

GEMMA = {"model": "gemma-3-12b", "kv_memory": "4GiB", "tier": ("cpu:32GiB",), "requests": 80, "load_or_compute": False}


def replay(**overrides):
    options = SimulateOptions(trace="synthetic:shared_prefix", layer_groups=True, **{**GEMMA, **overrides})
    report = run_study(options, load_requests(options))
    (result,) = report.results.values()
    return options, result


def test_a_hybrid_model_replays_its_groups_and_window_aware_saves_cost_hits():
    options, aware = replay(window_aware_saves=True)
    assert [g.kind.value for g in options.groups] == ["sliding_window"] * 5 + ["full_attention"]
    assert options.block_hash != "xxh3_128"  # window groups search hits from the end: no verifying index
    _, every = replay()  # the default saves every full window block
    assert aware.prompt_tokens == every.prompt_tokens
    # Saving every window block saves more bytes and finds more tokens in the tier (prefixes shared up to a
    # point before the last window of the request that computed them).
    assert every.tier_save_seconds > aware.tier_save_seconds
    assert every.hit_tokens_by_tier.get("cpu", 0) > aware.hit_tokens_by_tier.get("cpu", 0) > 0


def test_layer_groups_need_a_model_and_refuse_groups_tiers_cannot_serve():
    with pytest.raises(ConfigError, match="--layer-groups .* give --model"):
        SimulateOptions(trace="synthetic:shared_prefix", kv_blocks=64, layer_groups=True)
    with pytest.raises(ConfigError, match=r"groups blocks of \[400\] tokens at --block-size 16"):
        SimulateOptions(
            trace="synthetic:shared_prefix", model="granite-4.0-h-tiny", kv_memory="8GiB", layer_groups=True
        )
    options = SimulateOptions(
        trace="synthetic:shared_prefix",
        model="granite-4.0-h-tiny",  # Mamba states raise its blocks to 400 tokens
        block_size=400,
        kv_memory="8GiB",
        layer_groups=True,
        tier=("cpu:32GiB",),
        requests=4,
    )
    with pytest.raises(ConfigError, match="group 0 is mamba"):
        run_study(options, load_requests(options))
