"""The module that runs an act-order (input-permuted) weight: gather x's columns, then the
packed linear (``fitserve.quant.permuted``)."""

from __future__ import annotations

import torch
from torch import nn

from fitserve.model.linear import PackedLinear
from fitserve.quant.permuted import InputPermutedWeight


class InputPermutedLinear(nn.Module):
    """``y = x[..., perm] @ inner.T (+ bias)``: ``inner`` is ``W[:, perm]`` held packed."""

    perm: torch.Tensor

    def __init__(self, w: InputPermutedWeight, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.inner = PackedLinear(w.inner, bias)
        self.register_buffer("perm", w.perm.to(torch.int32))  # counted: the "-perm" formats
        self.in_features, self.out_features = w.inner.K, w.inner.N

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = self.inner(x.index_select(-1, self.perm))
        return y
