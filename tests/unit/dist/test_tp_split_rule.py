"""The planner's split rule against the engine's held weights: for each format the engine holds
a row-parallel weight in, ``ledger.tp_split.format_column_block`` of its format equals the held
weight's own ``column_block`` (what ``dist.shard`` splits at), and a column split the rule
refuses is one the held weight's ``shard`` refuses too."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import quantize as gguf_quantize

from fitserve.ledger.tp_split import format_column_block
from fitserve.quant.ggml_blocks import GgmlBlockWeight
from fitserve.quant.held import HeldWeight, as_held
from fitserve.quant.rtn import quantize as quantize_rtn

K = 512  # input columns: / 4 = 128 (whole 32- and 128-blocks), / 8 = 64 (not whole 128s)


def _held(fmt: str) -> HeldWeight:
    w = torch.randn(8, K, generator=torch.Generator().manual_seed(0))
    if fmt == "MXFP4":
        raw = gguf_quantize(w.numpy().astype(np.float32), Q.MXFP4)
        return GgmlBlockWeight(fmt, 8, K, torch.from_numpy(raw))
    if fmt == "Q4_K":  # gguf-py has no Q4_K quantizer: zero blocks (144 B per 256 weights)
        return GgmlBlockWeight(fmt, 8, K, torch.zeros(8, K // 256 * 144, dtype=torch.uint8))
    return as_held(quantize_rtn(w, fmt))


@pytest.mark.parametrize("fmt", ["int4-g32-asym", "int4-g32-sym", "int4-g128-asym", "int8-g32",
                                 "int8-g128", "int8-ch", "MXFP4", "Q4_K"])
def test_rule_equals_the_held_weights_column_block(fmt: str) -> None:
    held = _held(fmt)
    block = format_column_block(held.format)
    assert block == held.column_block
    for tp in (2, 4, 8):
        width = K // tp
        if width % block == 0:
            for r in range(tp):
                assert held.shard(1, r * width, (r + 1) * width).dequantize().shape == (8, width)
        elif fmt != "int8-ch":  # per-channel int8 re-pads a slice; the engine's check refuses it
            with pytest.raises(ValueError):
                held.shard(1, width, 2 * width)
