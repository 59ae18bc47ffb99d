"""Layer groups: windowed groups free what their window left behind, with exact block counts;
prefix hits across groups equal a brute-force search and read exactly what an unshared run wrote."""

from __future__ import annotations

import random

import pytest

from fitserve.config import ModelSpec
from fitserve.kv.group import NULL_BLOCK, KVGroup
from fitserve.kv.manager import KVCacheManager
from fitserve.kv.prefix_hash import extend_block_hashes
from fitserve.ledger.kv import kv_block_bytes
from fitserve.ledger.kv_groups import plan_kv_groups, request_group_blocks


def test_window_frees_blocks_behind_it_exact_tables() -> None:
    # window 5, block 4: a query at p sees p-4 .. p
    kv = KVCacheManager(8, 4, window=5, enable_caching=False)
    assert kv.stats().num_blocks == 7  # block 0 is the null block
    assert kv.allocate_slots("a", 0, 10) == [[]]
    assert kv.block_table("a") == [1, 2, 3]
    kv.allocate_slots("a", 10, 11)  # query 10 sees 6..10: block 0 (0..3) dead
    assert kv.block_table("a") == [NULL_BLOCK, 2, 3]
    assert kv.stats().used_blocks == 2
    kv.allocate_slots("a", 11, 12)  # sees 7..11: block 1 still live
    assert kv.block_table("a") == [NULL_BLOCK, 2, 3]
    kv.allocate_slots("a", 12, 13)  # sees 8..12: block 1 (4..7) dead, new block for 12
    assert kv.block_table("a") == [NULL_BLOCK, NULL_BLOCK, 3, 1]
    assert kv.stats().used_blocks == 2
    kv.free("a")
    assert kv.stats().used_blocks == 0 and kv.stats().free_blocks == 7


def test_full_group_keeps_everything() -> None:
    kv = KVCacheManager(8, 4)
    kv.allocate_slots("a", 0, 10)
    kv.allocate_slots("a", 10, 13)
    assert kv.block_table("a") == [0, 1, 2, 3]


def gemma3_like(layers: int = 26, window: int = 512) -> ModelSpec:
    types = tuple("full" if (i + 1) % 6 == 0 else "sliding" for i in range(layers))
    return ModelSpec("gemma3_text", vocab_size=1000, hidden_size=64, intermediate_size=128,
                     num_layers=layers, num_heads=4, num_kv_heads=1, head_dim=256,
                     sliding_window=window, layer_types=types)


def test_group_blocks_carry_their_layers_channel_key_scales() -> None:
    """int8 with per-channel key scales: a block of a group holds its tokens' codes and V scales
    plus one f32 per KV head and channel of each of its layers (the engine allocates them per
    layer and block; the groups' bytes add up to the one-pool block's)."""
    spec = gemma3_like()
    full, sw = plan_kv_groups(spec, 1 << 30, 16, "int8-kc", max_num_seqs=4, max_num_batched_tokens=2048)
    per_layer = 16 * 1 * (2 * 256 * 1 + 4) + 1 * 256 * 4  # 16 tokens x (K, V codes + V scale) + K scales
    assert full.block_bytes == 4 * per_layer and sw.block_bytes == 22 * per_layer
    assert full.block_bytes + sw.block_bytes == kv_block_bytes(spec, 16, "int8-kc")


def test_32k_request_on_gemma3_shape_holds_the_ledger_blocks() -> None:
    spec = gemma3_like()
    bs = 16
    groups = plan_kv_groups(spec, 8 << 30, bs, "bf16", max_num_seqs=4, max_num_batched_tokens=2048)
    full, sw = groups
    assert (len(full.layers), len(sw.layers)) == (4, 22)
    # the windowed pool: 4 x (ceil(511/16) + 1 + 1) + 2048/16, plus the null block
    assert sw.num_blocks == 4 * 34 + 128 + 1 == 265
    assert full.block_bytes == 4 * 16 * 2 * 256 * 2 and sw.block_bytes == 22 * 16 * 2 * 256 * 2
    assert full.num_blocks == ((8 << 30) - 265 * sw.block_bytes) // full.block_bytes
    kv = KVCacheManager.from_groups([KVGroup(g.kind, g.num_blocks, g.window) for g in groups], bs,
                                    enable_caching=False)
    done = 0
    seen: list[tuple[int, tuple[int, ...]]] = []
    while done < 32768:
        chunk = 2048 if done < 30720 else 1
        assert kv.allocate_slots("r", done, done + chunk) is not None
        held = kv.stats().group_used_blocks
        assert held == request_group_blocks(groups, bs, done + chunk, done)
        if done in (0, 2048, 16384, 30720, 32767):
            seen.append((done, held))
        done += chunk
    # written out: full = ceil(total / 16); window = ceil(total / 16) - (done - 511) // 16
    assert seen == [(0, (128, 128)), (2048, (256, 160)), (16384, (1152, 160)),
                    (30720, (1921, 33)), (32767, (2048, 32))]
    kv.free("r")
    assert kv.stats().used_blocks == 0


def test_hybrid_preempt_abort_and_forks_return_every_block() -> None:
    kv = KVCacheManager.from_groups([KVGroup("full", 40, None), KVGroup("sliding", 12, 6)], 4)
    assert kv.allocate_slots("p", 0, 10) == [[], []]
    assert kv.stats().group_used_blocks == (3, 3)
    kv.fork("p", "c1")
    kv.fork("p", "c2")
    assert kv.stats().group_used_blocks == (3, 3)
    # each writes position 10 in the shared partial block 2: copies in both groups
    cp = kv.allocate_slots("p", 10, 11)
    assert cp is not None and len(cp[0]) == 1 and len(cp[1]) == 1
    kv.allocate_slots("c1", 10, 11)
    kv.allocate_slots("c2", 10, 11)  # the last holder writes in place
    # full: shared blocks 0, 1 + three copies of block 2; window 6: query 10 sees 5 .. 10, so
    # the shared block 0 left every table: 1 + three copies of 2
    assert kv.stats().group_used_blocks == (5, 4)
    for i in range(11, 20):  # p moves on: its window (6) drops its early blocks
        kv.allocate_slots("p", i, i + 1)
    assert kv.block_tables("p")[1][:2] == [NULL_BLOCK, NULL_BLOCK]
    kv.free("c1")  # abort
    kv.free("p")  # preempt
    kv.free("c2")
    s = kv.stats()
    assert s.group_used_blocks == (0, 0) and s.free_blocks == 40 + 11


def test_prefix_hit_needs_only_the_window_before_it() -> None:
    kv = KVCacheManager(20, 4, window=9)  # a hit needs ceil(8 / 4) = 2 blocks before it
    toks = list(range(100, 124))
    hashes: list[bytes] = []
    extend_block_hashes(hashes, toks, 4, 6)
    kv.allocate_slots("a", 0, 24)
    kv.cache_blocks("a", hashes, 24)
    for i in range(24, 40):  # a moves on: blocks 0 .. 5 leave its window, stay cached
        kv.allocate_slots("a", i, i + 1)
    kv.free("a")
    kv.reset_prefix_cache()  # forget all
    kv.allocate_slots("b", 0, 24)
    kv.cache_blocks("b", hashes, 24)
    kv.free("b")
    hit = kv.find_prefix_hit(hashes, 25)[0]
    assert len(hit) == 6 and hit[:4] == [NULL_BLOCK] * 4 and NULL_BLOCK not in hit[4:]


# ---------------------------------------------------------------- against an unshared run

class Contents:
    """What each physical slot of each group holds: the prefix whose K/V it is."""

    def __init__(self, kv: KVCacheManager) -> None:
        self.kv = kv
        self.slot: list[dict[int, tuple[int, ...]]] = [{} for _ in kv.groups]

    def write(self, rid: str, toks: list[int], start: int, end: int) -> None:
        bs = self.kv.block_size
        for g, table in enumerate(self.kv.block_tables(rid)):
            for p in range(start, end):
                assert table[p // bs] != NULL_BLOCK or self.kv.groups[g].window is None
                self.slot[g][table[p // bs] * bs + p % bs] = tuple(toks[: p + 1])

    def check_reads(self, rid: str, toks: list[int], start: int, end: int) -> None:
        """Every key each query in [start, end) sees holds what an unshared run wrote there."""
        bs = self.kv.block_size
        for g, table in enumerate(self.kv.block_tables(rid)):
            w = self.kv.groups[g].window
            for q in range(start, end):
                for k in range(0 if w is None else max(0, q - w + 1), q + 1):
                    assert self.slot[g].get(table[k // bs] * bs + k % bs) == tuple(toks[: k + 1])


def brute_force_hit(kv: KVCacheManager, hashes: list[bytes], num_tokens: int) -> int:
    """The longest h (blocks) for which every group has, cached, every block it needs."""
    bs = kv.block_size
    for h in range(min(len(hashes), (num_tokens - 1) // bs), 0, -1):
        ok = True
        for g in kv.groups:
            lo = 0 if g.window is None else max(0, h * bs - g.window + 1) // bs
            ok &= all(g.pool.lookup(hashes[i]) is not None for i in range(lo, h))
        if ok:
            return h
    return 0


@pytest.mark.parametrize("seed", range(12))
def test_prefix_hits_equal_brute_force_and_read_unshared_contents(seed: int) -> None:
    rng = random.Random(seed)
    bs = 4
    w = rng.choice([3, 5, 9, 13])
    kv = KVCacheManager.from_groups([KVGroup("full", 60, None), KVGroup("sliding", 14, w)], bs)
    mem = Contents(kv)
    base = [rng.randrange(5) for _ in range(40)]
    live: list[str] = []
    for r in range(14):
        toks = base[: rng.randrange(4, 40)] + [rng.randrange(5) for _ in range(rng.randrange(1, 12))]
        hashes: list[bytes] = []
        extend_block_hashes(hashes, toks, bs, len(toks) // bs)
        rid = f"r{r}"
        hit = kv.find_prefix_hit(hashes, len(toks))
        assert len(hit[0]) == brute_force_hit(kv, hashes, len(toks))
        done = len(hit[0]) * bs
        if not kv.allocate(rid, done, computed_groups=hit):
            for old in live:
                kv.free(old)
            live = []
            assert kv.allocate(rid, done, computed_groups=hit)
        live.append(rid)
        while done < len(toks):
            end = min(len(toks), done + rng.randrange(1, 9))
            if kv.allocate_slots(rid, done, end) is None:
                kv.free(rid)
                live.remove(rid)
                break
            mem.write(rid, toks, done, end)
            mem.check_reads(rid, toks, done, end)
            done = end
            kv.cache_blocks(rid, hashes, done)
        if rng.random() < 0.5 and rid in live:
            kv.free(rid)
            live.remove(rid)
    for rid in live:
        kv.free(rid)
    assert kv.stats().used_blocks == 0
