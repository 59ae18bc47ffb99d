"""A packed weight HELD as panels (fitserve/kernels/cpu/qlinear_held.h; the default layout of the
int8-activation linears): the same bytes as row-major, read back exactly, and every call gives
the bits the row-major weight gives, for every M (the batch-1 GEMV and the panel tiles), format
and ISA tier; the group-32 results also equal the stated order in numpy (not only each other).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fitserve.kernels.cpu.qlinear import (
    held_layout,
    hold,
    int4_linear,
    int8_linear,
    qlinear_ops_available,
    rows_of_held,
)
from tests.conftest import asked_tier, run_tests_at_tier

if not qlinear_ops_available():
    pytest.skip("the qlinear C++ extension could not be built here", allow_module_level=True)

from tests.kernels.test_qlinear_cpp import make_int4, make_int8, make_x  # noqa: E402
from tests.kernels.test_qlinear_invariance import KINDS, canonical_g32  # noqa: E402

MS = (1, 2, 3, 5, 17, 300)
N, K = 48, 352  # 3 panels of 16 (6 of 8, 48 of 1); 11 groups of 32: a partial chunk and span


def make_weight(kind: str, gen: torch.Generator, n: int = N):  # type: ignore[no-untyped-def]
    """(bits, group, qweight, scales, mins, padded K) of a random packed weight of ``kind``."""
    if kind.startswith("int4"):
        g = int(kind.split("-g")[1])
        qw, sc, mn, w64 = make_int4(n, K, g, "asym" in kind, gen)
        return 4, g, qw, sc, mn, w64.shape[1]
    q8, s8, g, w64 = make_int8(n, K, None if kind == "int8-channel" else int(kind.split("-g")[1]),
                               gen)
    return 8, g, q8, s8, None, w64.shape[1]


def call(bits: int, x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, m: torch.Tensor | None,
         g: int, act_quant: bool = True) -> torch.Tensor:
    if bits == 4:
        return int4_linear(x, q, s, m, g, act_quant)
    return int8_linear(x, q, s, g, act_quant)


@pytest.mark.parametrize("kind", KINDS)
def test_held_reads_back_exactly(kind: str) -> None:
    bits, g, q, s, m, _ = make_weight(kind, torch.Generator().manual_seed(1))
    hq, hs, hm = hold(q, s, m, g)
    lanes = held_layout().lanes
    assert hs.shape == (N // lanes, s.shape[1], lanes) and hq.numel() == q.numel()
    rq, rs, rm = rows_of_held(hq, hs, hm)
    assert torch.equal(rq, q) and torch.equal(rs, s)
    assert (m is None and rm is None) or (m is not None and rm is not None and torch.equal(rm, m))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("kind", KINDS)
def test_held_gives_the_row_major_bits(kind: str, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(2)
    bits, g, q, s, m, kp = make_weight(kind, gen)
    hq, hs, hm = hold(q, s, m, g)
    x = make_x(max(MS), K, kp, dtype, gen)
    alone = torch.cat([call(bits, x[r:r + 1], hq, hs, hm, g) for r in range(max(MS))])
    for rows in MS:
        want = call(bits, x[:rows], q, s, m, g)
        got = call(bits, x[:rows], hq, hs, hm, g)
        assert torch.equal(got, want), f"{kind} M={rows}: held differs from row-major"
        assert torch.equal(got, alone[:rows]), f"{kind} M={rows}: a row differs from it alone"


def g32_codes(bits: int, q: torch.Tensor, s: torch.Tensor, m: torch.Tensor | None
              ) -> tuple[np.ndarray, np.ndarray | None]:
    """canonical_g32's codes [N, K] (int4: 0..15 in column order) and int4 offsets [N, G]."""
    if bits == 4:
        lo, hi = (q & 15).view(N, -1, 16), (q >> 4).view(N, -1, 16)
        codes = torch.cat([lo, hi], dim=2).reshape(N, -1).numpy()
        return codes, m.float().numpy() if m is not None else (s.float() * -8).numpy()
    return q.numpy(), None


@pytest.mark.parametrize("kind", ["int4-asym-g32", "int4-sym-g32", "int8-g32"])
def test_held_group32_order_is_the_stated_one(kind: str) -> None:
    gen = torch.Generator().manual_seed(3)
    bits, g, q, s, m, _ = make_weight(kind, gen)
    x = make_x(5, K, K, torch.float32, gen)
    codes, offsets = g32_codes(bits, q, s, m)
    want = canonical_g32(x.numpy(), codes, s.float().numpy(), offsets)
    hq, hs, hm = hold(q, s, m, g)
    for rows in (1, 5):  # the GEMV and the panel tiles
        assert np.array_equal(call(bits, x[:rows], hq, hs, hm, g).numpy(), want[:rows])


def test_held_errors_name_the_problem() -> None:
    bits, g, q, s, m, kp = make_weight("int4-asym-g32", torch.Generator().manual_seed(4))
    hq, hs, hm = hold(q, s, m, g)
    x = torch.randn(2, kp)
    with pytest.raises(RuntimeError, match="int8 activations only"):
        call(bits, x, hq, hs, hm, g, act_quant=False)
    with pytest.raises(RuntimeError, match="held scales"):
        torch.ops.fitserve.int4_linear(x, hq, hs[:, :-1].contiguous(), hm, g, True, False)
    lanes = held_layout().lanes
    if lanes > 1:
        with pytest.raises(RuntimeError, match="not a multiple"):
            hold(q[:lanes + 1], s[:lanes + 1], m[:lanes + 1], g)


def test_tier_is_the_one_asked_for() -> None:
    from fitserve.kernels.cpu.qlinear import qlinear_tier

    assert asked_tier() == qlinear_tier()


@pytest.mark.parametrize("tier", ["avx2", "scalar"])
def test_lower_tiers_hold_the_same_bits(tier: str) -> None:
    """The avx2 tier holds 8-row panels, the scalar tier 1-row ones; the avx512 tier differs
    from avx512_vnni only in how the exact int32 dots are formed (and unbiased int8 codes)."""
    run_tests_at_tier(__file__, tier, "tier_is or reads_back or row_major_bits or stated_one")


AMX_MS = (32, 33, 47, 48, 257, 300)  # ragged 16-row tiles, a 256-row chunk boundary


@pytest.mark.parametrize("kind", ["int4-asym-g32", "int4-sym-g32", "int8-g32"])
def test_amx_tiles_give_the_vnni_bits(kind: str) -> None:
    """Where the CPU has AMX-INT8 (qlinear_amx.h): the tiles give every row the bits the VNNI
    panels and the batch-1 GEMV give it, and the stated float order (an odd number of groups:
    the single-group tail)."""
    from fitserve.kernels.cpu.qlinear import amx_active, set_amx

    if not amx_active():
        pytest.skip("no AMX-INT8 tiles here (or FITSERVE_AMX=0): the VNNI panels run every M")
    gen = torch.Generator().manual_seed(5)
    bits, g, q, s, m, kp = make_weight(kind, gen)
    hq, hs, hm = hold(q, s, m, g)
    x = make_x(max(AMX_MS), K, kp, torch.bfloat16, gen)
    try:
        for rows in AMX_MS:
            set_amx(True)
            got = call(bits, x[:rows], hq, hs, hm, g)
            set_amx(False)
            want = call(bits, x[:rows], hq, hs, hm, g)
            assert torch.equal(got, want), f"{kind} M={rows}: AMX differs from the VNNI panels"
    finally:
        set_amx(True)
    xf = x[:33].float()  # 33 rows: two full tiles and a 1-row one
    codes, offsets = g32_codes(bits, q, s, m)
    want = canonical_g32(xf.numpy(), codes, s.float().numpy(), offsets)
    assert np.array_equal(call(bits, xf, hq, hs, hm, g).numpy(), want)
