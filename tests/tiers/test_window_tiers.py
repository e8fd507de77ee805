"""KV tiers for hybrid models (full attention + sliding window): per-group keys, the common hit, window saves.

The reference everywhere is the device's own rule: a manager that kept exactly the blocks the tiers hold
finds, with its coordinator, the hit the tiers must find.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool import ConfigError, KVCacheManager, Request
from kvpool.connector import ConnectorMetadata, ExternalMatch, TierRun
from kvpool.events import BlockStored
from kvpool.model_config import load_model_config
from kvpool.model_layers import layer_specs_from_config
from kvpool.planner import plan_kv_cache
from kvpool.scheduler import Scheduler, SchedulerConfig, StopConditions
from kvpool.sim.transfers import KeyStore, TierLink, TimingWorker
from kvpool.specs import KVCacheGroup, group_layers, pool_block_bytes
from kvpool.tiers.hierarchy import ByteTier, HostTier, TierHierarchyConnector
from kvpool.tiers.kinds import WritePolicy
from kvpool.tiers.transfer_threads import TransferThreads
from kvpool.tiers.windows import tier_groups
from tests.group_helpers import chunked, cross, full, mamba, sliding

BS = 4
LINK = TierLink(bandwidth_bytes_per_s=1e9, latency_s=0.0)


class Store(KeyStore):
    """The simulator's key store (no bound), remembering every key saved to it, in order."""

    def __init__(self, name: str = "disk") -> None:
        super().__init__(name, None)
        self.saved: list[bytes] = []

    def put_many(self, keys):
        self.saved.extend(keys)
        return super().put_many(keys)


@dataclass
class Engine:
    """A manager, its tier connector and scheduler, and a worker that moves no bytes (the simulator's)."""

    mgr: KVCacheManager
    conn: TierHierarchyConnector
    sched: Scheduler
    worker: TimingWorker
    stores: dict[str, Store]


def engine(
    groups: list[KVCacheGroup],
    *,
    num_blocks: int = 256,
    host_blocks: int = 0,
    stores: dict[str, Store] | None = None,
    write: WritePolicy = WritePolicy.WRITE_THROUGH,
    window_aware_saves: bool = True,
    max_batched: int = 8192,
    from_groups: bool = False,
) -> Engine:
    if from_groups:
        mgr = KVCacheManager.from_groups(groups, num_blocks)
    else:
        mgr = KVCacheManager(num_blocks, BS, groups=groups)
    stores = {"disk": Store()} if stores is None else stores
    tiers: list[HostTier | ByteTier] = [HostTier(host_blocks)] if host_blocks else []
    tiers += [ByteTier(s) for s in stores.values()]
    conn = TierHierarchyConnector(mgr, tiers, write=write, window_aware_saves=window_aware_saves)
    block_bytes = mgr.block_size  # one byte a token: the block counts are what matters here
    worker = TimingWorker(stores, {t.name: LINK for t in tiers}, block_size=mgr.block_size, block_bytes=block_bytes)
    sched = Scheduler(mgr, SchedulerConfig(max_num_batched_tokens=max_batched), connector=conn)
    return Engine(mgr, conn, sched, worker, stores)


def serve(e: Engine, request: Request, *, max_tokens: int = 1) -> tuple[int, list[ConnectorMetadata]]:
    """Run ``request`` to the end in the simulator's order of transfers; the tokens its admission found, and
    every step's transfers. The manager's invariants are checked after each step."""
    e.sched.add_request(request, StopConditions(max_tokens=max_tokens))
    found: int | None = None
    metas: list[ConnectorMetadata] = []
    while e.sched.has_unfinished_requests():
        out = e.sched.schedule()
        meta = out.connector_meta
        assert meta is not None
        metas.append(meta)
        if meta.loads or meta.spills:
            e.worker.start_load(meta)
            out = e.sched.apply_transfers(out, e.worker.get_finished())
        sampled = {}
        for chunk in out.chunks:
            if chunk.request_id == request.request_id and found is None:
                found = chunk.num_cached_tokens
            if chunk.sample:
                sampled[chunk.request_id] = 7
        if meta.saves:
            e.worker.save(meta)
            out = e.sched.apply_transfers(out, e.worker.get_finished())
        for metrics in e.sched.update(out, sampled):
            e.sched.forget(metrics.request_id)
        e.mgr.check_invariants()
    assert found is not None
    return found, metas


def keep(mgr: KVCacheManager, request: Request, held: list[list[bool]]) -> None:
    """Cache the blocks ``held[g][k]`` of ``request`` in group ``g`` of ``mgr``'s pool (free, like a finished
    request's)."""
    mgr.hash_request(request)
    pool = mgr.pool
    for g, blocks in enumerate(held):
        hashes = mgr.groups[g].hashes_of(request)
        for k, kept in enumerate(blocks):
            if kept:
                [block] = pool.get_new_blocks(1)
                pool.cache_block(block, hashes[k], g)
                pool.free_blocks([block])
    mgr.check_invariants()


def count_by_group(e: Engine, keys: list[bytes]) -> list[int]:
    """How many of ``keys`` name each group's blocks (by the group's tag)."""
    return [sum(1 for k in keys if len(k) == 32 + len(g.tag) and k.endswith(g.tag)) for g in e.conn.groups]


# -- what names an entry --------------------------------------------------------------------------------


def test_each_group_names_its_entries_and_a_plain_model_keeps_its_keys():
    plain = tier_groups(KVCacheManager(8, BS))
    assert [g.tag for g in plain] == [b""]  # one full-attention group: the keys are the block hashes, as before
    groups = tier_groups(KVCacheManager(8, BS, groups=[full(layer=0), sliding(8, layer=1)]))
    again = tier_groups(KVCacheManager(16, BS, groups=[full(layer=0), sliding(8, layer=1)]))
    other = tier_groups(KVCacheManager(8, BS, groups=[full(layer=0), sliding(12, layer=1)]))
    assert len({g.tag for g in groups}) == 2 and all(len(g.tag) == 8 for g in groups)
    assert [g.tag for g in groups] == [g.tag for g in again]  # another process of the same model: the same keys
    assert groups[0].tag == other[0].tag and groups[1].tag != other[1].tag  # the window is part of the name
    assert groups[0].key(b"h" * 32) != groups[1].key(b"h" * 32)  # two groups never read each other's bytes
    assert [g.window_blocks for g in groups] == [None, 2]  # cdiv(8 - 1, 4)


def test_a_plain_model_saves_under_its_block_hashes():
    e = engine([full()])
    request = Request("a", list(range(17)))
    serve(e, request)
    assert e.stores["disk"].saved == [bytes(h) for h in request.block_hashes[:4]]


# -- groups the tiers cannot serve --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("group", "kind"),
    [(mamba(layer=1), "mamba"), (chunked(8, layer=1), "chunked_local"), (cross(layer=1), "cross_attention")],
)
def test_groups_the_tiers_cannot_serve_are_refused_naming_their_kind(group, kind):
    mgr = KVCacheManager(16, BS, groups=[full(layer=0), group])
    host = HostTier(4)
    before = mgr.free_queue_block_ids()
    with pytest.raises(ConfigError, match=f"group 1 is {kind}"):
        TierHierarchyConnector(mgr, [host], write=WritePolicy.WRITE_BACK)
    assert mgr.free_queue_block_ids() == before and host.num_stored == 0 and host.pool.num_free_blocks == 4
    mgr.check_invariants()
    # Nothing was left watching the pool: a plain connector over another manager is unaffected.
    TierHierarchyConnector(KVCacheManager(16, BS), [host], write=WritePolicy.WRITE_BACK)


def test_groups_of_another_block_size_are_refused():
    mgr = KVCacheManager(16, BS, groups=[full(layer=0), sliding(8, bs=8, layer=1)])
    with pytest.raises(ConfigError, match="group 1 .*sliding_window.* has 8"):
        TierHierarchyConnector(mgr, [HostTier(4)])


def test_a_hybrid_model_refuses_asynchronous_loads_and_off_step_lookups():
    mgr = KVCacheManager(16, BS, groups=[full(layer=0), sliding(8, layer=1)])
    with pytest.raises(ConfigError, match="asynchronous tier loads"):
        TierHierarchyConnector(mgr, [HostTier(4)], async_loads=True)
    threads = TransferThreads("window-test")
    try:
        with pytest.raises(ConfigError, match="off-step disk and Redis lookups"):
            TierHierarchyConnector(mgr, [ByteTier(KeyStore("disk", None))], lookups=threads)
    finally:
        threads.close()
    with pytest.raises(ConfigError, match="window_aware_saves"):
        TierHierarchyConnector(mgr, [HostTier(4)], window_aware_saves=1)  # type: ignore[arg-type]


# -- the common hit: the device's rule --------------------------------------------------------------------

GROUP_SETS = {
    "full+window": lambda w: [full(layer=0), sliding(w, layer=1)],
    "window": lambda w: [sliding(w, layer=0)],
    "full+window+full": lambda w: [full(layer=0), sliding(w, layer=1), full(layer=2)],
    "window+window": lambda w: [sliding(w, layer=0), sliding(w + 5, layer=1)],
}


@settings(max_examples=150, deadline=None)
@given(
    kind=st.sampled_from(sorted(GROUP_SETS)),
    window=st.integers(1, 24),
    length=st.integers(2, 64),
    data=st.data(),
)
def test_the_tiers_find_what_the_device_would_have_found_had_it_kept_their_blocks(kind, window, length, data):
    groups = GROUP_SETS[kind](window)
    num_blocks = length // BS
    bits = st.lists(st.booleans(), min_size=num_blocks, max_size=num_blocks)
    held = [data.draw(bits) for _ in groups]  # what the tiers hold, per group
    local = [[h and data.draw(st.booleans()) for h in row] for row in held]  # what the pool still holds of it
    on_host = [[data.draw(st.booleans()) for _ in row] for row in held]  # CPU tier, else disk
    tokens = list(range(1000, 1000 + length))
    pool_blocks = 2 * len(groups) * (num_blocks + 2) + 8

    reference = KVCacheManager(pool_blocks, BS, groups=groups)
    ref_request = Request("r", tokens)
    keep(reference, ref_request, held)
    _, expected = reference.coordinator.find_longest_cache_hit(ref_request, ref_request.num_tokens - 1)

    e = engine(groups, num_blocks=pool_blocks, host_blocks=len(groups) * num_blocks + 1)
    request = Request("r", tokens)
    keep(e.mgr, request, local)
    host = e.conn.policy.host
    assert host is not None
    where: dict[bytes, str] = {}
    for g, group in enumerate(e.conn.groups):
        for k, h in enumerate(held[g]):
            if h:
                key = group.key(request.block_hashes[k])
                where[key] = "cpu" if on_host[g][k] else "disk"
                if on_host[g][k]:
                    slot = host.reserve(key)
                    assert slot is not None
                    host.release([slot])
                else:
                    e.stores["disk"].put_many([key])
    hit, num_hit = e.mgr.get_computed_blocks(request)
    match = e.conn.get_num_new_matched_tokens(request, num_hit)
    assert num_hit + match.num_tokens == expected
    assert match.num_tokens % BS == 0 and not match.pending
    assert e.conn.preview_match(request, num_hit) == match  # asking again changes nothing
    # Admitted: the loads are exactly the blocks the hit reads, each from the tier holding it.
    admitted = e.mgr.allocate_slots(request, 1, num_hit, hit, num_external_computed_tokens=match.num_tokens)
    assert admitted is not None
    e.conn.update_state_after_alloc(request, e.mgr.get_block_ids("r")[0], num_hit, match)
    loads = e.conn.build_meta([]).loads
    end = expected // BS
    first = num_hit // BS
    wanted = set()
    for group in e.conn.groups:
        start = first if group.window_blocks is None else max(first, end - group.window_blocks)
        wanted |= {(group.key(request.block_hashes[k]), k) for k in range(start, end)}
    assert {(load.key, load.position) for load in loads} == wanted
    assert all(load.tier == where[load.key] for load in loads)  # each from the tier holding it
    e.mgr.check_invariants()


def test_the_module_example_loads_four_full_blocks_and_two_window_blocks():
    e = engine([full(layer=0), sliding(8, layer=1)])
    request = Request("b", list(range(26)))  # 6 full blocks, the 7th holds the last token
    e.mgr.hash_request(request)
    fa, sw = e.conn.groups
    held = {fa: range(6), sw: (2, 3, 5)}
    e.stores["disk"].put_many([g.key(request.block_hashes[k]) for g, ks in held.items() for k in ks])
    found, metas = serve(e, request)
    assert found == 16
    loads = metas[0].loads
    assert sorted(load.position for load in loads if load.key.endswith(fa.tag)) == [0, 1, 2, 3]
    assert sorted(load.position for load in loads if load.key.endswith(sw.tag)) == [2, 3]
    assert e.conn.window_skipped_loads == 2  # window blocks 0 and 1: out of the window at the hit's end
    assert e.worker.blocks_loaded["disk"] == 6


def test_window_blocks_the_hit_does_not_load_are_not_left_in_the_prefix_cache():
    e = engine([full(layer=0), sliding(8, layer=1)])
    writer = Request("w", list(range(41)))
    serve(e, writer)
    fresh = engine([full(layer=0), sliding(8, layer=1)], stores=e.stores)
    reader = Request("r", list(range(45)))
    found, _ = serve(fresh, reader)
    assert found == 40
    # Window blocks 0..7 of the reader got pool blocks but no KV: none is cached, so nothing can hit them.
    probe = Request("p", list(range(13)))  # a shorter prefix: its window ends inside those blocks
    fresh.mgr.hash_request(probe)
    _, num_hit = fresh.mgr.get_computed_blocks(probe)
    assert num_hit == 0
    fresh.mgr.check_invariants()


class TrimTo:
    """Load or compute that loads at most ``tokens`` of any match (a stand-in for the engine's)."""

    def __init__(self, tokens: int) -> None:
        self.tokens = tokens
        self.counted: list[tuple[int, int]] = []

    def choose(self, match: ExternalMatch) -> ExternalMatch:
        return match.truncated(self.tokens)

    def count(self, offered: ExternalMatch, chosen: ExternalMatch) -> None:
        self.counted.append((offered.num_tokens, chosen.num_tokens))

    def compute_seconds(self, num_tokens: int) -> float:
        return num_tokens * 1e-3

    def note_lookup(self, num_keys: int, seconds: float) -> None:
        pass

    def worth_looking_up(self, num_keys: int, num_tokens: int, deadline_s: float | None = None) -> bool:
        return True


def test_a_shorter_chosen_load_moves_the_windows_and_is_searched_again():
    mgr = KVCacheManager(64, BS, groups=[full(layer=0), sliding(8, layer=1)])
    store = Store()
    chooser = TrimTo(24)
    conn = TierHierarchyConnector(mgr, [ByteTier(store)], chooser=chooser)
    request = Request("a", list(range(45)))
    mgr.hash_request(request)
    fa, sw = conn.groups
    store.put_many([fa.key(request.block_hashes[k]) for k in range(10)])
    store.put_many([sw.key(request.block_hashes[k]) for k in (2, 3, 8, 9)])
    assert conn.preview_match(request, 0).num_tokens == 16  # 40 held; 24 chosen; the window at 24 is not held
    chooser.tokens = 40
    assert conn.preview_match(request, 0).num_tokens == 40
    chooser.tokens = 24
    sched = Scheduler(mgr, SchedulerConfig(), connector=conn)
    sched.add_request(request, StopConditions(max_tokens=1))
    out = sched.schedule()
    assert out.connector_meta is not None
    loads = out.connector_meta.loads
    assert sorted((load.key.endswith(sw.tag), load.position) for load in loads) == [
        (False, 0),
        (False, 1),
        (False, 2),
        (False, 3),
        (True, 2),
        (True, 3),
    ]
    assert chooser.counted == [(40, 16)]
    mgr.check_invariants()


@pytest.mark.parametrize(("aware", "window_saved"), [(False, 10), (True, 2)])  # the default saves every block
def test_tier_events_name_each_blocks_group(aware: bool, window_saved: int):
    mgr = KVCacheManager(64, BS, groups=[full(layer=0), sliding(8, layer=1)], enable_events=True)
    store = Store()
    conn = TierHierarchyConnector(mgr, [ByteTier(store)], **({"window_aware_saves": True} if aware else {}))
    e = Engine(
        mgr,
        conn,
        Scheduler(mgr, SchedulerConfig(), connector=conn),
        TimingWorker({"disk": store}, {"disk": LINK}, block_size=BS, block_bytes=BS),
        {"disk": store},
    )
    serve(e, Request("a", list(range(41))))
    stored = [ev for ev in mgr.take_events() if isinstance(ev, BlockStored) and ev.medium != "GPU"]
    by_group = {0: 0, 1: 0}
    for ev in stored:
        by_group[ev.group_id] += len(ev.block_hashes)
    assert by_group == {0: 10, 1: window_saved}


# -- what a window group saves ------------------------------------------------------------------------------


def test_a_window_group_saves_only_the_blocks_the_request_can_still_read():
    e = engine([full(layer=0), sliding(8, layer=1)])
    request = Request("a", list(range(41)))  # 10 full blocks, prefilled in one step
    serve(e, request)
    full_saved, window_saved = count_by_group(e, e.stores["disk"].saved)
    # At 41 tokens the next token reads 34..41: blocks 8 and 9 (the pool gives 0..7 back).
    assert (full_saved, window_saved) == (10, 2)
    assert e.conn.window_skipped_saves == 8
    assert e.conn.counters["disk"].saved_blocks == 12


def test_decode_saves_each_window_block_while_it_is_still_read():
    e = engine([full(layer=0), sliding(8, layer=1)], max_batched=4)  # 4 tokens a step: every block is read
    request = Request("a", list(range(20)))
    serve(e, request, max_tokens=6)
    full_saved, window_saved = count_by_group(e, e.stores["disk"].saved)
    assert (full_saved, window_saved) == (6, 6) and e.conn.window_skipped_saves == 0


def test_without_window_aware_saves_every_full_block_is_saved():
    e = engine([full(layer=0), sliding(8, layer=1)], window_aware_saves=False)
    serve(e, Request("a", list(range(41))))
    assert count_by_group(e, e.stores["disk"].saved) == [10, 10]
    assert e.conn.window_skipped_saves == 0


def test_write_back_spills_each_groups_readable_blocks_under_their_own_keys():
    e = engine([full(layer=0), sliding(8, layer=1)], num_blocks=24, write=WritePolicy.WRITE_BACK)
    serve(e, Request("a", list(range(41))))  # 11 + 11 blocks; window blocks 0..7 are given back at once
    assert len(e.stores["disk"]) == 0  # write-back: nothing goes down before the pool evicts it
    serve(e, Request("b", list(range(500, 541))))  # evicts a's blocks
    full_saved, window_saved = count_by_group(e, e.stores["disk"].saved)
    assert (full_saved, window_saved) == (10, 2)
    fresh = engine([full(layer=0), sliding(8, layer=1)], stores=e.stores)
    found, _ = serve(fresh, Request("c", list(range(45))))
    assert found == 40


# -- gemma-3-12b, with the planner's figures ----------------------------------------------------------------


def gemma_groups() -> tuple[KVCacheGroup, ...]:
    return group_layers(layer_specs_from_config(load_model_config("gemma-3-12b"), block_size=16))


def test_gemma_3_saves_and_loads_what_the_planner_says():
    groups = gemma_groups()
    prompt = 4097  # 256 full blocks of 16 tokens and the last token
    plan = plan_kv_cache(load_model_config("gemma-3-12b"), gpu_memory_bytes="80GB", max_model_len=prompt)
    kinds = [g.kind.value for g in plan.groups]
    assert kinds == ["sliding_window"] * 5 + ["full_attention"]
    assert [g.block_bytes for g in plan.groups] == [pool_block_bytes(groups)] * 6 == [1 << 20] * 6
    # Bytes a token costs in each group (the planner's block bytes over its block size): 64 KiB.
    per_token = [g.block_bytes // g.block_size for g in plan.groups]
    assert per_token == [64 * 1024] * 6

    writer = engine(list(groups), num_blocks=2000, from_groups=True)
    serve(writer, Request("a", list(range(prompt))))
    saved = count_by_group(writer, writer.stores["disk"].saved)
    # A window group saves the blocks the next token still reads: the planner's blocks per request less the
    # one the next token goes into; full attention saves every full block.
    window_plan = [g.blocks_per_request for g in plan.groups[:5]]
    assert window_plan == [65] * 5
    assert saved == [65 - 1] * 5 + [256]
    bytes_saved = sum(n * g.block_bytes for n, g in zip(saved, plan.groups))
    bytes_full_only = 6 * 256 * (1 << 20)  # the same layers, all full attention: every block of every group
    assert (bytes_saved, bytes_full_only) == (576 << 20, 1536 << 20)  # 37.5%
    assert writer.worker.blocks_saved["disk"] * pool_block_bytes(groups) == bytes_saved

    reader = engine(list(groups), num_blocks=2000, stores=writer.stores, from_groups=True)
    request = Request("b", list(range(prompt + 100)))
    found, _ = serve(reader, request)
    _, kept = writer.mgr.coordinator.find_longest_cache_hit(request, request.num_tokens - 1)
    assert found == kept == 4096  # what the writer's pool, which kept every block, finds
    assert reader.worker.blocks_loaded["disk"] == 5 * 64 + 256  # 576 MiB loaded, not 1,536
    assert reader.conn.window_skipped_loads == 5 * 192


def test_window_aware_saving_trades_hits_that_end_before_the_window_for_bytes():
    """The cost of saving only readable window blocks: a prompt sharing only an early prefix finds nothing."""
    results = {}
    for aware in (True, False):
        writer = engine([full(layer=0), sliding(8, layer=1)], window_aware_saves=aware)
        serve(writer, Request("a", list(range(41))))
        saved = len(writer.stores["disk"])
        reader = engine([full(layer=0), sliding(8, layer=1)], stores=writer.stores)
        shorter = Request("b", [*range(20), *range(900, 920)])  # shares blocks 0..4 only
        found, _ = serve(reader, shorter)
        results[aware] = (saved, found, reader.worker.blocks_loaded["disk"])
    assert results[True] == (12, 0, 0)
    assert results[False] == (20, 20, 5 + 2)


# -- bad input changes nothing ----------------------------------------------------------------------------------


def test_a_match_the_tiers_do_not_hold_is_refused_with_nothing_changed():
    e = engine([full(layer=0), sliding(8, layer=1)], host_blocks=8)
    request = Request("a", list(range(21)))
    e.mgr.hash_request(request)
    fa, sw = e.conn.groups
    hashes = request.block_hashes
    e.stores["disk"].put_many([fa.key(hashes[0]), fa.key(hashes[1]), sw.key(hashes[0])])  # a hit of one block
    hit, n = e.mgr.get_computed_blocks(request)
    claimed = ExternalMatch((TierRun("disk", 8),))
    assert e.mgr.allocate_slots(request, 1, n, hit, num_external_computed_tokens=8) is not None
    host = e.conn.policy.host
    assert host is not None
    free = host.pool.num_free_blocks
    with pytest.raises(ConfigError, match="hold 4 of the 8 tokens"):
        e.conn.update_state_after_alloc(request, e.mgr.get_block_ids("a")[0], 0, claimed)
    assert e.conn.build_meta([(request, 9)]) == ConnectorMetadata()  # no loads, no saves: it was never admitted
    assert host.pool.num_free_blocks == free
    e.mgr.check_invariants()


def test_a_tier_that_fails_lookups_is_a_miss():
    class Broken:
        name = "disk"

        def contains_prefix(self, keys):
            raise ConnectionError("down")

    mgr = KVCacheManager(32, BS, groups=[full(layer=0), sliding(8, layer=1)])
    conn = TierHierarchyConnector(mgr, [ByteTier(Broken())])
    request = Request("a", list(range(21)))
    mgr.hash_request(request)
    assert conn.get_num_new_matched_tokens(request, 0).num_tokens == 0
    assert conn.lookup_errors() == {"disk": 1}
