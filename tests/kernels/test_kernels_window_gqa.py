"""Sliding-window tile counting and GQA packing."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fitserve.tools.labs.gqa import gqa_intensity, pack_gqa, unpack_gqa
from fitserve.tools.labs.reference import naive_attention
from fitserve.tools.labs.tiled import TileStats, tiled_attention
from fitserve.tools.labs.varlen import varlen_attention
from fitserve.tools.labs.window import (
    TileCounts,
    brute_force_key_tiles,
    count_key_tiles,
    predict_window_speedup,
    visible_pairs,
)

SETTINGS = settings(max_examples=60, deadline=None, derandomize=True)


@SETTINGS
@given(t=st.integers(1, 30), extra=st.integers(0, 30), bm=st.integers(1, 9), bn=st.integers(1, 9),
       window=st.one_of(st.none(), st.integers(1, 70)))
def test_counts_equal_brute_force(t: int, extra: int, bm: int, bn: int,
                                  window: int | None) -> None:
    assert count_key_tiles(t, t + extra, bm, bn, window) == brute_force_key_tiles(
        t, t + extra, bm, bn, window)


@settings(max_examples=15, deadline=None, derandomize=True)
@given(t=st.integers(1, 20), extra=st.integers(0, 20), bm=st.integers(1, 7), bn=st.integers(1, 7),
       window=st.one_of(st.none(), st.integers(1, 50)))
def test_kernel_visits_exactly_the_counted_tiles(t: int, extra: int, bm: int, bn: int,
                                                 window: int | None) -> None:
    stats = TileStats()
    q, k, v = torch.randn(1, t, 4), torch.randn(1, t + extra, 4), torch.randn(1, t + extra, 4)
    tiled_attention(q, k, v, causal=True, window=window, block_m=bm, block_n=bn, stats=stats)
    c = count_key_tiles(t, t + extra, bm, bn, window)
    assert (stats.skipped, stats.full, stats.masked) == (c.skipped, c.full, c.masked)


def test_docstring_example() -> None:
    c = count_key_tiles(12, 12, 4, 4, 5)
    assert (c.skipped, c.full, c.masked) == (4, 0, 5)      # the picture in the docstring
    assert count_key_tiles(12, 12, 4, 4, None) == TileCounts(3, 3, 3, 4 + 8 + 12,
                                                              4 * (4 + 8 + 12))


def test_window_larger_than_sequence_equals_causal() -> None:
    assert count_key_tiles(100, 100, 16, 16, 1000) == count_key_tiles(100, 100, 16, 16, None)


def test_speedup_prediction_next_to_naive_ratio() -> None:
    sp = predict_window_speedup(4096, 512, 64, 64)
    assert sp.naive_ratio == 8.0
    assert sp.pair_ratio == visible_pairs(4096, None) / visible_pairs(4096, 512)
    # causal visits 64*65/2 = 2080 tiles; the window visits 540, so 3.85x, not 8x
    assert sp.causal.visited == 2080 and sp.windowed.visited == 540
    assert abs(sp.tile_ratio - 2080 / 540) < 1e-12
    assert sp.tile_ratio < sp.pair_ratio < sp.naive_ratio


def test_visible_pairs_closed_form() -> None:
    for n in range(0, 12):
        for w in (None, 1, 3, 20):
            brute = sum(1 for p in range(n) for j in range(n) if j <= p and (w is None or j > p - w))
            assert visible_pairs(n, w) == brute


@settings(max_examples=30, deadline=None, derandomize=True)
@given(t=st.integers(1, 9), hkv=st.integers(1, 4), group=st.integers(1, 5))
def test_pack_unpack_roundtrip_and_mapping(t: int, hkv: int, group: int) -> None:
    q = torch.randn(t, hkv * group, 3)
    packed = pack_gqa(q, hkv)
    assert packed.shape == (hkv, t * group, 3)
    for h in range(hkv * group):
        for tok in range(t):
            assert torch.equal(packed[h // group, tok * group + h % group], q[tok, h])
    assert torch.equal(unpack_gqa(packed, hkv * group), q)


def test_gqa_folded_equals_per_head_expansion() -> None:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(11, 8, 16, generator=g)
    k, v = (torch.randn(11, 2, 16, generator=g) for _ in range(2))
    cu = torch.tensor([0, 11])
    out, _ = varlen_attention(q, k, v, cu, cu, causal=True, block_m=3, block_n=4)
    ref, _ = naive_attention(q.transpose(0, 1), k.transpose(0, 1).repeat_interleave(4, 0),
                             v.transpose(0, 1).repeat_interleave(4, 0), causal=True)
    torch.testing.assert_close(out.double(), ref.transpose(0, 1), atol=2e-5, rtol=2e-5)


def test_gqa_intensity_decode() -> None:
    # decode (T=1), G=4, 4096 keys, D=128, bf16: folding quadruples the intensity (~ G)
    gi = gqa_intensity(1, 4, 4096, 128, 2)
    assert gi.flops == 4 * 4 * 4096 * 128
    assert gi.bytes_folded == 2 * 4 * 128 * 2 + 2 * 4096 * 128 * 2
    assert 3.9 < gi.intensity_folded / gi.intensity_per_head <= 4.0
    assert abs(gi.intensity_per_head - 1.0) < 0.01         # ~1 FLOP/B: hopelessly memory-bound
