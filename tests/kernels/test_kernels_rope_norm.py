"""RoPE (both pairings, ragged positions, left padding, angle precision) and RMSNorm."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fitserve.tools.labs.rmsnorm import (
    rms_norm_eager,
    rms_norm_float64,
    rms_norm_one_pass,
    rmsnorm_bytes,
)
from fitserve.tools.labs.rope import (
    apply_rope,
    apply_rope_reference,
    half_to_interleaved,
    positions_from_attention_mask,
    rope_angles,
)

SETTINGS = settings(max_examples=25, deadline=None, derandomize=True)


def test_pairings_by_hand() -> None:
    x = torch.tensor([[[1.0, 0.0, 0.0, 0.0]]])                     # [tokens=1, heads=1, D=4]
    p = torch.tensor([3])
    c, s = math.cos(3.0), math.sin(3.0)
    inter = apply_rope(x, p, pairing="interleaved")[0, 0].tolist()
    half = apply_rope(x, p, pairing="half")[0, 0].tolist()
    assert inter == pytest.approx([c, s, 0.0, 0.0], abs=1e-6)     # pair (x0, x1)
    assert half == pytest.approx([c, 0.0, s, 0.0], abs=1e-6)      # pair (x0, x2)


@SETTINGS
@given(n=st.integers(1, 9), heads=st.integers(1, 3), half_d=st.integers(1, 12),
       pairing=st.sampled_from(["interleaved", "half"]), seed=st.integers(0, 2**16))
def test_ragged_positions_match_reference(n: int, heads: int, half_d: int, pairing: str,
                                          seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, heads, 2 * half_d, generator=g)
    pos = torch.randint(0, 2048, (n,), generator=g)              # ragged, unsorted
    got = apply_rope(x, pos, pairing=pairing)  # type: ignore[arg-type]
    ref = apply_rope_reference(x, pos, pairing=pairing)  # type: ignore[arg-type]
    # fp32 angle error <= 2 * 2^-24 * 2048 * |x| ~ 1e-3 at most (see rope.py)
    torch.testing.assert_close(got.double(), ref, atol=1e-3, rtol=1e-4)


def test_pairings_are_a_permutation_of_each_other() -> None:
    g = torch.Generator().manual_seed(0)
    x, pos = torch.randn(5, 2, 16, generator=g), torch.arange(5) * 7
    a = half_to_interleaved(apply_rope(x, pos, pairing="half"))
    b = apply_rope(half_to_interleaved(x), pos, pairing="interleaved")
    torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_relative_position_property() -> None:
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(1, 1, 32, generator=g), torch.randn(1, 1, 32, generator=g)
    def dot(pq: int, pk: int) -> float:
        a = apply_rope_reference(q, torch.tensor([pq]))
        b = apply_rope_reference(k, torch.tensor([pk]))
        return float((a * b).sum())
    assert dot(10, 3) == pytest.approx(dot(1010, 1003), abs=1e-9)


def test_left_padded_batch() -> None:
    g = torch.Generator().manual_seed(2)
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    pos = positions_from_attention_mask(mask)
    assert pos.tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 3, 4]]
    x = torch.randn(2, 5, 3, 8, generator=g)                      # [B, T, H, D]
    out = apply_rope(x, pos)
    alone = apply_rope(x[0, 2:], torch.arange(3))                  # row 0 without padding
    torch.testing.assert_close(out[0, 2:], alone, atol=0, rtol=0)
    torch.testing.assert_close(out[1], apply_rope(x[1], torch.arange(5)), atol=0, rtol=0)


def test_angle_precision_at_100k_bf16_vs_fp32() -> None:
    """bf16 rounds p = 100,000 to 99,840 (ulp 512): 160 rad error on the fastest pair."""
    p, d = 100_000, 128
    pos = torch.tensor([p])
    inv64 = 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    exact = p * inv64
    assert float(torch.tensor(float(p)).bfloat16()) == 99_840.0   # 195 * 512
    bf = rope_angles(pos, d, dtype=torch.bfloat16)[0].double()
    fp = rope_angles(pos, d, dtype=torch.float32)[0].double()
    err_bf, err_fp = (bf - exact).abs(), (fp - exact).abs()
    assert err_bf[0] == 160.0                                     # exactly the position error
    u_bf, u_fp = 2.0 ** -8, 2.0 ** -24
    assert (err_bf <= (3 * u_bf + 3 * u_bf ** 2) * exact + 1e-12).all()   # 3 roundings
    assert (err_fp <= (2 * u_fp + u_fp ** 2) * exact + 1e-12).all()      # p exact in fp32
    assert err_fp.max() < 0.013 and err_bf.max() > 100
    # what that does to the rotation: cos/sin of the fastest pair
    assert abs(math.cos(fp[0]) - math.cos(exact[0])) < 0.013
    assert abs(math.cos(bf[0]) - math.cos(exact[0])) > 0.1


@pytest.mark.parametrize("hidden", [1, 3, 7, 13, 257, 1000, 4097])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_awkward_sizes(hidden: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(hidden)
    x = (torch.randn(5, hidden, generator=g) * 3).to(dtype)
    w = torch.randn(hidden, generator=g).to(dtype)
    got, ref = rms_norm_one_pass(x, w), rms_norm_float64(x, w)
    assert got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 8e-3                # one bf16 rounding of y
    torch.testing.assert_close(got.double(), ref, atol=tol * 10, rtol=tol)
    torch.testing.assert_close(rms_norm_eager(x, w).double(), ref, atol=tol * 10, rtol=2 * tol)


# The eager transformers LlamaRMSNorm, op by op: (read, write) bytes per element for element
# size b (intermediates fp32). Per-row scalars (mean, rsqrt) and w are counted apart.
def _eager_table(b: int) -> list[tuple[int, int]]:
    return [(b, 4),   # x.to(f32)
            (4, 4),   # .pow(2)
            (4, 0),   # .mean(-1) (writes one fp32 per row)
            (4, 4),   # h * rsqrt(var + eps)
            (4, b),   # .to(x.dtype)
            (b, b)]   # weight * y


@pytest.mark.parametrize("rows,hidden,dtype_bytes,ratio", [
    # bf16: sum of the table = (2+4)+(4+4)+4+(4+4)+(4+2)+(2+2) = 36 = 4b + 28; fused 2b = 4: 9x
    # (the old count was 4b + 24 = 32: 8x)
    (4096, 4096, 2, 9.0),   # Llama-3-8B hidden
    (2048, 8192, 2, 9.0),   # Llama-3-70B hidden
    # fp32: 4 x 4 + 28 = 44 per element, fused 8: 5.5x
    (4096, 4096, 4, 5.5),
])
def test_rmsnorm_bytes_fused_vs_eager(rows: int, hidden: int, dtype_bytes: int,
                                      ratio: float) -> None:
    per_elem = sum(r + w for r, w in _eager_table(dtype_bytes))
    assert per_elem == 4 * dtype_bytes + 28
    elems = rows * hidden
    per_row = 4 + 4 + 4 + 4   # mean write, rsqrt read + write, the per-row read of x * rsqrt
    want_eager = elems * per_elem + rows * per_row + hidden * dtype_bytes
    want_fused = 2 * elems * dtype_bytes + hidden * dtype_bytes   # read x, write y, read w
    b = rmsnorm_bytes(rows=rows, hidden=hidden, dtype_bytes=dtype_bytes)
    assert (b.fused, b.eager) == (want_fused, want_eager)
    assert abs(b.ratio - ratio) < 0.01
    one = rmsnorm_bytes(rows=1, hidden=hidden, dtype_bytes=dtype_bytes)
    assert one.ratio < ratio   # w and the per-row terms dilute one row's ratio
