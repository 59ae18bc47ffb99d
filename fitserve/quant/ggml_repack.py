"""GGUF blocks rewritten, exactly, as the blocks of a type the engine holds as stored (or packs).

Where a type's values are a subset of another held type's, the loader converts the file's bytes
(numpy, block by block) instead of dequantizing them: the weight keeps its quantized size and
runs on that type's kernels (every ISA tier, the M > 1 tiles, experts, tensor parallel), and
``gguf.quants.dequantize`` of the new blocks equals that of the file's bit for bit (the same
float32 products of the same f16 scale, int8 sub-scale and integer code). The ledger prices
such tensors in the target type (``fitserve.ledger.formats.GGML_REPACKED``).

    Q3_K (110 B / 256 w): hmask 32 B | qs 64 B | scales 12 B (16 x 6-bit) | d f16
        w = (d * (sc - 32)) * (q - 4 * (1 - h)), q 2-bit from qs, h the hmask bit, per 16 columns
    -> Q6_K (210 B / 256 w): ql 128 B | qh 64 B | scales 16 x int8 | d f16
        w = (d * scale) * (q6 - 32):  scale = sc - 32 in [-32, 31], q6 = q' + 32 in [28, 35]

Held as Q6_K a Q3_K weight takes 1.9x the file's bytes (4.65x as bf16).

    TQ1_0 (54 B / 256 w, base-3 packed) and TQ2_0 (66 B / 256 w, 2-bit): w = d * t, t in -1..1
    (TQ2_0's code 3: 2), one f16 d per 256
    -> Q4_0 (18 B / 32 w): w = d * (q - 8): the same d in each of the 8 blocks, q = t + 8

Held as Q4_0 (the engine's packed int4-g32-sym) a ternary weight takes 2.2-2.7x the file's
bytes (7.8-9.5x as bf16).
"""

from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

QK_K = 256
Q3K_BYTES, Q6K_BYTES = 110, 210


def q3k_fields(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(d as f16 bytes [n, 2], scales int8 [n, 16] = sc - 32, codes int8 [n, 256] in -4..3) of
    Q3_K blocks ``[n, 110]``, the codes in column order: gguf.quants.Q3_K's own unpacking.

    The 12 scale bytes hold sixteen 6-bit scales: the low nibbles of bytes 0-7 are scales 0-7,
    their high nibbles scales 8-15; bytes 8-11 give each scale its top two bits (byte 8 + j % 4,
    bits 2 (j // 4) ..)."""
    n = blocks.shape[0]
    hmask, qs, scales, d = np.hsplit(blocks, [32, 96, 108])
    low = (scales[:, :8].reshape(n, 1, 8) >> np.array([0, 4], np.uint8).reshape(1, 2, 1))
    high = (scales[:, 8:].reshape(n, 1, 4) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 4, 1))
    sc = (low.reshape(n, 16) & np.uint8(0x0F)) | ((high.reshape(n, 16) & np.uint8(3)) << 4)
    ql = qs.reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
    qh = hmask.reshape(n, 1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)
    q = (ql.reshape(n, QK_K) & np.uint8(3)).astype(np.int8) \
        - (((qh.reshape(n, QK_K) & np.uint8(1)) ^ np.uint8(1)) << 2).astype(np.int8)
    return np.ascontiguousarray(d), (sc.astype(np.int8) - np.int8(32)), q


def q6k_blocks(d: np.ndarray, scales: np.ndarray, codes: np.ndarray) -> np.ndarray:
    """Q6_K blocks ``[n, 210]`` of f16 ``d`` bytes [n, 2], int8 ``scales`` [n, 16] and codes
    [n, 256] in -32..31 (column order): the inverse of gguf.quants.Q6_K's unpacking.

    Column 32 t + l (t = 4 h + s, h the 128-column half) takes the low nibble of ql[64 h + l +
    32 (s % 2)] (s < 2) or its high nibble (s >= 2), and bits 2 s .. 2 s + 1 of qh[32 h + l]."""
    n = d.shape[0]
    q6 = (codes.astype(np.int16) + 32).astype(np.uint8).reshape(n, 2, 4, 32)  # [n, h, s, l]
    low, high = q6 & np.uint8(0x0F), q6 >> 4
    ql = low[:, :, 0:2, :].reshape(n, 2, 64) | (low[:, :, 2:4, :].reshape(n, 2, 64) << 4)
    qh = (high << (2 * np.arange(4, dtype=np.uint8)).reshape(1, 1, 4, 1)).sum(
        axis=2, dtype=np.uint8)
    return np.concatenate([ql.reshape(n, 128), qh.reshape(n, 64), scales.view(np.uint8), d],
                          axis=1)


def q3k_as_q6k(data: np.ndarray) -> np.ndarray:
    """A Q3_K tensor's bytes ``[rows, k / 256 * 110]`` (uint8, any leading shape flattened to
    rows) as Q6_K bytes ``[rows, k / 256 * 210]``, the same values exactly."""
    a = np.asarray(data)
    if a.dtype != np.uint8 or a.ndim != 2 or a.shape[1] % Q3K_BYTES:
        raise ValueError(f"Q3_K bytes must be uint8 [rows, k / 256 * {Q3K_BYTES}], got "
                         f"{list(a.shape)} x {a.dtype}")
    rows = a.shape[0]
    d, scales, codes = q3k_fields(a.reshape(-1, Q3K_BYTES))
    return q6k_blocks(d, scales, codes).reshape(rows, -1)


def ternary_as_q4_0(data: np.ndarray, stored: str) -> np.ndarray:
    """A TQ1_0 / TQ2_0 tensor's bytes ``[rows, k / 256 * B]`` as Q4_0 bytes ``[rows, k / 32 * 18]``,
    the same values exactly. The codes come from gguf.quants' own unpacking of the blocks with d
    set to 1 (its d * t is then t itself, exactly); d is the block's own f16."""
    qtype = GGMLQuantizationType[stored]
    _, block_bytes = GGML_QUANT_SIZES[qtype]
    a = np.asarray(data)
    if a.dtype != np.uint8 or a.ndim != 2 or a.shape[1] % block_bytes:
        raise ValueError(f"{stored} bytes must be uint8 [rows, k / 256 * {block_bytes}], got "
                         f"{list(a.shape)} x {a.dtype}")
    blocks = a.reshape(-1, block_bytes).copy()
    d = blocks[:, -2:].copy()  # both types end with their f16 d
    blocks[:, -2:] = np.array([1.0], np.float16).view(np.uint8)
    t = np.asarray(dequantize(blocks, qtype), np.float32).reshape(-1, QK_K // 32, 32)
    q4 = (t.astype(np.int8) + np.int8(8)).astype(np.uint8)  # 7..10
    qs = q4[:, :, :16] | (q4[:, :, 16:] << 4)  # Q4_0: low nibbles columns 0-15, high 16-31
    out = np.concatenate([np.broadcast_to(d[:, None, :], (*qs.shape[:2], 2)), qs], axis=2)
    return np.ascontiguousarray(out).reshape(a.shape[0], -1)


# type as stored -> (type held, bytes of one stored block of 256, the conversion of a
# [rows, bytes] array of its blocks)
REPACKS = {
    "Q3_K": ("Q6_K", Q3K_BYTES, q3k_as_q6k),
    "TQ1_0": ("Q4_0", 54, lambda a: ternary_as_q4_0(a, "TQ1_0")),
    "TQ2_0": ("Q4_0", 66, lambda a: ternary_as_q4_0(a, "TQ2_0")),
}


def repacked(data: np.ndarray, stored: str, held: str, shape: tuple[int, int]) -> np.ndarray:
    """The file's blocks of a ``shape`` [rows, k] tensor stored as ``stored``, as ``held``
    blocks [rows, bytes per row] (``REPACKS``)."""
    target, block_bytes, convert = REPACKS[stored]
    if target != held:
        raise ValueError(f"{stored} is repacked as {target}, not {held}")
    rows, k = shape
    flat = np.asarray(data).reshape(-1)
    need = rows * (k // QK_K) * block_bytes
    if k % QK_K or flat.dtype != np.uint8 or flat.size != need:
        raise ValueError(f"{stored} tensor {list(shape)} needs {need} bytes in whole blocks of "
                         f"{QK_K}, got {flat.size} x {flat.dtype}")
    return convert(flat.reshape(rows, -1))
