"""Batch invariance of fitserve::int4_linear / int8_linear: row r of a call with M rows is
bit-identical to the call on that row alone, for every M, format and ISA tier.

- act_quant=True (the default model's path): every M (the few-row kernel, the panels with their
  row tiles) adds the same rounded terms in one order (qlinear_rows.h). The group-32 order is
  also checked against a numpy reimplementation of that order, so the claim is about a stated
  order, not only about the kernels agreeing with each other.
- act_quant=False with batch_invariant=True: register tiles for every M (no at::mm).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fitserve.kernels.cpu.qlinear import int4_linear, int8_linear, qlinear_ops_available
from tests.conftest import asked_tier, run_tests_at_tier

if not qlinear_ops_available():
    pytest.skip("the qlinear C++ extension could not be built here", allow_module_level=True)

from tests.kernels.test_qlinear_cpp import make_int4, make_int8, make_x  # noqa: E402

MS = (1, 2, 3, 4, 5, 8, 16, 17, 33, 64, 300)
N, K = 37, 352  # ragged N; 11 groups of 32: a partial chunk and a partial span
KINDS = ["int4-asym-g32", "int4-sym-g32", "int4-asym-g64", "int4-sym-g128", "int8-g32",
         "int8-g64", "int8-channel"]


def make_op(kind: str, gen: torch.Generator, act_quant: bool, invariant: bool):  # type: ignore[no-untyped-def]
    """(run(x) -> y, padded K) for a random packed weight of ``kind``."""
    if kind.startswith("int4"):
        g = int(kind.split("-g")[1])
        qw, sc, mn, w64 = make_int4(N, K, g, "asym" in kind, gen)
        return (lambda x: int4_linear(x, qw, sc, mn, g, act_quant, invariant)), w64.shape[1]
    g8 = None if kind == "int8-channel" else int(kind.split("-g")[1])
    q8, s8, g, w64 = make_int8(N, K, g8, gen)
    return (lambda x: int8_linear(x, q8, s8, g, act_quant, invariant)), w64.shape[1]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("mode", ["aq", "f32-invariant"])
@pytest.mark.parametrize("kind", KINDS)
def test_rows_equal_the_row_alone(kind: str, mode: str, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(11)
    run, kp = make_op(kind, gen, mode == "aq", mode == "f32-invariant")
    x = make_x(max(MS), K, kp, dtype, gen)
    alone = torch.cat([run(x[r:r + 1]) for r in range(max(MS))])
    for m in MS:
        y = run(x[:m])
        bad = (y != alone[:m]).any(dim=1).nonzero().flatten().tolist()
        assert not bad, f"{kind} {mode} M={m}: rows {bad[:5]} differ from the row alone"


def canonical_g32(x: np.ndarray, codes: np.ndarray, scales: np.ndarray,
                  offsets: np.ndarray | None) -> np.ndarray:
    """The stated order in numpy fp32: y = sum over groups, in order, of
    fl(I_g * fl(d_g * da_g)) [+ fl(c_g * S_g)]; x quantized per 32 columns (absmax / 127,
    round half to even). codes [N, K] (int4: 0..15 with offsets c [N, G]; int8: signed)."""
    f32 = np.float32
    blocks = x.astype(f32).reshape(x.shape[0], -1, 32)
    amax = np.abs(blocks).max(-1)
    inv = np.where(amax > 0, f32(127) / np.where(amax > 0, amax, 1), f32(0)).astype(f32)
    aq = np.clip(np.rint(blocks * inv[..., None]), -127, 127).astype(np.int64)
    da = (amax / f32(127)).astype(f32)
    cb = codes.reshape(codes.shape[0], -1, 32).astype(np.int64)
    dot = np.einsum("mgk,ngk->mng", aq, cb)  # exact int dots [M, N, G]
    terms = (dot.astype(f32) * (scales[None].astype(f32) * da[:, None, :]).astype(f32)).astype(f32)
    if offsets is not None:
        s_g = (da * aq.sum(-1).astype(f32)).astype(f32)  # [M, G]
        terms = (terms + (offsets[None].astype(f32) * s_g[:, None, :]).astype(f32)).astype(f32)
    y = np.zeros(terms.shape[:2], dtype=f32)
    for g in range(terms.shape[2]):
        y = (y + terms[:, :, g]).astype(f32)
    return y


@pytest.mark.parametrize("kind", ["int4-asym-g32", "int4-sym-g32", "int8-g32"])
def test_group32_order_is_the_stated_one(kind: str) -> None:
    gen = torch.Generator().manual_seed(12)
    x = make_x(5, K, K, torch.float32, gen)
    if kind.startswith("int4"):
        asym = "asym" in kind
        qw, sc, mn, w64 = make_int4(N, K, 32, asym, gen)
        lo, hi = (qw & 15).view(N, -1, 16), (qw >> 4).view(N, -1, 16)
        codes = torch.cat([lo, hi], dim=2).reshape(N, -1).numpy()
        offsets = mn.float().numpy() if asym else (sc.float() * -8).numpy()
        run = lambda x: int4_linear(x, qw, sc, mn, 32, True)  # noqa: E731
    else:
        q8, sc, _, w64 = make_int8(N, K, 32, gen)
        codes, offsets = q8.numpy(), None
        run = lambda x: int8_linear(x, q8, sc, 32, True)  # noqa: E731
    want = canonical_g32(x.numpy(), codes, sc.float().numpy(), offsets)
    for m in (1, 5):  # the few-row kernel and the panels
        assert np.array_equal(run(x[:m]).numpy(), want[:m]), (kind, m)


def test_tier_is_the_one_asked_for() -> None:
    from fitserve.kernels.cpu.qlinear import qlinear_tier

    assert asked_tier() == qlinear_tier()


@pytest.mark.slow
@pytest.mark.parametrize("tier", ["avx2", "scalar"])
def test_lower_tiers_are_batch_invariant(tier: str) -> None:
    """The AVX2 (8 lanes) and scalar (panels for every M) builds pass the same checks; the
    avx512 tier differs from avx512_vnni only in how the exact int32 dots are formed."""
    run_tests_at_tier(__file__, tier, "tier_is or rows_equal or stated_one")
