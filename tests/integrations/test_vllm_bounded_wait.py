"""The vLLM connector's asynchronous loads wait only as long as the compute they save: the engine's rule.

The scheduler's planner prices each receiving request's fetch with load or compute's measurement
(``TransferCosts.load_wait``, carried in the plan); the worker reads it in those pieces on its load
threads (``PieceFetch``, the engine's) and gives up at the bound: the blocks that arrived are
used, the rest are failed loads vLLM recomputes, the miss is counted and sent to the scheduler,
whose load or compute then neither loads from nor looks up in the tier until the late piece's
real time comes back. No vLLM: both halves are driven as ``KVPoolConnector`` drives them.

Every wait is on an event or a condition: the store's reads are gated piece by piece, and the
transfer threads' clock is a fake the test moves, so deadlines are reached by moving it.
"""

from __future__ import annotations

import pickle
import threading
from collections.abc import Callable, Sequence

import pytest
import torch

from kvpool.integrations.vllm.blocks import KVBlockLayout, TierWorker
from kvpool.integrations.vllm.plan import StepPlan, TierPlanner, TransferNotes
from kvpool.tiers import ByteTier, TierStats
from kvpool.tiers.load_or_compute import LoadOrCompute, LoadWait, TransferCosts, registry_links
from kvpool.tiers.piece_fetch import DeadlineMiss, PieceFetch
from kvpool.tiers.transfer_threads import TransferThreads
from tests.integrations.test_vllm_async import FakeClock, GatedLookup
from tests.integrations.test_vllm_blocks import BS, HEAD, HEADS, LAYERS, fingerprint
from tests.integrations.test_vllm_plan import FakeRequest

NUM_BLOCKS = 40  # vLLM's blocks in the fake KV cache
OFFERED = 16  # blocks of the request the stores hold
RATE = 1_000.0  # prefill tokens per second: a 4-token block computes in 4 ms (set, not measured)
FIXED = 600.0  # the fixed deadline: far above any compute bound, so reaching it would fail a test
BLOCK_BYTES = fingerprint().block_bytes


def caches(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(NUM_BLOCKS, HEADS, BS, 2 * HEAD, generator=g).to(torch.bfloat16) for _ in range(LAYERS)]


def until(condition: Callable[[], bool]) -> None:
    """Wait for ``condition`` (a thread's progress), on an event; the bound only ends a broken test."""
    tick = threading.Event()
    for _ in range(10_000):
        if condition():
            return
        tick.wait(0.001)
    raise AssertionError("the condition never held")


class PieceStore:
    """A store in memory whose first ``free`` reads answer at once; each later one waits for ``release``.

    ``started``: reads begun (a condition the test waits on); ``fail_from``: reads from that index
    raise (the store went away mid-load); ``garble_from``: reads from that index answer garbage.
    """

    def __init__(self, name: str, payloads: dict[bytes, bytes], free: int) -> None:
        self.name = name
        self.payloads = dict(payloads)
        self.free = free
        self.fail_from: int | None = None
        self.garble_from: int | None = None
        self.sizes: list[int] = []
        self.release = threading.Event()
        self.stats = TierStats()
        self._lock = threading.Condition()

    @property
    def started(self) -> int:
        with self._lock:
            return len(self.sizes)

    def get_many(self, keys: Sequence[bytes]) -> list[object]:
        with self._lock:
            index = len(self.sizes)
            self.sizes.append(len(keys))
        if index >= self.free:
            assert self.release.wait(10), "the test never released the held read"
        if self.fail_from is not None and index >= self.fail_from:
            raise ConnectionError("redis went away")
        if self.garble_from is not None and index >= self.garble_from:
            return ["not a payload"] * len(keys)
        return [self.payloads.get(k) for k in keys]

    def put_many(self, items: Sequence[tuple[bytes, bytes]]) -> int:
        self.payloads.update(items)
        return len(items)

    def close(self) -> None:
        pass


class Setup:
    """A planner with load or compute over a Redis tier, and a worker on a fake clock, sharing nothing but plans."""

    def __init__(self, free: int, *, lookups: bool = False) -> None:
        self.request = FakeRequest("a", list(range(OFFERED * BS + 1)))
        self.source = caches(1)
        layout = KVBlockLayout(self.source, NUM_BLOCKS, BLOCK_BYTES)
        self.block_ids = list(range(20, 20 + OFFERED + 1))  # vLLM's blocks for the request
        payloads = {bytes(h): layout.read(i).numpy().tobytes() for i, h in enumerate(self.request.block_hashes)}
        self.store = PieceStore("redis", payloads, free)
        costs = TransferCosts(registry_links(["redis"]), block_bytes=BLOCK_BYTES, prefill_tokens_per_s=RATE)
        self.chooser = LoadOrCompute(costs, block_size=BS)
        self.clock = FakeClock()
        self.lookup_threads = None
        self.lookup_store = GatedLookup("redis", self.request.block_hashes)
        if lookups:
            self.lookup_threads = TransferThreads("test-lookups", load_deadline_s=FIXED, clock=self.clock)
        self.planner = TierPlanner(
            [ByteTier(self.lookup_store)],
            BS,
            async_loads=True,
            chooser=self.chooser,
            lookups=self.lookup_threads,
            load_deadline_s=FIXED,
        )
        self.transfers = TransferThreads("test-loads", load_deadline_s=FIXED, clock=self.clock)
        self.target = caches(2)
        self.before = [t.clone() for t in self.target]
        target_layout = KVBlockLayout(self.target, NUM_BLOCKS, BLOCK_BYTES)
        self.worker = TierWorker(target_layout, {"redis": self.store}, None, self.transfers)

    def admit(self, request: FakeRequest | None = None) -> StepPlan:
        """Admit the request (its whole offer loaded, asynchronously) and build the step that plans its fetch."""
        request = request or self.request
        assert self.match(request) == OFFERED * BS and self.planner.loads_async(request.request_id)
        self.planner.allocated(request, self.block_ids, OFFERED * BS)
        return self.planner.build([])

    def match(self, request: FakeRequest) -> int:
        while (tokens := self.planner.match(request, 0)) is None:
            assert self.lookup_threads is not None
            self.lookup_threads.wait_for_loads(timeout=5)
        return tokens

    def copied(self, block_id: int) -> bool:
        """Whether vLLM's block ``block_id`` holds the payload of the request's block loaded into it."""
        index = self.block_ids.index(block_id)
        return all(torch.equal(s[index], t[block_id]) for s, t in zip(self.source, self.target))

    def untouched(self, block_id: int) -> bool:
        return all(torch.equal(b[block_id], t[block_id]) for b, t in zip(self.before, self.target))

    def close(self) -> None:
        self.store.release.set()
        self.transfers.close(drain_timeout=5)
        if self.lookup_threads is not None:
            self.lookup_threads.close()


def receive_until_done(s: Setup, plan: StepPlan, request_id: str) -> set[int]:
    """Start ``plan``'s loads and take the worker's answers until ``request_id``'s is in; its failed blocks."""
    s.worker.start_receiving(plan)
    done: set[str] = set()
    failed: set[int] = set()
    while request_id not in done:
        s.transfers.wait_for_loads(timeout=5)
        got, lost = s.worker.received()
        done |= got
        failed |= lost
    return failed


@pytest.fixture
def make():
    made: list[Setup] = []

    def build(free: int, **kwargs: bool) -> Setup:
        made.append(Setup(free, **kwargs))
        return made[-1]

    yield build
    for setup in made:
        setup.close()


def test_the_plan_carries_the_engine_s_wait_for_each_receiving_request_and_pickles(make):
    s = make(free=OFFERED)
    plan = s.admit()
    assert plan.receiving == ("a",) and [rid for rid, _ in plan.waits] == ["a"]
    wait = dict(plan.waits)["a"]
    expected = s.chooser.costs.load_wait([("redis", OFFERED)], block_size=BS, cap_s=FIXED)
    assert wait == expected  # the engine's rule, priced by the scheduler's measurement: not a copy of it
    assert len(wait.pieces) > 1 and wait.num_blocks == OFFERED
    assert pickle.loads(pickle.dumps(plan)) == plan  # vLLM sends the plan to its workers


def test_a_fetch_that_comes_back_in_time_is_used_whole(make):
    s = make(free=OFFERED)
    plan = s.admit()
    failed = receive_until_done(s, plan, "a")
    assert failed == set() and all(s.copied(b) for b in s.block_ids[:OFFERED])
    assert s.store.sizes == [n for _, n in dict(plan.waits)["a"].pieces]  # read in the planned pieces
    assert s.worker.figures.deadline_misses["redis"] == 0 and s.worker.figures.loaded["redis"] == OFFERED


def test_a_trickling_store_is_waited_for_only_the_compute_it_saves_and_gives_the_blocks_that_arrived(make):
    s = make(free=1)  # the first piece comes at once; the second is held
    plan = s.admit()
    wait = dict(plan.waits)["a"]
    first, second = wait.pieces[0][1], wait.pieces[1][1]
    s.worker.start_receiving(plan)
    until(lambda: s.store.started == 2)  # the first piece landed; the thread is in the second
    bound = wait.deadline_s(first)
    assert bound <= wait.block_compute_s * (first + second) < FIXED  # bounded by the compute, not the deadline
    s.clock.now = bound * 0.99
    assert s.worker.received() == (set(), set())  # before its bound it waits
    s.clock.now = bound * 1.01
    done, failed = s.worker.received()
    ids = s.block_ids[:OFFERED]
    assert done == {"a"} and failed == set(ids[first:])  # the rest: load errors, vLLM recomputes them
    assert all(s.copied(b) for b in ids[:first]) and all(s.untouched(b) for b in ids[first:])
    f = s.worker.figures
    assert (f.deadline_misses["redis"], f.kept_at_deadline["redis"], f.loaded["redis"]) == (1, first, first)
    assert f.timed_out_loads["redis"] == f.failed_loads["redis"] == OFFERED - first
    assert s.worker.received() == (set(), set()) and s.worker.num_receiving == 0  # reported once
    # the scheduler learns the miss: Redis owes its late piece, so the next request computes at once
    notes = s.worker.take_notes()
    assert notes is not None and [(t, n) for t, n, _, _ in notes.loads] == [("redis", first)]
    (miss,) = notes.misses
    assert (miss.tier, miss.late_blocks, miss.abandoned_blocks, miss.reading) == (
        "redis",
        second,
        OFFERED - first,
        True,
    )
    assert miss.seconds == pytest.approx(bound * 1.01)
    s.planner.note(notes)
    costs = s.chooser.costs
    assert costs.owes("redis")
    figures = s.chooser.figures()["tiers"]["redis"]
    assert (figures["deadline_misses"], figures["blocks_abandoned"], figures["late_pieces"]) == (1, OFFERED - first, 1)
    other = FakeRequest("b", s.request.tokens)
    assert s.planner.match(other, 0) == 0  # not loaded from while it owes a piece
    s.planner.allocated(other, [], 0)
    # the late piece arrives: its bytes are never copied, its real time goes to the scheduler
    s.store.release.set()
    until(lambda: s.worker.received() == (set(), set()) and s.worker.num_late == 0)  # its thread is done
    notes = s.worker.take_notes()
    assert notes is not None and notes.late_done == ["redis"]
    assert [(t, n) for t, n, _, _ in notes.loads] == [("redis", second)]
    assert s.store.sizes == [first, second]  # no piece after the late one was read
    assert all(s.untouched(b) for b in ids[first:])
    s.planner.note(notes)
    assert not costs.owes("redis")


def test_a_stalled_store_costs_one_piece_of_compute_and_is_then_not_looked_up(make):
    s = make(free=0, lookups=True)  # never answers until released
    plan = s.admit()
    wait = dict(plan.waits)["a"]
    s.worker.start_receiving(plan)
    until(lambda: s.store.started == 1)
    s.clock.now = wait.deadline_s(0) * 1.01  # one piece's compute, not the fixed deadline
    done, failed = s.worker.received()
    assert done == {"a"} and failed == set(s.block_ids[:OFFERED])
    assert all(s.untouched(b) for b in s.block_ids)
    notes = s.worker.take_notes()
    assert notes is not None
    assert [(m.late_blocks, m.abandoned_blocks, m.reading) for m in notes.misses] == [
        (wait.pieces[0][1], OFFERED, True)
    ]
    s.planner.note(notes)
    lookups = s.lookup_store.lookups
    other = FakeRequest("b", s.request.tokens)
    assert s.planner.match(other, 0) == 0  # a tier that owes a piece is not even asked
    assert s.lookup_store.lookups == lookups and s.chooser.lookups["skipped"] == 1


def test_a_store_that_goes_away_mid_load_gives_the_pieces_before_and_the_rest_is_computed(make):
    s = make(free=OFFERED)
    s.store.fail_from = 2  # the third piece's read raises
    plan = s.admit()
    pieces = dict(plan.waits)["a"].pieces
    kept = pieces[0][1] + pieces[1][1]
    failed = receive_until_done(s, plan, "a")
    ids = s.block_ids[:OFFERED]
    assert failed == set(ids[kept:]) and all(s.copied(b) for b in ids[:kept])
    assert s.store.sizes == [n for _, n in pieces[:3]]  # nothing read after the failed piece
    assert s.worker.figures.failed_loads["redis"] == OFFERED - kept
    assert s.worker.figures.deadline_misses["redis"] == 0  # it failed, it did not run late


def test_a_store_that_answers_garbage_is_a_miss_from_that_piece(make):
    s = make(free=OFFERED)
    s.store.garble_from = 1
    plan = s.admit()
    first = dict(plan.waits)["a"].pieces[0][1]
    failed = receive_until_done(s, plan, "a")
    assert failed == set(s.block_ids[first:OFFERED]) and all(s.copied(b) for b in s.block_ids[:first])


def test_a_plan_whose_wait_does_not_fit_its_loads_waits_the_fixed_deadline(make):
    s = make(free=0)
    plan = s.admit()
    bogus = LoadWait((("redis", 3),), (0.001,), 0.001, FIXED)  # made for other blocks
    s.worker.start_receiving(StepPlan(loads=plan.loads, receiving=plan.receiving, waits=(("a", bogus),)))
    until(lambda: s.store.started == 1)
    assert s.store.sizes == [OFFERED]  # one piece, the whole run
    s.clock.now = 1.0  # far past any compute bound
    assert s.worker.received() == (set(), set())
    s.clock.now = FIXED
    done, failed = s.worker.received()
    assert done == {"a"} and failed == set(s.block_ids[:OFFERED])


def test_a_worker_s_garbled_notes_are_dropped_never_raised(make):
    s = make(free=0)
    bad = TransferNotes(
        loads=[("nowhere", 1, 1, 0.1), ("redis", 1, 1, -1.0)],
        failed=[("redis", "x", 0.1)],  # type: ignore[list-item]
        misses=[DeadlineMiss("nowhere", 1, 1, 0.1, True), "junk"],  # type: ignore[list-item]
        late_done=["redis", "nowhere"],  # owed nothing
    )
    s.planner.note(bad)
    assert not s.chooser.costs.owes("redis") and s.chooser.figures()["tiers"]["redis"]["loads"] == 0


def test_a_piece_fetch_refuses_no_blocks_and_answers_a_short_read_as_missing():
    with pytest.raises(Exception, match="one or more blocks"):
        PieceFetch([], None, fixed_deadline_s=1.0)
    fetch = PieceFetch(["redis"] * 3, None, fixed_deadline_s=1.0)
    assert fetch.run(lambda tier, start, stop: [True]) == [True, False, False]
    assert fetch.landed == 0 and fetch.deadline_s() == 1.0
