"""fitserve.quant.hf_checkpoint_formats: the int32 field unpacking of each writer, and the
asymmetric int4 conversion whose groups are held flipped ((15 - q), -s, s * (15 - z)) where
-s * z does not fit an f16: exact, and run correctly by every packed kernel."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fitserve.ledger.prequant import QuantScheme
from fitserve.model.linear import CANDIDATES, PackedLinear
from fitserve.quant.hf_checkpoint_formats import (
    AWQ_REVERSE,
    Rounding,
    Unpacked,
    _packed,
    unpack_words,
)


def test_unpack_words_field_order() -> None:
    # one word, fields 0..7 = 1..8 (field i at bits 4i): along a row, down a column, AWQ order
    word = sum((i + 1) << (4 * i) for i in range(8))
    words = torch.tensor([[word - (1 << 32) if word >= 1 << 31 else word]], dtype=torch.int32)
    assert unpack_words(words, 4, 1).tolist() == [[1, 2, 3, 4, 5, 6, 7, 8]]
    assert unpack_words(words, 4, 0).flatten().tolist() == [1, 2, 3, 4, 5, 6, 7, 8]
    # AWQ: field i holds column (0, 2, 4, 6, 1, 3, 5, 7)[i], so column j is field AWQ_REVERSE[j]
    assert unpack_words(words, 4, 1, AWQ_REVERSE).tolist() == [[1, 5, 2, 6, 3, 7, 4, 8]]
    top = torch.tensor([[-1]], dtype=torch.int32)  # the sign bit is field 7's high bit
    assert unpack_words(top, 8, 1).tolist() == [[255, 255, 255, 255]]


def flipped_case(n: int = 32, k: int = 96, group: int = 32) -> tuple[Unpacked, torch.Tensor]:
    """bf16 scales (8 significant bits) and zero points 9..15 (4 significant bits): -s * z
    needs 12 bits, more than an f16 holds, for many groups; s * (15 - z) never does."""
    gen = torch.Generator().manual_seed(3)
    codes = torch.randint(0, 16, (n, k), generator=gen)
    zeros = torch.randint(0, 16, (n, k // group), generator=gen)
    zeros[: n // 2] = torch.tensor([9, 11, 13])[torch.randint(0, 3, (n // 2, k // group),
                                                              generator=gen)]
    scales = (torch.rand(n, k // group, generator=gen) * 0.02 + 0.001).to(torch.bfloat16)
    u = Unpacked(codes, zeros, scales)
    cols = torch.arange(k) // group
    w = scales.double()[:, cols] * (codes - zeros[:, cols]).double()
    return u, w


def test_asymmetric_int4_flipped_groups_are_exact() -> None:
    u, w = flipped_case()
    rounding = Rounding()
    pw = _packed(u, QuantScheme("compressed-tensors", 4, 32, False), 32, 96, rounding)
    assert rounding.rounded == 0 and rounding.total == 2 * pw.scales.numel()
    assert bool((pw.scales < 0).any()) and bool((pw.scales > 0).any())  # some flipped, not all
    assert torch.equal(pw.dequantize(torch.float32).double(), w)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 5, 40])
def test_every_kernel_runs_flipped_groups(dtype: torch.dtype, m: int) -> None:
    u, w = flipped_case()
    pw = _packed(u, QuantScheme("compressed-tensors", 4, 32, False), 32, 96, Rounding())
    x = torch.randn(m, 96, generator=torch.Generator().manual_seed(m)).to(dtype)
    want = F.linear(x.double(), w)
    ran = []
    for cand in CANDIDATES.values():
        if not cand.applies(pw, dtype):
            continue
        layer = PackedLinear(pw)
        layer.force = cand.name
        got = layer(x).double()
        # bf16 activations / int8-quantized ones (cpp-aq) round x: a bf16-sized tolerance
        tol = 2e-3 if dtype == torch.float32 and cand.name != "cpp-aq" else 4e-2
        assert float((got - want).abs().max()) <= tol * float(want.abs().max()), cand.name
        ran.append(cand.name)
    assert "torch" in ran
