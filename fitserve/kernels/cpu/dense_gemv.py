"""One row of bf16 x against a dense bf16 weight (dense_gemv.cpp), for batch-1 decode.

``bf16_gemv_available()`` says whether the op is built and loaded; ``bf16_gemv_preferred()``
whether fitserve.model.linear.DenseLinear should run it instead of ``F.linear``: on every
vector tier (avx2 and up), where it ran faster than torch's bf16 matrix-vector product on every
CPU seen (the bf16 W1 rows of benchmarks/bench_engine.py in docs/benchmarks.md, before and after
it). The scalar tier keeps torch's kernel.
"""

from __future__ import annotations

import torch

from fitserve.kernels.cpu.build import load_extension

__all__ = ["bf16_gemv_available", "bf16_gemv_preferred"]

_AVAILABLE: list[bool] = []


def bf16_gemv_available() -> bool:
    """True when dense_gemv.cpp is built and loaded (torch.ops.fitserve_dense.bf16_gemv)."""
    if not _AVAILABLE:
        ok = load_extension("dense_gemv", "dense_gemv.cpp") is not None
        if ok:
            @torch.library.register_fake("fitserve_dense::bf16_gemv")
            def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
                return x.new_empty(x.shape[0], weight.shape[0])
        _AVAILABLE.append(ok)
    return _AVAILABLE[0]


def bf16_gemv_preferred() -> bool:
    """Whether batch-1 bf16 linears should run the op here (see the module note)."""
    from fitserve.kernels.cpu.isa import build_tier, detect_isa

    return build_tier(detect_isa()) != "scalar" and bf16_gemv_available()
