"""The decoder layer's fused C++ ops against float64 references and the eager torch path."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fitserve.kernels.cpu import fused
from tests.conftest import asked_tier, run_tests_at_tier

pytestmark = pytest.mark.skipif(not fused.fused_ops_available(),
                                reason="fused_ops extension could not be built here")

DTYPES = [torch.float32, torch.bfloat16]
# Relative error bounds against float64: fp32 -> a few ulp of fp32 sums; bf16 -> the reference's
# two roundings (normalised value, then the product with the weight), (1 + 2^-8)^2 - 1 < 2^-7.
TOL = {torch.float32: 1e-5, torch.bfloat16: 2.0**-7 * 1.01}


def _rms64(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x64 = x.double()
    return w.double() * (x64 / torch.sqrt((x64 * x64).mean(-1, keepdim=True) + eps))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,dim", [(1, 576), (7, 64), (33, 1000)])
def test_rms_norm(dtype: torch.dtype, rows: int, dim: int) -> None:
    torch.manual_seed(rows)
    x, w = torch.randn(rows, dim, dtype=dtype) * 3, torch.randn(dim, dtype=dtype)
    got = fused.rms_norm(x, w, 1e-5)
    ref = _rms64(x, w, 1e-5)
    assert ((got.double() - ref).abs() <= TOL[dtype] * ref.abs() + 1e-6).all()
    eager = fused.rms_norm_reference(x, w, 1e-5)
    assert (got.double() - eager.double()).abs().max().item() <= TOL[dtype] * w.abs().max().item()
    if dtype == torch.bfloat16:  # same rounding points as the reference: bit-identical here
        assert torch.equal(got, eager)


def _scaled_rows(rows: int, dim: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Rows whose magnitudes span 1e-3 .. 1e2 (the sums' rounding at every scale)."""
    gen = torch.Generator().manual_seed(seed)
    scale = torch.logspace(-3, 2, rows).unsqueeze(1)
    return (torch.randn(rows, dim, generator=gen) * scale).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [8, 64, 136, 256, 512])
def test_rms_norm_sum_order_is_atens(dtype: torch.dtype, dim: int) -> None:
    """For D a multiple of 8 up to 512 the rows' sum of squares runs in ATen's vectorized order,
    so rms_norm and add_rms_norm_ give fused.rms_norm_reference's (the eager composite's) bits."""
    x = _scaled_rows(200, dim, dtype, dim)
    w = _scaled_rows(1, dim, dtype, dim + 1)[0] * 50
    eager = w * F.rms_norm(x.float(), (dim,), eps=1e-6).to(dtype)
    assert torch.equal(fused.rms_norm(x, w, 1e-6), eager)
    res, add = x.clone(), _scaled_rows(200, dim, dtype, dim + 2)
    got = fused.add_rms_norm_(res, add, w, 1e-6)
    assert torch.equal(res, (x.double() + add.double()).to(dtype))
    assert torch.equal(got, w * F.rms_norm(res.float(), (dim,), eps=1e-6).to(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [576, 1000, 1003, 2048])
def test_rms_norm_rows_do_not_depend_on_the_batch(dtype: torch.dtype, dim: int) -> None:
    """Each row's bits are the same alone, in any batch and at any thread count (the engine's
    batch invariance), and within the float64 bound, at widths past ATen's one-level sum and
    with a tail of D % 8 columns."""
    x = _scaled_rows(64, dim, dtype, dim)
    w = _scaled_rows(1, dim, dtype, dim + 1)[0] * 50
    full = fused.rms_norm(x, w, 1e-5)
    ref = _rms64(x, w, 1e-5)
    assert ((full.double() - ref).abs() <= TOL[dtype] * ref.abs() + 1e-6).all()
    for r in (0, 17, 63):
        assert torch.equal(fused.rms_norm(x[r : r + 1], w, 1e-5), full[r : r + 1])
    assert torch.equal(fused.rms_norm(x[5:40], w, 1e-5), full[5:40])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(fused.rms_norm(x, w, 1e-5), full)
    finally:
        torch.set_num_threads(threads)


def test_rms_norm_tier_is_the_one_asked_for() -> None:
    from fitserve.kernels.cpu.isa import build_tier, detect_isa

    assert asked_tier() == build_tier(detect_isa())


@pytest.mark.slow
@pytest.mark.parametrize("tier", ["avx2", "scalar"])
def test_rms_norm_lower_tiers(tier: str) -> None:
    """The vector-typed sum built for the avx2 tier (ymm) and the scalar one (no AVX: SSE pairs
    and a volatile copy instead of the asm barrier) keep ATen's order and the batch invariance."""
    run_tests_at_tier(__file__, tier, "sum_order_is_atens or do_not_depend or rms_norm_tier_is")


def _aten_heads(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """rms_norm_reference as ATen computes it (the composite the op must match bit for bit)."""
    return w * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


@pytest.mark.parametrize("dim", [8, 16, 24, 64, 128, 136, 256, 512, 40, 520])
@pytest.mark.parametrize("per_head", [False, True])
def test_rms_norm_heads_is_the_aten_composite_bit_for_bit(dim: int, per_head: bool) -> None:
    """Per-head q/k norms on a qkv view (rows strided past the heads): the same bits as
    F.rms_norm's dozen ops over every scale of input, weight [D] or [H, D], and within the
    reference's rounding of float64; 520 (past the one-pass kernel's sums) and bf16's fallbacks
    too."""
    assert torch.ops.fitserve_fused.rms_norm_heads_one_pass()  # this torch: the kernel's order
    torch.manual_seed(dim)
    heads, tokens = 5, 7
    qkv = torch.randn(tokens, (heads + 2) * dim) * torch.logspace(-4, 2, tokens).unsqueeze(1)
    x = qkv.bfloat16()[:, : heads * dim].view(tokens, heads, dim)  # not contiguous past D
    w = torch.randn(heads, dim).bfloat16() if per_head else torch.randn(dim).bfloat16()
    got = torch.ops.fitserve_fused.rms_norm_heads(x, w, 1e-6)
    assert torch.equal(got, _aten_heads(x, w, 1e-6))
    ref = _rms64(x, w, 1e-6)
    assert ((got.double() - ref).abs() <= TOL[torch.bfloat16] * ref.abs() + 1e-30).all()
    if not per_head:  # the module path's RMSNorm on 3-D views goes through it
        assert torch.equal(fused.rms_norm_reference(x, w, 1e-6), got)


def test_rms_norm_heads_falls_back_and_checks_shapes() -> None:
    x = torch.randn(2, 3, 64)
    assert torch.equal(torch.ops.fitserve_fused.rms_norm_heads(x, torch.ones(64), 1e-5),
                       _aten_heads(x, torch.ones(64), 1e-5))  # fp32: the ATen ops
    with pytest.raises(RuntimeError, match=r"weight must be \[D\] or \[H, D\]"):
        torch.ops.fitserve_fused.rms_norm_heads(x.bfloat16(), torch.ones(2, 64).bfloat16(), 1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_updates_residual_in_place(dtype: torch.dtype) -> None:
    torch.manual_seed(1)
    res, x, w = (torch.randn(5, 96, dtype=dtype), torch.randn(5, 96, dtype=dtype),
                 torch.randn(96, dtype=dtype))
    expect_res = (res.double() + x.double()).to(dtype)
    got = fused.add_rms_norm_(res, x, w, 1e-6)
    assert torch.equal(res, expect_res)  # one rounding of an exact sum
    ref = _rms64(expect_res, w, 1e-6)
    assert ((got.double() - ref).abs() <= TOL[dtype] * ref.abs() + 1e-6).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(dtype: torch.dtype) -> None:
    torch.manual_seed(2)
    g = torch.randn(9, 2 * 1030, dtype=dtype) * 4  # 64 vector lanes-of-16 and a tail of 6
    g[0, :8] = torch.tensor([-1e4, -200.0, -89.0, -87.0, 87.0, 89.0, 200.0, 1e4]).to(dtype)
    got = fused.silu_and_mul(g)
    gate, up = g.double().chunk(2, -1)
    ref = gate * torch.sigmoid(gate) * up
    assert ((got.double() - ref).abs() <= TOL[dtype] * ref.abs() + 1e-6).all()
    if dtype == torch.bfloat16:
        gate_b, up_b = g.chunk(2, -1)
        assert torch.equal(got, F.silu(gate_b) * up_b)


def _rope64(x: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor, interleaved: bool
            ) -> torch.Tensor:
    ang = pos.double()[:, None] * inv_freq.double()[None, :]  # [N, D/2]
    c, s = torch.cos(ang)[:, None, :], torch.sin(ang)[:, None, :]
    x = x.double()
    if interleaved:
        x0, x1 = x[..., 0::2], x[..., 1::2]
        return torch.stack((x0 * c - x1 * s, x1 * c + x0 * s), -1).flatten(-2)
    h = x.shape[-1] // 2
    x0, x1 = x[..., :h], x[..., h:]
    return torch.cat((x0 * c - x1 * s, x1 * c + x0 * s), -1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [False, True])
def test_rope_write_kv(dtype: torch.dtype, interleaved: bool) -> None:
    torch.manual_seed(3)
    n, hq, hkv, d, nb, bs, max_pos = 6, 4, 2, 16, 5, 4, 64
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    ang = torch.arange(max_pos).float()[:, None] * inv_freq[None, :]
    cos, sin = ang.cos(), ang.sin()
    qkv = torch.randn(n, (hq + 2 * hkv) * d, dtype=dtype)
    qk = qkv[:, : (hq + hkv) * d].view(n, hq + hkv, d)  # strided view, as the model passes it
    v = qkv[:, (hq + hkv) * d :].view(n, hkv, d)
    before = qk.clone()
    pos = torch.tensor([0, 1, 2, 40, 41, 63])
    slots = torch.tensor([3, 0, 17, 8, 9, 19])  # scattered over blocks
    kc = torch.zeros(hkv, nb, bs, d, dtype=dtype)
    vc = torch.zeros_like(kc)
    assert fused.rope_write_kv_(qk, v, pos, cos, sin, kc, vc, slots, hq, interleaved)
    ref = _rope64(before, pos, inv_freq, interleaved)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert (qk.double() - ref).abs().max().item() < tol * before.abs().max().item() * 2
    flat_k, flat_v = kc.view(hkv, nb * bs, d), vc.view(hkv, nb * bs, d)
    for t in range(n):
        assert torch.equal(flat_k[:, slots[t]], qk[t, hq:])
        assert torch.equal(flat_v[:, slots[t]], v[t])
    untouched = torch.ones(nb * bs, dtype=torch.bool)
    untouched[slots] = False
    assert not flat_k[:, untouched].any() and not flat_v[:, untouched].any()


def test_rope_rejects_out_of_range_positions() -> None:
    qk = torch.zeros(1, 2, 8)
    v = torch.zeros(1, 1, 8)
    cos = sin = torch.zeros(4, 4)
    kc = torch.zeros(1, 2, 2, 8)
    with pytest.raises(RuntimeError, match="position out of range"):
        fused.rope_write_kv_(qk, v, torch.tensor([4]), cos, sin, kc, kc.clone(),
                             torch.tensor([0]), 1, False)
    with pytest.raises(RuntimeError, match="slot out of range"):
        fused.rope_write_kv_(qk, v, torch.tensor([0]), cos, sin, kc, kc.clone(),
                             torch.tensor([4]), 1, False)


def test_ops_trace_under_torch_compile() -> None:
    def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return fused.silu_and_mul(torch.cat((fused.rms_norm(x, w, 1e-5), x), -1))

    x, w = torch.randn(3, 32), torch.randn(32)
    compiled = torch.compile(f, fullgraph=True, backend="eager")
    assert torch.equal(compiled(x, w), f(x, w))


def _argmax64(x: torch.Tensor) -> torch.Tensor:
    """The first index of each row's largest value, the first NaN where a row has one."""
    out = []
    for row in x.double():
        nan = row.isnan().nonzero()
        out.append(int(nan[0]) if len(nan) else int((row == row.max()).nonzero()[0]))
    return torch.tensor(out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("rows,vocab", [(1, 49152), (33, 1000), (3, 7), (2, 1), (4, 8 * 37 + 5)])
def test_argmax_is_the_first_largest(dtype: torch.dtype, rows: int, vocab: int) -> None:
    gen = torch.Generator().manual_seed(rows * vocab)
    x = (torch.randn(rows, vocab, generator=gen) * 4).to(dtype)
    assert torch.equal(fused.argmax(x), _argmax64(x))
    if vocab > 2:  # ties: the first of two equal maxima, placed in different vector lanes
        x[:, vocab - 1] = x.max() + 1
        x[:, vocab // 3] = x[:, vocab - 1]
        assert torch.equal(fused.argmax(x), _argmax64(x))
        assert (fused.argmax(x) == vocab // 3).all()
    # NaN beats everything (torch's rule): row 0 in the tail, the last row before a tie
    x[0, vocab - 1] = float("nan")
    x[-1, vocab // 2] = float("nan")
    assert torch.equal(fused.argmax(x), _argmax64(x))
    assert torch.equal(fused.argmax(x), x.argmax(-1))
    inf = torch.full((rows, vocab), float("-inf"), dtype=dtype)
    assert torch.equal(fused.argmax(inf), torch.zeros(rows, dtype=torch.long))
    signed_zero = torch.tensor([[-0.0, 0.0, -1.0]], dtype=dtype)
    assert fused.argmax(signed_zero).tolist() == signed_zero.argmax(-1).tolist() == [0]
