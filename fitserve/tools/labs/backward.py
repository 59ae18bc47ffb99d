"""Tiled attention backward by recomputation from the saved LSE (FlashAttention-2 style).

Nothing of size M x N is stored. With P = exp(S - LSE) recomputed tile by tile:

    D    = rowsum(dO * O)                 (one number per query row, computed up front)
    dV_j += P_ij^T dO_i
    dP_ij = dO_i V_j^T
    dS_ij = P_ij * (dP_ij - D_i)          (softmax Jacobian, using rowsum(P * dP) == D)
    dQ_i += dS_ij K_j * scale
    dK_j += dS_ij^T Q_i * scale

Loop order: key tiles outside (each owns dK_j, dV_j accumulators), query tiles inside
(dQ_i accumulated across key tiles in an fp32 buffer, as the atomic-add version does on GPU).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from fitserve.tools.labs.online_softmax import ACC_DTYPE
from fitserve.tools.labs.tiled import make_mask_args, tiled_attention


def tiled_attention_backward(
    q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dout: Tensor, *,
    scale: float | None = None, causal: bool = False, window: int | None = None,
    q_pos: Tensor | None = None, k_pos: Tensor | None = None,
    q_seg: Tensor | None = None, k_seg: Tensor | None = None,
    block_m: int = 64, block_n: int = 64,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients (dQ, dK, dV) of :func:`tiled_attention` given its saved O and LSE.

    Shapes as in :func:`tiled_attention`; returns tensors in the dtypes of q, k, v.
    Rows with LSE = -inf (nothing visible) contribute nothing and receive dQ = 0.
    """
    m_rows, n_cols = q.shape[-2], k.shape[-2]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    margs = make_mask_args(m_rows, n_cols, q.device, causal=causal, window=window, q_pos=q_pos,
                           k_pos=k_pos, q_seg=q_seg, k_seg=k_seg)
    q32, k32, v32 = q.to(ACC_DTYPE), k.to(ACC_DTYPE), v.to(ACC_DTYPE)
    do32 = dout.to(ACC_DTYPE)
    d_row = (do32 * out.to(ACC_DTYPE)).sum(dim=-1)                      # D = rowsum(dO * O)
    # NOTE: -inf LSE (empty row) -> exp(S - LSE) would be exp(-inf + inf) = nan; use +inf so
    # every p of that row is exp(-inf) = 0 (its S entries are all masked anyway).
    lse_safe = torch.where(torch.isneginf(lse), torch.full_like(lse, float("inf")), lse)
    dq = torch.zeros_like(q32)
    dk = torch.zeros_like(k32)
    dv = torch.zeros_like(v32)
    for j0 in range(0, n_cols, block_n):
        j1 = min(j0 + block_n, n_cols)
        k_t, v_t = k32[..., j0:j1, :], v32[..., j0:j1, :]
        for i0 in range(0, m_rows, block_m):
            i1 = min(i0 + block_m, m_rows)
            vis = margs.tile(i0, i1, j0, j1)
            if not bool(vis.any()):
                continue
            q_t, do_t = q32[..., i0:i1, :], do32[..., i0:i1, :]
            s = torch.matmul(q_t, k_t.transpose(-1, -2)) * scale
            p = torch.exp(s - lse_safe[..., i0:i1].unsqueeze(-1)).masked_fill(~vis, 0.0)
            dv[..., j0:j1, :] += torch.matmul(p.transpose(-1, -2), do_t)
            dp = torch.matmul(do_t, v_t.transpose(-1, -2))
            ds = p * (dp - d_row[..., i0:i1].unsqueeze(-1))
            dq[..., i0:i1, :] += torch.matmul(ds, k_t) * scale
            dk[..., j0:j1, :] += torch.matmul(ds.transpose(-1, -2), q_t) * scale
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class TiledAttentionFn(torch.autograd.Function):
    """Autograd wrapper: tiled forward (saves O and LSE only), tiled backward by recomputation."""

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, scale: float | None, causal: bool,
                window: int | None, block_m: int, block_n: int) -> Tensor:
        out, lse = tiled_attention(q, k, v, scale=scale, causal=causal, window=window,
                                   block_m=block_m, block_n=block_n)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.cfg = (scale, causal, window, block_m, block_n)
        return out

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        scale, causal, window, block_m, block_n = ctx.cfg
        dq, dk, dv = tiled_attention_backward(q, k, v, out, lse, grads[0], scale=scale,
                                              causal=causal, window=window,
                                              block_m=block_m, block_n=block_n)
        return dq, dk, dv, None, None, None, None, None


def flash_attention(q: Tensor, k: Tensor, v: Tensor, *, scale: float | None = None,
                    causal: bool = False, window: int | None = None,
                    block_m: int = 64, block_n: int = 64) -> Tensor:
    """Differentiable tiled attention (bottom-right positions); gradients by recomputation."""
    out: Tensor = TiledAttentionFn.apply(q, k, v, scale, causal, window, block_m, block_n)
    return out
