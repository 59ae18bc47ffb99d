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
  them along the expert axis: each expert's slice is a whole number of rows of ggml blocks);
- gpt-oss's ``mlp.router.{weight,bias}`` (the engine's ``mlp.gate``) and its transposed 3-D
  experts with biases: ``experts.gate_up_proj`` [E, H, 2I] (x @ W: gate in the even columns,
  up in the odd ones, as its ``[..., ::2]`` / ``[..., 1::2]``), ``gate_up_proj_bias`` [E, 2I]
  (same interleave), ``down_proj`` [E, I, H], ``down_proj_bias`` [E, H]. (Its MXFP4
  ``*_blocks`` / ``*_scales`` pairs: fitserve.loading.mxfp4.)
"""

from __future__ import annotations

import re
from typing import TypeVar

from fitserve.config import ModelSpec

T = TypeVar("T")  # a torch tensor or a numpy array

_MIXTRAL = re.compile(r"(.*\.)block_sparse_moe\.(gate|experts\.(\d+)\.(w1|w2|w3))\.(weight)$")
_MIXTRAL_PROJ = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_FUSED_3D = re.compile(r"(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")
_GPT_OSS_ROUTER = re.compile(r"(.*\.mlp)\.router\.(weight|bias)$")
_GPT_OSS_EXPERTS = re.compile(r"(.*\.mlp\.experts)\.(gate_up_proj|down_proj)(_bias)?$")
_PER_EXPERT = re.compile(r"(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.(weight|bias)$")


def split_expert_tensor(spec: ModelSpec, name: str, tensor: T) -> list[tuple[str, T]] | None:
    """A checkpoint's expert tensor under the engine's names: Mixtral's legacy names renamed,
    a fused 3-D tensor cut per expert (ValueError when its shape is not the spec's); None when
    ``name`` is no such tensor."""
    if not spec.num_experts:
        return None
    if spec.architecture == "gpt_oss":
        return _split_gpt_oss(spec, name, tensor)
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


def _split_gpt_oss(spec: ModelSpec, name: str, tensor: T) -> list[tuple[str, T]] | None:
    """gpt-oss's router and transposed, interleaved 3-D experts under the engine's names."""
    m = _GPT_OSS_ROUTER.fullmatch(name)
    if m is not None:
        return [(f"{m.group(1)}.gate.{m.group(2)}", tensor)]
    m = _GPT_OSS_EXPERTS.fullmatch(name)
    if m is None:
        return None
    e, h, inter = spec.num_experts, spec.hidden_size, spec.expert_intermediate_size
    fused, bias = m.group(2) == "gate_up_proj", m.group(3) is not None
    want = ((e, 2 * inter) if fused else (e, h)) if bias else (
        (e, h, 2 * inter) if fused else (e, inter, h))
    got = tuple(int(x) for x in tensor.shape)  # type: ignore[attr-defined]
    if got != want:
        raise ValueError(f"tensor {name!r} has shape {got}, expected {want}")
    suffix = "bias" if bias else "weight"
    out: list[tuple[str, T]] = []
    for x in range(e):
        one = tensor[x]  # type: ignore[index]
        if not bias:
            one = one.T  # x @ W [in, out] -> the engine's [out, in]
        if fused:
            out += [(f"{m.group(1)}.{x}.gate_proj.{suffix}", one[0::2]),
                    (f"{m.group(1)}.{x}.up_proj.{suffix}", one[1::2])]
        else:
            out.append((f"{m.group(1)}.{x}.down_proj.{suffix}", one))
    return out


def merged_expert_name(name: str) -> tuple[str, int] | None:
    """``(model.layers.i.mlp.experts.gate_proj.weight, e)`` for a per-expert name (the name
    gguf-py's tensor map gives ``ffn_gate_exps``; gpt-oss's ``.bias`` likewise), None for any
    other name."""
    m = _PER_EXPERT.fullmatch(name)
    if m is None:
        return None
    return f"{m.group(1)}.{m.group(3)}.{m.group(4)}", int(m.group(2))
