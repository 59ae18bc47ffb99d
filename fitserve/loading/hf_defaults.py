"""What a Hugging Face config.json means when it leaves a field out: transformers' defaults.

Data only, torch-free. A key absent from config.json takes the default of that model type's
transformers config class (transformers 5.24, ``models/<type>/configuration_<type>.py``); a
key present with ``null`` means "none" as transformers reads it. ``GENERIC`` (LlamaConfig's
defaults) covers a model type the table does not list. Only the keys fitserve reads are here,
and only where a class differs from ``GENERIC``; tests/unit/loading/test_model_reader.py checks every
row against ``transformers.AutoConfig.for_model``.

NOTE: ``rope_theta`` stands for the class's ``default_theta`` (it is not a config field in
transformers 5: the value lands in ``rope_parameters``). bos/eos ids are deliberately absent:
the class defaults (LlamaConfig: 1 and 2) describe no particular vocabulary, so ids come only
from config.json, generation_config.json, or the tokenizer.
"""

from __future__ import annotations

from typing import Any

# num_key_value_heads / head_dim None mean: num_attention_heads / hidden_size // heads.
GENERIC: dict[str, Any] = {
    "num_key_value_heads": None,
    "head_dim": None,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "attention_bias": False,
    "sliding_window": None,
}

_GEMMA = {"head_dim": 256, "tie_word_embeddings": True, "hidden_act": "gelu_pytorch_tanh"}

DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {},
    "mistral": {"num_key_value_heads": 8, "max_position_embeddings": 131072,
                "sliding_window": 4096},
    "mixtral": {"num_key_value_heads": 8, "max_position_embeddings": 131072,
                "rms_norm_eps": 1e-5, "rope_theta": 1e6, "num_local_experts": 8,
                "num_experts_per_tok": 2},
    "qwen2": {"num_key_value_heads": 32, "max_position_embeddings": 32768,
              "sliding_window": 4096, "max_window_layers": 28},
    "qwen3": {"num_key_value_heads": 32, "head_dim": 128, "max_position_embeddings": 32768,
              "sliding_window": 4096, "max_window_layers": 28},
    "qwen2_moe": {"num_key_value_heads": 16, "max_position_embeddings": 32768,
                  "sliding_window": 4096, "max_window_layers": 28,
                  "moe_intermediate_size": 1408, "num_experts": 60, "num_experts_per_tok": 4,
                  "shared_expert_intermediate_size": 5632},
    "qwen3_moe": {"num_key_value_heads": 4, "max_position_embeddings": 32768,
                  "sliding_window": 4096, "moe_intermediate_size": 768, "num_experts": 128,
                  "num_experts_per_tok": 8},
    "olmoe": {"max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "num_experts": 64,
              "num_experts_per_tok": 8},
    "gemma": {**_GEMMA, "num_key_value_heads": 16, "max_position_embeddings": 8192},
    "gemma2": {**_GEMMA, "num_key_value_heads": 4, "max_position_embeddings": 8192,
               "sliding_window": 4096, "query_pre_attn_scalar": 256,
               "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0},
    "gemma3_text": {**_GEMMA, "num_key_value_heads": 4, "max_position_embeddings": 131072,
                    "sliding_window": 4096, "rope_theta": 1e6, "sliding_window_pattern": 6,
                    "query_pre_attn_scalar": 256},
    "phi3": {"max_position_embeddings": 4096, "rms_norm_eps": 1e-5},
    "gpt_oss": {"num_key_value_heads": 8, "head_dim": 64, "max_position_embeddings": 131072,
                "rms_norm_eps": 1e-5, "rope_theta": 150000.0, "sliding_window": 128,
                "attention_bias": True, "num_local_experts": 128, "num_experts_per_tok": 4},
    "deepseek_v3": {"num_key_value_heads": 128, "max_position_embeddings": 4096,
                    "n_routed_experts": 256, "num_experts_per_tok": 8,
                    "moe_intermediate_size": 2048, "n_shared_experts": 1,
                    "first_k_dense_replace": 3, "kv_lora_rank": 512, "q_lora_rank": 1536,
                    "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128},
}

# Per-architecture facts config.json does not spell out (the modeling code does); planner only.
EXTRAS: dict[str, dict[str, float | int | str]] = {
    "gemma2": {"norms_per_layer": 4},
    "gemma3_text": {"norms_per_layer": 4},
    "gemma3": {"norms_per_layer": 4},
    "gpt_oss": {"o_proj_bias": 1, "attention_sinks": 1, "router_bias": 1, "moe_bias": 1},
    "deepseek_v3": {"router_bias": 1},  # e_score_correction_bias (noaux_tc routing)
}

# Sliding windows, as each config class and modeling file applies them:
WINDOW_NEVER = ("llama",)  # LlamaConfig has no sliding window; the model ignores the key
WINDOW_GATED = ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe")  # only with use_sliding_window
WINDOW_EVERY_LAYER = ("mistral", "mixtral", "qwen3_moe")  # one window, layer_types ignored
# Default layer pattern when config.json has no layer_types: the period's last layer is full.
WINDOW_PERIOD = {"gemma2": 2, "gpt_oss": 2}  # gemma3_text: sliding_window_pattern (6)
QK_NORM = ("qwen3", "qwen3_moe", "gemma3", "gemma3_text", "olmoe")
ALWAYS_QKV_BIAS = ("qwen2",)  # Qwen2Attention: q/k/v bias=True whatever attention_bias says
# attention_bias puts a bias on o_proj too (LlamaAttention, Qwen3Attention, GptOssAttention)
O_BIAS_WITH_ATTENTION_BIAS = ("llama", "gemma", "gemma2", "gemma3_text", "qwen3", "qwen3_moe",
                              "gpt_oss", "olmoe")
# Model types whose attention_bias transformers ignores (no such field; biases hard-coded off);
# qwen2_moe reads ``qkv_bias`` (default True) instead.
IGNORES_ATTENTION_BIAS = ("mistral", "mixtral", "qwen2", "qwen2_moe")


def default(model_type: str, key: str) -> Any:
    """transformers' default for ``key`` of ``model_type`` (``GENERIC`` for unknown types)."""
    table = DEFAULTS.get(model_type, {})
    return table[key] if key in table else GENERIC.get(key)
