"""One tier policy, two drivers: the engine's connector and the vLLM connector's planner find, load and save alike.

Each case is a table: which blocks of one prompt each tier holds, in the order the tiers are
looked up. Both adapters are driven over it from an empty GPU pool, one step that computes
the rest of the prompt, and must give the same tokens per tier, the same loads (tier and key
by block position) and the same saves (the tiers each position goes to, host placement
included). The first case is the drift the vLLM planner had: a CPU tier holding blocks 4-7
behind a Redis holding 0-3, where it found 64 tokens and the engine 128.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import pytest

from kvpool import KVCacheManager, Request
from kvpool.integrations.vllm.plan import TierPlanner, VllmScheduledChunk
from kvpool.tiers.hierarchy import TierHierarchyConnector
from kvpool.tiers.policy import ByteTier, HostTier, Placement, TierPolicy
from tests.integrations.test_vllm_plan import DictStore

BS = 16
HOST_BLOCKS = 16


@dataclass(frozen=True)
class Case:
    name: str
    blocks: int  # full blocks in the prompt (plus one token, so every block can be matched)
    holds: tuple[tuple[str, tuple[int, ...]], ...]  # (tier, positions it holds), in lookup order
    tokens: int  # tokens both must match
    host_blocks: int = HOST_BLOCKS


CASES = [
    Case("cpu after redis (the drift)", 8, (("cpu", (4, 5, 6, 7)), ("redis", (0, 1, 2, 3))), 8 * BS),
    Case("runs alternate between tiers", 6, (("cpu", (0, 1, 4)), ("disk", (2, 3)), ("redis", (5,))), 6 * BS),
    Case("a lower tier first, then the cpu tier", 5, (("cpu", (2, 3)), ("disk", (0, 1, 2))), 4 * BS),
    Case("a gap ends the match", 6, (("disk", (0, 1, 2)), ("redis", (4, 5))), 3 * BS),
    Case("nothing held", 4, (("cpu", ()), ("redis", ())), 0),
    Case("every tier holds all", 4, (("cpu", (0, 1, 2, 3)), ("disk", (0, 1, 2, 3))), 4 * BS),
    Case("stores only", 5, (("disk", (1, 2)), ("redis", (0, 3))), 4 * BS),
    Case("a cpu tier too small for the saves", 6, (("cpu", ()), ("redis", (0, 1))), 2 * BS, host_blocks=2),
]


def tiers_for(case: Case, keys: Sequence[bytes]) -> list[HostTier | ByteTier]:
    tiers: list[HostTier | ByteTier] = []
    for name, positions in case.holds:
        if name == "cpu":
            host = HostTier(case.host_blocks)
            for pos in positions:
                slot = host.reserve(keys[pos])
                assert slot is not None
                host.release([slot])
            host.take_evicted()
            tiers.append(host)
        else:
            tiers.append(ByteTier(DictStore(name, [keys[pos] for pos in positions])))
    return tiers


def tokens_of(case: Case) -> list[int]:
    return list(range(1000, 1000 + case.blocks * BS + 1))


def drive_engine(case: Case) -> tuple[dict[str, int], list[tuple[int, str, bytes]], list[tuple[int, tuple[str, ...]]]]:
    mgr = KVCacheManager(64, BS)
    request = Request("r", tokens_of(case))
    hit, local = mgr.get_computed_blocks(request)
    assert local == 0
    keys = [bytes(h) for h in request.block_hashes]
    conn = TierHierarchyConnector(mgr, tiers_for(case, keys))
    match = conn.get_num_new_matched_tokens(request, 0)
    external = match.num_tokens
    assert mgr.allocate_slots(request, request.num_tokens - external, 0, hit, external) is not None
    table = mgr.get_block_ids("r")[0]
    conn.update_state_after_alloc(request, table, 0, match)
    request.num_computed_tokens = request.num_tokens
    meta = conn.build_meta([(request, request.num_tokens)])
    by_tier: dict[str, int] = {}
    for run in match.runs:
        by_tier[run.tier] = by_tier.get(run.tier, 0) + run.num_tokens
    position = {block_id: pos for pos, block_id in enumerate(table)}
    loads = [(position[load.block_id], load.tier, load.key) for load in meta.loads]
    saves = sorted((position[save.block_id], save.tiers) for save in meta.saves)
    return by_tier, loads, saves


@dataclass
class VllmRequest:
    request_id: str
    num_tokens: int
    block_hashes: list[bytes]


def drive_vllm(case: Case) -> tuple[dict[str, int], list[tuple[int, str, bytes]], list[tuple[int, tuple[str, ...]]]]:
    request = Request("r", tokens_of(case))
    KVCacheManager(64, BS).get_computed_blocks(request)  # the same chained keys the engine uses
    keys = [bytes(h) for h in request.block_hashes]
    planner = TierPlanner(tiers_for(case, keys), BS)
    vllm_request = VllmRequest("r", request.num_tokens, keys)
    planner.add(vllm_request)
    external = planner.match(vllm_request, 0)
    block_ids = list(range(200, 200 + case.blocks + 1))
    planner.allocated(vllm_request, block_ids, external)
    chunk = VllmScheduledChunk(
        request_id="r",
        block_ids=tuple(block_ids),
        replace=True,
        num_computed_tokens=external,
        num_scheduled_tokens=request.num_tokens - external,
    )
    plan = planner.build([chunk])
    position = {block_id: pos for pos, block_id in enumerate(block_ids)}
    loads = [(position[load.block_id], load.tier, load.key) for load in plan.loads]
    saves = sorted((position[save.block_id], save.tiers) for save in plan.saves)
    return planner.hit_tokens_by_tier("r"), loads, saves


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_both_drivers_find_load_and_save_alike(case: Case) -> None:
    engine_hits, engine_loads, engine_saves = drive_engine(case)
    vllm_hits, vllm_loads, vllm_saves = drive_vllm(case)
    assert sum(engine_hits.values()) == case.tokens
    assert vllm_hits == engine_hits
    assert vllm_loads == engine_loads
    assert vllm_saves == engine_saves
    # every block not loaded from a tier is sent down; a loaded one only to the tiers above its own
    loaded = {pos for pos, _tier, _key in engine_loads}
    assert {pos for pos, _ in engine_saves} <= set(range(case.blocks))
    assert all(pos in loaded or tiers for pos, tiers in engine_saves)


def test_the_drift_case_finds_every_block_in_the_vllm_planner() -> None:
    case = CASES[0]
    hits, loads, _ = drive_vllm(case)
    assert hits == {"redis": 4 * BS, "cpu": 4 * BS}
    assert [(pos, tier) for pos, tier, _ in loads] == [(i, "redis" if i < 4 else "cpu") for i in range(8)]


def test_a_placement_drains_what_the_cpu_tier_evicted() -> None:
    """Saves that evict host blocks hand the evicted keys back, so none pile up in the host pool's events."""
    host = HostTier(2)
    policy = TierPolicy([host, ByteTier(DictStore("redis", []))])
    placements = []
    for i in range(6):
        placement = policy.place(bytes([i]) * 32, ("cpu", "redis"))
        assert placement.host_slot is not None
        host.release([placement.host_slot])
        placements.append(placement)
    assert [p.evicted for p in placements[2:]] == [(bytes([i]) * 32,) for i in range(4)]
    assert host.pool.take_events() == []


def test_a_key_already_held_is_not_placed_on_the_cpu_tier_again() -> None:
    host = HostTier(4)
    policy = TierPolicy([host])
    first = policy.place(b"k" * 32, ("cpu",))
    assert first.tiers == ("cpu",) and first.host_slot is not None
    host.release([first.host_slot])
    assert policy.place(b"k" * 32, ("cpu",)) == Placement(())


def test_destinations_of_an_unknown_tier_are_refused_naming_it() -> None:
    policy = TierPolicy([HostTier(2), ByteTier(DictStore("redis", []))])
    assert policy.destinations(None) == ("cpu", "redis")
    assert policy.destinations("redis") == ("cpu",)
    assert policy.destinations("cpu") == ()
    with pytest.raises(ValueError, match="'disk'"):
        policy.destinations("disk")


def test_a_bad_placement_is_refused_naming_it_with_nothing_reserved() -> None:
    host = HostTier(2)
    policy = TierPolicy([host])
    for key, tiers, named in [(b"", ("cpu",), "b''"), ("k", ("cpu",), "'k'"), (b"k", ("disk",), "'disk'")]:
        with pytest.raises(ValueError, match=named):
            policy.place(key, tiers)  # type: ignore[arg-type]  # the wrong types are the point
    assert host.pool.num_free_blocks == 2 and host.num_stored == 0
