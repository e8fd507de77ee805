"""Worked examples in docs/*.md, checked against the code."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from kvpool import KVCacheManager, Request
from kvpool.model_config import load_model_config
from kvpool.planner import GiB, plan_kv_cache
from kvpool.specs import LayerKind, MambaSpec
from tests.group_helpers import full, sliding, step

DOCS = Path(__file__).resolve().parents[1] / "docs"
HYBRID = (DOCS / "hybrid.md").read_text()
PLANNER = (DOCS / "planner.md").read_text()


def test_hybrid_sliding_window_diagram():
    """Window 4, 2-token blocks, 7 tokens computed: table [0, 0, b2, b3]; b1 then b0 released."""
    assert "table     [ 0   |   0  |  b2  |  b3 ]      b1, b0 released, in that order" in HYBRID
    mgr = KVCacheManager(16, 2, groups=[sliding(4, bs=2)])
    a = Request("a", list(range(9)))
    assert step(mgr, a, 7) == ([1, 2, 3, 4],)
    b0, b1, b2, b3 = 1, 2, 3, 4
    assert step(mgr, a, 1) == ([],)  # the step from 7 computed tokens; token 7 goes in block 3
    assert mgr.get_block_ids("a") == ([0, 0, b2, b3],)
    assert mgr.free_queue_block_ids()[-2:] == [b1, b0]  # cached: to the back, b1 evicted first


def test_hybrid_common_hit_example():
    """Full attention finds 10 blocks; the 8-token window group lost blocks 8 and 9: 32 tokens."""
    claim = "run of two ends at block 7: 32 tokens; full attention is trimmed to 8 blocks."
    assert claim in " ".join(HYBRID.split())
    mgr = KVCacheManager(64, 4, groups=[full(4, 0), sliding(8, 4, 1)])
    tokens = list(range(40))
    a = Request("a", [*tokens, 99])
    assert step(mgr, a, a.num_tokens) is not None
    window_blocks = mgr.get_block_ids("a")[1]
    mgr.free(a)
    assert len(mgr.get_computed_blocks(Request("x", [*tokens, 7]))[0].block_ids[0]) == 10
    for k in (8, 9):
        mgr.pool._evict(mgr.pool.block(window_blocks[k]))  # the window group loses blocks 8 and 9
    hit, num_hit = mgr.get_computed_blocks(Request("b", [*tokens, 7]))
    full_ids, window_ids = hit.block_ids
    assert num_hit == 32 and len(full_ids) == 8
    assert window_ids == [0] * 6 + window_blocks[6:8]


def test_hybrid_says_what_prefix_cacheable_is():
    assert MambaSpec.prefix_cacheable
    assert "`MambaSpec.prefix_cacheable` is True" in " ".join(HYBRID.split())


def _planner_commands() -> list[list[str]]:
    (block,) = re.findall(r"^```bash\n(kvpool plan.*?)^```", PLANNER, re.M | re.S)
    return [shlex.split(line) for line in block.splitlines()]


def test_planner_doc_commands_run():
    pytest.importorskip("click")
    from click.testing import CliRunner

    from kvpool.cli.commands import cli

    commands = _planner_commands()
    assert len(commands) == 3
    for words in commands:
        assert words[:2] == ["kvpool", "plan"]
        result = CliRunner().invoke(cli, words[1:])
        assert result.exit_code == 0, (words, result.output)


def test_planner_doc_llama_numbers():
    """2 x 16 x 8 x 128 x 2 B pages, 32 layers, a 40 GiB budget: 20,480 blocks, 327,680 tokens, 2.50x."""
    line = "KV cache size: 327,680 tokens; maximum concurrency for 131,072 tokens per request: 2.50x"
    assert line in PLANNER
    plan = plan_kv_cache(
        load_model_config("llama-3.1-8b"),
        gpu_memory_bytes=40 * GiB,
        gpu_memory_utilization=1,
        weights_bytes=0,
        activation_bytes=0,
        other_overhead_bytes=0,
    )
    assert plan.groups[0].page_bytes == 65_536 and plan.pool_block_bytes == 2 * 2**20
    assert (plan.num_blocks, plan.blocks_per_request) == (20_480, 8_192)
    assert plan.capacity_line == line


def test_planner_doc_gemma_and_jamba_figures():
    """Gemma 3 12B: 6 groups of 8 layers, 65 blocks per 1,024-token window. Jamba: 16 -> 80 tokens, 2 state blocks."""
    gemma = plan_kv_cache(load_model_config("gemma-3-12b"), gpu_memory_bytes="80GB", weights_bytes=0)
    assert (len(gemma.groups), gemma.layers_per_block) == (6, 8)
    assert {g.blocks_per_request for g in gemma.groups if g.kind is LayerKind.SLIDING_WINDOW} == {65}
    jamba = plan_kv_cache(load_model_config("jamba-mini-1.6"), gpu_memory_bytes="80GB", weights_bytes=0)
    assert (jamba.requested_block_size, jamba.block_size) == (16, 80)
    assert {g.blocks_per_request for g in jamba.groups if g.kind is LayerKind.MAMBA} == {2}
    assert "Jamba: 16 ->\n80 tokens" in PLANNER or "Jamba: 16 -> 80 tokens" in PLANNER
