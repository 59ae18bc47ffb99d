"""What config.json says about the newer families beyond the Llama shape (torch-free):
Phi-3's LongRoPE and Gemma 2/3's attention scale, soft-caps and local RoPE base, read as
transformers' config classes and RoPE functions read them."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from fitserve.config import GEMMA_ARCHITECTURES, RopeScaling
from fitserve.loading import hf_defaults as d
from fitserve.loading.errors import ModelLoadError


def _get(config: Mapping[str, Any], key: str, arch: str) -> Any:
    """config[key] if the key is there (even as null), else transformers' class default."""
    return config[key] if key in config else d.default(arch, key)


def longrope_scaling(p: Mapping[str, Any], max_pos: int, orig: int) -> RopeScaling:
    """LongRoPE as transformers' _compute_longrope_parameters reads it: ``factor`` defaults to
    max_position_embeddings / original, ``attention_factor`` to sqrt(1 + ln f / ln original)."""
    factor = p.get("factor")
    factor = max_pos / orig if factor is None else float(factor)
    attention = p.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
    return RopeScaling("longrope", factor=factor, original_max_position_embeddings=orig,
                       short_factor=tuple(float(x) for x in p["short_factor"]),
                       long_factor=tuple(float(x) for x in p["long_factor"]),
                       attention_factor=float(attention))


def yarn_scaling(p: Mapping[str, Any], max_pos: int, orig: int) -> RopeScaling:
    """YaRN as transformers' _compute_yarn_parameters reads it: ``attention_factor`` defaults
    to mscale(factor, mscale) / mscale(factor, mscale_all_dim) when both are set, else
    mscale(factor) = 0.1 ln(factor) + 1 (1 for factor <= 1); beta_fast 32, beta_slow 1 (when
    absent or 0), truncate True."""
    factor = p.get("factor")
    factor = max_pos / orig if factor is None else float(factor)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = p.get("attention_factor")
    if attention is None:
        ms, ms_all = p.get("mscale"), p.get("mscale_all_dim")
        attention = (mscale(factor, ms) / mscale(factor, ms_all) if ms and ms_all
                     else mscale(factor))
    return RopeScaling("yarn", factor=factor, original_max_position_embeddings=orig,
                       attention_factor=float(attention),
                       beta_fast=float(p.get("beta_fast") or 32), beta_slow=float(p.get("beta_slow") or 1),
                       truncate=bool(p.get("truncate", True)))


def gemma_fields(config: Mapping[str, Any], arch: str, source: object,
                  require_supported: bool) -> dict[str, Any]:
    """Gemma 2/3's attention scale, soft-caps and the sliding layers' RoPE base."""
    if arch not in GEMMA_ARCHITECTURES:
        return {}
    out: dict[str, Any] = {
        "query_pre_attn_scalar": float(_get(config, "query_pre_attn_scalar", arch)),
        "attn_logit_softcapping": _get(config, "attn_logit_softcapping", arch),
        "final_logit_softcapping": _get(config, "final_logit_softcapping", arch),
    }
    if require_supported and config.get("use_bidirectional_attention"):
        raise ModelLoadError(f"{source}: use_bidirectional_attention (an encoder) is not supported")
    if arch != "gemma2":  # Gemma 3: the local layers' own base (default RoPE, no scaling)
        params = config.get("rope_parameters")
        local = params.get("sliding_attention") if isinstance(params, Mapping) else None
        local = dict(local or {})
        kind = str(local.get("rope_type", "default"))
        if require_supported and kind != "default":
            raise ModelLoadError(f"{source}: sliding_attention rope type {kind!r} is not supported "
                                 "(only default)")
        out["sliding_rope_theta"] = float(local.get("rope_theta") or config.get(
            "rope_local_base_freq") or 10000.0)
    return {k: (float(v) if v is not None else None) for k, v in out.items()}


def moe_fields(config: Mapping[str, Any], arch: str, source: object,
               require_supported: bool) -> dict[str, Any]:
    """The expert block's settings beyond the counts (``_moe_and_mla``): top-k renormalisation
    (Mixtral always renormalises; Qwen2/3-MoE and OLMoE read ``norm_topk_prob``), Qwen2-MoE's
    shared expert, and which layers are sparse (``decoder_sparse_step``, ``mlp_only_layers``).
    ``router_aux_loss_coef`` / ``output_router_logits`` are training-only: ignored."""
    if arch == "gpt_oss":  # softmax over the top-k router logits = renormalised top-k probs
        return {"norm_topk_prob": True}
    if arch not in ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe"):
        return {}
    if require_supported and config.get("clip_qkv") is not None:
        raise ModelLoadError(f"{source}: {arch} with clip_qkv={config['clip_qkv']} is not "
                             "supported (q/k/v clamping)")
    only = _get(config, "mlp_only_layers", arch) or []
    return {
        "norm_topk_prob": True if arch == "mixtral" else bool(_get(config, "norm_topk_prob", arch)),
        "shared_expert_intermediate_size": int(
            _get(config, "shared_expert_intermediate_size", arch) or 0),
        "decoder_sparse_step": int(_get(config, "decoder_sparse_step", arch) or 1),
        "mlp_only_layers": tuple(int(i) for i in only),
        "qk_norm_scope": "projection" if arch == "olmoe" else "head",
    }
