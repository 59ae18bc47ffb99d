"""SmoothQuant-style W8A8 (fitserve.tools.quantize.smoothquant), against float64 references.

- the integer GEMM is exact (torch._int_mm and the float64-of-codes fallback);
- per-token x per-output-channel W8A8 equals the dequantize-then-float64 product: the two
  scales leave the integer sum, so the epilogue ``outer(sx, sw)`` is exact;
- per-INPUT-channel activation scales cannot: the least-squares best rank-1 rescale of the
  integer GEMM stays far off, while dequantize-then-float is exact;
- on a tiny random Llama with injected outlier channels (the float function unchanged),
  smoothing cuts W8A8's layer-output and logits errors by a clear factor, down to about the
  error W8A8 has on the model without outliers.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from fitserve.tools.quantize import smoothquant as sq
from fitserve.tools.quantize.smoothquant import (
    best_rank1_rescale,
    calibrate_amax,
    inject_outliers_,
    int_gemm,
    norm_groups,
    per_channel_rescale_error,
    quantize_rows,
    smooth_model_,
    smoothing_factors,
    to_w8a8_,
    w8a8_matmul,
)
from tests.conftest import tiny_hf_config

OUTLIERS, FACTORS = (5, 17, 42), (60.0, 80.0, 100.0)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("use_int_mm", [True, False])
def test_int_gemm_is_exact(use_int_mm: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if use_int_mm and not sq.int_mm_available():
        pytest.skip("torch._int_mm does not run here")
    monkeypatch.setattr(sq, "int_mm_available", lambda: use_int_mm)
    g = torch.Generator().manual_seed(0)
    for m, k, n in ((1, 64, 40), (17, 576, 96), (5, 4096, 8)):
        a = torch.randint(-127, 128, (m, k), dtype=torch.int8, generator=g)
        b = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
        a[0] = 127  # the largest sums: all-extreme rows
        b[0] = -127
        assert torch.equal(int_gemm(a, b), a.long() @ b.long().t())


def test_w8a8_per_token_per_channel_epilogue_is_exact() -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(24, 256, generator=g, dtype=torch.float64)
    w = torch.randn(48, 256, generator=g, dtype=torch.float64) * 0.05
    xq, sx = quantize_rows(x)
    wq, sw = quantize_rows(w)
    y = w8a8_matmul(x, wq, sw)
    deq = (xq.double() * sx.double().unsqueeze(1)) @ (wq.double() * sw.double().unsqueeze(1)).t()
    assert _rel(y, deq) < 1e-13
    # each element's error is within half a step: |x - q sx| <= sx / 2
    assert bool(((x - xq.double() * sx.double().unsqueeze(1)).abs()
                 <= sx.double().unsqueeze(1) / 2 * (1 + 1e-12)).all())
    assert _rel(y, x @ w.t()) < 0.02


def test_best_rank1_rescale_recovers_a_rescalable_product() -> None:
    g = torch.Generator().manual_seed(2)
    gm = torch.randint(-2000, 2000, (16, 12), generator=g).double()
    r, c = torch.rand(16, generator=g, dtype=torch.float64) + 0.5, torch.rand(12, generator=g,
                                                                               dtype=torch.float64)
    y = torch.outer(r, c) * gm
    assert _rel(best_rank1_rescale(gm, y), y) < 1e-10


def test_per_input_channel_activation_scales_do_not_fit_an_integer_gemm() -> None:
    """y_ik = sum_j (a_ij sx_j)(b_kj sw_k): sx_j is inside the sum over j, so no factor of i
    and k turns G = a @ b.T into y (numbers: ~88% error for the best rank-1 rescale)."""
    g = torch.Generator().manual_seed(3)
    channel_scale = torch.exp(torch.randn(256, generator=g, dtype=torch.float64) * 1.5)
    x = torch.randn(64, 256, generator=g, dtype=torch.float64) * channel_scale
    w = torch.randn(96, 256, generator=g, dtype=torch.float64)
    proof = per_channel_rescale_error(x, w)
    assert proof.dequant_float < 1e-6  # dequantize, then a float32 GEMM: exact up to rounding
    assert proof.best_rescale > 0.5
    assert proof.naive_rescale > proof.best_rescale * 0.99


def test_smoothing_factors_formula() -> None:
    act, wt = torch.tensor([4.0, 1.0, 9.0]), torch.tensor([1.0, 4.0, 0.25])
    assert torch.allclose(smoothing_factors(act, wt, 0.5), torch.tensor([2.0, 0.5, 6.0]).double())
    assert torch.allclose(smoothing_factors(act, wt, 1.0), act.double())
    assert torch.allclose(smoothing_factors(act, wt, 0.0), 1 / wt.double())
    with pytest.raises(ValueError, match="alpha"):
        smoothing_factors(act, wt, 1.5)


def _tiny_llama() -> nn.Module:
    tf = pytest.importorskip("transformers")
    torch.manual_seed(0)
    return tf.LlamaForCausalLM(tiny_hf_config("llama")).double().eval()


def _forward(model: nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
    return out.logits, out.hidden_states[1]  # logits, first decoder layer's output


def _w8a8_errors(model: nn.Module, ids: torch.Tensor) -> tuple[float, float]:
    logits, layer = _forward(model, ids)
    sim = copy.deepcopy(model)
    assert to_w8a8_(sim) == 14  # 7 linears x 2 layers, lm_head kept
    q_logits, q_layer = _forward(sim, ids)
    return _rel(q_layer, layer), _rel(q_logits, logits)


def test_smoothquant_cuts_w8a8_error_on_injected_outliers() -> None:
    g = torch.Generator().manual_seed(4)
    calib, ids = (torch.randint(3, 320, (4, 32), generator=g) for _ in range(2))
    model = _tiny_llama()
    clean_layer, clean_logits = _w8a8_errors(model, ids)
    float_logits, _ = _forward(model, ids)
    inject_outliers_(model, OUTLIERS, FACTORS)
    assert _rel(_forward(model, ids)[0], float_logits) < 1e-12  # the float function unchanged
    norm_out = model.model.layers[0].input_layernorm.weight.detach()
    assert float(norm_out[list(OUTLIERS)].min()) >= 60.0

    raw_layer, raw_logits = _w8a8_errors(model, ids)
    smoothed = copy.deepcopy(model)
    s = smooth_model_(smoothed, calibrate_amax(model, lambda: model(calib)))
    assert set(s) == {g.name for g in norm_groups(model)} and len(s) == 4
    assert _rel(_forward(smoothed, ids)[0], float_logits) < 1e-12
    sm_layer, sm_logits = _w8a8_errors(smoothed, ids)
    print(f"\nW8A8 rel. error  layer-0 output  logits\n  no outliers    {clean_layer:.4f}"
          f"  {clean_logits:.4f}\n  outliers       {raw_layer:.4f}  {raw_logits:.4f}\n"
          f"  + smoothing    {sm_layer:.4f}  {sm_logits:.4f}")
    assert raw_layer > 10 * sm_layer
    assert raw_logits > 10 * sm_logits
    assert sm_logits < 2 * clean_logits  # smoothing gives back about the outlier-free error


def test_smoothing_folds_into_fitserve_fused_projections() -> None:
    from fitserve.loading.hf_config import spec_from_hf_config
    from fitserve.model.llama import CausalLM

    torch.manual_seed(0)
    spec = spec_from_hf_config(tiny_hf_config("llama").to_dict())
    layer = CausalLM(spec, 64).layers[0].float()
    x = torch.randn(16, spec.hidden_size)

    def run() -> torch.Tensor:
        return torch.cat((layer.self_attn.qkv_proj(layer.input_layernorm(x)),
                          layer.mlp.gate_up_proj(layer.post_attention_layernorm(x))), 1)

    groups = norm_groups(layer)
    assert [len(g.linears) for g in groups] == [1, 1]  # fused qkv_proj, gate_up_proj
    with torch.no_grad():
        before = run()
        inject_outliers_(layer, OUTLIERS, FACTORS)
        smooth_model_(layer, calibrate_amax(layer, run))
        after = run()
    assert _rel(after, before) < 1e-5
    assert float(layer.input_layernorm.weight.detach().abs().max()) < 10  # outliers migrated
