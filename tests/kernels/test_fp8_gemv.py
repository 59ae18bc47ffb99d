"""fitserve_fp8::fp8_linear (fp8_gemv.cpp) against float64, at every ISA tier.

Reference: ``x64 @ (torch's float8 cast of the codes, in float64, * each element's scale).T
(+ bias)``, the scales expanded here by plain indexing. The op sums exact-or-once-rounded fp32
products (fp32 x: an FMA rounds each product-sum once; bf16 x: VDPBF16PS's products are exact) in
fp32, applies the scale per segment (one segment, or one per B columns for block scales), adds
the bias and rounds once to x's dtype, so with ``A = |x| @ |W|.T + |b|`` (float64)

    |y - y64| <= (K + segments + 4) * 2^-23 * A * (1 + u) + u * |y64| + K * 2^-126 * max(scale)
                 + f

u being the output rounding (2^-8 bf16, 2^-11 fp16, 0 fp32), K * 2^-126 * max(scale) VDPBF16PS's
flush of subnormal fp32 sums, f half the output dtype's smallest subnormal (fp16's 2^-25 is
reached by e5m2's small products). NaN codes (e4m3fn 0x7F / 0xFF; e5m2 0x7D-0x7F, 0xFD-0xFF) decode
to NaN like torch's cast, so their output channel is NaN; e5m2's infinities stay infinite.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fitserve.kernels.cpu.fp8_gemv import fp8_gemv_available, fp8_linear
from fitserve.quant.fp8 import FORMATS, scale_shape
from tests.conftest import asked_tier, run_tests_at_tier, torch_threads

if not fp8_gemv_available():
    pytest.skip("fp8_gemv.cpp could not be built here", allow_module_level=True)

EPS32 = 2.0**-23
OUT_ROUND = {torch.float32: 0.0, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
# half the output dtype's smallest subnormal: the absolute error of rounding a tiny y
OUT_FLOOR = {torch.float32: 2.0**-150, torch.bfloat16: 2.0**-134, torch.float16: 2.0**-25}


def random_scales(n: int, k: int, granularity: str, block: int, gen: torch.Generator
                  ) -> torch.Tensor:
    shape = scale_shape(n, k, granularity, block)
    return (torch.rand(shape, generator=gen) * 0.02 + 0.001).float()


def element_scales(scales: torch.Tensor, n: int, k: int, granularity: str, block: int
                   ) -> torch.Tensor:
    """[n, k] float64: each element's scale, by plain indexing."""
    if granularity == "tensor":
        return scales.double().reshape(1, 1).expand(n, k)
    if granularity == "channel":
        return scales.double().reshape(n, 1).expand(n, k)
    rows = torch.arange(n) // block
    cols = torch.arange(k) // block
    return scales.double()[rows][:, cols]


def reference(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, fmt: str,
              granularity: str, block: int, bias: torch.Tensor | None
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """(y64, the bound's A = |x| @ |W|.T + |b|) in float64."""
    n, k = codes.shape
    w64 = codes.view(FORMATS[fmt]).to(torch.float64) * element_scales(scales, n, k,
                                                                        granularity, block)
    x64 = x.double()
    b64 = torch.zeros(n, dtype=torch.float64) if bias is None else bias.double()
    return x64 @ w64.T + b64, x64.abs() @ w64.abs().T + b64.abs()


def check(y: torch.Tensor, x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, fmt: str,
          granularity: str, block: int, bias: torch.Tensor | None) -> None:
    y64, a = reference(x, codes, scales, fmt, granularity, block, bias)
    k = codes.shape[1]
    segments = -(-k // block) if granularity == "block" else 1
    u = OUT_ROUND[x.dtype]
    bound = ((k + segments + 4) * EPS32 * a * (1 + u) + u * y64.abs()
             + k * 2.0**-126 * float(scales.max()) + OUT_FLOOR[x.dtype])
    assert y.dtype == x.dtype and y.shape == y64.shape
    yd = y.double()
    assert torch.equal(yd.isnan(), y64.isnan()), "NaN outputs differ from the reference's"
    fin = y64.isfinite()
    assert torch.equal(yd[~fin & ~y64.isnan()], y64[~fin & ~y64.isnan()]), "infinities differ"
    err = (yd - y64).abs()[fin]
    assert (err <= bound[fin]).all(), f"worst {(err / bound[fin]).max().item():.3g}x the bound"


def finite_codes(n: int, k: int, fmt: str, gen: torch.Generator) -> torch.Tensor:
    """Random uint8 codes [n, k], NaN/inf codes replaced by zero."""
    c = torch.randint(0, 256, (n, k), generator=gen, dtype=torch.uint8)
    bad = ~c.view(FORMATS[fmt]).float().isfinite()
    return torch.where(bad, torch.zeros_like(c), c)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("granularity,block", [("tensor", 128), ("channel", 128), ("block", 128),
                                               ("block", 64), ("block", 48)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_matches_float64_across_shapes(fmt: str, granularity: str, block: int,
                                       dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(hash((fmt, granularity, block, str(dtype))) % 2**31)
    n = 67  # odd, not a multiple of any tile or block
    for m, k, bias in [(1, 1, False), (1, 7, True), (2, 64, False), (3, 151, True),
                       (5, 200, False), (8, 263, True), (9, 576, False), (16, 321, True)]:
        codes = finite_codes(n, k, fmt, gen)
        scales = random_scales(n, k, granularity, block, gen)
        x = torch.randn(m, k, generator=gen).to(dtype)
        b = torch.randn(n, generator=gen).to(dtype) if bias else None
        y = fp8_linear(x, codes, scales, fmt, granularity, block, b)
        check(y, x, codes, scales, fmt, granularity, block, b)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 4])
def test_every_code(fmt: str, dtype: torch.dtype, m: int) -> None:
    """Row n holds code n everywhere (zero, subnormals, max, infinities, NaN): K = 151 runs a
    64-code lookup step (bf16 x), a 16-code vector step and a scalar tail over each code."""
    gen = torch.Generator().manual_seed(7)
    k = 151
    codes = torch.arange(256, dtype=torch.uint8).reshape(256, 1).expand(256, k).contiguous()
    scales = random_scales(256, k, "channel", 128, gen)
    x = (torch.rand(m, k, generator=gen) + 0.5).to(dtype)  # positive: no inf - inf
    y = fp8_linear(x, codes, scales, fmt, "channel", 128, None)
    check(y, x, codes, scales, fmt, "channel", 128, None)
    values = codes[:, 0].view(FORMATS[fmt]).float()
    assert torch.equal(y.isnan().all(0), values.isnan())
    if fmt == "e4m3":
        assert values.isnan().nonzero().flatten().tolist() == [0x7F, 0xFF]
        assert y[0, 0] == 0 and y[0, 0x80] == 0  # +0, -0
        assert y[0, 1] > 0 and y[0, 0x81] < 0  # the smallest subnormal, both signs


def test_a_nan_code_poisons_only_its_channel() -> None:
    gen = torch.Generator().manual_seed(3)
    codes = finite_codes(5, 300, "e4m3", gen)
    codes[2, 123] = 0x7F
    scales = random_scales(5, 300, "channel", 128, gen)
    y = fp8_linear(torch.randn(2, 300, generator=gen).bfloat16(), codes, scales, "e4m3",
                   "channel", 128, None)
    assert y[:, 2].isnan().all() and not y[:, [0, 1, 3, 4]].isnan().any()


def test_thread_splits_give_the_same_bits() -> None:
    """Each output is one thread's work: 1, 2 or 3 threads give the same bits."""
    gen = torch.Generator().manual_seed(4)
    codes = finite_codes(1001, 576, "e4m3", gen)
    scales = random_scales(1001, 576, "channel", 128, gen)
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(3, 576, generator=gen).to(dtype)
        outs = []
        for t in (1, 2, 3):
            with torch_threads(t):
                outs.append(fp8_linear(x, codes, scales, "e4m3", "channel", 128, None))
        assert all(torch.equal(outs[0], o) for o in outs[1:])
        check(outs[1], x, codes, scales, "e4m3", "channel", 128, None)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("granularity", ["tensor", "channel"])
@pytest.mark.parametrize("k", [64, 576, 1088])
def test_one_row_of_x_gives_each_output_its_row_alone(fmt: str, granularity: str, k: int) -> None:
    """At one row of x a thread's weight rows stream as four runs, one row of each computed
    together (the lookup path: rows_dot_lookup4, x's loads shared, one reduction of four):
    every output has the bits of its weight row called alone, whatever the split."""
    gen = torch.Generator().manual_seed(k)
    n = 1003  # runs of unequal length at 1-3 threads
    codes = finite_codes(n, k, fmt, gen)
    scales = random_scales(n, k, granularity, 128, gen)
    x = torch.randn(1, k, generator=gen).bfloat16()
    bias = torch.randn(n, generator=gen).bfloat16()
    for b in (None, bias):
        full = fp8_linear(x, codes, scales, fmt, granularity, 128, b)
        check(full, x, codes, scales, fmt, granularity, 128, b)
        for t in (1, 3):
            with torch_threads(t):
                assert torch.equal(fp8_linear(x, codes, scales, fmt, granularity, 128, b), full)
        for r in (0, 1, 250, 251, 252, 500, 1000, 1002):
            sr = scales[r : r + 1] if granularity == "channel" else scales
            br = None if b is None else b[r : r + 1]
            one = fp8_linear(x, codes[r : r + 1], sr, fmt, granularity, 128, br)
            assert torch.equal(one[0, 0], full[0, r])


def test_bad_arguments_raise() -> None:
    x = torch.ones(2, 8)
    codes = torch.zeros(4, 8, dtype=torch.uint8)
    ch = torch.ones(4)
    op = torch.ops.fitserve_fp8.fp8_linear
    with pytest.raises(RuntimeError, match="fmt must be"):
        op(x, codes, ch, "e3m4", "channel", 128, None)
    with pytest.raises(RuntimeError, match="granularity must be"):
        op(x, codes, ch, "e4m3", "row", 128, None)
    with pytest.raises(RuntimeError, match="channel scales must be"):
        op(x, codes, torch.ones(3), "e4m3", "channel", 128, None)
    with pytest.raises(RuntimeError, match="block scales must be"):
        op(x, codes, torch.ones(2, 2), "e4m3", "block", 4, None)
    with pytest.raises(RuntimeError, match="x's K"):
        op(torch.ones(2, 9), codes, ch, "e4m3", "channel", 128, None)
    with pytest.raises(RuntimeError, match="uint8"):
        op(x, codes.float(), ch, "e4m3", "channel", 128, None)
    with pytest.raises(RuntimeError, match="x must be float32"):
        op(x.double(), codes, ch, "e4m3", "channel", 128, None)
    with pytest.raises(RuntimeError, match="bias must have N"):
        op(x, codes, ch, "e4m3", "channel", 128, torch.ones(5))


def test_lookup_path_where_the_cpu_has_it() -> None:
    """bf16 x takes the VBMI + AVX512-BF16 lookup path exactly where the build and CPU allow."""
    from fitserve.kernels.cpu.isa import build_tier, detect_isa

    isa = detect_isa()
    cpuinfo = Path("/proc/cpuinfo")
    flags = cpuinfo.read_text().split() if cpuinfo.exists() else []
    want = (build_tier(isa) == "avx512_vnni" and isa.avx512_bf16
            and "avx512vbmi" in flags)
    assert torch.ops.fitserve_fp8.lookup_path() == want


def test_tier_is_the_one_asked_for() -> None:
    from fitserve.kernels.cpu.isa import build_tier, detect_isa

    assert asked_tier() == build_tier(detect_isa())


@pytest.mark.slow
@pytest.mark.parametrize("tier", ["avx512", "avx2", "scalar"])
def test_lower_tiers_match_float64(tier: str) -> None:
    """The AVX-512 (without VNNI), AVX2 + F16C and scalar-table builds, made with
    FITSERVE_CPU_TIER on a CPU whose own tier is higher, pass the same float64 checks."""
    run_tests_at_tier(__file__, tier, "tier_is or matches_float64 or every_code or nan_code "
                                      "or thread_splits or lookup_path")
