"""benchmarks/bench_route.py on a tiny index (its fleet part needs live replicas and is run by hand)."""

from __future__ import annotations

import sys
from pathlib import Path

from kvpool.router.index import MemoryIndex

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import bench_route  # noqa: E402


def test_the_index_bench_finds_the_whole_prompt_on_its_replica_only() -> None:
    result = bench_route.bench_index(MemoryIndex(), replicas=3, blocks=300, prompt_blocks=40, repeats=3)
    assert result["found"] == 40 and result["median_us"] > 0


def test_the_fleet_conversations_are_distinct_from_their_first_block() -> None:
    prompts = [bench_route._system(run, i)["content"] for run in range(2) for i in range(5)]
    assert len({p[:16] for p in prompts}) == len(prompts)
