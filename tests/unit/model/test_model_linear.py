"""PackedLinear's kernels against a float64 reference: every candidate, every M class.

The reference is ``x (float64) @ W_hat (float64).T`` with W_hat dequantized in float64 from the
packed tensors. Each candidate gets the error bound its arithmetic allows (stated per case):

- exact weights, fp32 x/accumulation (torch path and cpp in fp32; aten-int8 in fp32):
  |err| <= 2 K eps32 * (|W| @ |x|)
- bf16 x: the weight (torch path) or its scale (aten) rounded to bf16 and the output rounded
  to bf16: |err| <= 2^-8 (|W| @ |x|) + 2^-8 |y|  (+ the fp32 term)
- aten-int4: scale and zero = min + 8 scale cast to x's dtype, so each weight moves by at most
  u (|scale (q - 8)| + |zero|) (u = 2^-8 bf16, 2^-22 fp32): |err| <= that @ |x| + the above
- cpp-aq: x quantized per 32 columns with da = absmax / 127: |err| <= sum over blocks
  (da / 2) sum |w| of the block, + the bf16/fp32 terms
"""

from __future__ import annotations

import pytest
import torch

from fitserve.model.linear import (
    BF16_TABLES,
    CANDIDATES,
    RULES,
    PackedEmbedding,
    PackedLinear,
    choose,
    cpp_ops_available,
    preference,
    shape_class,
)
from fitserve.quant import PackedWeight, quantize
from fitserve.quant.packed import unpack_int4

FORMATS = ["int4-g32-asym", "int4-g64-sym", "int4-g128-asym", "int4-g32-sym", "int8-g32",
           "int8-ch"]
MS = [1, 5, 16, 17, 300]  # "m1", "m<=16", "m<=256", "prefill" rows of x
EPS32 = 2.0**-24
U_BF16 = 2.0**-8


def dequant64(pw: PackedWeight) -> torch.Tensor:
    q = (unpack_int4(pw.qweight, pw.group_size) if pw.kind == "int4" else pw.qweight).double()
    s = pw.scales.double().repeat_interleave(pw.group_size, 1)
    if pw.kind == "int8":
        w = s * q
    elif pw.mins is None:
        w = s * (q - 8)
    else:
        w = s * q + pw.mins.double().repeat_interleave(pw.group_size, 1)
    return w[:, : pw.K]


def bound(name: str, pw: PackedWeight, x: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Per-element bound on |y - ref| for candidate ``name`` (see the module docstring)."""
    w = dequant64(pw)
    x64 = x.double()
    mag = x64.abs() @ w.abs().t()
    k = pw.K_padded
    out = 2 * k * EPS32 * mag + 1e-30
    bf16 = x.dtype == torch.bfloat16
    if bf16:
        out = out + U_BF16 * mag + U_BF16 * ref.abs()
    if name == "aten-int4":
        u = U_BF16 if bf16 else 2.0**-22
        s = pw.scales.double().repeat_interleave(pw.group_size, 1)[:, : pw.K]
        q = unpack_int4(pw.qweight, pw.group_size).double()[:, : pw.K]
        m = (torch.zeros_like(s) if pw.mins is None
             else pw.mins.double().repeat_interleave(pw.group_size, 1)[:, : pw.K])
        moved = u * ((s * (q - 8)).abs() + (m + 8 * s).abs())
        out = out + x64.abs() @ moved.t()
    if name == "cpp-aq":
        xp = torch.nn.functional.pad(x64, (0, k - pw.K)).reshape(x.shape[0], k // 32, 32)
        da = xp.abs().amax(-1) / 127  # [M, blocks]
        wp = torch.nn.functional.pad(w.abs(), (0, k - pw.K)).reshape(pw.N, k // 32, 32).sum(-1)
        out = out + (da / 2) @ wp.t() * (1 + 1e-6)
    return out


def make(fmt: str, n: int = 48, k: int = 100, seed: int = 0) -> PackedWeight:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g) + 0.02
    return quantize(w, fmt)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_every_candidate_within_its_bound(fmt: str, dtype: torch.dtype) -> None:
    pw = make(fmt)
    layer = PackedLinear(pw)
    checked = []
    for m in MS:
        x = (torch.randn(m, pw.K, generator=torch.Generator().manual_seed(m)) * 2).to(dtype)
        ref = x.double() @ dequant64(pw).t()
        for cand in CANDIDATES.values():
            if not cand.applies(pw, dtype):
                continue
            layer.force = cand.name
            y = layer(x)
            assert y.dtype == dtype and y.shape == (m, pw.N)
            err = (y.double() - ref).abs()
            b = bound(cand.name, pw, x, ref)
            worst = float((err / b).max())
            assert worst <= 1.0, f"{cand.name} M={m}: error is {worst:.3g}x its bound"
            checked.append(cand.name)
        layer.force = None
        y = layer(x)  # the table's own choice
        assert torch.isfinite(y).all()
        chosen = layer.kernel(m, dtype).name
        err = (y.double() - ref).abs()
        assert float((err / bound(chosen, pw, x, ref)).max()) <= 1.0, chosen
    assert "torch" in checked
    if pw.per_channel:
        assert "aten-int8" in checked


def test_bounds_are_not_vacuous() -> None:
    """The bf16 and act-quant errors are real and the bounds are within 100x of them."""
    pw = make("int4-g32-asym", n=64, k=256)
    layer = PackedLinear(pw)
    x = torch.randn(16, 256, generator=torch.Generator().manual_seed(3))
    ref = x.double() @ dequant64(pw).t()
    for name, dtype in (("torch", torch.bfloat16), ("cpp-aq", torch.float32)):
        if not CANDIDATES[name].applies(pw, dtype):
            continue
        layer.force = name
        xd = x.to(dtype)
        ref_d = xd.double() @ dequant64(pw).t()
        err = (layer(xd).double() - ref_d).abs()
        b = bound(name, pw, xd, ref_d)
        assert float(err.max()) > 0
        assert float((err / b).max()) > 0.01, name
    layer.force = "torch"
    exact = (layer(x).double() - ref).abs().max()
    assert float(exact) <= 1e-4 * float(ref.abs().max())  # fp32: essentially exact


def test_bias_leading_dims_and_padding() -> None:
    pw = make("int4-g64-sym", n=32, k=70)  # K_padded = 128
    bias = torch.randn(32)
    layer = PackedLinear(pw, bias)
    x = torch.randn(2, 3, 70)
    y = layer(x)
    ref = x.double() @ dequant64(pw).t() + bias.double()
    assert y.shape == (2, 3, 32)
    assert torch.allclose(y.double(), ref, rtol=1e-5, atol=1e-5)


def test_embedding_and_tied_lm_head_share_one_tensor() -> None:
    pw = make("int8-g32", n=50, k=64)
    emb = PackedEmbedding(pw, torch.bfloat16)
    head = emb.tied_linear()
    assert head.qweight is emb.qweight and head.scales is emb.scales
    ids = torch.tensor([[0, 49, 7], [7, 7, 1]])
    out = emb(ids)
    assert out.dtype == torch.bfloat16 and out.shape == (2, 3, 64)
    assert torch.equal(out, dequant64(pw)[ids].float().to(torch.bfloat16))
    container = torch.nn.ModuleDict({"e": emb, "h": head})
    assert sum(b.numel() * b.element_size() for b in container.buffers()) == pw.nbytes


def test_table_lookup_and_fallback() -> None:
    assert [shape_class(m) for m in (1, 2, 16, 17, 256, 257)] == ["m1", "m<=16", "m<=16",
                                                                   "m<=256", "m<=256", "prefill"]
    for prefs in RULES.values():
        assert set(prefs) <= set(CANDIDATES)
    # the most specific rule wins; an unknown ISA still gets a list ending on the torch path
    assert preference("no-such-isa", "int8-channel", "m1", "bf16")[-1] == "torch"
    assert preference("no-such-isa", "int4-asym", "m<=256", "f32")[-1] == "torch"
    # fp32 activations are never quantized, on any ISA; bf16 here takes the measured lists
    for isa in ("avx512_vnni+amx", "avx2"):
        for m in ("m1", "m<=16", "m<=256", "prefill"):
            for layout in ("int4-asym", "int4-sym", "int8-channel", "int8-group"):
                assert "cpp-aq" not in preference(isa, layout, m, "f32")
    assert preference("avx512_vnni+amx", "int8-group", "prefill", "bf16")[0] == "torch"
    # every measured ISA covers every layout and shape class, and only names real candidates
    for isa, tables in BF16_TABLES.items():
        for layout in ("int4-asym", "int4-sym", "int8-channel", "int8-group"):
            for m in ("m1", "m<=16", "m<=256", "prefill"):
                prefs = preference(isa, layout, m, "bf16")
                assert prefs[-1] == "torch" and len(prefs) >= 2, (isa, layout, m)
        assert set(tables) == {"int4", "int8-channel", "int8-group"}
    # the rows that differ between the CPUs measured (Xeon with AMX, Zen 4 without, Zen 3 AVX2)
    assert preference("avx512_vnni", "int8-group", "prefill", "bf16")[0] == "cpp-aq"
    assert preference("avx2", "int8-group", "prefill", "bf16")[0] == "cpp-aq"
    assert preference("avx2", "int4-asym", "m1", "bf16")[:2] == ("cpp-aq", "cpp")
    assert preference("avx2", "int8-channel", "m1", "bf16")[0] == "cpp-aq"
    pw = make("int8-g32")
    assert choose(pw, 1, torch.float16).name == "torch"  # only the torch path runs f16 x


@pytest.mark.parametrize("fmt", ["int4-g32-asym", "int8-g32", "int4-g64-sym"])
def test_held_panels_run_the_same_bits_and_go_back(fmt: str) -> None:
    from fitserve.kernels.cpu.qlinear import held_layout

    if not cpp_ops_available():
        pytest.skip("no C++ ops: nothing is held as panels")
    pw = make(fmt, n=48, k=100)  # K_padded > K: x is padded on the held path too
    layer, row_major = PackedLinear(pw, torch.randn(48)), PackedLinear(pw, torch.randn(48))
    row_major.bias = layer.bias
    assert not layer.hold_panels(), "held before act_quant is set: the table may pick others"
    layer.act_quant = row_major.act_quant = True
    assert layer.hold_panels() and layer.held_panels and "held as panels" in repr(layer)
    assert layer.scales.dim() == 3 and layer.scales.shape[2] == held_layout().lanes
    before = sum(b.numel() * b.element_size() for b in row_major.buffers())
    assert sum(b.numel() * b.element_size() for b in layer.buffers()) == before  # one copy
    assert torch.equal(layer.packed.qweight, pw.qweight)  # a row-major copy on request
    x = torch.randn(3, 7, 100).bfloat16()
    for rows in (1, 2, 21):
        xs = x.reshape(-1, 100)[:rows]
        assert torch.equal(layer(xs), row_major(xs)), (fmt, rows)
    layer.act_quant = False  # the weight-only kernels read rows: back to row-major
    assert not layer.held_panels and torch.equal(layer.qweight, pw.qweight)
    row_major.act_quant = False
    assert torch.equal(layer(x), row_major(x))


@pytest.mark.parametrize("fmt, k", [("int8-g32", 96), ("int4-g32-asym", 100),
                                    ("int4-g64-sym", 100), ("int8-ch", 70)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16], ids=str)
def test_tied_embedding_gathers_from_its_heads_panels(fmt: str, k: int,
                                                      dtype: torch.dtype) -> None:
    """The held lookup (qlinear_held_rows, one C++ call) gives the row-major lookup's tensor
    (gather_rows: packed.py's dequantize, then .to(dtype)) bit for bit, K's padding dropped."""
    from fitserve.kernels.cpu import qlinear
    from fitserve.model.linear import hold_linears_as_panels

    if not cpp_ops_available():
        pytest.skip("no C++ ops: nothing is held as panels")
    pw = make(fmt, n=64, k=k)
    emb = PackedEmbedding(pw, dtype)
    head = emb.tied_linear()
    head.act_quant = True
    model = torch.nn.ModuleDict({"embed": emb, "lm_head": head})
    ids = torch.tensor([[0, 63, 17], [16, 15, 1]])
    want_rows, x = emb(ids), torch.randn(2, k).bfloat16()
    assert want_rows.dtype == dtype and want_rows.shape == (2, 3, k)
    want_logits = head(x)
    assert "1 of 1" in hold_linears_as_panels(model)
    assert emb.held_panels and head.held_panels and emb.qweight is head.qweight
    got = emb(ids)
    assert torch.equal(got.view(torch.uint8), want_rows.view(torch.uint8)), (fmt, dtype)
    assert not torch.equal(got, emb((ids + 1) % 64))  # a wrong row would be seen
    assert torch.equal(head(x), want_logits)
    assert sum(b.numel() * b.element_size() for b in model.buffers()) == pw.nbytes  # one copy
    with pytest.raises(IndexError, match="out of bounds"):
        qlinear.held_rows(emb.qweight, emb.scales, emb.mins, torch.tensor([64]), pw.group_size,
                          k, dtype)
