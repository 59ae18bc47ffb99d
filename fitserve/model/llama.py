"""One decoder for the Llama family: Llama 1/2/3, Mistral (sliding window), Qwen2 (qkv bias),
Qwen3 (per-head q/k RMSNorm), and the mixture-of-experts families whose layers differ only in
the MLP (Mixtral, Qwen2-MoE, Qwen3-MoE; OLMoE with q/k norms over the whole projection; the
expert block is fitserve.model.moe). Weights use Hugging Face names; q/k/v and gate/up are fused.
The modules only: ``fitserve.model.loader`` turns a state dict into them (``build_model``)."""

from __future__ import annotations

import torch
from torch import nn

from fitserve.config import ModelSpec
from fitserve.kernels.cpu import fused
from fitserve.model.attention.paged import AttentionBatch, paged_attention, write_kv
from fitserve.model.layers import RMSNorm, RotaryEmbedding, StepRope
from fitserve.model.linear import DenseLinear
from fitserve.model.moe import make_mlp
from fitserve.quant.kv_cache import QuantizedKVCache

# One layer's KV cache: dense (K, V) tensors, or int8/fp8 codes with scales
LayerKV = tuple[torch.Tensor, torch.Tensor] | QuantizedKVCache


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec, layer_idx: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.num_heads, self.num_kv, self.head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.q_size, self.kv_size = spec.q_size, spec.kv_size
        self.qkv_proj = DenseLinear(spec.hidden_size, self.q_size + 2 * self.kv_size, bias=spec.attention_bias)
        self.o_proj = DenseLinear(self.q_size, spec.hidden_size, bias=False)
        # q/k norms per head (Qwen3) or over the whole projection (OLMoE: qk_norm_scope)
        self.norm_whole = spec.qk_norm_scope == "projection"
        q_dim, k_dim = (self.q_size, self.kv_size) if self.norm_whole else (self.head_dim,) * 2
        self.q_norm = RMSNorm(q_dim, spec.rms_norm_eps) if spec.qk_norm else None
        self.k_norm = RMSNorm(k_dim, spec.rms_norm_eps) if spec.qk_norm else None
        self.rotary = rotary
        self.scale = spec.head_dim**-0.5
        self.layer_idx = layer_idx
        # a learned logit per query head in each softmax's denominator (gpt-oss), else None
        self.sinks: nn.Parameter | None = None

    def norm_qk(self, qkv: torch.Tensor, qk: torch.Tensor) -> torch.Tensor:
        """qk [N, Hq+Hkv, D] (a view of qkv [N, (Hq+2Hkv) D]) after the q/k norms, if any: a new
        tensor then (the decode loop calls this too, so both paths make the same ops)."""
        if self.q_norm is None or self.k_norm is None:
            return qk
        if self.norm_whole:  # 2-D rows: fused.rms_norm (decode_moe.h's qk_norm_whole)
            q_end = self.q_size
            return torch.cat((self.q_norm(qkv[:, :q_end]),
                              self.k_norm(qkv[:, q_end : q_end + self.kv_size])), 1).view(qk.shape)
        # 3-D heads: rms_norm_reference (decode_moe.h's qk_norm_heads)
        return torch.cat((self.q_norm(qk[:, : self.num_heads]), self.k_norm(qk[:, self.num_heads :])), 1)

    def forward(
        self,
        x: torch.Tensor,
        rope: StepRope,
        batch: AttentionBatch,
        kv_cache: LayerKV,
    ) -> torch.Tensor:
        n = x.shape[0]
        qkv = self.qkv_proj(x)
        heads = self.num_heads + self.num_kv
        qk = qkv[:, : self.q_size + self.kv_size].view(n, heads, self.head_dim)
        v = qkv[:, self.q_size + self.kv_size :].view(n, self.num_kv, self.head_dim)
        qk = self.norm_qk(qkv, qk)
        if isinstance(kv_cache, QuantizedKVCache):
            # one C++ call (same bits as the torch rotation and write), else torch
            if not kv_cache.rope_write_(qk, v, rope.positions, self.rotary.cos, self.rotary.sin,
                                        batch.slot_mapping, self.num_heads,
                                        self.rotary.interleaved):
                qk = self.rotary(qk, rope.tables())
                kv_cache.write(qk[:, self.num_heads :], v, batch.slot_mapping)
            d = batch.decode
            if d is not None and d.backend.reads_quantized_kv:  # codes read in place
                assert d.num == n and not batch.prefills, "a decode-only step"
                out = d.backend.decode_quantized(qk[:, : self.num_heads], kv_cache, d, self.scale)
                return self.o_proj(out.reshape(n, self.q_size))
            assert batch.kv_blocks is not None, "a quantized KV cache needs the step's kv_blocks"
            k_cache, v_cache = kv_cache.dequantize(batch.kv_blocks, qk.dtype)
            out = paged_attention(qk[:, : self.num_heads], k_cache, v_cache, batch, self.scale,
                                  self.sinks)
            return self.o_proj(out.reshape(n, self.q_size))
        k_cache, v_cache = kv_cache
        # queries and keys rotate in one pass (same positions, same tables); the C++ op also
        # writes the keys and values into the cache, the eager path does it in two more steps
        if not fused.rope_write_kv_(qk, v, rope.positions, self.rotary.cos, self.rotary.sin,
                                    k_cache, v_cache, batch.slot_mapping, self.num_heads,
                                    self.rotary.interleaved):
            qk = self.rotary(qk, rope.tables())
            write_kv(qk[:, self.num_heads :], v, k_cache, v_cache, batch.slot_mapping)
        q = qk[:, : self.num_heads]
        out = paged_attention(q, k_cache, v_cache, batch, self.scale, self.sinks)
        return self.o_proj(out.reshape(n, self.q_size))


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, layer_idx: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.self_attn = Attention(spec, layer_idx, rotary)
        self.mlp = make_mlp(spec, layer_idx)  # a dense SwiGLU, or the expert block (MoE)
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        rope: StepRope,
        batch: AttentionBatch,
        kv_cache: LayerKV,
        residual: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, residual) -> (mlp output, residual stream): each residual add is fused into the
        norm that follows it (vLLM's layout), so the stream is x + residual after the layer."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h = self.input_layernorm.add_forward(residual, x)
        h = self.self_attn(h, rope, batch, kv_cache)
        h = self.post_attention_layernorm.add_forward(residual, h)
        return self.mlp(h), residual


class CausalLM(nn.Module):
    """Packed-token decoder: forward takes N tokens of many sequences at once."""

    layer_class: type[nn.Module] = DecoderLayer  # gpt-oss: its own (fitserve.model.gpt_oss)

    def __init__(self, spec: ModelSpec, max_positions: int) -> None:
        super().__init__()
        self.spec = spec
        self.rotary = RotaryEmbedding(spec, max_positions)
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(self.layer_class(spec, i, self.rotary)
                                    for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.lm_head = DenseLinear(spec.hidden_size, spec.vocab_size, bias=False)
        if spec.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        batch: AttentionBatch,
        kv_caches: list[LayerKV],
    ) -> torch.Tensor:
        """input_ids, positions [N] -> final hidden states [N, hidden]."""
        x = self.embed_tokens(input_ids)
        rope = StepRope(self.rotary, positions, x.dtype)
        residual: torch.Tensor | None = None
        batches = batch.layer_batches(len(self.layers))
        for layer, kv, b in zip(self.layers, kv_caches, batches, strict=True):
            x, residual = layer(x, rope, b, kv, residual)
        return x if residual is None else self.norm.add_forward(residual, x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def install_rotary(self, max_positions: int, device: torch.device | str) -> None:
        """fp32 rotary tables on ``device`` (whatever the model dtype: angles at long positions),
        shared by every layer."""
        self.rotary = RotaryEmbedding(self.spec, max_positions).to(device)
        for layer in self.layers:
            layer.self_attn.rotary = self.rotary
