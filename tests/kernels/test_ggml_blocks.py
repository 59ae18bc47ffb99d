"""fitserve::ggml_matmul (ggml_blocks.cpp) on raw GGUF blocks against float64 references.

The weights are random bytes reinterpreted as ggml blocks (every 6-bit scale / min code, every
int8 Q6_K scale, every high-bit pattern, every IQ4 table index: the C++ table of IQ4_NL /
IQ4_XS values is thereby checked against gguf-py's), with the fp16 fields (d, dmin, m) set to finite,
bounded values of both signs; some blocks get all-zero and all-maximal scale codes. The
reference is ``x64 @ W64.T`` with ``W64 = gguf.quants.dequantize(blocks)`` (gguf-py, the
independent implementation) in float64.

Bound: the kernel rounds x per activation block b (256 columns for the K-quants and IQ4_XS, 32
for Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / IQ4_NL) to ``d_b * q`` with ``|x_k - d_b q_k| <= d_b / 2``, so
``|y - y64| <= sum_b (d_b / 2) * sum_{k in b} |w_k|`` plus fp32 rounding of the terms it adds:
the scaled integer dots (``|d sc q| <= |w| + |offset|``) and the offsets (-dmin * m, -32 d sc,
-16 d, -8 d, m); ``offset_k`` is gguf's dequantization of the same blocks with their quant bits
zeroed. bfloat16 x: the reference uses the same bf16 values (the output is fp32).

That bound holds for any rounding, so it is loose (a wrong sub-block could hide in it); each
check therefore also compares with ``x_hat64 @ W64.T``, x_hat = x rounded to int8 per block as
the kernel's contract says (fp32 absmax / 127, round half to even), where only the fp32
rounding of the kernel's sums is left.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize

from fitserve.kernels.cpu.ggml_blocks import (
    _BLOCK,
    GGML_KERNEL_TYPES,
    amx_active,
    ggml_blocks_tier,
    ggml_kernel_available,
    ggml_matmul,
    set_amx,
)
from tests.conftest import asked_tier, run_tests_at_tier, torch_threads

if not ggml_kernel_available("Q4_K"):
    pytest.skip("the ggml_blocks C++ extension could not be built here (no compiler, a failed "
                "build or FITSERVE_DISABLE_CPP=1)", allow_module_level=True)

EPS32 = 2.0**-23
TYPES = list(GGML_KERNEL_TYPES)
# byte offsets of the fp16 fields, of the scale bytes, and of the quant bits of each block
F16_FIELDS = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "Q4_0": (0,), "Q4_1": (0, 2),
              "Q8_0": (0,), "Q5_0": (0,), "Q5_1": (0, 2), "IQ4_NL": (0,), "IQ4_XS": (0,),
              "MXFP4": ()}
SCALE_BYTES = {"Q4_K": (4, 16), "Q5_K": (4, 16), "Q6_K": (192, 208), "IQ4_XS": (2, 8)}
# the quant bits: zeroed, they leave each weight's offset (IQ4 types have none: the table is
# signed, nibble 0 maps to -127, so zeroed quants give d * sc * -127: a valid magnitude bound)
QUANT_BYTES = {"Q4_K": [(16, 144)], "Q5_K": [(16, 176)], "Q6_K": [(0, 192)], "Q4_0": [(2, 18)],
               "Q4_1": [(4, 20)], "Q8_0": [(2, 34)], "Q5_0": [(2, 22)],
               "Q5_1": [(4, 24)], "IQ4_NL": [(2, 18)], "IQ4_XS": [(8, 136)], "MXFP4": [(1, 17)]}
ACT_BLOCK = {"Q4_K": 256, "Q5_K": 256, "Q6_K": 256, "Q4_0": 32, "Q4_1": 32, "Q8_0": 32,
             "Q5_0": 32, "Q5_1": 32, "IQ4_NL": 32, "IQ4_XS": 256, "MXFP4": 32}


def gtype(name: str) -> gguf.GGMLQuantizationType:
    return gguf.GGMLQuantizationType[name]


def random_blocks(t: str, n: int, k: int, seed: int) -> np.ndarray:
    """uint8 [n, row bytes]: random bytes, finite fp16 fields of both signs (5% zero); block 0
    of row 0 with all sub-block scales 0 (K-quant mins kept), row 1 with every scale / min code
    maximal (0xFF: 6-bit 63; Q6_K int8 -1), row 2 of Q6_K with int8 scales -128 / 127."""
    rng = np.random.default_rng(seed)
    block, size = gguf.GGML_QUANT_SIZES[gtype(t)]
    b = rng.integers(0, 256, (n, k // block, size), dtype=np.uint8)
    for off in F16_FIELDS[t]:
        v = (rng.standard_normal((n, k // block)) * 0.02).astype(np.float16)
        v[rng.random(v.shape) < 0.05] = 0.0  # some zero d / dmin
        b[:, :, off:off + 2] = v.view(np.uint8).reshape(n, k // block, 2)
    if t == "MXFP4":  # the e8m0 exponent byte: scales 2^-128 (e = 0, subnormal) .. 2^-3
        b[:, :, 0] = rng.integers(118, 126, (n, k // block))
        b[0, 0, 0] = 0
    if t in SCALE_BYTES:
        lo, hi = SCALE_BYTES[t]
        if t in ("Q6_K", "IQ4_XS"):
            b[0, 0, lo:hi] = 0  # IQ4_XS: every code 0 is the scale -32
        else:  # the 8 scales 0, the 8 mins kept (bytes 0-3, the low nibbles of 8-11)
            b[0, 0, lo:lo + 4] = 0
            b[0, 0, lo + 8:hi] &= 0xF0
        if n > 1:
            b[1, :, lo:hi] = 0xFF
        if t == "Q6_K" and n > 2:  # int8 extremes
            b[2, :, lo:hi] = np.array([0x80, 0x7F] * 8, dtype=np.uint8)
    return b.reshape(n, -1)


def reference(t: str, blocks: np.ndarray, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(W64, |offsets|64) [n, k]: gguf-py's dequantization, and that of the blocks with every
    quant bit zeroed (what each weight is offset by: -dmin * m, -32 d sc, -16 d, m)."""
    w = dequantize(blocks, gtype(t)).astype(np.float64).reshape(n, k)
    z = blocks.reshape(n, -1, gguf.GGML_QUANT_SIZES[gtype(t)][1]).copy()
    for lo, hi in QUANT_BYTES[t]:
        z[:, :, lo:hi] = 0
    off = dequantize(z.reshape(n, -1), gtype(t)).astype(np.float64).reshape(n, k)
    return torch.from_numpy(w), torch.from_numpy(np.abs(off))


def bound(t: str, x64: torch.Tensor, w64: torch.Tensor, off64: torch.Tensor) -> torch.Tensor:
    m, k = x64.shape
    ab = ACT_BLOCK[t]
    da = x64.view(m, k // ab, ab).abs().amax(-1) / 127  # [M, blocks]
    wsum = w64.abs().view(w64.shape[0], k // ab, ab).sum(-1)  # [N, blocks]
    quant = (da * (0.5 + 1e-4)) @ wsum.T
    xhat = x64.abs() + da.repeat_interleave(ab, 1)
    slack = (k / 16 + 64) * EPS32 * (xhat @ (w64.abs() + 2 * off64).T)
    return quant + slack


def quantized_x(t: str, x: torch.Tensor) -> torch.Tensor:
    """x as the kernel rounds it, in float64: per activation block d = absmax / 127 and
    q = round_half_even(x * (127 / absmax)) in [-127, 127], each step in fp32 as the kernel."""
    m, k = x.shape
    ab = ACT_BLOCK[t]
    xb = x.float().view(m, k // ab, ab)
    amax = xb.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros_like(amax))
    q = torch.round((xb * inv).clamp(-127, 127))
    return (q.double() * (amax / 127).double()).view(m, k)


def make_x(m: int, k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen)
    x[:, ::7] *= 4.0  # uneven magnitudes inside blocks
    if m > 1:
        x[1, : k // 2] = 0.0  # all-zero activation blocks (d = 0)
    return x.to(dtype)


def check(t: str, m: int, n: int, k: int, dtype: torch.dtype, seed: int) -> None:
    blocks = random_blocks(t, n, k, seed)
    w64, off64 = reference(t, blocks, n, k)
    x = make_x(m, k, dtype, seed)
    y = ggml_matmul(x, torch.from_numpy(blocks), t, n, k)
    assert y.dtype == torch.float32 and y.shape == (m, n)
    x64 = x.double()
    err = (y.double() - x64 @ w64.T).abs()
    worst = (err / bound(t, x64, w64, off64).clamp_min(1e-300)).max().item()
    assert worst <= 1.0, f"{t} M={m} N={n} K={k}: error exceeds the bound by {worst:.3g}x"
    # the tight check: against x rounded as the kernel rounds it, only fp32 summation is left
    xq64 = quantized_x(t, x)
    slack = (k / 16 + 64) * EPS32 * (xq64.abs() @ (w64.abs() + 2 * off64).T)
    err_q = (y.double() - xq64 @ w64.T).abs()
    worst_q = (err_q / slack.clamp_min(1e-300)).max().item()
    assert worst_q <= 1.0, f"{t} M={m} N={n} K={k}: vs rounded x, {worst_q:.3g}x the fp32 slack"
    if (w64 != 0).any():
        assert err.max().item() > 0, "the exact product: x was not quantized?"


# NOTE: Q4_0 / Q4_1 / Q8_0 run the tile drivers (rows_range, lanes_row<B, MT>) that the other
# 32-column types test at every M; one M per range (1, 2-16, 17-256) keeps their added time small
# (test_each_row_is_the_row_alone covers their 8 + 4 + 2 + 1 tiles bit for bit)
FEW_M_TYPES = ("Q4_0", "Q4_1", "Q8_0")
MATMUL_CASES = [(t, m) for t in TYPES for m in (1, 2, 3, 5, 16, 17, 40, 64)
                if t not in FEW_M_TYPES or m in (1, 5, 17)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("t", "m"), MATMUL_CASES)
def test_matches_float64(t: str, m: int, dtype: torch.dtype) -> None:
    """M = 1 (the GEMV), 2-16 and 17-64 (row tiles of 4 + 2 + 1), several N and K: K = 256 (one
    super-block), 512, 2304 (9 super-blocks / 72 blocks of 32); the 32-column types also 288
    (an odd number of blocks: the tail after the AVX-512 kernels' pairs of blocks)."""
    odd = ((5, 288),) if ACT_BLOCK[t] == 32 else ()
    for n, k in ((1, 256), (7, 512), (67, 2304), (130, 256), *odd):
        check(t, m, n, k, dtype, seed=1000 * m + n + k)


@pytest.mark.parametrize("t", TYPES)
def test_model_shapes(t: str) -> None:
    """A decode (M = 1) and prefills (M = 23, 200) on 576 / 1536-column rows, where the
    32-column types have many blocks (K = 1536 also for the K-quants)."""
    for n, k in ((96, 576 if ACT_BLOCK[t] == 32 else 768), (40, 1536)):
        for m in (1, 23, 200):
            check(t, m, n, k, torch.float32, seed=7 * m + k)


def test_type_table_matches_gguf() -> None:
    """The Python and C++ type lists agree, and the block geometry is gguf's."""
    assert list(torch.ops.fitserve.ggml_kernel_types()) == list(GGML_KERNEL_TYPES)
    for t in GGML_KERNEL_TYPES:
        assert _BLOCK[t] == gguf.GGML_QUANT_SIZES[gtype(t)]


@pytest.mark.parametrize("t", TYPES)
def test_thread_splits_give_the_same_bits(t: str) -> None:
    """Each output is one thread's work in one order: 1, 2 or 3 threads give the same bits."""
    n, k = 203, 512
    blocks = torch.from_numpy(random_blocks(t, n, k, 3))
    for m in (1, 6, 33):
        x = make_x(m, k, torch.float32, m)
        outs = []
        for threads in (1, 2, 3):
            with torch_threads(threads):
                outs.append(ggml_matmul(x, blocks, t, n, k))
        assert all(torch.equal(outs[0], o) for o in outs[1:]), (t, m)


@pytest.mark.parametrize("t", TYPES)
def test_each_row_is_the_row_alone(t: str) -> None:
    """Batch invariance: row r of a call with M rows has the bits of row r run alone (the M = 1
    GEMV, rows streamed), for M = 15 (tiles of 8 + 4 + 2 + 1 rows on AVX-512, 4 + 4 + 4 + 2 + 1
    on AVX2), M = 24 (full tiles only) and M = 37 (the K-quants' AVX-512 panels: 9 tiles of 4
    and one of 1, over 16 + 16 + 13 weight rows, a pair of panels in one register tile where a
    thread's share has two; IQ4_XS's VNNI panels the same way from M = 2; the VNNI 32-column
    types' register tiles of 4 weight rows x 4 rows of x, then 2 and 1, over blocks with a last
    short one; where the CPU has AMX-INT8, their tiles of 16 + 16 + 5); K = 544 for the
    32-column types is 17 blocks (a 16-block step of the VNNI rows and a tail of one), 1280 for
    the others (5 super-blocks: two of IQ4_XS's two-super-block GEMV steps and its odd one)."""
    n, k = 45, 544 if ACT_BLOCK[t] == 32 else 1280
    blocks = torch.from_numpy(random_blocks(t, n, k, 11))
    ms = (15, 24, 37)
    x = make_x(max(ms), k, torch.float32, 13)
    alone = torch.cat([ggml_matmul(x[r:r + 1], blocks, t, n, k) for r in range(max(ms))])
    for m in ms:
        y = ggml_matmul(x[:m], blocks, t, n, k)
        bad = [r for r in range(m) if not torch.equal(y[r], alone[r])]
        assert not bad, f"{t} M={m}: rows {bad} differ from the row alone"


@pytest.mark.parametrize("types", [("Q4_K", "Q6_K"), ("Q8_0",), ("Q6_K", "Q4_0", "Q4_K", "IQ4_XS")])
@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_parts_side_by_side_are_the_calls_concatenated(types: tuple[str, ...], m: int,
                                                      dtype: torch.dtype) -> None:
    """ggml_matmul_parts (a decode step's Q4_K_M qkv: attn_q / attn_k Q4_K, attn_v Q6_K) gives
    the bits of each part's ggml_matmul, concatenated, and with out_x_dtype of that rounded to
    x's dtype; one row of x runs all parts in one region, split over 1, 2 or 3 threads alike."""
    k, ns = 512, (70, 24, 45, 33)
    blocks = [torch.from_numpy(random_blocks(t, n, k, 30 + i))
              for i, (t, n) in enumerate(zip(types, ns, strict=False))]
    x = make_x(m, k, dtype, 31)
    want = torch.cat([ggml_matmul(x, b, t, b.shape[0], k) for b, t in zip(blocks, types, strict=True)], -1)
    for threads in (1, 2, 3):
        with torch_threads(threads):
            got = torch.ops.fitserve.ggml_matmul_parts(x, blocks, list(types), False)
            cast = torch.ops.fitserve.ggml_matmul_parts(x, blocks, list(types), True)
        assert torch.equal(got, want), (types, m, threads)
        assert cast.dtype == dtype and torch.equal(cast, want.to(dtype)), (types, m, threads)


def test_parts_bad_arguments_raise() -> None:
    blocks = [torch.from_numpy(random_blocks("Q4_K", 4, 256, 6))]
    x = torch.randn(1, 256)
    with pytest.raises(RuntimeError, match="one type per part"):
        torch.ops.fitserve.ggml_matmul_parts(x, blocks, ["Q4_K", "Q6_K"], False)
    with pytest.raises(RuntimeError, match="ggml_matmul_parts: blocks must be contiguous uint8"):
        torch.ops.fitserve.ggml_matmul_parts(x, blocks, ["Q6_K"], False)
    with pytest.raises(RuntimeError, match="no kernel for GGML type"):
        torch.ops.fitserve.ggml_matmul_parts(x, blocks, ["Q2_K"], False)


AMX_TYPES = ["Q4_K", "Q5_K", "Q6_K"] + [t for t in TYPES if ACT_BLOCK[t] == 32]


@pytest.mark.parametrize("t", AMX_TYPES)
def test_amx_tiles_give_the_vnni_bits(t: str) -> None:
    """Where the CPU has AMX-INT8: the K-quant panels' 16-row AMX tiles (ggml_blocks_kqamx.h;
    Q4_K / Q5_K through the scale-digit codes) give every row the bits of the VNNI panels, and
    the 32-column types' tiles (ggml_blocks_lanes_amx.h: one tile dot per block of 32
    columns, the lanes' fp32 order) the bits of their VNNI rows (IQ4_XS has no AMX tiles: its
    VNNI panel runs); M = 16 (one full tile), 17 and 47 (short last
    tiles), N = 45 (a 13-row last panel), K = 1280 (5 super-blocks, 40 blocks of 32) and for the
    32-column types also 544 (17 blocks: an odd count, a lane with two blocks); and with the
    tiles on, a call stays within check()'s float64 bounds."""
    if not amx_active():
        pytest.skip("no AMX-INT8 tiles here (or FITSERVE_AMX=0): the VNNI kernels run every M")
    for k in (1280, 544) if ACT_BLOCK[t] == 32 else (1280,):
        amx_matches_vnni(t, 45, k)
    check(t, 33, 45, 2304, torch.bfloat16, seed=77)


def amx_matches_vnni(t: str, n: int, k: int) -> None:
    blocks = torch.from_numpy(random_blocks(t, n, k, 19))
    x = make_x(47, k, torch.float32, 23)
    try:
        for m in (16, 17, 47):
            set_amx(True)
            got = ggml_matmul(x[:m], blocks, t, n, k)
            set_amx(False)
            want = ggml_matmul(x[:m], blocks, t, n, k)
            assert torch.equal(got, want), f"{t} M={m} K={k}: AMX differs from VNNI"
    finally:
        set_amx(True)


@pytest.mark.parametrize(("t", "m"), [("Q4_K", 3), ("Q4_K", 20), ("IQ4_NL", 3), ("IQ4_NL", 20)])
def test_nan_in_x_reaches_its_row_only(t: str, m: int) -> None:
    """A NaN in one row of x makes that row NaN and no other (M = 20: the AMX tiles where the
    CPU has them, the row sharing its tile with 15 finite ones)."""
    blocks = torch.from_numpy(random_blocks(t, 12, 512, 5))
    x = torch.randn(m, 512)
    x[2, 300] = float("nan")
    y = ggml_matmul(x, blocks, t, 12, 512)
    assert y[2].isnan().all()
    assert torch.cat([y[:2], y[3:]]).isfinite().all()


def test_bad_arguments_raise() -> None:
    blocks = torch.from_numpy(random_blocks("Q4_K", 4, 256, 6))
    x = torch.randn(2, 256)
    with pytest.raises(ValueError, match="no kernel for GGML type 'Q2_K'"):
        ggml_matmul(x, blocks, "Q2_K", 4, 256)
    with pytest.raises(ValueError, match="multiple of Q4_K's block size 256"):
        ggml_matmul(torch.randn(2, 128), blocks, "Q4_K", 4, 128)
    with pytest.raises(ValueError, match="blocks must be uint8"):
        ggml_matmul(x, blocks, "Q6_K", 4, 256)
    with pytest.raises(ValueError, match="x must be"):
        ggml_matmul(x.half(), blocks, "Q4_K", 4, 256)
    with pytest.raises(RuntimeError, match="no kernel for GGML type"):
        torch.ops.fitserve.ggml_matmul(x, blocks, "IQ2_XS", 4, 256)
    assert not ggml_kernel_available("Q2_K")
    assert ggml_matmul(x[:0], blocks, "Q4_K", 4, 256).shape == (0, 4)


def test_torch_compile_fullgraph_treats_the_op_as_opaque() -> None:
    blocks = torch.from_numpy(random_blocks("Q6_K", 24, 256, 8))

    def fn(x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = torch.ops.fitserve.ggml_matmul(x, blocks, "Q6_K", 24, 256)
        return torch.relu(y) * 2

    x = torch.randn(3, 256)
    assert torch.equal(torch.compile(fn, fullgraph=True)(x), fn(x))


def test_tier_is_the_one_asked_for() -> None:
    assert asked_tier() == ggml_blocks_tier()


@pytest.mark.slow
@pytest.mark.parametrize("tier", ["avx2", "scalar", "avx512"])
def test_lower_tiers_match_float64(tier: str) -> None:
    """The tiers below this CPU's own, built with FITSERVE_CPU_TIER, pass the same tests."""
    run_tests_at_tier(__file__, tier, "tier_is or (matches_float64 and not bfloat16) or "
                                      "model_shapes or nan_in_x or row_alone")
