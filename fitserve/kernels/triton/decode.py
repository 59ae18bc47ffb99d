"""Triton split-KV decode over a paged KV cache, with an exact LSE merge kernel.

Phase 1, grid (B * Hq, P): program (b*Hq + h, p) handles keys [p*chunk, (p+1)*chunk) of
sequence b, reading them page by page through the block table, and writes a partial
(O_p fp32 [D], LSE_p) -- (0, -inf) when the split holds no visible key.

Phase 2, grid (B * Hq): merges the P partials: lse = log sum exp(LSE_p),
O = sum exp(LSE_p - lse) O_p. The split count comes from fitserve.kernels.split_plan.choose_num_splits.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _decode_partial_kernel(
    Q, KC, VC, BT, SEQ, PO, PL,
    sqb, sqh, skblk, skslot, skh, svblk, svslot, svh, sbt,
    HQ, G, D, P, chunk, block_size, scale, window,
    USE_WINDOW: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0)
    split = tl.program_id(1)
    b = pid // HQ
    h = pid % HQ
    kvh = h // G
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    q = tl.load(Q + b * sqb + h * sqh + offs_d, mask=d_ok, other=0.0).to(tl.float32) * scale
    seq_len = tl.load(SEQ + b)
    lo = split * chunk
    if USE_WINDOW:
        lo = tl.maximum(lo, seq_len - window)
    hi = tl.minimum(split * chunk + chunk, seq_len)
    m_i = tl.full([1], float("-inf"), tl.float32)
    l_i = tl.zeros([1], tl.float32)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_ok = offs_n < hi
        page = tl.load(BT + b * sbt + offs_n // block_size, mask=n_ok, other=0)
        slot = offs_n % block_size
        k = tl.load(KC + page[:, None] * skblk + slot[:, None] * skslot + kvh * skh
                    + offs_d[None, :], mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        s = tl.sum(k.to(tl.float32) * q[None, :], 1)                     # [BLOCK_N]
        s = tl.where(n_ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)           # NaN guard
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe)
        l_i = l_i * alpha + tl.sum(p, 0)
        v = tl.load(VC + page[:, None] * svblk + slot[:, None] * svslot + kvh * svh
                    + offs_d[None, :], mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        acc = acc * alpha + tl.sum(p[:, None] * v.to(tl.float32), 0)
        m_i = m_new
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    lse = tl.where(empty, float("-inf"), m_i + tl.log(l_safe))
    base = pid * P + split
    tl.store(PO + base * D + offs_d, acc / l_safe, mask=d_ok)
    tl.store(PL + base + tl.arange(0, 1), lse)


@triton.jit
def _merge_kernel(PO, PL, Out, LSE, P, D, BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr):
    pid = tl.program_id(0)
    offs_p = tl.arange(0, BLOCK_P)
    offs_d = tl.arange(0, BLOCK_D)
    p_ok = offs_p < P
    d_ok = offs_d < D
    lses = tl.load(PL + pid * P + offs_p, mask=p_ok, other=float("-inf"))
    m = tl.max(lses, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lses - m_safe)
    total = tl.sum(w, 0)
    empty = total == 0.0
    w = w / tl.where(empty, 1.0, total)
    parts = tl.load(PO + (pid * P + offs_p[:, None]) * D + offs_d[None, :],
                    mask=p_ok[:, None] & d_ok[None, :], other=0.0)
    out = tl.sum(w[:, None] * parts, 0)
    tl.store(Out + pid * D + offs_d, out.to(Out.dtype.element_ty), mask=d_ok)
    tl.store(LSE + pid, tl.where(empty, float("-inf"), m_safe + tl.log(tl.where(empty, 1.0, total))))


def triton_paged_decode(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor,
                        seq_lens: Tensor, *, num_splits: int, scale: float | None = None,
                        sliding_window: int | None = None, block_n: int = 32
                        ) -> tuple[Tensor, Tensor]:
    """Split-KV decode of q [B, Hq, D] (one query per sequence at position seq_len - 1).

    k_cache/v_cache [num_blocks, block_size, Hkv, D] (last dim contiguous), block_tables
    [B, max_blocks] int32, seq_lens [B]. Returns (out [B, Hq, D] in q.dtype, lse [B, Hq] fp32).
    """
    bsz, hq, d = q.shape
    block_size, hkv = k_cache.shape[1], k_cache.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    max_len = block_tables.shape[1] * block_size
    chunk = math.ceil(math.ceil(max_len / num_splits) / block_n) * block_n
    q = q.contiguous()
    tables = block_tables.to(torch.int32).contiguous()
    lens = seq_lens.to(torch.int32).contiguous()
    part_o = torch.empty((bsz * hq, num_splits, d), dtype=torch.float32, device=q.device)
    part_l = torch.empty((bsz * hq, num_splits), dtype=torch.float32, device=q.device)
    block_d = max(16, triton.next_power_of_2(d))
    _decode_partial_kernel[(bsz * hq, num_splits)](
        q, k_cache, v_cache, tables, lens, part_o, part_l,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), tables.stride(0),
        hq, hq // hkv, d, num_splits, chunk, block_size, scale, sliding_window or 1,
        USE_WINDOW=sliding_window is not None, BLOCK_N=block_n, BLOCK_D=block_d,
    )
    out = torch.empty_like(q)
    lse = torch.empty((bsz, hq), dtype=torch.float32, device=q.device)
    _merge_kernel[(bsz * hq,)](part_o, part_l, out, lse, num_splits, d,
                               BLOCK_P=max(2, triton.next_power_of_2(num_splits)),
                               BLOCK_D=block_d)
    return out, lse
