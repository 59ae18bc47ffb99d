"""fitserve_dense::bf16_gemv (dense_gemv.cpp) against float64, and DenseLinear's dispatch.

The op multiplies bf16 x [1, K] by a bf16 weight [N, K] with fp32 products and sums and rounds
once to bf16, so ``|y - y64| <= (K + 4) * eps32 * sum_k |w_k x_k| * (1 + 2^-8) + 2^-8 |y64|``
(fp32 summation, then the output rounding), with y64 the float64 product of the same bf16
values (+ the bf16 bias).
"""

from __future__ import annotations

import pytest
import torch

from fitserve.kernels.cpu.dense_gemv import bf16_gemv_available
from fitserve.model.linear import DenseLinear
from tests.conftest import asked_tier, run_tests_at_tier, torch_threads

if not bf16_gemv_available():
    pytest.skip("dense_gemv.cpp could not be built here", allow_module_level=True)

EPS32 = 2.0**-23
BF16_ROUND = 2.0**-8


def check(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> None:
    x64, w64 = x.double(), w.double()
    y64 = x64 @ w64.T + (0 if b is None else b.double())
    k = x.shape[1]
    bound = (k + 4) * EPS32 * (x64.abs() @ w64.abs().T) * (1 + BF16_ROUND) + BF16_ROUND * y64.abs()
    err = (y.double() - y64).abs()
    assert (err <= bound).all(), f"worst {(err / bound).max().item():.3g}x the bound"


@pytest.mark.parametrize("k", [1, 7, 8, 31, 32, 200, 576, 1536])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_float64(k: int, bias: bool) -> None:
    gen = torch.Generator().manual_seed(k + 1000 * bias)
    n = 67  # not a multiple of any block
    x = torch.randn(1, k, generator=gen).bfloat16()
    w = (torch.randn(n, k, generator=gen) * 0.05).bfloat16()
    b = torch.randn(n, generator=gen).bfloat16() if bias else None
    y = torch.ops.fitserve_dense.bf16_gemv(x, w, b)
    assert y.dtype == torch.bfloat16 and y.shape == (1, n)
    check(y, x, w, b)
    for r in (0, 16, 17, 66):  # four rows run together, each with its own row's bits
        br = None if b is None else b[r : r + 1]
        one = torch.ops.fitserve_dense.bf16_gemv(x, w[r : r + 1], br)
        assert torch.equal(one[0, 0], y[0, r])


def test_nan_and_inf_reach_the_output() -> None:
    x = torch.ones(1, 64).bfloat16()
    w = torch.ones(3, 64).bfloat16()
    w[1, 5] = float("nan")
    w[2, 40] = float("inf")
    y = torch.ops.fitserve_dense.bf16_gemv(x, w, None).float()
    assert y[0, 0] == 64 and y[0, 1].isnan() and y[0, 2].isinf()


def test_bad_arguments_raise() -> None:
    x = torch.ones(2, 8).bfloat16()
    w = torch.ones(4, 8).bfloat16()
    with pytest.raises(RuntimeError, match=r"\[1, K\]"):
        torch.ops.fitserve_dense.bf16_gemv(x, w, None)
    with pytest.raises(RuntimeError, match="bfloat16"):
        torch.ops.fitserve_dense.bf16_gemv(x[:1].float(), w, None)
    with pytest.raises(RuntimeError, match="contiguous"):
        torch.ops.fitserve_dense.bf16_gemv(torch.ones(1, 4).bfloat16(), w.t(), None)


@pytest.mark.parametrize("rows", [1, 3])
def test_dense_linear_runs_gemv_only_for_one_bf16_row(rows: int,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    import fitserve.model.linear as lin

    monkeypatch.setattr(lin, "_GEMV_PREFERRED", [True])  # as on an AVX2-only CPU
    layer = DenseLinear(96, 40, bias=True).bfloat16()
    x = torch.randn(rows, 96).bfloat16()
    assert layer.gemv_applies(rows, x.dtype) == (rows == 1)
    assert not layer.float().gemv_applies(1, torch.float32)
    y = layer.bfloat16()(x)
    if rows == 1:  # the op's result, not F.linear's
        assert torch.equal(y, torch.ops.fitserve_dense.bf16_gemv(x, layer.weight, layer.bias))
    check(y[:1], x[:1], layer.weight, layer.bias)


def test_thread_splits_give_the_same_bits() -> None:
    """Each output is one thread's work: 1, 2 or 3 threads give the same bits."""
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(1, 576, generator=gen).bfloat16()
    w = (torch.randn(1001, 576, generator=gen) * 0.05).bfloat16()
    outs = []
    for t in (1, 2, 3):
        with torch_threads(t):
            outs.append(torch.ops.fitserve_dense.bf16_gemv(x, w, None))
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    check(outs[1], x, w, None)
    # the rows run as interleaved runs per thread: each output is still its row's dot alone
    for n in (0, 1, 250, 251, 500, 999, 1000):
        assert torch.equal(torch.ops.fitserve_dense.bf16_gemv(x, w[n : n + 1], None)[0, 0],
                           outs[1][0, n])


def test_tier_is_the_one_asked_for() -> None:
    from fitserve.kernels.cpu.isa import build_tier, detect_isa

    assert asked_tier() == build_tier(detect_isa())


@pytest.mark.slow
@pytest.mark.parametrize("tier", ["avx512", "avx2", "scalar"])
def test_lower_tiers_match_float64(tier: str) -> None:
    """The FMA loops (avx512 tier: no AVX512-BF16 there; avx2) and the plain loop (scalar),
    built with FITSERVE_CPU_TIER on a CPU whose own tier runs VDPBF16PS, pass the same float64
    checks."""
    run_tests_at_tier(__file__, tier, "tier_is or matches_float64 or nan_and_inf or thread_splits")
