"""Round-to-nearest (RTN) quantizers: float weights -> PackedWeight, no calibration data.

Per group of G columns (after zero-padding K to ``K_padded``):

    int4 asym:  min = f16 rounded DOWN of min(w);  scale = f16 rounded UP of (max(w) - min) / 15
                q = clamp(round((w - min) / scale), 0, 15)      =>  min <= w <= min + 15 * scale
    int4 sym:   scale = f16 rounded UP of max(-min(w) / 8, max(w) / 7)
                q = clamp(round(w / scale) + 8, 0, 15)          =>  -8 scale <= w <= 7 scale
    int8:       scale = f16 rounded UP of max|w| / 127,  q = clamp(round(w / scale), -127, 127)

Rounding the stored scale up (and the min down) keeps every weight inside the range the codes
cover, so ``|w - w_hat| <= scale / 2`` holds for the scale that is stored, element by element.
A positive scale that would underflow float16 becomes the smallest subnormal (2**-24); an
all-zero group gets scale 0 and codes that dequantize to exactly 0.
"""

from __future__ import annotations

import torch

from fitserve.quant.packed import PackedWeight, channel_group, pack, padded_k

GROUP_SIZES = (32, 64, 128)
_F16_MAX = 65504.0
# NOTE: the codes are chosen in float64 (a row chunk at a time, to bound the scratch): a float32
# division can land a value a hair on the wrong side of a .5 tie and break the bound by an ulp.
_ROW_CHUNK = 2048


def f16_round_up(x: torch.Tensor) -> torch.Tensor:
    """The smallest float16 >= x (x >= 0, finite); positive values never become 0."""
    h = x.to(torch.float16)
    low = h.to(x.dtype) < x
    h = torch.where(low, torch.nextafter(h, torch.full_like(h, float("inf"))), h)
    return h


def f16_round_down(x: torch.Tensor) -> torch.Tensor:
    """The largest float16 <= x (finite x)."""
    h = x.to(torch.float16)
    high = h.to(x.dtype) > x
    return torch.where(high, torch.nextafter(h, torch.full_like(h, float("-inf"))), h)


def _check_range(w: torch.Tensor) -> None:
    if not bool(torch.isfinite(w).all()):
        raise ValueError("cannot quantize a weight with inf/nan values")
    if w.numel() and float(w.abs().max()) > _F16_MAX / 2:
        raise ValueError(f"weights beyond +-{_F16_MAX / 2:g} do not fit float16 scales/mins")


def _groups(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """float64 ``[R, K_padded / G, G]`` view of ``w`` zero-padded to whole groups."""
    r, k = w.shape
    kp = padded_k(k, group_size)
    wp = torch.zeros(r, kp, dtype=torch.float64)
    wp[:, :k] = w.to(torch.float64)
    return wp.reshape(r, kp // group_size, group_size)


def _codes(w: torch.Tensor, offset: torch.Tensor, scale: torch.Tensor, lo: int,
           hi: int) -> torch.Tensor:
    """round((w - offset) / scale) clamped to [lo, hi]; 0 where the scale is 0."""
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round((w - offset) / safe).clamp(lo, hi)
    return torch.where(scale > 0, q, torch.zeros_like(q))


def _int4_chunk(g: torch.Tensor, symmetric: bool) -> tuple[torch.Tensor, ...]:
    lo, hi = g.amin(-1), g.amax(-1)
    if symmetric:
        s16 = f16_round_up(torch.maximum(torch.clamp(-lo, min=0) / 8, torch.clamp(hi, min=0) / 7))
        s = s16.to(torch.float64).unsqueeze(-1)
        q = _codes(g, torch.zeros_like(s), s, -8, 7) + 8
        # an all-zero group: scale 0, q = 8 so that scale * (q - 8) = 0 exactly
        q = torch.where(s > 0, q, torch.full_like(q, 8.0))
        return q, s16
    m16 = f16_round_down(lo)
    m = m16.to(torch.float64)
    s16 = f16_round_up((hi - m) / 15)
    q = _codes(g, m.unsqueeze(-1), s16.to(torch.float64).unsqueeze(-1), 0, 15)
    return q, s16, m16


def quantize_int4(w: torch.Tensor, group_size: int = 32, *, symmetric: bool = False) -> PackedWeight:
    """RTN int4 of ``w [N, K]`` in groups of ``group_size`` (32, 64 or 128)."""
    if group_size not in GROUP_SIZES:
        raise ValueError(f"int4 group size must be one of {GROUP_SIZES}, got {group_size}")
    _check_range(w)
    n, k = w.shape
    qs, scales, mins = [], [], []
    for r0 in range(0, n, _ROW_CHUNK):
        out = _int4_chunk(_groups(w[r0 : r0 + _ROW_CHUNK], group_size), symmetric)
        qs.append(out[0].reshape(out[0].shape[0], -1).to(torch.uint8))
        scales.append(out[1])
        if not symmetric:
            mins.append(out[2])
    return pack("int4", torch.cat(qs), torch.cat(scales), None if symmetric else torch.cat(mins),
                group_size, k)


def quantize_int8(w: torch.Tensor, group_size: int | None = None) -> PackedWeight:
    """RTN int8 of ``w [N, K]``: per output channel (``group_size=None``) or per group."""
    _check_range(w)
    n, k = w.shape
    g = channel_group(k) if group_size is None else group_size
    if g <= 0 or g % 32:
        raise ValueError(f"int8 group size must be a positive multiple of 32, got {g}")
    qs, scales = [], []
    for r0 in range(0, n, _ROW_CHUNK):
        grp = _groups(w[r0 : r0 + _ROW_CHUNK], g)
        s16 = f16_round_up(grp.abs().amax(-1) / 127)
        q = _codes(grp, torch.zeros(()), s16.to(torch.float64).unsqueeze(-1), -127, 127)
        qs.append(q.reshape(q.shape[0], -1).to(torch.int8))
        scales.append(s16)
    return pack("int8", torch.cat(qs), torch.cat(scales), None, g, k)


def quantize(w: torch.Tensor, fmt: str) -> PackedWeight:
    """RTN ``w`` into a packed format of the formats table (``int4-g32-asym``, ``int8-ch`` ...)."""
    from fitserve.ledger.formats import weight_format

    layout = weight_format(fmt).packed
    if layout is None:
        raise ValueError(f"{fmt} is not a packed format the engine holds")
    if layout.kind == "int4":
        return quantize_int4(w, layout.group_size, symmetric=layout.symmetric)
    return quantize_int8(w, layout.group_size or None)
