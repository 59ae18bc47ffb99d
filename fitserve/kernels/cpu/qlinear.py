"""Quantized linear ops on packed int4 / int8 weights (qlinear.cpp), per the packed contract.

``y = x @ W.T`` with ``W [N, K]`` stored as in fitserve/quant/packed.py
(/work/notes/contract_packed.md):

- int4: ``qweight`` uint8 ``[N, K_padded // 2]`` (per group of G columns, byte ``i`` holds
  column ``i`` in its low nibble and ``i + G/2`` in its high nibble), ``scales`` float16
  ``[N, K_padded // G]``, ``mins`` float16 like ``scales`` (``w = scale * q + min``) or None
  (``w = scale * (q - 8)``); G in 32 / 64 / 128 (any multiple of 32 works).
- int8: ``qweight`` int8 ``[N, K_padded]``, ``scales`` float16 ``[N, K_padded // G]``,
  ``w = scale * q``; per output channel is ``G = K_padded``.

``x`` is float32 or bfloat16 ``[..., K]`` or ``[..., K_padded]``; the result has x's dtype and
``[..., N]``, accumulated in fp32.

- ``act_quant=False``: the weights are dequantized exactly in fp32 and multiplied with fp32 x,
  so the result equals the fp32 product of the dequantized weight up to fp32 summation order.
  That order changes at 16 rows (at::mm) unless ``batch_invariant=True`` (register tiles for
  every M: row m's bits independent of M, slower for many rows).
- ``act_quant=True``: each 32 columns of x are quantized to int8 with an fp32 scale
  ``absmax / 127`` (llama.cpp's Q8_0 / Q8_1 activations) and the dot products run in integers
  (AVX512-VNNI vpdpbusd, or AVX2 / AVX-512 maddubs), combined in fp32 in one order for every M (row m of the result does not
  depend on the other rows: batch invariance). The extra error is
  bounded by ``sum over blocks of (da / 2) * sum |w|`` over the block's columns.

``prepack`` lays a weight out once (at load) for the M > 1 panel kernels; the ops find it by
its tensors, so their signatures (and the decode step's calls) are unchanged.

The functions raise RuntimeError when the extension is unavailable (no compiler, failed build,
``FITSERVE_DISABLE_CPP=1``): check :func:`qlinear_ops_available` and fall back.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fitserve.kernels.cpu.build import load_extension

__all__ = ["HeldLayout", "amx_active", "set_amx", "held_layout", "hold", "int4_linear", "int8_linear", "is_prepacked",
           "gather_held_rows", "held_rows", "out_features", "padded_width", "prepack", "qlinear_ops_available", "qlinear_tier",
           "rows_of_held"]


@functools.cache
def qlinear_ops_available() -> bool:
    """True when qlinear.cpp is built and loaded (``torch.ops.fitserve.int4_linear`` & co)."""
    if load_extension("qlinear", "qlinear.cpp") is None:
        return False
    _register_fakes()
    return True


def qlinear_tier() -> str:
    """The ISA tier the loaded kernels were compiled for ("avx512_vnni", ..., "scalar")."""
    _require()
    return str(torch.ops.fitserve.qlinear_tier())


def out_features(qweight: torch.Tensor, scales: torch.Tensor) -> int:
    """N of a weight held row-major (``qweight [N, ...]``) or as panels (``scales [P, G, L]``)."""
    return scales.shape[0] * scales.shape[2] if scales.dim() == 3 else qweight.shape[0]


def padded_width(qweight: torch.Tensor, scales: torch.Tensor, group_size: int) -> int:
    """K_padded of a weight held row-major or as panels."""
    if scales.dim() == 3:
        return scales.shape[1] * group_size
    return qweight.shape[1] * (2 if qweight.dtype == torch.uint8 else 1)


def _int4_fake(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
               mins: torch.Tensor | None, group_size: int, act_quant: bool,
               batch_invariant: bool = False) -> torch.Tensor:
    return x.new_empty(x.shape[0], out_features(qweight, scales))


def _int8_fake(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, group_size: int,
               act_quant: bool, batch_invariant: bool = False) -> torch.Tensor:
    return x.new_empty(x.shape[0], out_features(qweight, scales))


def _register_fakes() -> None:
    """Shapes for torch.compile's fake tensors: the ops stay opaque calls in the graph."""
    torch.library.register_fake("fitserve::int4_linear", _int4_fake)
    torch.library.register_fake("fitserve::int8_linear", _int8_fake)
    torch.library.register_fake("fitserve::qlinear_held_rows", _held_rows_fake)


def _held_rows_fake(codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
                    ids: torch.Tensor, group_size: int, k: int,
                    dtype: torch.dtype) -> torch.Tensor:
    return scales.new_empty(*ids.shape, k, dtype=dtype)


def _require() -> None:
    if not qlinear_ops_available():
        raise RuntimeError("fitserve qlinear C++ ops are unavailable (see the log for why); "
                           "use the pure-torch path")


def _as_rows(x: torch.Tensor, k_padded: int) -> torch.Tensor:
    """x as a contiguous [M, K_padded] matrix, zero-padding the columns past K."""
    x2 = x.reshape(-1, x.shape[-1])
    if x2.shape[1] > k_padded:
        raise ValueError(f"x has {x2.shape[1]} columns, the weight only {k_padded}")
    if x2.shape[1] < k_padded:
        # NOTE: padded columns must be exactly 0 (the contract): they meet zero-padded weights
        x2 = F.pad(x2, (0, k_padded - x2.shape[1]))
    return x2.contiguous()


def int4_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                mins: torch.Tensor | None, group_size: int, act_quant: bool,
                batch_invariant: bool = False) -> torch.Tensor:
    """``x @ W.T`` for int4 W (asymmetric with ``mins``, symmetric without): ``[..., N]``."""
    _require()
    x2 = _as_rows(x, padded_width(qweight, scales, group_size))
    y: torch.Tensor = torch.ops.fitserve.int4_linear(x2, qweight, scales, mins, group_size,
                                                     act_quant, batch_invariant)
    return y.reshape(*x.shape[:-1], out_features(qweight, scales))


def int8_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, group_size: int,
                act_quant: bool, batch_invariant: bool = False) -> torch.Tensor:
    """``x @ W.T`` for int8 W in groups of ``group_size`` columns: ``[..., N]``."""
    _require()
    x2 = _as_rows(x, padded_width(qweight, scales, group_size))
    y: torch.Tensor = torch.ops.fitserve.int8_linear(x2, qweight, scales, group_size, act_quant,
                                                     batch_invariant)
    return y.reshape(*x.shape[:-1], out_features(qweight, scales))


def prepack(qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
            group_size: int) -> torch.Tensor:
    """Lay the weight out once for the M > 1 panel kernels (qlinear_prepack.h) and register it:
    later ``int4_linear`` / ``int8_linear`` calls with these same tensors read the panels
    instead of packing them per call (same bits). Returns the panels, uint8, N rows of the codes
    + 4 bytes (int8) or 8 (int4) per group: the caller holds them (the registry keeps only weak
    references), and the registration lapses when any of the tensors is freed, replaced or
    written in place."""
    _require()
    bits = 4 if qweight.dtype == torch.uint8 else 8
    blob: torch.Tensor = torch.ops.fitserve.qlinear_prepack(qweight, scales, mins, group_size,
                                                            bits)
    return blob


@dataclass(frozen=True, slots=True)
class HeldLayout:
    """How this build's kernels hold a weight as panels (qlinear_held.h)."""

    lanes: int  # weight rows per panel
    w8_biased: bool  # int8 codes held + 128 (byte ^ 0x80)


@functools.cache
def held_layout() -> HeldLayout:
    """The panel layout of the loaded kernels (it depends on the ISA tier they were built for)."""
    _require()
    lanes, biased = torch.ops.fitserve.qlinear_held_layout()
    return HeldLayout(int(lanes), bool(biased))


def amx_active() -> bool:
    """Whether held int4 / int8 weights with 32-column groups run on AMX-INT8 tiles from a few
    rows of x on (qlinear_amx.h): compiled for this CPU, granted by the OS, not turned off."""
    _require()
    return bool(torch.ops.fitserve.qlinear_amx_active())


def set_amx(on: bool) -> bool:
    """Turns the AMX path on or off for later calls (the VNNI panels run instead, with the same
    bits); returns whether it is on. ``FITSERVE_AMX=0`` starts a process with it off."""
    _require()
    return bool(torch.ops.fitserve.qlinear_set_amx(on))


def hold(qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
         group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The row-major packed weight laid out as panels (``codes [P, nd * L * 4]``, ``scales`` and
    ``mins`` ``[P, G, L]`` f16), to pass to ``int4_linear`` / ``int8_linear`` in place of
    ``qweight`` / ``scales`` / ``mins`` (int8 activations only). Same bytes; N % lanes == 0."""
    _require()
    bits = 4 if qweight.dtype == torch.uint8 else 8
    out = torch.ops.fitserve.qlinear_hold(qweight, scales, mins, group_size, bits)
    return out[0], out[1], (out[2] if len(out) == 3 else None)


def rows_of_held(codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The inverse of ``hold``: ``(qweight [N, row_bytes], scales [N, G], mins)`` row-major
    (copies: for dequantization and the pure-torch paths, never a decode step)."""
    lay = held_layout()
    p, g, lanes = scales.shape
    q = codes.view(torch.uint8).view(p, -1, lanes, 4).permute(0, 2, 1, 3).reshape(p * lanes, -1)
    if codes.dtype == torch.int8 and lay.w8_biased:
        q = q ^ 0x80
    rows = q.view(codes.dtype)

    def unpanel(t: torch.Tensor) -> torch.Tensor:
        return t.permute(0, 2, 1).reshape(p * lanes, g).contiguous()

    return rows, unpanel(scales), None if mins is None else unpanel(mins)


def gather_held_rows(codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
                     ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Rows ``ids`` of a weight held as panels, row-major (``qweight``, ``scales``, ``mins`` of
    those rows only): what a tied embedding gathers from its lm_head's panels."""
    p, _, lanes = scales.shape
    pi, li = ids // lanes, ids % lanes
    q = codes.view(torch.uint8).view(p, -1, lanes, 4)[pi, :, li, :].reshape(ids.numel(), -1)
    if codes.dtype == torch.int8 and held_layout().w8_biased:
        q = q ^ 0x80
    return q.view(codes.dtype), scales[pi, :, li], None if mins is None else mins[pi, :, li]


def held_rows(codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
              ids: torch.Tensor, group_size: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows ``ids`` of a weight held as panels dequantized to ``[*ids.shape, k]`` of ``dtype``
    (float32, bfloat16, float16) in one call: the values of ``gather_held_rows`` then
    fitserve.quant.packed's dequantize, bit for bit (a tied embedding's lookup). An id outside
    ``[0, N)`` raises IndexError."""
    _require()
    out: torch.Tensor = torch.ops.fitserve.qlinear_held_rows(codes, scales, mins, ids.long(),
                                                             group_size, k, dtype)
    return out


def is_prepacked(qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
                 group_size: int) -> bool:
    """Whether calls with these tensors read prepacked panels (their registration is live)."""
    _require()
    bits = 4 if qweight.dtype == torch.uint8 else 8
    return bool(torch.ops.fitserve.qlinear_is_prepacked(qweight, scales, mins, group_size, bits))
