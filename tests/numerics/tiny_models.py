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
