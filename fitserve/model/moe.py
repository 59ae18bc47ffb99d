"""The sparse mixture-of-experts block (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE).

Per step of N tokens (transformers' *SparseMoeBlock, op for op where it matters)::

    logits = gate(x)                       [N, E]  model dtype (the router's matmul)
    probs  = softmax(float(logits))        [N, E]  fp32
    w, ids = topk(probs, k)                [N, k]  (w /= sum(w) when norm_topk_prob)
    flat ids [N*k] --argsort--> slots grouped by expert; bincount = tokens per expert
    for each expert e with c > 0 tokens:   y = expert_e(x[tokens of its c slots])
        out.index_add_(tokens, y * w)      out: [N, H] fp32, cast once at the end
    (+ sigmoid(shared_expert_gate(x)) * shared_expert(x), Qwen2-MoE)

Each expert is a GatedMLP over its own held weights (dense, packed int4/int8, fp8 or ggml
blocks: fitserve.model.linear and ggml_linear run them as stored), so a step reads only the
weights of the experts its tokens picked: k experts at batch 1. Experts held as ggml blocks
run all at once instead, in one C++ call per layer (fitserve.model.moe_experts).

Extension points for another expert MLP (gpt-oss: a clamped SwiGLU with biases and MXFP4
weights): ``SparseMoeBlock(make_expert=...)`` builds each expert (any module mapping
[n, H] -> [n, H] whose projections the loader installs by name), and ``router_bias`` gives
the router a bias.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from fitserve.config import ModelSpec
from fitserve.kernels.cpu.moe_experts import moe_route, moe_route_available
from fitserve.model.layers import GatedMLP
from fitserve.model.linear import DenseLinear
from fitserve.model.moe_experts import GroupedExperts, grouped_experts


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [N, k] fp32, expert ids [N, k] int64) of router ``logits`` [N, E]: softmax in
    fp32, the top k (largest first, as transformers), renormalised to sum 1 when asked
    (Mixtral's softmax over the top-k logits is the same numbers).

    On the CPU with the C++ build: one call (moe_route.h: the softmax in float64 rounded once,
    ties to the lower expert), which decode_layers calls too, so every path routes the same
    bits; else torch's ops."""
    if logits.device.type == "cpu" and moe_route_available():
        return moe_route(logits, top_k, renormalize)
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def group_by_expert(ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, list[int]]:
    """The step's (token, slot) pairs grouped by expert: ``order`` [N*k] indexes the flat
    ids with expert 0's slots first (token order within an expert), ``counts[e]`` slots each."""
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    return order, counts


class SparseMoeBlock(nn.Module):
    """Router + experts (+ an optional gated shared expert); forward [N, H] -> [N, H]."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, expert_intermediate: int, *,
                 renormalize: bool, shared_intermediate: int = 0, router_bias: bool = False,
                 make_expert: Callable[[int, int], nn.Module] = GatedMLP) -> None:
        super().__init__()
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.gate = DenseLinear(hidden, num_experts, bias=router_bias)
        self.experts = nn.ModuleList(make_expert(hidden, expert_intermediate)
                                     for _ in range(num_experts))
        self.shared_expert: nn.Module | None = None
        self.shared_expert_gate: nn.Module | None = None
        if shared_intermediate:
            self.shared_expert = GatedMLP(hidden, shared_intermediate)
            self.shared_expert_gate = DenseLinear(hidden, 1, bias=False)
        self._grouped: GroupedExperts | None = None  # see prepare_grouped (moe_experts.py)
        self.allow_grouped = True  # False: the per-expert loop whatever is held (benchmarks)

    def prepare_grouped(self) -> None:
        """Stack the experts for the grouped kernel now, as vLLM processes weights after
        loading. NOTE: the runner calls this at start-up. Built at the first call instead, the
        stacking (a copy of every expert's blocks: 0.22 s for bench_moe.py's 0.7 GiB of experts,
        proportionally more for a 30B-A3B's ~17 GB) fell into the first request's TTFT. A
        later change of the held experts (a TP shard) is seen by grouped_experts' check and
        restacked at the next call, as before."""
        if self.allow_grouped:
            self._grouped = grouped_experts(self.experts, self._grouped)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(self.gate(x), self.top_k, self.renormalize)
        out = self.combine(x, weights, ids)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
            out += shared.float()
        return out.to(x.dtype)

    def combine(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """sum_j weights[t, j] * expert_{ids[t, j]}(x[t]) for every token t, in fp32 [N, H]:
        each active expert runs once over its tokens, idle experts are not touched."""
        if self.allow_grouped:
            self._grouped = grouped = grouped_experts(self.experts, self._grouped)
            if grouped.applies(x, self.experts[0]):
                return grouped(x, weights, ids)  # every active expert in one C++ call
        n, hidden = x.shape
        order, counts = group_by_expert(ids, self.num_experts)
        tokens = order // self.top_k
        grouped = torch.empty(n * self.top_k, hidden, dtype=torch.float32, device=x.device)
        start = 0
        for e, c in enumerate(counts):
            if c == 0:
                continue
            grouped[start : start + c] = self.experts[e](x.index_select(0, tokens[start : start + c]))
            start += c
        # back to (token, slot) order, then the weighted sum over each token's k slots
        # NOTE: one scatter of whole rows and a [N, k] reduction instead of index_add_ per
        # expert (measured ~ms per call on a loaded CPU); summed in fp32 and cast once
        # (transformers adds in the model dtype: the same numbers in fp32)
        per_slot = torch.empty_like(grouped).index_copy_(0, order, grouped)
        return (per_slot.view(n, self.top_k, hidden) * weights.unsqueeze(-1)).sum(dim=1)

    def extra_repr(self) -> str:
        return f"experts={self.num_experts}, top_k={self.top_k}, renormalize={self.renormalize}"


def make_mlp(spec: ModelSpec, layer_idx: int) -> nn.Module:
    """Layer ``layer_idx``'s MLP: the expert block on a sparse layer, else the dense SwiGLU."""
    if not spec.is_moe_layer(layer_idx):
        return GatedMLP(spec.hidden_size, spec.intermediate_size)
    return SparseMoeBlock(spec.hidden_size, spec.num_experts, spec.num_experts_per_token,
                          spec.expert_intermediate_size, renormalize=spec.norm_topk_prob,
                          shared_intermediate=spec.shared_expert_intermediate_size)
