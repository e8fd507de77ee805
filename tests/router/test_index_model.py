"""The compact in-memory index against a plain model of it: same answers, invariants checked after every step.

The model keeps, per replica, a dict of hash -> the (medium, group) pairs holding it, and
answers match and match_media by walking it. Without caps the index must answer exactly
as it does; with small caps it must hold a subset of the model's claims (a dropped claim
only ever makes the router miss), stay within its caps, and keep its invariants
(:meth:`MemoryIndex.check`).
"""

from __future__ import annotations

from itertools import groupby

import hypothesis.strategies as st
import pytest
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvpool.errors import ConfigError
from kvpool.router.index import ExternalHash, Group, HeldMedia, Medium, MemoryIndex

REPLICAS = [f"http://r{i}:1" for i in range(5)]
#: A small pool, so replicas share blocks; bytes of several lengths, and ints (never equal to any bytes).
POOL: list[ExternalHash] = [bytes([i]) * 32 for i in range(12)] + [b"x" * i for i in range(1, 5)] + [7, 8, 2**63]
MEDIA: list[Medium] = [None, "GPU", "CPU"]

chains = st.lists(st.sampled_from(POOL), min_size=0, max_size=10, unique=True)


def model_media(claims: dict[ExternalHash, set[tuple[Medium, int]]], chain: list[ExternalHash]) -> HeldMedia:
    held = []
    for h in chain:
        if not claims.get(h):
            break
        held.append(frozenset(m for m, _ in claims[h]))
    return tuple((media, len(list(same))) for media, same in groupby(held))


class Exact(RuleBasedStateMachine):
    """No caps reached: the index answers as the model does."""

    def __init__(self) -> None:
        super().__init__()
        self.index = MemoryIndex(sweep_step=2)  # cleared replicas' bits linger over several steps
        self.model: dict[str, dict[ExternalHash, set[tuple[Medium, int]]]] = {}

    @rule(replica=st.sampled_from(REPLICAS), chain=chains, medium=st.sampled_from(MEDIA))
    def store(self, replica: str, chain: list[ExternalHash], medium: Medium) -> None:
        self.index.store(replica, chain, medium)
        held = self.model.setdefault(replica, {})
        for h in chain:
            held.setdefault(h, set()).add((medium, 0))

    @rule(replica=st.sampled_from(REPLICAS), chain=chains, medium=st.sampled_from(MEDIA))
    def remove(self, replica: str, chain: list[ExternalHash], medium: Medium) -> None:
        self.index.remove(replica, chain, medium, Group())
        held = self.model.get(replica, {})
        for h in chain:
            claims = held.get(h)
            if claims is not None:
                claims.discard((medium, 0))
                if not claims:
                    del held[h]

    @rule(replica=st.sampled_from(REPLICAS))
    def clear(self, replica: str) -> None:
        self.index.clear(replica)
        self.model.pop(replica, None)

    @rule(chain=chains, replicas=st.lists(st.sampled_from(REPLICAS), min_size=1, max_size=5, unique=True))
    def match(self, chain: list[ExternalHash], replicas: list[str]) -> None:
        expected = [model_media(self.model.get(r, {}), chain) for r in replicas]
        assert self.index.match_media(chain, replicas) == expected
        assert self.index.match(chain, replicas) == [sum(n for _, n in runs) for runs in expected]

    @invariant()
    def consistent(self) -> None:
        self.index.check()
        for replica in REPLICAS:
            assert self.index.num_blocks(replica) == len(self.model.get(replica, {}))


class Capped(RuleBasedStateMachine):
    """Small caps: the index holds a subset of the model's claims, within its caps."""

    def __init__(self) -> None:
        super().__init__()
        self.index = MemoryIndex(max_blocks=14, max_blocks_per_replica=6, sweep_step=1)
        self.model: dict[str, set[ExternalHash]] = {}

    @rule(replica=st.sampled_from(REPLICAS), chain=chains)
    def store(self, replica: str, chain: list[ExternalHash]) -> None:
        self.index.store(replica, chain)
        self.model.setdefault(replica, set()).update(chain)
        if chain:  # the newest batch's root is the last claim a cap drops
            assert self.index.match(chain[:1], [replica]) == [1]

    @rule(replica=st.sampled_from(REPLICAS), chain=chains)
    def remove(self, replica: str, chain: list[ExternalHash]) -> None:
        self.index.remove(replica, chain)
        self.model.get(replica, set()).difference_update(chain)

    @rule(replica=st.sampled_from(REPLICAS), limit=st.one_of(st.none(), st.integers(1, 8)))
    def limit(self, replica: str, limit: int | None) -> None:
        self.index.limit(replica, limit)
        assert self.index.num_blocks(replica) <= (6 if limit is None else min(6, limit))

    @rule(replica=st.sampled_from(REPLICAS))
    def clear(self, replica: str) -> None:
        self.index.clear(replica)
        self.model.pop(replica, None)

    @rule(chain=chains, replicas=st.lists(st.sampled_from(REPLICAS), min_size=1, max_size=5, unique=True))
    def match(self, chain: list[ExternalHash], replicas: list[str]) -> None:
        for replica, depth in zip(replicas, self.index.match(chain, replicas)):
            assert all(h in self.model.get(replica, set()) for h in chain[:depth]), "a claim the replica never made"

    @invariant()
    def bounded(self) -> None:
        self.index.check()
        for replica in REPLICAS:
            assert self.index.num_blocks(replica) <= len(self.model.get(replica, set()))


TestExact = Exact.TestCase
TestExact.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)
TestCapped = Capped.TestCase
TestCapped.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)


def test_many_replicas_use_several_holder_words() -> None:
    index = MemoryIndex()
    names = [f"http://r{i}:1" for i in range(150)]  # three words of holder bits
    shared = [bytes([i]) * 32 for i in range(4)]
    for n, name in enumerate(names):
        index.store(name, shared[: 1 + n % 4])
    assert index.match(shared, names) == [1 + n % 4 for n in range(150)]
    index.clear(names[70])
    index.store("http://late:1", shared)  # a new bit (the cleared one is freed once swept)
    assert index.match(shared, [names[70], "http://late:1", names[71]]) == [0, 4, 4]
    index.check()


def test_tables_grow_and_shrink_without_losing_a_block() -> None:
    index = MemoryIndex()
    blocks = [i.to_bytes(8, "big") for i in range(20_000)]
    index.store("a", blocks)
    index.store("b", blocks[:100])
    assert index.match(blocks, ["a", "b"]) == [20_000, 100]
    index.remove("a", blocks[100:])
    index.store("a", [b"new" + b for b in blocks[:5000]])  # fills the slots let go: tables re-inserted
    assert index.match(blocks, ["a", "b"]) == [100, 100]
    assert index.figures()["blocks"] == 100 + 5000
    index.check()


def test_a_hybrid_replica_counts_a_prefix_its_groups_can_use() -> None:
    index = MemoryIndex()
    chain = [bytes([i]) * 32 for i in range(6)]
    index.store("a", chain, "GPU", Group(0))
    index.store("a", chain[3:5], "GPU", Group(1, tail=2))  # a sliding window of 2 blocks
    assert index.match(chain, ["a"]) == [5]  # blocks 3 and 4 are the window of a 5-block prefix
    assert index.match_media(chain, ["a"]) == [((frozenset({"GPU"}), 5),)]
    index.check()


def test_a_used_prefix_outlives_newer_claims_past_one_sorted_front() -> None:
    index = MemoryIndex(max_blocks_per_replica=5000)
    old = [i.to_bytes(8, "big") for i in range(3000)]
    newer = [b"n" + b for b in old[:2000]]
    index.store("a", old)
    index.store("a", newer)
    assert index.match(old[:1500], ["a"]) == [1500]  # used: now newer than `newer`
    index.store("a", [b"x" + b for b in old[:1500]])  # 1,500 over the cap
    assert index.match(old[:1500], ["a"]) == [1500]
    assert index.match(newer, ["a"]) == [2000]
    assert index.match(old[1500:], ["a"]) == [0]  # the least recently used went first
    assert index.figures()["dropped"] == 1500
    index.check()


def test_a_clear_answers_at_once_and_its_bits_are_swept_a_step_at_a_time() -> None:
    index = MemoryIndex(sweep_step=10)
    held = [i.to_bytes(8, "big") for i in range(35)]
    index.store("a", held)
    index.store("b", held[:5])
    index.clear("a")
    assert index.match(held, ["a", "b"]) == [0, 5]  # answered as gone before any sweep
    assert index.num_blocks("a") == 0
    assert index.figures()["claims_to_sweep"] == 35
    index.store("a", held[:3])  # a new bit for "a": the retired one still has 35 set
    assert index.match(held, ["a", "b"]) == [3, 5]
    assert index.figures()["claims_to_sweep"] == 25  # one step of 10
    index.check()
    for _ in range(3):
        index.remove("c", [])  # a remove of an unknown replica sweeps nothing: it changes nothing
        index.store("b", [])
    assert index.figures()["claims_to_sweep"] == 0
    assert index.figures()["blocks"] == 5  # the blocks only "a" held are let go; "a"'s 3 are among b's 5
    index.check()
    index.store("d", held[30:])  # takes the swept bit
    assert index.match(held[30:], ["a", "b", "d"]) == [0, 0, 5]
    index.check()


def test_the_global_cap_sweeps_retired_claims_before_dropping_a_live_one() -> None:
    index = MemoryIndex(max_blocks=10, sweep_step=1)
    index.store("a", [i.to_bytes(8, "big") for i in range(8)])
    index.clear("a")
    fresh = [b"f" + i.to_bytes(8, "big") for i in range(8)]
    index.store("b", fresh)  # 8 live + 8 retired past 10: the retired ones go, all at once
    assert index.match(fresh, ["b"]) == [8]
    assert index.figures()["dropped"] == 0
    assert index.figures()["claims_to_sweep"] == 0
    assert index.figures()["blocks"] == 8
    index.check()


def test_a_sweep_step_below_one_is_refused_by_name() -> None:
    with pytest.raises(ConfigError, match="sweep_step must be an integer >= 1, got 0"):
        MemoryIndex(sweep_step=0)
