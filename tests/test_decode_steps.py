"""Decode steps that change nothing are skipped (the full-attention group's quiet bound), with the
same decisions as calling the group on every step."""

from __future__ import annotations

import random

import pytest

from kvpool import KVCacheManager, Request
from kvpool.errors import RequestStateError
from kvpool.groups.base import GroupManager


def admit(mgr: KVCacheManager, request: Request) -> tuple[list[int], ...]:
    hit, num_hit = mgr.get_computed_blocks(request)
    new = mgr.allocate_slots(request, request.num_tokens - num_hit, num_hit, hit)
    assert new is not None
    request.num_computed_tokens = request.num_tokens
    return new


def decode(mgr: KVCacheManager, request: Request, token: int) -> tuple[list[int], ...] | None:
    request.append_output_token_ids(token)
    new = mgr.allocate_slots(request, 1)
    if new is not None:
        request.num_computed_tokens += 1
    return new


def test_new_blocks_come_exactly_when_a_step_passes_the_last_slot():
    mgr = KVCacheManager(64, 4)
    a = Request("a", [1, 2, 3, 4, 5, 6])  # 2 blocks, 2 free slots
    admit(mgr, a)
    got = [decode(mgr, a, 100 + i) for i in range(10)]  # tokens 7..16
    taken = [len(new[0]) for new in got]  # type: ignore[index]  # every step fits
    assert taken == [0, 0, 1, 0, 0, 0, 1, 0, 0, 0]  # tokens 9 and 13 open blocks
    assert len(mgr.get_block_ids("a")[0]) == 4
    mgr.check_invariants()


@pytest.mark.parametrize("hash_algo", ["kvpool_sha256", "xxh3_128"])
def test_a_block_is_cached_on_the_step_that_fills_it(hash_algo):
    mgr = KVCacheManager(64, 4, hash_algo=hash_algo)
    prompt = [1, 2, 3, 4, 5, 6]
    a = Request("a", prompt)
    admit(mgr, a)
    outputs = [100, 101, 102, 103, 104, 105]
    for i, token in enumerate(outputs):
        decode(mgr, a, token)
        tokens = prompt + outputs[: i + 1]
        _, num_hit = mgr.get_computed_blocks(Request(f"probe{i}", tokens + [999]))
        assert num_hit == len(tokens) // 4 * 4, f"after {len(tokens)} tokens"
        mgr.check_invariants()


def test_a_step_after_any_other_kind_of_step_still_caches_and_grows():
    mgr = KVCacheManager(64, 4)
    a = Request("a", [1, 2, 3, 4, 5])
    admit(mgr, a)
    a.append_output_token_ids(50)
    assert mgr.allocate_slots(a, 1, num_lookahead_tokens=6) is not None  # slots up to token 12
    a.num_computed_tokens += 1
    assert len(mgr.get_block_ids("a")[0]) == 3
    for token in (51, 52):  # tokens 7, 8: block 1 fills
        assert decode(mgr, a, token) == ([],)
    _, num_hit = mgr.get_computed_blocks(Request("probe", [1, 2, 3, 4, 5, 50, 51, 52, 9]))
    assert num_hit == 8
    assert decode(mgr, a, 53) == ([],)  # token 9 lies in the lookahead block
    for token in range(54, 58):  # tokens 10..13: the fourth block opens at 13
        new = decode(mgr, a, token)
    assert new is not None and len(new[0]) == 1
    mgr.check_invariants()


def test_a_zero_that_is_not_the_int_zero_is_still_refused():
    mgr = KVCacheManager(64, 4)
    a = Request("a", [1, 2, 3])
    admit(mgr, a)
    a.append_output_token_ids(9)
    for name in ("num_lookahead_tokens", "num_new_computed_tokens"):
        with pytest.raises(RequestStateError):
            mgr.allocate_slots(a, 1, **{name: False})
        with pytest.raises(RequestStateError):
            mgr.allocate_slots(a, 1, **{name: 0.0})
    assert mgr.allocate_slots(a, 1) == ([],)


def _never_quiet(mgr: KVCacheManager) -> KVCacheManager:
    """The manager with its group's step replaced by the generic one (quiet bound 0: every step calls)."""
    group = mgr.groups[0]
    group.step = GroupManager.step.__get__(group)  # type: ignore[method-assign]  # a reference without the skip
    return mgr


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("hash_algo", ["kvpool_sha256", "xxh3_128"])
def test_skipping_quiet_steps_makes_the_same_decisions_as_calling_every_step(seed, hash_algo):
    rng = random.Random(seed)
    systems = [KVCacheManager(40, 4, hash_algo=hash_algo), _never_quiet(KVCacheManager(40, 4, hash_algo=hash_algo))]
    shared = [rng.randrange(50) for _ in range(9)]
    prompts = [
        shared[: rng.randrange(1, 10)] + [rng.randrange(50) for _ in range(rng.randrange(1, 12))] for _ in range(12)
    ]
    traces: list[list[object]] = [[], []]
    for mgr, trace in zip(systems, traces):
        running: list[Request] = []
        waiting = [Request(f"r{i}", p) for i, p in enumerate(prompts)]
        local = random.Random(seed)
        for _ in range(120):
            if waiting and local.random() < 0.3:
                request = waiting[0]
                hit, num_hit = mgr.get_computed_blocks(request)
                new = mgr.allocate_slots(request, request.num_tokens - num_hit, num_hit, hit)
                trace.append(("admit", request.request_id, num_hit, new))
                if new is not None:
                    request.num_computed_tokens = request.num_tokens
                    running.append(waiting.pop(0))
            for request in list(running):
                if local.random() < 0.1:
                    mgr.free(request)
                    running.remove(request)
                    trace.append(("free", request.request_id))
                    continue
                trace.append(("decode", request.request_id, decode(mgr, request, local.randrange(50))))
            mgr.check_invariants()
        trace.append(("queue", mgr.free_queue_block_ids()))
        trace.append(("tables", {r.request_id: mgr.get_block_ids(r.request_id) for r in running}))
    assert traces[0] == traces[1]
