"""fitserve::int4_linear / int8_linear (qlinear.cpp) against float64 references.

The packed tensors are built here by hand from random quants (not with fitserve.quant), and
dequantized in float64: ``w = scale * q + min`` (int4 asym), ``scale * (q - 8)`` (int4 sym),
``scale * q`` (int8). Bounds:

- act_quant=False: the kernel dequantizes exactly in fp32 and sums in fp32, so
  ``|y - y64| <= (Kp + 4) * eps32 * sum_k |w_k x_k|`` (a standard summation bound).
- act_quant=True: x is rounded per 32-column block b to ``da_b * a_q`` with
  ``|x_k - da_b a_q,k| <= da_b / 2`` (plus a few ulps), so
  ``|y - y64| <= sum_b (da_b / 2) * sum_{k in b} |w_k|`` plus fp32 slack. The tests check the
  error is > 0 (the path really quantizes) and, with activations built to round the worst way,
  that the bound is nearly attained (it is not vacuous).
- bfloat16 x: the reference uses the same bf16 values; the output rounding adds 2^-8 |y|.
"""

from __future__ import annotations

import pytest
import torch

from fitserve.kernels.cpu.qlinear import (
    int4_linear,
    int8_linear,
    qlinear_ops_available,
    qlinear_tier,
)
from tests.conftest import asked_tier, run_tests_at_tier, torch_threads

if not qlinear_ops_available():
    pytest.skip("the qlinear C++ extension could not be built here (no compiler, a failed build "
                "or FITSERVE_DISABLE_CPP=1); the pure-torch path is tested elsewhere",
                allow_module_level=True)

EPS32 = 2.0**-23
BF16_ROUND = 2.0**-8
DTYPES = [torch.float32, torch.bfloat16]
MS = [1, 3, 16, 33, 200]
N_ODD = 67  # not a multiple of any row tile (4) or block


def pad_k(k: int, g: int) -> int:
    return -(-k // g) * g


def pack_int4(q: torch.Tensor, g: int) -> torch.Tensor:
    """[N, Kp] quants in 0..15 -> uint8 [N, Kp/2]: per group, byte i = col i | col i+G/2 << 4."""
    n, kp = q.shape
    grp = q.to(torch.uint8).view(n, kp // g, 2, g // 2)
    return (grp[:, :, 0] | (grp[:, :, 1] << 4)).reshape(n, kp // 2).contiguous()


Int4 = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]
Int8 = tuple[torch.Tensor, torch.Tensor, int, torch.Tensor]


def make_int4(n: int, k: int, g: int, asym: bool, gen: torch.Generator) -> Int4:
    """Random packed int4 weight: (qweight, scales, mins or None, w64 [N, Kp] float64)."""
    kp = pad_k(k, g)
    q = torch.randint(0, 16, (n, kp), generator=gen)  # padded columns too: x is 0 there
    scales = (torch.rand(n, kp // g, generator=gen) * 0.03 + 0.002).half()
    d64 = scales.double().repeat_interleave(g, 1)
    if asym:
        mins = (-8 * scales.float() + 0.01 * torch.randn(n, kp // g, generator=gen)).half()
        w64 = d64 * q.double() + mins.double().repeat_interleave(g, 1)
    else:
        mins = None
        w64 = d64 * (q.double() - 8)
    return pack_int4(q, g), scales, mins, w64


def make_int8(n: int, k: int, g: int | None, gen: torch.Generator) -> Int8:
    """Random packed int8 weight (g=None: per channel, G = K rounded up to 32):
    (qweight, scales, G, w64 [N, Kp] float64)."""
    kp = pad_k(k, 32) if g is None else pad_k(k, g)
    g = kp if g is None else g
    q = torch.randint(-128, 128, (n, kp), generator=gen, dtype=torch.int8)
    q[:, 0] = -128  # the sign tricks' edge case
    scales = (torch.rand(n, kp // g, generator=gen) * 0.01 + 0.001).half()
    w64 = scales.double().repeat_interleave(g, 1) * q.double()
    return q, scales, g, w64


def make_x(m: int, k: int, kp: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    x = torch.randn(m, kp, generator=gen)
    x[:, :: 7] *= 4.0  # uneven magnitudes inside blocks
    x[:, k:] = 0.0
    return x.to(dtype)


def fp32_bound(x64: torch.Tensor, w64: torch.Tensor, y64: torch.Tensor,
               dtype: torch.dtype) -> torch.Tensor:
    kp = x64.shape[1]
    bound = (kp + 4) * EPS32 * (x64.abs() @ w64.abs().T)
    if dtype == torch.bfloat16:
        bound = bound * (1 + BF16_ROUND) + BF16_ROUND * y64.abs()
    return bound


def act_quant_bound(x64: torch.Tensor, w64: torch.Tensor, y64: torch.Tensor, dtype: torch.dtype,
                    offsets64: torch.Tensor | None = None) -> torch.Tensor:
    """sum_b (da_b/2) sum_{k in b} |w_k|  +  fp32 slack  (+ bf16 output rounding)."""
    m, kp = x64.shape
    da = x64.view(m, kp // 32, 32).abs().amax(-1) / 127  # [M, blocks]
    wabs_blocks = w64.abs().view(w64.shape[0], kp // 32, 32).sum(-1)  # [N, blocks]
    bound = (da * (0.5 + 1e-4)) @ wabs_blocks.T
    # fp32 slack over the terms the kernel adds: |d q| and the int4 offset |c| times |x_hat|
    xhat = x64.abs() + da.repeat_interleave(32, 1)
    mag = w64.abs() if offsets64 is None else w64.abs() + 2 * offsets64.abs()
    bound = bound + (kp / 8 + 64) * EPS32 * (xhat @ mag.T)
    if dtype == torch.bfloat16:
        bound = bound * (1 + BF16_ROUND) + BF16_ROUND * y64.abs()
    return bound


def int4_offsets64(scales: torch.Tensor, mins: torch.Tensor | None, g: int) -> torch.Tensor:
    c = mins.double() if mins is not None else -8 * scales.double()
    return c.repeat_interleave(g, 1)


def check(y: torch.Tensor, y64: torch.Tensor, bound: torch.Tensor, act_quant: bool) -> None:
    err = (y.double() - y64).abs()
    worst = (err / bound).max().item()
    assert worst <= 1.0, f"error exceeds the bound by {worst:.3g}x"
    if act_quant:
        assert err.max().item() > 0, "act_quant=True gave the exact product: nothing quantized?"


@pytest.mark.parametrize("act_quant", [False, True])
@pytest.mark.parametrize("asym", [True, False], ids=["asym", "sym"])
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_int4_matches_float64(dtype: torch.dtype, m: int, group: int, asym: bool,
                              act_quant: bool) -> None:
    gen = torch.Generator().manual_seed(1000 * m + group + asym)
    k = 200
    qweight, scales, mins, w64 = make_int4(N_ODD, k, group, asym, gen)
    x = make_x(m, k, w64.shape[1], dtype, gen)
    y = int4_linear(x, qweight, scales, mins, group, act_quant)
    assert y.dtype == dtype and y.shape == (m, N_ODD)
    x64 = x.double()
    y64 = x64 @ w64.T
    if act_quant:
        bound = act_quant_bound(x64, w64, y64, dtype, int4_offsets64(scales, mins, group))
    else:
        bound = fp32_bound(x64, w64, y64, dtype)
    check(y, y64, bound, act_quant)


@pytest.mark.parametrize("act_quant", [False, True])
@pytest.mark.parametrize("group", [32, 64, None], ids=["g32", "g64", "channel"])
@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_int8_matches_float64(dtype: torch.dtype, m: int, group: int | None,
                              act_quant: bool) -> None:
    gen = torch.Generator().manual_seed(7 * m + (group or 1))
    k = 200
    qweight, scales, g, w64 = make_int8(N_ODD, k, group, gen)
    x = make_x(m, k, w64.shape[1], dtype, gen)
    y = int8_linear(x, qweight, scales, g, act_quant)
    assert y.dtype == dtype and y.shape == (m, N_ODD)
    x64 = x.double()
    y64 = x64 @ w64.T
    bound = (act_quant_bound if act_quant else fp32_bound)(x64, w64, y64, dtype)
    check(y, y64, bound, act_quant)


@pytest.mark.parametrize("act_quant", [False, True])
@pytest.mark.parametrize("m", [1, 4, 14])
@pytest.mark.parametrize("kind", ["int4-asym-g32", "int4-sym-g32", "int4-sym-g64", "int8-g32",
                                  "int8-channel"])
def test_model_shapes(kind: str, m: int, act_quant: bool) -> None:
    """SmolLM2's K = 576 / 960 / 1536: rows of 18 / 30 / 48 groups of 32, so the batch-1 GEMV
    ends a row in a partial span of 2 / 6 / no groups (416: 13 groups, an int4 row ends in a
    half chunk); M = 14 runs panel tiles of 8 + 4 + 2 rows."""
    gen = torch.Generator().manual_seed(5)
    for n, k in ((96, 576), (48, 960), (40, 1536), (24, 416)):
        if kind.startswith("int4"):
            g = int(kind.split("-g")[1])
            qweight, scales, mins, w64 = make_int4(n, k, g, "asym" in kind, gen)
            x = make_x(m, k, w64.shape[1], torch.float32, gen)
            y = int4_linear(x, qweight, scales, mins, g, act_quant)
            offsets = int4_offsets64(scales, mins, g)
        else:
            qweight, scales, g, w64 = make_int8(n, k, 32 if kind == "int8-g32" else None, gen)
            x = make_x(m, k, w64.shape[1], torch.float32, gen)
            y = int8_linear(x, qweight, scales, g, act_quant)
            offsets = None
        x64 = x.double()
        y64 = x64 @ w64.T
        if act_quant:
            bound = act_quant_bound(x64, w64, y64, torch.float32, offsets)
        else:
            bound = fp32_bound(x64, w64, y64, torch.float32)
        check(y, y64, bound, act_quant)


def worst_case_x(w64: torch.Tensor, m: int, dtype: torch.dtype) -> torch.Tensor:
    """x whose int8 rounding error is +-0.4375 da in the direction of sign(w[0]) everywhere.

    Each 32-block holds one 127 * s (so da = s exactly, with s a power of two) and values
    (j + 0.4375) * s, j in 0..15 (exact in bf16 too): they round to j * s, an error of
    0.4375 s = 0.875 * (da / 2). Signs follow row 0 of w, so for that output the errors add up.
    """
    kp = w64.shape[1]
    gen = torch.Generator().manual_seed(3)
    s = 2.0**-6
    j = torch.randint(0, 16, (m, kp), generator=gen).double()
    sign = torch.where(w64[0] >= 0, 1.0, -1.0).double()
    x = (j + 0.4375) * s * sign
    x[:, ::32] = 127 * s * sign[::32]
    return x.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", ["int4-asym-g32", "int4-sym-g128", "int8-g32", "int8-channel"])
def test_act_quant_bound_is_tight(kind: str, dtype: torch.dtype) -> None:
    """With worst-case activations the error reaches ~85% of the bound (~75% in bf16): tight."""
    gen = torch.Generator().manual_seed(11)
    n, k, m = 8, 256, 2
    if kind.startswith("int4"):
        g = int(kind.split("-g")[1])
        qweight, scales, mins, w64 = make_int4(n, k, g, "asym" in kind, gen)
        x = worst_case_x(w64, m, dtype)
        y = int4_linear(x, qweight, scales, mins, g, True)
        offsets = int4_offsets64(scales, mins, g)
    else:
        qweight, scales, g, w64 = make_int8(n, k, 32 if kind == "int8-g32" else None, gen)
        x = worst_case_x(w64, m, dtype)
        y = int8_linear(x, qweight, scales, g, True)
        offsets = None
    x64 = x.double()
    y64 = x64 @ w64.T
    bound = act_quant_bound(x64, w64, y64, dtype, offsets)
    err = (y.double() - y64).abs()
    assert (err <= bound).all()
    ratio = (err[:, 0] / bound[:, 0]).min().item()
    floor = 0.8 if dtype == torch.float32 else 0.6  # bf16: the bound also holds output rounding
    assert ratio > floor, f"output 0 reaches only {ratio:.3f} of the bound"


@pytest.mark.parametrize("act_quant", [False, True])
def test_wrapper_pads_k_and_keeps_leading_dims(act_quant: bool) -> None:
    gen = torch.Generator().manual_seed(2)
    k, g = 100, 64
    qweight, scales, mins, w64 = make_int4(9, k, g, True, gen)
    x = torch.randn(2, 3, k, generator=gen)
    y = int4_linear(x, qweight, scales, mins, g, act_quant)
    assert y.shape == (2, 3, 9)
    xp = torch.nn.functional.pad(x.reshape(6, k), (0, w64.shape[1] - k))
    assert torch.equal(y.reshape(6, 9), int4_linear(xp, qweight, scales, mins, g, act_quant))
    q8, s8, g8, _ = make_int8(9, k, None, gen)
    y8 = int8_linear(x, q8, s8, g8, act_quant)
    xp8 = torch.nn.functional.pad(x.reshape(6, k), (0, g8 - k))
    assert torch.equal(y8.reshape(6, 9), int8_linear(xp8, q8, s8, g8, act_quant))
    assert int8_linear(x[:0], q8, s8, g8, act_quant).shape == (0, 3, 9)


@pytest.mark.parametrize("act_quant", [False, True])
def test_nan_in_x_reaches_the_output(act_quant: bool) -> None:
    """A NaN must not vanish in the int8 rounding: its row of y is NaN, the other rows not."""
    gen = torch.Generator().manual_seed(8)
    qweight, scales, mins, _ = make_int4(12, 96, 32, True, gen)
    q8, s8, g8, _ = make_int8(12, 96, None, gen)
    for m in (1, 3, 9):  # row tiles and panels
        x = torch.randn(m, 96, generator=gen)
        x[m - 1, 40] = float("nan")
        for y in (int4_linear(x, qweight, scales, mins, 32, act_quant),
                  int8_linear(x, q8, s8, g8, act_quant)):
            assert y[m - 1].isnan().all() and y[: m - 1].isfinite().all()


def test_bad_arguments_raise() -> None:
    gen = torch.Generator().manual_seed(4)
    qweight, scales, mins, _ = make_int4(4, 64, 32, True, gen)
    x = torch.randn(1, 64)
    with pytest.raises(RuntimeError, match="scales"):
        torch.ops.fitserve.int4_linear(x, qweight, scales.float(), mins, 32, False)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        torch.ops.fitserve.int4_linear(x, qweight, scales, mins, 48, False)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        torch.ops.fitserve.int4_linear(x.half(), qweight, scales, mins, 32, False)
    with pytest.raises(ValueError, match="columns"):
        int4_linear(torch.randn(1, 65), qweight, scales, mins, 32, False)


def test_torch_compile_fullgraph_treats_ops_as_opaque() -> None:
    """Inductor traces through both ops (fake kernels), fullgraph, and runs them as extern calls."""
    gen = torch.Generator().manual_seed(6)
    qweight, scales, mins, _ = make_int4(24, 64, 32, False, gen)
    q8, s8, g8, _ = make_int8(24, 24, None, gen)

    def fn(x: torch.Tensor) -> torch.Tensor:
        h = torch.ops.fitserve.int4_linear(x, qweight, scales, mins, 32, True)
        h = torch.nn.functional.pad(torch.relu(h), (0, g8 - 24))
        y: torch.Tensor = torch.ops.fitserve.int8_linear(h, q8, s8, g8, False) * 2
        return y

    x = torch.randn(3, 64, generator=gen)
    compiled = torch.compile(fn, fullgraph=True)
    assert torch.equal(compiled(x), fn(x))


def test_tier_is_the_one_asked_for() -> None:
    assert asked_tier() == qlinear_tier()


@pytest.mark.slow
@pytest.mark.parametrize("tier", ["avx2", "scalar", "avx512"])
def test_lower_tiers_match_float64(tier: str) -> None:
    """The AVX2 and scalar code paths, built here with FITSERVE_CPU_TIER, pass the same tests."""
    run_tests_at_tier(__file__, tier, "tier_is or (matches_float64 and not bfloat16) or tight "
                                      "or model_shapes or nan_in_x")


@pytest.mark.parametrize("act_quant", [False, True])
@pytest.mark.parametrize("kind", ["int4-asym-g32", "int4-sym-g128", "int8-g32", "int8-channel"])
def test_thread_splits_give_the_same_bits(kind: str, act_quant: bool) -> None:
    """Each output row is one thread's work, summed in one order: 1, 2 or 3 threads give the
    same bits, for every way a call runs (M = 1 GEMV/rows, small-M rows, panels)."""
    gen = torch.Generator().manual_seed(9)
    n, k = 203, 576  # rows split unevenly into parallel blocks
    if kind.startswith("int4"):
        g = int(kind.split("-g")[1])
        qweight, scales, mins, w64 = make_int4(n, k, g, "asym" in kind, gen)

        def run(x: torch.Tensor) -> torch.Tensor:
            return int4_linear(x, qweight, scales, mins, g, act_quant)
    else:
        q8, s8, g8, w64 = make_int8(n, k, 32 if kind == "int8-g32" else None, gen)

        def run(x: torch.Tensor) -> torch.Tensor:
            return int8_linear(x, q8, s8, g8, act_quant)
    for m in (1, 4, 14, 33, 200):
        x = make_x(m, k, w64.shape[1], torch.float32, gen)
        outs = []
        for t in (1, 2, 3):
            with torch_threads(t):
                outs.append(run(x))
        assert all(torch.equal(outs[0], o) for o in outs[1:]), (kind, m)
