"""The fused C++ paged decode backend (fitserve/kernels/cpu/paged_attention.cpp): K/V read in
place through the block table, fp32 online softmax, no gather and no mask tensors."""

from __future__ import annotations

import torch

from fitserve.kernels.cpu.paged_attention import paged_decode_attention
from fitserve.ledger.scratch import ScratchKind
from fitserve.model.attention.backend import AttentionBackend, DecodeBatch, padded_tables


class CpuPagedDecode(AttentionBackend):
    """Decode only: the C++ kernel masks by itself from int32 block tables and lengths."""

    name = "cpu_paged_decode"
    ledger_kind = ScratchKind.FUSED_DECODE

    def decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               d: DecodeBatch, scale: float) -> torch.Tensor:
        assert d.seq_lens is not None
        return paged_decode_attention(q, k_cache, v_cache, d.block_tables, d.seq_lens, scale,
                                      d.window)

    def build_decode(self, tables: list[list[int]], seq_lens: list[int], *, block_size: int,
                     window: int | None, device: torch.device) -> DecodeBatch:
        """int32 block tables and lengths, what the kernel reads (no [B, L] masks to build)."""
        width = max(-(-n // block_size) for n in seq_lens)
        return DecodeBatch(
            num=len(tables), backend=self,
            block_tables=torch.tensor(padded_tables(tables, width), dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device), window=window,
        )


CPU_PAGED_DECODE = CpuPagedDecode()
