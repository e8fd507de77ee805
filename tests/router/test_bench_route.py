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


import route_workload  # noqa: E402


def test_the_phases_share_system_prompts_within_a_phase_only() -> None:
    prompts = {(tag, s): route_workload.system_prompt(tag, s) for tag in ("r0p0", "r0p1", "r1p0") for s in range(3)}
    assert len({p[:12] for p in prompts.values()}) == len(prompts)  # distinct from the first block on


def test_a_phase_runs_every_turn_concurrently_and_wipes_once_between_turns() -> None:
    from kvpool.router import RouteOptions, Router
    from kvpool.tenancy import SaltPolicy
    from tests.router.fakes import ByteTokenizer, FakeReplica, RouterThread, wait_for

    salts = SaltPolicy.isolated(b"s" * 32)
    replica = FakeReplica("r0", salts).start()
    options = RouteOptions(replicas=(replica.url,), tokenizer=ByteTokenizer(), keys=None, salts=salts)
    router = RouterThread(Router(options, MemoryIndex()))
    served_at_wipe: list[int] = []
    try:
        wait_for(lambda: all(r.up for r in router.router.replicas), "the replica up")
        result = route_workload.run_phase(
            f"http://127.0.0.1:{router.port}", "fake", "t", conversations=3, turns=3, system_prompts=2,
            max_tokens=4, wipe_after=2, on_wipe=lambda: served_at_wipe.append(replica.served),
        )  # fmt: skip
    finally:
        router.stop()
        replica.kill()
    assert served_at_wipe == [6]  # once, when all three conversations had sent two turns and none the third
    assert result.requests == 9 and result.failed == 0 and len(result.ttft) == 9
    assert 0 < result.cached < result.prompt  # follow-ups found their history cached
    summary = route_workload.summary([result])
    assert summary["cached_share"] == result.cached / result.prompt and summary["throughput"] > 0
