"""A linear layer over an FP8 weight (``fitserve.quant.fp8.Fp8Weight``).

    Fp8Linear(fw)(x [..., K]) -> [..., N]     x float32 / bfloat16 / float16; y in x's dtype

Three paths:

    kernel     (default, weight-only W8A16, up to FP8_GEMV_MAX_ROWS rows of x on CPU) the C++
               op of fitserve/kernels/cpu/fp8_gemv.cpp: one byte read per weight, the codes
               converted in registers, fp32 sums, the scale once per output (per 128 columns
               for block scales), the bias in fp32; every granularity and both formats.
    dequant    (weight-only W8A16: more rows, another device, or no C++ build) dequantize row
               chunks in float32 to x's dtype and F.linear; scratch bounded to ~1M elements
               whatever the layer (as ``run_torch`` in fitserve.model.linear). Exact up to the
               float GEMM's own sums.
    scaled-mm  (``act_fp8=True``, W8A8-fp8) x quantized per token to the weight's fp8 format,
               then ``torch._scaled_mm`` with per-token x scales and per-channel weight scales
               (tensor/channel granularity only; block weights stay on the dequant path).

NOTE: measured on this CPU (torch 2.13, one thread, min of 15 runs on a shared, loaded
machine; 1536 x 576 e4m3 per channel, bf16 x; /tmp script, not a benchmark yet):

    M       dequant       scaled-mm     dense bf16    (ms)   rel. error vs x @ W_hat.T
    1       1.9           5.9           0.17                 dequant 0.24%  (bf16 rounding)
    16      2.1           6.2           0.16                 scaled-mm 2.6-2.7%
    128     2.6           8.6           0.35                 (x's e4m3 cast)
    512     3.3           27.8          0.94

_scaled_mm runs for fp8 on this CPU, but only with fp8 activations: it is slower than the
dequant path at every M and ~10x less exact (it quantizes x), so it is never chosen by itself;
``act_fp8`` is an explicit opt-in to W8A8-fp8 numerics. The dequant path decodes e4m3 by bit
moves (``codes_as_f16``; torch's e4m3 cast took 8.7 ms here); it is still ~10x a dense bf16
GEMM at decode, which is why the kernel path exists (see fitserve/kernels/cpu/fp8_gemv.py).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fitserve.kernels.cpu.fp8_gemv import FP8_GEMV_MAX_ROWS, fp8_gemv_available
from fitserve.kernels.cpu.fp8_gemv import fp8_linear as fp8_linear_op
from fitserve.quant.fp8 import FORMATS, Fp8Weight, fp8_max

_CHUNK_ELEMENTS = 1 << 20


@functools.cache
def scaled_mm_available() -> bool:
    """Whether ``torch._scaled_mm`` runs fp8 x fp8 -> float32 here with row/column scales and
    gives the exact product of the codes on a small case."""
    try:
        a = torch.tensor([[1.0, -2.0], [0.5, 4.0]]).to(torch.float8_e4m3fn)
        b = torch.tensor([[3.0, 1.0], [-1.0, 2.0]]).to(torch.float8_e4m3fn)
        sa, sb = torch.tensor([[2.0], [1.0]]), torch.tensor([[1.0, 0.5]])
        out = torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb, out_dtype=torch.float32)
        want = (a.float() @ b.float().t()) * sa * sb
        return bool(torch.equal(out, want))
    except Exception:  # not built for this device / dtype: the dequant path runs
        return False


def dequant_linear(fw: Fp8Weight, x: torch.Tensor) -> torch.Tensor:
    """``x2 [M, K] @ W_hat.T`` dequantizing row chunks of W in float32 to x's dtype."""
    rows = max(1, _CHUNK_ELEMENTS // max(fw.K, 1))
    if fw.granularity == "block":
        rows = max(fw.block, rows // fw.block * fw.block)  # chunks on tile boundaries
    outs = [F.linear(x, fw.dequantize_rows(r0, min(fw.N, r0 + rows), x.dtype))
            for r0 in range(0, fw.N, rows)]
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)


def scaled_mm_linear(fw: Fp8Weight, x: torch.Tensor) -> torch.Tensor:
    """W8A8-fp8: x quantized per token (row) to ``fw.fmt`` with float32 scales, then
    ``torch._scaled_mm``; tensor or channel weights only."""
    if fw.granularity == "block":
        raise ValueError("_scaled_mm here takes row/column scales: block weights use dequant")
    top = fp8_max(fw.fmt)
    xf = x.to(torch.float32)
    amax = xf.abs().amax(dim=1, keepdim=True)
    sx = torch.where(amax > 0, amax / top, torch.ones_like(amax))
    xq = (xf / sx).clamp(-top, top).to(FORMATS[fw.fmt])
    sw = fw.scales.reshape(1, -1).expand(1, fw.N).contiguous()
    out: torch.Tensor = torch._scaled_mm(xq, fw.codes.t(), scale_a=sx, scale_b=sw,
                                         out_dtype=x.dtype)
    return out


class Fp8Linear(nn.Module):
    """``y = x @ W.T (+ bias)`` with W held in fp8: buffers ``weight_fp8`` (the codes' uint8
    bits) and ``weight_scale`` (float32)."""

    weight_fp8: torch.Tensor
    weight_scale: torch.Tensor

    def __init__(self, fw: Fp8Weight, bias: torch.Tensor | None = None, *,
                 act_fp8: bool = False) -> None:
        super().__init__()
        self.fmt, self.granularity, self.block = fw.fmt, fw.granularity, fw.block
        self.in_features, self.out_features = fw.K, fw.N
        # NOTE: uint8 bits, not a float8 buffer: Module.to(dtype) casts every floating
        # buffer, and float8 counts as floating (a model.to(bf16) would decode the codes).
        self.register_buffer("weight_fp8", fw.data.view(torch.uint8)
                             if fw.data.dtype != torch.uint8 else fw.data)
        self.register_buffer("weight_scale", fw.scales)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        if act_fp8 and (fw.granularity == "block" or not scaled_mm_available()):
            raise ValueError("act_fp8 needs torch._scaled_mm and tensor/channel scales")
        self.act_fp8 = act_fp8

    def _apply(self, fn: Callable[..., Any], recurse: bool = True) -> Fp8Linear:
        # NOTE: the float32 scales move with the module but never change dtype (a bf16 scale
        # would round away 16 bits of every weight's magnitude).
        scales = self._buffers.pop("weight_scale")
        assert scales is not None
        super()._apply(fn, recurse)  # type: ignore[no-untyped-call]
        self.register_buffer("weight_scale", scales.to(self.weight_fp8.device))
        return self

    @property
    def fp8(self) -> Fp8Weight:
        """The weight as an Fp8Weight over this module's buffers (no copy)."""
        return Fp8Weight(self.fmt, self.granularity, self.out_features, self.in_features,
                         self.weight_fp8, self.weight_scale, self.block)

    def kernel_applies(self, x2: torch.Tensor) -> bool:
        """Whether ``x2 [M, K]`` runs the C++ op (see the module docstring)."""
        return self.kernel_runs(x2.shape[0], x2.dtype, x2.device)

    def kernel_runs(self, rows: int, dtype: torch.dtype, device: torch.device) -> bool:
        """Whether x of ``rows`` rows, ``dtype``, on ``device`` runs the C++ op."""
        return (not self.act_fp8 and device.type == "cpu" and rows <= FP8_GEMV_MAX_ROWS
                and dtype in (torch.float32, torch.bfloat16, torch.float16)
                and fp8_gemv_available())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x if x.dim() == 2 else x.reshape(-1, self.in_features)
        if self.kernel_applies(x2):
            y = fp8_linear_op(x2, self.weight_fp8, self.weight_scale, self.fmt, self.granularity,
                              self.block, self.bias)
        else:
            run = scaled_mm_linear if self.act_fp8 else dequant_linear
            y = run(self.fp8, x2)
            if self.bias is not None:
                y = y + self.bias.to(y.dtype)
        return y if x.dim() == 2 else y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"fmt={self.fmt}, granularity={self.granularity}, act_fp8={self.act_fp8}")
