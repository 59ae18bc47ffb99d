"""Paged attention: keys and values read through a block table, key tiles may span pages.

    block_size = 4, block_table[b] = [7, 2, 9, 0(pad)], seq_lens[b] = 10

    logical key j :  0 1 2 3 | 4 5 6 7 | 8 9
    page          :  7 7 7 7 | 2 2 2 2 | 9 9          page   = block_table[b, j // block_size]
    slot          :  0 1 2 3 | 0 1 2 3 | 0 1          slot   = j % block_size
    key tile (n=6):  [---- tile 0 ----][- tile 1 -]    a tile of 6 keys spans pages 7 and 2

A tile gathers k_cache[page, slot] for its logical keys, so tile size and page size are
independent. The T queries of sequence b sit at absolute positions seq_lens[b]-T .. seq_lens[b]-1
(bottom-right), GQA-folded so every KV head reads each key tile once for its G query heads.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from fitserve.tools.labs.gqa import group_size, pack_gqa, repeat_rows, unpack_gqa
from fitserve.tools.labs.masks import visible_mask
from fitserve.tools.labs.online_softmax import ACC_DTYPE, OnlineSoftmax


def gather_keys(cache: Tensor, block_table_row: Tensor, j0: int, j1: int) -> Tensor:
    """Logical keys [j0, j1) of one sequence: [j1-j0, Hkv, D] gathered page by page."""
    block_size = cache.shape[1]
    idx = torch.arange(j0, j1, device=cache.device)
    pages = block_table_row[idx // block_size].long()
    return cache[pages, idx % block_size]


def first_visible_key(min_q_pos: int, sliding_window: int | None) -> int:
    """Smallest key position any query at >= min_q_pos can see (0 without a window)."""
    return 0 if sliding_window is None else max(0, min_q_pos - sliding_window + 1)


def paged_attention_reference(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    cu_seqlens_q: Tensor,
    *,
    scale: float | None = None,
    sliding_window: int | None = None,
    block_m: int = 64,
    block_n: int = 64,
    return_lse: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Causal attention of packed varlen queries against a paged KV cache.

    Args:
        q: [num_tokens_total, num_heads, head_dim], sequences packed back to back.
        k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]; the new tokens'
            keys/values must already be written.
        block_tables: [B, max_blocks] int32, padded with 0 (padding is never read).
        seq_lens: [B] keys per sequence including the new ones.
        cu_seqlens_q: [B+1] cumulative query counts (vLLM's ``query_start_loc``); sequence b
            owns q[cu_seqlens_q[b]:cu_seqlens_q[b+1]] and T_b <= seq_lens[b] must hold.
        scale: softmax scale, default 1/sqrt(head_dim).
        sliding_window: query at position p sees keys p-w+1 .. p (None: all keys <= p).
        block_m: query tile size in tokens (a tile holds block_m * G packed rows).
        block_n: key tile size (independent of block_size).
        return_lse: also return the fp32 LSE [num_tokens_total, num_heads].

    Returns:
        out [num_tokens_total, num_heads, head_dim] in q.dtype (and LSE if requested).
        GQA: query head h reads KV head h // (num_heads // num_kv_heads).
    """
    num_heads, hkv = q.shape[1], k_cache.shape[2]
    g = group_size(num_heads, hkv)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    out = torch.zeros_like(q)
    lse_all = torch.full(q.shape[:2], float("-inf"), dtype=ACC_DTYPE, device=q.device)
    cu = cu_seqlens_q.tolist()
    lens = seq_lens.tolist()
    for b in range(len(lens)):
        t0, t1, seq_len = cu[b], cu[b + 1], int(lens[b])
        n_q = t1 - t0
        if n_q == 0:
            continue
        if n_q > seq_len:
            raise ValueError(f"sequence {b}: {n_q} queries but only {seq_len} keys")
        q_pos = torch.arange(seq_len - n_q, seq_len, device=q.device)
        o_b, lse_b = _one_sequence(q[t0:t1], k_cache, v_cache, block_tables[b], q_pos,
                                   scale=scale, window=sliding_window, block_m=block_m,
                                   block_n=block_n, g=g)
        out[t0:t1] = unpack_gqa(o_b, num_heads).to(q.dtype)
        lse_all[t0:t1] = unpack_gqa(lse_b, num_heads)
    return (out, lse_all) if return_lse else out


def _one_sequence(q_b: Tensor, k_cache: Tensor, v_cache: Tensor, table_row: Tensor,
                  q_pos: Tensor, *, scale: float, window: int | None, block_m: int,
                  block_n: int, g: int) -> tuple[Tensor, Tensor]:
    """GQA-folded online softmax of one sequence: returns ([Hkv, T*G, D], [Hkv, T*G])."""
    hkv, n_q = k_cache.shape[2], q_b.shape[0]
    outs, lses = [], []
    for i0 in range(0, n_q, block_m):
        i1 = min(i0 + block_m, n_q)
        o, lse = _query_tile(pack_gqa(q_b[i0:i1], hkv), k_cache, v_cache, table_row,
                             q_pos[i0:i1], scale=scale, window=window, block_n=block_n, g=g)
        outs.append(o)
        lses.append(lse)
    # NOTE: packed rows are token-major (row = t*G + g), so query tiles concatenate along rows.
    return torch.cat(outs, dim=1), torch.cat(lses, dim=1)


def _query_tile(qp: Tensor, k_cache: Tensor, v_cache: Tensor, table_row: Tensor,
                q_pos: Tensor, *, scale: float, window: int | None, block_n: int, g: int
                ) -> tuple[Tensor, Tensor]:
    """One GQA-packed query tile [Hkv, rows, D] against its visible key tiles."""
    hkv = k_cache.shape[2]
    qp = qp.to(ACC_DTYPE) * scale
    row_pos = repeat_rows(q_pos, g)
    last_key = int(q_pos[-1]) + 1                      # keys after the tile's last query: unseen
    state = OnlineSoftmax((hkv, qp.shape[1]), v_cache.shape[-1], qp.device)
    # NOTE: with a window, tiles entirely left of the earliest visible key are never loaded;
    # the loop starts at the tile containing that key (tiles stay aligned to multiples of n).
    start = (first_visible_key(int(q_pos[0]), window) // block_n) * block_n
    for j0 in range(start, last_key, block_n):
        j1 = min(j0 + block_n, last_key)
        k_t = gather_keys(k_cache, table_row, j0, j1).transpose(0, 1)   # [Hkv, n, D]
        v_t = gather_keys(v_cache, table_row, j0, j1).transpose(0, 1)
        s = torch.matmul(qp, k_t.to(ACC_DTYPE).transpose(-1, -2))       # [Hkv, rows, n]
        k_pos = torch.arange(j0, j1, device=qp.device)
        vis = visible_mask(row_pos, k_pos, causal=True, window=window)
        if not bool(vis.all()):
            s = s.masked_fill(~vis, float("-inf"))
        state.update(s, v_t)
    return state.finalize()
