"""Quantized weights: the packed int4/int8 layout, RTN quantizers and the GGUF block mapping.

    from fitserve.quant import quantize_int4, dequantize
    pw = quantize_int4(w, 32)                   # PackedWeight, w [N, K] float
    w_hat = dequantize(pw, torch.float32)       # [N, K], |w - w_hat| <= scale / 2
"""

from __future__ import annotations

from fitserve.quant.packed import (
    PackedWeight,
    cat_rows,
    dequantize,
    gather_rows,
    pack,
    pack_int4,
    unpack,
    unpack_int4,
)
from fitserve.quant.rtn import quantize, quantize_int4, quantize_int8

__all__ = [
    "PackedWeight",
    "cat_rows",
    "dequantize",
    "gather_rows",
    "pack",
    "pack_int4",
    "quantize",
    "quantize_int4",
    "quantize_int8",
    "unpack",
    "unpack_int4",
]
