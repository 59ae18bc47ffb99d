"""Split-KV decode: one query per sequence over a long cache, keys split across workers.

Decode has B * Hkv independent work items (GQA-folded: one per KV head). With fewer items than
workers (SMs on a GPU, cores here) most workers idle, so the key axis is cut into P splits, each
computing a partial (O_p, LSE_p); the partials are merged exactly (online_softmax.merge_lse).

Wave-efficiency rule (the FlashAttention-2 heuristic). With W workers and B*Hkv*P work items,
the kernel runs in ceil(B*Hkv*P / W) waves and

    efficiency(P) = B*Hkv*P / (W * ceil(B*Hkv*P / W))

    W = 8, B*Hkv = 3:  P=1  3/8  = 0.38   |###.....|
                       P=2  6/8  = 0.75   |######..|
                       P=3  9/16 = 0.56   |########|#.......|
                       P=5 15/16 = 0.94   |########|#######.|   <- chosen (>= 0.85 * best)

Rules: P = 1 when B*Hkv already fills >= 80% of the workers; P never exceeds the number of key
blocks nor W nor max_splits; a P that gives the same blocks-per-split as P-1 is not eligible
(it adds merge work without shortening the longest split); among eligible P the smallest whose
efficiency is >= 85% of the best is chosen.

Splits over the key axis (ragged batch: splits are sized on the longest sequence, so a short
sequence can have empty trailing splits, which come back as (0, -inf) and weigh 0 in the merge):

    keys 0 ........................................ S_max
         | split 0   | split 1   | split 2   | split 3 |
    b=0  |###########|###########|####       |         |   seq_len 36 of 48
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from fitserve.kernels.split_plan import choose_num_splits, wave_efficiency
from fitserve.tools.labs.gqa import group_size
from fitserve.tools.labs.online_softmax import ACC_DTYPE, OnlineSoftmax, merge_lse

__all__ = ["choose_num_splits", "split_kv_decode", "wave_efficiency"]


def split_kv_decode(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    seq_lens: Tensor,
    *,
    num_splits: int,
    scale: float | None = None,
    sliding_window: int | None = None,
    block_n: int = 64,
) -> tuple[Tensor, Tensor]:
    """Decode attention of one query per sequence, key axis cut into ``num_splits`` splits.

    Args:
        q: [B, Hq, D] (the query of each sequence sits at position seq_lens[b] - 1).
        k, v: [B, S_max, Hkv, D] contiguous caches; keys >= seq_lens[b] are ignored.
        seq_lens: [B] keys per sequence (>= 1 for a meaningful row; 0 gives out 0, lse -inf).
        num_splits: P, e.g. from :func:`choose_num_splits`.
        scale: default 1/sqrt(D).
        sliding_window: query at p sees keys p-w+1 .. p.
        block_n: key tile inside a split.

    Returns:
        (out [B, Hq, D] in q.dtype, lse [B, Hq] fp32), equal to the unsplit result.
    """
    bsz, hq, d = q.shape
    s_max, hkv = k.shape[1], k.shape[2]
    g = group_size(hq, hkv)
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    n_blocks = max(1, math.ceil(s_max / block_n))
    blocks_per_split = math.ceil(n_blocks / num_splits)
    chunk = blocks_per_split * block_n
    pad = chunk * num_splits - s_max
    # [B, S, Hkv, D] -> [B, Hkv, P, chunk, D]: every split is an independent batch entry.
    kp = F.pad(k, (0, 0, 0, 0, 0, pad)).view(bsz, num_splits, chunk, hkv, -1).permute(0, 3, 1, 2, 4)
    vp = F.pad(v, (0, 0, 0, 0, 0, pad)).view(bsz, num_splits, chunk, hkv, -1).permute(0, 3, 1, 2, 4)
    qg = (q.to(ACC_DTYPE) * scale).view(bsz, hkv, 1, g, d)           # GQA-folded rows
    lens = seq_lens.to(torch.int64).view(bsz, 1, 1, 1, 1)
    split_base = (torch.arange(num_splits, device=q.device) * chunk).view(1, 1, num_splits, 1, 1)
    state = OnlineSoftmax((bsz, hkv, num_splits, g), v.shape[-1], q.device)
    for j0 in range(0, chunk, block_n):
        j1 = j0 + block_n
        s = torch.matmul(qg, kp[..., j0:j1, :].to(ACC_DTYPE).transpose(-1, -2))  # [B,Hkv,P,G,n]
        key_pos = split_base + torch.arange(j0, j1, device=q.device).view(1, 1, 1, 1, -1)
        vis = key_pos < lens
        if sliding_window is not None:
            vis = vis & (key_pos >= lens - sliding_window)
        state.update(s.masked_fill(~vis, float("-inf")), vp[..., j0:j1, :])
    part_out, part_lse = state.finalize()                            # [B,Hkv,P,G,(D)]
    out, lse = merge_lse(part_out, part_lse, dim=2)                  # [B,Hkv,G,(D)]
    return out.reshape(bsz, hq, -1).to(q.dtype), lse.reshape(bsz, hq)
