"""FP8 weights: torch.float8_e4m3fn / float8_e5m2 codes with float32 scales per tensor, per
output channel or per 128 x 128 block (DeepSeek-V3's weight tiles).

Logical weight ``W [N out, K in]``, ``y = x @ W.T``; ``w = scale * float(code)``::

    granularity  scales (float32)                      scale of element (n, k)
    "tensor"     [1]                                   scales[0]
    "channel"    [N]                                   scales[n]
    "block"      [ceil(N / B), ceil(K / B)]            scales[n // B, k // B]

    block, N = 300, K = 260, B = 128: 3 x 3 tiles, the last row/column of tiles ragged
    +--------+--------+----+
    | 128x128| 128x128|128x4|   codes are never padded: N * K bytes whatever the tiles
    +--------+--------+----+
    |        |        |    |
    +--------+--------+----+
    | 44x128 | 44x128 |44x4|
    +--------+--------+----+

``scale = amax / fp8_max`` (float32) over each group, so the group's largest magnitude maps to
the format's largest finite value (e4m3: 448, e5m2: 57344). An all-zero group gets scale 1 and
codes 0 (dequantizes to exactly 0, and the scale stays a usable reciprocal for kernels).

Error bound (checked against float64 in tests/unit/quant/test_quant_fp8.py): with ``x = w / scale``
and round-to-nearest-even into a format of ``m`` mantissa bits (e4m3: 3, e5m2: 2),

    normal   |x| >= 2^emin          |w_hat - w| <= 2^-(m+1) |w|       e4m3: 1/16, e5m2: 1/8
    subnormal |x| < 2^emin          |w_hat - w| <= scale * 2^(emin - m - 1)   (half a step:
                                    e4m3 emin = -6, step 2^-9; e5m2 emin = -14, step 2^-16)

each up to float32 roundings of the quotient and of the dequantizing product (~2^-24 relative);
the sup of the normal relative error is u / (1 + u), u = 2^-(m+1) (reached just below a tie at
the bottom of a binade: e4m3 0.0588, e5m2 0.111).
e5m2 has one mantissa bit fewer (twice the error bound) but a 2^7 larger max (57344 vs 448) and
a 2^15 larger dynamic range (max / smallest normal: 2^29.8 vs 2^14.8).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from fitserve.quant.held import HeldWeight

FORMATS: dict[str, torch.dtype] = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
GRANULARITIES = ("tensor", "channel", "block")
MANTISSA_BITS: dict[str, int] = {"e4m3": 3, "e5m2": 2}
DEFAULT_BLOCK = 128
# Rows quantized / dequantized at once: bounds the float64 scratch to ~1M elements (8 MiB).
_CHUNK_ELEMENTS = 1 << 20


def fp8_dtype(fmt: str) -> torch.dtype:
    """The torch dtype of ``"e4m3"`` (float8_e4m3fn) or ``"e5m2"`` (float8_e5m2)."""
    if fmt not in FORMATS:
        raise ValueError(f"fp8 format must be one of {tuple(FORMATS)}, got {fmt!r}")
    return FORMATS[fmt]


def fp8_max(fmt: str) -> float:
    """The largest finite value of the format (448 for e4m3, 57344 for e5m2)."""
    return float(torch.finfo(fp8_dtype(fmt)).max)


def fp8_min_normal(fmt: str) -> float:
    """The smallest positive normal value: 2^-6 (e4m3), 2^-14 (e5m2)."""
    return float(torch.finfo(fp8_dtype(fmt)).smallest_normal)


def relative_error_bound(fmt: str) -> float:
    """Half an ulp relative to a normal value: 2^-(mantissa bits + 1)."""
    return 2.0 ** -(MANTISSA_BITS[fmt] + 1)


def subnormal_error_bound(fmt: str) -> float:
    """Half the subnormal step in scaled units (multiply by the scale): 2^(emin - m - 1)."""
    return fp8_min_normal(fmt) * 2.0 ** -(MANTISSA_BITS[fmt] + 1)


def scale_shape(n: int, k: int, granularity: str, block: int = DEFAULT_BLOCK) -> tuple[int, ...]:
    """The shape of the float32 scales of an ``[n, k]`` weight (see the module docstring)."""
    if granularity == "tensor":
        return (1,)
    if granularity == "channel":
        return (n,)
    if granularity == "block":
        if block <= 0:
            raise ValueError(f"block must be positive, got {block}")
        return (-(-n // block), -(-k // block))
    raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")


def fp8_weight_bytes(n: int, k: int, granularity: str, block: int = DEFAULT_BLOCK) -> int:
    """Bytes an fp8 weight ``[n, k]`` holds: ``n * k`` one-byte codes (never padded) plus 4
    bytes per float32 scale (1, ``n`` or ``ceil(n / B) * ceil(k / B)``); equals
    ``Fp8Weight.nbytes``."""
    count = 1
    for d in scale_shape(n, k, granularity, block):
        count *= d
    return n * k + 4 * count


# the formats table's names by granularity (e4m3; e5m2 names add "_e5m2" after "fp8")
_TABLE_SUFFIX = {"tensor": "", "channel": "-ch", "block": "-block"}


@dataclass(frozen=True, slots=True)
class Fp8Weight(HeldWeight):
    """One fp8 weight matrix ``[N, K]``: codes ``data`` (float8 or their uint8 bits) and float32
    ``scales`` shaped per ``granularity`` (see the module docstring)."""

    fmt: str
    granularity: str
    N: int
    K: int
    data: torch.Tensor
    scales: torch.Tensor
    block: int = DEFAULT_BLOCK

    def __post_init__(self) -> None:
        fp8_dtype(self.fmt)
        want = scale_shape(self.N, self.K, self.granularity, self.block)
        if self.data.dtype not in (torch.uint8, FORMATS[self.fmt]):
            raise ValueError(f"{self.fmt} data must be uint8 or {FORMATS[self.fmt]}, got "
                             f"{self.data.dtype}")
        if tuple(self.data.shape) != (self.N, self.K):
            raise ValueError(f"data must be [{self.N}, {self.K}], got {list(self.data.shape)}")
        if tuple(self.scales.shape) != want or self.scales.dtype != torch.float32:
            raise ValueError(f"{self.granularity} scales must be float32 {list(want)}, got "
                             f"{self.scales.dtype} {list(self.scales.shape)}")

    @property
    def shape(self) -> tuple[int, int]:
        """The logical shape ``(N, K)``."""
        return (self.N, self.K)

    @property
    def format(self) -> str:
        """``fp8-ch``, ``fp8_e5m2-ch``, ``fp8``, ``fp8-block`` ... (fitserve.ledger.formats)."""
        return ("fp8" if self.fmt == "e4m3" else f"fp8_{self.fmt}") + _TABLE_SUFFIX[
            self.granularity]

    def to(self, device: torch.device | str) -> Fp8Weight:
        return Fp8Weight(self.fmt, self.granularity, self.N, self.K, self.data.to(device),
                         self.scales.to(device), self.block)

    def fuse(self, rest: Sequence[HeldWeight]) -> Fp8Weight | None:
        """Per-channel weights of one format and K stack exactly (each row keeps its scale)."""
        parts = [self, *(p for p in rest if isinstance(p, Fp8Weight))]
        if len(parts) != len(rest) + 1 or self.granularity != "channel" or len(
                {(p.fmt, p.granularity, p.K) for p in parts}) != 1:
            return None
        return Fp8Weight(self.fmt, "channel", sum(p.N for p in parts), self.K,
                         torch.cat([p.data for p in parts]), torch.cat([p.scales for p in parts]))

    def shard(self, dim: int, start: int, stop: int) -> Fp8Weight:
        raise ValueError("fp8 weights are not supported under tensor parallelism")

    @property
    def codes(self) -> torch.Tensor:
        """The codes as the float8 dtype (a view: uint8 bits are reinterpreted, not converted)."""
        dt = FORMATS[self.fmt]
        return self.data if self.data.dtype == dt else self.data.view(dt)

    @property
    def nbytes(self) -> int:
        """Bytes held: the codes (1 byte each) plus the float32 scales."""
        return (self.data.numel() * self.data.element_size()
                + self.scales.numel() * self.scales.element_size())

    def row_scales(self, r0: int, r1: int) -> torch.Tensor:
        """The scale of each element of rows ``r0:r1``, broadcastable to ``[r1 - r0, K]``."""
        if self.granularity == "tensor":
            return self.scales.reshape(1, 1)
        if self.granularity == "channel":
            return self.scales[r0:r1].unsqueeze(1)
        b = self.block
        tiles = self.scales[r0 // b : -(-r1 // b)]
        full = tiles.repeat_interleave(b, dim=0).repeat_interleave(b, dim=1)
        off = r0 - (r0 // b) * b
        return full[off : off + (r1 - r0), : self.K]

    def dequantize_rows(self, r0: int, r1: int, dtype: torch.dtype = torch.float32
                        ) -> torch.Tensor:
        """Rows ``r0:r1`` of the weight: ``float(code) * scale`` in float32 (float64 when
        ``dtype`` is float64, where the product is exact), then cast to ``dtype``."""
        work = torch.float64 if dtype == torch.float64 else torch.float32
        bits = self.data[r0:r1]
        half = codes_as_f16(bits if bits.dtype == torch.uint8 else bits.view(torch.uint8),
                            self.fmt)
        w = half.to(work) * (self.row_scales(r0, r1).to(work) * F16_FACTOR[self.fmt])
        return w if w.dtype == dtype else w.to(dtype)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight ``[N, K]`` in ``dtype`` (see ``dequantize_rows``)."""
        return self.dequantize_rows(0, self.N, dtype)


# code value = float16 of codes_as_f16 x this factor (exact powers of two)
F16_FACTOR: dict[str, float] = {"e4m3": 256.0, "e5m2": 1.0}


def codes_as_f16(bits: torch.Tensor, fmt: str) -> torch.Tensor:
    """fp8 codes (their uint8 bits) as float16 by bit moves alone, exact for every finite code:
    e5m2 is float16's top byte; e4m3 keeps sign, exponent and mantissa in float16's layout and
    reads as the value x 2^-8 (bias 7 vs 15; e4m3 subnormals land on float16 subnormals).

    NOTE: 4.5x faster than torch's own e4m3 -> float32 cast on this CPU (1.9 vs 8.7 ms for
    1536 x 576, one thread). e4m3fn's NaN codes (0x7F, 0xFF; never emitted by quantize_fp8, but
    a loaded checkpoint may hold them) read as NaN, as in torch's cast and the C++ kernel
    (fitserve/kernels/cpu/fp8_gemv.cpp): their bits 0x3F80 | 0x7E00 are a float16 NaN.
    """
    i = bits.to(torch.int16)
    if fmt == "e5m2":
        return (i << 8).view(torch.float16)
    mag = i & 0x7F
    nan = (mag == 0x7F).to(torch.int16) * 0x7E00
    return (((i & 0x80) << 8) | (mag << 7) | nan).view(torch.float16)


def _group_amax(w: torch.Tensor, granularity: str, block: int) -> torch.Tensor:
    """max |w| per scale group, float64, shaped like the scales."""
    a = w.abs()
    if granularity == "tensor":
        return a.amax().reshape(1).to(torch.float64)
    if granularity == "channel":
        return a.amax(dim=1).to(torch.float64)
    n, k = w.shape
    nb, kb = scale_shape(n, k, "block", block)
    padded = torch.zeros(nb * block, kb * block, dtype=a.dtype, device=a.device)
    padded[:n, :k] = a
    return padded.reshape(nb, block, kb, block).amax(dim=(1, 3)).to(torch.float64)


def _scales(amax: torch.Tensor, fmt: str) -> torch.Tensor:
    """float32 ``amax / fp8_max``; 1 for an all-zero group, the smallest float32 subnormal
    where a positive amax would underflow to 0."""
    s = (amax / fp8_max(fmt)).to(torch.float32)
    tiny = torch.full_like(s, torch.finfo(torch.float32).smallest_normal * 2.0**-23)
    s = torch.where((s == 0) & (amax > 0), tiny, s)
    return torch.where(amax == 0, torch.ones_like(s), s)


def quantize_fp8(w: torch.Tensor, fmt: str = "e4m3", granularity: str = "channel",
                 block: int = DEFAULT_BLOCK) -> Fp8Weight:
    """Round-to-nearest fp8 of ``w [N, K]`` with float32 scales per ``granularity``.

    Codes are ``round(clamp(w / scale, -max, max))``: the quotient in float64 (a row chunk at a
    time), clamped first.
    NOTE: clamped before the cast: torch's cast is not saturating in general (e5m2 turns
    anything from 61440 up into inf; e4m3fn saturates to 448 on this CPU build, NaN is its only
    other choice), and the float32 scale ``amax / max`` may round down so that ``amax / scale``
    exceeds ``max`` by an ulp; the clamp makes the codes finite whatever the build does.
    """
    if w.dim() != 2:
        raise ValueError(f"fp8 weights are 2-d [N, K], got shape {list(w.shape)}")
    if not bool(torch.isfinite(w).all()):
        raise ValueError("cannot quantize a weight with inf/nan values")
    dt, top = fp8_dtype(fmt), fp8_max(fmt)
    n, k = w.shape
    scales = _scales(_group_amax(w, granularity, block), fmt)
    shell = Fp8Weight(fmt, granularity, n, k, torch.zeros(n, k, dtype=torch.uint8,
                                                          device=w.device), scales, block)
    data = shell.data
    step = max(1, _CHUNK_ELEMENTS // max(k, 1))
    if granularity == "block":
        step = max(block, step // block * block)  # whole tiles per chunk
    for r0 in range(0, n, step):
        r1 = min(n, r0 + step)
        x = w[r0:r1].to(torch.float64) / shell.row_scales(r0, r1).to(torch.float64)
        data[r0:r1] = x.clamp(-top, top).to(dt).view(torch.uint8)
    return shell


def fp8_linear_reference(x: torch.Tensor, fw: Fp8Weight) -> torch.Tensor:
    """``x @ W_hat.T`` in float64 with the exact dequantized weight (tests' reference)."""
    return x.to(torch.float64) @ fw.dequantize(torch.float64).T
