"""Pre-quantized Hugging Face weights (compressed-tensors pack-quantized, GPTQ, AWQ) into the
engine's packed layouts, as stored (``fitserve.loading.hf_quant_config`` reads the config).

Each writer stores, per weight ``W [N, K]``, unsigned b-bit codes ``q``, scales ``s`` and zero
points ``z`` per group of input columns, meaning ``w = s * (q - z)``; they differ in how the
codes are packed into int32 words (field ``i`` of a word is bits ``i*b .. i*b+b-1``)::

    compressed-tensors  weight_packed [N, ceil(K*b/32)]: along a row, codes q = stored + 2^(b-1)
                        weight_zero_point [ceil(N*b/32), K/G]: along the output rows, offset
                        as the codes (asymmetric only)
    GPTQ                qweight [K*b/32, N]: along the input rows; qzeros [K/G, N*b/32] along
                        the outputs, each zero minus 1 (v1; gptq_v2: as is); g_idx [K] the group
                        of each input column
    AWQ (GEMM)          qweight [K, N/8], qzeros [K/G, N/8]: 8 output columns per word in the
                        order 0 2 4 6 1 3 5 7 (field i holds column AWQ_ORDER[i])

Held as (``held_format``):

    4-bit, z = 8 everywhere   int4-g<G>-sym     codes q, f16 s: w = s * (q - 8)      exact
    4-bit, other z            int4-g<G>-asym    codes q, f16 s, f16 min = -s * z   (Q4_1-style;
                                                or 15 - q, -s, s * (15 - z): see _packed)
    8-bit, z = 2^7            int8-g<G> / -ch   codes q - 128, f16 s               exact
    no engine layout          dense             s * (q - z) in float32, cast to the model dtype

NOTE: the engine's scales and mins are float16. GPTQ/AWQ scales are float16 already;
compressed-tensors stores them in the model dtype (bf16: exact in f16 above 2^-14). A min
``-s * z`` (or its flipped form) that does not fit an f16 (f16 scales times an odd zero point)
is rounded once to the nearest f16 (error at most 2^-12 of |s * z|, under 1% of one
quantization step); ``Rounding`` counts the groups rounded (the loader logs it once per
checkpoint): exact wherever none is (always for bf16 scales).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from fitserve.ledger.formats import weight_format
from fitserve.ledger.prequant import QuantScheme, held_format
from fitserve.quant.held import HeldTensor, dtype_table_name
from fitserve.quant.packed import CODES, PackedWeight, channel_group, padded_k
from fitserve.quant.permuted import InputPermutedWeight

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
AWQ_REVERSE = (0, 4, 1, 5, 2, 6, 3, 7)  # column j of a word is field AWQ_REVERSE[j]
# the tensors each writer stores per quantized Linear ("<module>.<part>")
CT_PARTS = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx")
GPTQ_PARTS = ("qweight", "qzeros", "scales", "g_idx")
AWQ_PARTS = ("qweight", "qzeros", "scales")
PARTS = {"compressed-tensors": CT_PARTS, "gptq": GPTQ_PARTS, "awq": AWQ_PARTS}


@dataclass(slots=True)
class Unpacked:
    """One weight's codes and group parameters, rows = output channels.

    ``codes [N, K]`` unsigned, ``zeros [N, groups]`` integers (the midpoint 2^(b-1) where the
    scheme is symmetric), ``scales [N, groups]`` float; ``g_idx [K]`` the group of each input
    column (None: column k is in group k // G).
    """

    codes: torch.Tensor
    zeros: torch.Tensor
    scales: torch.Tensor
    g_idx: torch.Tensor | None = None


def unpack_words(words: torch.Tensor, bits: int, dim: int,
                 order: tuple[int, ...] | None = None) -> torch.Tensor:
    """The unsigned ``bits``-bit fields of int32 ``words`` laid out along ``dim`` (0 or 1):
    ``[R, C]`` -> ``[R * 32/b, C]`` or ``[R, C * 32/b]``; ``order``: the field each position
    of a word holds (AWQ), else field i is position i."""
    per = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int64, device=words.device)
    fields = (words.to(torch.int64).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [R, C, per]
    if order is not None:
        fields = fields[..., list(order)]
    r, c = words.shape
    if dim == 1:
        return fields.reshape(r, c * per)
    return fields.permute(0, 2, 1).reshape(r * per, c)


def unpack_compressed_tensors(parts: Mapping[str, torch.Tensor], scheme: QuantScheme
                              ) -> Unpacked:
    """compressed-tensors pack-quantized tensors of one weight (``CT_PARTS``)."""
    n, k = (int(v) for v in parts["weight_shape"].tolist())
    b, mid = scheme.bits, 1 << (scheme.bits - 1)
    codes = unpack_words(parts["weight_packed"], b, 1)[:, :k]
    scales = parts["weight_scale"].reshape(n, -1)
    zeros = torch.full(scales.shape, mid, dtype=torch.int64)
    if not scheme.symmetric:
        # NOTE: group/channel zero points are packed along the rows (dim 0), offset like codes
        zeros = unpack_words(parts["weight_zero_point"], b, 0)[:n]
    g_idx = parts.get("weight_g_idx")
    return Unpacked(codes, zeros, scales, None if g_idx is None else g_idx.to(torch.int64))


def unpack_gptq(parts: Mapping[str, torch.Tensor], scheme: QuantScheme, k: int) -> Unpacked:
    """GPTQ tensors of one weight (``GPTQ_PARTS``); ``k`` the logical input width."""
    b = scheme.bits
    codes = unpack_words(parts["qweight"], b, 0)[:k].T
    zeros = unpack_words(parts["qzeros"], b, 1).T + scheme.zero_offset
    scales = parts["scales"].T
    n = scales.shape[0]
    g_idx = parts.get("g_idx")
    return Unpacked(codes.contiguous(), zeros[:n].contiguous(), scales.contiguous(),
                    None if g_idx is None else g_idx.to(torch.int64))


def unpack_awq(parts: Mapping[str, torch.Tensor], scheme: QuantScheme) -> Unpacked:
    """AWQ GEMM tensors of one weight (``AWQ_PARTS``)."""
    codes = unpack_words(parts["qweight"], scheme.bits, 1, AWQ_REVERSE).T
    zeros = unpack_words(parts["qzeros"], scheme.bits, 1, AWQ_REVERSE).T
    return Unpacked(codes.contiguous(), zeros.contiguous(), parts["scales"].T.contiguous())


def unpack_parts(parts: Mapping[str, torch.Tensor], scheme: QuantScheme, k: int) -> Unpacked:
    """The codes and group parameters of one weight as ``scheme.method`` stores them."""
    if scheme.method == "gptq":
        return unpack_gptq(parts, scheme, k)
    if scheme.method == "awq":
        return unpack_awq(parts, scheme)
    return unpack_compressed_tensors(parts, scheme)


def dequantize_stored(u: Unpacked, group: int) -> torch.Tensor:
    """``s * (q - z)`` in float64, exactly: ``[N, K]`` (``group`` 0: one per row)."""
    k = u.codes.shape[1]
    cols = u.g_idx if u.g_idx is not None else torch.arange(k) // (group or k)
    q = u.codes.to(torch.float64) - u.zeros.to(torch.float64)[:, cols]
    return q * u.scales.to(torch.float64)[:, cols]


@dataclass(slots=True)
class Rounding:
    """Scales and mins an f16 could not hold exactly, over the weights converted."""

    rounded: int = 0
    total: int = 0
    worst: float = 0.0  # largest relative error

    def add(self, exact: torch.Tensor, held: torch.Tensor) -> None:
        e, h = exact.to(torch.float64), held.to(torch.float64)
        bad = h != e
        self.total += bad.numel()
        if bool(bad.any()):
            self.rounded += int(bad.sum())
            rel = ((h - e).abs() / e.abs().clamp_min(1e-30))[bad]
            self.worst = max(self.worst, float(rel.max()))


def convert(name: str, parts: Mapping[str, torch.Tensor], scheme: QuantScheme,
            shape: tuple[int, int], dtype: torch.dtype,
            rounding: Rounding | None = None) -> HeldTensor:
    """One stored weight held in its engine format (``held_format``): a PackedWeight (inside an
    InputPermutedWeight for act-order), or a dense ``dtype`` tensor. ValueError for tensors
    that disagree with the scheme or the model's shape."""
    n, k = shape
    u = unpack_parts(parts, scheme, k)
    if tuple(u.codes.shape) != (n, k) or u.zeros.shape != u.scales.shape:
        raise ValueError(f"{scheme.method} tensors unpack to codes {list(u.codes.shape)}, zero "
                         f"points {list(u.zeros.shape)}, scales {list(u.scales.shape)}; the model "
                         f"wants [{n}, {k}]")
    layout = weight_format(held_format(scheme, k, dtype_table_name(dtype))).packed
    if layout is None:  # NOTE: exact in float32 (at most 20 significant bits), then cast
        return dequantize_stored(u, scheme.group_size).to(torch.float32).to(dtype)
    mid = 1 << (scheme.bits - 1)
    if scheme.symmetric and not bool((u.zeros == mid).all()):
        raise ValueError(f"symmetric {scheme.method} weight with zero points other than {mid}")
    plain = torch.arange(k) // (scheme.group_size or k)
    if u.g_idx is not None and not scheme.act_order and not torch.equal(u.g_idx, plain):
        raise ValueError("g_idx reorders the groups, but the config does not say act-order "
                         "(desc_act / actorder 'group')")
    perm = None
    if scheme.act_order and scheme.group_size:  # columns sorted by group (quant.permuted)
        g_idx = plain if u.g_idx is None else u.g_idx
        perm = torch.sort(g_idx, stable=True).indices
        g = scheme.group_size
        want = torch.full((u.scales.shape[1],), g)
        want[-1] = k - g * (len(want) - 1)
        if not torch.equal(torch.bincount(g_idx, minlength=len(want)), want):
            raise ValueError(f"{scheme.method} g_idx does not give each group {g} columns (the "
                             "last the rest)")
        u = Unpacked(u.codes[:, perm], u.zeros, u.scales)
    group = scheme.group_size or channel_group(k)
    pw = _packed(u, scheme, group, k, rounding or Rounding())
    return pw if perm is None else InputPermutedWeight(pw, perm)


def _packed(u: Unpacked, scheme: QuantScheme, group: int, k: int, rounding: Rounding
            ) -> PackedWeight:
    """Codes in column order, zero points and scales -> the engine's PackedWeight."""
    codes, zeros, scales, bits = u.codes, u.zeros, u.scales, scheme.bits
    n = codes.shape[0]
    kp = padded_k(k, group)
    mid = 1 << (bits - 1)
    s16 = _to_f16(scales, rounding)
    q = torch.zeros((n, kp), dtype=torch.int64)
    if bits == 8:
        q[:, :k] = codes - mid  # int8 codes: w = s * (q - 128) = s * code
        return PackedWeight("int8", n, k, kp, group, CODES["int8"].pack(q, group), s16)
    q[:, :k] = codes
    if scheme.symmetric:  # NOTE: the padded columns meet zero activations: any code adds 0
        return PackedWeight("int4", n, k, kp, group, CODES["int4"].pack(q, group), s16)
    s64, z64 = s16.to(torch.float64), zeros.to(torch.float64)
    # NOTE: w = s * (q - z) = (-s) * (15 - q) + s * (15 - z): a group whose -s * z does not fit
    # an f16 is held flipped where s * (15 - z) does (z = 9, 11, 13, 15 -> 6, 4, 2, 0: for bf16
    # scales, 8 significant bits, one of the two always fits; for f16 scales not always).
    flip = _fits_f16(s64 * (15 - z64)) & ~_fits_f16(-s64 * z64)
    flip_cols = flip.repeat_interleave(group, dim=1)
    q = torch.where(flip_cols, 15 - q, q)
    q[:, k:] = 0
    s16 = torch.where(flip, -s16, s16)
    mins = _to_f16(torch.where(flip, s64 * (15 - z64), -s64 * z64), rounding)
    return PackedWeight("int4", n, k, kp, group, CODES["int4"].pack(q, group), s16, mins)


def _fits_f16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.float16).to(torch.float64) == t


def _to_f16(t: torch.Tensor, rounding: Rounding) -> torch.Tensor:
    """``t`` as the engine's float16, counting what it rounds."""
    out = t.to(torch.float16).contiguous()
    rounding.add(t, out)
    return out
