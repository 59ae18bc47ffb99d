"""--activation-quant: which kernel packed linears run, what precision they compute in, and the
flag's validation."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fitserve.config import EngineConfig
from fitserve.model.linear import PackedLinear, cpp_ops_available, set_activation_quant
from fitserve.quant import quantize

if not cpp_ops_available():
    pytest.skip("the qlinear C++ extension is unavailable", allow_module_level=True)


def model(gen: torch.Generator) -> nn.Module:
    w = torch.randn(48, 96, generator=gen) * 0.05
    return nn.Sequential(PackedLinear(quantize(w, "int4-g32-asym")),
                         PackedLinear(quantize(w[:, :48].contiguous(), "int8-g32")))


@pytest.mark.parametrize(("choice", "dtype", "want"), [
    ("int8", torch.bfloat16, "cpp-aq"), ("int8", torch.float32, "cpp-aq"),
    ("none", torch.bfloat16, "cpp"), ("none", torch.float32, "cpp"),
    ("auto", torch.bfloat16, "cpp-aq"), ("auto", torch.float32, "cpp"),
])
def test_one_kernel_for_every_m(choice: str, dtype: torch.dtype, want: str) -> None:
    m = model(torch.Generator().manual_seed(0))
    line = set_activation_quant(m, choice, dtype)
    assert ("int8 per 32 columns" in line) == (want == "cpp-aq") and "2 packed" in line
    for lin in m:
        assert {lin.kernel(rows, dtype).name for rows in (1, 3, 16, 200, 1000)} == {want}


def test_weight_only_is_closer_to_the_dequantized_product() -> None:
    """'none' computes W4A16 (error: fp32 sums only); 'int8' adds the activation rounding."""
    gen = torch.Generator().manual_seed(1)
    lin = model(gen)[0]
    x = torch.randn(64, 96, generator=gen)
    w64 = lin.packed.codes.dequantize(lin.packed.codes.unpack(lin.qweight, 32), lin.scales,
                                      lin.mins, 32).double()
    want = x.double() @ w64.T
    errs = {}
    for choice in ("int8", "none"):
        lin.act_quant = choice == "int8"
        errs[choice] = (lin(x).double() - want).abs().max().item()
    assert errs["none"] < 1e-5 * want.abs().max().item() < errs["int8"], errs


def test_bad_value_names_the_flag() -> None:
    with pytest.raises(ValueError, match="--activation-quant"):
        EngineConfig(activation_quant="fp16").validate()  # type: ignore[arg-type]
    assert EngineConfig(activation_quant="none").flat_kwargs()["activation_quant"] == "none"


@pytest.mark.parametrize("act", [True, False])
def test_explicit_choice_is_batch_invariant(act: bool) -> None:
    """With the choice made (as the engine makes it), row r of M rows == the row alone, also for
    the weight-only kernel past 16 rows (where it would switch to at::mm)."""
    gen = torch.Generator().manual_seed(2)
    lin = model(gen)[0]
    lin.act_quant = act
    x = torch.randn(40, 96, generator=gen).bfloat16()
    alone = torch.cat([lin(x[r:r + 1]) for r in range(40)])
    assert torch.equal(lin(x), alone)
