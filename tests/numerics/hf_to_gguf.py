"""Test helper: a transformers model written as GGUF the way llama.cpp's convert_hf_to_gguf.py
writes Gemma 2 / Gemma 3 / Phi-3 (gguf-py's GGUFWriter, names from gguf-py's tensor map, the
converter's metadata keys and tensor edits), with the tiny byte-level vocabulary of
tests/tiny_gguf.py (or a given one, tests/gguf_vocab_files.py) so the engine can load the file
alone.

The converter's edits reproduced here: Gemma's norm weights stored as w + 1 (every tensor whose
name ends in "norm.weight", q/k norms included), Gemma's lm_head skipped (tied), Phi-3's
LongRoPE as rope_factors_long/short tensors plus rope.scaling.attn_factor (its formula) and
rope.scaling.original_context_length; no Q/K row permutation for these architectures.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from tests.gguf_vocab_files import Vocab, add_vocab
from tests.tiny_gguf import add_tiny_vocab

_ARCH = {"gemma2": gguf.MODEL_ARCH.GEMMA2, "gemma3_text": gguf.MODEL_ARCH.GEMMA3,
         "phi3": gguf.MODEL_ARCH.PHI3}


def _metadata(w: gguf.GGUFWriter, cfg: Any, model_type: str) -> None:
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    rope = cfg.rope_parameters
    if model_type == "gemma2":
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
        w.add_rope_freq_base(rope["rope_theta"])
        w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)
        w.add_sliding_window(cfg.sliding_window)
    elif model_type == "gemma3_text":
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
        full = rope["full_attention"]
        w.add_rope_freq_base(full["rope_theta"])
        if full.get("rope_type") == "linear":
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(full["factor"])
        w.add_sliding_window(cfg.sliding_window)
        # one bool per layer, True = sliding (the layer_types of the config)
        w.add_sliding_window_pattern([t == "sliding_attention" for t in cfg.layer_types])
    else:  # phi3
        orig = rope["original_max_position_embeddings"]
        w.add_rope_scaling_orig_ctx_len(orig)
        w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
        w.add_rope_freq_base(rope["rope_theta"])
        w.add_sliding_window(cfg.sliding_window or 0)
        scale = cfg.max_position_embeddings / orig
        w.add_rope_scaling_attn_factors(
            math.sqrt(1 + math.log(scale) / math.log(orig)) if scale > 1.0 else 1.0)


def write_gguf_like_llama_cpp(model: torch.nn.Module, path: Path, f16: bool = False,
                              vocab: Vocab | None = None) -> Path:
    """Write ``model`` (Gemma2ForCausalLM, Gemma3ForCausalLM or Phi3ForCausalLM) to ``path``;
    every tensor as F32, or with ``f16`` its 2-D tensors as F16 (the converter's --outtype f16,
    the source llama.cpp's quantizer reads in benchmarks/bench_families.py); ``vocab`` the
    tokenizer metadata (default: the tiny byte-level vocabulary)."""
    cfg = model.config
    model_type = cfg.model_type
    arch = _ARCH[model_type]
    w = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])
    w.add_name(f"tiny-{model_type}")
    if f16:
        w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    _metadata(w, cfg, model_type)
    if vocab is None:
        add_tiny_vocab(w, cfg.vocab_size)
    else:
        add_vocab(w, vocab)
    tmap = gguf.get_tensor_name_map(arch, cfg.num_hidden_layers)
    for name, tensor in model.state_dict().items():
        if model_type != "phi3" and name == "lm_head.weight":
            continue  # tied: the converter skips it
        data = tensor.detach().float()
        if model_type != "phi3" and name.endswith("norm.weight"):
            data = data + 1
        new = tmap.get_name(name, try_suffixes=(".weight", ".bias"))
        assert new is not None, name
        dtype = np.float16 if f16 and data.dim() == 2 else np.float32
        w.add_tensor(new, data.numpy().astype(dtype))
    if model_type == "phi3":
        rope = cfg.rope_parameters
        w.add_tensor("rope_factors_long.weight", np.asarray(rope["long_factor"], np.float32))
        w.add_tensor("rope_factors_short.weight", np.asarray(rope["short_factor"], np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
