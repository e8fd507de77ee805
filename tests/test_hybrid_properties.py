"""Stateful property test of hybrid models: random mixes of layer groups sharing one pool.

Random requests with shared prefixes arrive (whole prompts or a first prefill
chunk), advance in chunks or decode, get preempted, finish and come back.
After every step the invariant checker must pass and every block is either
free or held; every prefix hit must cover the same length in every group, hold
exactly the prefix asked for (for a state block: the state after that prefix)
in every real block, and provide every block the layer type reads at the hit
point.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvpool import CapacityError, KVCacheManager, KVPoolError, Request
from kvpool.groups.base import cdiv
from kvpool.specs import LayerKind
from tests.group_helpers import chunked, full, mamba, sliding
from tests.helpers import snapshot

PREFIXES = [list(range(100, 140)), list(range(200, 224)), [7] * 17, []]
KINDS = ("full", "sliding", "chunked", "mamba")


def needed_positions(group, num_tokens: int) -> range:
    """Table positions a group must hold real blocks at for the token at position ``num_tokens``."""
    bs = group.block_size
    if group.spec.kind is LayerKind.MAMBA:  # the state after num_tokens tokens
        return range(cdiv(num_tokens, bs) - 1, cdiv(num_tokens, bs)) if num_tokens else range(0)
    return range(group.num_skipped_tokens(num_tokens) // bs, num_tokens // bs)


class HybridMachine(RuleBasedStateMachine):
    @initialize(
        kinds=st.sets(st.sampled_from(KINDS), min_size=1),
        unit=st.sampled_from([1, 2, 2, 4]),
        multiples=st.lists(st.integers(min_value=1, max_value=3), min_size=4, max_size=4),
        window=st.integers(min_value=1, max_value=24),
        chunk=st.integers(min_value=1, max_value=24),
        num_blocks=st.integers(min_value=6, max_value=80),
    )
    def setup(self, kinds, unit, multiples, window, chunk, num_blocks) -> None:
        builders = {
            "full": lambda bs, layer: full(bs=bs, layer=layer),
            "sliding": lambda bs, layer: sliding(window, bs=bs, layer=layer),
            "chunked": lambda bs, layer: chunked(chunk, bs=bs, layer=layer),
            "mamba": lambda bs, layer: mamba(bs=bs, layer=layer),
        }
        chosen = [k for k in KINDS if k in kinds]
        groups = [builders[k](unit * multiples[i], i) for i, k in enumerate(chosen)]
        self.mgr = KVCacheManager.from_groups(groups, num_blocks)
        self.running: dict[str, Request] = {}
        self.accepted: dict[str, int] = {}  # progress the manager saw at each request's last allocation
        self.waiting: list[Request] = []
        self.next_id = 0
        # block ID -> (group, the token prefix it holds) while it is cached in a table
        self.shadow: dict[int, tuple[int, tuple[int, ...]]] = {}

    # -- helpers -------------------------------------------------------------------

    def _record(self, request: Request) -> None:
        tokens = list(request.all_token_ids)
        for group, table in zip(self.mgr.groups, self.mgr.get_block_ids(request.request_id)):
            for k, block_id in enumerate(table):
                if block_id and self.mgr.pool.block(block_id).block_hash is not None:
                    self.shadow[block_id] = (group.group_id, tuple(tokens[: (k + 1) * group.block_size]))

    def _check_hit(self, request: Request, hit, num_hit: int) -> None:
        assert num_hit < request.num_tokens and num_hit % self.mgr.coordinator.alignment == 0
        tokens = list(request.all_token_ids)
        for group, blocks in zip(self.mgr.groups, hit.blocks):
            assert len(blocks) * group.block_size == num_hit
            for k, block in enumerate(blocks):
                if block.block_id:
                    prefix = tuple(tokens[: (k + 1) * group.block_size])
                    assert self.shadow.get(block.block_id) == (group.group_id, prefix), f"false hit {block}"
            for k in needed_positions(group, num_hit):
                assert blocks[k].block_id, f"group {group.group_id} hit lacks position {k}"

    def _admit(self, request: Request, chunk: int) -> None:
        hit, num_hit = self.mgr.get_computed_blocks(request)
        self._check_hit(request, hit, num_hit)
        todo = request.num_tokens - num_hit
        num_new = min(todo, chunk) if chunk else todo
        try:
            new = self.mgr.allocate_slots(request, num_new, num_hit, hit)
        except CapacityError:
            need = self.mgr.coordinator.blocks_held_after(num_hit, num_hit + num_new)
            assert need > self.mgr.num_blocks - 1
            return
        if new is None:
            self.waiting.append(request)
            return
        request.num_computed_tokens = num_hit + num_new
        self.running[request.request_id] = request
        self.accepted[request.request_id] = num_hit
        self._record(request)

    def _preempt(self, request: Request) -> None:
        self.mgr.free(request)
        del self.running[request.request_id]
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.waiting.append(request)

    # -- rules -----------------------------------------------------------------------

    @rule(
        prefix=st.sampled_from(PREFIXES),
        cut=st.integers(min_value=0, max_value=40),
        tail=st.lists(st.integers(min_value=0, max_value=5), min_size=1, max_size=10),
        chunk=st.sampled_from([0, 0, 1, 2, 4, 8, 12]),
    )
    def arrive(self, prefix, cut, tail, chunk) -> None:
        self.next_id += 1
        self._admit(Request(f"r{self.next_id}", prefix[:cut] + tail), chunk)

    @precondition(lambda self: self.running)
    @rule(pick=st.integers(min_value=0), size=st.integers(min_value=1, max_value=8), token=st.integers(0, 5))
    def advance(self, pick: int, size: int, token: int) -> None:
        """A prefill chunk of a partly computed request, or one decode step."""
        request = list(self.running.values())[pick % len(self.running)]
        todo = request.num_tokens - request.num_computed_tokens
        if todo == 0:
            request.append_output_token_ids(token)
            todo = 1
        num_new = min(size, todo)
        try:
            new = self.mgr.allocate_slots(request, num_new)
        except CapacityError:
            new = None
        if new is None:
            self._preempt(request)
            return
        self.accepted[request.request_id] = request.num_computed_tokens
        request.num_computed_tokens += num_new
        self._record(request)

    @precondition(lambda self: self.running)
    @rule(pick=st.integers(min_value=0))
    def preempt(self, pick: int) -> None:
        self._preempt(list(self.running.values())[pick % len(self.running)])

    @precondition(lambda self: self.running)
    @rule(pick=st.integers(min_value=0))
    def finish(self, pick: int) -> None:
        request = list(self.running.values())[pick % len(self.running)]
        self.mgr.free(request)
        del self.running[request.request_id]

    @precondition(lambda self: self.waiting)
    @rule(chunk=st.sampled_from([0, 4]))
    def readmit(self, chunk: int) -> None:
        self._admit(self.waiting.pop(0), chunk)

    # -- hostile callers -------------------------------------------------------------

    @rule(
        prefix=st.sampled_from(PREFIXES[:3]),
        tail=st.lists(st.integers(min_value=0, max_value=5), min_size=1, max_size=6),
        between=st.sampled_from(["reset", "flood"]),
    )
    def stale_hit(self, prefix, tail, between) -> None:
        """A lookup, then the cache changes under it: refused cleanly, or still a true hit."""
        self.next_id += 1
        request = Request(f"r{self.next_id}", prefix + tail)
        hit, num_hit = self.mgr.get_computed_blocks(request)
        if between == "reset":
            for other in list(self.running.values()):
                self._preempt(other)
            if self.mgr.reset_prefix_cache():
                self.shadow.clear()
        else:
            self.next_id += 1
            flood = Request(f"flood{self.next_id}", list(range(1000 + self.next_id, 1040 + self.next_id)))
            self._admit(flood, 0)
            if flood.request_id in self.running:
                self.finish(list(self.running).index(flood.request_id))
        before = snapshot(self.mgr)
        try:
            new = self.mgr.allocate_slots(request, request.num_tokens - num_hit, num_hit, hit)
        except CapacityError:
            return
        except KVPoolError as error:
            assert "stale" in str(error), error
            assert snapshot(self.mgr) == before
            return
        if new is not None:
            request.num_computed_tokens = request.num_tokens
            self.running[request.request_id] = request
            self.accepted[request.request_id] = num_hit
            self._check_hit(request, hit, num_hit)
            self._record(request)

    @precondition(lambda self: self.running)
    @rule(pick=st.integers(min_value=0), lie=st.sampled_from(["float", "bool", "back", "jump"]))
    def progress_lie(self, pick: int, lie: str) -> None:
        request = list(self.running.values())[pick % len(self.running)]
        honest = request.num_computed_tokens
        accepted = self.accepted[request.request_id]  # what the manager saw at its last allocation
        if lie == "back" and accepted == 0:
            return
        request.append_output_token_ids([4] * 8)
        bogus = {"float": float(honest), "bool": honest > 0, "back": accepted - 1, "jump": honest + 1}[lie]
        before = snapshot(self.mgr)
        request.num_computed_tokens = bogus
        try:
            with pytest.raises(KVPoolError, match="num_computed_tokens"):
                self.mgr.allocate_slots(request, 1)
        finally:
            request.num_computed_tokens = honest
        assert snapshot(self.mgr) == before

    # -- invariants ------------------------------------------------------------------

    @invariant()
    def bookkeeping_holds(self) -> None:
        if not hasattr(self, "mgr"):
            return
        self.mgr.check_invariants()
        in_use = {b for r in self.running for table in self.mgr.get_block_ids(r) for b in table if b}
        assert len(in_use) + self.mgr.num_free_blocks == self.mgr.num_blocks - 1
        for rid, request in self.running.items():
            for group, table in zip(self.mgr.groups, self.mgr.get_block_ids(rid)):
                # the next step reads these positions: they must still be held
                for k in needed_positions(group, request.num_computed_tokens):
                    if k < len(table):
                        assert table[k], f"{rid} group {group.group_id} lost position {k}"


TestHybridMachine = HybridMachine.TestCase
TestHybridMachine.settings = settings(
    max_examples=100, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
