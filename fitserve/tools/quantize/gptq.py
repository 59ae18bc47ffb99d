"""GPTQ-style error compensation (Frantar et al., 2022) into the engine's packed int4/int8 layout.

A linear ``y = x W^T`` is quantized one input column at a time; after column ``j`` is rounded,
its error is pushed onto the columns not yet quantized so that the layer output on the
calibration rows ``X`` moves as little as possible (the OBS update with ``H = X^T X``)::

    err_j   = (w_j - q(w_j)) / U_jj                 U = upper Cholesky factor of H^-1
    w_{j:} -= err_j * U_{j, j:}                     (lazily, a block of columns at a time)

Choices (as the reference implementation, IST-DASLab/gptq):

- dampening: ``damp * mean(diag H)`` is added to the diagonal (default ``damp = 0.01``) so that
  H is safely positive definite; dead columns (``H_jj = 0``, an input channel that is always 0 in
  the calibration set) get ``H_jj = 1`` and their weights set to 0 (they never matter for X).
- order: ``act_order=True`` quantizes columns in descending ``diag(H)`` order (the channels
  with the most input energy first, while most columns are still free to absorb their error);
  with it, group scales/mins are *static*: computed by RTN from the original-order groups of the
  original weight before the pass, so the result is still the engine's contiguous-group layout.
  ``act_order=False`` goes left to right, and a group's scale/min is found (by RTN, the same
  float16 rounding as ``fitserve.quant.rtn``) from the compensated weights when the pass reaches
  the group's first column; per-channel int8 is always static (one group = the whole row).

- precision: H is factorised in float64; the compensated weights and U are float32 (as the
  reference), or float64 with ``dtype=torch.float64`` (what the tests compare with a naive
  unblocked float64 implementation, code for code).

Codes are rounded (in float64) against the stored float16 scale/min exactly as RTN rounds them,
and the error pushed forward is against the value the engine dequantizes (float32
``(d * q) + m``), so with a diagonal H (no correlations to exploit) GPTQ reproduces RTN bit for
bit.

The model-level driver is *non-sequential* GPTQ: every Hessian comes from one calibration pass
through the unquantized model (``fitserve.tools.quantize.calibration``), instead of re-running the
calibration set through the partly quantized model layer by layer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from fitserve.quant.packed import PackedWeight, channel_group, pack, padded_k
from fitserve.quant.rtn import quantize_int4, quantize_int8

if TYPE_CHECKING:
    from fitserve.tools.quantize.stats import LinearStats


@dataclass(frozen=True, slots=True)
class Grid:
    """One group's float16 scale (and min) per row, with the float32/float64 views the column
    loop needs prepared once per group."""

    scale: torch.Tensor  # float16 [N]
    mins: torch.Tensor | None  # float16 [N] (asymmetric int4)
    safe: torch.Tensor  # float64 [N]: the scale, 1 where it is 0 (rounding divides by it)
    s32: torch.Tensor  # float32 [N] (dequantization multiplies by it)
    m64: torch.Tensor | None
    m32: torch.Tensor | None
    zero: torch.Tensor | None  # bool [N] rows whose scale is 0; None when there are none
    lo: int  # code range, before the +8 offset of symmetric int4
    hi: int
    offset: int  # 8 for symmetric int4 (the stored code is q + 8), else 0


def make_grid(scale: torch.Tensor, mins: torch.Tensor | None, bits: int) -> Grid:
    """The Grid of float16 ``scale``/``mins [N]`` for ``bits`` (int4 with mins: asymmetric)."""
    s64 = scale.to(torch.float64)
    zero = s64 == 0
    lo, hi, offset = (-127, 127, 0) if bits == 8 else ((0, 15, 0) if mins is not None else
                                                        (-8, 7, 8))
    return Grid(scale, mins, torch.where(zero, torch.ones_like(s64), s64),
                scale.to(torch.float32), None if mins is None else mins.to(torch.float64),
                None if mins is None else mins.to(torch.float32),
                zero if bool(zero.any()) else None, lo, hi, offset)


def _check_args(bits: int, group_size: int | None, k: int) -> int:
    """The group size G of the packed result (per-channel int8: K rounded up to 32)."""
    if bits == 4:
        if group_size is None:
            raise ValueError("int4 needs a group size (32, 64 or 128)")
        return group_size
    if bits == 8:
        return channel_group(k) if group_size is None else group_size
    raise ValueError(f"bits must be 4 or 8, got {bits}")


def group_params(w: torch.Tensor, bits: int, group_size: int, symmetric: bool,
                 per_channel: bool) -> Grid:
    """The Grid (float16 scale, min per row) that RTN chooses for the columns ``w [N, c]``
    (c <= G; RTN zero-pads a short last group, so this does too)."""
    if bits == 4:
        pw = quantize_int4(w, group_size, symmetric=symmetric)
        return make_grid(pw.scales[:, 0], None if pw.mins is None else pw.mins[:, 0], bits)
    pw = quantize_int8(w, None if per_channel else group_size)
    return make_grid(pw.scales[:, 0], None, bits)


def quantize_column(w: torch.Tensor, grid: Grid) -> tuple[torch.Tensor, torch.Tensor]:
    """(float64 codes less ``grid.offset``, the engine's float32 dequantized value) of one
    float64 column ``w [N]`` (not modified): RTN's rounding, in float64, against the stored
    float16 scale/min.

    NOTE: ``scale * q`` is exact in float32 (11 + 8 significant bits at most), so the engine's
    ``(d * q) + m`` (two float32 roundings) equals ``addcmul``'s, fused or not.
    """
    x = w if grid.m64 is None else torch.sub(w, grid.m64)
    q = torch.div(x, grid.safe)
    q.round_().clamp_(grid.lo, grid.hi)
    if grid.zero is not None:
        q.masked_fill_(grid.zero, 0.0)
    q32 = q.float()
    if grid.m32 is None:
        return q, q32.mul_(grid.s32)
    return q, torch.addcmul(grid.m32, q32, grid.s32)


def prepare_hessian(w: torch.Tensor, hessian: torch.Tensor, damp: float
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(float64 weight copy with dead columns zeroed, dampened float64 H copy)."""
    k = w.shape[1]
    if tuple(hessian.shape) != (k, k):
        raise ValueError(f"the Hessian must be [{k}, {k}] for a weight of K={k}, got "
                         f"{list(hessian.shape)}")
    if not bool(torch.isfinite(hessian).all()):
        raise ValueError("the Hessian has inf/nan entries")
    h = hessian.to(torch.float64).clone()
    w = w.to(torch.float64).clone()
    dead = torch.diagonal(h) == 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    idx = torch.arange(k)
    h[idx, idx] += damp * torch.diagonal(h).mean()
    return w, h


def inverse_cholesky(h: torch.Tensor) -> torch.Tensor:
    """Upper Cholesky factor U of H^-1 (``H^-1 = U^T U``), float64; ValueError if H is not
    positive definite even after dampening.

    NOTE: one factorisation instead of the reference's three (cholesky, cholesky_inverse,
    cholesky): with J the reversal, ``J H J = M M^T`` (M lower) gives ``H = R R^T`` for the
    upper ``R = J M J``, so ``H^-1 = (R^-1)^T R^-1`` and ``U = R^-1 = J M^-1 J``.
    """
    low, info = torch.linalg.cholesky_ex(h.flip(0, 1))
    if int(info):
        raise ValueError("the dampened Hessian is not positive definite: raise damp")
    eye = torch.eye(h.shape[0], dtype=h.dtype)
    u: torch.Tensor = torch.linalg.solve_triangular(low, eye, upper=False).flip(0, 1)
    return u


def _static_params(w: torch.Tensor, bits: int, g: int, symmetric: bool, per_channel: bool
                   ) -> list[Grid]:
    k = w.shape[1]
    return [group_params(w[:, c0:min(c0 + g, k)], bits, g, symmetric, per_channel)
            for c0 in range(0, k, g)]


def _current_cols(wt: torch.Tensor, w1t: torch.Tensor, err1t: torch.Tensor, u: torch.Tensor,
                  i1: int, i: int, c1: int) -> torch.Tensor:
    """Columns [i1 + i, c1) of the weight (processing order), ``[N, c1 - i1 - i]``, as the
    unblocked algorithm would see them now: inside the block from W1 (fully updated), beyond it
    W less the block's pending update. (All ``*t`` tensors are transposed: ``[columns, N]``.)"""
    i2 = i1 + w1t.shape[0]
    inside = w1t[i:min(c1, i2) - i1]
    if c1 <= i2:
        return inside.T
    beyond = wt[i2:c1] - u[i1:i1 + i, i2:c1].T @ err1t[:i]
    return torch.cat([inside, beyond]).T


def _gptq_pass(wt: torch.Tensor, u: torch.Tensor, params: Callable[..., Grid],
               block_size: int) -> torch.Tensor:
    """Blocked GPTQ over the columns of the weight, held transposed ``wt [K, N]`` (the working
    dtype, modified in place), in their order; ``params(wt, w1t, err1t, i1, i)`` gives column
    i1 + i's Grid. Returns the float codes (less the grid offset), transposed ``[K, N]``.

    NOTE: transposed so that a column is a contiguous row: the rank-1 update of the block's
    remaining columns runs 3-10x faster than on strided column slices.
    """
    k, n = wt.shape
    codes = torch.empty(k, n, dtype=torch.float32)  # small integers: exact
    threads = torch.get_num_threads()
    for i1 in range(0, k, block_size):
        i2 = min(i1 + block_size, k)
        w1t = wt[i1:i2].clone()
        err1t = torch.zeros_like(w1t)
        u1 = u[i1:i2, i1:i2]
        # NOTE: the column loop is thousands of small ops; with several intra-op threads each
        # pays a thread-pool handoff (15x slower on a busy 2-core machine), so it runs on one
        # thread; the block's lazy update (one matmul) gets them all back.
        torch.set_num_threads(1)
        try:
            for i, d in enumerate(u1.diagonal().tolist()):
                col = w1t[i]
                q, w_hat = quantize_column(col.double(), params(wt, w1t, err1t, i1, i))
                codes[i1 + i] = q
                e = torch.sub(col, w_hat.to(col.dtype), out=err1t[i]).div_(d)
                # the update touches columns i.. (column i's residual is never read again)
                w1t[i:].addr_(u1[i, i:], e, alpha=-1.0)
        finally:
            torch.set_num_threads(threads)
        wt[i2:] -= u[i1:i2, i2:].T @ err1t
    return codes


def gptq_quantize(w: torch.Tensor, hessian: torch.Tensor, *, bits: int, group_size: int | None,
                  symmetric: bool, damp: float = 0.01, act_order: bool = True,
                  block_size: int = 128, dtype: torch.dtype = torch.float32) -> PackedWeight:
    """GPTQ of ``w [N, K]`` with ``hessian [K, K]`` (``sum x^T x`` of its calibration inputs)
    into the packed layout RTN produces for the same arguments: int4 (``group_size`` 32/64/128,
    ``symmetric`` or f16 min) or int8 (per group, or per channel with ``group_size=None``;
    int8 is always symmetric). See the module docstring for dampening and column order.

    ``dtype``: the working precision of the compensated weights and of U (float32, as the
    reference implementation; float64 for a reference). H is factorised in float64 either way,
    and codes are always rounded in float64 against the stored scales.
    """
    n, k = w.shape
    g = _check_args(bits, group_size, k)
    if bits == 8 and not symmetric:
        raise ValueError("int8 is symmetric only")
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    per_channel = bits == 8 and group_size is None
    w64, h = prepare_hessian(w, hessian, damp)
    static = act_order or per_channel
    fixed = _static_params(w64, bits, g, symmetric, per_channel) if static else []
    perm = torch.argsort(torch.diagonal(h), descending=True, stable=True) if act_order else (
        torch.arange(k))
    wt, hp = w64.T[perm].to(dtype).contiguous(), h[perm][:, perm]
    u = inverse_cholesky(hp).to(dtype)
    dynamic: dict[int, Grid] = {}
    order: list[int] = perm.tolist()

    def params(wcur: torch.Tensor, w1t: torch.Tensor, err1t: torch.Tensor, i1: int,
               i: int) -> Grid:
        col = order[i1 + i]
        if static:
            return fixed[col // g]
        if col % g == 0:  # the pass reaches a new group (left to right: perm is the identity)
            cols = _current_cols(wcur, w1t, err1t, u, i1, i, min(col + g, k))
            dynamic[col // g] = group_params(cols, bits, g, symmetric, per_channel)
        return dynamic[col // g]

    codes_p = _gptq_pass(wt, u, params, block_size)
    codes = torch.empty(n, k, dtype=torch.float32)
    codes[:, perm] = codes_p.T
    return _assemble(codes, fixed if static else [dynamic[j] for j in range(-(-k // g))],
                     bits, g, k)


def _assemble(codes: torch.Tensor, groups: list[Grid], bits: int, g: int,
              k: int) -> PackedWeight:
    """Pack float codes ``[N, K]`` (less the offset) with their groups' scales/mins; padded
    columns get the codes RTN gives a zero weight."""
    n = codes.shape[0]
    kp = padded_k(k, g)
    scales = torch.stack([grid.scale for grid in groups], 1)
    mins = None if groups[0].mins is None else torch.stack(
        [grid.mins for grid in groups], 1)  # type: ignore[misc]
    full = torch.empty(n, kp, dtype=torch.float32)
    full[:, :k] = codes
    if kp > k:
        q0, _ = quantize_column(torch.zeros(n, dtype=torch.float64), groups[-1])
        full[:, k:] = q0.float().unsqueeze(1)
    full += groups[0].offset
    q = full.to(torch.uint8) if bits == 4 else full.to(torch.int8)
    return pack("int4" if bits == 4 else "int8", q, scales, mins, g, k)


def gptq_quantize_weights(weights: dict[str, torch.Tensor], stats: dict[str, LinearStats], *,
                          bits: int, group_size: int | None, symmetric: bool, damp: float = 0.01,
                          act_order: bool = True) -> dict[str, PackedWeight]:
    """GPTQ every weight of ``weights`` that has calibration ``stats`` (HF names), returning the
    packed weights by the same names (weights without stats are left out: RTN them).

    NOTE: non-sequential GPTQ: the Hessians all come from one pass through the unquantized model,
    not from re-running the calibration set through the partly quantized model after each layer
    (as the reference does, so that a layer's Hessian also sees earlier layers' errors). One
    pass is what the statistics hold and costs one forward instead of one per layer; on the
    default model it already halves RTN's KL at int4 g128. Weights sharing one input (q/k/v,
    gate/up: the same LinearStats) are stacked and quantized as one matrix: GPTQ is
    row-independent, so this equals quantizing them one by one.
    """
    names = [name for name in weights if name in stats]
    by_input: dict[int, list[str]] = {}
    for name in names:
        by_input.setdefault(id(stats[name]), []).append(name)
    out: dict[str, PackedWeight] = {}
    for members in by_input.values():
        stacked = torch.cat([weights[m] for m in members])
        pw = gptq_quantize(stacked, stats[members[0]].hessian, bits=bits, group_size=group_size,
                           symmetric=symmetric, damp=damp, act_order=act_order)
        row = 0
        for m in members:
            rows = weights[m].shape[0]
            out[m] = pw.select_rows(torch.arange(row, row + rows)) if len(members) > 1 else pw
            row += rows
    return out
