"""The simulator predicts the engine's tier hits: same requests, same pool, same tiers, same tokens per tier.

The engine runs a tiny model with a CPU tier (and a disk tier); the simulator
replays the same prompts with the engine's output tokens, through the same
scheduler and the same tier connector with a worker that only keeps time. The
tokens each tier served must be equal, for both write policies.

The outputs matter: the engine decodes greedily, so a repeated prompt gets the
same output tokens and the blocks holding them the same hashes, which the CPU
tier already holds; outputs derived from the request ID would be new keys that
take host blocks and push another prefix down to disk (under write-back, where
every evicted block goes down, that moves one 16-token prefix of this sequence
from the CPU tier to disk).
"""

from __future__ import annotations

import pytest

from kvpool.cost_model import default_profile
from kvpool.engine.llm_engine import LLMEngine
from kvpool.sim.simulator import SimulationConfig, simulate
from kvpool.sim.traces import TokenSegment, TraceRequest
from kvpool.tiers import WritePolicy, parse_specs
from tests.engine.test_tiers import BLOCK, BLOCK_BYTES, PARAMS, TIERS_AS_TESTED, TINY_POOL
from tests.engine.tiny_models import build_model, random_prompt, save_model

pytestmark = [pytest.mark.engine, pytest.mark.slow]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_model(build_model("llama"), tmp_path_factory.mktemp("llama"))


def request_sequence() -> list[list[int]]:
    """Five 30-token prompts, then the same again in another order, then prompts sharing their first 16 tokens."""
    base = [random_prompt(30, 700 + i) for i in range(5)]
    shared = [base[0][:16] + random_prompt(14, 800 + i) for i in range(3)]
    return base + [base[i] for i in (3, 0, 4, 1, 2)] + shared + base[:2]


@pytest.mark.parametrize("write", list(WritePolicy), ids=lambda w: w.value)
def test_the_simulator_serves_from_each_tier_what_the_engine_does(folder, tmp_path, write):
    specs = [f"cpu:{24 * BLOCK_BYTES}", f"disk:{tmp_path}:1MiB"]  # 24 host blocks: the CPU tier evicts too
    # Every hit loads (the simulator's cost model is not this machine's), and each request's saves
    # are written before the next arrives, as the trace's arrivals far apart replay them.
    engine = LLMEngine(folder, **TINY_POOL, kv_tiers=specs, kv_tier_write=write, **TIERS_AS_TESTED, log=None)
    prompts = request_sequence()
    outputs = []
    for prompt in prompts:
        rid = engine.add_request(prompt, PARAMS)
        outputs.append(engine.run_until_done([rid])[rid].output_token_ids)
        assert engine.kv_tiers.flush_saves(timeout=60)
    engine.kv_tiers.close()
    by_engine = engine.cached_tokens_by_tier

    trace = [
        TraceRequest.create(f"r{i}", 1e6 * i, (TokenSegment.of(prompt),), len(output), outputs=TokenSegment.of(output))
        for i, (prompt, output) in enumerate(zip(prompts, outputs, strict=True))
    ]
    config = SimulationConfig(
        num_blocks=engine.manager.pool.num_blocks,
        block_size=BLOCK,
        max_num_batched_tokens=TINY_POOL["max_num_batched_tokens"],
        max_num_seqs=TINY_POOL["max_num_seqs"],
        cost=default_profile().with_fields(kv_bytes_per_token=BLOCK_BYTES // BLOCK),
        tiers=parse_specs(specs),
        tier_write=write,
        load_or_compute=False,
    )
    predicted = simulate(trace, config).hit_tokens_by_tier
    assert predicted == {"gpu": 0, "cpu": 0, "disk": 0} | by_engine
    assert by_engine.get("cpu", 0) > 0 and by_engine.get("disk", 0) > 0 and by_engine.get("gpu", 0) > 0
    figures = engine.kv_tier_figures()
    assert sum(f["saved_blocks"] for f in figures.values()) > 0
