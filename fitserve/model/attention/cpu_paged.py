"""The fused C++ paged decode backend (fitserve/kernels/cpu/paged_attention.cpp): K/V read in
place through the block table, fp32 online softmax, no gather and no mask tensors; and its
quantized-cache twin (paged_attention_kvq.cpp) reading int8 / fp8 codes with their scales."""

from __future__ import annotations

import torch

from fitserve.kernels.cpu.paged_attention import paged_decode_attention, paged_prefill_attention
from fitserve.kernels.cpu.paged_attention_kvq import paged_decode_attention_kvq
from fitserve.ledger.scratch import ScratchKind, paged_prefill_rows
from fitserve.model.attention.backend import (
    AttentionBackend,
    DecodeBatch,
    PrefillSeq,
    padded_tables,
)
from fitserve.quant.kv_cache import QuantizedKVCache


class CpuPagedDecode(AttentionBackend):
    """The C++ kernel masks by itself from int32 block tables and lengths: decode, and prefill
    chunks in query tiles whose rows equal the decode kernel's (the batch-invariant prefill)."""

    name = "cpu_paged_decode"
    ledger_kind = ScratchKind.FUSED_DECODE

    def decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               d: DecodeBatch, scale: float) -> torch.Tensor:
        assert d.seq_lens is not None
        return paged_decode_attention(q, k_cache, v_cache, d.block_tables, d.seq_lens, scale,
                                      d.window)

    def prefill(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                seq: PrefillSeq, scale: float) -> torch.Tensor:
        """The chunk's queries in flash-style tiles (paged_prefill.h), each row bitwise the
        decode kernel's row over its own visible keys (the chunk's keys are in the cache
        already): query i sees keys [0, cached + i].

        NOTE: batch invariance: a token's attention is then computed by the one kernel, in one
        order, whether it came in a whole prompt, a chunk, after a prefix-cache hit, as a
        speculative draft being verified, or as a decode step (fixed key partitions, see
        paged_attention.py); torch's SDPA tiles a prompt by its length.
        """
        t, ids = q.shape[0], seq.block_ids.to(torch.int32)
        # NOTE: rows in slices: the kernel's fp32 partials grow with rows x partitions (58 MiB a
        # layer for 2,048 queries after 2,048 cached tokens, invisible to torch's allocator);
        # a row's result does not depend on the slice it runs in (fitserve.ledger.scratch)
        rows = paged_prefill_rows(q.shape[1], k_cache.shape[0], q.shape[2], seq.cached + t)
        if rows >= t:
            return paged_prefill_attention(q.contiguous(), k_cache, v_cache, ids, seq.cached,
                                           scale, seq.window)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        for lo in range(0, t, rows):
            hi = min(t, lo + rows)
            out[lo:hi] = paged_prefill_attention(q[lo:hi].contiguous(), k_cache, v_cache, ids,
                                                 seq.cached + lo, scale, seq.window)
        return out

    def build_decode(self, tables: list[list[int]], seq_lens: list[int], *, block_size: int,
                     window: int | None, device: torch.device) -> DecodeBatch:
        """int32 block tables and lengths, what the kernel reads (no [B, L] masks to build)."""
        width = max(-(-n // block_size) for n in seq_lens)
        return DecodeBatch(
            num=len(tables), backend=self,
            block_tables=torch.tensor(padded_tables(tables, width), dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device), window=window,
        )


class CpuPagedDecodeKVQ(CpuPagedDecode):
    """Decode over a quantized cache (fitserve/kernels/cpu/paged_attention_kvq.cpp): the int8 /
    fp8 codes and their scales read in place through the physical block tables (no dequantized
    copy). Prefill chunks with a quantized cache keep the dequantize-then-attend path."""

    name = "cpu_paged_decode_kvq"
    reads_quantized_kv = True

    def decode_quantized(self, q: torch.Tensor, kv: QuantizedKVCache, d: DecodeBatch,
                         scale: float) -> torch.Tensor:
        assert d.seq_lens is not None
        return paged_decode_attention_kvq(
            q, kv.k_codes, kv.v_codes, kv.k_scales, kv.v_scales, d.block_tables, d.seq_lens,
            scale, d.window, codec=kv.codec.name, channel_keys=kv.key_layout == "channel-key")


CPU_PAGED_DECODE = CpuPagedDecode()
CPU_PAGED_DECODE_KVQ = CpuPagedDecodeKVQ()
