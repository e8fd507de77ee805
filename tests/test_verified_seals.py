"""The verified index's seals: numbers kept in the block records, never issued twice."""

from __future__ import annotations

import pytest

from kvpool.block import KVBlock, block_ids
from kvpool.errors import InvariantViolation
from kvpool.hashing import BlockHash
from kvpool.prefix_index import VerifiedPrefixIndex

H = [BlockHash(bytes([i]) * 16) for i in range(4)]
C = [bytes([i]) * 64 for i in range(4)]


def _blocks(first: int, n: int) -> list[KVBlock]:
    return [KVBlock(first + i) for i in range(n)]


def test_a_chain_is_sealed_parent_by_parent():
    index = VerifiedPrefixIndex()
    table = _blocks(1, 3)
    assert index.insert_run(table, 0, 3, H, C, 0) == 3
    seals = [b.seal for b in table]
    assert len(set(seals)) == 3 and 0 not in seals
    assert [b.parent_seal for b in table] == [0, *seals[:2]]
    assert [b.content for b in table] == C[:3]
    assert index.longest_prefix(H, C, 4) == table


def test_a_lineage_evicted_and_rebuilt_gets_a_new_seal_so_old_children_miss():
    index = VerifiedPrefixIndex()
    old = _blocks(1, 2)
    index.insert_run(old, 0, 2, H, C, 0)
    index.remove_run([old[0]])  # the parent goes; its child stays cached under H[1]
    assert (old[0].seal, old[0].content, old[0].block_hash) == (0, None, None)
    rebuilt = _blocks(10, 1)
    index.insert_run(rebuilt, 0, 1, H, C, 0)  # same hash, same content: a new seal number
    assert rebuilt[0].seal not in (0, old[0].seal, old[1].seal, old[1].parent_seal)
    assert index.longest_prefix(H, C, 4) == rebuilt  # the old child is not reconnected
    again = _blocks(20, 2)
    assert index.insert_run(again, 0, 2, H, C, 0) == 1  # and its hash cannot take the new lineage's child


def test_a_duplicate_shares_the_seal_and_the_content():
    index = VerifiedPrefixIndex()
    first, second = _blocks(1, 2), _blocks(3, 2)
    index.insert_run(first, 0, 2, H, C, 0)
    contents = [bytes(c) for c in C]  # equal, not the same objects
    assert index.insert_run(second, 0, 2, H, contents, 0) == 2
    assert [b.seal for b in second] == [b.seal for b in first]
    assert all(a.content is b.content for a, b in zip(first, second))
    index.remove_run(first)
    assert index.longest_prefix(H, C, 4) == second  # the seal lives while one of its blocks does


def test_other_content_or_an_unsealed_parent_is_refused():
    index = VerifiedPrefixIndex()
    table = _blocks(1, 2)
    index.insert_run(table, 0, 2, H, C, 0)
    other = _blocks(5, 2)
    assert index.insert_run(other, 0, 2, H, [C[0], C[3]], 0) == 1  # block 1: same hash, other content
    assert other[1].seal == 0 and other[1].block_hash is None
    assert index.insert_run(_blocks(8, 2), 1, 2, H, C, 0) == 1  # block 0 was never sealed
    with pytest.raises(InvariantViolation, match="block 1 is cached twice"):
        index.insert_run(table, 0, 1, H, C, 0)


def test_clear_unseals_every_block():
    index = VerifiedPrefixIndex()
    table = _blocks(1, 3)
    index.insert_run(table, 0, 3, H, C, 0)
    index.clear()
    assert [(b.seal, b.content) for b in table] == [(0, None)] * 3
    assert index.longest_prefix(H, C, 4) == [] and len(index) == 0


def test_block_ids_lists_ids_in_order():
    assert block_ids(_blocks(7, 3)) == [7, 8, 9] and block_ids([]) == []
