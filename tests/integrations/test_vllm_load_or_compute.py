"""Load or compute inside the vLLM connector: the planner asks the engine's rule, measured from the worker's notes."""

from __future__ import annotations

import pytest

from kvpool import KVCacheManager, Request
from kvpool.errors import ConfigError
from kvpool.integrations.vllm.plan import ConnectorOptions, TierPlanner, TransferNotes
from kvpool.tiers import ByteTier, HostTier
from kvpool.tiers.hierarchy import TierHierarchyConnector
from kvpool.tiers.load_or_compute import LoadOrCompute, TransferCosts, registry_links
from kvpool.tiers.piece_fetch import DeadlineMiss
from tests.integrations.test_vllm_plan import BS, DictStore, FakeRequest

BLOCK_BYTES = 4096
RATE = 1_000.0  # prefill tokens per second: a 4-token block computes in 4 ms


def chooser(*tiers: str) -> LoadOrCompute:
    costs = TransferCosts(registry_links(tiers), block_bytes=BLOCK_BYTES, prefill_tokens_per_s=RATE)
    return LoadOrCompute(costs, block_size=BS)


def slow(notes: TransferNotes, tier: str = "redis", seconds: float = 0.05) -> TransferNotes:
    """Fetches of 1 to 5 blocks from ``tier``, each taking ``seconds`` (a far-away Redis: latency, no bandwidth)."""
    notes.loads += [(tier, n, n * BLOCK_BYTES, seconds) for n in range(1, 6)]
    return notes


def redis_planner(request: FakeRequest, held: slice, *, host_blocks: int = 0) -> TierPlanner:
    tiers: list[HostTier | ByteTier] = []
    names = ["redis"]
    if host_blocks:
        host = HostTier(8)
        for key in request.block_hashes[:host_blocks]:
            host.release([host.reserve(key)])  # type: ignore[list-item]  # a free host has room
        tiers.append(host)
        names.insert(0, "cpu")
    tiers.append(ByteTier(DictStore("redis", request.block_hashes[held])))
    return TierPlanner(tiers, BS, chooser=chooser(*names))


def test_a_tier_measured_faster_than_computing_is_loaded_and_counted_at_admission():
    request = FakeRequest("a", list(range(21)))  # 5 offerable blocks, all in Redis
    planner = redis_planner(request, slice(0, 5))
    assert planner.match(request, 0) == 20  # the registry's Redis link (300 us, 1.25 GB/s) beats 4 ms a block
    assert planner.chooser is not None and planner.chooser.requests["loaded"] == 0  # counted at admission only
    planner.allocated(request, [1, 2, 3, 4, 5, 6], 20)
    figures = planner.chooser.figures()
    assert figures["requests"]["loaded"] == 1 and figures["tiers"]["redis"]["blocks_loaded"] == 5


def test_a_redis_measured_slower_than_computing_is_computed_and_counted():
    request = FakeRequest("a", list(range(21)))
    planner = redis_planner(request, slice(0, 5))
    planner.note(slow(TransferNotes()))  # each fetch 50 ms: 5 blocks compute in 20 ms
    assert planner.match(request, 0) == 0 and planner.hit_tokens_by_tier("a") == {}
    planner.allocated(request, [1, 2, 3, 4, 5, 6], 0)
    assert planner.chooser is not None
    figures = planner.chooser.figures()
    assert figures["requests"]["computed"] == 1 and figures["tiers"]["redis"]["blocks_computed"] == 5
    assert figures["tiers"]["redis"]["loads"] == 5 and figures["tiers"]["redis"]["load_latency_s"] > 0.04


def test_the_host_tier_still_loads_when_the_redis_behind_it_is_cut():
    request = FakeRequest("a", list(range(21)))
    planner = redis_planner(request, slice(2, 5), host_blocks=2)
    planner.note(slow(TransferNotes()))
    assert planner.match(request, 0) == 8 and planner.hit_tokens_by_tier("a") == {"cpu": 8}
    planner.allocated(request, [1, 2, 3, 4, 5, 6], 8)
    assert planner.chooser is not None and planner.chooser.requests["cut"] == 1


def test_a_measured_prefill_rate_decides_too():
    request = FakeRequest("a", list(range(21)))
    planner = redis_planner(request, slice(0, 5))
    notes = slow(TransferNotes(), seconds=0.01)  # 10 ms a fetch: slower than 4 ms a block of 5 at first...
    planner.note(notes)
    assert planner.match(request, 0) == 20  # 20 ms to compute 5 blocks, 10 ms x 1.25 to load them
    planner.note(TransferNotes(steps=[(n * 100, n * 0.01) for n in range(1, 6)]))  # then 10,000 tokens/s
    assert planner.match(request, 0) == 0  # 2 ms to compute 5 blocks


def test_the_planner_and_the_engine_decide_alike_on_the_same_measurement():
    tokens = list(range(100, 100 + 5 * BS + 1))
    for seconds, expected in ((0.0005, 5 * BS), (0.05, 0)):
        request = FakeRequest("r", tokens)
        mgr = KVCacheManager(64, BS)
        engine_request = Request("r", tokens)
        assert mgr.get_computed_blocks(engine_request)[1] == 0  # the pool hashes the request's blocks
        keys = [bytes(h) for h in engine_request.block_hashes]
        engine_chooser, vllm_chooser = chooser("redis"), chooser("redis")
        for c in (engine_chooser, vllm_chooser):
            for tier, n, size, s in slow(TransferNotes(), seconds=seconds).loads:
                c.costs.note_load(tier, n, size, s)
        conn = TierHierarchyConnector(mgr, [ByteTier(DictStore("redis", keys))], chooser=engine_chooser)
        planner = TierPlanner([ByteTier(DictStore("redis", keys))], BS, chooser=vllm_chooser)
        request.block_hashes = keys
        assert conn.get_num_new_matched_tokens(engine_request, 0).num_tokens == expected
        assert planner.match(request, 0) == expected


def test_notes_without_a_chooser_change_nothing():
    request = FakeRequest("a", list(range(21)))
    planner = TierPlanner([ByteTier(DictStore("redis", request.block_hashes))], BS)
    planner.note(slow(TransferNotes()))
    assert planner.match(request, 0) == 20


def test_a_chooser_that_is_not_load_or_compute_is_refused_naming_it():
    with pytest.raises(ConfigError, match="chooser must be a LoadOrCompute"):
        TierPlanner([HostTier(4)], BS, chooser="fast")  # type: ignore[arg-type]


def test_options_take_always_load_and_a_prefill_rate():
    extra = {"tiers": ["cpu:1MiB"]}
    plain = ConnectorOptions.from_extra_config(extra)
    assert plain.always_load is False and plain.prefill_tokens_per_s is None
    set_ = ConnectorOptions.from_extra_config({**extra, "always_load": True, "prefill_tokens_per_s": 5000})
    assert set_.always_load is True and set_.prefill_tokens_per_s == 5000.0


@pytest.mark.parametrize("rate", [0, -1, "fast", True, float("inf")])
def test_a_bad_prefill_rate_is_refused_naming_the_key(rate):
    with pytest.raises(ConfigError, match="prefill_tokens_per_s"):
        ConnectorOptions.from_extra_config({"tiers": ["cpu:1MiB"], "prefill_tokens_per_s": rate})


def test_a_bad_always_load_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match="always_load"):
        ConnectorOptions.from_extra_config({"tiers": ["cpu:1MiB"], "always_load": "yes"})


# -- the worker's measurements ----------------------------------------------------------------------


def test_the_worker_notes_each_fetch_a_timed_out_one_at_its_deadline_and_hands_them_over_once():
    from kvpool.integrations.vllm.plan import StepPlan
    from tests.integrations.test_vllm_async import FakeClock, GatedStore, _load, _source_payloads, _worker

    clock = FakeClock()
    _, payloads = _source_payloads()
    store = GatedStore(payloads, gated=[b"k1"])
    worker, _ = _worker(store, clock)
    try:
        assert worker.take_notes() is None  # nothing measured yet
        assert worker.load(StepPlan(loads=(_load("now", b"k2", 2), _load("now", b"k3", 3)))) == set()
        notes = worker.take_notes()
        assert notes is not None and [(t, n, b) for t, n, b, _ in notes.loads] == [
            ("redis", 2, 2 * worker.layout.block_bytes)
        ]
        assert worker.take_notes() is None  # handed over once
        worker.start_receiving(StepPlan(loads=(_load("slow", b"k1", 1),), receiving=("slow",)))
        assert store.read_started.wait(5)
        clock.now = 1.0  # its deadline
        assert worker.received() == ({"slow"}, {1})
        notes = worker.take_notes()  # a deadline miss: the piece not back after 1 s, its tier owing it
        assert notes is not None and notes.loads == [] and notes.failed == []
        assert notes.misses == [DeadlineMiss("redis", late_blocks=1, abandoned_blocks=1, seconds=1.0, reading=True)]
        assert worker.take_notes() is None
    finally:
        store.release.set()
    worker.transfers.close(drain_timeout=5)  # type: ignore[union-attr]


def test_a_planner_fed_the_worker_s_timed_out_fetch_computes_the_next_request():
    request = FakeRequest("a", list(range(21)))
    planner = redis_planner(request, slice(0, 5))
    planner.note(TransferNotes(failed=[("redis", 5, 2.0)]))  # a fetch that ran to a 2 s deadline
    assert planner.match(request, 0) == 0
