"""GPTQ against RTN and against a naive float64 reference (OBS with an explicit inverse).

The reference re-inverts the Hessian of the columns still free after every step (the OBQ form
of the update, O(K^4)), never a Cholesky factor and never blocks; the module's blocked Cholesky
pass must give the same codes.
"""

from __future__ import annotations

import pytest
import torch

from fitserve.quant.packed import PackedWeight, check_packed, dequantize, unpack
from fitserve.quant.rtn import quantize_int4, quantize_int8
from fitserve.tools.quantize.gptq import gptq_quantize, gptq_quantize_weights, group_params

# small tensors: one thread keeps these quick (tests/conftest.py one_thread)
pytestmark = pytest.mark.usefixtures("one_thread")


CASES = [(4, 32, False), (4, 64, True), (4, 128, False), (4, 32, True), (8, 32, True),
         (8, None, True)]


def _rtn(w: torch.Tensor, bits: int, group: int | None, sym: bool) -> PackedWeight:
    if bits == 4:
        assert group is not None
        return quantize_int4(w, group, symmetric=sym)
    return quantize_int8(w, group)


def _correlated(n: int, k: int, rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(W [n, k], X [rows, k]) with strongly correlated, unevenly scaled input channels."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(k, k, generator=g, dtype=torch.float64) / k**0.5
    x = torch.randn(rows, k, generator=g, dtype=torch.float64) @ (torch.eye(k) + 2 * mix)
    x *= torch.rand(k, generator=g, dtype=torch.float64) * 3 + 0.2
    w = torch.randn(n, k, generator=g) * 0.05
    return w, x


def _ref_codes(w: torch.Tensor, scale: torch.Tensor, mins: torch.Tensor | None,
               bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes and engine dequantization of one float64 column, written out per format."""
    s = scale.double()
    if bits == 8:
        q = torch.where(s > 0, torch.round(w / s), torch.zeros_like(w)).clamp(-127, 127)
        return q, (q.float() * scale.float()).double()
    if mins is None:
        q = torch.where(s > 0, torch.round(w / s).clamp(-8, 7) + 8, torch.full_like(w, 8.0))
        return q, (scale.float() * (q.float() - 8)).double()
    q = torch.where(s > 0, torch.round((w - mins.double()) / s), torch.zeros_like(w))
    q = q.clamp(0, 15)
    return q, (scale.float() * q.float() + mins.float()).double()


def reference_gptq(w: torch.Tensor, hess: torch.Tensor, bits: int, group: int | None, sym: bool,
                   damp: float, act_order: bool) -> torch.Tensor:
    """Naive GPTQ codes [N, K] (original column order), unblocked, float64."""
    n, k = w.shape
    W = w.double().clone()
    H = hess.double().clone()
    dead = torch.diagonal(H) == 0
    H[dead, dead] = 1.0
    W[:, dead] = 0.0
    H += torch.eye(k, dtype=torch.float64) * damp * torch.diagonal(H).mean()
    g = group if group is not None else 10**9
    per_channel = bits == 8 and group is None
    gsize = group or 32 * -(-k // 32)
    static = act_order or per_channel
    params = {j: group_params(W[:, j * g:(j + 1) * g], bits, gsize, sym, per_channel)
              for j in range(-(-k // g))} if static else {}
    order = torch.argsort(torch.diagonal(H), descending=True, stable=True).tolist() if (
        act_order) else list(range(k))
    free = list(order)
    codes = torch.zeros(n, k, dtype=torch.float64)
    for col in order:
        if not static and col % g == 0:
            params[col // g] = group_params(W[:, col:col + g], bits, gsize, sym, per_channel)
        hinv = torch.linalg.inv(H[free][:, free])  # the free columns' inverse Hessian
        grid = params[col // g]
        q, w_hat = _ref_codes(W[:, col], grid.scale, grid.mins, bits)
        codes[:, col] = q
        delta = (W[:, col] - w_hat) / hinv[0, 0]
        W[:, free] -= torch.outer(delta, hinv[0])
        free.pop(0)
    return codes


def _codes(pw: PackedWeight) -> torch.Tensor:
    return unpack(pw)[0][:, : pw.K].to(torch.float64)


@pytest.mark.parametrize("bits,group,sym", CASES)
@pytest.mark.parametrize("act_order", [False, True])
def test_diagonal_hessian_equals_rtn(bits: int, group: int | None, sym: bool,
                                     act_order: bool) -> None:
    g = torch.Generator().manual_seed(1)
    w = torch.randn(24, 200, generator=g) * torch.rand(200, generator=g)
    hess = torch.diag(torch.rand(200, generator=g, dtype=torch.float64) * 10 + 0.1)
    got = gptq_quantize(w, hess, bits=bits, group_size=group, symmetric=sym, act_order=act_order)
    want = _rtn(w, bits, group, sym)
    for name, t in want.tensors().items():
        assert torch.equal(got.tensors()[name], t), name
    assert got.format == want.format


@pytest.mark.parametrize("bits,group,sym", CASES)
@pytest.mark.parametrize("act_order", [False, True])
def test_blocked_matches_naive_reference(bits: int, group: int | None, sym: bool,
                                         act_order: bool) -> None:
    # K = 100: a short last group (padding); block 40: groups straddle blocks
    w, x = _correlated(12, 100, 400, seed=2)
    hess = x.T @ x
    got = gptq_quantize(w, hess, bits=bits, group_size=group, symmetric=sym,
                        act_order=act_order, block_size=40, dtype=torch.float64)
    want = reference_gptq(w, hess, bits, group, sym, 0.01, act_order)
    assert torch.equal(_codes(got), want)
    # the default float32 working precision: a rare code one step off, near a rounding tie
    fast = _codes(gptq_quantize(w, hess, bits=bits, group_size=group, symmetric=sym,
                                act_order=act_order, block_size=40))
    assert float((fast != want).float().mean()) < 0.01
    assert float((fast - want).abs().max()) <= 1
    other = gptq_quantize(w, hess, bits=bits, group_size=group, symmetric=sym,
                          act_order=act_order, block_size=128, dtype=torch.float64)
    assert torch.equal(other.qweight, got.qweight) and torch.equal(other.scales, got.scales)


@pytest.mark.parametrize("bits,group,sym", CASES)
@pytest.mark.parametrize("act_order", [False, True])
def test_lower_output_error_than_rtn(bits: int, group: int | None, sym: bool,
                                     act_order: bool) -> None:
    w, x = _correlated(64, 256, 2048, seed=3)
    pw = gptq_quantize(w, x.T @ x, bits=bits, group_size=group, symmetric=sym,
                       act_order=act_order)
    check_packed(pw)
    q = unpack(pw)[0]
    lo, hi = (0, 15) if bits == 4 else (-127, 127)
    assert int(q.min()) >= lo and int(q.max()) <= hi

    def err(p: PackedWeight) -> float:
        return float(torch.linalg.norm(x @ (w.double() - dequantize(p).double()).T))

    rtn = err(_rtn(w, bits, group, sym))
    assert err(pw) < 0.8 * rtn, (err(pw), rtn)


def test_dead_columns_and_padding() -> None:
    w, x = _correlated(8, 100, 400, seed=4)
    x[:, [3, 50]] = 0.0
    pw = gptq_quantize(w, x.T @ x, bits=4, group_size=64, symmetric=False)
    w_hat = dequantize(pw)
    assert bool(torch.isfinite(w_hat).all())
    # a dead column is quantized as a zero weight (RTN's code for 0 in that group)
    zero_col = w.clone()
    zero_col[:, [3, 50]] = 0.0
    group0 = quantize_int4(zero_col[:, :64], 64)
    assert torch.equal(w_hat[:, 3], dequantize(group0)[:, 3])
    assert pw.K_padded == 128 and pw.format == "int4-g64-asym"


def test_argument_errors() -> None:
    w = torch.randn(4, 64)
    h = torch.eye(64, dtype=torch.float64)
    with pytest.raises(ValueError, match="bits"):
        gptq_quantize(w, h, bits=3, group_size=32, symmetric=True)
    with pytest.raises(ValueError, match="group size"):
        gptq_quantize(w, h, bits=4, group_size=48, symmetric=True)
    with pytest.raises(ValueError, match="Hessian"):
        gptq_quantize(w, h[:32, :32], bits=4, group_size=32, symmetric=True)
    with pytest.raises(ValueError, match="symmetric"):
        gptq_quantize(w, h, bits=8, group_size=32, symmetric=False)


def test_weights_driver_splits_shared_inputs() -> None:
    from fitserve.tools.quantize.stats import LinearStats

    w, x = _correlated(40, 96, 300, seed=5)
    stats = LinearStats(hessian=x.T @ x, rows=300, abs_mean=x.abs().mean(0).float(),
                        sample=x[:64].float())
    weights = {"a.q_proj.weight": w[:16], "a.k_proj.weight": w[16:24],
               "a.v_proj.weight": w[24:], "a.norm.weight": torch.ones(96)}
    out = gptq_quantize_weights(weights, {k: stats for k in list(weights)[:3]}, bits=4,
                                group_size=32, symmetric=False)
    assert set(out) == set(list(weights)[:3])
    for name in out:
        alone = gptq_quantize(weights[name], stats.hessian, bits=4, group_size=32,
                              symmetric=False)
        assert torch.equal(out[name].qweight, alone.qweight), name
        assert torch.equal(out[name].scales, alone.scales), name
