"""Float64 naive attention: the reference every kernel in this package is tested against.

It materialises the full [M, N] score matrix, so it is only for tests and small shapes.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from fitserve.tools.labs.masks import bottom_right_positions, visible_mask

REF_DTYPE = torch.float64


def naive_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    scale: float | None = None,
    causal: bool = False,
    window: int | None = None,
    q_pos: Tensor | None = None,
    k_pos: Tensor | None = None,
    q_seg: Tensor | None = None,
    k_seg: Tensor | None = None,
    mask: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """softmax(q k^T * scale + mask) v in float64, differentiable (autograd is the grad reference).

    Args:
        q: [..., M, D]; k: [..., N, D]; v: [..., N, Dv] (same leading dims).
        scale: defaults to 1/sqrt(D).
        causal, window, q_pos, k_pos, q_seg, k_seg: see :func:`visible_mask`; positions default
            to bottom-right alignment (queries are the last M of N positions).
        mask: an explicit boolean [M, N] visibility mask; overrides the other mask arguments.

    Returns:
        (out [..., M, Dv] float64, lse [..., M] float64). Rows with no visible key give out = 0
        and lse = -inf.
    """
    m_rows, n_cols = q.shape[-2], k.shape[-2]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if mask is None:
        dq, dk = bottom_right_positions(m_rows, n_cols, q.device)
        mask = visible_mask(dq if q_pos is None else q_pos, dk if k_pos is None else k_pos,
                            causal=causal, window=window, q_seg=q_seg, k_seg=k_seg)
    s = torch.matmul(q.to(REF_DTYPE), k.to(REF_DTYPE).transpose(-1, -2)) * scale
    s = s.masked_fill(~mask, float("-inf"))
    # NOTE: for an all-masked row logsumexp is -inf and s - lse is nan (and so is the gradient of
    # logsumexp even behind a torch.where); such rows are replaced by zeros *before* logsumexp.
    empty = ~mask.any(dim=-1)
    lse_safe = torch.logsumexp(s.masked_fill(empty.unsqueeze(-1), 0.0), dim=-1)
    p = torch.exp(s - lse_safe.unsqueeze(-1)).masked_fill(~mask, 0.0)
    out = torch.matmul(p, v.to(REF_DTYPE))
    lse = lse_safe.masked_fill(empty, float("-inf"))
    return out, lse


def naive_attention_bhsd(q: Tensor, k: Tensor, v: Tensor, *, scale: float | None = None,
                         causal: bool = False, window: int | None = None) -> Tensor:
    """The "naive" eager implementation used as a timed baseline: fp32 (or input dtype) matrices.

    q [B, H, M, D], k/v [B, H, N, D] with bottom-right alignment; not float64 (it is a timed
    variant, not the reference).
    """
    m_rows, n_cols = q.shape[-2], k.shape[-2]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    q_pos, k_pos = bottom_right_positions(m_rows, n_cols, q.device)
    mask = visible_mask(q_pos, k_pos, causal=causal, window=window)
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    s = s.masked_fill(~mask, float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return torch.matmul(p, v.float()).to(q.dtype)
