"""fitserve::moe_experts_ggml (moe_experts.cpp: every active expert of a layer in one call)
against a float64 loop over tokens and their experts.

Weights: random bytes reinterpreted as ggml blocks (test_ggml_blocks.random_blocks: every scale
code, finite fp16 fields), stacked [E, rows, bytes]. The reference dequantizes them with gguf-py
(independent of fitserve) and computes, token by token, ``sum_j w_j * down_e(silu(gate_e x) *
up_e x)`` in float64. Groupings are ragged on purpose: an expert with many tokens, one with a
single token, one with none; all tokens on one expert; tokens on disjoint experts; batch 1.

Bound: the kernel quantizes x per activation block for gate/up and the fp32 SiLU product per
block for down, as ggml_matmul does (test_ggml_blocks' contract). The reference takes x rounded
that way, h = xq @ W64.T in float64, the product silu(g) * u rounded per block the same way,
then down in float64; the kernel may differ by its fp32 sums (test_ggml_blocks' slack) and, where
its fp32 product lies within that slack of a rounding boundary, by one quantum of that element.
Each check also asserts that the outputs with every slot moved to the next expert break the
bound, and compares with the composition of the separately tested ggml_matmul per expert, which
must agree to fp32 rounding.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fitserve.kernels.cpu.ggml_blocks import ggml_matmul
from fitserve.kernels.cpu.moe_experts import (
    MOE_KERNEL_TYPES,
    moe_experts_ggml,
    moe_experts_tier,
    moe_kernel_available,
)
from tests.conftest import asked_tier, run_tests_at_tier, torch_threads
from tests.kernels.test_ggml_blocks import (
    ACT_BLOCK,
    EPS32,
    quantized_x,
    random_blocks,
    reference,
)

if not moe_kernel_available("Q4_K", "Q6_K"):
    pytest.skip("the moe_experts C++ extension could not be built here (no compiler, a failed "
                "build or FITSERVE_DISABLE_CPP=1)", allow_module_level=True)

E, H, INTER = 6, 256, 256


def stack(t: str, rows: int, cols: int, seed: int) -> tuple[torch.Tensor, ...]:
    """uint8 [E, rows, bytes], and W64 and |offsets|64 [E, rows, cols] from gguf-py."""
    blocks = [random_blocks(t, rows, cols, seed + e) for e in range(E)]
    refs = [reference(t, b, rows, cols) for b in blocks]
    return (torch.from_numpy(np.stack(blocks)), torch.stack([w for w, _ in refs]),
            torch.stack([o for _, o in refs]))


def groupings(n: int, k: int) -> dict[str, torch.Tensor]:
    """ids [n, k] per named case (distinct ids per token, as top-k gives; k <= 4)."""
    # ragged: expert 0 on every token, expert 1 on token 0 only, 2-4 on some, E-1 on none
    ragged = [[0, 1, 2, 3][:k]] + [[0, *([2, 3, 4][t % 3:] + [2, 3, 4][: t % 3])][:k]
                                   for t in range(1, n)]
    same = torch.arange(k).repeat(n, 1)  # every token on experts 0 .. k-1
    disjoint = (torch.arange(n * k) % E).view(n, k)  # consecutive tokens, other experts
    return {"ragged": torch.tensor(ragged), "same": same, "disjoint": disjoint}


def expert64(tg: str, td: str, x: torch.Tensor, gu64: torch.Tensor, gu_off: torch.Tensor,
             dn64: torch.Tensor, dn_off: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(one expert's output on the rows of x [n, H], in float64 from the kernel's rounded
    inputs, and the bound on the kernel's distance from it), both [n, H]."""
    xq = quantized_x(tg, x)  # x as the kernel rounds it (the ggml test's contract)
    h64 = xq @ gu64.T
    dh = (H / 16 + 64) * EPS32 * (xq.abs() @ (gu64.abs() + 2 * gu_off).T)
    g, u, dg, du = h64[:, :INTER], h64[:, INTER:], dh[:, :INTER], dh[:, INTER:]
    act = F.silu(g) * u
    dact = 1.1 * dg * (u.abs() + du) + (F.silu(g).abs() + 1.1 * dg) * du + 1e-6 * act.abs()
    # the product rounded per block as the kernel does; where the kernel's fp32 product may sit
    # across a rounding boundary (within its error of one), one quantum more
    n, ab = x.shape[0], ACT_BLOCK[td]
    amax = act.abs().view(n, -1, ab).amax(-1).repeat_interleave(ab, 1)
    damax = dact.view(n, -1, ab).amax(-1).repeat_interleave(ab, 1)
    d = amax / 127
    r = torch.where(d > 0, act / d.clamp_min(1e-300), torch.zeros_like(act))
    q = torch.round(r)
    margin = (dact + r.abs() * damax / 127) / d.clamp_min(1e-300) + 1e-6
    risky = ((r - r.floor() - 0.5).abs() < margin).double()
    step = q.abs() * damax / 127 + risky * (d + damax / 127)
    wabs = dn64.abs()
    slack = (INTER / 16 + 64) * EPS32 * (((q * d).abs() + step) @ (wabs + 2 * dn_off).T)
    return (q * d) @ dn64.T, step @ wabs.T + slack


def check(tg: str, td: str, n: int, k: int, dtype: torch.dtype, seed: int) -> None:
    gu, gu64, gu_off = stack(tg, 2 * INTER, H, seed)
    dn, dn64, dn_off = stack(td, H, INTER, seed + 100)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, H, generator=gen).to(dtype)
    w = torch.rand(n, k, generator=gen)
    # every expert on every token: float64 outputs and bounds, and the per-expert composition
    # of the separately tested ggml_matmul (h, the SiLU product in fp32, down)
    per = [expert64(tg, td, x, gu64[e], gu_off[e], dn64[e], dn_off[e]) for e in range(E)]
    out64 = torch.stack([o for o, _ in per])  # [E, n, H]
    bound64 = torch.stack([b for _, b in per])
    hk = [ggml_matmul(x, gu[e], tg, 2 * INTER, H) for e in range(E)]
    composed_e = torch.stack([ggml_matmul(F.silu(h[:, :INTER]) * h[:, INTER:], dn[e], td, H,
                                          INTER) for e, h in enumerate(hk)])
    rows = torch.arange(n).unsqueeze(1)
    for case, ids in groupings(n, k).items():
        y = moe_experts_ggml(x, ids, w, gu, tg, dn, td)
        assert y.dtype == torch.float32 and y.shape == (n, H)
        wk = w.double().unsqueeze(-1)
        ref = (wk * out64[ids, rows]).sum(1)  # [n, k, H] -> [n, H], token by token
        tol = (wk * bound64[ids, rows]).sum(1)
        wrong = (wk * out64[(ids + 1) % E, rows]).sum(1)  # every slot on the next expert
        composed = (w.unsqueeze(-1) * composed_e[ids, rows]).sum(1)
        err = (y.double() - ref).abs()
        worst = (err / tol.clamp_min(1e-300)).max().item()
        label = f"{tg}/{td} n={n} k={k} {case}"
        assert worst <= 1.0, f"{label}: error exceeds the bound by {worst:.3g}x"
        assert ((y.double() - wrong).abs() > tol).any(), f"{label}: the bound misses a swap"
        scale = composed.abs().amax().item()
        torch.testing.assert_close(y, composed, rtol=1e-4, atol=1e-5 * scale, msg=label)


@pytest.mark.parametrize("n, k", [(1, 4), (6, 2), (19, 3)])
def test_q4k_q6k_matches_float64(n: int, k: int) -> None:
    """Q4_K gate/up with Q6_K down (a Q4_K_M file's experts): batch 1, a few tokens, and more
    than a row tile (8) on one expert."""
    check("Q4_K", "Q6_K", n, k, torch.bfloat16, seed=n * 7 + k)


@pytest.mark.parametrize("t", MOE_KERNEL_TYPES)
def test_every_type_matches_float64(t: str) -> None:
    check(t, t, 5, 2, torch.float32, seed=11)


def test_inactive_experts_are_not_read() -> None:
    """Batch 1: the experts the token did not pick hold NaN scales; a kernel that used any of
    their bytes would give NaN."""
    gu, _, _ = stack("Q4_K", 2 * INTER, H, 1)
    dn, _, _ = stack("Q6_K", H, INTER, 2)
    ids = torch.tensor([[3, 1]])
    for e in (0, 2, 4, 5):
        gu[e].view(2 * INTER, -1, 144)[:, :, 0:4] = 0xFF  # d, dmin: fp16 NaN
        dn[e].view(H, -1, 210)[:, :, 208:210] = 0xFF
    y = moe_experts_ggml(torch.randn(1, H), ids, torch.tensor([[0.6, 0.4]]), gu, "Q4_K", dn,
                         "Q6_K")
    assert y.isfinite().all()


@pytest.mark.parametrize("n, k, case", [(7, 2, "ragged"), (1, 4, "same"), (19, 3, "same")])
def test_thread_counts_give_the_same_bits(n: int, k: int, case: str) -> None:
    """Both ways the op shares out the rows give the same bits at 1, 2 and 3 threads: whole
    experts per thread where that splits evenly (batch 1 k=4 at 2 threads, 19 tokens on 3
    experts at 3) and chunk spans starting mid-expert otherwise (ragged; k=4 at 3 threads):
    every output is still one tile's work in one order. With
    ``out_x_dtype`` the bf16 result is the fp32 one rounded (decode_layers' MoE block)."""
    gu, _, _ = stack("Q4_K", 2 * INTER, H, 3)
    dn, _, _ = stack("Q6_K", H, INTER, 4)
    x, ids = torch.randn(n, H), groupings(n, k)[case]
    w = torch.rand(n, k)
    outs = []
    for threads in (1, 2, 3):
        with torch_threads(threads):
            # NOTE: another call first, so scratch a split left unwritten holds other values
            moe_experts_ggml(-x, ids, w, gu, "Q4_K", dn, "Q6_K")
            outs.append(moe_experts_ggml(x, ids, w, gu, "Q4_K", dn, "Q6_K"))
            # the sum rounded in the op: the same bits as rounding the fp32 result
            xb = x.bfloat16()
            got = moe_experts_ggml(xb, ids, w, gu, "Q4_K", dn, "Q6_K", out_x_dtype=True)
            assert got.dtype == torch.bfloat16
            assert torch.equal(got, moe_experts_ggml(xb, ids, w, gu, "Q4_K", dn, "Q6_K").bfloat16())
    assert all(torch.equal(outs[0], o) for o in outs[1:])


def test_bad_arguments_raise() -> None:
    gu, _, _ = stack("Q4_K", 2 * INTER, H, 5)
    dn, _, _ = stack("Q6_K", H, INTER, 6)
    x, ids, w = torch.randn(2, H), torch.tensor([[0, 1], [1, 2]]), torch.rand(2, 2)
    with pytest.raises(ValueError, match="no kernel for GGML type 'Q2_K'"):
        moe_experts_ggml(x, ids, w, gu, "Q2_K", dn, "Q6_K")
    with pytest.raises(ValueError, match="down must be uint8"):
        moe_experts_ggml(x, ids, w, gu, "Q4_K", dn, "Q4_K")
    with pytest.raises(ValueError, match="ids must be int64"):
        moe_experts_ggml(x, ids.int(), w, gu, "Q4_K", dn, "Q6_K")
    with pytest.raises(RuntimeError, match="expert id 6 out of range"):
        moe_experts_ggml(x, torch.tensor([[0, 6], [1, 2]]), w, gu, "Q4_K", dn, "Q6_K")
    assert moe_experts_ggml(x[:0], ids[:0], w[:0], gu, "Q4_K", dn, "Q6_K").shape == (0, H)
    assert list(torch.ops.fitserve.moe_experts_types()) == list(MOE_KERNEL_TYPES)


def test_tier_is_the_one_asked_for() -> None:
    assert asked_tier() == moe_experts_tier()


@pytest.mark.slow
@pytest.mark.parametrize("tier", ["avx2", "scalar", "avx512"])
def test_lower_tiers_match_float64(tier: str) -> None:
    """The tiers below this CPU's own, built with FITSERVE_CPU_TIER, pass the same tests."""
    run_tests_at_tier(__file__, tier, "tier_is or matches_float64 or not_read")
