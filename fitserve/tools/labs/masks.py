"""Attention masks as a function of absolute positions and segment ids.

Every kernel in this package decides visibility the same way: a query row carries an absolute
position (and, when sequences are packed, a segment id), a key column carries the same, and

    visible(i, j) = seg_q[i] == seg_k[j]                       (varlen packing)
                and k_pos[j] <= q_pos[i]                        (causal)
                and k_pos[j] >= q_pos[i] - window + 1           (sliding window)

Bottom-right alignment (a chunk of T new queries at the end of a cache of L keys) is simply
q_pos = L - T .. L - 1, k_pos = 0 .. L - 1:

    L = 6 keys, T = 2 queries       top-left (library default for T != L)
         k: 0 1 2 3 4 5                  k: 0 1 2 3 4 5
    q@4:    x x x x x .             q#0:    x . . . . .
    q@5:    x x x x x x             q#1:    x x . . . .

The right-hand mask is what ``torch.nn.functional.scaled_dot_product_attention(is_causal=True)``
applies when T != L; it is wrong for chunked prefill and decode.
"""

from __future__ import annotations

import torch
from torch import Tensor


def bottom_right_positions(num_queries: int, num_keys: int, device: torch.device | None = None
                           ) -> tuple[Tensor, Tensor]:
    """Absolute positions of T queries sitting at the end of L keys: (L-T .. L-1, 0 .. L-1)."""
    q_pos = torch.arange(num_queries, device=device, dtype=torch.int64) + (num_keys - num_queries)
    k_pos = torch.arange(num_keys, device=device, dtype=torch.int64)
    return q_pos, k_pos


def visible_mask(
    q_pos: Tensor,
    k_pos: Tensor,
    *,
    causal: bool,
    window: int | None = None,
    q_seg: Tensor | None = None,
    k_seg: Tensor | None = None,
) -> Tensor:
    """Boolean [M, N] mask, True where query row i may attend to key column j.

    Args:
        q_pos: [M] int absolute query positions.
        k_pos: [N] int absolute key positions.
        causal: keys after the query position are hidden.
        window: sliding window size w; a query at position p sees keys p-w+1 .. p. ``None`` or
            a window >= the sequence length means no window.
        q_seg, k_seg: optional [M] / [N] segment ids (packed varlen sequences); rows only see
            keys of their own segment.
    """
    qp = q_pos[:, None]
    kp = k_pos[None, :]
    mask = torch.ones(qp.shape[0], kp.shape[1], dtype=torch.bool, device=q_pos.device)
    if causal:
        mask &= kp <= qp
    if window is not None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        mask &= kp >= qp - (window - 1)
    if q_seg is not None or k_seg is not None:
        if q_seg is None or k_seg is None:
            raise ValueError("q_seg and k_seg must be given together")
        mask &= q_seg[:, None] == k_seg[None, :]
    return mask


def library_default_causal_mask(num_queries: int, num_keys: int) -> Tensor:
    """The top-left aligned causal mask that ``sdpa(is_causal=True)`` uses: tril(ones(T, L))."""
    return torch.ones(num_queries, num_keys, dtype=torch.bool).tril(diagonal=0)


def segment_ids(cu_seqlens: Tensor) -> Tensor:
    """Segment id of every packed token from cumulative lengths [B+1] (``cu_seqlens``).

    cu_seqlens = [0, 3, 3, 5] -> seg = [0, 0, 0, 2, 2] (sequence 1 is empty).
    """
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).to(torch.int64)
    ids = torch.arange(lens.numel(), device=cu_seqlens.device, dtype=torch.int64)
    return torch.repeat_interleave(ids, lens)


def local_positions(cu_seqlens: Tensor) -> Tensor:
    """Position of each packed token inside its own sequence (0-based)."""
    seg = segment_ids(cu_seqlens)
    starts = cu_seqlens[:-1].to(torch.int64)
    return torch.arange(seg.numel(), device=cu_seqlens.device, dtype=torch.int64) - starts[seg]
