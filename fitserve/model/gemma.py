"""Gemma 2 and Gemma 3 (text): the Llama-family attention with Gemma's differences.

Per layer (transformers' Gemma2DecoderLayer / Gemma3DecoderLayer)::

    x = x + post_attention_layernorm(attn(input_layernorm(x)))
    x = x + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(x)))

- every norm is ``GemmaRMSNorm``: x * rsqrt(mean(x^2) + eps) * (1 + w), all in fp32, then cast;
- the MLP is GeGLU: down(gelu_tanh(gate) * up);
- the embedding is multiplied by sqrt(hidden) rounded to the model dtype;
- the attention scale is query_pre_attn_scalar**-0.5; Gemma 3 adds (1 + w) q/k norms;
- Gemma 2 soft-caps attention scores (the runner passes the cap in the attention metadata, and
  the dispatch rule runs a backend that applies it) and the final logits;
- layers alternate "sliding" (windowed: their KV layer group's batch, AttentionBatch.per_layer) and "full" (ModelSpec.layer_types);
  Gemma 3's sliding layers rotate with their own base (ModelSpec.sliding_rope_theta), its full
  ones with rope_theta and rope_scaling (linear);
- embeddings are tied.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from fitserve.config import ModelSpec
from fitserve.model.attention.paged import AttentionBatch
from fitserve.model.layers import RotaryEmbedding, StepRope
from fitserve.model.linear import DenseLinear
from fitserve.model.llama import Attention, LayerKV


class GemmaRMSNorm(nn.Module):
    """RMSNorm with the (1 + w) weight, computed in fp32 and cast once at the end (as
    transformers' Gemma2RMSNorm: ``(x * w).to(dtype)``, not Llama's ``x.to(dtype) * w``)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * (1.0 + self.weight.float())).to(x.dtype)


class GemmaAttention(Attention):
    """Attention with Gemma's scale and (1 + w) q/k norms; the rest is the Llama family's."""

    def __init__(self, spec: ModelSpec, layer_idx: int, rotary: RotaryEmbedding) -> None:
        super().__init__(spec, layer_idx, rotary)
        if spec.qk_norm:
            self.q_norm = GemmaRMSNorm(spec.head_dim, spec.rms_norm_eps)  # type: ignore[assignment]
            self.k_norm = GemmaRMSNorm(spec.head_dim, spec.rms_norm_eps)  # type: ignore[assignment]
        self.scale = (spec.query_pre_attn_scalar or spec.head_dim) ** -0.5


class GeGLU(nn.Module):
    """down(gelu_tanh(gate) * up), gate and up fused into one matmul."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_up_proj = DenseLinear(hidden, 2 * intermediate, bias=False)
        self.down_proj = DenseLinear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class GemmaDecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, layer_idx: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        h, eps = spec.hidden_size, spec.rms_norm_eps
        self.self_attn = GemmaAttention(spec, layer_idx, rotary)
        self.mlp = GeGLU(h, spec.intermediate_size)
        self.input_layernorm = GemmaRMSNorm(h, eps)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps)

    def forward(self, x: torch.Tensor, rope: StepRope, batch: AttentionBatch,
                kv_cache: LayerKV) -> torch.Tensor:
        h = self.self_attn(self.input_layernorm(x), rope, batch, kv_cache)
        x = x + self.post_attention_layernorm(h)
        h = self.mlp(self.pre_feedforward_layernorm(x))
        return x + self.post_feedforward_layernorm(h)


def layer_uses_local_rope(spec: ModelSpec, layer_idx: int) -> bool:
    """Whether layer ``layer_idx`` rotates with the sliding layers' own table (Gemma 3).

    NOTE: a spec whose layers all slide has layer_types None (one kind) and a sliding_window:
    every layer is then a sliding one and uses the local table, as transformers' per-layer-type
    rotary does (reading None as "all full" rotated a 2-layer all-sliding Gemma 3 with the
    global base 1e6 instead of 1e4).
    """
    if spec.sliding_rope_theta is None:
        return False
    if spec.layer_types is not None:
        return spec.layer_types[layer_idx] == "sliding"
    return spec.sliding_window is not None


def local_rope_spec(spec: ModelSpec) -> ModelSpec | None:
    """The spec the sliding layers' rotary table is built from (Gemma 3: their own base, no
    scaling), or None when no layer has its own table."""
    if not any(layer_uses_local_rope(spec, i) for i in range(spec.num_layers)):
        return None
    return replace(spec, rope_theta=spec.sliding_rope_theta, rope_scaling=None)


class GemmaCausalLM(nn.Module):
    """Packed-token Gemma 2/3 decoder, with CausalLM's interface (forward, compute_logits)."""

    def __init__(self, spec: ModelSpec, max_positions: int) -> None:
        super().__init__()
        self.spec = spec
        self.rotary = RotaryEmbedding(spec, max_positions)
        local = local_rope_spec(spec)
        self.rotary_local = None if local is None else RotaryEmbedding(local, max_positions)
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(spec, i, self._rotary_of(i)) for i in range(spec.num_layers))
        self.norm = GemmaRMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.lm_head = DenseLinear(spec.hidden_size, spec.vocab_size, bias=False)
        if spec.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def _rotary_of(self, layer_idx: int) -> RotaryEmbedding:
        if self.rotary_local is not None and layer_uses_local_rope(self.spec, layer_idx):
            return self.rotary_local
        return self.rotary

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch,
                kv_caches: list[LayerKV]) -> torch.Tensor:
        """input_ids, positions [N] -> final hidden states [N, hidden]."""
        x = self.embed_tokens(input_ids)
        # NOTE: transformers rounds sqrt(hidden) to the model dtype before multiplying
        x = x * torch.tensor(self.spec.hidden_size**0.5, dtype=x.dtype)
        ropes = {id(r): StepRope(r, positions, x.dtype)
                 for r in (self.rotary, self.rotary_local) if r is not None}
        batches = batch.layer_batches(len(self.layers))  # a hybrid model: each layer's group
        for layer, kv, b in zip(self.layers, kv_caches, batches, strict=True):
            x = layer(x, ropes[id(layer.self_attn.rotary)], b, kv)
        out: torch.Tensor = self.norm(x)
        return out

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        cap = self.spec.final_logit_softcapping
        if cap is not None:  # in the model dtype, as transformers
            logits = torch.tanh(logits / cap) * cap
        return logits.float()

    def install_rotary(self, max_positions: int, device: torch.device | str) -> None:
        """fp32 rotary tables on ``device``, one per layer kind that has its own."""
        self.rotary = RotaryEmbedding(self.spec, max_positions).to(device)
        local = local_rope_spec(self.spec)
        self.rotary_local = None if local is None else RotaryEmbedding(local, max_positions).to(device)
        for i, layer in enumerate(self.layers):
            layer.self_attn.rotary = self._rotary_of(i)
