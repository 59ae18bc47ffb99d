"""The decoder of one tensor-parallel rank: its shard of CausalLM plus the collectives.

``build_tp_model`` builds rank r's CausalLM from its rank spec and sharded weights, then puts
the collectives where Megatron does: an all-reduce after each row-parallel projection (o_proj,
down_proj: 2 per layer) and after the vocab-parallel embedding lookup (1 per step); logits are
computed per vocabulary shard and gathered on rank 0, which samples (NOTE: a gather rather
than a parallel argmax, so every sampling feature — penalties, top-p, logprobs — runs on the
full distribution, unchanged).
"""

from __future__ import annotations

import torch
from torch import nn

from fitserve.config import ModelSpec
from fitserve.dist.comm import Collectives
from fitserve.dist.layout import RankSlice, rank_slice, rank_spec
from fitserve.dist.shard import shard_weights
from fitserve.model.attention.paged import AttentionBatch
from fitserve.model.gemma import GemmaCausalLM, GemmaDecoderLayer
from fitserve.model.llama import CausalLM, DecoderLayer, LayerKV
from fitserve.model.loader import build_model
from fitserve.model.moe import SparseMoeBlock
from fitserve.quant.held import HeldTensor


class RowParallel(nn.Module):
    """A row-parallel projection: this rank's partial product, summed over the ranks."""

    def __init__(self, inner: nn.Module, comm: Collectives, kind: str) -> None:
        super().__init__()
        self.inner, self.comm, self.kind = inner, comm, kind

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.comm.all_reduce(self.inner(x).contiguous(), self.kind)


class VocabParallelEmbedding(nn.Module):
    """Rows [v0, v1) of the embedding: tokens outside give zeros, the all-reduce fills them."""

    def __init__(self, inner: nn.Module, vocab: tuple[int, int], comm: Collectives) -> None:
        super().__init__()
        self.inner, self.comm = inner, comm
        self.v0, self.v1 = vocab

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        mine = (ids >= self.v0) & (ids < self.v1)
        rows: torch.Tensor = self.inner(torch.where(mine, ids - self.v0, 0))
        rows = rows * mine.unsqueeze(1).to(rows.dtype)
        return self.comm.all_reduce(rows.contiguous(), "embedding")


class TPCausalLM(nn.Module):
    """Rank r's decoder: forward as CausalLM (hidden states are whole on every rank after each
    all-reduce); compute_logits returns the full vocabulary on rank 0, None on the others."""

    def __init__(self, model: CausalLM | GemmaCausalLM, full: ModelSpec, s: RankSlice, comm: Collectives) -> None:
        super().__init__()
        self.model, self.full_spec, self.slice, self.comm = model, full, s, comm
        self.spec = model.spec
        model.embed_tokens = VocabParallelEmbedding(model.embed_tokens, s.vocab, comm)  # type: ignore[assignment]
        for layer in model.layers:
            # the Llama family's layer or Gemma's: both end attention in o_proj, the MLP in
            # down_proj; Gemma's post-norms and embedding scale act on whole (reduced) tensors
            assert isinstance(layer, DecoderLayer | GemmaDecoderLayer)
            attn, mlp = layer.self_attn, layer.mlp
            attn.o_proj = RowParallel(attn.o_proj, comm, "layer")  # type: ignore[assignment]
            if isinstance(mlp, SparseMoeBlock):
                # NOTE: every expert's down (and the shared expert's) holds its slice of the
                # columns; the block's output is linear in their partial products (routing
                # weights and the shared gate are whole on every rank), so one all-reduce of
                # the block's output sums them: 2 per layer, as a dense layer
                layer.mlp = RowParallel(mlp, comm, "layer")
            else:
                down = mlp.down_proj
                assert isinstance(down, nn.Module)
                mlp.down_proj = RowParallel(down, comm, "layer")
        self.shard_sizes = [rank_slice(full, s.tp, r).vocab for r in range(s.tp)]

    @property
    def layers(self) -> nn.ModuleList:
        """The rank model's layers (the runner looks there for attention sinks)."""
        return self.model.layers

    @property
    def rotary(self) -> nn.Module:
        """The rank model's rotary tables (the runner reads LongRoPE's row offset there)."""
        return self.model.rotary

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch,
                kv_caches: list[LayerKV]) -> torch.Tensor:
        hidden: torch.Tensor = self.model(input_ids, positions, batch, kv_caches)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        local = self.model.compute_logits(hidden)  # [rows, this rank's vocabulary], float32
        width = self.slice.vocab_shard
        if local.shape[1] < width:  # uneven vocabulary: pad to the widest shard
            local = torch.nn.functional.pad(local, (0, width - local.shape[1]))
        parts = self.comm.gather(local.contiguous(), "logits")
        if parts is None:
            return None
        return torch.cat([p[:, : v1 - v0] for p, (v0, v1) in zip(parts, self.shard_sizes,
                                                                  strict=True)], dim=1)


def build_tp_model(spec: ModelSpec, weights: dict[str, HeldTensor], *, tp: int, rank: int,
                   comm: Collectives, dtype: torch.dtype, device: torch.device | str,
                   max_positions: int) -> TPCausalLM:
    s = rank_slice(spec, tp, rank)
    shard = shard_weights(spec, weights, s)
    model = build_model(rank_spec(spec, tp, rank), shard, dtype=dtype, device=device,
                        max_positions=max_positions)
    return TPCausalLM(model, spec, s, comm)
