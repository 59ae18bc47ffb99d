"""Varlen packing (no cross-sequence leakage) and the paged variant (== contiguous)."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fitserve.tools.labs.paged import gather_keys, paged_attention_reference
from fitserve.tools.labs.reference import naive_attention
from fitserve.tools.labs.tiled import tiled_attention
from fitserve.tools.labs.varlen import varlen_attention

SETTINGS = settings(max_examples=25, deadline=None, derandomize=True)


def _cu(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lens, dtype=torch.int64).cumsum(0).tolist()],
                        dtype=torch.int32)


def _per_sequence_reference(q, k, v, q_lens, k_lens, *, causal, window):  # type: ignore[no-untyped-def]
    """Each sequence alone, heads expanded for GQA: the leakage-free ground truth."""
    group = q.shape[1] // k.shape[1]
    outs, cq, ck = [], 0, 0
    for tq, tk in zip(q_lens, k_lens, strict=True):
        kk = k[ck:ck + tk].transpose(0, 1).repeat_interleave(group, 0)
        vv = v[ck:ck + tk].transpose(0, 1).repeat_interleave(group, 0)
        o, _ = naive_attention(q[cq:cq + tq].transpose(0, 1), kk, vv, causal=causal, window=window)
        outs.append(o.transpose(0, 1))
        cq, ck = cq + tq, ck + tk
    return torch.cat(outs)


@st.composite
def _batches(draw: st.DrawFn) -> tuple[list[int], list[int]]:
    k_lens = draw(st.lists(st.integers(0, 13), min_size=1, max_size=4))
    q_lens = [draw(st.integers(0, n)) for n in k_lens]
    return q_lens, k_lens


@SETTINGS
@given(lens=_batches(), hkv=st.integers(1, 2), group=st.integers(1, 3), causal=st.booleans(),
       window=st.one_of(st.none(), st.integers(1, 15)), bm=st.integers(1, 8),
       bn=st.integers(1, 8), seed=st.integers(0, 2**16))
def test_varlen_matches_per_sequence(lens: tuple[list[int], list[int]], hkv: int, group: int,
                                     causal: bool, window: int | None, bm: int, bn: int,
                                     seed: int) -> None:
    q_lens, k_lens = lens
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(q_lens), hkv * group, 4, generator=g)
    k, v = (torch.randn(sum(k_lens), hkv, 4, generator=g) for _ in range(2))
    out, _ = varlen_attention(q, k, v, _cu(q_lens), _cu(k_lens), causal=causal, window=window,
                              block_m=bm, block_n=bn)
    ref = _per_sequence_reference(q, k, v, q_lens, k_lens, causal=causal, window=window)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)


def test_leakage_caught_where_a_causal_only_check_passes() -> None:
    """Two packed sequences with their boundary inside a 4x4 tile.

    The leaky kernel masks by packed index only (causal, no segment ids). A causal-only check
    ("row i does not depend on keys after i") passes for it. The perturbation check (change
    sequence A's keys/values; sequence B's output must be bit-identical) catches it, and our
    varlen kernel passes it both causal and bidirectional.
    """
    g = torch.Generator().manual_seed(0)
    q_lens = [5, 4]                               # boundary at packed index 5, inside 4x4 tiles
    cu = _cu(q_lens)
    q, k, v = (torch.randn(9, 2, 8, generator=g) for _ in range(3))
    k2, v2 = k.clone(), v.clone()
    k2[:5] += 3.0                                 # perturb sequence A only
    v2[:5] -= 2.0

    for causal in (True, False):
        a, _ = varlen_attention(q, k, v, cu, cu, causal=causal, block_m=4, block_n=4)
        b, _ = varlen_attention(q, k2, v2, cu, cu, causal=causal, block_m=4, block_n=4)
        assert torch.equal(a[5:], b[5:]), "sequence B saw sequence A"

    def leaky(kk: torch.Tensor, vv: torch.Tensor) -> torch.Tensor:
        o, _ = tiled_attention(q.transpose(0, 1), kk.transpose(0, 1), vv.transpose(0, 1),
                               causal=True, block_m=4, block_n=4)
        return o.transpose(0, 1)

    # the causal-only check (output of row i independent of keys after i) passes for `leaky` ...
    k3 = k.clone()
    k3[7:] += 5.0
    assert torch.equal(leaky(k, v)[:7], leaky(k3, v)[:7])
    # ... but the perturbation test exposes the leak
    assert not torch.allclose(leaky(k, v)[5:], leaky(k2, v2)[5:])


def _scatter_to_pages(k: torch.Tensor, k_lens: list[int], block_size: int, num_blocks: int,
                      g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Write contiguous per-sequence keys into a paged cache at random distinct pages."""
    hkv, d = k.shape[1], k.shape[2]
    cache = torch.randn(num_blocks, block_size, hkv, d, generator=g)  # garbage elsewhere
    max_blocks = max(1, max(-(-n // block_size) for n in k_lens))
    table = torch.zeros(len(k_lens), max_blocks, dtype=torch.int32)
    free = torch.randperm(num_blocks - 1, generator=g) + 1            # page 0 = padding only
    used, start = 0, 0
    for b, n in enumerate(k_lens):
        for blk in range(-(-n // block_size)):
            page = int(free[used])
            used += 1
            table[b, blk] = page
            rows = k[start + blk * block_size: start + min(n, (blk + 1) * block_size)]
            cache[page, : rows.shape[0]] = rows
        start += n
    return cache, table


@SETTINGS
@given(lens=_batches(), hkv=st.integers(1, 2), group=st.integers(1, 3),
       block_size=st.integers(1, 5), bm=st.integers(1, 6), bn=st.integers(1, 9),
       window=st.one_of(st.none(), st.integers(1, 15)), seed=st.integers(0, 2**16))
def test_paged_matches_contiguous(lens: tuple[list[int], list[int]], hkv: int, group: int,
                                  block_size: int, bm: int, bn: int, window: int | None,
                                  seed: int) -> None:
    q_lens, k_lens = lens
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(q_lens), hkv * group, 4, generator=g)
    k, v = (torch.randn(sum(k_lens), hkv, 4, generator=g) for _ in range(2))
    num_blocks = 1 + sum(-(-n // block_size) for n in k_lens) + 2
    # NOTE: the same generator seed gives K and V the same random page assignment
    k_cache, table = _scatter_to_pages(k, k_lens, block_size, num_blocks,
                                       torch.Generator().manual_seed(seed))
    v_cache, table_v = _scatter_to_pages(v, k_lens, block_size, num_blocks,
                                         torch.Generator().manual_seed(seed))
    assert torch.equal(table, table_v)
    seq_lens = torch.tensor(k_lens, dtype=torch.int32)
    out, lse = paged_attention_reference(q, k_cache, v_cache, table, seq_lens, _cu(q_lens), scale=0.5,
                               sliding_window=window, block_m=bm, block_n=bn, return_lse=True)
    var, var_lse = varlen_attention(q, k, v, _cu(q_lens), _cu(k_lens), scale=0.5, causal=True,
                                    window=window)
    torch.testing.assert_close(out, var, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse, var_lse, atol=2e-5, rtol=2e-5)


def test_tile_spanning_pages_gathers_in_order() -> None:
    """block_size 4, table [7, 2, 9]: a 6-key tile starting at key 2 reads pages 7 then 2."""
    cache = torch.arange(10 * 4, dtype=torch.float32).view(10, 4, 1, 1)   # value = page*4 + slot
    table = torch.tensor([7, 2, 9, 0], dtype=torch.int32)
    got = gather_keys(cache, table, 2, 8).flatten().tolist()
    assert got == [30, 31, 8, 9, 10, 11]


def test_paged_decode_gqa_smollm_like() -> None:
    """9 query heads / 3 KV heads (the default model's layout), T = 1 per sequence."""
    g = torch.Generator().manual_seed(3)
    k_lens, q_lens = [17, 1, 40], [1, 1, 1]
    k, v = (torch.randn(sum(k_lens), 3, 8, generator=g) for _ in range(2))
    q = torch.randn(3, 9, 8, generator=g)
    kc, table = _scatter_to_pages(k, k_lens, 16, 12, torch.Generator().manual_seed(5))
    vc, _ = _scatter_to_pages(v, k_lens, 16, 12, torch.Generator().manual_seed(5))
    out = paged_attention_reference(q, kc, vc, table, torch.tensor(k_lens), _cu(q_lens), scale=8 ** -0.5)
    ref = _per_sequence_reference(q, k, v, q_lens, k_lens, causal=True, window=None)
    assert isinstance(out, torch.Tensor)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)
