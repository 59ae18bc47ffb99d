"""Attention over the paged KV cache for a ragged batch of chunks.

Each sequence b contributes T_b new query tokens that sit at absolute positions
S_b .. S_b+T_b-1, after S_b tokens already in the cache. Its keys are positions 0 .. S_b+T_b-1.
The causal mask is aligned bottom-right (query i sees keys 0 .. S_b+i)::

    S=3, T=2          keys ->  0 1 2 3 4
    query 0 (pos 3)            x x x x .
    query 1 (pos 4)            x x x x x

``scaled_dot_product_attention(is_causal=True)`` would align it top-left (query 0 seeing only
key 0), which is only right when S == 0.

The batch is packed decodes-first: sequences with T == 1 run together as one padded batched
matmul (GQA folded: the G query heads of a KV head become G rows against that head's keys);
longer chunks run one sequence at a time through scaled_dot_product_attention.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class PrefillSeq:
    """One multi-token chunk: tokens [start, end) of the packed batch, after ``cached`` tokens."""

    start: int
    end: int
    cached: int
    block_ids: torch.Tensor  # [ceil((cached + T) / block_size)] long
    mask: torch.Tensor | None  # [T, cached + T] bool (True = visible), None = plain causal


@dataclass(slots=True)
class DecodeBatch:
    """The first ``num`` tokens of the packed batch, one per sequence."""

    num: int
    block_tables: torch.Tensor  # [num, max_blocks] long, padded with block 0
    visible: torch.Tensor  # [num, 1, 1, max_blocks * block_size] bool


@dataclass(slots=True)
class AttentionBatch:
    """Per-step tensors shared by every layer."""

    slot_mapping: torch.Tensor  # [N] long: cache slot each new token's K/V is written to
    decode: DecodeBatch | None
    prefills: list[PrefillSeq] = field(default_factory=list)


def visible_mask(
    num_queries: int, num_cached: int, window: int | None, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """Bool [T, S+T]: query i (position S+i) sees key j iff j <= S+i and S+i-j < window."""
    q_pos = torch.arange(num_cached, num_cached + num_queries, device=device).unsqueeze(1)
    k_pos = torch.arange(num_cached + num_queries, device=device).unsqueeze(0)
    mask = k_pos <= q_pos
    if window is not None:
        mask &= (q_pos - k_pos) < window
    return mask


def write_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor
) -> None:
    """Scatter new K/V [N, Hkv, D] into caches [num_blocks, block_size, Hkv, D] at flat slots."""
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, k)
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, v)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: AttentionBatch,
    scale: float,
) -> torch.Tensor:
    """q [N, Hq, D] -> out [N, Hq, D]; the new tokens' K/V must already be in the cache."""
    out = torch.empty_like(q)
    if batch.decode is not None and batch.decode.num > 0:
        d = batch.decode
        out[: d.num] = _decode_attention(q[: d.num], k_cache, v_cache, d, scale)
    for seq in batch.prefills:
        out[seq.start : seq.end] = _chunk_attention(q[seq.start : seq.end], k_cache, v_cache, seq, scale)
    return out


def _decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, d: DecodeBatch, scale: float
) -> torch.Tensor:
    num, num_heads, head_dim = q.shape
    num_kv = k_cache.shape[2]
    group = num_heads // num_kv
    # [B, blocks, bs, Hkv, D] -> [B, Hkv, L, D]
    k = k_cache[d.block_tables].flatten(1, 2).transpose(1, 2)
    v = v_cache[d.block_tables].flatten(1, 2).transpose(1, 2)
    qg = q.view(num, num_kv, group, head_dim)  # GQA folded into rows
    scores = torch.matmul(qg, k.transpose(-1, -2)).float() * scale  # [B, Hkv, G, L]
    scores = scores.masked_fill(~d.visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    return torch.matmul(probs, v).reshape(num, num_heads, head_dim)


def _chunk_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seq: PrefillSeq, scale: float
) -> torch.Tensor:
    t = q.shape[0]
    total = seq.cached + t
    k = k_cache[seq.block_ids].flatten(0, 1)[:total]  # [S+T, Hkv, D]
    v = v_cache[seq.block_ids].flatten(0, 1)[:total]
    num_heads, num_kv = q.shape[1], k.shape[1]
    qh = q.transpose(0, 1).unsqueeze(0)  # [1, Hq, T, D]
    kh = k.transpose(0, 1).unsqueeze(0)
    vh = v.transpose(0, 1).unsqueeze(0)
    if num_kv != num_heads:
        kh = kh.repeat_interleave(num_heads // num_kv, dim=1)
        vh = vh.repeat_interleave(num_heads // num_kv, dim=1)
    if seq.mask is None:
        o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale)
    else:
        o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=seq.mask, scale=scale)
    return o.squeeze(0).transpose(0, 1)
