"""Tiled forward vs the float64 reference: values, LSE, NaN safety, bottom-right chunk mask."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from fitserve.tools.labs.masks import (
    bottom_right_positions,
    library_default_causal_mask,
    visible_mask,
)
from fitserve.tools.labs.online_softmax import OnlineSoftmax, unguarded_update
from fitserve.tools.labs.reference import naive_attention
from fitserve.tools.labs.tiled import tiled_attention

SETTINGS = settings(max_examples=40, deadline=None, derandomize=True)


def _close(out: torch.Tensor, ref: torch.Tensor, tol: float = 2e-5) -> None:
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)


def _lse_close(lse: torch.Tensor, ref: torch.Tensor) -> None:
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref))
    fin = ~torch.isneginf(ref)
    torch.testing.assert_close(lse.double()[fin], ref[fin], atol=2e-5, rtol=2e-5)


@SETTINGS
@given(
    m=st.integers(1, 37), n=st.integers(0, 41), d=st.sampled_from([1, 3, 8, 17]),
    heads=st.integers(1, 3), bm=st.integers(1, 17), bn=st.integers(1, 19),
    causal=st.booleans(), window=st.one_of(st.none(), st.integers(1, 60)),
    seed=st.integers(0, 2**16),
)
def test_tiled_matches_reference(m: int, n: int, d: int, heads: int, bm: int, bn: int,
                                 causal: bool, window: int | None, seed: int) -> None:
    """Odd sizes, T=1, S=0, windows larger than the sequence, M > N (empty rows)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(heads, m, d, generator=g)
    k = torch.randn(heads, n, d, generator=g)
    v = torch.randn(heads, n, d + 1, generator=g)
    out, lse = tiled_attention(q, k, v, causal=causal, window=window, block_m=bm, block_n=bn)
    ref, ref_lse = naive_attention(q, k, v, causal=causal, window=window)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    _close(out, ref)
    _lse_close(lse, ref_lse)


@SETTINGS
@given(m=st.integers(1, 20), n=st.integers(1, 20), seed=st.integers(0, 2**16),
       bm=st.integers(1, 8), bn=st.integers(1, 8))
def test_arbitrary_positions_and_segments(m: int, n: int, seed: int, bm: int, bn: int) -> None:
    """Random positions/segments: many rows see nothing at all, some see a single key."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, x, 4, generator=g) for x in (m, n, n))
    q_pos = torch.randint(0, 10, (m,), generator=g)
    k_pos = torch.randint(0, 10, (n,), generator=g)
    q_seg = torch.randint(0, 3, (m,), generator=g)
    k_seg = torch.randint(0, 3, (n,), generator=g)
    kw = dict(causal=True, window=3, q_pos=q_pos, k_pos=k_pos, q_seg=q_seg, k_seg=k_seg)
    out, lse = tiled_attention(q, k, v, block_m=bm, block_n=bn, **kw)
    ref, ref_lse = naive_attention(q, k, v, **kw)
    _close(out, ref)
    _lse_close(lse, ref_lse)


def test_fully_masked_rows_give_zero_and_neg_inf() -> None:
    q, k, v = torch.randn(1, 4, 8), torch.randn(1, 6, 8), torch.randn(1, 6, 8)
    q_pos = torch.tensor([-3, -1, 2, 5])          # rows 0 and 1 precede every key
    out, lse = tiled_attention(q, k, v, causal=True, q_pos=q_pos, block_m=2, block_n=4)
    assert torch.equal(out[0, :2], torch.zeros(2, 8))
    assert torch.isneginf(lse[0, :2]).all() and torch.isfinite(lse[0, 2:]).all()
    assert not torch.isnan(out).any()


def test_unguarded_recurrence_produces_nan_and_guard_prevents_it() -> None:
    """The NaN trap: a row whose first key tile is fully masked has m_old = m_new = -inf."""
    scores = torch.full((1, 4), float("-inf"))           # one row, every key of the tile masked
    v = torch.randn(4, 2)
    m0, l0, acc0 = torch.full((1,), float("-inf")), torch.zeros(1), torch.zeros(1, 2)
    m, row_sum, acc = unguarded_update(m0, l0, acc0, scores, v)
    assert torch.isnan(row_sum).all() and torch.isnan(acc).all()      # exp(-inf - -inf) = exp(nan)
    # a later visible tile cannot repair it: nan * 0 is still nan
    m, row_sum, acc = unguarded_update(m, row_sum, acc, torch.zeros(1, 4), v)
    assert torch.isnan(acc).all()
    state = OnlineSoftmax((1,), 2)
    state.update(scores, v)
    assert torch.equal(state.l, torch.zeros(1)) and not torch.isnan(state.acc).any()
    state.update(torch.zeros(1, 4), v)
    out, lse = state.finalize()
    torch.testing.assert_close(out, v.mean(0, keepdim=True))
    torch.testing.assert_close(lse, torch.log(torch.tensor([4.0])))


@SETTINGS
@given(s=st.integers(0, 30), t=st.integers(1, 12), seed=st.integers(0, 2**16))
def test_chunk_at_end_of_cache_bottom_right(s: int, t: int, seed: int) -> None:
    """T queries at S..S+T-1 equal the last T rows of a full causal prefill of S+T tokens."""
    g = torch.Generator().manual_seed(seed)
    q_all, k, v = (torch.randn(2, s + t, 8, generator=g) for _ in range(3))
    full, _ = naive_attention(q_all, k, v, causal=True)
    out, _ = tiled_attention(q_all[:, s:], k, v, causal=True, block_m=5, block_n=7)
    _close(out, full[:, s:])
    # torch with an explicit bottom-right mask agrees; its is_causal default does not (S > 0)
    q_pos, k_pos = bottom_right_positions(t, s + t)
    br = visible_mask(q_pos, k_pos, causal=True)
    sdpa_br = F.scaled_dot_product_attention(q_all[:, s:].double(), k.double(), v.double(),
                                             attn_mask=br)
    _close(out, sdpa_br)
    sdpa_default = F.scaled_dot_product_attention(q_all[:, s:].double(), k.double(), v.double(),
                                                  is_causal=True)
    top_left, _ = naive_attention(q_all[:, s:], k, v, mask=library_default_causal_mask(t, s + t))
    torch.testing.assert_close(sdpa_default, top_left)       # the library default is top-left
    if s > 0:
        assert not torch.allclose(sdpa_default, out.double(), atol=1e-3)


def test_bottom_right_mask_picture() -> None:
    q_pos, k_pos = bottom_right_positions(2, 6)
    assert visible_mask(q_pos, k_pos, causal=True).int().tolist() == [
        [1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]]
    assert library_default_causal_mask(2, 6).int().tolist() == [
        [1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0]]


def test_bf16_inputs_fp32_accumulation() -> None:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, x, 32, generator=g).bfloat16() for x in (50, 300, 300))
    out, lse = tiled_attention(q, k, v, causal=True, block_m=16, block_n=32)
    ref, ref_lse = naive_attention(q, k, v, causal=True)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-4, rtol=1e-5)
