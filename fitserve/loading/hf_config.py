"""Hugging Face ``config.json`` -> :class:`ModelSpec`, and the weight names a spec implies.

Shared by the safetensors loader and (later) the planner's catalog. Handles both spellings of
RoPE settings: transformers < 5 (``rope_theta`` + ``rope_scaling``) and transformers 5
(``rope_parameters`` holding ``rope_theta``, ``rope_type`` and the scaling factors).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from fitserve.config import SUPPORTED_ARCHITECTURES, ModelSpec, RopeScaling
from fitserve.loading.errors import (
    MissingTensorError,
    ModelLoadError,
    UnsupportedArchitectureError,
)

# HF class names and model_type spellings -> fitserve architecture names.
_ARCH_ALIASES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MixtralForCausalLM": "mixtral",
}
_ENGINE_ROPE_KINDS = ("llama3", "linear")


def normalize_architecture(config: Mapping[str, Any]) -> str:
    """The architecture name of a config: ``model_type`` if set, else from ``architectures``."""
    model_type = config.get("model_type")
    if isinstance(model_type, str) and model_type:
        return model_type.lower()
    archs = config.get("architectures") or []
    if archs:
        return _ARCH_ALIASES.get(archs[0], str(archs[0]))
    return ""


def _rope(
    config: Mapping[str, Any], source: object, require_supported: bool
) -> tuple[float, RopeScaling | None]:
    params = config.get("rope_parameters")
    if isinstance(params, Mapping) and "full_attention" in params:  # per-layer-type layout
        params = params["full_attention"]
    scaling = config.get("rope_scaling")
    merged: dict[str, Any] = {}
    if isinstance(scaling, Mapping):
        merged.update(scaling)
    if isinstance(params, Mapping):
        merged.update(params)
    theta = float(merged.get("rope_theta", config.get("rope_theta", 10000.0)))
    kind = merged.get("rope_type", merged.get("type", "default")) or "default"
    if kind == "default":
        return theta, None
    if require_supported and kind not in _ENGINE_ROPE_KINDS:
        raise ModelLoadError(
            f"{source}: unsupported rope scaling type {kind!r}; supported: default, "
            + ", ".join(_ENGINE_ROPE_KINDS)
        )
    defaults = RopeScaling(kind=str(kind))
    return theta, RopeScaling(
        kind=str(kind),
        factor=float(merged.get("factor", defaults.factor)),
        low_freq_factor=float(merged.get("low_freq_factor", defaults.low_freq_factor)),
        high_freq_factor=float(merged.get("high_freq_factor", defaults.high_freq_factor)),
        original_max_position_embeddings=int(
            merged.get(
                "original_max_position_embeddings", defaults.original_max_position_embeddings
            )
        ),
    )


def _ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _sliding(
    config: Mapping[str, Any], arch: str, num_layers: int
) -> tuple[int | None, tuple[str, ...] | None]:
    """(window, per-layer kinds) following transformers' rules for each architecture."""
    window = config.get("sliding_window")
    if arch in ("qwen2", "qwen3") and not config.get("use_sliding_window", False):
        window = None
    if window is None:
        return None, None
    layer_types = config.get("layer_types")
    if layer_types is None and arch in ("qwen2", "qwen3"):
        first = int(config.get("max_window_layers", num_layers))
        layer_types = [
            "sliding_attention" if i >= first else "full_attention" for i in range(num_layers)
        ]
    if layer_types is None:
        return int(window), None
    kinds = tuple("sliding" if t == "sliding_attention" else "full" for t in layer_types)
    if all(k == "sliding" for k in kinds):
        return int(window), None
    if not any(k == "sliding" for k in kinds):
        return None, None
    return int(window), kinds


def spec_from_hf_config(
    config: Mapping[str, Any],
    *,
    source: object = "config.json",
    require_supported: bool = True,
    generation_config: Mapping[str, Any] | None = None,
) -> ModelSpec:
    """Build a :class:`ModelSpec` from a parsed ``config.json``.

    With ``require_supported`` (the engine's case) an architecture outside
    ``SUPPORTED_ARCHITECTURES`` or a RoPE scaling the engine cannot do raises
    :class:`ModelLoadError`; the planner passes False to describe any decoder-only model.
    ``generation_config`` (``generation_config.json``) contributes extra EOS ids.
    """
    if "text_config" in config and "hidden_size" not in config:
        config = {**config["text_config"], "architectures": config.get("architectures")}
    arch = normalize_architecture(config)
    if require_supported and arch not in SUPPORTED_ARCHITECTURES:
        shown = arch or "(none: config has no model_type or architectures)"
        if config.get("architectures"):
            shown = f"{arch} ({config['architectures'][0]})"
        raise UnsupportedArchitectureError(shown, source)
    try:
        hidden = int(config["hidden_size"])
        heads = int(config["num_attention_heads"])
        layers = int(config["num_hidden_layers"])
        vocab = int(config["vocab_size"])
        intermediate = int(config["intermediate_size"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelLoadError(f"{source}: missing or invalid field {exc}") from exc
    if (
        require_supported
        and arch in ("llama", "mistral")
        and (config.get("attention_bias") or config.get("mlp_bias"))
    ):
        raise ModelLoadError(f"{source}: {arch} with attention_bias/mlp_bias is not supported")
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or hidden // heads)
    theta, scaling = _rope(config, source, require_supported)
    window, layer_types = _sliding(config, arch, layers)
    eos = list(_ids(config.get("eos_token_id")))
    if generation_config:
        eos += [i for i in _ids(generation_config.get("eos_token_id")) if i not in eos]
    bos = config.get("bos_token_id")
    if isinstance(bos, list):
        bos = bos[0] if bos else None
    return ModelSpec(
        architecture=arch,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-5)),
        rope_theta=theta,
        rope_scaling=scaling,
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        attention_bias=arch == "qwen2" or bool(config.get("attention_bias", False)),
        qk_norm=arch == "qwen3",
        sliding_window=window,
        layer_types=layer_types,
        hidden_act=str(config.get("hidden_act", "silu")),
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=tuple(eos),
        name=str(config.get("_name_or_path", "") or ""),
        num_experts=int(config.get("num_local_experts") or config.get("num_experts") or 0),
        num_experts_per_token=int(config.get("num_experts_per_tok") or 0),
        moe_intermediate_size=int(config.get("moe_intermediate_size") or 0),
    )


def expected_weight_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Every Hugging Face parameter name (and shape) the engine needs for ``spec``.

    ``lm_head.weight`` appears only when embeddings are untied; biases only with
    ``attention_bias``; ``q_norm``/``k_norm`` only with ``qk_norm``.
    """
    h, q, kv, d = spec.hidden_size, spec.q_size, spec.kv_size, spec.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (spec.vocab_size, h),
        "model.norm.weight": (h,),
    }
    if not spec.tie_word_embeddings:
        shapes["lm_head.weight"] = (spec.vocab_size, h)
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        for name, rows in (("q", q), ("k", kv), ("v", kv)):
            shapes[f"{p}self_attn.{name}_proj.weight"] = (rows, h)
            if spec.attention_bias:
                shapes[f"{p}self_attn.{name}_proj.bias"] = (rows,)
        shapes[p + "self_attn.o_proj.weight"] = (h, q)
        if spec.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (d,)
            shapes[p + "self_attn.k_norm.weight"] = (d,)
        shapes[p + "mlp.gate_proj.weight"] = (spec.intermediate_size, h)
        shapes[p + "mlp.up_proj.weight"] = (spec.intermediate_size, h)
        shapes[p + "mlp.down_proj.weight"] = (h, spec.intermediate_size)
    return shapes


# Tensors some checkpoints carry that the engine does not need (recomputed or redundant).
_HARMLESS_EXTRA = re.compile(r".*rotary_emb\.inv_freq$")


def check_weights(weights: dict[str, Any], spec: ModelSpec, source: object) -> None:
    """Check ``weights`` has exactly the tensors ``spec`` needs, with the right shapes.

    Drops harmless extras in place (``rotary_emb.inv_freq``; ``lm_head.weight`` when tied);
    raises :class:`MissingTensorError` for absent tensors and :class:`ModelLoadError` for a
    wrong shape or an unexpected tensor (which would otherwise be silently ignored).
    """
    expected = expected_weight_shapes(spec)
    for name in list(weights):
        if name not in expected and (
            _HARMLESS_EXTRA.fullmatch(name)
            or (name == "lm_head.weight" and spec.tie_word_embeddings)
        ):
            del weights[name]
    missing = [n for n in expected if n not in weights]
    if missing:
        raise MissingTensorError(missing, source)
    unexpected = sorted(set(weights) - set(expected))
    if unexpected:
        raise ModelLoadError(
            f"{source}: unexpected tensors for {spec.architecture}: {', '.join(unexpected[:8])}"
        )
    for name, shape in expected.items():
        got = tuple(weights[name].shape)
        if got != shape:
            raise ModelLoadError(f"{source}: tensor {name!r} has shape {got}, expected {shape}")
