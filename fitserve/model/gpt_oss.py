"""gpt-oss (``GptOssForCausalLM``): the Llama-family decoder with gpt-oss's differences.

Per layer (transformers' GptOssDecoderLayer)::

    x = x + o_proj(attn(input_layernorm(x)))       q/k/v and o_proj with biases
    x = x + experts(post_attention_layernorm(x))   every layer sparse

- attention adds a learned logit per head (``sinks``) to each softmax's denominator:
  softmax([scores, sink])[:-1], so a row's weights sum to < 1 (the attention backends apply it,
  fitserve.model.attention.gather.softmax_with_sinks; the dispatch rule picks EagerGather);
- layers alternate "sliding" (window ``sliding_window``) and "full" (ModelSpec.layer_types,
  each layer reading its KV layer group's batch), all rotating with one YaRN table;
- the router has a bias; a token's k experts are the top-k router logits, weighted by the
  softmax of those k logits;
- each expert is a clamped SwiGLU with biases (``GptOssExpert``)::

      gate = min(gate, limit)          up = clamp(up, -limit, limit)
      y = down((up + 1) * gate * sigmoid(alpha * gate))      alpha 1.702, limit 7.0
"""

from __future__ import annotations

import torch
from torch import nn

from fitserve.config import ModelSpec
from fitserve.model.layers import RMSNorm, RotaryEmbedding
from fitserve.model.linear import DenseLinear
from fitserve.model.llama import Attention, CausalLM, DecoderLayer
from fitserve.model.moe import SparseMoeBlock

SWIGLU_ALPHA = 1.702  # GptOssConfig.swiglu_alpha's default (llama.cpp hard-codes it)
SWIGLU_LIMIT = 7.0  # GptOssConfig.swiglu_limit's default


class GptOssExpert(nn.Module):
    """One expert: gate and up fused into one projection (gate rows first), both with biases."""

    def __init__(self, hidden: int, intermediate: int, alpha: float, limit: float) -> None:
        super().__init__()
        self.alpha, self.limit = alpha, limit
        self.gate_up_proj = DenseLinear(hidden, 2 * intermediate, bias=True)
        self.down_proj = DenseLinear(intermediate, hidden, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        # transformers' GptOssExperts._apply_gate, op for op
        gate = gate.clamp(min=None, max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        glu = gate * torch.sigmoid(gate * self.alpha)
        out: torch.Tensor = self.down_proj((up + 1) * glu)
        return out


class GptOssMoeBlock(SparseMoeBlock):
    """The router (with a bias) picks the top-k logits; their softmax weights the experts."""

    def __init__(self, spec: ModelSpec) -> None:
        alpha = float(spec.extra.get("swiglu_alpha", SWIGLU_ALPHA))
        limit = float(spec.extra.get("swiglu_limit", SWIGLU_LIMIT))
        super().__init__(spec.hidden_size, spec.num_experts, spec.num_experts_per_token,
                         spec.expert_intermediate_size, renormalize=True, router_bias=True,
                         make_expert=lambda h, i: GptOssExpert(h, i, alpha, limit))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # NOTE: top-k of the logits, then the softmax of those k (GptOssTopKRouter): the same
        # experts and weights as top-k of the softmax renormalised, but ties break on the logits
        top, ids = torch.topk(self.gate(x), self.top_k, dim=-1)
        weights = torch.softmax(top.float(), dim=-1)
        return self.combine(x, weights, ids).to(x.dtype)


class GptOssAttention(Attention):
    """Llama-family attention with an o_proj bias and one sink logit per query head."""

    def __init__(self, spec: ModelSpec, layer_idx: int, rotary: RotaryEmbedding) -> None:
        super().__init__(spec, layer_idx, rotary)
        self.o_proj = DenseLinear(self.q_size, spec.hidden_size, bias=True)
        self.sinks = nn.Parameter(torch.zeros(spec.num_heads), requires_grad=False)


class GptOssDecoderLayer(DecoderLayer):
    def __init__(self, spec: ModelSpec, layer_idx: int, rotary: RotaryEmbedding) -> None:
        nn.Module.__init__(self)
        self.self_attn = GptOssAttention(spec, layer_idx, rotary)
        self.mlp = GptOssMoeBlock(spec)
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)


class GptOssCausalLM(CausalLM):
    """CausalLM with gpt-oss layers (the per-layer-group batches and one rotary table are
    CausalLM's own)."""

    layer_class = GptOssDecoderLayer
