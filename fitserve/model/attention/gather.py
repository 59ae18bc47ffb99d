"""The gather backends: each sequence's K/V blocks copied out of the cache, then attention.

``EagerGather`` (eager, GQA folded: the G query heads of a KV head become G rows against that
head's keys; matmul, fp32 softmax, matmul) and ``TorchSDPA`` (torch's
``scaled_dot_product_attention`` with ``enable_gqa``). They need no compiled kernel, so they run
everywhere; the dispatch rule gives them whatever the fused kernels do not take.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fitserve.ledger.scratch import ScratchKind
from fitserve.model.attention.backend import (
    AttentionBackend,
    DecodeBatch,
    PrefillSeq,
    soft_cap,
    visible_mask,
)


def gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """cache [Hkv, NB, bs, D], block ids [..., n] -> [Hkv, ..., n * bs, D] in one index_select.

    NOTE: index_select over a flattened block axis is ~3x faster than advanced indexing here.
    """
    hk, nb, bs, d = cache.shape
    flat = cache.view(hk, nb, bs * d).index_select(1, block_ids.reshape(-1))
    return flat.view(hk, *block_ids.shape[:-1], block_ids.shape[-1] * bs, d)


def gather_chunk_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, seq: PrefillSeq,
                    total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A chunk's first ``total`` keys and values, [1, Hkv, total, D] each."""
    kh = gather_blocks(k_cache, seq.block_ids)[:, :total].unsqueeze(0)
    vh = gather_blocks(v_cache, seq.block_ids)[:, :total].unsqueeze(0)
    return kh, vh


def softmax_with_sinks(scores: torch.Tensor, sinks: torch.Tensor | None,
                       shape: tuple[int, ...]) -> torch.Tensor:
    """softmax over the last dim of fp32 ``scores``; with ``sinks`` (one logit per query head,
    viewed as ``shape`` to broadcast over the scores), each row's softmax over [scores, sink]
    with the sink's column dropped (transformers' gpt-oss eager attention): the rows then sum
    to less than 1."""
    if sinks is None:
        return torch.softmax(scores, dim=-1)
    sink = sinks.float().view(shape).expand(*scores.shape[:-1], 1)
    return torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :-1]


class EagerGather(AttentionBackend):
    """Gathered K/V, GQA folded into rows, matmul + fp32 softmax + matmul."""

    name = "eager_gather"
    ledger_kind = ScratchKind.GATHER_EAGER
    supports_softcap = True
    supports_sinks = True

    def decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               d: DecodeBatch, scale: float, sinks: torch.Tensor | None = None) -> torch.Tensor:
        assert d.visible is not None, "EagerGather decode needs the visible mask"
        num, num_heads, head_dim = q.shape
        num_kv = k_cache.shape[0]
        # [Hkv, B, blocks, bs, D] -> [Hkv, B, L, D]: contiguous, no copy before the matmuls
        k = gather_blocks(k_cache, d.block_tables)
        v = gather_blocks(v_cache, d.block_tables)
        qg = (q * scale).reshape(num, num_kv, num_heads // num_kv, head_dim).transpose(0, 1)
        scores = soft_cap(torch.matmul(qg, k.transpose(-1, -2)).float(), d.softcap)  # [Hkv, B, G, L]
        hidden = d.hidden if d.hidden is not None else ~d.visible
        probs = softmax_with_sinks(scores.masked_fill_(hidden, float("-inf")), sinks,
                                   (num_kv, 1, num_heads // num_kv, 1)).to(v.dtype)
        return torch.matmul(probs, v).transpose(0, 1).reshape(num, num_heads, head_dim)

    def prefill(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                seq: PrefillSeq, scale: float, sinks: torch.Tensor | None = None) -> torch.Tensor:
        t = q.shape[0]
        total = seq.cached + t
        num_heads, num_kv = q.shape[1], k_cache.shape[0]
        group = num_heads // num_kv
        kh, vh = gather_chunk_kv(k_cache, v_cache, seq, total)
        # the T queries of the G heads of one KV head become G*T rows
        qg = (q * scale).reshape(t, num_kv, group, -1).permute(1, 2, 0, 3).reshape(num_kv, group * t, -1)
        scores = torch.matmul(qg, kh[0].transpose(-1, -2)).float().view(num_kv, group, t, total)
        scores = soft_cap(scores, seq.softcap)
        hidden = seq.hidden if seq.hidden is not None else ~visible_mask(t, seq.cached, seq.window, q.device)
        probs = softmax_with_sinks(scores.masked_fill_(hidden, float("-inf")), sinks,
                                   (num_kv, group, 1, 1)).to(vh.dtype)
        o = torch.matmul(probs.view(num_kv, group * t, total), vh[0])  # [Hkv, G*T, D]
        return o.view(num_kv, group, t, -1).permute(2, 0, 1, 3).reshape(t, num_heads, -1)

    def build_prefill(self, offset: int, cached: int, num_new: int, table: list[int], *,
                      block_size: int, window: int | None, device: torch.device) -> PrefillSeq:
        """The chunk's metadata plus ``hidden``: masked explicitly, so inverted once per step,
        not once per layer."""
        seq = super().build_prefill(offset, cached, num_new, table, block_size=block_size,
                                    window=window, device=device)
        mask = seq.mask if seq.mask is not None else visible_mask(num_new, cached, None, device)
        seq.hidden = ~mask
        return seq


class TorchSDPA(AttentionBackend):
    """Gathered K/V, torch ``scaled_dot_product_attention`` (GQA without expanding K/V)."""

    name = "torch_sdpa"
    ledger_kind = ScratchKind.GATHER_SDPA

    def decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               d: DecodeBatch, scale: float) -> torch.Tensor:
        assert d.visible is not None, "TorchSDPA decode needs the visible mask"
        num, num_heads, head_dim = q.shape
        k = gather_blocks(k_cache, d.block_tables)  # [Hkv, B, L, D]
        v = gather_blocks(v_cache, d.block_tables)
        o = F.scaled_dot_product_attention(
            q.unsqueeze(2), k.transpose(0, 1), v.transpose(0, 1),
            attn_mask=d.visible.transpose(0, 1), scale=scale, enable_gqa=True,
        )  # [B, Hq, 1, D]
        return o.reshape(num, num_heads, head_dim)

    def prefill(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                seq: PrefillSeq, scale: float) -> torch.Tensor:
        kh, vh = gather_chunk_kv(k_cache, v_cache, seq, seq.cached + q.shape[0])
        qh = q.transpose(0, 1).unsqueeze(0)  # [1, Hq, T, D]
        if seq.mask is None:
            o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=True)
        else:
            o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=seq.mask, scale=scale,
                                               enable_gqa=True)
        return o.squeeze(0).transpose(0, 1)


EAGER_GATHER = EagerGather()
TORCH_SDPA = TorchSDPA()
