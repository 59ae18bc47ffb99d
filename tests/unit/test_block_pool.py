"""BlockPool: deterministic allocation, reference counts, double free, exhaustion."""

from __future__ import annotations

import pytest

from fitserve.kv.block_pool import BlockPool, NoFreeBlocksError


def test_rejects_empty_pool() -> None:
    with pytest.raises(ValueError, match="at least 1 block"):
        BlockPool(0)


def test_allocate_in_free_list_order_and_refcount_one() -> None:
    pool = BlockPool(6)
    assert pool.allocate(2) == [0, 1]
    assert pool.allocate(3) == [2, 3, 4]
    assert [pool.ref_count(b) for b in range(6)] == [1, 1, 1, 1, 1, 0]
    assert (pool.num_used_blocks, pool.num_free_blocks) == (5, 1)
    assert pool.allocate(0) == []


def test_freed_blocks_go_to_the_back_of_the_free_list() -> None:
    pool = BlockPool(4)
    pool.allocate(4)
    pool.decref([2, 0])
    assert pool.num_free_blocks == 2
    assert pool.allocate(2) == [2, 0]


def test_exhaustion_raises_and_leaves_pool_unchanged() -> None:
    pool = BlockPool(3)
    pool.allocate(2)
    with pytest.raises(NoFreeBlocksError, match="asked for 2 blocks but only 1 of 3"):
        pool.allocate(2)
    assert pool.num_free_blocks == 1
    assert [pool.ref_count(b) for b in range(3)] == [1, 1, 0]
    assert pool.allocate(1) == [2]


def test_incref_decref_sharing() -> None:
    pool = BlockPool(3)
    a = pool.allocate(2)
    pool.incref(a)
    pool.incref([0])
    assert [pool.ref_count(b) for b in range(3)] == [3, 2, 0]
    pool.decref(a)
    assert [pool.ref_count(b) for b in range(3)] == [2, 1, 0]
    assert pool.num_free_blocks == 1
    pool.decref([1, 0])
    assert pool.num_free_blocks == 2
    assert pool.ref_count(0) == 1
    pool.decref([0])
    assert pool.num_free_blocks == 3
    assert pool.allocate(3) == [2, 1, 0]


def test_double_free_raises_and_changes_nothing() -> None:
    pool = BlockPool(3)
    pool.allocate(2)
    pool.decref([0])
    with pytest.raises(ValueError, match="double free of block 0"):
        pool.decref([0])
    # a repeated id in one call counts twice; the valid part is not applied either
    with pytest.raises(ValueError, match="double free of block 1"):
        pool.decref([1, 1])
    assert pool.ref_count(1) == 1
    assert pool.num_free_blocks == 2


def test_incref_on_free_block_raises() -> None:
    pool = BlockPool(2)
    pool.allocate(1)
    with pytest.raises(ValueError, match="incref on free block 1"):
        pool.incref([0, 1])
    assert pool.ref_count(0) == 1  # all-or-nothing


def test_out_of_range_ids() -> None:
    pool = BlockPool(2)
    with pytest.raises(ValueError, match="out of range"):
        pool.ref_count(2)
    with pytest.raises(ValueError, match="out of range"):
        pool.decref([-1])
    with pytest.raises(ValueError, match="negative"):
        pool.allocate(-1)
