"""A few rows of x against an fp8 weight, the codes converted in registers (fp8_gemv.cpp).

``fp8_gemv_available()`` says whether ``torch.ops.fitserve_fp8.fp8_linear`` is built and loaded;
fitserve.model.fp8_linear.Fp8Linear runs it for up to ``FP8_GEMV_MAX_ROWS`` rows of x on every
tier it builds for (AVX-512, AVX2 and the scalar table loop) and falls back to its pure-torch
dequantize-and-GEMM path for larger M (where a GEMM's blocking pays) or without the op.
"""

from __future__ import annotations

import torch

from fitserve.kernels.cpu.build import load_extension

__all__ = ["FP8_GEMV_MAX_ROWS", "fp8_gemv_available", "fp8_linear"]

# NOTE: rows of x up to which the op runs (decode batches, speculative verification, short
# prefill chunks); past it Fp8Linear dequantizes row chunks and runs torch's GEMM, whose cache
# blocking wins at prefill. Rough single-thread timings on a loaded Zen 5 (bf16 x, e4m3 per
# channel, 1536 x 576 and 576 x 1536): the op 2.5-5x faster at M <= 32, ~1.4x at 64, ~0.7x at 128.
FP8_GEMV_MAX_ROWS = 64

_AVAILABLE: list[bool] = []


def fp8_gemv_available() -> bool:
    """True when fp8_gemv.cpp is built and loaded (torch.ops.fitserve_fp8.fp8_linear)."""
    if not _AVAILABLE:
        ok = load_extension("fp8_gemv", "fp8_gemv.cpp") is not None
        if ok:
            @torch.library.register_fake("fitserve_fp8::fp8_linear")
            def _(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, fmt: str,
                  granularity: str, block: int, bias: torch.Tensor | None) -> torch.Tensor:
                return x.new_empty(x.shape[0], codes.shape[0])
        _AVAILABLE.append(ok)
    return _AVAILABLE[0]


def fp8_linear(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, fmt: str,
               granularity: str, block: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [M, K] @ (code(codes) * scales).T (+ bias)`` in x's dtype (the op; see the .cpp)."""
    out: torch.Tensor = torch.ops.fitserve_fp8.fp8_linear(x, codes, scales, fmt, granularity,
                                                         block, bias)
    return out
