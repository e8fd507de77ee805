"""KV connectors in the core: the manager's loaded tokens, the scheduler's hooks, the tier hierarchy's bookkeeping."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool import ConfigError, KVCacheManager, Request, RequestStateError
from kvpool.connector import (
    NO_MATCH,
    ConnectorMetadata,
    ExternalMatch,
    KVConnector,
    TierRun,
    TransferResult,
)
from kvpool.events import BlockRemoved, BlockStored
from kvpool.scheduler import Scheduler, SchedulerConfig, StopConditions
from kvpool.tiers.hierarchy import ByteTier, HostTier, TierHierarchyConnector
from kvpool.tiers.kinds import WritePolicy

BS = 4


def prompt(n: int, base: int = 100) -> list[int]:
    return list(range(base, base + n))


# -- the manager ------------------------------------------------------------------------------


def test_loaded_tokens_get_new_blocks_count_as_computed_and_are_cached():
    mgr = KVCacheManager(16, BS)
    a = Request("a", prompt(14))
    hit, n = mgr.get_computed_blocks(a)
    assert n == 0
    new = mgr.allocate_slots(a, 2, n, hit, num_external_computed_tokens=12)
    assert new is not None and len(new[0]) == 4  # 12 loaded + 2 new tokens: 4 blocks
    a.num_computed_tokens = 12  # what the scheduler records: loaded tokens are computed
    mgr.check_invariants()
    # Three loaded blocks are in the prefix cache at once, like computed ones.
    b = Request("b", prompt(14))
    _, n = mgr.get_computed_blocks(b)
    assert n == 12


def test_loaded_tokens_follow_a_local_hit():
    mgr = KVCacheManager(16, BS)
    a = Request("a", prompt(9))
    hit, n = mgr.get_computed_blocks(a)
    mgr.allocate_slots(a, 9, n, hit)
    a.num_computed_tokens = 9
    mgr.free(a)
    b = Request("b", prompt(17))
    hit, n = mgr.get_computed_blocks(b)
    assert n == 8
    new = mgr.allocate_slots(b, 1, n, hit, num_external_computed_tokens=8)
    assert new is not None and len(new[0]) == 3  # blocks 2 and 3 loaded, block 4 for the last token
    assert mgr.get_block_ids("b")[0][:2] == hit.block_ids[0]
    b.num_computed_tokens = 16
    mgr.check_invariants()


BAD_EXTERNAL = [
    (-4, "non-negative int"),
    (4.0, "non-negative int"),
    (True, "non-negative int"),
    ("4", "non-negative int"),
    (16, "exceed its 14 tokens"),
]


@pytest.mark.parametrize(("value", "message"), BAD_EXTERNAL)
def test_bad_external_tokens_are_refused_with_nothing_changed(value, message):
    mgr = KVCacheManager(16, BS)
    a = Request("a", prompt(14))
    hit, n = mgr.get_computed_blocks(a)
    before = mgr.free_queue_block_ids()
    with pytest.raises(RequestStateError, match=message):
        mgr.allocate_slots(a, 2, n, hit, num_external_computed_tokens=value)
    assert mgr.free_queue_block_ids() == before and mgr.running_request_ids() == []
    mgr.check_invariants()


def test_a_running_request_takes_no_loaded_tokens():
    mgr = KVCacheManager(16, BS)
    a = Request("a", prompt(6))
    hit, n = mgr.get_computed_blocks(a)
    mgr.allocate_slots(a, 6, n, hit)
    a.num_computed_tokens = 6
    a.append_output_token_ids(1)
    with pytest.raises(RequestStateError, match="first allocation"):
        mgr.allocate_slots(a, 1, num_external_computed_tokens=4)
    assert mgr.allocate_slots(a, 1) == ([],)


def test_a_refused_allocation_with_loaded_tokens_takes_nothing():
    mgr = KVCacheManager(6, BS)  # 5 usable blocks
    other = Request("other", prompt(8, base=7))
    hit, n = mgr.get_computed_blocks(other)
    mgr.allocate_slots(other, 8, n, hit)
    a = Request("a", prompt(17))
    hit, n = mgr.get_computed_blocks(a)
    assert mgr.allocate_slots(a, 1, n, hit, num_external_computed_tokens=16) is None
    assert mgr.running_request_ids() == ["other"] and mgr.num_free_blocks == 3


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(1, 30), st.integers(0, 7), st.integers(0, 3), st.booleans()),
        min_size=1,
        max_size=25,
    )
)
def test_invariants_hold_under_loaded_admissions(ops):
    """Random admissions with local hits, loaded blocks and new tokens, and frees: the bookkeeping stays whole."""
    mgr = KVCacheManager(24, BS)
    live: dict[str, Request] = {}
    for i, (length, loaded_blocks, family, free_one) in enumerate(ops):
        req = Request(f"r{i}", prompt(length, base=1000 * family))
        hit, n = mgr.get_computed_blocks(req)
        loaded = min(loaded_blocks * BS, (length - 1 - n) // BS * BS)
        todo = length - n - loaded
        if mgr.allocate_slots(req, todo, n, hit, num_external_computed_tokens=loaded) is not None:
            req.num_computed_tokens = length
            live[req.request_id] = req
        mgr.check_invariants()
        if free_one and live:
            mgr.free(live.pop(next(iter(live))))
            mgr.check_invariants()
    for req in live.values():
        mgr.free(req)
    mgr.check_invariants()
    assert mgr.num_free_blocks == 23


# -- the scheduler with a scripted connector ----------------------------------------------------


class ScriptedConnector:
    """Offers ``offer`` tokens to every request; saves pend until ``finish_saves``."""

    def __init__(self, offer: int = 0, tier: str = "remote", hold_saves: bool = False) -> None:
        self.offer = offer
        self.tier = tier
        self.hold_saves = hold_saves
        self.allocs: list[tuple[str, list[int], int, int]] = []
        self.metas: list[ConnectorMetadata] = []
        self.reports: list[TransferResult] = []
        self.finished: list[str] = []

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> ExternalMatch:
        room = (request.num_tokens - 1 - num_computed_tokens) // BS * BS
        n = min(self.offer, room)
        return ExternalMatch((TierRun(self.tier, n),)) if n else NO_MATCH

    def update_state_after_alloc(
        self, request: Request, block_ids: Sequence[int], num_local_tokens: int, match: ExternalMatch
    ) -> None:
        self.allocs.append((request.request_id, list(block_ids), num_local_tokens, match.num_tokens))

    def build_meta(self, scheduled: Sequence[tuple[Request, int]]) -> ConnectorMetadata:
        meta = ConnectorMetadata()
        self.metas.append(meta)
        return meta

    def update_finished(self, result: TransferResult) -> None:
        self.reports.append(result)

    def request_finished(self, request: Request, block_ids: Sequence[int]) -> bool:
        self.finished.append(request.request_id)
        return self.hold_saves


def make_scheduler(connector, num_blocks=32, **config):
    mgr = KVCacheManager(num_blocks, BS)
    return Scheduler(mgr, SchedulerConfig(**config), connector=connector)


def test_the_scripted_connector_satisfies_the_protocol():
    assert isinstance(ScriptedConnector(), KVConnector)
    with pytest.raises(ConfigError, match="KVConnector"):
        Scheduler(KVCacheManager(8, BS), connector=object())  # type: ignore[arg-type]  # the point of the test


def test_loaded_tokens_are_not_computed_and_are_counted_by_tier():
    conn = ScriptedConnector(offer=8)
    sched = make_scheduler(conn)
    sched.add_request(Request("a", prompt(11)), StopConditions(max_tokens=1))
    out = sched.schedule()
    (chunk,) = out.chunks
    assert (chunk.start_position, chunk.num_tokens, chunk.num_cached_tokens) == (8, 3, 8)
    assert out.connector_meta is conn.metas[0]
    [(rid, table, local, loaded)] = conn.allocs
    assert (rid, len(table), local, loaded) == ("a", 3, 0, 8)
    finished = sched.update(out, {"a": 5})
    assert finished[0].cached_tokens_by_tier == {"gpu": 0, "remote": 8}
    assert finished[0].num_cached_tokens == 8 and finished[0].num_computed_tokens == 3
    assert sched.cached_tokens_by_tier == {"gpu": 0, "remote": 8}
    sched.manager.check_invariants()


def test_a_failed_load_is_computed_in_the_same_step():
    conn = ScriptedConnector(offer=12)
    sched = make_scheduler(conn, max_num_batched_tokens=8)
    sched.add_request(Request("a", prompt(15)), StopConditions(max_tokens=1))
    out = sched.schedule()
    assert [(c.start_position, c.num_tokens) for c in out.chunks] == [(12, 3)]
    # The worker got the first block only: 4 tokens are in place.
    revised = sched.apply_transfers(out, TransferResult(finished_loads=frozenset({"a"}), failed_loads={"a": 4}))
    (chunk,) = revised.chunks
    assert (chunk.start_position, chunk.num_tokens, chunk.sample) == (4, 11, True)
    assert chunk.token_ids == tuple(prompt(15)[4:])
    assert chunk.slot_mapping[0][0] == chunk.block_tables[0][1] * BS  # position 4: block 1, offset 0
    assert revised.num_batched_tokens == 11
    assert conn.reports[-1].failed_loads == {"a": 4}
    with pytest.raises(RequestStateError, match="not issued"):
        sched.update(out, {"a": 1})  # the superseded plan is refused
    (metrics,) = sched.update(revised, {"a": 1})
    assert metrics.num_cached_tokens == 4 and metrics.num_computed_tokens == 11
    assert metrics.cached_tokens_by_tier == {"gpu": 0, "remote": 4}
    sched.manager.check_invariants()


def test_a_failure_report_outside_the_promised_tokens_is_refused():
    sched = make_scheduler(ScriptedConnector(offer=8))
    sched.add_request(Request("a", prompt(11)), StopConditions(max_tokens=1))
    out = sched.schedule()
    for bad in (8, -1, 9, "4"):
        with pytest.raises(RequestStateError, match="failed load"):
            sched.apply_transfers(out, TransferResult(failed_loads={"a": bad}))


def test_finished_requests_keep_their_blocks_until_their_saves_are_done():
    conn = ScriptedConnector(hold_saves=True)
    sched = make_scheduler(conn, num_blocks=8)
    sched.add_request(Request("a", prompt(8)), StopConditions(max_tokens=1))
    out = sched.schedule()
    sched.update(out, {"a": 3})
    assert conn.finished == ["a"] and sched.num_saving == 1
    assert sched.manager.get_block_ids("a") != ([],)
    assert sched.manager.num_free_blocks == 5  # 7 usable, 2 held for the pending save
    out = sched.schedule()  # nothing to run; the saves are still pending
    sched.apply_transfers(out, TransferResult(finished_saves=frozenset({"a"})))
    assert sched.num_saving == 0 and sched.manager.num_free_blocks == 7
    sched.update(out, {})
    sched.manager.check_invariants()


def test_a_connector_that_breaks_its_contract_is_named():
    sched = make_scheduler(ScriptedConnector(offer=3))  # not a whole block
    sched.add_request(Request("a", prompt(11)), StopConditions(max_tokens=1))
    with pytest.raises(ConfigError, match="whole blocks"):
        sched.schedule()


# -- the tier hierarchy --------------------------------------------------------------------------


class DictStore:
    """An in-memory byte store with the BlockStore lookup; ``broken`` makes every call raise."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.data: dict[bytes, bytes] = {}
        self.broken = False

    def contains_prefix(self, keys: Sequence[bytes]) -> int:
        if self.broken:
            raise ConnectionError("down")
        n = 0
        for key in keys:
            if key not in self.data:
                break
            n += 1
        return n


def hierarchy(num_blocks=32, host_blocks=8, stores=("disk",)):
    mgr = KVCacheManager(num_blocks, BS)
    host = HostTier(host_blocks)
    byte_stores = [DictStore(name) for name in stores]
    conn = TierHierarchyConnector(mgr, [host, *(ByteTier(s) for s in byte_stores)])
    return Scheduler(mgr, SchedulerConfig(), connector=conn), conn, host, byte_stores


def run_one(sched: Scheduler, req: Request, done: TransferResult | None = None):
    sched.add_request(req, StopConditions(max_tokens=1))
    out = sched.schedule()
    rid = req.request_id
    report = done or TransferResult(finished_loads=frozenset({rid}), finished_saves=frozenset({rid}))
    out = sched.apply_transfers(out, report)
    (metrics,) = sched.update(out, {rid: 1})
    sched.forget(rid)
    return out, metrics


def test_computed_blocks_are_saved_to_every_tier_once():
    sched, conn, host, (disk,) = hierarchy()
    out, _ = run_one(sched, Request("a", prompt(10)))
    meta = out.connector_meta
    assert meta is not None and meta.loads == ()
    assert [(s.tiers, s.host_slot is not None) for s in meta.saves] == [(("cpu", "disk"), True)] * 2
    assert host.num_stored == 2 and host.pool.num_free_blocks == 8  # stored, and unpinned
    assert conn.counters["disk"].saved_blocks == 2


def test_lookup_takes_each_block_from_the_first_tier_that_holds_it():
    sched, conn, host, (disk,) = hierarchy()
    req = Request("x", prompt(21))
    sched.manager.hash_request(req)
    keys = [bytes(h) for h in req.block_hashes]
    host_slot = host.reserve(keys[0])
    assert host_slot is not None
    host.release([host_slot])
    for key in keys[:3]:
        disk.data[key] = b"kv"
    match = conn.get_num_new_matched_tokens(req, 0)
    assert match.runs == (TierRun("cpu", 4), TierRun("disk", 8))
    # Beyond a local hit of one block, the CPU tier's block is not needed.
    assert conn.get_num_new_matched_tokens(req, 4).runs == (TierRun("disk", 8),)


def test_a_second_prompt_loads_from_the_tiers_and_promotes_to_the_ones_above():
    sched, conn, host, (disk,) = hierarchy(host_blocks=3)
    run_one(sched, Request("a", prompt(17)))
    # Four blocks filled in one step; three host blocks: the first three are kept (all pinned for the step).
    assert host.num_stored == 3
    sched.manager.reset_prefix_cache()
    a = Request("a2", prompt(17))
    sched.manager.hash_request(a)
    disk.data[bytes(a.block_hashes[3])] = b"kv"  # as if the DictStore had been written
    out, metrics = run_one(sched, a)
    meta = out.connector_meta
    assert [(ld.position, ld.tier) for ld in meta.loads] == [(0, "cpu"), (1, "cpu"), (2, "cpu"), (3, "disk")]
    assert metrics.cached_tokens_by_tier == {"gpu": 0, "cpu": 12, "disk": 4}
    sched.manager.reset_prefix_cache()
    b = Request("b", prompt(13, base=500))
    sched.manager.hash_request(b)
    for key in b.block_hashes:
        disk.data[bytes(key)] = b"kv"
    out, metrics = run_one(sched, b)
    meta = out.connector_meta
    assert [(ld.position, ld.tier) for ld in meta.loads] == [(0, "disk"), (1, "disk"), (2, "disk")]
    # Loaded from disk: promoted to the CPU tier only (evicting the least recently used host blocks).
    assert [s.tiers for s in meta.saves] == [("cpu",)] * 3
    assert host.contains_prefix([bytes(h) for h in b.block_hashes]) == 3
    assert metrics.cached_tokens_by_tier == {"gpu": 0, "disk": 12}
    assert conn.counters["disk"].hit_blocks == 4  # one for a2, three for b


def test_salts_isolate_tenants_in_every_tier():
    sched, conn, host, (disk,) = hierarchy()
    run_one(sched, Request("a", prompt(13), cache_salt="tenant-1"))
    sched.manager.reset_prefix_cache()
    other = Request("b", prompt(13), cache_salt="tenant-2")
    sched.manager.hash_request(other)
    assert conn.get_num_new_matched_tokens(other, 0) == NO_MATCH
    same = Request("c", prompt(13), cache_salt="tenant-1")
    sched.manager.hash_request(same)
    assert conn.get_num_new_matched_tokens(same, 0).runs == (TierRun("cpu", 12),)


def test_a_failing_store_is_a_miss_and_is_counted():
    sched, conn, host, (disk,) = hierarchy(host_blocks=1)
    req = Request("a", prompt(9))
    sched.manager.hash_request(req)
    disk.data[bytes(req.block_hashes[0])] = b"kv"
    disk.broken = True
    assert conn.get_num_new_matched_tokens(req, 0) == NO_MATCH
    assert conn.lookup_errors() == {"disk": 1}


def test_the_cpu_tier_evicts_least_recently_used_through_its_free_queue():
    host = HostTier(2)
    slots = {}
    for key in (b"a", b"b"):
        slots[key] = host.reserve(key)
        host.release([slots[key]])
    host.release([host.pin(b"a")])  # a load makes "a" the most recently used
    slot = host.reserve(b"c")
    assert slot == slots[b"b"]  # "b" was the least recently used
    host.release([slot])
    assert host.contains_prefix([b"a", b"c"]) == 2 and host.contains_prefix([b"b"]) == 0
    assert host.reserve(b"a") is None  # stored already


def test_tiers_publish_what_they_store_and_evict_under_their_medium():
    mgr = KVCacheManager(32, BS, enable_events=True)
    host, disk = HostTier(2), DictStore("disk")
    conn = TierHierarchyConnector(mgr, [host, ByteTier(disk)])
    sched = Scheduler(mgr, SchedulerConfig(), connector=conn)

    def held(events, kind, medium):
        return [h for e in events if isinstance(e, kind) and e.medium == medium for h in e.block_hashes]

    a = Request("a", prompt(13))
    run_one(sched, a)  # three full blocks: all to disk, the first two to the two host blocks
    events = mgr.take_events()
    hashes = a.block_hashes
    assert held(events, BlockStored, "GPU") == hashes[:3]
    assert held(events, BlockStored, "CPU") == hashes[:2]
    assert held(events, BlockStored, "STORAGE") == hashes[:3]
    second = next(
        e for e in events if isinstance(e, BlockStored) and e.medium == "STORAGE" and e.block_hashes == (hashes[1],)
    )
    assert second.parent_block_hash == hashes[0] and second.token_ids == tuple(prompt(13)[4:8])
    assert second.block_size == BS and not held(events, BlockRemoved, "CPU")

    b = Request("b", prompt(9, base=500))
    run_one(sched, b)  # its two blocks take the host blocks of a's, least recently used first
    events = mgr.take_events()
    assert held(events, BlockRemoved, "CPU") == hashes[:2]
    assert held(events, BlockStored, "CPU") == b.block_hashes[:2]

    conn.reset()  # a failed step: the CPU tier forgets everything, and says so
    assert sorted(held(mgr.take_events(), BlockRemoved, "CPU")) == sorted(b.block_hashes[:2])


def test_tier_events_cost_nothing_without_events():
    sched, conn, host, (disk,) = hierarchy(host_blocks=1)
    run_one(sched, Request("a", prompt(13)))
    assert sched.manager.take_events() == [] and conn._stored == {}


def test_the_hierarchy_refuses_what_it_cannot_serve():
    with pytest.raises(ConfigError, match="cryptographic"):
        TierHierarchyConnector(KVCacheManager(8, BS, hash_algo="xxh3_128"), [HostTier(2)])
    with pytest.raises(ConfigError, match="prefix caching"):
        TierHierarchyConnector(KVCacheManager(8, BS, enable_caching=False), [HostTier(2)])
    with pytest.raises(ConfigError, match="distinct"):
        TierHierarchyConnector(KVCacheManager(8, BS), [HostTier(2), HostTier(2)])
    with pytest.raises(ConfigError, match="at least one"):
        TierHierarchyConnector(KVCacheManager(8, BS), [])


def test_the_connector_example_in_the_docs_runs():
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "tiers.md").read_text()
    (code,) = re.findall(r"```python\n(.*?)```", text, re.S)
    namespace: dict[str, object] = {}
    exec(compile(code, "docs/tiers.md", "exec"), namespace)
    mgr = KVCacheManager(32, BS)
    probe = Request("probe", prompt(13))
    mgr.hash_request(probe)
    known = {bytes(h) for h in probe.block_hashes[:2]}
    conn = namespace["DictConnector"](known, BS)  # type: ignore[operator]  # defined by the example
    assert isinstance(conn, KVConnector)
    sched = Scheduler(mgr, SchedulerConfig(), connector=conn)
    sched.add_request(Request("a", prompt(13)), StopConditions(max_tokens=1))
    out = sched.schedule()
    assert out.chunks[0].start_position == 8 and len(conn.loads["a"]) == 2
    (metrics,) = sched.update(out, {"a": 1})
    assert metrics.cached_tokens_by_tier == {"gpu": 0, "dict": 8}


# -- write-back: blocks go down when the pool evicts them -----------------------------------------


def write_back(num_blocks=5, host_blocks=8):
    mgr = KVCacheManager(num_blocks, BS, enable_events=True)
    host, disk = HostTier(host_blocks), DictStore("disk")
    conn = TierHierarchyConnector(mgr, [host, ByteTier(disk)], write=WritePolicy.WRITE_BACK)
    return Scheduler(mgr, SchedulerConfig(), connector=conn), conn, host, disk


def test_write_back_saves_nothing_on_fill_and_spills_what_the_pool_evicts():
    sched, conn, host, disk = write_back()
    a = Request("a", prompt(13))
    out, _ = run_one(sched, a)  # three full blocks and a partial one: the whole pool of 4
    assert out.connector_meta.saves == () and out.connector_meta.spills == ()
    assert host.num_stored == 0 and conn.counters["cpu"].saved_blocks == 0
    sched.manager.take_events()
    b = Request("b", prompt(13, base=500))
    out, _ = run_one(sched, b)  # needs the 4 blocks: a's 3 cached ones are evicted
    spills = out.connector_meta.spills
    assert sorted(s.key for s in spills) == sorted(bytes(h) for h in a.block_hashes[:3])
    assert all(s.request_id is None and s.tiers == ("cpu", "disk") and s.host_slot is not None for s in spills)
    assert host.num_stored == 3 and host.pool.num_free_blocks == 8  # indexed, and not pinned
    events = sched.manager.take_events()
    stored = [e.block_hashes for e in events if isinstance(e, BlockStored) and e.medium == "CPU"]
    assert sorted(stored) == sorted((h,) for h in a.block_hashes[:3])
    # a comes back: its blocks are found in the CPU tier, and loaded
    a2 = Request("a2", prompt(13))
    sched.manager.hash_request(a2)
    assert conn.get_num_new_matched_tokens(a2, 0).runs == (TierRun("cpu", 12),)


def test_write_back_sends_a_loaded_block_only_to_the_tiers_above_its_own():
    sched, conn, host, disk = write_back()
    b = Request("b", prompt(13, base=500))
    sched.manager.hash_request(b)
    for key in b.block_hashes:
        disk.data[bytes(key)] = b"kv"
    out, metrics = run_one(sched, b)
    assert metrics.cached_tokens_by_tier == {"gpu": 0, "disk": 12} and out.connector_meta.saves == ()
    out, _ = run_one(sched, Request("c", prompt(13, base=900)))  # evicts b's blocks
    assert [s.tiers for s in out.connector_meta.spills] == [("cpu",)] * 3


def test_write_back_a_block_reused_in_the_pool_never_crosses_the_link():
    sched, conn, host, disk = write_back(num_blocks=32)
    for i in range(5):
        out, _ = run_one(sched, Request(f"a{i}", prompt(13)))
        assert out.connector_meta.spills == () and out.connector_meta.saves == ()
    assert conn.counters["cpu"].saved_blocks == conn.counters["disk"].saved_blocks == 0
    through = hierarchy(num_blocks=32)
    for i in range(5):
        run_one(through[0], Request(f"a{i}", prompt(13)))
    assert through[1].counters["cpu"].saved_blocks == 3  # write-through: saved at once, whether reused or not


def test_write_back_forgets_what_a_failed_step_may_have_left():
    sched, conn, host, disk = write_back()
    run_one(sched, Request("a", prompt(13)))
    conn.reset()
    out, _ = run_one(sched, Request("b", prompt(13, base=500)))
    assert out.connector_meta.spills == ()  # a's blocks may hold what the failed step left: not sent down


def test_the_write_policy_is_checked():
    with pytest.raises(ConfigError, match="WritePolicy"):
        TierHierarchyConnector(KVCacheManager(8, BS), [HostTier(2)], write="write-back")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="'write-sideways'"):
        WritePolicy.parse("write-sideways")
    assert WritePolicy.parse("write-back") is WritePolicy.WRITE_BACK


def test_a_preview_of_the_match_remembers_nothing_of_the_request():
    from kvpool.tiers.load_or_compute import LinkPrior, LoadOrCompute, TransferCosts

    mgr = KVCacheManager(32, BS)
    costs = TransferCosts({"disk": LinkPrior(bandwidth_bytes_per_s=1e9, latency_s=1e-4)}, block_bytes=64,
                          prefill_tokens_per_s=10.0)  # fmt: skip
    disk = DictStore("disk")
    conn = TierHierarchyConnector(mgr, [ByteTier(disk)], chooser=LoadOrCompute(costs, block_size=BS))
    a = Request("a", prompt(13))
    mgr.hash_request(a)
    disk.data.update((bytes(h), b"kv") for h in a.block_hashes)
    assert conn.preview_match(a, 0).num_tokens == 12
    assert conn._offered == {}
    assert conn.get_num_new_matched_tokens(a, 0).num_tokens == 12
    assert set(conn._offered) == {"a"}


def test_a_lookup_is_given_up_once_computing_would_have_been_faster():
    import threading

    from kvpool.tiers.load_or_compute import LinkPrior, LoadOrCompute, TransferCosts
    from kvpool.tiers.transfer_threads import TransferThreads

    now = [0.0]
    threads = TransferThreads("test-lookups", load_deadline_s=60.0, clock=lambda: now[0])
    gate = threading.Event()
    disk = DictStore("disk")
    inner = disk.contains_prefix
    disk.contains_prefix = lambda keys: gate.wait(30) and inner(keys)
    costs = TransferCosts({"disk": LinkPrior(bandwidth_bytes_per_s=1e9, latency_s=1e-4)}, block_bytes=64,
                          prefill_tokens_per_s=100.0)  # fmt: skip  # 12 tokens: 0.12 s to compute
    mgr = KVCacheManager(32, BS)
    conn = TierHierarchyConnector(mgr, [ByteTier(disk)], chooser=LoadOrCompute(costs, block_size=BS), lookups=threads)
    try:
        a = Request("a", prompt(13))
        mgr.hash_request(a)
        disk.data.update((bytes(h), b"kv") for h in a.block_hashes)
        assert conn.get_num_new_matched_tokens(a, 0).pending
        now[0] = 0.1
        assert conn.get_num_new_matched_tokens(a, 0).pending  # computing would take 0.12 s: still worth waiting
        now[0] = 0.13
        given_up = conn.get_num_new_matched_tokens(a, 0)
        assert not given_up.pending and given_up.num_tokens == 0  # computed: the stores count as misses
        assert conn._lookups.gave_up == 1
    finally:
        gate.set()
        threads.close()


def test_stores_measured_slower_than_computing_are_not_asked():
    import threading

    from kvpool.tiers.load_or_compute import LinkPrior, LoadOrCompute, TransferCosts
    from kvpool.tiers.transfer_threads import TransferThreads

    now = [0.0]
    threads = TransferThreads("test-lookups", load_deadline_s=60.0, clock=lambda: now[0])
    gate, asked = threading.Event(), []
    disk = DictStore("disk")
    inner = disk.contains_prefix
    disk.contains_prefix = lambda keys: asked.append(len(keys)) or (gate.wait(30) and inner(keys))
    costs = TransferCosts({"disk": LinkPrior(bandwidth_bytes_per_s=1e9, latency_s=1e-4)}, block_bytes=64,
                          prefill_tokens_per_s=100.0)  # fmt: skip
    chooser = LoadOrCompute(costs, block_size=BS)
    mgr = KVCacheManager(32, BS)
    conn = TierHierarchyConnector(mgr, [ByteTier(disk)], chooser=chooser, lookups=threads)
    try:
        a, b = Request("a", prompt(13)), Request("b", prompt(13, base=300))
        mgr.hash_request(a)
        mgr.hash_request(b)
        assert conn.get_num_new_matched_tokens(a, 0).pending  # the prior: a lookup is cheap, asked
        now[0] = 5.0
        gate.set()
        threads.wait_for_loads(30)
        conn.get_num_new_matched_tokens(a, 0)  # back: measured at 5 s for 3 keys
        assert chooser.lookup_seconds(3) > 1.0 and chooser.lookups == {"asked": 1, "skipped": 0}
        calls = len(asked)
        match = conn.get_num_new_matched_tokens(b, 0)  # 12 tokens compute in 0.12 s: the stores are not asked
        assert not match.pending and match.num_tokens == 0 and len(asked) == calls
        assert chooser.lookups["skipped"] == 1
    finally:
        gate.set()
        threads.close()


def test_a_lookup_expected_to_reach_its_deadline_is_not_asked():
    from kvpool.tiers.load_or_compute import LinkPrior, LoadOrCompute, TransferCosts

    costs = TransferCosts({"disk": LinkPrior(bandwidth_bytes_per_s=1e9, latency_s=1e-4)}, block_bytes=64,
                          prefill_tokens_per_s=1.0)  # fmt: skip  # 64 tokens: a minute to compute
    chooser = LoadOrCompute(costs, block_size=BS)
    chooser.note_lookup(16, 2.0)  # a lookup that timed out at its 2 s deadline
    assert chooser.worth_looking_up(16, 64)  # beats a minute of compute...
    assert not chooser.worth_looking_up(16, 64, deadline_s=2.0)  # ...but would answer nothing in time
