"""Stateful property test of the core under hostile callers.

Besides honest admissions, decodes, preemptions, frees and resets, the machine
keeps trying what a careless or hostile caller would: lookup results used
after a reset or an eviction, by another manager, for another request object
that reuses the ID; progress that is a float or a bool, moves backwards or
jumps past the slots; cache keys assigned after construction; requests past
``max_model_len``. Every such call must either raise a ``KVPoolError`` with
nothing changed, or (for a hit that is still valid) be served correctly.

The test keeps its own shadow of what every block physically holds: each time
a step "runs", the KV of every computed position is written into the block
that the request's table names for it, as ``(salt, lora, token prefix)``.
After every step, every running request's table must name, at every position
it has computed, a block holding exactly that request's KV. So a hit on a
block written by another prompt or another tenant, or a block cached before it
was computed, fails the check, whatever path led to it.
"""

from __future__ import annotations

import hashlib
import importlib.util

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvpool import CapacityError, KVCacheManager, KVPoolError, Request
from tests.helpers import snapshot

PREFIXES = [list(range(100, 120)), list(range(200, 209)), [7] * 13, []]
SALTS = [None, None, "tenant-a", "tenant-b"]
LORAS = [None, None, "adapter-1"]
MAX_MODEL_LEN = 40


def colliding_digest(data: bytes) -> bytes:
    """A terrible 'fast hash' with 64 values: collisions all the time."""
    return (hashlib.sha256(data).digest()[0] % 64).to_bytes(1, "little") * 16


class HostileMachine(RuleBasedStateMachine):
    hash_algo = "sha256"

    @initialize(num_blocks=st.integers(min_value=4, max_value=32), block_size=st.sampled_from([1, 2, 4]))
    def setup(self, num_blocks: int, block_size: int) -> None:
        self.mgr = self._manager(num_blocks, block_size)
        self.other = self._manager(num_blocks, block_size)  # a second pool, for foreign hits
        self.bs = block_size
        self.running: dict[str, Request] = {}
        self.progress: dict[str, int] = {}  # the caller's own count of computed tokens
        self.accepted: dict[str, int] = {}  # the progress the manager saw at the last allocation
        self.waiting: list[Request] = []
        self.next_id = 0
        # block ID -> {slot: (salt, lora, token prefix)}: what the block physically holds
        self.memory: dict[int, dict[int, tuple]] = {}
        self.pending = None  # (request, hit, num_hit) from an earlier lookup, kept to go stale

    def _manager(self, num_blocks: int, block_size: int) -> KVCacheManager:
        mgr = KVCacheManager(num_blocks, block_size, hash_algo=self.hash_algo, max_model_len=MAX_MODEL_LEN)
        if self.hash_algo == "xxh3_128":
            mgr.hasher._xxh = colliding_digest
            mgr.hasher.root = colliding_digest(b"root")
        return mgr

    # -- the "model": writing KV, and what a position should hold ---------------------

    @staticmethod
    def _kv(request: Request, position: int) -> tuple:
        return (request.cache_salt, request.lora_name, tuple(request.all_token_ids[: position + 1]))

    def _run_step(self, request: Request, start: int, stop: int) -> None:
        """Write the KV of positions ``start..stop-1`` into the blocks the table names."""
        self.accepted[request.request_id] = start
        (table,) = self.mgr.get_block_ids(request.request_id)
        for p in range(start, stop):
            self.memory.setdefault(table[p // self.bs], {})[p % self.bs] = self._kv(request, p)
        self.progress[request.request_id] = stop
        request.num_computed_tokens = stop

    def _refused_cleanly(self, call) -> None:
        """``call`` must raise a KVPoolError and change nothing."""
        before = snapshot(self.mgr), {r: q.num_computed_tokens for r, q in self.running.items()}
        with pytest.raises(KVPoolError):
            call()
        assert (snapshot(self.mgr), {r: q.num_computed_tokens for r, q in self.running.items()}) == before
        self.mgr.check_invariants()

    def _new_request(self, prefix, cut, tail, salt, lora, rid: str | None = None) -> Request:
        self.next_id += 1
        return Request(rid or f"r{self.next_id}", prefix[:cut] + tail, cache_salt=salt, lora_name=lora)

    def _admit(self, request: Request, hit=None, num_hit: int | None = None) -> None:
        if hit is None:
            hit, num_hit = self.mgr.get_computed_blocks(request)
        assert num_hit is not None
        try:
            new = self.mgr.allocate_slots(request, request.num_tokens - num_hit, num_hit, hit)
        except CapacityError:
            return
        if new is None:
            self.waiting.append(request)
            return
        self.running[request.request_id] = request
        self._run_step(request, num_hit, request.num_tokens)

    def _pick(self, pick: int) -> Request:
        return list(self.running.values())[pick % len(self.running)]

    # -- honest traffic --------------------------------------------------------------

    @rule(
        prefix=st.sampled_from(PREFIXES),
        cut=st.integers(min_value=0, max_value=20),
        tail=st.lists(st.integers(min_value=0, max_value=5), min_size=1, max_size=12),
        salt=st.sampled_from(SALTS),
        lora=st.sampled_from(LORAS),
    )
    def arrive(self, prefix, cut, tail, salt, lora) -> None:
        self._admit(self._new_request(prefix, cut, tail, salt, lora))

    @precondition(lambda self: self.running)
    @rule(pick=st.integers(min_value=0), token=st.integers(min_value=0, max_value=5))
    def decode(self, pick: int, token: int) -> None:
        request = self._pick(pick)
        if request.num_tokens >= MAX_MODEL_LEN:
            self._finish(request)
            return
        request.append_output_token_ids(token)
        try:
            new = self.mgr.allocate_slots(request, 1)
        except CapacityError:  # it outgrew the whole pool
            self._finish(request)
            return
        if new is None:
            self._preempt(request)
            return
        self._run_step(request, request.num_tokens - 1, request.num_tokens)

    def _preempt(self, request: Request) -> None:
        self.mgr.free(request)
        del self.running[request.request_id]
        del self.progress[request.request_id]
        del self.accepted[request.request_id]
        request.num_computed_tokens = 0
        self.waiting.append(request)

    def _finish(self, request: Request) -> None:
        self.mgr.free(request)
        del self.running[request.request_id]
        del self.progress[request.request_id]
        del self.accepted[request.request_id]

    @precondition(lambda self: self.running)
    @rule(pick=st.integers(min_value=0))
    def preempt(self, pick: int) -> None:
        self._preempt(self._pick(pick))

    @precondition(lambda self: self.running)
    @rule(pick=st.integers(min_value=0))
    def finish(self, pick: int) -> None:
        self._finish(self._pick(pick))

    @precondition(lambda self: self.waiting)
    @rule()
    def readmit(self) -> None:
        request = self.waiting.pop(0)
        if request.request_id in self.running:
            return  # its ID was taken meanwhile; drop it
        self._admit(request)

    @rule()
    def reset(self) -> None:
        self.mgr.reset_prefix_cache()

    @rule(token=st.integers(min_value=1000, max_value=2000))
    def flood(self, token) -> None:
        """Fresh requests take every free block, which evicts every cached one, then leave."""
        flooded = []
        while self.mgr.num_free_blocks:
            self.next_id += 1
            size = min(self.mgr.num_free_blocks * self.bs, MAX_MODEL_LEN)
            flood = Request(f"flood{self.next_id}", [token + self.next_id * 50 + i for i in range(size)])
            hit, num_hit = self.mgr.get_computed_blocks(flood)
            if self.mgr.allocate_slots(flood, flood.num_tokens - num_hit, num_hit, hit) is None:
                break
            self.running[flood.request_id] = flood
            self._run_step(flood, num_hit, flood.num_tokens)
            flooded.append(flood)
        for flood in flooded:
            self._finish(flood)

    # -- hostile traffic ---------------------------------------------------------------

    @rule(
        prefix=st.sampled_from(PREFIXES),
        cut=st.integers(min_value=0, max_value=20),
        tail=st.lists(st.integers(min_value=0, max_value=5), min_size=1, max_size=12),
        salt=st.sampled_from(SALTS),
    )
    def look_up_and_keep(self, prefix, cut, tail, salt) -> None:
        """Look a request up now; a later rule allocates with the (maybe stale) result."""
        request = self._new_request(prefix, cut, tail, salt, None)
        hit, num_hit = self.mgr.get_computed_blocks(request)
        self.pending = (request, hit, num_hit)

    @rule(
        prefix=st.sampled_from(PREFIXES[:3]),
        tail=st.lists(st.integers(min_value=0, max_value=5), min_size=1, max_size=6),
        salt=st.sampled_from(SALTS),
        between=st.sampled_from(["reset", "flood", "finish all", "nothing"]),
        token=st.integers(min_value=1000, max_value=2000),
    )
    def lookup_then_disrupt_then_allocate(self, prefix, tail, salt, between, token) -> None:
        """A request computed, left, and looked up again; then the cache changes under the lookup."""
        first = self._new_request(prefix, len(prefix), tail, salt, None)
        self._admit(first)
        if first.request_id in self.running:
            self._finish(first)
        self.look_up_and_keep(prefix, len(prefix), tail[::-1], salt)
        if between in ("reset", "finish all"):
            for request in list(self.running.values()):
                self._finish(request)
        if between == "reset":
            self.reset()
        elif between == "flood":
            self.flood(token)
        self.allocate_with_kept_hit()

    @precondition(lambda self: self.pending is not None)
    @rule()
    def allocate_with_kept_hit(self) -> None:
        """Whatever happened since the lookup: refused cleanly, or served with the right KV."""
        request, hit, num_hit = self.pending
        self.pending = None
        if request.request_id in self.running:
            return
        before = snapshot(self.mgr)
        try:
            new = self.mgr.allocate_slots(request, request.num_tokens - num_hit, num_hit, hit)
        except CapacityError:
            assert snapshot(self.mgr) == before
            return
        except KVPoolError as error:
            assert "stale" in str(error), error
            assert snapshot(self.mgr) == before
            return
        if new is not None:
            self.running[request.request_id] = request
            self._run_step(request, num_hit, request.num_tokens)

    @precondition(lambda self: self.pending is not None)
    @rule()
    def hit_from_another_manager(self) -> None:
        request, _, _ = self.pending
        hit, num_hit = self.other.get_computed_blocks(request)
        if request.request_id not in self.running:
            self._refused_cleanly(lambda: self.mgr.allocate_slots(request, request.num_tokens - num_hit, num_hit, hit))

    @precondition(lambda self: self.pending is not None)
    @rule(tail=st.lists(st.integers(min_value=0, max_value=5), min_size=1, max_size=12))
    def hit_for_another_request_object(self, tail) -> None:
        """A new Request reusing the looked-up request's ID (or a running one's) with other tokens."""
        request, hit, num_hit = self.pending
        impostor = Request(request.request_id, list(request.all_token_ids[:num_hit]) + tail)
        if impostor.num_tokens > num_hit:
            self._refused_cleanly(
                lambda: self.mgr.allocate_slots(impostor, impostor.num_tokens - num_hit, num_hit, hit)
            )

    @precondition(lambda self: self.running)
    @rule(pick=st.integers(min_value=0), tail=st.lists(st.integers(min_value=0, max_value=5), min_size=1, max_size=8))
    def running_id_reused(self, pick, tail) -> None:
        victim = self._pick(pick)
        impostor = Request(victim.request_id, tail, cache_salt=victim.cache_salt)
        hit, num_hit = self.mgr.get_computed_blocks(impostor)
        self._refused_cleanly(lambda: self.mgr.allocate_slots(impostor, impostor.num_tokens - num_hit, num_hit, hit))
        self._refused_cleanly(lambda: self.mgr.free(impostor))

    @precondition(lambda self: self.running)
    @rule(
        pick=st.integers(min_value=0),
        bogus=st.one_of(
            st.sampled_from(["float", "bool", "back", "jump", "none"]),
            st.integers(min_value=1, max_value=64).map(lambda n: ("jump", n)),
        ),
    )
    def progress_lies(self, pick, bogus) -> None:
        request = self._pick(pick)
        rid = request.request_id
        honest, accepted = self.progress[rid], self.accepted[rid]
        if request.num_tokens >= MAX_MODEL_LEN:
            self._finish(request)
            return
        extra = 1
        if isinstance(bogus, tuple):
            bogus, extra = bogus
        if bogus == "back":  # behind the progress the manager last accepted
            if accepted == 0:
                return
            lie: object = max(accepted - extra, 0)
        elif bogus == "jump":  # every slot allocated so far is computed: any jump passes them
            lie = honest + extra
        else:
            lie = {"float": float(honest), "bool": bool(honest), "none": None}[bogus]
        # enough tokens that the lie stays within the request: only the slots can refuse it
        grow = min(extra + 1, MAX_MODEL_LEN - request.num_tokens)
        if bogus == "jump" and grow < extra + 1:
            return
        request.append_output_token_ids([3] * grow)
        request.num_computed_tokens = lie
        try:
            self._refused_cleanly(lambda: self.mgr.allocate_slots(request, 1))
        finally:
            request.num_computed_tokens = honest
        # the honest step still works afterwards (or the pool is full)
        try:
            new = self.mgr.allocate_slots(request, request.num_tokens - honest)
        except CapacityError:
            self._finish(request)
            return
        if new is None:
            self._preempt(request)
        else:
            self._run_step(request, honest, request.num_tokens)

    @precondition(lambda self: self.running)
    @rule(
        pick=st.integers(min_value=0),
        field=st.sampled_from(["cache_salt", "lora_name", "mm_inputs", "request_id", "num_prompt_tokens"]),
        value=st.sampled_from([None, "tenant-a", "tenant-b", "x", (), 3]),
    )
    def keys_are_fixed(self, pick, field, value) -> None:
        request = self._pick(pick)
        before = getattr(request, field), request.block_hashes
        with pytest.raises((AttributeError, KVPoolError)):
            setattr(request, field, value)
        assert (getattr(request, field), request.block_hashes) == before
        copy = request.all_token_ids
        copy[0] = (copy[0] + 1) % 7
        assert request.all_token_ids[0] != copy[0]

    @rule(length=st.integers(min_value=MAX_MODEL_LEN + 1, max_value=MAX_MODEL_LEN + 30))
    def longer_than_max_model_len(self, length) -> None:
        request = Request(f"long{length}", [1] * length)
        self._refused_cleanly(lambda: self.mgr.get_computed_blocks(request))
        self._refused_cleanly(lambda: self.mgr.allocate_slots(request, length))

    # -- invariants ------------------------------------------------------------------

    @invariant()
    def every_table_holds_its_own_kv(self) -> None:
        if not hasattr(self, "mgr"):
            return
        self.mgr.check_invariants()
        for rid, request in self.running.items():
            (table,) = self.mgr.get_block_ids(rid)
            for p in range(self.progress[rid]):
                held = self.memory.get(table[p // self.bs], {}).get(p % self.bs)
                assert held == self._kv(request, p), (
                    f"request {rid!r} position {p}: block {table[p // self.bs]} holds {held!r}"
                )


SETTINGS = settings(
    max_examples=120, stateful_step_count=50, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)

TestHostileSHA256 = HostileMachine.TestCase
TestHostileSHA256.settings = SETTINGS


class HostileCollidingFastHash(HostileMachine):
    hash_algo = "xxh3_128"


TestHostileCollidingFastHash = pytest.mark.skipif(
    importlib.util.find_spec("xxhash") is None, reason="the fast hash needs xxhash (the 'fast' extra)"
)(HostileCollidingFastHash.TestCase)
TestHostileCollidingFastHash.settings = SETTINGS
