"""Quantized weights: the packed int4/int8 layout, RTN quantizers and the GGUF block mapping.

    from fitserve.quant import quantize_int4, dequantize
    pw = quantize_int4(w, 32)                   # PackedWeight, w [N, K] float
    w_hat = dequantize(pw, torch.float32)       # [N, K], |w - w_hat| <= scale / 2
"""

from __future__ import annotations

from typing import Any

# NOTE: names resolve on first use (PEP 562): `fitserve --help` builds the parsers of
# fitserve.quant.cli_* without importing torch through this package's __init__.
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
