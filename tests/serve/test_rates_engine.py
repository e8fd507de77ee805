"""kvpool's engine's rates (``GET /rates``): none before a prefill, then measured, with the CPU tier's load rate."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("torch")

from kvpool.engine.llm_engine import LLMEngine  # noqa: E402
from kvpool.engine.sampling import SamplingParams  # noqa: E402
from tests.engine.tiny_models import build_model, random_prompt, save_model  # noqa: E402

BLOCK = 4
BLOCK_BYTES = 2 * 2 * BLOCK * 2 * 16 * 4  # layers x (K, V) x tokens x KV heads x head dim x float32


def test_rates_are_none_before_a_prefill_then_measured_with_the_tiers_load_rate(tmp_path: Path) -> None:
    folder = save_model(build_model("llama"), tmp_path / "llama")
    engine = LLMEngine(
        folder, block_size=BLOCK, kv_cache_memory=17 * BLOCK_BYTES, max_model_len=64, max_num_batched_tokens=64,
        max_num_seqs=8, kv_tiers=["cpu:1MiB"], threads=1, log=None,
    )  # fmt: skip
    assert engine.rates() is None
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    for _ in range(2):  # the second round finds the first's prompts in the CPU tier (the pool is small)
        for i in range(4):
            rid = engine.add_request(random_prompt(30, 100 + i), params)
            engine.run_until_done([rid])
    rates = engine.rates()
    assert rates is not None and rates.source == "measured"
    assert rates.prefill_tokens_per_s > 0 and rates.decode_step_s > 0
    assert engine.cached_tokens_by_tier["cpu"] > 0  # the second round loaded from the CPU tier
    assert engine.kv_tiers is not None and engine.kv_tiers.chooser is not None
    bandwidth = engine.kv_tiers.chooser.figures()["tiers"]["cpu"]["load_bandwidth_bytes_per_s"]
    bytes_per_token = engine.setup.plan.pool_block_bytes / BLOCK
    assert dict(rates.tier_load_tokens_per_s) == {"CPU": pytest.approx(bandwidth / bytes_per_token)}
