"""Attention over the paged KV cache for a ragged batch of chunks.

Each sequence b contributes T_b new query tokens that sit at absolute positions
S_b .. S_b+T_b-1, after S_b tokens already in the cache. Its keys are positions 0 .. S_b+T_b-1.
The causal mask is aligned bottom-right (query i sees keys 0 .. S_b+i)::

    S=3, T=2          keys ->  0 1 2 3 4
    query 0 (pos 3)            x x x x .
    query 1 (pos 4)            x x x x x

``scaled_dot_product_attention(is_causal=True)`` would align it top-left (query 0 seeing only
key 0), which is only right when S == 0.

The batch is packed decodes-first: sequences with T == 1 run together in one call, either the
fused C++ kernel on the CPU ("cpu_paged": reads the blocks in place through the block table,
online softmax, no gather) or one padded batched matmul over gathered blocks (GQA folded: the
G query heads of a KV head become G rows against that head's keys); longer chunks run one
sequence at a time. Which implementation runs each group (the C++ kernel, eager folded "naive",
torch SDPA, or the Triton kernels on CUDA) is the rule in fitserve.model.attention.dispatch, read off
benchmarks/bench_kernels.py; the runner picks it once per step and builds the tensors it needs.

The cache is head-major, [num_kv_heads, num_blocks, block_size, head_dim] per layer, so that
gathering a sequence's blocks yields [Hkv, L, D] matrices that matmul and SDPA read in place
(a token-major cache needs a transposing copy of every gathered key and value).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from fitserve.kernels.cpu.paged_attention import paged_decode_attention


@dataclass(slots=True)
class PrefillSeq:
    """One multi-token chunk: tokens [start, end) of the packed batch, after ``cached`` tokens."""

    start: int
    end: int
    cached: int
    block_ids: torch.Tensor  # [ceil((cached + T) / block_size)] long
    mask: torch.Tensor | None  # [T, cached + T] bool (True = visible), None = plain causal
    impl: str = "sdpa"  # from fitserve.model.attention.dispatch.choose_attention_impl
    hidden: torch.Tensor | None = None  # ~mask, made once per step for the "naive" path
    window: int | None = None


@dataclass(slots=True)
class DecodeBatch:
    """The first ``num`` tokens of the packed batch, one per sequence."""

    num: int
    block_tables: torch.Tensor  # [num, max_blocks], padded with block 0 (int32 for "cpu_paged")
    visible: torch.Tensor | None  # [1, num, 1, max_blocks * block_size] bool (gather paths)
    hidden: torch.Tensor | None = None  # ~visible, made once per step for the "naive" path
    seq_lens: torch.Tensor | None = None  # [num] keys per sequence (Triton / "cpu_paged")
    impl: str = "naive"  # from fitserve.model.attention.dispatch.choose_attention_impl
    window: int | None = None


@dataclass(slots=True)
class AttentionBatch:
    """Per-step tensors shared by every layer."""

    slot_mapping: torch.Tensor  # [N] long: cache slot each new token's K/V is written to
    decode: DecodeBatch | None
    prefills: list[PrefillSeq] = field(default_factory=list)
    # quantized KV: the physical blocks the step reads, in the order of the compact dense cache
    # they are dequantized into (the block tables above index that compact cache)
    kv_blocks: torch.Tensor | None = None


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
    """Scatter new K/V [N, Hkv, D] into caches [Hkv, num_blocks, block_size, D] at flat slots."""
    hk, _, _, d = k_cache.shape
    k_cache.view(hk, -1, d).index_copy_(1, slots, k.transpose(0, 1))
    v_cache.view(hk, -1, d).index_copy_(1, slots, v.transpose(0, 1))


def gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """cache [Hkv, NB, bs, D], block ids [..., n] -> [Hkv, ..., n * bs, D] in one index_select.

    NOTE: index_select over a flattened block axis is ~3x faster than advanced indexing here.
    """
    hk, nb, bs, d = cache.shape
    flat = cache.view(hk, nb, bs * d).index_select(1, block_ids.reshape(-1))
    return flat.view(hk, *block_ids.shape[:-1], block_ids.shape[-1] * bs, d)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: AttentionBatch,
    scale: float,
) -> torch.Tensor:
    """q [N, Hq, D] -> out [N, Hq, D]; the new tokens' K/V must already be in the cache."""
    if not batch.prefills and batch.decode is not None and batch.decode.num == q.shape[0]:
        return _decode_attention(q, k_cache, v_cache, batch.decode, scale)  # all decodes: no copy
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
    if d.impl == "cpu_paged":
        assert d.seq_lens is not None
        return paged_decode_attention(q, k_cache, v_cache, d.block_tables, d.seq_lens, scale,
                                      d.window)
    if d.impl == "triton_decode":
        return _decode_triton(q, k_cache, v_cache, d, scale)
    assert d.visible is not None, f"decode impl {d.impl!r} needs the visible mask"
    num, num_heads, head_dim = q.shape
    num_kv = k_cache.shape[0]
    group = num_heads // num_kv
    # [Hkv, B, blocks, bs, D] -> [Hkv, B, L, D]: contiguous, no copy before the matmuls
    k = gather_blocks(k_cache, d.block_tables)
    v = gather_blocks(v_cache, d.block_tables)
    if d.impl == "sdpa":
        o = F.scaled_dot_product_attention(
            q.unsqueeze(2), k.transpose(0, 1), v.transpose(0, 1),
            attn_mask=d.visible.transpose(0, 1), scale=scale, enable_gqa=True,
        )  # [B, Hq, 1, D]
        return o.reshape(num, num_heads, head_dim)
    qg = (q * scale).reshape(num, num_kv, group, head_dim).transpose(0, 1)  # GQA folded into rows
    scores = torch.matmul(qg, k.transpose(-1, -2)).float()  # [Hkv, B, G, L]
    scores = scores.masked_fill_(d.hidden if d.hidden is not None else ~d.visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    return torch.matmul(probs, v).transpose(0, 1).reshape(num, num_heads, head_dim)


def _decode_triton(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, d: DecodeBatch, scale: float
) -> torch.Tensor:
    from fitserve.kernels.split_plan import choose_num_splits
    from fitserve.kernels.triton.decode import triton_paged_decode

    assert d.seq_lens is not None
    block_n = 32
    workers = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 2
    longest = int(d.block_tables.shape[1] * k_cache.shape[2])
    splits = choose_num_splits(workers, q.shape[0], k_cache.shape[0], -(-longest // block_n))
    # the kernel reads a token-major [NB, bs, Hkv, D] view through strides: no copy
    out, _ = triton_paged_decode(
        q, k_cache.permute(1, 2, 0, 3), v_cache.permute(1, 2, 0, 3), d.block_tables, d.seq_lens,
        num_splits=splits, scale=scale, sliding_window=d.window, block_n=block_n,
    )
    return out


def _chunk_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seq: PrefillSeq, scale: float
) -> torch.Tensor:
    t = q.shape[0]
    total = seq.cached + t
    num_heads, num_kv = q.shape[1], k_cache.shape[0]
    group = num_heads // num_kv
    kh = gather_blocks(k_cache, seq.block_ids)[:, :total].unsqueeze(0)  # [1, Hkv, S+T, D]
    vh = gather_blocks(v_cache, seq.block_ids)[:, :total].unsqueeze(0)
    qh = q.transpose(0, 1).unsqueeze(0)  # [1, Hq, T, D]
    if seq.impl == "triton_forward":
        from fitserve.kernels.triton.forward import triton_attention_forward

        o, _ = triton_attention_forward(qh, kh, vh, scale=scale, causal=True, window=seq.window)
        return o.squeeze(0).transpose(0, 1)
    if seq.impl == "naive":
        # eager, GQA folded: the T queries of the G heads of one KV head become G*T rows
        qg = (q * scale).reshape(t, num_kv, group, -1).permute(1, 2, 0, 3).reshape(num_kv, group * t, -1)
        scores = torch.matmul(qg, kh[0].transpose(-1, -2)).float().view(num_kv, group, t, total)
        hidden = seq.hidden if seq.hidden is not None else ~visible_mask(t, seq.cached, seq.window, q.device)
        probs = torch.softmax(scores.masked_fill_(hidden, float("-inf")), dim=-1).to(vh.dtype)
        o = torch.matmul(probs.view(num_kv, group * t, total), vh[0])  # [Hkv, G*T, D]
        return o.view(num_kv, group, t, -1).permute(2, 0, 1, 3).reshape(t, num_heads, -1)
    if seq.mask is None:
        o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=True)
    else:
        o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=seq.mask, scale=scale, enable_gqa=True)
    return o.squeeze(0).transpose(0, 1)
