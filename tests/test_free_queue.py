"""The linked free queue: order, O(1) removal, and the lazily created tail."""

from __future__ import annotations

import pytest

from kvpool.block import KVBlock
from kvpool.errors import InvariantViolation
from kvpool.free_queue import FreeBlockQueue


def make(num_blocks: int) -> tuple[FreeBlockQueue, list[KVBlock]]:
    blocks = [KVBlock(0)]
    return FreeBlockQueue(blocks, num_blocks), blocks


def test_starts_in_block_id_order_without_block_zero():
    queue, blocks = make(6)
    assert list(queue.block_ids()) == [1, 2, 3, 4, 5]
    assert queue.num_free_blocks == 5
    assert len(blocks) == 1  # nothing materialised yet
    queue.check()


def test_popleft_materialises_in_id_order_and_records_are_indexed_by_id():
    queue, blocks = make(6)
    taken = queue.popleft_n(3)
    assert [b.block_id for b in taken] == [1, 2, 3]
    assert [b.block_id for b in blocks] == [0, 1, 2, 3]
    assert list(queue.block_ids()) == [4, 5]
    queue.check()


def test_prepend_goes_before_never_used_and_append_after():
    queue, _ = make(8)
    a, b, c = queue.popleft_n(3)
    queue.prepend_n([c, a])
    queue.append_n([b])
    assert list(queue.block_ids()) == [3, 1, 4, 5, 6, 7, 2]
    assert [x.block_id for x in queue.popleft_n(4)] == [3, 1, 4, 5]
    queue.check()


def test_remove_from_the_middle_is_exact():
    queue, _ = make(6)
    taken = queue.popleft_n(5)
    queue.append_n(taken)
    queue.remove(taken[2])
    assert list(queue.block_ids()) == [1, 2, 4, 5]
    assert queue.num_free_blocks == 4
    with pytest.raises(InvariantViolation):
        queue.remove(taken[2])
    queue.check()


def test_exhausting_the_never_used_range_unlinks_its_marker():
    queue, blocks = make(4)
    taken = queue.popleft_n(3)
    assert queue.num_free_blocks == 0 and queue.num_never_used == 0
    assert list(queue.block_ids()) == []
    queue.append_n(taken[:1])
    queue.prepend_n(taken[1:])
    assert list(queue.block_ids()) == [2, 3, 1]
    queue.check()
    with pytest.raises(InvariantViolation):
        queue.popleft_n(4)


def test_check_detects_a_broken_link():
    queue, _ = make(5)
    taken = queue.popleft_n(4)
    queue.append_n(taken)
    taken[1].prev_free = taken[3]
    with pytest.raises(InvariantViolation):
        queue.check()


def test_a_million_block_queue_is_built_without_materialising_blocks():
    queue, blocks = make(1_000_000)
    assert queue.num_free_blocks == 999_999
    assert len(blocks) == 1
    assert [b.block_id for b in queue.popleft_n(2)] == [1, 2]
