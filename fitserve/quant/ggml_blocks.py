"""GGUF weights held as the file's raw ggml blocks, byte for byte (K-quants, Q4/Q5/Q8_0, IQ4, MXFP4).

``GgmlBlockWeight.blocks`` is uint8 ``[N, (K / block_size) * type_size]``: row n is the blocks of
output row n back to back, exactly as ggml stores them (llama.cpp's Q/K row permutation is
undone by moving whole rows). The dequantization below is vectorized torch, exact to
``gguf.quants.dequantize`` bit for bit: the same float32 operations in the same order.

    block_q4_K (144 B, 256 w): d f16 | dmin f16 | scales 12 B (8 x 6-bit scale, 8 x 6-bit min)
                               | qs 128 B (4 chunks of 32 B: low nibbles sub-block 2j, high 2j+1)
        w = (d * sc) * q - (dmin * m)
    block_q5_K (176 B, 256 w): d | dmin | scales 12 B | qh 32 B (bit i: sub-block i) | qs 128 B
    block_q6_K (210 B, 256 w): ql 128 B | qh 64 B | scales 16 x int8 | d f16
        w = (d * scale) * (q - 32)
    block_q4_0 (18 B, 32 w): d | qs 16 B (low nibbles 0-15, high 16-31) w = d * (q - 8)
    block_q4_1 (20 B, 32 w): d | m | qs 16 B                        w = d * q + m
    block_q8_0 (34 B, 32 w): d | qs 32 x int8                      w = d * q
    block_q5_0 (22 B, 32 w): d | qh u32 (bit j: weight j) | qs 16 B    w = d * (q - 16)
    block_q5_1 (24 B, 32 w): d | m | qh u32 | qs 16 B                  w = d * q + m
    block_iq4_nl (18 B, 32 w): d | qs 16 B                             w = d * kvalues[q]
    block_iq4_xs (136 B, 256 w): d | scales_h u16 | scales_l 4 B | qs 128 B
        w = (d * (scale - 32)) * kvalues[q]
    block_mxfp4 (17 B, 32 w): e u8 | qs 16 B                          w = 2^(e-128) * kv[q]
        kv: the e2m1 values doubled (0, 1, 2, 3, 4, 6, 8, 12, then negated), the e8m0 scale
        halved to match (ggml_e8m0_to_fp32_half): the OCP MX value e2m1[q] * 2^(e-127)

    6-bit scales/mins of Q4_K/Q5_K (12 bytes, j = 0..3):
        sc[j] = b[j] & 63          sc[j+4] = (b[j+8] & 15) | ((b[j]   >> 2) & 48)
        m[j]  = b[j+4] & 63        m[j+4]  = (b[j+8] >> 4) | ((b[j+4] >> 2) & 48)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import MXFP4 as _GGUF_MXFP4

from fitserve.quant.held import HeldWeight

# The non-linear 4-bit grid of IQ4_NL / IQ4_XS (gguf.quants.IQ4_NL.kvalues).
IQ4_KVALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


def block_layout(ggml_type: str) -> tuple[int, int]:
    """``(block_size, type_size)``: weights per block and its bytes (gguf.GGML_QUANT_SIZES)."""
    try:
        return GGML_QUANT_SIZES[GGMLQuantizationType[ggml_type]]
    except KeyError:
        raise ValueError(f"unknown ggml type {ggml_type!r}") from None


def _f16(b: torch.Tensor, at: int) -> torch.Tensor:
    """The float16 at byte ``at`` of each block ``b [nb, type_size]`` as float32 ``[nb, 1]``."""
    return b[:, at : at + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor, groups: int) -> torch.Tensor:
    """``qs [nb, groups * n]`` -> ``[nb, groups, 2, n]``: low nibbles, then high nibbles."""
    q = qs.reshape(qs.shape[0], groups, 1, -1)
    return torch.cat([q & 0x0F, q >> 4], dim=2)


def _bits(qh: torch.Tensor, nbits: int, width: int) -> torch.Tensor:
    """``qh [nb, m]`` -> ``[nb, nbits // width, m]``: field i is ``(qh >> i*width) & mask``."""
    shifts = torch.arange(0, nbits, width, dtype=torch.uint8).reshape(1, -1, 1)
    return (qh.unsqueeze(1) >> shifts) & ((1 << width) - 1)


def _scale_min_k4(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 6-bit packed scales / mins of Q4_K and Q5_K: ``s [nb, 12]`` -> two ``[nb, 8]``."""
    d, m, md = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=1)
    return sc, mn


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    nb = b.shape[0]
    sc, mn = _scale_min_k4(b[:, 4:16])
    dl = (_f16(b, 0) * sc.float()).reshape(nb, 8, 1)
    ml = (_f16(b, 2) * mn.float()).reshape(nb, 8, 1)
    q = _nibbles(b[:, 16:144], 4).reshape(nb, 8, 32).float()
    return (dl * q - ml).reshape(nb, 256)


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    nb = b.shape[0]
    sc, mn = _scale_min_k4(b[:, 4:16])
    dl = (_f16(b, 0) * sc.float()).reshape(nb, 8, 1)
    ml = (_f16(b, 2) * mn.float()).reshape(nb, 8, 1)
    ql = _nibbles(b[:, 48:176], 4).reshape(nb, 8, 32)
    qh = _bits(b[:, 16:48], 8, 1)  # [nb, 8, 32]: bit i of byte l is sub-block i, weight l
    q = (ql | (qh << 4)).float()
    return (dl * q - ml).reshape(nb, 256)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    nb = b.shape[0]
    scales = b[:, 192:208].contiguous().view(torch.int8).float()
    dl = (_f16(b, 208) * scales).reshape(nb, 16, 1)
    ql = _nibbles(b[:, 0:128], 2).reshape(nb, 8, 32)  # [nb, 2, 2, 64] -> [nb, 8, 32]
    qh = _bits(b[:, 128:192].reshape(nb * 2, 32), 8, 2).reshape(nb, 8, 32)
    q = ((ql | (qh << 4)).to(torch.int8) - 32).reshape(nb, 16, 16).float()
    return (dl * q).reshape(nb, 256)


def _q5_low_high(b: torch.Tensor, qh_at: int) -> torch.Tensor:
    """The 5-bit codes of a Q5_0 / Q5_1 block (qh at byte ``qh_at``, qs after it): [nb, 32]."""
    nb = b.shape[0]
    ql = _nibbles(b[:, qh_at + 4 : qh_at + 20], 1).reshape(nb, 32)
    qh = _bits(b[:, qh_at : qh_at + 4], 8, 1).transpose(1, 2).reshape(nb, 32)  # byte j//8, bit j%8
    return ql | (qh << 4)


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    q = (_nibbles(b[:, 2:18], 1).reshape(b.shape[0], 32).to(torch.int8) - 8).float()
    return _f16(b, 0) * q


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    return _f16(b, 0) * _nibbles(b[:, 4:20], 1).reshape(b.shape[0], 32).float() + _f16(b, 2)


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    return _f16(b, 0) * b[:, 2:34].contiguous().view(torch.int8).float()


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    q = (_q5_low_high(b, 2).to(torch.int8) - 16).float()
    return _f16(b, 0) * q


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    return _f16(b, 0) * _q5_low_high(b, 4).float() + _f16(b, 2)


def _kvalues(codes: torch.Tensor) -> torch.Tensor:
    table = torch.tensor(IQ4_KVALUES, dtype=torch.float32, device=codes.device)
    return table[codes.long()]


def _iq4_nl(b: torch.Tensor) -> torch.Tensor:
    return _f16(b, 0) * _kvalues(_nibbles(b[:, 2:18], 1).reshape(b.shape[0], 32))


def _iq4_xs(b: torch.Tensor) -> torch.Tensor:
    nb = b.shape[0]
    lo = _nibbles(b[:, 4:8], 4).reshape(nb, 8)  # sub-block i: byte i // 2, nibble i % 2
    hi16 = b[:, 2:4].to(torch.int32)
    hi16 = hi16[:, 0] | (hi16[:, 1] << 8)
    hi = (hi16.unsqueeze(1) >> torch.arange(0, 16, 2, device=b.device)) & 3
    scales = ((lo.to(torch.int32) | (hi << 4)) - 32).float()
    dl = (_f16(b, 0) * scales).reshape(nb, 8, 1)
    q = _kvalues(_nibbles(b[:, 8:136], 8).reshape(nb, 8, 32))
    return (dl * q).reshape(nb, 256)


# The e2m1 grid doubled, as llama.cpp's kvalues_mxfp4 (gguf.quants.MXFP4.kvalues).
MXFP4_KVALUES: tuple[int, ...] = tuple(_GGUF_MXFP4.kvalues)


def e8m0_to_fp32_half(e: torch.Tensor) -> torch.Tensor:
    """2^(e - 128) of uint8 exponents as float32, built from its bits (ggml_e8m0_to_fp32_half:
    e < 2 gives the subnormals 2^-128, 2^-127)."""
    e = e.to(torch.int32)
    bits = torch.where(e < 2, torch.full_like(e, 0x00200000) << e, (e - 1) << 23)
    return bits.view(torch.float32)


def _mxfp4(b: torch.Tensor) -> torch.Tensor:
    table = torch.tensor(MXFP4_KVALUES, dtype=torch.float32, device=b.device)
    q = table[_nibbles(b[:, 1:17], 1).reshape(b.shape[0], 32).long()]
    return e8m0_to_fp32_half(b[:, 0:1]) * q


# ggml type -> its block dequantization ``[nb, type_size] uint8 -> [nb, block_size] float32``
DEQUANTIZERS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k, "Q4_0": _q4_0, "Q4_1": _q4_1, "Q8_0": _q8_0,
    "Q5_0": _q5_0, "Q5_1": _q5_1,
    "IQ4_NL": _iq4_nl, "IQ4_XS": _iq4_xs, "MXFP4": _mxfp4,
}
GGML_BLOCK_TYPES: tuple[str, ...] = tuple(DEQUANTIZERS)


def dequantize_blocks(blocks: torch.Tensor, ggml_type: str) -> torch.Tensor:
    """Rows of raw blocks ``[R, nb * type_size]`` -> float32 ``[R, nb * block_size]``."""
    if ggml_type not in DEQUANTIZERS:
        raise ValueError(f"no block dequantization for {ggml_type} (have: "
                         f"{', '.join(GGML_BLOCK_TYPES)})")
    block_size, type_size = block_layout(ggml_type)
    rows = blocks.shape[0]
    out = DEQUANTIZERS[ggml_type](blocks.reshape(-1, type_size))
    return out.reshape(rows, -1)


@dataclass(frozen=True, slots=True)
class GgmlBlockWeight(HeldWeight):
    """A weight ``[N, K]`` held as its ggml blocks (``blocks`` uint8 ``[N, K/bs * ts]``)."""

    ggml_type: str
    N: int
    K: int
    blocks: torch.Tensor

    def __post_init__(self) -> None:
        block_size, type_size = block_layout(self.ggml_type)
        if self.ggml_type not in DEQUANTIZERS:
            raise ValueError(f"{self.ggml_type} cannot be held as ggml blocks (held types: "
                             f"{', '.join(GGML_BLOCK_TYPES)})")
        if self.K % block_size:
            raise ValueError(f"{self.ggml_type} rows of {self.K} weights are not whole blocks "
                             f"of {block_size}")
        want = (self.N, self.K // block_size * type_size)
        if self.blocks.dtype != torch.uint8 or tuple(self.blocks.shape) != want:
            raise ValueError(f"{self.ggml_type} weight [{self.N}, {self.K}] needs uint8 blocks "
                             f"{list(want)}, got {self.blocks.dtype} {list(self.blocks.shape)}")

    @property
    def block_size(self) -> int:
        return block_layout(self.ggml_type)[0]

    @property
    def type_size(self) -> int:
        return block_layout(self.ggml_type)[1]

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.N, self.K)

    @property
    def format(self) -> str:
        return self.ggml_type  # the formats table's name of a ggml type is the type itself

    @property
    def nbytes(self) -> int:
        return self.blocks.numel()

    @property
    def column_block(self) -> int:
        return self.block_size

    def to(self, device: torch.device | str) -> GgmlBlockWeight:
        return GgmlBlockWeight(self.ggml_type, self.N, self.K, self.blocks.to(device))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_blocks(self.blocks, self.ggml_type).to(dtype)

    def dequantize_rows(self, start: int, stop: int) -> torch.Tensor:
        """Rows ``start:stop`` as float32 (the pure-torch linear path, in bounded chunks)."""
        return dequantize_blocks(self.blocks[start:stop], self.ggml_type)

    def fuse(self, rest: Sequence[HeldWeight]) -> GgmlBlockWeight | None:
        same = [p for p in rest if isinstance(p, GgmlBlockWeight)
                and p.ggml_type == self.ggml_type and p.K == self.K]
        if len(same) != len(rest):
            return None  # types differ (a Q4_K_M file's Q6_K attn_v): ConcatLinear runs them
        blocks = torch.cat([self.blocks, *(p.blocks for p in same)])
        return GgmlBlockWeight(self.ggml_type, blocks.shape[0], self.K, blocks)

    def shard(self, dim: int, start: int, stop: int) -> GgmlBlockWeight:
        if not 0 <= start < stop <= self.shape[dim]:
            raise ValueError(f"shard {start}:{stop} of dim {dim} outside {list(self.shape)}")
        if dim == 0:
            return GgmlBlockWeight(self.ggml_type, stop - start, self.K,
                                   self.blocks[start:stop].clone())
        if dim != 1:
            raise ValueError(f"a weight matrix has dims 0 and 1, not {dim}")
        bs, ts = self.block_size, self.type_size
        if start % bs or stop % bs:
            raise ValueError(f"{self.ggml_type} columns split only on multiples of its block of "
                             f"{bs} weights, not at {start}:{stop}")
        cols = self.blocks[:, start // bs * ts : stop // bs * ts]
        return GgmlBlockWeight(self.ggml_type, self.N, stop - start, cols.contiguous())


def ggml_from_gguf(data: object, ggml_type: str, shape: tuple[int, int],
                   row_order: object | None = None) -> GgmlBlockWeight:
    """The GgmlBlockWeight of one GGUF tensor's raw bytes (``data``: uint8 array as the gguf
    reader gives it); ``row_order``: output rows to take in order (undoing llama.cpp's Q/K
    permutation), or None. Only the bytes are copied out of the memory-mapped file."""
    import numpy as np

    n, k = shape
    block_size, type_size = block_layout(ggml_type)
    flat = np.asarray(data).reshape(-1)
    need = n * (k // block_size) * type_size
    if k % block_size or flat.dtype != np.uint8 or flat.size != need:
        raise ValueError(f"{ggml_type} tensor {list(shape)} needs {need} bytes in whole blocks "
                         f"of {block_size}, got {flat.size} x {flat.dtype}")
    rows = flat.reshape(n, -1)
    # one copy out of the mapped file: the row gather makes it, else an explicit copy
    picked = np.array(rows, copy=True) if row_order is None else rows[np.asarray(row_order)]
    blocks = torch.from_numpy(np.ascontiguousarray(picked))
    return GgmlBlockWeight(ggml_type, blocks.shape[0], k, blocks)
