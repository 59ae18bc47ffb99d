"""GGUF tensor names -> the Hugging Face names the engine holds, from gguf-py's own tables.

llama.cpp's converter names tensors with ``gguf.get_tensor_name_map(arch, n_blocks)``
(HF name -> GGUF name, per architecture: Gemma's ``post_attention_layernorm`` is
``post_attention_norm``, Llama's is ``ffn_norm``); this module runs the same map over the
names the engine holds for a spec (fitserve.ledger.weight_names; Phi-3's fused ``qkv_proj`` /
``gate_up_proj`` in place of their parts) and inverts it, so no table here lists a family.
Torch-free.
"""

from __future__ import annotations

import gguf

from fitserve.config import ModelSpec
from fitserve.ledger.weight_names import expected_weight_shapes
from fitserve.loading.errors import ModelLoadError
from fitserve.loading.fused_weights import checkpoint_names
from fitserve.loading.moe_names import merged_expert_name

_ARCH_BY_NAME = {name: arch for arch, name in gguf.MODEL_ARCH_NAMES.items()}


def gguf_to_hf_names(spec: ModelSpec, gguf_arch: str, source: object) -> dict[str, str]:
    """GGUF tensor name -> HF name (a fused one for Phi-3; ``mlp.experts.gate_proj.weight`` for
    the 3-D ``ffn_gate_exps``) of every tensor ``spec`` needs."""
    arch = _ARCH_BY_NAME.get(gguf_arch)
    if arch is None:
        raise ModelLoadError(f"{source}: gguf-py knows no architecture {gguf_arch!r}")
    tmap = gguf.get_tensor_name_map(arch, spec.num_layers)
    out: dict[str, str] = {}
    # experts: one 3-D tensor per projection and layer (ffn_gate_exps ...), named here by the
    # per-projection HF name the converter maps (fitserve.loading.gguf splits it per expert)
    names = [merged_expert_name(n) for n in expected_weight_shapes(spec)]
    merged = dict.fromkeys(m[0] for m in names if m is not None)
    singles = [n for n, m in zip(expected_weight_shapes(spec), names, strict=True) if m is None]
    for hf in [*checkpoint_names(spec, singles), *merged]:
        if hf.endswith(".sinks"):  # a parameter with no .weight (gpt-oss): attn_sinks.weight
            out[f"{tmap.get_name(hf)}.weight"] = hf
            continue
        stem, _, suffix = hf.rpartition(".")
        name = tmap.get_name(stem)
        if name is None:
            raise ModelLoadError(f"{source}: gguf-py's {gguf_arch} tensor map has no name for {hf!r}")
        out[f"{name}.{suffix}"] = hf
    return out
