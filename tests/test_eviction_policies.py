"""Every eviction policy in the registry passes the same contract, plus each policy's own rules."""

from __future__ import annotations

import random

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import initialize, precondition, rule

from kvpool import BlockRemoved, KVCacheManager, Request
from kvpool.block import KVBlock
from kvpool.errors import ConfigError, InvariantViolation
from kvpool.eviction import (
    POLICIES,
    FreeQueuePolicy,
    SupportsHitReports,
    SupportsWaitingHints,
    resolve_policy,
)
from kvpool.eviction.frequency import FrequencyAgedQueue
from kvpool.eviction.waiting import WaitingAwareQueue
from kvpool.free_queue import FreeBlockQueue
from tests.helpers import admit, snapshot
from tests.test_properties import SETTINGS, ManagerMachine

NAMES = sorted(POLICIES)


def make_manager(name: str, num_blocks: int = 12, block_size: int = 4, **kwargs) -> KVCacheManager:
    return KVCacheManager(num_blocks, block_size, eviction_policy=POLICIES[name], **kwargs)


def in_use(mgr: KVCacheManager) -> set[int]:
    return {b for rid in mgr.running_request_ids() for b in mgr.get_block_ids(rid)[0] if b}


# -- the registry and the interface ------------------------------------------------------


def test_registry_names_the_default_and_is_read_only():
    assert POLICIES["lru"] is FreeBlockQueue
    assert {"frequency", "waiting"} <= set(POLICIES)
    with pytest.raises(TypeError):
        POLICIES["mine"] = FreeBlockQueue  # type: ignore[index]
    assert resolve_policy("frequency") == ("frequency", FrequencyAgedQueue)
    assert resolve_policy(WaitingAwareQueue) == ("waiting", WaitingAwareQueue)
    with pytest.raises(ConfigError, match="unknown eviction policy"):
        resolve_policy("belady")


@pytest.mark.parametrize("name", NAMES)
def test_every_policy_implements_the_protocol(name):
    queue = POLICIES[name]([KVBlock(0)], 8)
    assert isinstance(queue, FreeQueuePolicy)


def test_optional_capabilities():
    assert not isinstance(FreeBlockQueue([KVBlock(0)], 4), SupportsHitReports)
    assert isinstance(FrequencyAgedQueue([KVBlock(0)], 4), SupportsHitReports)
    assert not isinstance(FrequencyAgedQueue([KVBlock(0)], 4), SupportsWaitingHints)
    assert isinstance(WaitingAwareQueue([KVBlock(0)], 4), SupportsWaitingHints)


def test_the_default_pool_touch_is_the_plain_loop():
    plain = KVCacheManager(8, 4).pool
    reporting = make_manager("frequency").pool
    assert plain.touch.__func__ is type(plain)._touch
    assert reporting.touch.__func__ is type(reporting)._touch_reporting_hits


@pytest.mark.parametrize("bad", [(), (0, 1), (2, 1), (1.5,)])
def test_frequency_weights_are_validated(bad):
    with pytest.raises(ConfigError):
        FrequencyAgedQueue([KVBlock(0)], 4, weights=bad)
    with pytest.raises(ConfigError):
        FrequencyAgedQueue([KVBlock(0)], 4, ghost_capacity=-1)


# -- the shared contract -----------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_reference_scenario_gives_the_same_blocks(name, system_prompt):
    mgr = make_manager(name, enable_events=True)
    a = Request("A", system_prompt + [1, 2, 3, 4, 5])
    assert admit(mgr, a) == ([1, 2, 3, 4, 5],)
    b = Request("B", system_prompt + [7, 8, 9, 10])
    hit, num_hit = mgr.get_computed_blocks(b)
    assert num_hit == 12 and hit.block_ids == ([1, 2, 3],)
    assert mgr.allocate_slots(b, b.num_tokens - num_hit, num_hit, hit) == ([6],)
    b.num_computed_tokens = b.num_tokens
    mgr.check_invariants()
    mgr.free(a)
    mgr.free(b)
    mgr.check_invariants()
    # Uncached block 5 first, then never-used blocks in ID order, then cached blocks,
    # the questions (4, 6) before the shared prefix, children before parents.
    assert mgr.free_queue_block_ids() == [5, 7, 8, 9, 10, 11, 4, 6, 3, 2, 1]
    c = Request("C", system_prompt + [7, 8, 9, 10], cache_salt="T2")
    assert admit(mgr, c) == ([5, 7, 8, 9],)
    d = Request("D", system_prompt + [7, 8, 9, 10])
    assert admit(mgr, d) == ([10],)
    assert mgr.get_block_ids("D") == ([1, 2, 3, 10],)
    mgr.take_events()
    e = Request("E", list(range(500, 512)))
    assert admit(mgr, e) == ([11, 4, 6],)
    removed = [ev.block_hashes[0] for ev in mgr.take_events() if isinstance(ev, BlockRemoved)]
    assert removed == [a.block_hashes[3], b.block_hashes[3]]
    assert mgr.num_free_blocks == 0
    mgr.check_invariants()


@pytest.mark.parametrize("name", NAMES)
def test_a_refused_allocation_changes_nothing(name):
    mgr = make_manager(name, num_blocks=8)
    first = Request("a", list(range(14)))
    admit(mgr, first)
    mgr.free(first)
    admit(mgr, Request("b", list(range(100, 110))))
    big = Request("c", list(range(13)) + [999] * 8)
    before = snapshot(mgr)
    hit, num_hit = mgr.get_computed_blocks(big)
    assert num_hit == 12
    assert mgr.allocate_slots(big, big.num_tokens - num_hit, num_hit, hit) is None
    assert snapshot(mgr)[:-1] == before[:-1]  # only the lookup stats moved
    mgr.check_invariants()


@pytest.mark.parametrize("name", NAMES)
def test_free_counts_add_up_through_a_random_run(name):
    rng = random.Random(7)
    mgr = make_manager(name, num_blocks=30, block_size=2)
    running: list[Request] = []
    for i in range(300):
        if running and rng.random() < 0.45:
            mgr.free(running.pop(rng.randrange(len(running))))
        else:
            prefix = [[1, 2, 3, 4, 5, 6], [9, 9, 9], []][rng.randrange(3)]
            req = Request(f"r{i}", prefix + [rng.randrange(4) for _ in range(rng.randrange(1, 7))])
            if admit(mgr, req) is not None:
                running.append(req)
        assert mgr.num_free_blocks + len(in_use(mgr)) == mgr.num_blocks - 1
        assert len(mgr.free_queue_block_ids()) == mgr.num_free_blocks
        mgr.check_invariants()


@pytest.mark.parametrize("name", NAMES)
def test_never_used_blocks_are_handed_out_lazily_in_id_order(name):
    blocks = [KVBlock(0)]
    queue = POLICIES[name](blocks, 1_000_000)
    assert queue.num_free_blocks == 999_999 and queue.num_never_used == 999_999
    assert len(blocks) == 1
    assert [b.block_id for b in queue.popleft_n(3)] == [1, 2, 3]
    assert [b.block_id for b in blocks] == [0, 1, 2, 3]
    queue.check()


@pytest.mark.parametrize("name", NAMES)
def test_uncached_freed_blocks_are_reused_first(name):
    mgr = make_manager(name, num_blocks=10)
    cached = Request("a", list(range(8)))  # two full blocks, cached
    partial = Request("b", [50, 51])  # one partial block, never cached
    admit(mgr, cached)
    admit(mgr, partial)
    mgr.free(cached)
    mgr.free(partial)
    order = mgr.free_queue_block_ids()
    assert order[0] == mgr.pool.blocks[3].block_id == 3
    assert order[1:6] == [4, 5, 6, 7, 8, 9][:5]
    assert set(order[-2:]) == {1, 2}


@pytest.mark.parametrize("name", NAMES)
def test_hashes_are_evicted_only_when_the_block_is_taken(name):
    mgr = make_manager(name, num_blocks=5)
    a = Request("a", list(range(8)) + [1])
    admit(mgr, a)
    mgr.free(a)
    index = mgr.pool.indexes[0]
    assert len(index) == 2  # still cached while free
    hit, num_hit = mgr.get_computed_blocks(Request("x", list(range(8)) + [5]))
    assert num_hit == 8
    admit(mgr, Request("b", [7, 7]))  # one partial block: takes a's uncached block
    assert len(index) == 2 and mgr.pool.num_evictions == 0
    other = Request("c", [3] * 5)  # takes the never-used block, then one cached block
    admit(mgr, other)
    assert mgr.pool.num_evictions == 1  # a's deepest block made room
    assert len(index) == 2  # a's first block and c's block
    _, num_hit = mgr.get_computed_blocks(Request("y", list(range(8)) + [5]))
    assert num_hit == 4  # the parent survived its child
    mgr.check_invariants()


@pytest.mark.parametrize("name", NAMES)
def test_check_catches_a_broken_link(name):
    mgr = make_manager(name, num_blocks=8)
    a = Request("a", list(range(20)))
    admit(mgr, a)
    mgr.free(a)
    queue = mgr.pool.free_queue
    queue.check()
    victim = mgr.pool.blocks[2]
    victim.prev_free = mgr.pool.blocks[4]
    with pytest.raises(InvariantViolation):
        queue.check()


@pytest.mark.parametrize("name", NAMES)
def test_check_catches_a_wrong_count(name):
    mgr = make_manager(name, num_blocks=8)
    a = Request("a", list(range(20)))
    admit(mgr, a)
    mgr.free(a)
    mgr.pool.free_queue.num_free_blocks += 1
    with pytest.raises(InvariantViolation):
        mgr.check_invariants()


@pytest.mark.parametrize("name", NAMES)
def test_removing_a_block_that_is_not_free_is_refused(name):
    mgr = make_manager(name, num_blocks=8)
    a = Request("a", list(range(9)))
    admit(mgr, a)
    with pytest.raises(InvariantViolation):
        mgr.pool.free_queue.remove(mgr.pool.blocks[1])
    with pytest.raises(InvariantViolation):
        mgr.pool.free_queue.popleft_n(mgr.num_free_blocks + 1)


def _random_replay(name: str, seed: int) -> list[list[int]]:
    """A seeded run of admissions, hints and frees; the free-queue order after every step."""
    rng = random.Random(seed)
    mgr = make_manager(name, num_blocks=40, block_size=2)
    running: list[Request] = []
    waiting: list[Request] = []
    orders = []
    for i in range(400):
        roll = rng.random()
        if running and roll < 0.4:
            mgr.free(running.pop(rng.randrange(len(running))))
        elif roll < 0.5:
            waiting.append(Request(f"w{i}", [rng.randrange(6) for _ in range(rng.randrange(2, 12))]))
            mgr.note_waiting(waiting)
        else:
            source = waiting.pop(0) if waiting and roll < 0.6 else None
            tokens = (
                list(source.prompt_token_ids) if source else [rng.randrange(6) for _ in range(rng.randrange(1, 12))]
            )
            req = Request(f"r{i}", tokens)
            if admit(mgr, req) is not None:
                running.append(req)
            mgr.note_waiting(waiting)
        orders.append(mgr.free_queue_block_ids())
        mgr.check_invariants()
    return orders


@pytest.mark.parametrize("name", NAMES)
def test_two_identical_runs_give_identical_free_queue_orders(name):
    assert _random_replay(name, 3) == _random_replay(name, 3)


@pytest.mark.parametrize("name", NAMES)
def test_free_queue_order_is_the_hand_out_order(name):
    """``block_ids()`` predicts exactly which blocks ``popleft_n`` hands out next."""
    rng = random.Random(11)
    mgr = make_manager(name, num_blocks=40, block_size=2)
    reqs = []
    for i in range(60):
        req = Request(f"r{i}", [rng.randrange(3) for _ in range(rng.randrange(1, 9))])
        if admit(mgr, req) is not None:
            reqs.append(req)
        if len(reqs) > 3:
            mgr.free(reqs.pop(rng.randrange(len(reqs))))
    for req in reqs:
        mgr.free(req)
    queue = mgr.pool.free_queue
    predicted = list(queue.block_ids())
    handed = [b.block_id for b in queue.popleft_n(queue.num_free_blocks)]
    assert handed == predicted


# -- the frequency policy's own rules ----------------------------------------------------


def test_frequency_keeps_a_reused_block_longer_than_a_one_off():
    mgr = make_manager("frequency", num_blocks=9, block_size=2)
    hot = Request("hot", [1, 2, 3])
    admit(mgr, hot)
    mgr.free(hot)
    for i in range(3):  # the hot prefix is hit three times
        again = Request(f"hot{i}", [1, 2, 3 + i])
        admit(mgr, again)
        mgr.free(again)
    cold = Request("cold", [7, 7, 9])
    admit(mgr, cold)
    mgr.free(cold)
    queue = mgr.pool.free_queue
    hot_block = mgr.pool.indexes[0].get(hot.block_hashes[0])
    cold_block = mgr.pool.indexes[0].get(cold.block_hashes[0])
    assert queue.use_count(hot_block) == 4 and queue.use_count(cold_block) == 1
    order = mgr.free_queue_block_ids()
    # Just released, the one-off is younger than the hot block even scaled by 4.
    assert order.index(hot_block.block_id) < order.index(cold_block.block_id)
    admit(mgr, Request("later", [8, 8, 8]))  # two more blocks written: both age
    order = mgr.free_queue_block_ids()
    # Idle 2 blocks (x1) against idle 4 blocks (/4): the one-off, released later, goes first.
    assert order.index(cold_block.block_id) < order.index(hot_block.block_id)
    mgr.check_invariants()


def test_frequency_counts_hits_on_blocks_in_use():
    mgr = make_manager("frequency", num_blocks=12, block_size=2)
    holders = [Request(f"h{i}", [4, 4, 4, 4, i]) for i in range(3)]
    for req in holders:
        admit(mgr, req)  # the first caches, the others hit while it is in use
    block = mgr.pool.indexes[0].get(holders[0].block_hashes[0])
    assert mgr.pool.free_queue.use_count(block) == 3


def test_frequency_scan_does_not_flush_a_hot_prefix():
    mgr = make_manager("frequency", num_blocks=11, block_size=2)
    hot = [5, 6, 7, 8]
    for i in range(4):
        req = Request(f"hot{i}", hot + [i])
        admit(mgr, req)
        mgr.free(req)
    for i in range(12):  # one-off prompts that together exceed the pool
        req = Request(f"scan{i}", [100 + 2 * i, 101 + 2 * i, 0])
        admit(mgr, req)
        mgr.free(req)
    _, num_hit = mgr.get_computed_blocks(Request("probe", hot + [9]))
    assert num_hit == 4
    lru = make_manager("lru", num_blocks=11, block_size=2)
    for i in range(4):
        req = Request(f"hot{i}", hot + [i])
        admit(lru, req)
        lru.free(req)
    for i in range(12):
        req = Request(f"scan{i}", [100 + 2 * i, 101 + 2 * i, 0])
        admit(lru, req)
        lru.free(req)
    assert lru.get_computed_blocks(Request("probe", hot + [9]))[1] == 0  # LRU lost it


def test_frequency_history_survives_eviction():
    blocks = [KVBlock(0)]
    queue = FrequencyAgedQueue(blocks, 4, ghost_capacity=8)
    (block,) = queue.popleft_n(1)
    block.block_hash = b"h" * 32  # type: ignore[assignment]
    queue.release([], [block])
    queue.on_hit([block])  # as if hit while free: remove, then report
    queue.remove(block)
    queue.release([], [block])
    assert queue.use_count(block) == 2
    taken = queue.popleft_n(3)  # takes the two never-used blocks, then evicts it
    assert taken[-1] is block
    block.block_hash = None
    (other,) = [b for b in taken if b is not block][:1]
    other.block_hash = b"h" * 32  # type: ignore[assignment]
    queue.release([], [other])
    assert queue.use_count(other) == 3  # resumed from the ghost table, plus this use
    queue.check()


def test_frequency_never_ranks_a_child_above_its_parent():
    mgr = make_manager("frequency", num_blocks=20, block_size=2)
    base = Request("base", [1, 1, 2, 2, 3, 3, 0])
    admit(mgr, base)
    mgr.free(base)
    # Hit only the first two blocks many times: their counts rise, the third's does not.
    for i in range(4):
        req = Request(f"p{i}", [1, 1, 2, 2, 9 + i])
        admit(mgr, req)
        mgr.free(req)
    order = mgr.free_queue_block_ids()
    ids = [mgr.pool.indexes[0].get(h).block_id for h in base.block_hashes]
    assert order.index(ids[2]) < order.index(ids[1]) < order.index(ids[0])


# -- the waiting-aware policy's own rules --------------------------------------------------


def test_waiting_hints_protect_a_prefix_until_the_request_leaves_the_queue():
    mgr = make_manager("waiting", num_blocks=7, block_size=2)
    doc = Request("doc", [1, 2, 3, 4, 0])
    admit(mgr, doc)
    mgr.free(doc)
    follow_up = Request("next", [1, 2, 3, 4, 8])
    assert mgr.note_waiting([follow_up]) is True
    for i in range(6):  # one-off prompts that need the whole pool in turn
        req = Request(f"x{i}", [50 + i] * 6)
        admit(mgr, req)
        mgr.free(req)
        mgr.check_invariants()
    _, num_hit = mgr.get_computed_blocks(follow_up)
    assert num_hit == 4
    assert mgr.note_waiting([]) is True
    assert mgr.pool.free_queue.num_protected_hashes == 0
    for i in range(3):
        req = Request(f"y{i}", [70 + i] * 6)
        admit(mgr, req)
        mgr.free(req)
    assert mgr.get_computed_blocks(follow_up)[1] == 0  # no longer protected: evicted
    mgr.check_invariants()


def test_protected_blocks_are_still_handed_out_when_nothing_else_is_left():
    mgr = make_manager("waiting", num_blocks=5, block_size=2)
    doc = Request("doc", [1, 2, 3, 4, 0])
    admit(mgr, doc)
    mgr.free(doc)
    mgr.note_waiting([Request("next", [1, 2, 3, 4, 8])])
    big = Request("big", [9] * 8)
    assert admit(mgr, big) is not None  # needs all four blocks, the protected two included
    mgr.check_invariants()


def test_policies_without_hints_ignore_note_waiting():
    mgr = make_manager("lru")
    assert mgr.note_waiting([Request("w", [1, 2, 3])]) is False
    off = make_manager("waiting", enable_caching=False)
    assert off.note_waiting([Request("w", [1, 2, 3])]) is False


# -- the stateful property machine, once per policy ----------------------------------------


def _machine_for(name: str) -> type[ManagerMachine]:
    factory = POLICIES[name]

    class PolicyMachine(ManagerMachine):
        @initialize(
            num_blocks=st.integers(min_value=4, max_value=40),
            block_size=st.sampled_from([1, 2, 4, 8]),
        )
        def setup(self, num_blocks: int, block_size: int) -> None:
            super().setup(num_blocks, block_size)
            self.mgr = KVCacheManager(num_blocks, block_size, hash_algo=self.hash_algo, eviction_policy=factory)

        @precondition(lambda self: self.waiting)
        @rule(keep=st.integers(min_value=0, max_value=4))
        def hint_waiting(self, keep: int) -> None:
            self.mgr.note_waiting(self.waiting[:keep])

    PolicyMachine.__name__ = f"{name.title()}PolicyMachine"
    return PolicyMachine


TestLruPolicyMachine = _machine_for("lru").TestCase
TestLruPolicyMachine.settings = SETTINGS
TestFrequencyPolicyMachine = _machine_for("frequency").TestCase
TestFrequencyPolicyMachine.settings = SETTINGS
TestWaitingPolicyMachine = _machine_for("waiting").TestCase
TestWaitingPolicyMachine.settings = SETTINGS


def test_every_registered_policy_has_a_machine():
    assert {n.lower() for n in ("Lru", "Frequency", "Waiting")} == set(POLICIES)
