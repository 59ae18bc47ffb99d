"""The per-matrix sensitivity sweep (fitserve.tools.eval.sensitivity) on a tiny random-weight model:
units, in-place quantization and exact restore, ranking, mixes, and the ledger's price."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from fitserve.ledger.flops import prefill_flops
from fitserve.ledger.hardware import get_hardware
from fitserve.ledger.params import count_params
from fitserve.loading import load_model
from fitserve.model.llama import CausalLM
from fitserve.model.loader import build_model
from fitserve.quant.packed import dequantize
from fitserve.quant.rtn import quantize, quantize_int4
from fitserve.tools.eval.eval import BootstrapConfig
from fitserve.tools.eval.sensitivity import (
    MATRICES,
    matrix_rows,
    price_sweep,
    quantized,
    run_sweep,
    sweep_dict,
    sweep_units,
)
from fitserve.tools.planner.model_source import catalog_entry

FAST = BootstrapConfig(block_len=8, resamples=200, seed=0)


@pytest.fixture()
def tiny(tiny_hf_model_dir: Callable[..., Any]) -> CausalLM:
    loaded = load_model(tiny_hf_model_dir("llama", initializer_range=0.2), torch.float32)
    return build_model(loaded.spec, loaded.weights, dtype=torch.float32, device="cpu",
                       max_positions=128)


def _state(model: CausalLM) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_units_of_each_granularity() -> None:
    m = sweep_units(3, "matrix")
    assert len(m) == 21 and m[0].name == "L0.q_proj" and m[-1].parts == ((2, "down_proj"),)
    layer = sweep_units(3, "layer")
    assert [u.name for u in layer] == ["L0", "L1", "L2"] and len(layer[1].parts) == 7
    kinds = sweep_units(3, "type")
    assert [u.name for u in kinds] == list(MATRICES) and kinds[6].parts[2] == (2, "down_proj")
    with pytest.raises(ValueError, match="granularity"):
        sweep_units(3, "head")


def test_matrix_rows_tile_the_fused_weights(tiny: CausalLM) -> None:
    spec = tiny.spec
    qkv = sorted(matrix_rows(spec, m)[1:] for m in ("q_proj", "k_proj", "v_proj"))
    assert qkv == [(0, spec.q_size), (spec.q_size, spec.q_size + spec.kv_size),
                   (spec.q_size + spec.kv_size, spec.q_size + 2 * spec.kv_size)]
    assert tiny.layers[0].self_attn.qkv_proj.weight.shape[0] == spec.q_size + 2 * spec.kv_size
    inter = spec.intermediate_size
    assert matrix_rows(spec, "up_proj") == ("mlp.gate_up_proj", inter, 2 * inter)
    assert matrix_rows(spec, "down_proj") == ("mlp.down_proj", 0, None)


def test_quantized_touches_only_its_rows_and_restores_exactly(tiny: CausalLM) -> None:
    before = _state(tiny)
    spec = tiny.spec
    q, kv = spec.q_size, spec.kv_size
    with quantized(tiny, ((1, "k_proj"),), "int4-g32-asym") as n:
        assert n == kv * spec.hidden_size
        now = tiny.state_dict()
        changed = [k for k in before if not torch.equal(before[k], now[k])]
        assert changed == ["layers.1.self_attn.qkv_proj.weight"]
        w0, w1 = before[changed[0]], now[changed[0]]
        assert torch.equal(w1[:q], w0[:q]) and torch.equal(w1[q + kv:], w0[q + kv:])
        want = dequantize(quantize_int4(w0[q:q + kv], 32), torch.float32)
        assert torch.equal(w1[q:q + kv], want)
    after = tiny.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_sweep_ranks_units_and_measures_mixes(tiny: CausalLM) -> None:
    before = _state(tiny)
    tokens = torch.randint(tiny.spec.vocab_size, (96,), generator=torch.Generator().manual_seed(1))
    seen: list[str] = []
    res = run_sweep(tiny, tiny.spec, tokens.tolist(), granularity="matrix", fmt="int4-g32-asym",
                    window=64, chunk_size=32, mix_sizes=(2, 14, 99), cfg=FAST,
                    progress=lambda i, n, name: seen.append(name))
    assert len(res.ranked) == 14 and len(seen) == 14 and res.num_positions == 95
    kls = [d.kl.mean for d in res.ranked]
    assert kls == sorted(kls, reverse=True) and all(k > 0 for k in kls)
    assert all(d.kl.lo <= d.kl.mean <= d.kl.hi for d in res.ranked)
    assert [len(m.units) for m in res.mixes] == [2, 14]  # 99 > 14 units: skipped
    top2 = res.mixes[0]
    assert top2.units == tuple(d.unit.name for d in res.ranked[:2])
    assert top2.kl_sum == pytest.approx(res.ranked[0].kl.mean + res.ranked[1].kl.mean)
    assert top2.kl_mix.mean > res.ranked[0].kl.mean  # two damaged matrices hurt more than one
    assert res.cost.passes == 1 + 14 + 2 and res.cost.tokens == 96 and res.cost.seconds > 0
    after = tiny.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # the model is back as it was
    d = sweep_dict(res, top=3)
    assert len(d["ranked"]) == 3 and d["mixes"][1]["units"] == [u.unit.name for u in res.ranked]


def test_sweep_rejects_a_packed_model(tiny_hf_model_dir: Callable[..., Any]) -> None:
    loaded = load_model(tiny_hf_model_dir("llama"), torch.float32, weights="int8")
    model = build_model(loaded.spec, loaded.weights, dtype=torch.float32, device="cpu",
                        max_positions=64)
    with pytest.raises(ValueError, match="not held dense"), quantized(model, ((0, "o_proj"),)):
        pass


def test_price_from_the_ledger() -> None:
    small = catalog_entry("SmolLM2-135M").spec
    cost = price_sweep(small, "matrix", 1500, window=1024, num_mixes=3, gpu="h100", mfu=0.5)
    assert (cost.units, cost.passes) == (30 * 7, 30 * 7 + 1 + 3)
    big = catalog_entry("Llama-3.3-70B").spec
    per_pass = (prefill_flops(big, 1024, logit_positions=1024).total
                + prefill_flops(big, 476, logit_positions=476).total)
    assert (cost.big_units, cost.big_passes) == (80 * 7, 80 * 7 + 1 + 3)
    assert cost.big_flops == (80 * 7 + 4) * per_pass
    peak = get_hardware("h100").bf16_flops
    assert cost.big_gpu_hours == pytest.approx(cost.big_flops / (peak * 0.5) / 3600)
    # sanity: about 2 x matmul parameters per token (attention adds a little at 1k context)
    assert 1.0 < cost.big_flops / (564 * 1500 * 2 * count_params(big).active_matmul) < 1.1
    with pytest.raises(ValueError, match="MFU"):
        price_sweep(small, "layer", 10, mfu=0)


def test_rtn_onto_a_q4_1_grid_is_almost_lossless_but_g128_is_not() -> None:
    """Why the sweep defaults to int4-g128: the default model's file is Q4_1 (= int4-g32-asym),
    and RTN int4-g32-asym of already-Q4_1 weights lands back on (nearly) the same values."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(64, 256, generator=gen) * 0.05
    on_grid = dequantize(quantize(w, "int4-g32-asym"))  # what the GGUF file holds
    again = dequantize(quantize(on_grid, "int4-g32-asym"))
    g128 = dequantize(quantize(on_grid, "int4-g128-asym"))
    int8 = dequantize(quantize(on_grid, "int8-ch"))
    err = lambda x: float((x - on_grid).pow(2).mean())  # noqa: E731
    assert err(again) < 1e-3 * err(g128)
    assert err(again) < err(int8) < err(g128)
