"""The disk tier against a model LRU, through random puts, gets, vanished and damaged files, and restarts."""

from __future__ import annotations

import shutil
import tempfile
from collections import OrderedDict
from pathlib import Path

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvpool.tiers import DiskStore, EntryCodec
from tests.tiers.conftest import LAYOUT, block_key

CODEC = EntryCodec(LAYOUT)
KEYS = st.integers(0, 11)


def payload(i: int) -> bytes:
    return bytes([i]) * (100 + 37 * i)  # sizes differ, so the byte bound matters, not a count


SIZE = {i: len(CODEC.encode(block_key(i), payload(i))) for i in range(12)}


class DiskTier(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.directory = Path(tempfile.mkdtemp(prefix="kvpool-disk-"))
        self.capacity = 2000
        self.store = DiskStore(self.directory, self.capacity, CODEC)
        self.model: OrderedDict[int, int] = OrderedDict()  # id -> entry bytes, least recent first

    def teardown(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)

    def _path(self, i: int) -> Path:
        name = block_key(i).hex()
        return self.store.root / name[:2] / f"{name}.kv"

    @rule(ids=st.lists(KEYS, max_size=5))
    def put(self, ids: list[int]) -> None:
        expected = 0
        for i in ids:
            if i in self.model:
                self.model.move_to_end(i)
            else:
                while sum(self.model.values()) + SIZE[i] > self.capacity:
                    self.model.popitem(last=False)
                self.model[i] = SIZE[i]
            expected += 1
        assert self.store.put_many([(block_key(i), payload(i)) for i in ids]) == expected

    @rule(ids=st.lists(KEYS, max_size=5))
    def get(self, ids: list[int]) -> None:
        got = self.store.get_many([block_key(i) for i in ids])
        for i, g in zip(ids, got):
            if i in self.model:
                self.model.move_to_end(i)
            assert g == (payload(i) if i in self.model else None)

    @rule(ids=st.lists(KEYS, max_size=5))
    def prefix(self, ids: list[int]) -> None:
        expected = 0
        for i in ids:
            if i not in self.model:
                break
            expected += 1
        assert self.store.contains_prefix([block_key(i) for i in ids]) == expected

    @precondition(lambda self: self.model)
    @rule(data=st.data(), damage=st.sampled_from(["vanish", "truncate", "flip"]))
    def damage(self, data: st.DataObject, damage: str) -> None:
        i = data.draw(st.sampled_from(sorted(self.model)))
        path = self._path(i)
        corrupt_before = self.store.stats.corrupt
        if damage == "vanish":
            path.unlink()
        else:
            raw = path.read_bytes()
            path.write_bytes(raw[:-3] if damage == "truncate" else raw[:-1] + bytes([raw[-1] ^ 4]))
        assert self.store.get_many([block_key(i)]) == [None]
        del self.model[i]
        assert self.store.stats.corrupt == corrupt_before + (damage != "vanish")

    @rule()
    def restart(self) -> None:
        self.store.close()
        self.store = DiskStore(self.directory, self.capacity, CODEC)
        # file times may tie within a tick: the set survives exactly, the order as the files tell it
        order = [int.from_bytes(k[:4], "big") for k in self.store.keys_by_recency()]
        assert sorted(order) == sorted(self.model)
        self.model = OrderedDict((i, self.model[i]) for i in order)

    @invariant()
    def agrees(self) -> None:
        self.store.check_invariants()
        assert [int.from_bytes(k[:4], "big") for k in self.store.keys_by_recency()] == list(self.model)


DiskTier.TestCase.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
TestDiskTier = pytest.mark.slow(DiskTier.TestCase)
