"""Backward by recomputation vs autograd on the float64 naive attention."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fitserve.tools.labs.backward import flash_attention, tiled_attention_backward
from fitserve.tools.labs.reference import naive_attention
from fitserve.tools.labs.tiled import tiled_attention

SETTINGS = settings(max_examples=25, deadline=None, derandomize=True)


def _reference_grads(q, k, v, dout, **kw):  # type: ignore[no-untyped-def]
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    out, _ = naive_attention(*leaves, **kw)
    out.backward(dout.double())
    return [x.grad for x in leaves]


@SETTINGS
@given(m=st.integers(1, 23), n=st.integers(0, 29), d=st.sampled_from([1, 5, 16]),
       bm=st.integers(1, 9), bn=st.integers(1, 11), causal=st.booleans(),
       window=st.one_of(st.none(), st.integers(1, 40)), seed=st.integers(0, 2**16))
def test_backward_matches_autograd(m: int, n: int, d: int, bm: int, bn: int, causal: bool,
                                   window: int | None, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, x, d, generator=g) for x in (m, n, n))
    dout = torch.randn(2, m, d, generator=g)
    kw = dict(causal=causal, window=window)
    out, lse = tiled_attention(q, k, v, block_m=bm, block_n=bn, **kw)
    grads = tiled_attention_backward(q, k, v, out, lse, dout, block_m=bm, block_n=bn, **kw)
    for got, want in zip(grads, _reference_grads(q, k, v, dout, **kw), strict=True):
        assert not torch.isnan(got).any()
        torch.testing.assert_close(got.double(), want, atol=5e-5, rtol=5e-5)


def test_empty_rows_get_zero_gradient() -> None:
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, x, 4, generator=g) for x in (6, 3, 3))
    dout = torch.randn(1, 6, 4, generator=g)
    out, lse = tiled_attention(q, k, v, causal=True, block_m=4, block_n=2)   # rows 0..2 empty
    dq, dk, dv = tiled_attention_backward(q, k, v, out, lse, dout, causal=True, block_m=4,
                                          block_n=2)
    assert torch.equal(dq[0, :3], torch.zeros(3, 4))
    want = _reference_grads(q, k, v, dout, causal=True)
    for got, ref in zip((dq, dk, dv), want, strict=True):
        torch.testing.assert_close(got.double(), ref, atol=5e-5, rtol=5e-5)


def test_autograd_function_gradcheck_style() -> None:
    """flash_attention is a drop-in differentiable op with the same gradients."""
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(3, 19, 8, generator=g).requires_grad_() for _ in range(3))
    out = flash_attention(q, k, v, causal=True, window=6, block_m=4, block_n=5)
    dout = torch.randn_like(out)
    out.backward(dout)
    want = _reference_grads(q, k, v, dout, causal=True, window=6)
    for leaf, ref in zip((q, k, v), want, strict=True):
        assert leaf.grad is not None
        torch.testing.assert_close(leaf.grad.double(), ref, atol=5e-5, rtol=5e-5)
