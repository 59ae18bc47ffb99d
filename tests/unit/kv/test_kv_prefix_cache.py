"""Prefix caching in the KV layer: chained block hashes, the pool's cached/evictable blocks
(LRU), and the manager's lookup / allocate-from-hits / register, with exact block ids."""

from __future__ import annotations

import hashlib
import struct

import pytest

from fitserve.kv.block_pool import BlockPool
from fitserve.kv.manager import KVCacheManager, KVStats
from fitserve.kv.prefix_hash import ROOT_HASH, extend_block_hashes, hash_block


def h(tag: str) -> bytes:
    return hashlib.sha256(tag.encode()).digest()


def chain(tokens: list[int], bs: int, extra: tuple[str | int, ...] = ()) -> list[bytes]:
    out: list[bytes] = []
    extend_block_hashes(out, tokens, bs, len(tokens) // bs, extra)
    return out


# ------------------------------------------------------------------------------- hashes


def test_hash_layout_is_pinned() -> None:
    # the documented byte layout, so a change to it (which would orphan logged hashes) is seen
    want = hashlib.sha256(ROOT_HASH + struct.pack("<I4q", 4, 1, 2, 3, 4)).digest()
    assert hash_block(ROOT_HASH, [1, 2, 3, 4]) == want
    assert hashlib.sha256(b"fitserve prefix cache v1").digest() == ROOT_HASH
    assert len(want) == 32


def test_hashes_chain_over_the_prefix_and_extra_keys() -> None:
    a = chain([1, 2, 3, 4, 5, 6, 7, 8, 9], 4)
    assert len(a) == 2  # the partial block [9] has no hash
    assert a[1] == hash_block(a[0], [5, 6, 7, 8])
    # same second block after a different first block: a different hash (K/V differ)
    b = chain([0, 2, 3, 4, 5, 6, 7, 8], 4)
    assert b[0] != a[0] and b[1] != a[1]
    # a shared head gives shared leading hashes, then they part
    c = chain([1, 2, 3, 4, 5, 6, 7, 0], 4)
    assert c[0] == a[0] and c[1] != a[1]
    # extra keys (an adapter, a salt) separate otherwise equal prefixes
    lora = chain([1, 2, 3, 4, 5, 6, 7, 8], 4, ("lora:x",))
    assert lora[0] != a[0] and lora[1] != a[1]
    assert chain([1, 2, 3, 4], 4, ("lora:x",)) == lora[:1]
    # order matters, and [1, 23] is not [12, 3]
    assert hash_block(ROOT_HASH, [1, 2]) != hash_block(ROOT_HASH, [2, 1])
    assert hash_block(ROOT_HASH, [1, 23]) != hash_block(ROOT_HASH, [12, 3])


def test_extend_only_adds_new_blocks() -> None:
    tokens = list(range(20))
    hashes = chain(tokens[:8], 4)
    first = list(hashes)
    extend_block_hashes(hashes, tokens, 4, 5)
    assert hashes[:2] == first and hashes == chain(tokens, 4)
    extend_block_hashes(hashes, tokens, 4, 3)  # already covered: nothing changes
    assert len(hashes) == 5
    with pytest.raises(ValueError, match="need 24 tokens"):
        extend_block_hashes(hashes, tokens, 4, 6)


# ------------------------------------------------------------------------------- pool


def test_freed_cached_block_stays_cached_until_the_pool_needs_it() -> None:
    pool = BlockPool(6)
    assert pool.allocate(2) == [0, 1]
    assert pool.cache_block(0, h("a"))
    pool.decref([1, 0])
    # empty 1 first, then the never used 2..5, then the evictable 0
    assert pool.free_block_ids() == [1, 2, 3, 4, 5, 0]
    assert (pool.num_free_blocks, pool.num_cached_blocks, pool.num_evictable_cached_blocks) == (6, 1, 1)
    assert pool.lookup(h("a")) == 0 and pool.block_hash(0) == h("a")
    # a hit revives it from the free list
    pool.touch([0])
    assert pool.ref_count(0) == 1 and pool.free_block_ids() == [1, 2, 3, 4, 5]
    assert pool.num_evictable_cached_blocks == 0
    pool.decref([0])
    # every other free block goes first; taking 0 evicts its hash
    assert pool.allocate(5) == [1, 2, 3, 4, 5]
    assert pool.lookup(h("a")) == 0 and pool.num_evictions == 0
    assert pool.allocate(1) == [0]
    assert pool.lookup(h("a")) is None and pool.block_hash(0) is None
    assert (pool.num_cached_blocks, pool.num_evictable_cached_blocks, pool.num_evictions) == (0, 0, 1)


def test_lru_evicts_the_least_recently_freed_cached_block() -> None:
    pool = BlockPool(3)
    pool.allocate(3)
    for b, tag in enumerate("xyz"):
        assert pool.cache_block(b, h(tag))
    pool.decref([1])
    pool.decref([2])
    pool.decref([0])
    assert pool.free_block_ids() == [1, 2, 0]
    pool.touch([2])  # a hit refreshes 2: freed again, it goes to the back
    pool.decref([2])
    assert pool.allocate(1) == [1]
    assert [pool.lookup(h(t)) for t in "xyz"] == [0, None, 2]
    assert pool.allocate(1) == [0]
    assert [pool.lookup(h(t)) for t in "xyz"] == [None, None, 2]


def test_touch_shares_a_held_cached_block() -> None:
    pool = BlockPool(2)
    (b,) = pool.allocate(1)
    pool.cache_block(b, h("a"))
    pool.touch([b, b])
    assert pool.ref_count(b) == 3 and pool.num_free_blocks == 1
    pool.decref([b, b, b])
    assert pool.num_evictable_cached_blocks == 1


def test_cache_block_rules() -> None:
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    assert pool.cache_block(a, h("p"))
    assert pool.cache_block(a, h("p"))  # again under its own hash: fine
    assert not pool.cache_block(b, h("p"))  # a duplicate prefix: the first one stays cached
    assert pool.block_hash(b) is None and pool.lookup(h("p")) == a
    with pytest.raises(ValueError, match="another hash"):
        pool.cache_block(a, h("q"))
    with pytest.raises(ValueError, match="free block 2"):
        pool.cache_block(2, h("q"))
    with pytest.raises(ValueError, match="holds no cached prefix"):
        pool.touch([b])
    with pytest.raises(ValueError, match="holds no cached prefix"):
        pool.touch([a, 3])  # all-or-nothing: a keeps its count
    assert pool.ref_count(a) == 1
    with pytest.raises(ValueError, match="out of range"):
        pool.touch([9])


def test_reset_prefix_cache_drops_only_evictable_blocks() -> None:
    pool = BlockPool(3)
    a, b = pool.allocate(2)
    pool.cache_block(a, h("a"))
    pool.cache_block(b, h("b"))
    pool.decref([b])
    assert pool.reset_prefix_cache() == 1
    assert pool.lookup(h("a")) == a and pool.lookup(h("b")) is None
    assert (pool.num_evictable_cached_blocks, pool.num_evictions) == (0, 0)


# ------------------------------------------------------------------------------- manager


def test_lookup_caps_to_leave_the_last_token_and_stops_at_a_miss() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    tokens = list(range(12))
    hashes = chain(tokens, 4)
    assert kv.allocate("a", 12)
    assert kv.get_computed_blocks(hashes, 12) == []  # nothing registered yet
    kv.cache_blocks("a", hashes, 12)
    assert kv.block_table("a") == [0, 1, 2]
    # 12 tokens, all 3 blocks cached: the cap (12 - 1) // 4 = 2 leaves block 2 to compute
    assert kv.get_computed_blocks(hashes, 12) == [0, 1]
    assert kv.get_computed_blocks(hashes, 13) == [0, 1, 2]
    assert kv.get_computed_blocks(hashes, 5) == [0]
    assert kv.get_computed_blocks(hashes, 4) == []
    assert kv.get_computed_blocks(hashes, 0) == []
    # a miss in block 1 ends the prefix (and chained hashes differ after it anyway)
    other = chain([0, 1, 2, 3, 9, 9, 9, 9, 8, 9, 10, 11], 4)
    assert kv.get_computed_blocks(other, 13) == [0]


def test_allocate_from_hits_shares_and_revives() -> None:
    kv = KVCacheManager(num_blocks=6, block_size=4)
    tokens = list(range(10))
    hashes = chain(tokens, 4)
    kv.allocate("a", 10)  # [0, 1, 2]
    kv.cache_blocks("a", hashes, 10)  # only the 2 full blocks: 2 is partial
    assert kv.pool.num_cached_blocks == 2 and kv.pool.block_hash(2) is None
    hits = kv.get_computed_blocks(hashes, 10)
    assert hits == [0, 1]
    assert kv.allocate("b", 10, hits)
    assert kv.block_table("b") == [0, 1, 3]
    assert [kv.pool.ref_count(b) for b in range(4)] == [2, 2, 1, 1]
    assert kv.block_owners() == {0: ["a", "b"], 1: ["a", "b"], 2: ["a"], 3: ["b"]}
    kv.free("a")
    kv.free("b")
    # the empty 2 and 3 (freed tail first), the never used 4 and 5, the evictable 1 and 0
    assert kv.pool.free_block_ids() == [2, 3, 4, 5, 1, 0]
    assert kv.stats().evictable_cached_blocks == 2
    # revived from the free list: both hits leave it, one block is new (2, the front)
    assert kv.allocate("c", 9, kv.get_computed_blocks(hashes, 9))
    assert kv.block_table("c") == [0, 1, 2]
    assert kv.pool.free_block_ids() == [3, 4, 5]
    kv.cache_blocks("c", hashes, 9)  # its hits are registered already: nothing changes
    assert kv.pool.num_cached_blocks == 2


def test_allocate_from_hits_is_all_or_nothing() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=4)
    hashes = chain(list(range(8)), 4)
    kv.allocate("a", 8)
    kv.cache_blocks("a", hashes, 8)
    kv.free("a")  # tail first, after the never used 2 and 3
    assert kv.pool.free_block_ids() == [2, 3, 1, 0]
    kv.allocate("x", 8)  # takes 2, 3
    hits = kv.get_computed_blocks(hashes, 9)
    assert hits == [0, 1]
    # 2 hits (both evictable: they use 2 of the 2 free blocks) + 2 new blocks > 2 free
    assert not kv.allocate("b", 16, hits)
    assert not kv.has_request("b")
    assert kv.pool.free_block_ids() == [1, 0] and kv.pool.num_evictable_cached_blocks == 2
    assert kv.allocate("b", 8, hits)
    assert kv.block_table("b") == [0, 1] and kv.pool.num_free_blocks == 0


def test_allocate_from_hits_errors() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=4)
    hashes = chain(list(range(8)), 4)
    kv.allocate("a", 8)
    kv.cache_blocks("a", hashes, 8)
    with pytest.raises(ValueError, match="already has blocks"):
        kv.allocate("a", 12, [0])
    with pytest.raises(ValueError, match="exceed"):
        kv.allocate("b", 4, [0, 1])


def test_cache_blocks_registers_only_full_computed_blocks_incrementally() -> None:
    kv = KVCacheManager(num_blocks=6, block_size=4)
    tokens = list(range(16))
    hashes = chain(tokens, 4)
    kv.allocate("a", 16)
    kv.cache_blocks("a", hashes, 3)
    assert kv.pool.num_cached_blocks == 0
    kv.cache_blocks("a", hashes, 9)
    assert [kv.pool.block_hash(b) for b in range(4)] == [hashes[0], hashes[1], None, None]
    kv.cache_blocks("a", hashes[:3], 16)  # hashes known for 3 blocks only: 3 registered
    assert kv.pool.num_cached_blocks == 3
    kv.cache_blocks("nope", hashes, 16)  # unknown request: nothing
    assert kv.pool.num_cached_blocks == 3


def test_duplicate_prefix_computed_twice_keeps_the_first() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=2)
    hashes = chain([5, 6, 7, 8], 2)
    kv.allocate("a", 4)
    kv.allocate("b", 4)
    kv.cache_blocks("a", hashes, 4)
    kv.cache_blocks("b", hashes, 4)
    assert [kv.pool.block_hash(b) for b in range(4)] == [hashes[0], hashes[1], None, None]
    kv.free("a")
    kv.free("b")
    assert kv.get_computed_blocks(hashes, 5) == [0, 1]


def test_stats_count_cached_blocks_and_prefix_queries() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=4)
    hashes = chain(list(range(8)), 4)
    kv.allocate("a", 9)
    kv.cache_blocks("a", hashes, 8)
    kv.record_prefix_lookup(9, 0)
    kv.free("a")
    assert kv.stats() == KVStats(
        num_blocks=10, used_blocks=0, free_blocks=10, allocated_slots=0, used_slots=0,
        fragmentation=0.0, prefix_cache_queries=9, prefix_cache_hits=0, cached_blocks=2,
        evictable_cached_blocks=2, touched_blocks=3,
    )
    hits = kv.get_computed_blocks(hashes, 10)
    kv.allocate("b", 10, hits)
    kv.record_prefix_lookup(10, 8)
    s = kv.stats()
    assert (s.prefix_cache_queries, s.prefix_cache_hits) == (19, 8)
    assert (s.used_blocks, s.used_slots, s.cached_blocks, s.evictable_cached_blocks) == (3, 10, 2, 0)
    with pytest.raises(ValueError, match="hit 5 of 4"):
        kv.record_prefix_lookup(4, 5)


def test_caching_off_finds_and_registers_nothing() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=4, enable_caching=False)
    hashes = chain(list(range(8)), 4)
    kv.allocate("a", 8)
    kv.cache_blocks("a", hashes, 8)
    assert kv.pool.num_cached_blocks == 0
    assert kv.get_computed_blocks(hashes, 9) == []
    kv.record_prefix_lookup(9, 0)
    assert (kv.stats().prefix_cache_queries, kv.stats().cached_blocks) == (0, 0)


def test_fork_keeps_working_with_cached_blocks() -> None:
    kv = KVCacheManager(num_blocks=6, block_size=4)
    hashes = chain(list(range(8)), 4)
    kv.allocate("p", 6)
    kv.cache_blocks("p", hashes, 4)
    kv.fork("p", "c")
    assert kv.block_table("c") == [0, 1] and kv.pool.ref_count(0) == 2
    kv.allocate("c", 8)
    kv.cache_blocks("c", hashes, 8)  # the child registers the block it filled, not block 0 again
    assert [kv.pool.block_hash(b) for b in (0, 1)] == hashes
    kv.free("p")
    kv.free("c")
    assert kv.pool.num_free_blocks == 6 and kv.pool.num_evictable_cached_blocks == 2
