"""The contract every group manager keeps, run against every layer type (and a mix of them)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest

from kvpool import CapacityError, KVCacheManager, Request
from kvpool.specs import KVCacheGroup, cdiv
from tests.group_helpers import chunked, cross, full, mamba, mla, sliding
from tests.helpers import snapshot


@dataclass(frozen=True)
class Case:
    name: str
    groups: Callable[[], list[KVCacheGroup]]
    encoder: bool = False  # an encoder-decoder model: pass the prompt length as the encoder input

    def manager(self, num_blocks: int = 64, **kwargs) -> KVCacheManager:
        return KVCacheManager.from_groups(self.groups(), num_blocks, **kwargs)


CASES = [
    Case("full", lambda: [full()]),
    Case("mla", lambda: [mla()]),
    Case("sliding", lambda: [sliding(6)]),
    Case("chunked", lambda: [chunked(8)]),
    Case("mamba", lambda: [mamba()]),
    Case("cross", lambda: [full(), cross(layer=1)], encoder=True),
    Case("hybrid", lambda: [full(bs=8), sliding(6, layer=1), chunked(16, layer=2), mamba(bs=8, layer=3)]),
]


@pytest.fixture(params=CASES, ids=lambda case: case.name)
def case(request) -> Case:
    return request.param


def admit(mgr: KVCacheManager, case: Case, request: Request):
    hit, num_hit = mgr.get_computed_blocks(request)
    mgr.check_invariants()
    encoder = request.num_prompt_tokens if case.encoder else 0
    new = mgr.allocate_slots(request, request.num_tokens - num_hit, num_hit, hit, num_encoder_tokens=encoder)
    mgr.check_invariants()
    if new is not None:
        request.num_computed_tokens = request.num_tokens
    return new


def decode(mgr: KVCacheManager, request: Request, token: int, **kwargs):
    request.append_output_token_ids(token)
    new = mgr.allocate_slots(request, 1, **kwargs)
    mgr.check_invariants()
    if new is not None:
        request.num_computed_tokens += 1
    return new


def exhaust(mgr: KVCacheManager, case: Case) -> None:
    """Admit one-token requests until one is refused: then no group has a block to spare."""
    for i in range(mgr.num_blocks):
        if admit(mgr, case, Request(f"filler-{i}", [10_000 + i])) is None:
            return
    raise AssertionError("the pool never ran out")


def covered(group, request: Request) -> int:
    """Tokens a group's table must cover for a running request."""
    return request.num_prompt_tokens if group.uses_encoder_tokens else request.num_tokens


class TestGroupContract:
    def test_allocation_grows_every_table_to_cover_the_tokens(self, case):
        mgr = case.manager()
        a = Request("a", list(range(13)))
        new = admit(mgr, case, a)
        assert new is not None and len(new) == len(mgr.groups)
        for _ in range(2):
            for group, table in zip(mgr.groups, mgr.get_block_ids("a")):
                assert len(table) == cdiv(covered(group, a), group.block_size)
                assert table[-1] != 0  # the block the next token is written to is real
            for token in range(9):
                assert decode(mgr, a, token) is not None

    def test_the_new_block_ids_are_the_table_growth(self, case):
        mgr = case.manager()
        a = Request("a", list(range(5)))
        admit(mgr, case, a)
        for token in range(20):
            before = mgr.get_block_ids("a")
            new = decode(mgr, a, token)
            after = mgr.get_block_ids("a")
            for old, grown, added in zip(before, after, new):
                assert [b for b in grown[len(old) :] if b] == added
                assert not set(added) & set(old)

    def test_refused_admission_changes_nothing(self, case):
        mgr = case.manager(num_blocks=40)
        exhaust(mgr, case)
        big = Request("big", list(range(200, 240)))
        hit, num_hit = mgr.get_computed_blocks(big)
        before = snapshot(mgr)
        encoder = big.num_tokens if case.encoder else 0
        assert mgr.allocate_slots(big, big.num_tokens - num_hit, num_hit, hit, num_encoder_tokens=encoder) is None
        assert snapshot(mgr) == before
        mgr.check_invariants()

    def test_refused_step_takes_nothing_beyond_releasing_skipped_blocks(self, case):
        mgr = case.manager(num_blocks=40)
        a = Request("a", list(range(9)))
        admit(mgr, case, a)
        exhaust(mgr, case)
        a.append_output_token_ids(list(range(8)))
        mgr.coordinator.remove_skipped_blocks("a", a.num_computed_tokens)  # what any step does first
        before = snapshot(mgr)
        assert mgr.allocate_slots(a, 8) is None
        assert snapshot(mgr) == before
        mgr.check_invariants()

    def test_free_returns_every_non_null_block(self, case):
        mgr = case.manager()
        a = Request("a", list(range(11)))
        admit(mgr, case, a)
        held: set[int] = set()
        for token in range(15):
            held |= {b for table in mgr.get_block_ids("a") for b in table if b}
            decode(mgr, a, token)
        held |= {b for table in mgr.get_block_ids("a") for b in table if b}
        mgr.free(a)
        mgr.check_invariants()
        assert mgr.num_free_blocks == mgr.num_blocks - 1
        assert held <= set(mgr.free_queue_block_ids())
        assert all(not group.tables for group in mgr.groups)

    def test_lookups_change_nothing(self, case):
        mgr = case.manager()
        a = Request("a", list(range(24)) + [1])
        admit(mgr, case, a)
        for token in range(6):
            decode(mgr, a, token)
        before = snapshot(mgr)
        hit, num_hit = mgr.get_computed_blocks(Request("b", list(range(24)) + [2]))
        assert snapshot(mgr)[:-1] == before[:-1]  # only the stats moved
        for group, blocks in zip(mgr.groups, hit.blocks):
            assert len(blocks) * group.block_size == num_hit or (num_hit == 0 and not blocks)
        mgr.check_invariants()

    def test_caching_off_means_no_hits(self, case):
        mgr = case.manager(enable_caching=False)
        a = Request("a", list(range(24)) + [1])
        admit(mgr, case, a)
        mgr.free(a)
        hit, num_hit = mgr.get_computed_blocks(Request("b", list(range(24)) + [1]))
        assert num_hit == 0 and all(not blocks for blocks in hit.blocks)
        assert all(len(index) == 0 for index in mgr.pool.indexes)

    def test_caching_on_finds_a_repeated_prefix_unless_the_model_cannot(self, case):
        mgr = case.manager()
        a = Request("a", list(range(16)))
        admit(mgr, case, a)
        for token in range(17):  # decoding passes every block boundary
            decode(mgr, a, token)
        b = Request("b", list(a.all_token_ids) + [1])
        hit, num_hit = mgr.get_computed_blocks(b)
        if case.encoder:
            assert num_hit == 0
        else:
            assert num_hit >= 16
            assert admit(mgr, case, b) is not None

    def test_the_single_group_fast_path_makes_the_general_path_decisions(self, case):
        fast, general = case.manager(num_blocks=12), case.manager(num_blocks=12)
        requests = {}
        for mgr in (fast, general):
            requests[id(mgr)] = r = Request("a", list(range(7)))
            admit(mgr, case, r)
        empty = general.get_computed_blocks(Request("probe", [1]))[0]  # a hit of 0 tokens: no fast path
        assert empty.num_tokens == 0
        for token in range(40):
            try:
                got_fast = decode(fast, requests[id(fast)], token)
            except CapacityError:
                got_fast = "raised"
            try:
                got_general = decode(general, requests[id(general)], token, new_computed_blocks=empty)
            except CapacityError:
                got_general = "raised"
            assert got_fast == got_general
            assert fast.get_block_ids("a") == general.get_block_ids("a")
            assert fast.free_queue_block_ids() == general.free_queue_block_ids()
            if got_fast is None or got_fast == "raised":
                break
