"""Attention over the paged KV cache for a ragged batch of chunks.

Each sequence b contributes T_b new query tokens that sit at absolute positions
S_b .. S_b+T_b-1, after S_b tokens already in the cache. Its keys are positions 0 .. S_b+T_b-1.
The causal mask is aligned bottom-right (query i sees keys 0 .. S_b+i)::

    S=3, T=2          keys ->  0 1 2 3 4
    query 0 (pos 3)            x x x x .
    query 1 (pos 4)            x x x x x

``scaled_dot_product_attention(is_causal=True)`` would align it top-left (query 0 seeing only
key 0), which is only right when S == 0.

The batch is packed decodes-first: sequences with T == 1 run together in one call of the
decode group's backend, either the fused C++ kernel on the CPU (``CpuPagedDecode``: reads the
blocks in place through the block table, online softmax, no gather) or one padded batched call
over gathered blocks; longer chunks run one sequence at a time. Which backend runs each group
(fitserve.model.attention.backend: the C++ kernel, ``EagerGather``, ``TorchSDPA``, or the Triton
kernels on CUDA) is the rule in fitserve.model.attention.dispatch; the runner picks it once per
step, and the backend builds the tensors it needs.

The cache is head-major, [num_kv_heads, num_blocks, block_size, head_dim] per layer, so that
gathering a sequence's blocks yields [Hkv, L, D] matrices that matmul and SDPA read in place
(a token-major cache needs a transposing copy of every gathered key and value).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from fitserve.model.attention.backend import DecodeBatch, PrefillSeq


@dataclass(slots=True)
class AttentionBatch:
    """Per-step tensors shared by every layer."""

    slot_mapping: torch.Tensor  # [N] long: cache slot each new token's K/V is written to
    decode: DecodeBatch | None
    prefills: list[PrefillSeq] = field(default_factory=list)
    # quantized KV: the physical blocks the step reads, in the order of the compact dense cache
    # they are dequantized into (the block tables above index that compact cache)
    kv_blocks: torch.Tensor | None = None
    # a hybrid model's KV layer groups (fitserve.kv.group): the batch each layer reads (its
    # group's tables, slots and window); None: every layer reads this one
    per_layer: list[AttentionBatch] | None = None

    def layer_batches(self, num_layers: int) -> list[AttentionBatch]:
        """The batch of each of ``num_layers`` layers."""
        return self.per_layer if self.per_layer is not None else [self] * num_layers


def write_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor
) -> None:
    """Scatter new K/V [N, Hkv, D] into caches [Hkv, num_blocks, block_size, D] at flat slots."""
    hk, _, _, d = k_cache.shape
    k_cache.view(hk, -1, d).index_copy_(1, slots, k.transpose(0, 1))
    v_cache.view(hk, -1, d).index_copy_(1, slots, v.transpose(0, 1))


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: AttentionBatch,
    scale: float,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [N, Hq, D] -> out [N, Hq, D]; the new tokens' K/V must already be in the cache.
    ``sinks`` [Hq]: a learned logit per head in each softmax's denominator (gpt-oss), taken
    only by a backend that ``supports_sinks`` (the dispatch rule picks one)."""
    d = batch.decode
    extra = {} if sinks is None else {"sinks": sinks}
    for backend in ([d.backend] if d is not None else []) + [s.backend for s in batch.prefills]:
        if sinks is not None and not backend.supports_sinks:
            raise ValueError(f"attention backend {backend.name} does not apply attention sinks")
    if not batch.prefills and d is not None and d.num == q.shape[0]:
        return d.backend.decode(q, k_cache, v_cache, d, scale, **extra)  # all decodes: no copy
    out = torch.empty_like(q)
    if d is not None and d.num > 0:
        out[: d.num] = d.backend.decode(q[: d.num], k_cache, v_cache, d, scale, **extra)
    for seq in batch.prefills:
        out[seq.start : seq.end] = seq.backend.prefill(q[seq.start : seq.end], k_cache, v_cache,
                                                       seq, scale, **extra)
    return out
