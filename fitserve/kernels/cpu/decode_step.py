"""The decoder layers of a decode-only step as one C++ op (decode_step.cpp).

``torch.ops.fitserve_step.decode_layers`` calls the same registered ops as the Python loop in
fitserve/runner/decode_loop.py, in the same order; it needs fused_ops, paged_attention and (for packed
linears) qlinear loaded first, which ``decode_step_available`` makes sure of.
"""

from __future__ import annotations

from fitserve.kernels.cpu.build import load_extension

__all__ = ["decode_step_available"]

_AVAILABLE: list[bool] = []


def decode_step_available() -> bool:
    """True when decode_step.cpp and the extensions whose ops it calls are loaded."""
    if not _AVAILABLE:
        from fitserve.kernels.cpu.fused import fused_ops_available
        from fitserve.kernels.cpu.paged_attention import paged_attention_available
        from fitserve.kernels.cpu.qlinear import qlinear_ops_available

        ok = fused_ops_available() and paged_attention_available() and qlinear_ops_available()
        _AVAILABLE.append(ok and load_extension("decode_step", "decode_step.cpp") is not None)
    return _AVAILABLE[0]
