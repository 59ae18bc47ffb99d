"""The Triton backends (CUDA, or the Triton interpreter): split-KV paged decode and the
forward kernel over a chunk's gathered K/V. The kernels import on first call."""

from __future__ import annotations

import torch

from fitserve.model.attention.backend import AttentionBackend, DecodeBatch, PrefillSeq
from fitserve.model.attention.gather import gather_chunk_kv


class TritonPagedDecode(AttentionBackend):
    """Decode only: fitserve.kernels.triton.decode reads the cache through the block tables."""

    name = "triton_decode"

    def decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               d: DecodeBatch, scale: float) -> torch.Tensor:
        from fitserve.kernels.split_plan import choose_num_splits
        from fitserve.kernels.triton.decode import triton_paged_decode

        assert d.seq_lens is not None
        block_n = 32
        workers = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 2
        longest = int(d.block_tables.shape[1] * k_cache.shape[2])
        splits = choose_num_splits(workers, q.shape[0], k_cache.shape[0], -(-longest // block_n))
        # the kernel reads a token-major [NB, bs, Hkv, D] view through strides: no copy
        out, _ = triton_paged_decode(
            q, k_cache.permute(1, 2, 0, 3), v_cache.permute(1, 2, 0, 3), d.block_tables,
            d.seq_lens, num_splits=splits, scale=scale, sliding_window=d.window, block_n=block_n,
        )
        return out


class TritonPrefill(AttentionBackend):
    """Prefill only: fitserve.kernels.triton.forward over the chunk's gathered K/V."""

    name = "triton_prefill"

    def prefill(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                seq: PrefillSeq, scale: float) -> torch.Tensor:
        from fitserve.kernels.triton.forward import triton_attention_forward

        kh, vh = gather_chunk_kv(k_cache, v_cache, seq, seq.cached + q.shape[0])
        qh = q.transpose(0, 1).unsqueeze(0)  # [1, Hq, T, D]
        o, _ = triton_attention_forward(qh, kh, vh, scale=scale, causal=True, window=seq.window)
        return o.squeeze(0).transpose(0, 1)


TRITON_DECODE = TritonPagedDecode()
TRITON_PREFILL = TritonPrefill()
