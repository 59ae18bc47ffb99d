"""FP8 weights (fitserve.quant.fp8) and their linear layer (fitserve.model.fp8_linear).

- error bounds as bounds, per element against float64: normal values within u = 2^-(m+1) of
  relative error (e4m3 1/16, e5m2 1/8), subnormal ones within half the subnormal step times the
  scale; the observed max reaches the exact sup u / (1 + u) (the bound is not a loose one);
- each group's largest magnitude maps to the format's max; zero groups dequantize to exactly 0;
- e5m2: ~2x the error of e4m3, 2^7 x its max and a far wider dynamic range (shown on weights
  spanning 2^20: e4m3 flushes the small ones, e5m2 keeps them all normal);
- bytes: Fp8Weight.nbytes == fp8_weight_bytes == the formats table where it has the format;
- Fp8Linear equals x @ W_hat.T (float64 reference) in float32 and bfloat16, chunked or not.
"""

from __future__ import annotations

import pytest
import torch

from fitserve.kernels.cpu.fp8_gemv import fp8_gemv_available
from fitserve.ledger.formats import weight_bytes
from fitserve.model import fp8_linear
from fitserve.model.fp8_linear import Fp8Linear, scaled_mm_available
from fitserve.quant.fp8 import (
    F16_FACTOR,
    FORMATS,
    GRANULARITIES,
    MANTISSA_BITS,
    codes_as_f16,
    fp8_linear_reference,
    fp8_max,
    fp8_min_normal,
    fp8_weight_bytes,
    quantize_fp8,
    relative_error_bound,
    subnormal_error_bound,
)

N, K = 300, 260  # ragged 128-blocks on both axes
F32_SLACK = 2.0**-23  # the float32 quotient / product roundings around the fp8 rounding


def _weights(seed: int = 0) -> torch.Tensor:
    """float32 [N, K], magnitudes spread over ~2^12, some exact zeros, one all-zero tile."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=g) * torch.exp(torch.randn(N, K, generator=g) * 1.5)
    w[::7, ::5] = 0.0
    w[:128, 128:256] = 0.0  # block (0, 1)
    return w


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_error_bounds_element_by_element(fmt: str, granularity: str) -> None:
    w = _weights()
    fw = quantize_fp8(w, fmt, granularity)
    w64, hat = w.double(), fw.dequantize(torch.float64)
    scale = fw.row_scales(0, N).double().expand(N, K)
    err = (hat - w64).abs()
    normal = (w64 / scale).abs() >= fp8_min_normal(fmt)
    rel_bound = relative_error_bound(fmt)
    assert bool((err[normal] <= (rel_bound + F32_SLACK) * w64.abs()[normal]).all())
    sub = ~normal
    sub_bound = (scale[sub] * subnormal_error_bound(fmt) * (1 + F32_SLACK)
                 + F32_SLACK * w64.abs()[sub])
    assert bool((err[sub] <= sub_bound).all())
    # nearly attained: the sup of |x_hat - x| / |x| is u / (1 + u) (x just under a tie at the
    # bottom of a binade), u = 2^-(m+1); the bound is the bound, not a loose one
    assert float((err[normal] / w64.abs()[normal]).max()) > 0.97 * rel_bound / (1 + rel_bound)
    # float32 dequantization is the exact (float64) product rounded once
    assert torch.equal(fw.dequantize(torch.float32), hat.float())
    # zeros stay exactly zero, the all-zero tile too (scale 1, codes 0)
    assert bool((hat[w == 0] == 0).all())
    if granularity == "block":
        assert float(fw.scales[0, 1]) == 1.0
    # each nonzero group's largest magnitude is the format's max
    codes = fw.codes.double().abs()
    if granularity == "tensor":
        assert float(codes.max()) == fp8_max(fmt)
    elif granularity == "channel":
        assert bool((codes.amax(1) == fp8_max(fmt)).all())


def test_e5m2_has_twice_the_error_and_far_more_range() -> None:
    g = torch.Generator().manual_seed(1)
    w = torch.randn(256, 512, generator=g) * 0.02
    rel = {}
    for fmt in ("e4m3", "e5m2"):
        hat = quantize_fp8(w, fmt, "channel").dequantize(torch.float64)
        rel[fmt] = float(((hat - w.double()).abs() / w.double().abs()).mean())
    assert 1.6 < rel["e5m2"] / rel["e4m3"] < 2.5
    assert MANTISSA_BITS["e4m3"] - MANTISSA_BITS["e5m2"] == 1
    assert fp8_max("e5m2") / fp8_max("e4m3") == 2.0**7
    # per-tensor scales over weights spanning 2^20: e4m3's normal range is 2^14.8 wide
    span = torch.sign(torch.randn(4096, generator=g)) * 2.0 ** (-20 * torch.rand(4096, generator=g))
    span = span.reshape(64, 64)
    bad = {}
    for fmt in ("e4m3", "e5m2"):
        hat = quantize_fp8(span, fmt, "tensor").dequantize(torch.float64)
        relerr = (hat - span.double()).abs() / span.double().abs()
        bad[fmt] = float((relerr > relative_error_bound(fmt) + F32_SLACK).double().mean())
    assert bad["e5m2"] == 0.0  # all normal: 2^-20 >> e5m2's 2^-29.8
    assert bad["e4m3"] > 0.1  # the smallest ~quarter fall below e4m3's normal range


def test_cast_is_not_saturating_so_quantize_clamps() -> None:
    assert torch.isinf(torch.tensor([62000.0]).to(torch.float8_e5m2).float()).all()
    w = torch.tensor([[57344.0 * 1.0001, -3.0], [1.0, 2.0]])
    for fmt in ("e4m3", "e5m2"):
        hat = quantize_fp8(w, fmt, "tensor").dequantize()
        assert bool(torch.isfinite(hat).all())
    zero = quantize_fp8(torch.zeros(4, 8), "e4m3", "channel")
    assert torch.equal(zero.scales, torch.ones(4)) and not bool(zero.dequantize().any())
    with pytest.raises(ValueError, match="inf/nan"):
        quantize_fp8(torch.tensor([[float("inf")]]))


@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_bytes_match_the_ledger(granularity: str) -> None:
    fw = quantize_fp8(_weights(), "e4m3", granularity)
    want = {"tensor": N * K + 4, "channel": N * K + 4 * N, "block": N * K + 4 * 3 * 3}
    assert fw.nbytes == fp8_weight_bytes(N, K, granularity) == want[granularity]
    # the formats table's rows that exist: "fp8" (per tensor); "fp8-block" for whole tiles
    if granularity == "tensor":
        assert weight_bytes(N * K, "fp8") == fw.nbytes
    if granularity == "block":
        assert weight_bytes(256 * 384, "fp8-block") == fp8_weight_bytes(256, 384, "block")


@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_linear_matches_the_float64_reference(granularity: str, dtype: torch.dtype,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    g = torch.Generator().manual_seed(2)
    w = torch.randn(N, K, generator=g) * 0.05
    fw = quantize_fp8(w, "e4m3", granularity)
    bias = torch.randn(N, generator=g)
    x = torch.randn(2, 5, K, generator=g).to(dtype)
    ref = fp8_linear_reference(x, fw) + bias.double()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    # the C++ op (10 rows) where it is built; the dequant path in one chunk and in several (row
    # chunks of whole tiles) with the op's row limit at 0
    for max_rows, chunk in ((64, 1 << 20), (0, 1 << 20), (0, 128 * K - 1)):
        monkeypatch.setattr(fp8_linear, "FP8_GEMV_MAX_ROWS", max_rows)
        monkeypatch.setattr(fp8_linear, "_CHUNK_ELEMENTS", chunk)
        layer = Fp8Linear(fw, bias.to(dtype))
        assert layer.kernel_applies(x[0]) == (max_rows > 0 and fp8_gemv_available())
        y = layer(x)
        assert y.dtype == dtype and y.shape == (2, 5, N)
        assert float((y.double() - ref).norm() / ref.norm()) < tol


def test_fp8_linear_keeps_its_codes_and_scales_through_module_casts() -> None:
    fw = quantize_fp8(torch.randn(64, 32), "e5m2", "block", block=16)
    lin = Fp8Linear(fw).to(torch.bfloat16)
    assert lin.weight_fp8.dtype == torch.uint8 and lin.weight_scale.dtype == torch.float32
    assert torch.equal(lin.fp8.dequantize(), fw.dequantize())
    assert set(lin.state_dict()) == {"weight_fp8", "weight_scale"}


def test_scaled_mm_path_is_w8a8_numerics() -> None:
    """torch._scaled_mm needs fp8 activations too: its error is the activations' cast on top
    of the weight's (why it is opt-in, never the default path)."""
    if not scaled_mm_available():
        pytest.skip("torch._scaled_mm does not run fp8 here")
    g = torch.Generator().manual_seed(3)
    fw = quantize_fp8(torch.randn(96, 128, generator=g) * 0.05, "e4m3", "channel")
    x = torch.randn(8, 128, generator=g)
    ref = fp8_linear_reference(x, fw)
    err_w8a8 = float((Fp8Linear(fw, act_fp8=True)(x).double() - ref).norm() / ref.norm())
    err_w8a16 = float((Fp8Linear(fw)(x).double() - ref).norm() / ref.norm())
    assert err_w8a16 < 1e-6 < err_w8a8 < 2 * relative_error_bound("e4m3")
    with pytest.raises(ValueError, match="act_fp8"):
        Fp8Linear(quantize_fp8(torch.randn(8, 8), "e4m3", "block"), act_fp8=True)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_bit_decode_equals_torch_cast_for_every_code(fmt: str) -> None:
    codes = torch.arange(256, dtype=torch.uint8)
    torch_value = codes.view(FORMATS[fmt]).to(torch.float64)
    ours = codes_as_f16(codes, fmt).to(torch.float64) * F16_FACTOR[fmt]
    finite = torch.isfinite(torch_value)
    assert torch.equal(ours[finite], torch_value[finite])
    assert torch.equal(ours.isnan(), torch_value.isnan())  # e4m3fn 0x7F / 0xFF: NaN
    assert torch.equal(ours[ours.isinf()], torch_value[torch_value.isinf()])
