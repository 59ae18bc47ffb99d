"""Random-weight tiny models of each supported architecture, saved as Hugging Face folders."""

from __future__ import annotations

import zlib
from pathlib import Path

import torch

TINY = dict(hidden_size=64, intermediate_size=160, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=384, max_position_embeddings=512, tie_word_embeddings=False)


def tiny_config(arch: str, **overrides: object):  # type: ignore[no-untyped-def]
    import transformers as tf

    if overrides:
        config = tiny_config(arch)
        for key, value in overrides.items():
            setattr(config, key, value)
        return config

    if arch == "llama":
        return tf.LlamaConfig(**TINY, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 32})
    if arch == "mistral":
        return tf.MistralConfig(**TINY, sliding_window=12, head_dim=16)
    if arch == "qwen2":
        return tf.Qwen2Config(**{**TINY, "tie_word_embeddings": True})
    if arch == "qwen3":
        return tf.Qwen3Config(**TINY, head_dim=24)
    return _new_family_config(tf, arch)


# Gemma 2/3 and Phi-3 (issue 38): GQA 4:1, head_dim != hidden / heads, windows shorter than the
# prompts, soft-caps small enough to bite, both Gemma 3 RoPE tables, LongRoPE past its original
# context. Used by tests/numerics/test_new_families_vs_transformers.py.
_NEW = dict(hidden_size=64, intermediate_size=160, num_attention_heads=4, num_key_value_heads=1,
            vocab_size=384, max_position_embeddings=512)
PHI3_ORIGINAL_CONTEXT = 100


def _new_family_config(tf, arch: str):  # type: ignore[no-untyped-def]
    if arch == "gemma2":
        return tf.Gemma2Config(**_NEW, num_hidden_layers=4, head_dim=24, query_pre_attn_scalar=20,
                               sliding_window=6, attn_logit_softcapping=4.0,
                               final_logit_softcapping=6.0, tie_word_embeddings=True)
    if arch == "gemma3":
        return tf.Gemma3TextConfig(
            **_NEW, num_hidden_layers=4, head_dim=32, query_pre_attn_scalar=24, sliding_window=5,
            layer_types=["sliding_attention", "full_attention", "sliding_attention",
                         "sliding_attention"],
            rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0,
                                                "rope_theta": 1e6},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
            tie_word_embeddings=True)
    if arch == "gemma3_all_sliding":  # every layer windowed: the spec's layer_types is None
        return tf.Gemma3TextConfig(
            **_NEW, num_hidden_layers=2, head_dim=32, query_pre_attn_scalar=32, sliding_window=5,
            layer_types=["sliding_attention"] * 2,
            rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0,
                                                "rope_theta": 1e6},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
            tie_word_embeddings=True)
    if arch == "phi3":
        half = 16 // 2  # head_dim 16
        return tf.Phi3Config(
            **_NEW, num_hidden_layers=3, sliding_window=48,
            original_max_position_embeddings=PHI3_ORIGINAL_CONTEXT,
            rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                             "short_factor": [1.0 + 0.1 * i for i in range(half)],
                             "long_factor": [1.5 + 0.7 * i for i in range(half)]},
            tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    raise ValueError(arch)


def tiny_seed(arch: str) -> int:
    """The weight seed of ``arch``: the same in every process.

    NOTE: crc32, not hash(): str hashes change with PYTHONHASHSEED, i.e. every process.
    """
    return zlib.crc32(arch.encode())


def build_tiny(arch: str, folder: Path, tokenizer_source, **overrides: object) -> torch.nn.Module:  # type: ignore[no-untyped-def]
    """Save a random tiny model (weights scaled up so logits are far from ties) plus a tokenizer;
    ``overrides`` set config fields (e.g. a draft model with the target's ``vocab_size``)."""
    import transformers as tf

    torch.manual_seed(tiny_seed(arch))
    config = tiny_config(arch, **overrides)
    config._attn_implementation = "eager"
    model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                # std 0.02 makes near-uniform logits where greedy ties are decided by rounding
                p.normal_(0.0, 0.25 if "embed" in name or "lm_head" in name else 0.12)
            elif "bias" in name:
                p.normal_(0.0, 0.1)
            else:
                p.uniform_(0.6, 1.4)  # norms
    model.save_pretrained(folder, max_shard_size="200KB")  # sharded on purpose
    tokenizer_source.save_pretrained(folder)
    return model.eval()
