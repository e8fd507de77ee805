"""The vLLM connector's transfers off vLLM's step, without vLLM: asynchronous loads, deadlines, the bounded save queue.

Both halves are driven as ``KVPoolConnector`` drives them: the planner answers ``load_async`` and
plans a waiting request's loads; the worker fetches them on its load threads and reports them
from ``received`` (``get_finished``). Every wait is on an event; the deadline's clock is injected.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import pytest
import torch

from kvpool.errors import ConfigError
from kvpool.integrations.vllm.blocks import KVBlockLayout, TierWorker
from kvpool.integrations.vllm.plan import ConnectorOptions, StepPlan, TierPlanner, VllmBlockLoad, VllmBlockSave
from kvpool.tiers import ByteTier, HostTier, TierStats
from kvpool.tiers.transfer_threads import DEFAULT_LOAD_DEADLINE_S, TransferThreads
from tests.integrations.test_vllm_blocks import BLOCKS, cpu_caches, fingerprint
from tests.integrations.test_vllm_plan import BS, DictStore, FakeRequest, new_chunk

# -- the scheduler's half ---------------------------------------------------------------------------


def test_options_load_asynchronously_by_default_with_the_default_deadline():
    options = ConnectorOptions.from_extra_config({"tiers": ["cpu:1MiB"]})
    assert options.async_loads and options.load_deadline_s == DEFAULT_LOAD_DEADLINE_S
    options = ConnectorOptions.from_extra_config({"tiers": ["cpu:1MiB"], "async_loads": False, "load_deadline_s": 0.5})
    assert not options.async_loads and options.load_deadline_s == 0.5


def test_a_bad_async_option_is_refused_naming_it():
    with pytest.raises(ConfigError, match="'async_loads' must be True or False, got 'yes'"):
        ConnectorOptions.from_extra_config({"tiers": ["cpu:1MiB"], "async_loads": "yes"})
    for bad in (-1, 0, True, "2", float("nan")):  # checked with the rest of the config, naming it
        with pytest.raises(ConfigError, match="'load_deadline_s' must be a finite number of seconds > 0"):
            ConnectorOptions.from_extra_config({"tiers": ["cpu:1MiB"], "load_deadline_s": bad})


def _host_and_redis(request: FakeRequest, host_blocks: int, redis_blocks: slice, *, async_loads: bool = True):
    host = HostTier(8)
    for key in request.block_hashes[:host_blocks]:
        host.reserve(key)
    host.release(list(range(1, host_blocks + 1)))
    redis = DictStore("redis", request.block_hashes[redis_blocks])
    return TierPlanner([host, ByteTier(redis)], BS, async_loads=async_loads), host


def test_a_match_a_store_serves_loads_asynchronously_and_one_the_host_tier_serves_alone_does_not():
    request = FakeRequest("a", list(range(21)))  # 5 full blocks, all offerable
    planner, _ = _host_and_redis(request, 2, slice(2, 4))
    assert planner.match(request, 0) == 16 and planner.loads_async("a")
    host_only, _ = _host_and_redis(request, 2, slice(0, 0))
    assert host_only.match(request, 0) == 8 and not host_only.loads_async("a")
    synchronous, _ = _host_and_redis(request, 2, slice(2, 4), async_loads=False)
    assert synchronous.match(request, 0) == 16 and not synchronous.loads_async("a")
    assert not planner.loads_async("never-seen")


def test_an_async_load_is_planned_while_its_request_waits_and_promoted_when_vllm_schedules_it():
    request = FakeRequest("a", list(range(14)))  # 3 full blocks and 2 tokens; Redis holds the first 2
    planner, host = _host_and_redis(request, 0, slice(0, 2))
    planner.add(request)
    assert planner.match(request, 0) == 8 and planner.loads_async("a")
    planner.allocated(request, [10, 11, 12, 13], 8)
    h = request.block_hashes
    # vLLM parks the request in WAITING_FOR_REMOTE_KVS: it is in no chunk of this step
    waiting = planner.build([])
    assert waiting.receiving == ("a",)
    assert waiting.loads == (
        VllmBlockLoad(request_id="a", tier="redis", key=h[0], block_id=10),
        VllmBlockLoad(request_id="a", tier="redis", key=h[1], block_id=11),
    )
    assert waiting.saves == () and host.contains_prefix(h) == 0  # nothing promoted before it is loaded
    assert planner.build([]) == StepPlan()  # planned once
    # received: vLLM schedules it from the loaded tokens; the loaded blocks go up, the computed one everywhere
    plan = planner.build([new_chunk("a", [10, 11, 12, 13], computed=8, scheduled=6)])
    assert [(s.key, s.block_id, s.tiers) for s in plan.saves] == [
        (h[0], 10, ("cpu",)),
        (h[1], 11, ("cpu",)),
        (h[2], 12, ("cpu", "redis")),
    ]
    assert plan.receiving == () and plan.loads == ()


def test_a_failed_async_block_is_computed_and_saved_as_computed_not_promoted():
    request = FakeRequest("a", list(range(14)))
    planner, _ = _host_and_redis(request, 0, slice(0, 2))
    planner.add(request)
    planner.match(request, 0)
    planner.allocated(request, [10, 11, 12, 13], 8)
    planner.build([])
    # block 11 failed to load: vLLM resumes the request at token 4
    plan = planner.build([new_chunk("a", [10, 11, 12, 13], computed=4, scheduled=10)])
    h = request.block_hashes
    assert [(s.key, s.block_id, s.tiers) for s in plan.saves] == [
        (h[0], 10, ("cpu",)),
        (h[1], 11, ("cpu", "redis")),
        (h[2], 12, ("cpu", "redis")),
    ]


def test_a_request_finished_while_waiting_is_forgotten_with_its_loads():
    request = FakeRequest("a", list(range(14)))
    planner, _ = _host_and_redis(request, 0, slice(0, 2))
    planner.add(request)
    planner.match(request, 0)
    planner.allocated(request, [10, 11, 12, 13], 8)
    planner.finished("a")
    assert planner.build([]) == StepPlan() and planner.num_tracked == 0


def test_synchronous_loads_stay_in_the_step_that_schedules_them():
    request = FakeRequest("a", list(range(14)))
    planner, _ = _host_and_redis(request, 0, slice(0, 2), async_loads=False)
    planner.add(request)
    planner.match(request, 0)
    planner.allocated(request, [10, 11, 12, 13], 8)
    plan = planner.build([new_chunk("a", [10, 11, 12, 13], computed=8, scheduled=6)])
    assert plan.receiving == () and len(plan.loads) == 2
    assert [s.block_id for s in plan.saves] == [10, 11, 12]  # promotions with the loads, as before


# -- the worker's half ------------------------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class GatedStore:
    """A store in memory whose reads of ``gated`` keys, and writes while ``hold_puts``, wait for ``release``."""

    name = "redis"

    def __init__(self, payloads: dict[bytes, bytes], gated: Sequence[bytes] = ()) -> None:
        self.payloads = dict(payloads)
        self.gated = set(gated)
        self.hold_puts = False
        self.release = threading.Event()
        self.read_started = threading.Event()
        self.put_started = threading.Event()
        self.stats = TierStats()

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        if self.gated & set(keys):
            self.read_started.set()
            assert self.release.wait(10), "the test never released the stalled read"
        return [self.payloads.get(k) for k in keys]

    def put_many(self, items: Sequence[tuple[bytes, bytes]]) -> int:
        if self.hold_puts:
            self.put_started.set()
            assert self.release.wait(10), "the test never released the stalled write"
        self.payloads.update(items)
        return len(items)

    def close(self) -> None:
        pass


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def _worker(store: GatedStore, clock: FakeClock, *, max_queued_saves: int = 4, seed: int = 2):
    transfers = TransferThreads(
        "test", load_threads=2, max_queued_saves=max_queued_saves, load_deadline_s=1.0, clock=clock
    )
    caches = cpu_caches(seed)
    layout = KVBlockLayout(caches, BLOCKS, fingerprint().block_bytes)
    return TierWorker(layout, {"redis": store}, None, transfers), caches


def _source_payloads() -> tuple[list[torch.Tensor], dict[bytes, bytes]]:
    source = cpu_caches(1)
    layout = KVBlockLayout(source, BLOCKS, fingerprint().block_bytes)
    return source, {f"k{i}".encode(): layout.read(i).numpy().tobytes() for i in range(BLOCKS)}


def _receive_until(worker: TierWorker, wanted: str) -> tuple[set[str], set[int]]:
    got: set[str] = set()
    failed: set[int] = set()
    while wanted not in got:
        assert worker.transfers is not None
        worker.transfers.wait_for_loads(timeout=5)
        done, lost = worker.received()
        got |= done
        failed |= lost
    return got, failed


def _load(request_id: str, key: bytes, block_id: int) -> VllmBlockLoad:
    return VllmBlockLoad(request_id=request_id, tier="redis", key=key, block_id=block_id)


def test_a_stalled_fetch_leaves_other_requests_loads_finishing_and_fails_its_blocks_at_the_deadline(clock):
    source, payloads = _source_payloads()
    store = GatedStore(payloads, gated=[b"k1"])
    worker, target = _worker(store, clock)
    before = [layer[1].clone() for layer in target]
    plan = StepPlan(loads=(_load("slow", b"k1", 1), _load("fast", b"k2", 2)), receiving=("slow", "fast"))
    try:
        worker.start_receiving(plan)
        assert worker.load(plan) == set()  # nothing else to load: nothing is read on the step
        assert store.read_started.wait(5)
        got, failed = _receive_until(worker, "fast")
        assert got == {"fast"} and failed == set()
        assert all(torch.equal(a[2], b[2]) for a, b in zip(source, target))  # copied in on this thread
        assert worker.num_receiving == 1
        clock.now = 1.0  # the slow fetch's deadline
        assert worker.received() == ({"slow"}, {1})  # vLLM computes block 1 instead
        assert worker.figures.timed_out_loads["redis"] == 1 and worker.figures.loaded["redis"] == 1
        assert "1 not loaded (1 past the deadline)" in worker.describe()
    finally:
        store.release.set()
    worker.transfers.close()  # type: ignore[union-attr]
    assert worker.received() == (set(), set())  # its late bytes are dropped, never copied
    assert all(torch.equal(a, b[1]) for a, b in zip(before, target))


def test_a_fetch_a_store_fails_reports_its_request_with_every_block_failed(clock):
    class DownStore(GatedStore):
        def get_many(self, keys):
            raise ConnectionError("redis is down")

    worker, _ = _worker(DownStore({}), clock)
    plan = StepPlan(loads=(_load("a", b"k0", 0), _load("a", b"k1", 3)), receiving=("a",))
    try:
        worker.start_receiving(plan)
        assert _receive_until(worker, "a") == ({"a"}, {0, 3})
        assert worker.figures.failed_loads["redis"] == 2
    finally:
        worker.close()


def test_missing_and_wrong_sized_payloads_are_failed_blocks_of_a_received_request(clock):
    _, payloads = _source_payloads()
    payloads[b"k1"] = b"short"
    worker, _ = _worker(GatedStore(payloads), clock)
    plan = StepPlan(loads=(_load("a", b"k0", 0), _load("a", b"k1", 1), _load("a", b"absent", 2)), receiving=("a",))
    try:
        worker.start_receiving(plan)
        assert _receive_until(worker, "a") == ({"a"}, {1, 2})
        assert worker.figures.loaded["redis"] == 1
    finally:
        worker.close()


def test_a_receiving_request_with_only_host_loads_is_received_at_once(clock):
    worker, caches = _worker(GatedStore({}), clock)
    worker.host = torch.zeros((3, fingerprint().block_bytes), dtype=torch.uint8)
    worker.host[2] = worker.layout.read(4)
    load = VllmBlockLoad(request_id="a", tier="cpu", key=b"k", block_id=0, slot=2)
    try:
        worker.start_receiving(StepPlan(loads=(load,), receiving=("a",)))
        assert worker.received() == ({"a"}, set())
        assert all(torch.equal(layer[0], layer[4]) for layer in caches)
    finally:
        worker.close()


def test_load_copies_only_the_requests_that_are_not_receiving(clock):
    source, payloads = _source_payloads()
    store = GatedStore(payloads, gated=[b"k1"])
    worker, target = _worker(store, clock)
    plan = StepPlan(loads=(_load("waits", b"k1", 1), _load("now", b"k3", 3)), receiving=("waits",))
    try:
        worker.start_receiving(plan)
        assert store.read_started.wait(5)
        assert worker.load(plan) == set()  # "now" is read and copied on this thread, past the stalled fetch
        assert all(torch.equal(a[3], b[3]) for a, b in zip(source, target))
        assert worker.received() == (set(), set())
    finally:
        store.release.set()
        worker.close()


def test_a_worker_without_threads_refuses_an_async_plan_naming_the_requests():
    layout = KVBlockLayout(cpu_caches(), BLOCKS, fingerprint().block_bytes)
    worker = TierWorker(layout, {}, None)
    with pytest.raises(ConfigError, match=r"\['a'\]"):
        worker.start_receiving(StepPlan(loads=(_load("a", b"k", 1),), receiving=("a",)))


def test_a_full_save_queue_drops_the_save_and_counts_it_never_waiting(clock):
    store = GatedStore({})
    store.hold_puts = True
    worker, _ = _worker(store, clock, max_queued_saves=1)
    transfers = worker.transfers
    assert transfers is not None

    def plan(*block_ids: int) -> StepPlan:
        return StepPlan(
            saves=tuple(VllmBlockSave(key=f"s{b}".encode(), block_id=b, tiers=("redis",)) for b in block_ids)
        )

    try:
        worker.save(plan(0, 1))
        assert store.put_started.wait(5)  # the save thread holds the first write
        worker.save(plan(2))  # waits in the queue
        worker.save(plan(3, 4))  # finds it full: dropped
        assert worker.figures.dropped_saves["redis"] == 2 and transfers.figures.saves_dropped == 1
        assert "2 dropped (save queue full)" in worker.describe()
    finally:
        store.release.set()
    assert transfers.drain_saves(5)
    assert sorted(store.payloads) == [b"s0", b"s1", b"s2"] and worker.figures.saved["redis"] == 3
    worker.close()


# -- lookups off the step ---------------------------------------------------------------------------


class GatedLookup(DictStore):
    """A store's lookup that waits for ``release`` while ``gated``."""

    def __init__(self, name: str, keys: Sequence[bytes] = ()) -> None:
        super().__init__(name, keys)
        self.gated = False
        self.release = threading.Event()
        self.started = threading.Event()

    def contains_prefix(self, keys: Sequence[bytes]) -> int:
        if self.gated:
            self.started.set()
            assert self.release.wait(10), "the test never released the stalled lookup"
        return super().contains_prefix(keys)


def _planner_with_lookups(request: FakeRequest, clock: FakeClock, host_blocks: int, redis: GatedLookup):
    host = HostTier(8)
    for key in request.block_hashes[:host_blocks]:
        host.reserve(key)
    host.release(list(range(1, host_blocks + 1)))
    threads = TransferThreads("lookup", load_threads=2, load_deadline_s=1.0, clock=clock)
    return TierPlanner([host, ByteTier(redis)], BS, async_loads=True, lookups=threads), host, threads


def _match_when_back(planner: TierPlanner, request: FakeRequest, threads: TransferThreads) -> int:
    while (tokens := planner.match(request, 0)) is None:
        threads.wait_for_loads(timeout=5)
    return tokens


def test_a_lookup_runs_off_the_step_and_answers_once_it_is_back(clock):
    request = FakeRequest("a", list(range(21)))  # 5 offerable blocks: 2 on the host tier, 2 in Redis
    redis = GatedLookup("redis", request.block_hashes[2:4])
    planner, _, threads = _planner_with_lookups(request, clock, 2, redis)
    try:
        assert planner.match(request, 0) is None  # asked: not known yet, vLLM skips it this step
        assert _match_when_back(planner, request, threads) == 16
        assert planner.hit_tokens_by_tier("a") == {"cpu": 8, "redis": 8} and planner.loads_async("a")
        asked = redis.lookups
        assert planner.match(request, 0) == 16 and redis.lookups == asked  # asked again: the same answers
    finally:
        threads.close()


def test_a_stalled_lookup_holds_only_its_request_and_misses_at_the_deadline(clock):
    slow, fast = FakeRequest("slow", list(range(21))), FakeRequest("fast", list(range(100, 121)))
    redis = GatedLookup("redis", slow.block_hashes + fast.block_hashes)
    planner, _, threads = _planner_with_lookups(slow, clock, 1, redis)
    try:
        redis.gated = True
        assert planner.match(slow, 0) is None
        assert redis.started.wait(5)
        redis.gated = False
        assert _match_when_back(planner, fast, threads) == 20  # another request's lookup comes back
        assert planner.match(slow, 0) is None
        clock.now = 1.0  # the slow lookup's deadline: its store counts as a miss, the host tier still serves
        assert planner.match(slow, 0) == 4 and planner.hit_tokens_by_tier("slow") == {"cpu": 4}
        assert planner.lookups is not None and planner.lookups.timed_out == 1
    finally:
        redis.release.set()
        threads.close()


def test_a_host_block_evicted_while_the_lookup_ran_ends_the_match_there(clock):
    request = FakeRequest("a", list(range(21)))
    redis = GatedLookup("redis", request.block_hashes[2:4])
    planner, host, threads = _planner_with_lookups(request, clock, 2, redis)
    try:
        assert planner.match(request, 0) is None
        host.clear()  # the host tier forgets its blocks before the answers are used
        assert _match_when_back(planner, request, threads) == 0  # Redis was asked from block 2, not block 0
    finally:
        threads.close()


def test_an_admitted_request_is_not_looked_up_again_and_a_finished_one_is_forgotten(clock):
    request = FakeRequest("a", list(range(21)))
    redis = GatedLookup("redis", request.block_hashes)
    planner, _, threads = _planner_with_lookups(request, clock, 0, redis)
    try:
        planner.add(request)
        assert _match_when_back(planner, request, threads) == 20
        planner.allocated(request, [1, 2, 3, 4, 5, 6], 20)
        assert planner.match(request, 0) == 0  # asked again after its async load: the host tier only
        other = FakeRequest("b", list(range(21)))
        assert planner.match(other, 0) is None  # another request is looked up
        planner.finished("b")
        assert planner.lookups is not None and planner.lookups.num_pending == 0
        assert redis.lookups == 1  # Redis holds every block: one call per lookup
    finally:
        threads.close()


def test_a_request_whose_async_load_failed_is_not_offered_the_stores_again():
    # vLLM frees a request whose asynchronous load failed from its first block and asks about it anew:
    # a store that lists blocks it cannot return must not be offered them again, or the request loops
    request = FakeRequest("a", list(range(21)))
    planner, _ = _host_and_redis(request, 1, slice(0, 5))
    planner.add(request)
    assert planner.match(request, 0) == 20 and planner.loads_async("a")  # block 0 from cpu, 1-4 from Redis
    planner.allocated(request, [1, 2, 3, 4, 5, 6], 20)
    assert planner.build([]).receiving == ("a",)
    assert planner.match(request, 0) == 4  # the host tier's block only, copied on the step
    assert planner.hit_tokens_by_tier("a") == {"cpu": 4} and not planner.loads_async("a")
