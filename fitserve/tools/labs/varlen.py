"""Varlen attention: several sequences packed along the token axis, described by cu_seqlens.

    cu_seqlens_q = [0, 3, 5]    tokens: a a a | b b
    cu_seqlens_k = [0, 4, 6]    keys:   A A A A | B B

Tiles run over the *packed* axes, so one tile can hold the end of sequence a and the start of
sequence b; the segment-id term of the mask is what keeps b's queries off a's keys:

             keys  A0 A1 A2 A3 B0 B1
    a@1 (q0)        x  x  .  .  .  .        positions are bottom-right per sequence:
    a@2 (q1)        x  x  x  .  .  .        a's 3 queries sit at 1..3 of 4 keys,
    a@3 (q2)        x  x  x  x  .  .        b's 2 queries at 0..1 of 2 keys
    b@0 (q3)        .  .  .  .  x  .
    b@1 (q4)        .  .  .  .  x  x        (a causal-only mask on packed indices would
                                              let b@0 see A0..A3)
"""

from __future__ import annotations

import math

from torch import Tensor

from fitserve.tools.labs.gqa import group_size, pack_gqa, repeat_rows, unpack_gqa
from fitserve.tools.labs.masks import local_positions, segment_ids
from fitserve.tools.labs.tiled import TileStats, tiled_attention


def varlen_positions(cu_seqlens_q: Tensor, cu_seqlens_k: Tensor
                     ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(q_pos, k_pos, q_seg, k_seg) for packed sequences, queries bottom-right aligned."""
    q_seg, k_seg = segment_ids(cu_seqlens_q), segment_ids(cu_seqlens_k)
    lens_q = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).long()
    lens_k = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).long()
    q_pos = local_positions(cu_seqlens_q) + (lens_k - lens_q)[q_seg]
    return q_pos, local_positions(cu_seqlens_k), q_seg, k_seg


def varlen_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    *,
    scale: float | None = None,
    causal: bool = True,
    window: int | None = None,
    block_m: int = 64,
    block_n: int = 64,
    stats: TileStats | None = None,
) -> tuple[Tensor, Tensor]:
    """Attention over packed sequences with GQA folding.

    Args:
        q: [total_q, Hq, D]; k, v: [total_k, Hkv, D]; Hq a multiple of Hkv.
        cu_seqlens_q, cu_seqlens_k: [B+1] cumulative lengths (int).
        scale: defaults to 1/sqrt(D).
        causal, window: per-sequence masks with bottom-right aligned queries.
        block_m, block_n: tile sizes over the packed (and GQA-folded) row/key axes.
        stats: optional tile counter.

    Returns:
        (out [total_q, Hq, D] in q.dtype, lse [total_q, Hq] fp32).
    """
    hq, hkv = q.shape[1], k.shape[1]
    g = group_size(hq, hkv)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    q_pos, k_pos, q_seg, k_seg = varlen_positions(cu_seqlens_q, cu_seqlens_k)
    qp = pack_gqa(q, hkv)                                   # [Hkv, total_q*G, D]
    out, lse = tiled_attention(
        qp, k.transpose(0, 1), v.transpose(0, 1), scale=scale, causal=causal, window=window,
        q_pos=repeat_rows(q_pos, g), k_pos=k_pos, q_seg=repeat_rows(q_seg, g), k_seg=k_seg,
        block_m=block_m * g, block_n=block_n, stats=stats,
    )
    # NOTE: block_m counts tokens; with GQA folding a tile holds block_m * G rows.
    return unpack_gqa(out, hq), unpack_gqa(lse, hq)
