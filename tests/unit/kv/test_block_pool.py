"""BlockPool: deterministic allocation (empty, then fresh, then evictable blocks), reference
counts, double free, exhaustion, and the touched-block count a lazily backed cache is resident for."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

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


def test_freed_blocks_are_reused_before_fresh_ones() -> None:
    pool = BlockPool(8)
    pool.allocate(3)
    pool.decref([1])
    assert pool.free_block_ids() == [1, 3, 4, 5, 6, 7]
    assert pool.allocate(2) == [1, 3]
    assert pool.num_touched_blocks == 4
    pool.decref([0, 1, 2, 3])
    for _ in range(5):  # a churn of short requests stays on the blocks it already touched
        pool.decref(pool.allocate(4))
    assert pool.num_touched_blocks == 4


def test_evictable_blocks_are_taken_only_after_fresh_ones() -> None:
    pool = BlockPool(4)
    a = pool.allocate(2)
    assert pool.cache_block(a[0], b"h0")
    pool.decref(a)  # a[0] evictable, a[1] empty
    assert pool.free_block_ids() == [1, 2, 3, 0]
    assert pool.allocate(3) == [1, 2, 3] and pool.lookup(b"h0") == 0
    assert pool.allocate(1) == [0] and pool.lookup(b"h0") is None
    assert pool.num_evictions == 1 and pool.num_touched_blocks == 4


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
    # used blocks are reused before the never-touched one, in the order they were freed
    assert pool.allocate(3) == [1, 0, 2]


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


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["alloc", "free", "cache", "hit", "reset"]),
                          st.integers(0, 6)), max_size=60))
def test_touched_blocks_are_the_most_ever_held_or_cached_at_once(ops: list[tuple[str, int]]) -> None:
    """What a lazily backed cache keeps resident is the workload's peak, not the pool: after any
    sequence of operations, num_touched_blocks == max over time of (held + evictable)."""
    pool = BlockPool(12)
    held: list[int] = []  # one entry per reference
    peak = 0
    for op, k in ops:
        if op == "alloc" and k <= pool.num_free_blocks:
            held += pool.allocate(k)
        elif op == "free" and held:
            pool.decref([held.pop(k % len(held))])
        elif op == "cache" and held:
            b = held[k % len(held)]
            if pool.block_hash(b) is None:
                pool.cache_block(b, f"h{b}-{k}".encode())
        elif op == "hit" and pool.num_cached_blocks:
            cached = [b for b in range(12) if pool.block_hash(b) is not None]
            b = cached[k % len(cached)]
            pool.touch([b])
            held.append(b)
        elif op == "reset":
            pool.reset_prefix_cache()
        peak = max(peak, pool.num_used_blocks + pool.num_evictable_cached_blocks)
        assert pool.num_touched_blocks == peak
        assert all(pool.ref_count(b) == 0 and pool.block_hash(b) is None
                   for b in range(pool.num_touched_blocks, 12))
