"""Test helper: a transformers mixture-of-experts model written as GGUF the way llama.cpp's
convert_hf_to_gguf.py writes it (gguf-py's writer and tensor map, the converter's metadata),
with the tiny byte-level vocabulary of tests/tiny_gguf.py.

Experts go into 3-D tensors ``ffn_{gate,up,down}_exps`` [E, rows, cols] (transformers 5's fused
``experts.gate_up_proj`` cut into its gate and up halves), in F16 or a type gguf-py quantizes (``expert_type``;
everything else F32). Mixtral is written as llama.cpp writes it: architecture "llama" with an
expert count, Q and K rows permuted (LlamaModel.permute). ``load_dequantized_experts`` puts
the file's experts, dequantized by gguf-py, back into the transformers model: the reference
then runs the very weights the engine reads.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

from tests.tiny_gguf import add_tiny_vocab

_ARCH = {"mixtral": gguf.MODEL_ARCH.LLAMA, "qwen3_moe": gguf.MODEL_ARCH.QWEN3MOE,
         "qwen2_moe": gguf.MODEL_ARCH.QWEN2MOE, "olmoe": gguf.MODEL_ARCH.OLMOE,
         "gpt_oss": gguf.MODEL_ARCH.GPT_OSS}


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's LlamaModel.permute: each head's two halves interleaved as pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
        w.shape)


def _metadata(w: gguf.GGUFWriter, cfg: Any) -> None:
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_expert_count(cfg.num_experts if hasattr(cfg, "num_experts") else cfg.num_local_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    if getattr(cfg, "moe_intermediate_size", None):
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if getattr(cfg, "shared_expert_intermediate_size", None):
        w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    if getattr(cfg, "head_dim", None):
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
    if cfg.model_type == "gpt_oss":  # llama.cpp's GptOssModel.set_gguf_parameters
        w.add_sliding_window(cfg.sliding_window)
        w.add_expert_feed_forward_length(cfg.intermediate_size)
        rope = cfg.rope_parameters
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])


def _experts(state: dict[str, torch.Tensor], name: str) -> list[tuple[str, np.ndarray]]:
    """HF 3-D expert tensors -> (merged HF name for the tensor map, [E, rows, cols])."""
    stem = name.removesuffix(".gate_up_proj").removesuffix(".down_proj")
    t = state[name].detach().float().numpy()
    if name.endswith("_bias"):  # gpt-oss: [E, 2I] gate / up interleaved, [E, H]
        stem = stem.removesuffix(".gate_up_proj_bias").removesuffix(".down_proj_bias")
        if name.endswith("gate_up_proj_bias"):
            return [(f"{stem}.gate_proj", t[:, 0::2]), (f"{stem}.up_proj", t[:, 1::2])]
        return [(f"{stem}.down_proj", t)]
    if _is_gpt_oss(state):  # x @ W [E, in, out], gate / up interleaved: llama.cpp's [E, out, in]
        t = t.transpose(0, 2, 1)
        if name.endswith("gate_up_proj"):
            return [(f"{stem}.gate_proj", t[:, 0::2]), (f"{stem}.up_proj", t[:, 1::2])]
        return [(f"{stem}.down_proj", t)]
    if name.endswith("gate_up_proj"):
        half = t.shape[1] // 2
        return [(f"{stem}.gate_proj", t[:, :half]), (f"{stem}.up_proj", t[:, half:])]
    return [(f"{stem}.down_proj", t)]


def _is_gpt_oss(state: dict[str, torch.Tensor]) -> bool:
    return "model.layers.0.self_attn.sinks" in state


def write_moe_gguf(model: torch.nn.Module, path: Path, expert_type: Q = Q.F16,
                   flat_gates: bool = False) -> Path:
    """Write ``model`` (a transformers MoE causal LM) to ``path``. ``flat_gates``: Qwen2-MoE's
    [1, hidden] shared-expert gates written 1-D, as llama.cpp's quantizer rewrites them (it
    keeps ggml_n_dims dimensions: trailing size-1 ones dropped)."""
    cfg = model.config
    arch = _ARCH[cfg.model_type]
    w = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])
    w.add_name(f"tiny-{cfg.model_type}")
    _metadata(w, cfg)
    add_tiny_vocab(w, cfg.vocab_size)
    tmap = gguf.get_tensor_name_map(arch, cfg.num_hidden_layers)
    state = model.state_dict()
    for name, tensor in state.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj", "_proj_bias")):
            for stem, data in _experts(state, name):
                new = tmap.get_name(stem)
                assert new is not None, stem
                if name.endswith("_bias"):
                    w.add_tensor(f"{new}.bias", np.ascontiguousarray(data, dtype=np.float32))
                elif expert_type == Q.F16:
                    w.add_tensor(f"{new}.weight", data.astype(np.float16))
                else:
                    w.add_tensor(f"{new}.weight", quantize(np.ascontiguousarray(data), expert_type),
                                 raw_dtype=expert_type)
            continue
        data = tensor.detach().float().numpy()
        if name.endswith(".sinks"):  # llama.cpp's converter adds the suffix
            w.add_tensor(f"{tmap.get_name(name)}.weight", data)
            continue
        if cfg.model_type == "mixtral" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads
            data = _permute(data, heads)
        new = tmap.get_name(name, try_suffixes=(".weight", ".bias"))
        assert new is not None, name
        if flat_gates and name.endswith("shared_expert_gate.weight"):
            data = data.reshape(-1)
        w.add_tensor(new, data.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@torch.no_grad()
def load_dequantized_experts(model: torch.nn.Module, path: Path) -> None:
    """Replace ``model``'s expert weights by the file's, dequantized by gguf-py."""
    reader = gguf.GGUFReader(str(path))
    for t in reader.tensors:
        parts = t.name.split(".")
        if len(parts) != 4 or not parts[2].endswith("_exps") or parts[3] != "weight":
            continue
        shape = tuple(int(x) for x in reversed(t.shape.tolist()))
        data = torch.from_numpy(np.asarray(dequantize(t.data, t.tensor_type),
                                           dtype=np.float32).reshape(shape).copy())
        experts = model.model.layers[int(parts[1])].mlp.experts
        inter = shape[1] if parts[2] != "ffn_down_exps" else shape[2]
        if hasattr(experts, "down_proj_bias"):  # gpt-oss: [E, in, out], gate / up interleaved
            if parts[2] == "ffn_down_exps":
                experts.down_proj.copy_(data.transpose(1, 2))
            else:
                first = 0 if parts[2] == "ffn_gate_exps" else 1
                experts.gate_up_proj[:, :, first::2] = data.transpose(1, 2)
            continue
        if parts[2] == "ffn_gate_exps":
            experts.gate_up_proj[:, :inter] = data
        elif parts[2] == "ffn_up_exps":
            experts.gate_up_proj[:, inter:] = data
        else:
            experts.down_proj.copy_(data)
