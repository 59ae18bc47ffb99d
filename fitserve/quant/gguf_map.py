"""GGUF Q4_0 / Q4_1 / Q8_0 blocks -> PackedWeight, exactly as stored (no float round trip).

Each ggml block of 32 weights is split into its float16 scale(s) and its codes; the codes keep
their byte order, which is the packed layout's for G = 32::

    block_q4_0 (18 B): [ d f16 | qs 16 B ]            -> int4 sym   g32: scale = d
    block_q4_1 (20 B): [ d f16 | m f16 | qs 16 B ]    -> int4 asym  g32: scale = d, min = m
    block_q8_0 (34 B): [ d f16 | qs 32 x int8 ]       -> int8       g32: scale = d

    a row of K weights = K / 32 blocks  ->  qweight row = the blocks' qs back to back,
                                            scales row  = the blocks' d (and mins row: m)

llama.cpp's Q/K row permutation is undone by reordering ROWS of the three tensors (exact).
"""

from __future__ import annotations

import numpy as np
import torch

from fitserve.quant.packed import PackedWeight

# ggml type name -> (bytes per 32-weight block, offset of the codes, has a min, packed kind)
_BLOCKS: dict[str, tuple[int, int, bool, str]] = {
    "Q4_0": (18, 2, False, "int4"),
    "Q4_1": (20, 4, True, "int4"),
    "Q8_0": (34, 2, False, "int8"),
}
QK = 32  # weights per block in all three types
PACKABLE_GGUF_TYPES: tuple[str, ...] = tuple(_BLOCKS)


def _f16(blocks: np.ndarray, rows: np.ndarray | slice, start: int) -> torch.Tensor:
    """The float16 at byte ``start`` of every block, as ``[N, blocks per row]``."""
    raw = np.ascontiguousarray(blocks[rows, :, start : start + 2])
    return torch.from_numpy(raw.view(np.float16).reshape(raw.shape[0], raw.shape[1]))


def packed_from_gguf(data: np.ndarray, type_name: str, shape: tuple[int, int],
                     row_order: np.ndarray | None = None) -> PackedWeight:
    """The PackedWeight of one GGUF tensor's raw blocks.

    ``data``: the tensor's bytes as the gguf reader gives them (uint8, any shape holding
    ``N x K / 32`` blocks); ``shape``: the logical ``(N, K)``; ``row_order``: output rows to
    take, in order (undoing llama.cpp's Q/K permutation), or None for the file's order.
    Only the packed bytes are copied (out of the memory-mapped file); nothing is dequantized.
    """
    if type_name not in _BLOCKS:
        raise ValueError(f"{type_name} blocks have no packed layout (packable: "
                         f"{', '.join(_BLOCKS)})")
    block_bytes, qs_at, has_min, kind = _BLOCKS[type_name]
    n, k = shape
    if k % QK:
        raise ValueError(f"{type_name} rows of {k} weights are not whole blocks of {QK}")
    nb = k // QK
    flat = np.asarray(data).reshape(-1)
    if flat.dtype != np.uint8 or flat.size != n * nb * block_bytes:
        raise ValueError(f"{type_name} tensor {list(shape)} needs {n * nb * block_bytes} bytes, "
                         f"got {flat.size} x {flat.dtype}")
    blocks = flat.reshape(n, nb, block_bytes)
    rows: np.ndarray | slice = slice(None) if row_order is None else np.asarray(row_order)
    codes = np.ascontiguousarray(blocks[rows, :, qs_at:]).reshape(-1, nb * (block_bytes - qs_at))
    qweight = torch.from_numpy(codes if kind == "int4" else codes.view(np.int8))
    scales = _f16(blocks, rows, 0)
    mins = _f16(blocks, rows, 2) if has_min else None
    return PackedWeight(kind, qweight.shape[0], k, k, QK, qweight, scales, mins)
