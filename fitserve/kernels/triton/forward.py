"""Triton tiled attention forward (online softmax, NaN-safe, bottom-right causal, window, GQA).

Grid: (cdiv(M, BLOCK_M), B * H). Program (i, b*H + h) owns query rows i*BLOCK_M .. of head h
and streams the key tiles it can see from KV head h // G:

    causal upper bound : keys < min(N, last query position + 1)
    window lower bound : keys >= first query position - window + 1 (rounded down to a tile)
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _attn_fwd_kernel(
    Q, K, V, Out, LSE,
    sqb, sqh, sqm, skb, skh, skn, svb, svh, svn, sob, soh, som,
    H, G, M, N, D, scale, window,
    CAUSAL: tl.constexpr, USE_WINDOW: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    kvh = h // G
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < M
    d_ok = offs_d < D
    q = tl.load(Q + b * sqb + h * sqh + offs_m[:, None] * sqm + offs_d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    q_pos = offs_m + (N - M)                                 # bottom-right alignment
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    hi = N
    if CAUSAL:
        hi = tl.minimum(N, pid_m * BLOCK_M + BLOCK_M + (N - M))
    lo = 0
    if USE_WINDOW:
        lo = tl.maximum(0, pid_m * BLOCK_M + (N - M) - window + 1)
        lo = (lo // BLOCK_N) * BLOCK_N
    k_base = K + b * skb + kvh * skh
    v_base = V + b * svb + kvh * svh
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        k = tl.load(k_base + offs_n[None, :] * skn + offs_d[:, None],
                    mask=d_ok[:, None] & n_ok[None, :], other=0.0)
        s = tl.dot(q, k) * scale                            # fp32 accumulate
        vis = n_ok[None, :] & row_ok[:, None]
        if CAUSAL:
            vis = vis & (offs_n[None, :] <= q_pos[:, None])
        if USE_WINDOW:
            vis = vis & (offs_n[None, :] >= q_pos[:, None] - window + 1)
        s = tl.where(vis, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)   # NaN guard
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + offs_n[:, None] * svn + offs_d[None, :],
                    mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc / l_safe[:, None]
    lse = tl.where(empty, float("-inf"), m_i + tl.log(l_safe))
    tl.store(Out + b * sob + h * soh + offs_m[:, None] * som + offs_d[None, :],
             out.to(Out.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    tl.store(LSE + pid_bh * M + offs_m, lse, mask=row_ok)


def triton_attention_forward(q: Tensor, k: Tensor, v: Tensor, *, scale: float | None = None,
                             causal: bool = False, window: int | None = None,
                             block_m: int = 64, block_n: int = 64) -> tuple[Tensor, Tensor]:
    """Forward attention on [B, H, M, D] queries and [B, Hkv, N, D] keys/values.

    Returns (out [B, H, M, D] in q.dtype, lse [B, H, M] fp32); queries bottom-right aligned;
    query head h reads KV head h // (H // Hkv).
    """
    bsz, heads, m_rows, d = q.shape
    n_cols, hkv = k.shape[2], k.shape[1]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    out = torch.empty_like(q)
    lse = torch.empty((bsz, heads, m_rows), dtype=torch.float32, device=q.device)
    block_d = max(16, triton.next_power_of_2(d))
    grid = (triton.cdiv(m_rows, block_m), bsz * heads)
    _attn_fwd_kernel[grid](
        q, k, v, out, lse,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1), out.stride(2),
        heads, heads // hkv, m_rows, n_cols, d, scale, window or 1,
        CAUSAL=causal, USE_WINDOW=window is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
    )
    return out, lse
