"""KVCacheManager: block tables, all-or-nothing growth, fragmentation, fork and free."""

from __future__ import annotations

import pytest

from fitserve.kv.manager import KVCacheManager, KVStats


def test_tables_grow_by_whole_blocks() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    assert kv.blocks_needed("a", 5) == 2
    assert kv.allocate("a", 5)
    assert kv.block_table("a") == [0, 1]
    assert kv.blocks_needed("a", 8) == 0
    assert kv.blocks_needed("a", 9) == 1
    assert kv.blocks_needed("a", 3) == 0  # never negative
    assert kv.allocate("b", 1)
    assert kv.allocate("a", 9)
    assert kv.block_table("a") == [0, 1, 3]
    assert kv.block_table("b") == [2]
    assert kv.has_request("a") and not kv.has_request("zzz")
    assert kv.block_table("zzz") == []


def test_block_table_is_a_copy() -> None:
    kv = KVCacheManager(num_blocks=2, block_size=4)
    kv.allocate("a", 4)
    kv.block_table("a").append(99)
    assert kv.block_table("a") == [0]


def test_allocate_is_all_or_nothing() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=4)
    assert kv.allocate("a", 12)
    assert not kv.allocate("b", 8)  # needs 2, 1 free
    assert not kv.has_request("b")
    assert kv.pool.num_free_blocks == 1
    assert not kv.allocate("a", 20)  # needs 2 more
    assert kv.block_table("a") == [0, 1, 2]
    assert kv.stats().used_slots == 12


def test_fragmentation_exact() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=16)
    assert kv.stats() == KVStats(10, 0, 10, 0, 0, 0.0)
    kv.allocate("a", 5)
    kv.allocate("b", 20)
    s = kv.stats()
    assert s == KVStats(
        num_blocks=10,
        used_blocks=3,
        free_blocks=7,
        allocated_slots=48,
        used_slots=25,
        fragmentation=23 / 48,
        touched_blocks=3,
    )
    kv.allocate("b", 32)  # fills b's second block
    assert kv.stats().used_slots == 37
    assert kv.stats().fragmentation == 11 / 48
    kv.free("a")
    assert kv.stats() == KVStats(10, 2, 8, 32, 32, 0.0, touched_blocks=3)


def test_free_returns_every_block_and_unknown_is_noop() -> None:
    kv = KVCacheManager(num_blocks=6, block_size=2)
    kv.allocate("a", 5)  # [0, 1, 2]
    kv.allocate("b", 2)  # [3]
    kv.free("a")
    kv.free("a")
    kv.free("nope")
    assert kv.pool.num_free_blocks == 5
    assert not kv.has_request("a")
    # freed tail-first: a's used 2, 1, 0 are reused before the never touched 4, 5
    assert kv.pool.allocate(5) == [2, 1, 0, 4, 5]


def test_fork_shares_blocks_and_free_order_does_not_matter() -> None:
    for first, second in (("p", "c"), ("c", "p")):
        kv = KVCacheManager(num_blocks=6, block_size=4)
        kv.allocate("p", 6)  # [0, 1]
        kv.fork("p", "c")
        assert kv.block_table("c") == [0, 1]
        assert [kv.pool.ref_count(b) for b in (0, 1)] == [2, 2]
        assert kv.block_owners() == {0: ["p", "c"], 1: ["p", "c"]}
        # shared blocks count once: 2 blocks, 8 slots, 6 used
        assert kv.stats() == KVStats(6, 2, 4, 8, 6, 2 / 8, shared_blocks=2,
                                     touched_blocks=2)
        kv.allocate("c", 9)  # child grows on its own: [0, 1, 2]
        assert kv.block_owners() == {0: ["p", "c"], 1: ["p", "c"], 2: ["c"]}
        assert kv.stats().used_slots == 9
        kv.free(first)
        assert kv.pool.num_used_blocks == (3 if first == "p" else 2)
        assert all(kv.pool.ref_count(b) == 1 for b in kv.block_owners())
        kv.free(second)
        assert kv.pool.num_free_blocks == 6
        assert kv.block_owners() == {}


def test_fork_errors() -> None:
    kv = KVCacheManager(num_blocks=2, block_size=4)
    kv.allocate("p", 1)
    with pytest.raises(KeyError):
        kv.fork("nope", "c")
    with pytest.raises(ValueError, match="existing"):
        kv.fork("p", "p")
    with pytest.raises(ValueError, match="block_size"):
        KVCacheManager(num_blocks=2, block_size=0)
