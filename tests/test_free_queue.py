"""The linked free queue: order, O(1) removal, and the lazily created tail;
the free list every policy is built on."""

from __future__ import annotations

import pytest

from kvpool.block import KVBlock
from kvpool.errors import InvariantViolation
from kvpool.free_queue import FreeBlockQueue
from kvpool.linked_blocks import FreeList


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


# -- the free list under every policy ----------------------------------------------


def records(n: int) -> list[KVBlock]:
    return [KVBlock(i) for i in range(n)]


def test_a_list_without_a_range_starts_empty_and_keeps_insertion_order():
    blocks = records(6)
    free = FreeList(blocks, len(blocks))
    assert free.num_free_blocks == 0 and free.num_never_used == 0 and list(free) == []
    free.append(blocks[3])
    free.append_n([blocks[1], blocks[4]])
    free.prepend_n([blocks[5], blocks[2]])
    assert [b.block_id for b in free] == list(free.block_ids()) == [5, 2, 3, 1, 4]
    free.remove(blocks[3])
    assert list(free.block_ids()) == [5, 2, 1, 4] and free.num_free_blocks == 4
    free.check("test list")


def test_iteration_skips_the_never_used_range_that_block_ids_spells_out():
    blocks = records(3)
    free = FreeList(blocks, 6)
    free.prepend_n([blocks[2]])
    free.append_n([blocks[1]])
    assert list(free.block_ids()) == [2, 3, 4, 5, 1]
    assert [b.block_id for b in free] == [2, 1]
    assert free.num_free_blocks == 5 and free.num_never_used == 3


def test_popleft_run_takes_the_front_up_to_a_key():
    blocks = records(6)
    free = FreeList(blocks, len(blocks))
    free.append_n(blocks[1:])
    keys = [0, 1, 1, 2, 5, 9]
    out: list[KVBlock] = []
    assert free.popleft_run(10, out, keys, 2) == 3
    assert [b.block_id for b in out] == [1, 2, 3]
    assert all(b.prev_free is None and b.next_free is None for b in out)
    assert free.popleft_run(1, out, keys, 100) == 1  # n caps the run
    assert free.popleft_run(5, out, keys, 100) == 1  # the tail ends it
    assert free.popleft_run(5, out, keys, 100) == 0
    assert [b.block_id for b in out] == [1, 2, 3, 4, 5] and free.num_free_blocks == 0
    free.check()


def test_check_names_the_broken_list():
    blocks = records(4)
    free = FreeList(blocks, len(blocks))
    free.append_n(blocks[1:])
    free.num_free_blocks += 1
    with pytest.raises(InvariantViolation, match="class 2 holds 3 blocks, its count says 4"):
        free.check("class 2")
