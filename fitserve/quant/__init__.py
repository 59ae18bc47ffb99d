"""Runtime weight formats: the held-weight interface (held: dense, packed int4/int8, fp8), the
packed layout, RTN quantizers, converting a loaded tensor to its held format (convert), the GGUF
block mapping (gguf_map: Q4_0/Q4_1/Q8_0 -> packed; ggml_blocks: K-quants, Q5, IQ4 as raw
blocks) and the quantized KV cache.

    from fitserve.quant import quantize_int4, dequantize
    pw = quantize_int4(w, 32)                   # PackedWeight, w [N, K] float
    w_hat = dequantize(pw, torch.float32)       # [N, K], |w - w_hat| <= scale / 2
"""

from __future__ import annotations

from typing import Any

# NOTE: names resolve on first use (PEP 562): importing the package does not import torch.
_LAZY: dict[str, str] = {
    **dict.fromkeys(["PackedWeight", "cat_rows", "dequantize", "gather_rows", "pack", "pack_int4",
                     "unpack", "unpack_int4"], "fitserve.quant.packed"),
    **dict.fromkeys(["quantize", "quantize_int4", "quantize_int8"], "fitserve.quant.rtn"),
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'fitserve.quant' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


__all__ = sorted(_LAZY)
