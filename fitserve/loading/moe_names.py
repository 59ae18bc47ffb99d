"""The expert tensors of a mixture-of-experts model, under the names the engine holds them.

The engine holds each expert's projections apart, under the per-expert Hugging Face names
(``model.layers.{i}.mlp.experts.{e}.gate_proj.weight`` ...; the router ``mlp.gate.weight``;
Qwen2-MoE's ``mlp.shared_expert.*`` and ``mlp.shared_expert_gate.weight``). Checkpoints spell
them three ways, all mapped onto those names here (torch-free: slices of whatever array type):

- per expert, as transformers' ``save_pretrained`` writes (5.24 converts back on save);
  Mixtral's legacy ``block_sparse_moe.gate`` / ``experts.{e}.w1|w3|w2`` (gate, up, down);
- transformers 5's fused 3-D parameters ``mlp.experts.gate_up_proj`` [E, 2I, H] (gate rows,
  then up rows, as its ``chunk(2)``) and ``mlp.experts.down_proj`` [E, H, I];
- llama.cpp's 3-D ``ffn_{gate,up,down}_exps`` [E, rows, cols] (fitserve.loading.gguf splits
  them along the expert axis: each expert's slice is a whole number of rows of ggml blocks).
"""

from __future__ import annotations

import re
from typing import TypeVar

from fitserve.config import ModelSpec
from fitserve.ledger.weight_names import expected_weight_shapes

T = TypeVar("T")  # a torch tensor or a numpy array

_MIXTRAL = re.compile(r"(.*\.)block_sparse_moe\.(gate|experts\.(\d+)\.(w1|w2|w3))\.(weight)$")
_MIXTRAL_PROJ = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_FUSED_3D = re.compile(r"(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")
_PER_EXPERT = re.compile(r"(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def engine_weight_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Every HF parameter name (and shape) the engine holds for ``spec``: the ledger's list
    (fitserve.ledger.weight_names) with each sparse layer's MLP replaced by its router and
    experts (and shared expert), and OLMoE's q/k norms over the whole projection.

    NOTE (merge): the ledger's list knows dense MLPs only; until it lists experts the engine
    takes this one, and sizes an MoE model's weights from what it holds (engine.builder)."""
    shapes = expected_weight_shapes(spec)
    if not spec.num_experts:
        return shapes
    h, e, inter = spec.hidden_size, spec.num_experts, spec.expert_intermediate_size
    out: dict[str, tuple[int, ...]] = {}
    for name, shape in shapes.items():
        m = re.fullmatch(r"(model\.layers\.(\d+)\.)mlp\.(gate|up|down)_proj\.weight", name)
        if spec.qk_norm_scope == "projection" and name.endswith("self_attn.q_norm.weight"):
            shape = (spec.q_size,)
        if spec.qk_norm_scope == "projection" and name.endswith("self_attn.k_norm.weight"):
            shape = (spec.kv_size,)
        if m is None or not spec.is_moe_layer(int(m.group(2))):
            out[name] = shape
            continue
        if m.group(3) != "gate":
            continue  # the layer's expert names are all added at its gate_proj
        p = m.group(1) + "mlp."
        out[p + "gate.weight"] = (e, h)
        for x in range(e):
            out.update(_mlp(f"{p}experts.{x}.", h, inter))
        if spec.shared_expert_intermediate_size:
            out.update(_mlp(p + "shared_expert.", h, spec.shared_expert_intermediate_size))
            out[p + "shared_expert_gate.weight"] = (1, h)
    return out


def _mlp(prefix: str, hidden: int, inter: int) -> dict[str, tuple[int, ...]]:
    return {prefix + "gate_proj.weight": (inter, hidden), prefix + "up_proj.weight": (inter, hidden),
            prefix + "down_proj.weight": (hidden, inter)}


def split_expert_tensor(spec: ModelSpec, name: str, tensor: T) -> list[tuple[str, T]] | None:
    """A checkpoint's expert tensor under the engine's names: Mixtral's legacy names renamed,
    a fused 3-D tensor cut per expert (ValueError when its shape is not the spec's); None when
    ``name`` is no such tensor."""
    if not spec.num_experts:
        return None
    m = _MIXTRAL.fullmatch(name)
    if m is not None:
        stem = "gate" if m.group(2) == "gate" else f"experts.{m.group(3)}.{_MIXTRAL_PROJ[m.group(4)]}"
        return [(f"{m.group(1)}mlp.{stem}.weight", tensor)]
    m = _FUSED_3D.fullmatch(name)
    if m is None:
        return None
    e, h, inter = spec.num_experts, spec.hidden_size, spec.expert_intermediate_size
    fused = m.group(2) == "gate_up_proj"
    want = (e, 2 * inter, h) if fused else (e, h, inter)
    got = tuple(int(x) for x in tensor.shape)  # type: ignore[attr-defined]
    if got != want:
        raise ValueError(f"tensor {name!r} has shape {got}, expected {want}")
    out: list[tuple[str, T]] = []
    for x in range(e):
        one = tensor[x]  # type: ignore[index]
        if fused:
            out += [(f"{m.group(1)}.{x}.gate_proj.weight", one[:inter]),
                    (f"{m.group(1)}.{x}.up_proj.weight", one[inter:])]
        else:
            out.append((f"{m.group(1)}.{x}.down_proj.weight", one))
    return out


def merged_expert_name(name: str) -> tuple[str, int] | None:
    """``(model.layers.i.mlp.experts.gate_proj.weight, e)`` for a per-expert name (the name
    gguf-py's tensor map gives ``ffn_gate_exps``), None for any other name."""
    m = _PER_EXPERT.fullmatch(name)
    if m is None:
        return None
    return f"{m.group(1)}.{m.group(3)}.weight", int(m.group(2))
