"""AWQ scaling and the calibration statistics it reads, on tiny random models.

References: the statistics against float64 sums of the raw inputs a plain hook records; AWQ's
transform against the untransformed float model (same logits); its search against plain RTN
(the engine's quantizer) on held-out rows with outlier channels.
"""

from __future__ import annotations

import pytest
import torch

from fitserve.config import ModelSpec
from fitserve.model.loader import build_model
from fitserve.quant.packed import dequantize
from fitserve.quant.rtn import quantize_int4, quantize_int8
from fitserve.runner.teacher_forcing import score_logits
from fitserve.tools.quantize.awq import awq_search_scale, awq_transform, fake_rtn
from fitserve.tools.quantize.calibration import (
    calibration_shift,
    calibration_token_ids,
    collect_linear_stats,
    format_shift,
    linear_weight_names,
    sample_positions,
)

OUTLIERS = [3, 17, 29]



# small tensors: one thread keeps these quick (tests/conftest.py one_thread)
pytestmark = pytest.mark.usefixtures("one_thread")

def tiny_spec(kv_heads: int = 4, bias: bool = False) -> ModelSpec:
    return ModelSpec(architecture="qwen2" if bias else "llama", vocab_size=96, hidden_size=64,
                     intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=kv_heads,
                     head_dim=16, max_position_embeddings=256, attention_bias=bias)


def tiny_weights(spec: ModelSpec, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random HF-named weights with a few outlier channels in every scaled input: the norms'
    weights (q/k/v, gate/up inputs), v_proj's rows (o_proj's input), up_proj's rows (down's)."""
    g = torch.Generator().manual_seed(seed)
    h, f, kv = spec.hidden_size, spec.intermediate_size, spec.num_kv_heads * spec.head_dim

    def rnd(*shape: int, std: float = 0.1) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

    w = {"model.embed_tokens.weight": rnd(spec.vocab_size, h, std=1.0),
         "model.norm.weight": 1 + rnd(h), "lm_head.weight": rnd(spec.vocab_size, h)}
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        for norm in ("input_layernorm", "post_attention_layernorm"):
            w[p + norm + ".weight"] = 1 + rnd(h)
            w[p + norm + ".weight"][OUTLIERS] *= 12
        w.update({p + "self_attn.q_proj.weight": rnd(spec.num_heads * spec.head_dim, h),
                  p + "self_attn.k_proj.weight": rnd(kv, h),
                  p + "self_attn.v_proj.weight": rnd(kv, h),
                  p + "self_attn.o_proj.weight": rnd(h, spec.num_heads * spec.head_dim),
                  p + "mlp.gate_proj.weight": rnd(f, h), p + "mlp.up_proj.weight": rnd(f, h),
                  p + "mlp.down_proj.weight": rnd(h, f)})
        w[p + "self_attn.v_proj.weight"][OUTLIERS] *= 10
        w[p + "mlp.up_proj.weight"][OUTLIERS] *= 10
        if spec.attention_bias:
            for x, n in (("q", spec.num_heads * spec.head_dim), ("k", kv), ("v", kv)):
                w[p + f"self_attn.{x}_proj.bias"] = rnd(n)
    return w


def _ids(n: int, length: int, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 96, (length,), generator=g).tolist() for _ in range(n)]


def _model(spec: ModelSpec, w: dict[str, torch.Tensor]):  # type: ignore[no-untyped-def]
    return build_model(spec, dict(w), dtype=torch.float32, device="cpu", max_positions=256)


def test_stats_equal_float64_sums_of_the_inputs() -> None:
    spec = tiny_spec(kv_heads=2)
    model = _model(spec, tiny_weights(spec))
    ids = _ids(3, 70)
    seen: dict[str, list[torch.Tensor]] = {}
    hooks = [mod.register_forward_pre_hook(
        lambda _m, a, key=name: seen.setdefault(key, []).append(a[0].double().clone()))
        for name, mod in model.named_modules() if name.endswith(("_proj", "qkv_proj"))]
    for t in ids:
        score_logits(model, spec, t, chunk_size=1000)
    for h in hooks:
        h.remove()
    stats = collect_linear_stats(model, spec, ids, max_sample_rows=50, chunk_size=32)
    assert set(stats) == set(linear_weight_names(spec))
    at = sample_positions(210, 50)
    assert len(set(at.tolist())) == 50
    for module, hf in (("layers.1.self_attn.qkv_proj", "model.layers.1.self_attn.k_proj"),
                       ("layers.0.self_attn.o_proj", "model.layers.0.self_attn.o_proj"),
                       ("layers.1.mlp.gate_up_proj", "model.layers.1.mlp.up_proj"),
                       ("layers.0.mlp.down_proj", "model.layers.0.mlp.down_proj")):
        x = torch.cat(seen[module])
        st = stats[hf + ".weight"]
        assert st.rows == 210
        ref = x.T @ x  # float32 chunk products summed in float64: ~1e-6 of the largest entry
        assert st.hessian.dtype == torch.float64
        assert float((st.hessian - ref).abs().max()) <= 1e-5 * float(ref.abs().max())
        torch.testing.assert_close(st.abs_mean, x.abs().mean(0).float(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(st.sample, x[at].float(), rtol=1e-5, atol=1e-6)
    p = "model.layers.0."
    assert stats[p + "self_attn.q_proj.weight"] is stats[p + "self_attn.v_proj.weight"]
    assert stats[p + "mlp.gate_proj.weight"] is stats[p + "mlp.up_proj.weight"]


def test_stats_need_a_dense_model() -> None:
    spec = tiny_spec()
    w: dict[str, object] = dict(tiny_weights(spec))
    w["model.layers.1.mlp.down_proj.weight"] = quantize_int8(
        w["model.layers.1.mlp.down_proj.weight"])  # type: ignore[arg-type]
    model = build_model(spec, w, dtype=torch.float32, device="cpu",  # type: ignore[arg-type]
                        max_positions=64)
    with pytest.raises(ValueError, match=r"layers\.1\.mlp\.down_proj is a PackedLinear"):
        collect_linear_stats(model, spec, _ids(1, 8))
    with pytest.raises(ValueError, match="no tokens"):
        collect_linear_stats(model, spec, [])


@pytest.mark.parametrize("kv_heads,bias", [(4, False), (2, False), (4, True)])
def test_transform_keeps_the_float_function(kv_heads: int, bias: bool) -> None:
    spec = tiny_spec(kv_heads, bias)
    w = tiny_weights(spec)
    model = _model(spec, w)
    stats = collect_linear_stats(model, spec, _ids(2, 64))
    new = awq_transform(w, spec, stats, bits=4, group_size=32, symmetric=False)
    assert set(new) == set(w) and all(t.dtype == torch.float32 for t in new.values())
    for i in range(spec.num_layers):  # every scaled set found s != 1 (else this test is void)
        p = f"model.layers.{i}."
        moved = [p + "input_layernorm.weight", p + "post_attention_layernorm.weight",
                 p + "mlp.up_proj.weight"] + ([p + "self_attn.o_proj.weight"] * (kv_heads == 4))
        for name in moved:
            assert not torch.allclose(new[name], w[name], rtol=0.01), name
        if kv_heads != 4:  # GQA: o_proj is not scaled, v_proj only by the q/k/v set
            assert torch.equal(new[p + "self_attn.o_proj.weight"], w[p + "self_attn.o_proj.weight"])
    ids = _ids(1, 90, seed=7)[0]
    ref = score_logits(model, spec, ids)
    got = score_logits(_model(spec, new), spec, ids)
    assert float((got - ref).norm() / ref.norm()) < 1e-4


def _engine_rtn(w: torch.Tensor, bits: int, group: int | None, sym: bool) -> torch.Tensor:
    if bits == 4:
        assert group is not None
        return dequantize(quantize_int4(w, group, symmetric=sym))
    return dequantize(quantize_int8(w, group))


@pytest.mark.parametrize("bits,group,sym", [(4, 32, False), (4, 128, True), (4, 64, False),
                                            (8, None, True)])
def test_search_lowers_layer_output_error(bits: int, group: int | None, sym: bool) -> None:
    g = torch.Generator().manual_seed(3)
    k = 256
    gain = torch.ones(k)
    gain[[5, 40, 77, 200]] = 25.0

    def inputs(rows: int) -> torch.Tensor:
        return torch.randn(rows, k, generator=g) * gain

    x, held = inputs(512), inputs(512)
    w = torch.randn(96, k, generator=g) * 0.05
    s, loss, rtn_loss = awq_search_scale(w, x, x.abs().mean(0), bits=bits, group_size=group,
                                         symmetric=sym)
    assert loss < rtn_loss and not torch.equal(s, torch.ones(k))
    ref = held @ w.T
    rtn_err = float((held @ _engine_rtn(w, bits, group, sym).T - ref).norm())
    awq_err = float(((held / s) @ _engine_rtn(w * s, bits, group, sym).T - ref).norm())
    assert awq_err < 0.8 * rtn_err, (awq_err, rtn_err)


@pytest.mark.parametrize("bits,group,sym", [(4, 32, False), (4, 64, True), (8, None, True),
                                            (8, 32, True), (4, 128, False)])
def test_fake_rtn_is_the_engine_rtn(bits: int, group: int | None, sym: bool) -> None:
    g = torch.Generator().manual_seed(4)
    w = torch.randn(200, 300, generator=g) * torch.rand(300, generator=g)
    w[:3] = 0.0
    want = _engine_rtn(w, bits, group, sym)
    got = fake_rtn(w, bits, group, sym)
    differ = got != want
    # float32 code rounding may land an exact-ish .5 tie the other way: one step, rarely
    assert int(differ.sum()) <= 3
    step = quantize_int4(w, group or 32).scales.float().max() if bits == 4 else 1.0
    assert float((got - want).abs().max()) <= float(step) * 1.001


class CharTokenizer:
    """One token per character (ids 3..), BOS = 1."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return ([1] if add_special_tokens else []) + [3 + ord(c) % 90 for c in text]


def test_calibration_token_ids_pieces() -> None:
    pieces = calibration_token_ids("abcdefghij" * 10, CharTokenizer(), max_tokens=30,
                                   min_tokens=5)
    assert [len(p) for p in pieces] == [30, 30, 30, 14]
    assert all(p[0] == 1 for p in pieces)
    assert sum(len(p) - 1 for p in pieces) == 100
    short = calibration_token_ids("x" * 60, CharTokenizer(), max_tokens=30, min_tokens=5)
    assert [len(p) for p in short] == [30, 30]  # the 3-token tail is dropped
    assert len(calibration_token_ids("y" * 500, CharTokenizer(), max_tokens=30,
                                     max_pieces=3)) == 3
    with pytest.raises(ValueError, match="no room"):
        calibration_token_ids("abc", CharTokenizer(), max_tokens=1)


def test_calibration_shift_table() -> None:
    spec = tiny_spec()
    texts = {"code": "def f(x):\n    return x[0] + 1\n" * 12,
             "prose": "The sun also ariseth, and the sun goeth down. " * 8}
    kl = calibration_shift(spec, tiny_weights(spec), CharTokenizer(), texts, bits=4,
                           group_size=32, max_tokens=64)
    assert set(kl) == {"rtn", "gptq", "awq"} and set(kl["rtn"]) == {"-"}
    assert set(kl["gptq"]) == set(kl["awq"]) == set(texts)
    for rows in kl.values():
        for cols in rows.values():
            assert set(cols) == set(texts) and all(v > 0 for v in cols.values())
    table = format_shift(kl)
    assert "gptq" in table and " x" in table
