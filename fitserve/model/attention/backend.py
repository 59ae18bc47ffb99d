"""The attention backend interface and the per-step metadata a backend reads.

A scaled-down vLLM v1 ``AttentionBackend`` + ``AttentionMetadataBuilder`` + ``AttentionImpl``
in one stateless object: it names itself (``name`` for logs and benchmarks, ``ledger_kind`` for
fitserve.ledger.scratch), builds the metadata its kernels read once per step
(``build_decode`` for the decode group, ``build_prefill`` for one chunk) and runs them in every
layer (``decode`` / ``prefill``). fitserve.model.attention.dispatch picks the backend of each
group once per step; the metadata carries it, and
fitserve.model.attention.paged.paged_attention calls it.

Concrete backends: ``CpuPagedDecode`` (cpu_paged.py), ``EagerGather`` and ``TorchSDPA``
(gather.py), ``TritonPagedDecode`` and ``TritonPrefill`` (triton_attn.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from fitserve.ledger.scratch import ScratchKind
from fitserve.quant.kv_cache import QuantizedKVCache


class AttentionBackend:
    """One implementation of attention over the paged cache (stateless; one instance each).

    The default builders make the gather paths' metadata; a backend that reads something else
    overrides them. A backend that runs one phase only leaves the other method unimplemented.
    """

    name: ClassVar[str]
    # applies attention logit soft-capping (DecodeBatch/PrefillSeq.softcap; Gemma 2)
    supports_softcap: ClassVar[bool] = False
    # takes ``sinks=`` [Hq] in decode / prefill: a per-head logit in the softmax (gpt-oss)
    supports_sinks: ClassVar[bool] = False
    # NOTE: None for the CUDA backends: the ledger sizes CPU steps only
    ledger_kind: ClassVar[ScratchKind | None] = None
    # decode reads a QuantizedKVCache's codes in place (``decode_quantized``), so the runner
    # makes no dequantized compact cache for a step whose only group this backend runs
    reads_quantized_kv: ClassVar[bool] = False

    def __repr__(self) -> str:
        return type(self).__name__

    def decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               d: DecodeBatch, scale: float) -> torch.Tensor:
        """q [B, Hq, D] (one new token per sequence) -> out [B, Hq, D]."""
        raise NotImplementedError(f"{self.name} runs no decode")

    def decode_quantized(self, q: torch.Tensor, kv: QuantizedKVCache, d: DecodeBatch,
                         scale: float) -> torch.Tensor:
        """q [B, Hq, D] over a quantized cache read in place (physical block tables)."""
        raise NotImplementedError(f"{self.name} reads no quantized KV cache")

    def prefill(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                seq: PrefillSeq, scale: float) -> torch.Tensor:
        """q [T, Hq, D] of one chunk -> out [T, Hq, D]."""
        raise NotImplementedError(f"{self.name} runs no prefill")

    def build_decode(self, tables: list[list[int]], seq_lens: list[int], *, block_size: int,
                     window: int | None, device: torch.device) -> DecodeBatch:
        """The decode group of one step (one new token per sequence, ``seq_lens`` keys each,
        the new one included): int64 block tables padded with block 0, the lengths, and the
        visible mask over every padded key with its inverse, made once per step, not per layer."""
        width = max(-(-n // block_size) for n in seq_lens)
        lens = torch.tensor(seq_lens, dtype=torch.long, device=device).unsqueeze(1)
        key_pos = torch.arange(width * block_size, device=device).unsqueeze(0)
        visible = key_pos < lens
        if window is not None:
            # the query sits at position len-1 and sees keys with (len-1) - key < window
            visible &= (lens - 1 - key_pos) < window
        return DecodeBatch(
            num=len(tables), backend=self,
            block_tables=torch.tensor(padded_tables(tables, width), dtype=torch.long, device=device),
            seq_lens=lens.squeeze(1), visible=visible[None, :, None, :],
            hidden=~visible[None, :, None, :], window=window,
        )

    def build_prefill(self, offset: int, cached: int, num_new: int, table: list[int], *,
                      block_size: int, window: int | None, device: torch.device) -> PrefillSeq:
        """One chunk: tokens [offset, offset+num_new) of the packed batch, after ``cached``
        tokens of the sequence whose blocks are ``table``; a bool mask unless plain causal."""
        plain_causal = cached == 0 and (window is None or window >= num_new)
        total = cached + num_new
        return PrefillSeq(
            start=offset, end=offset + num_new, cached=cached, backend=self,
            block_ids=torch.tensor(table[: -(-total // block_size)], dtype=torch.long, device=device),
            mask=None if plain_causal else visible_mask(num_new, cached, window, device),
            window=window,
        )


@dataclass(slots=True)
class PrefillSeq:
    """One multi-token chunk: tokens [start, end) of the packed batch, after ``cached`` tokens."""

    start: int
    end: int
    cached: int
    block_ids: torch.Tensor  # [ceil((cached + T) / block_size)] long
    backend: AttentionBackend  # from fitserve.model.attention.dispatch
    mask: torch.Tensor | None = None  # [T, cached + T] bool (True = visible), None = plain causal
    hidden: torch.Tensor | None = None  # ~mask, made once per step for EagerGather
    window: int | None = None
    softcap: float | None = None  # scores -> tanh(s / cap) * cap before the mask (Gemma 2)


@dataclass(slots=True)
class DecodeBatch:
    """The first ``num`` tokens of the packed batch, one per sequence."""

    num: int
    block_tables: torch.Tensor  # [num, max_blocks], padded with block 0 (int32 for the C++ kernel)
    backend: AttentionBackend  # from fitserve.model.attention.dispatch
    seq_lens: torch.Tensor | None = None  # [num] keys per sequence (C++ / Triton kernels)
    visible: torch.Tensor | None = None  # [1, num, 1, max_blocks * block_size] bool (gather paths)
    hidden: torch.Tensor | None = None  # ~visible, made once per step for EagerGather
    window: int | None = None
    softcap: float | None = None  # scores -> tanh(s / cap) * cap before the mask (Gemma 2)


def soft_cap(scores: torch.Tensor, cap: float | None) -> torch.Tensor:
    """tanh(scores / cap) * cap in place (transformers' Gemma 2 eager attention), or scores."""
    if cap is None:
        return scores
    return scores.div_(cap).tanh_().mul_(cap)


def padded_tables(tables: list[list[int]], width: int) -> list[list[int]]:
    """Each block table cut or padded with block 0 to ``width`` blocks."""
    return [t[:width] + [0] * (width - min(len(t), width)) for t in tables]


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
