"""Stateful property tests: random admissions, decodes, preemptions and frees.

After every step the manager's invariant checker must pass, every hit block
must hold exactly the tokens (and salt and adapter) the request asked for, and
no request may hit a block cached under another salt. The same machine runs
with SHA-256 and with a deliberately broken fast hash that collides all the
time, which the verified index must survive without a single false hit.
"""

from __future__ import annotations

import hashlib
import importlib.util

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvpool import CapacityError, KVCacheManager, Request

PREFIXES = [list(range(100, 120)), list(range(200, 209)), [7] * 13, []]
SALTS = [None, None, "tenant-a", "tenant-b"]
LORAS = [None, None, "adapter-1"]


def colliding_digest(data: bytes) -> bytes:
    """A terrible 'fast hash': only 64 distinct values, so collisions are constant."""
    return hashlib.sha256(data).digest()[:1][0].__mod__(64).to_bytes(1, "little") * 16


class ManagerMachine(RuleBasedStateMachine):
    hash_algo = "sha256"

    @initialize(
        num_blocks=st.integers(min_value=4, max_value=40),
        block_size=st.sampled_from([1, 2, 4, 8]),
    )
    def setup(self, num_blocks: int, block_size: int) -> None:
        self.mgr = KVCacheManager(num_blocks, block_size, hash_algo=self.hash_algo)
        if self.hash_algo == "xxh3_128":
            self.mgr.hasher._xxh = colliding_digest
            self.mgr.hasher.root = colliding_digest(b"root")
        self.block_size = block_size
        self.running: dict[str, Request] = {}
        self.waiting: list[Request] = []
        self.next_id = 0
        # block ID -> (salt, lora, prefix tokens) recorded while the block was cached in a table
        self.shadow: dict[int, tuple] = {}

    # -- helpers -------------------------------------------------------------------

    def _record_contents(self, request: Request) -> None:
        (table,) = self.mgr.get_block_ids(request.request_id)
        tokens = list(request.all_token_ids)
        for k, block_id in enumerate(table):
            if self.mgr.pool.block(block_id).block_hash is not None:
                self.shadow[block_id] = (
                    request.cache_salt,
                    request.lora_name,
                    tuple(tokens[: (k + 1) * self.block_size]),
                )

    def _admit(self, request: Request) -> None:
        hit, num_hit = self.mgr.get_computed_blocks(request)
        assert num_hit % self.block_size == 0 and num_hit < request.num_tokens
        tokens = list(request.all_token_ids)
        for k, block_id in enumerate(hit.block_ids[0]):
            expected = (request.cache_salt, request.lora_name, tuple(tokens[: (k + 1) * self.block_size]))
            assert self.shadow.get(block_id) == expected, f"false hit on block {block_id}"
        try:
            new = self.mgr.allocate_slots(request, request.num_tokens - num_hit, num_hit, hit)
        except CapacityError:
            assert -(-request.num_tokens // self.block_size) > self.mgr.num_blocks - 1
            return
        if new is None:
            self.waiting.append(request)
            return
        request.num_computed_tokens = request.num_tokens
        self.running[request.request_id] = request
        self._record_contents(request)

    # -- rules -----------------------------------------------------------------------

    @rule(
        prefix=st.sampled_from(PREFIXES),
        cut=st.integers(min_value=0, max_value=20),
        tail=st.lists(st.integers(min_value=0, max_value=5), min_size=1, max_size=12),
        salt=st.sampled_from(SALTS),
        lora=st.sampled_from(LORAS),
    )
    def arrive(self, prefix, cut, tail, salt, lora) -> None:
        self.next_id += 1
        request = Request(f"r{self.next_id}", prefix[:cut] + tail, cache_salt=salt, lora_name=lora)
        self._admit(request)

    @precondition(lambda self: self.running)
    @rule(pick=st.integers(min_value=0), token=st.integers(min_value=0, max_value=5))
    def decode(self, pick: int, token: int) -> None:
        request = list(self.running.values())[pick % len(self.running)]
        request.append_output_token_ids(token)
        try:
            new = self.mgr.allocate_slots(request, 1)
        except CapacityError:
            new = None
        if new is None:
            self._preempt(request)
            return
        request.num_computed_tokens += 1
        self._record_contents(request)

    def _preempt(self, request: Request) -> None:
        self.mgr.free(request)
        del self.running[request.request_id]
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.waiting.append(request)

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
    @rule()
    def readmit(self) -> None:
        self._admit(self.waiting.pop(0))

    @rule()
    def reset(self) -> None:
        if self.mgr.reset_prefix_cache():
            assert not self.running
            self.shadow.clear()

    # -- invariants ------------------------------------------------------------------

    @invariant()
    def bookkeeping_holds(self) -> None:
        if hasattr(self, "mgr"):
            self.mgr.check_invariants()
            in_use = {b for r in self.running for b in self.mgr.get_block_ids(r)[0]}
            assert len(in_use) + self.mgr.num_free_blocks == self.mgr.num_blocks - 1


SETTINGS = settings(
    max_examples=150, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)

TestManagerSHA256 = ManagerMachine.TestCase
TestManagerSHA256.settings = SETTINGS


class CollidingFastHashMachine(ManagerMachine):
    hash_algo = "xxh3_128"


TestManagerCollidingFastHash = pytest.mark.skipif(
    importlib.util.find_spec("xxhash") is None, reason="the fast hash needs xxhash (the 'fast' extra)"
)(CollidingFastHashMachine.TestCase)
TestManagerCollidingFastHash.settings = SETTINGS
