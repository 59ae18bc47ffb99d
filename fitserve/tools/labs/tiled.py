"""Tiled attention forward with online softmax (FlashAttention-2 order), returning O and LSE.

Tiling of one head (M queries x N keys, tiles of block_m x block_n):

             key tile 0   key tile 1   key tile 2
            +-----------+-----------+-------+
    q tile 0|  masked   |  skipped  |skipped|     causal, bottom-right, M = N
            +-----------+-----------+-------+
    q tile 1|   full    |  masked   |skipped|     full   : every pair visible, no mask work
            +-----------+-----------+-------+     masked : some pairs visible, apply mask
    q tile 2|   full    |   full    |masked |     skipped: no pair visible, never loaded
            +-----------+-----------+-------+

The outer loop runs over query tiles (each owns its fp32 running max m, running sum l and
accumulator O), the inner loop over key tiles; K/V tiles are therefore re-read once per query tile
(see counters.py for the traffic this implies).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from fitserve.tools.labs.masks import bottom_right_positions, visible_mask
from fitserve.tools.labs.online_softmax import ACC_DTYPE, OnlineSoftmax


@dataclass(slots=True)
class TileStats:
    """Counts of (query tile, key tile) pairs by how the kernel treated them."""

    skipped: int = 0
    full: int = 0
    masked: int = 0

    @property
    def visited(self) -> int:
        """Tiles whose K/V were loaded and multiplied."""
        return self.full + self.masked


@dataclass(slots=True)
class MaskArgs:
    """Per-row / per-column mask inputs shared by the forward and backward kernels."""

    q_pos: Tensor
    k_pos: Tensor
    causal: bool
    window: int | None
    q_seg: Tensor | None
    k_seg: Tensor | None
    k_sorted: bool = False

    def tile(self, i0: int, i1: int, j0: int, j1: int) -> Tensor:
        """Visibility mask of query rows [i0, i1) against key columns [j0, j1)."""
        return visible_mask(
            self.q_pos[i0:i1], self.k_pos[j0:j1], causal=self.causal, window=self.window,
            q_seg=None if self.q_seg is None else self.q_seg[i0:i1],
            k_seg=None if self.k_seg is None else self.k_seg[j0:j1],
        )


def make_mask_args(m_rows: int, n_cols: int, device: torch.device, *, causal: bool,
                   window: int | None, q_pos: Tensor | None, k_pos: Tensor | None,
                   q_seg: Tensor | None, k_seg: Tensor | None) -> MaskArgs:
    """Fill in bottom-right default positions."""
    dq, dk = bottom_right_positions(m_rows, n_cols, device)
    k_sorted = k_seg is not None and bool((k_seg[1:] >= k_seg[:-1]).all())
    return MaskArgs(dq if q_pos is None else q_pos, dk if k_pos is None else k_pos,
                    causal, window, q_seg, k_seg, k_sorted)


def _segment_key_range(margs: MaskArgs, i0: int, i1: int, n_cols: int, block_n: int
                       ) -> tuple[int, int]:
    """Key-tile loop bounds [lo, hi) for query rows [i0, i1).

    With packed segments (sorted k_seg, as varlen produces) only keys of the segments present in
    the query tile can be visible, so the loop is restricted to them instead of scanning every
    packed key tile; ``lo`` is rounded down to a tile boundary so tiles stay aligned.
    """
    if margs.q_seg is None or margs.k_seg is None or n_cols == 0 or not margs.k_sorted:
        return 0, n_cols
    seg = margs.q_seg[i0:i1]
    lo = int(torch.searchsorted(margs.k_seg, seg.min(), right=False))
    hi = int(torch.searchsorted(margs.k_seg, seg.max(), right=True))
    return (lo // block_n) * block_n, hi


def tiled_attention(
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
    block_m: int = 64,
    block_n: int = 64,
    stats: TileStats | None = None,
) -> tuple[Tensor, Tensor]:
    """Tiled online-softmax attention.

    Args:
        q: [..., M, D]; k: [..., N, D]; v: [..., N, Dv] with equal leading dims.
        scale: defaults to 1/sqrt(D).
        causal, window, q_pos, k_pos, q_seg, k_seg: visibility, see :func:`visible_mask`;
            positions default to bottom-right alignment.
        block_m, block_n: tile sizes.
        stats: if given, incremented with the number of skipped / full / masked tiles.

    Returns:
        (out [..., M, Dv] in q.dtype, lse [..., M] fp32). Empty rows: out = 0, lse = -inf.
    """
    m_rows, n_cols, dv = q.shape[-2], k.shape[-2], v.shape[-1]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    margs = make_mask_args(m_rows, n_cols, q.device, causal=causal, window=window, q_pos=q_pos,
                           k_pos=k_pos, q_seg=q_seg, k_seg=k_seg)
    lead = q.shape[:-2]
    out = torch.empty((*lead, m_rows, dv), dtype=q.dtype, device=q.device)
    lse = torch.empty((*lead, m_rows), dtype=ACC_DTYPE, device=q.device)
    n_tiles_k = -(-n_cols // block_n)
    for i0 in range(0, m_rows, block_m):
        i1 = min(i0 + block_m, m_rows)
        q_tile = q[..., i0:i1, :].to(ACC_DTYPE) * scale  # NOTE: scale folded into Q once
        state = OnlineSoftmax((*lead, i1 - i0), dv, q.device)
        lo, hi = _segment_key_range(margs, i0, i1, n_cols, block_n)
        if stats is not None:
            stats.skipped += n_tiles_k - len(range(lo, hi, block_n))
        for j0 in range(lo, hi, block_n):
            j1 = min(j0 + block_n, n_cols)
            vis = margs.tile(i0, i1, j0, j1)
            if not bool(vis.any()):
                if stats is not None:
                    stats.skipped += 1
                continue
            s = torch.matmul(q_tile, k[..., j0:j1, :].to(ACC_DTYPE).transpose(-1, -2))
            if bool(vis.all()):
                if stats is not None:
                    stats.full += 1
            else:
                s = s.masked_fill(~vis, float("-inf"))
                if stats is not None:
                    stats.masked += 1
            state.update(s, v[..., j0:j1, :])
        o_tile, lse_tile = state.finalize()
        out[..., i0:i1, :] = o_tile.to(q.dtype)
        lse[..., i0:i1] = lse_tile
    return out, lse
