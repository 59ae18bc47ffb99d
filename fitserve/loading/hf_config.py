"""Hugging Face ``config.json`` -> :class:`ModelSpec`, for the engine and the planner alike.

Torch-free: the planner imports this module. One reader, two modes:

- ``require_supported=True`` (the engine's loader): an architecture outside
  ``SUPPORTED_ARCHITECTURES``, a RoPE scaling the engine cannot do, or a bias the engine has
  no place for raises :class:`ModelLoadError`;
- ``require_supported=False`` (the planner): any decoder-only model is described, MoE and MLA
  fields included.

A field config.json leaves out takes the default of that model type's transformers 5.24
config class (``fitserve.loading.hf_defaults``), so the spec is what transformers would build.
Both spellings of RoPE settings are read: transformers < 5 (``rope_theta`` + ``rope_scaling``)
and transformers 5 (``rope_parameters`` holding ``rope_theta``, ``rope_type`` and factors,
possibly nested per layer type); as in transformers, a legacy ``rope_scaling`` wins.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from fitserve.config import (
    GEMMA_ARCHITECTURES,
    MOE_ARCHITECTURES,
    SUPPORTED_ARCHITECTURES,
    ModelSpec,
    RopeScaling,
)
from fitserve.ledger.errors import PlanError
from fitserve.ledger.formats import weight_format

# the engine's names: the ledger's list with a mixture-of-experts model's experts
from fitserve.ledger.weight_names import expected_weight_shapes  # noqa: F401
from fitserve.loading import hf_defaults as d
from fitserve.loading.errors import ModelLoadError, UnsupportedArchitectureError
from fitserve.loading.hf_families import gemma_fields, longrope_scaling, moe_fields, yarn_scaling
from fitserve.loading.hf_quant_config import MXFP4_METHOD, PREQUANT_METHODS, quant_problems
from fitserve.loading.weight_names import check_weights as check_weights  # re-exported

# HF class names -> model_type, for configs that only name ``architectures``.
_ARCH_ALIASES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "OlmoeForCausalLM": "olmoe",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3_text",
    "Phi3ForCausalLM": "phi3",
}
ENGINE_ROPE_KINDS = ("llama3", "linear", "longrope", "yarn")
# quantization_config.quant_method of a `fitserve quantize` checkpoint (fitserve.loading.checkpoint)
FITSERVE_QUANT_METHOD = "fitserve"
# Keys transformers requires per rope type (original_max_position_embeddings defaults to
# max_position_embeddings when absent, as transformers' standardize_rope_params does).
_ROPE_REQUIRED = {
    "linear": ("factor",),
    "dynamic": ("factor",),
    "yarn": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor"),
    "longrope": ("short_factor", "long_factor"),
}
_ROPE_ORIGINAL_MAX = ("llama3", "yarn", "longrope")


def normalize_architecture(config: Mapping[str, Any]) -> str:
    """The architecture name of a config: ``model_type`` if set, else from ``architectures``."""
    model_type = config.get("model_type")
    if isinstance(model_type, str) and model_type:
        return model_type.lower()
    archs = config.get("architectures") or []
    if archs:
        return _ARCH_ALIASES.get(archs[0], str(archs[0]))
    return ""


def _text_config(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """The language model's config of a multimodal config (``text_config``), else ``config``."""
    text = config.get("text_config")
    if not isinstance(text, Mapping) or "hidden_size" in config:
        return config
    merged = dict(text)
    merged.setdefault("architectures", config.get("architectures"))
    merged.setdefault("model_type", config.get("model_type"))
    if "tie_word_embeddings" in config:
        merged.setdefault("tie_word_embeddings", config["tie_word_embeddings"])
    return merged


def _get(config: Mapping[str, Any], key: str, arch: str) -> Any:
    """config[key] if the key is there (even as null), else transformers' class default."""
    return config[key] if key in config else d.default(arch, key)


def _required_int(config: Mapping[str, Any], key: str, source: object) -> int:
    if key not in config or config[key] is None:
        raise ModelLoadError(f"{source}: missing field {key!r} (needed to build the model)")
    try:
        return int(config[key])
    except (TypeError, ValueError) as exc:
        raise ModelLoadError(f"{source}: field {key!r} is not an integer: {config[key]!r}") from exc


def _rope_params(config: Mapping[str, Any]) -> dict[str, Any]:
    """The RoPE parameters of full-attention layers, merged as transformers merges them."""
    scaling, params = config.get("rope_scaling"), config.get("rope_parameters")
    if isinstance(params, Mapping) and ("full_attention" in params or "sliding_attention" in params):
        full = dict(params.get("full_attention") or {})  # nested per layer type (Gemma 3)
        if isinstance(scaling, Mapping):
            full.update(scaling)
        return full
    if isinstance(scaling, Mapping) and scaling:
        return dict(scaling)  # transformers: rope_parameters = rope_scaling or rope_parameters
    return dict(params) if isinstance(params, Mapping) else {}


def _rope(
    config: Mapping[str, Any], arch: str, max_pos: int, source: object, require_supported: bool
) -> tuple[float, RopeScaling | None]:
    p = _rope_params(config)
    theta = float(p.get("rope_theta", config.get("rope_theta") or d.default(arch, "rope_theta")))
    kind = str(p.get("rope_type", p.get("type", "default")) or "default")
    if kind in ("su", "yarn") and arch == "phi3":
        kind = "longrope"  # Phi3Config's backward compatibility: "su"/"yarn" mean longrope
    if kind == "default":
        return theta, None
    if require_supported and kind not in ENGINE_ROPE_KINDS:
        raise ModelLoadError(
            f"{source}: unsupported rope scaling type {kind!r}; supported: default, "
            + ", ".join(ENGINE_ROPE_KINDS)
        )
    missing = [k for k in _ROPE_REQUIRED.get(kind, ()) if p.get(k) is None]
    if missing:
        raise ModelLoadError(
            f"{source}: rope scaling {kind!r} lacks {', '.join(map(repr, missing))} "
            "(transformers requires it too)"
        )
    dflt = RopeScaling(kind=kind)
    orig = p.get("original_max_position_embeddings")
    if kind in _ROPE_ORIGINAL_MAX and (
            "original_max_position_embeddings" in config or arch == "phi3"):
        # NOTE: transformers' standardize_rope_params gives a top-level field priority; Phi3Config
        # always has one (class default 4096)
        orig = config.get("original_max_position_embeddings") or 4096
    if orig is None:
        orig = max_pos if kind in _ROPE_ORIGINAL_MAX else dflt.original_max_position_embeddings
    if kind == "longrope":
        return theta, longrope_scaling(p, max_pos, int(orig))
    if kind == "yarn":
        return theta, yarn_scaling(p, max_pos, int(orig))
    return theta, RopeScaling(
        kind=kind,
        factor=float(p.get("factor", dflt.factor)),
        low_freq_factor=float(p.get("low_freq_factor", dflt.low_freq_factor)),
        high_freq_factor=float(p.get("high_freq_factor", dflt.high_freq_factor)),
        original_max_position_embeddings=int(orig),
    )


def _sliding_per_layer(config: Mapping[str, Any], arch: str, n: int, source: object) -> list[bool]:
    """Which layers use the window, by each config class's rule (window already known set)."""
    types = config.get("layer_types")
    if arch in d.WINDOW_EVERY_LAYER:
        return [True] * n
    if isinstance(types, list):
        if len(types) != n:
            raise ModelLoadError(f"{source}: layer_types has {len(types)} entries for {n} layers")
        return ["sliding" in str(t) for t in types]
    if arch in ("qwen2", "qwen3", "qwen2_moe"):
        first = int(_get(config, "max_window_layers", arch))
        if arch == "qwen2_moe":
            return [bool((i + 1) % 2) and i < first for i in range(n)]
        return [i >= first for i in range(n)]  # the top layers slide
    period = config.get("sliding_window_pattern") or d.WINDOW_PERIOD.get(arch) or d.default(
        arch, "sliding_window_pattern")
    if period:
        return [bool((i + 1) % int(period)) for i in range(n)]  # every period-th layer is full
    return [True] * n


def _sliding(
    config: Mapping[str, Any], arch: str, n: int, source: object
) -> tuple[int | None, tuple[str, ...] | None]:
    """(window, per-layer kinds); kinds None when every layer is of one kind."""
    if arch in d.WINDOW_NEVER:
        return None, None
    window = _get(config, "sliding_window", arch)
    if arch in d.WINDOW_GATED and not config.get("use_sliding_window", False):
        window = None
    if not window:  # None, or 0 (qwen2_moe's "unused")
        return None, None
    sliding = _sliding_per_layer(config, arch, n, source)
    if all(sliding):
        return int(window), None
    if not any(sliding):
        return None, None
    return int(window), tuple("sliding" if s else "full" for s in sliding)


def _ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _attention_bias(config: Mapping[str, Any], arch: str) -> tuple[bool, bool]:
    """(q/k/v bias, o_proj bias) as the architecture's attention module builds them."""
    if arch in d.ALWAYS_QKV_BIAS:
        return True, False
    if arch == "qwen2_moe":
        return bool(config.get("qkv_bias", True)), False
    if arch in d.IGNORES_ATTENTION_BIAS:
        return False, False
    bias = bool(_get(config, "attention_bias", arch))
    return bias, bias and arch in d.O_BIAS_WITH_ATTENTION_BIAS


def _moe_and_mla(config: Mapping[str, Any], arch: str) -> dict[str, Any]:
    """ModelSpec's planner-only fields: experts (Mixtral, Qwen-MoE, gpt-oss, DeepSeek) and MLA."""

    def num(*keys: str) -> int:
        for key in keys:
            value = _get(config, key, arch)
            if value:
                return int(value)
        return 0

    return dict(
        num_experts=num("num_local_experts", "n_routed_experts", "num_experts"),
        num_experts_per_token=num("num_experts_per_tok", "experts_per_token"),
        moe_intermediate_size=num("moe_intermediate_size"),
        num_shared_experts=num("n_shared_experts"),
        first_k_dense=num("first_k_dense_replace"),
        q_lora_rank=num("q_lora_rank"),
        kv_lora_rank=num("kv_lora_rank"),
        qk_nope_head_dim=num("qk_nope_head_dim"),
        qk_rope_head_dim=num("qk_rope_head_dim"),
        v_head_dim=num("v_head_dim"),
    )


def _check_engine_config(config: Mapping[str, Any], arch: str, source: object) -> None:
    if arch not in SUPPORTED_ARCHITECTURES:
        shown = arch or "(none: config has no model_type or architectures)"
        if config.get("architectures"):
            shown = f"{arch} ({config['architectures'][0]})"
        raise UnsupportedArchitectureError(shown, source)
    if arch == "llama" and (config.get("attention_bias") or config.get("mlp_bias")):
        raise ModelLoadError(f"{source}: llama with attention_bias/mlp_bias is not supported")
    if arch in ("qwen3", "qwen3_moe", "olmoe") and config.get("attention_bias"):
        raise ModelLoadError(f"{source}: {arch} with attention_bias (an o_proj bias) is not "
                             "supported")
    if (config.get("architectures") or [""])[0] == "Gemma3ForConditionalGeneration":
        raise ModelLoadError(f"{source}: Gemma3ForConditionalGeneration (image + text) is not "
                             "supported; the engine runs Gemma3ForCausalLM (gemma3_text) checkpoints")
    if arch in GEMMA_ARCHITECTURES and config.get("attention_bias"):
        raise ModelLoadError(f"{source}: {arch} with attention_bias is not supported")
    if arch == "phi3":
        partial = config.get("partial_rotary_factor")
        params = config.get("rope_parameters") or config.get("rope_scaling") or {}
        if partial is None and isinstance(params, Mapping):
            partial = params.get("partial_rotary_factor")
        if partial not in (None, 1, 1.0):
            raise ModelLoadError(f"{source}: phi3 with partial_rotary_factor={partial} (Phi-4-mini) "
                                 "is not supported: the engine rotates whole heads")


def spec_from_hf_config(
    config: Mapping[str, Any],
    *,
    source: object = "config.json",
    require_supported: bool = True,
    generation_config: Mapping[str, Any] | None = None,
    name: str = "",
) -> ModelSpec:
    """Build a :class:`ModelSpec` from a parsed ``config.json`` (see the module docstring).

    ``generation_config`` (``generation_config.json``) contributes extra EOS ids; ``name``
    overrides ``_name_or_path``. Raises :class:`ModelLoadError` naming ``source``.
    """
    config = _text_config(config)
    arch = normalize_architecture(config)
    if require_supported:
        _check_engine_config(config, arch, source)
    elif not arch:
        arch = "llama"  # NOTE: planner only: a bare hand-written config is read as Llama's
    hidden = _required_int(config, "hidden_size", source)
    heads = _required_int(config, "num_attention_heads", source)
    layers = _required_int(config, "num_hidden_layers", source)
    vocab = _required_int(config, "vocab_size", source)
    intermediate = _required_int(config, "intermediate_size", source)
    if heads < 1 or hidden < 1 or layers < 1:
        raise ModelLoadError(f"{source}: hidden_size, num_attention_heads and num_hidden_layers "
                             "must be >= 1")
    experts = _moe_and_mla(config, arch)
    if experts["kv_lora_rank"]:  # MLA: q/k heads are nope + rope wide (planner's convention)
        head_dim = experts["qk_nope_head_dim"] + experts["qk_rope_head_dim"]
    else:
        head_dim = int(_get(config, "head_dim", arch) or hidden // heads)
    max_pos = int(_get(config, "max_position_embeddings", arch))
    theta, scaling = _rope(config, arch, max_pos, source, require_supported)
    window, layer_types = _sliding(config, arch, layers, source)
    qkv_bias, o_bias = _attention_bias(config, arch)
    extra: dict[str, float | int | str] = dict(d.EXTRAS.get(arch, {}))
    if o_bias:
        extra["o_proj_bias"] = 1
    if arch == "gpt_oss":  # the experts' clamped SwiGLU (fitserve.model.gpt_oss)
        extra["swiglu_alpha"] = float(_get(config, "swiglu_alpha", arch) or 1.702)
        extra["swiglu_limit"] = float(_get(config, "swiglu_limit", arch) or 7.0)
    gen = generation_config or {}
    eos = list(_ids(config.get("eos_token_id")))
    eos += [i for i in _ids(gen.get("eos_token_id")) if i not in eos]
    bos = config.get("bos_token_id", gen.get("bos_token_id"))
    if isinstance(bos, list):
        bos = bos[0] if bos else None
    act = config.get("hidden_activation") or _get(config, "hidden_act", arch)
    spec = ModelSpec(
        architecture=arch,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(_get(config, "num_key_value_heads", arch) or heads),
        head_dim=head_dim,
        max_position_embeddings=max_pos,
        rms_norm_eps=float(_get(config, "rms_norm_eps", arch)),
        rope_theta=theta,
        rope_scaling=scaling,
        tie_word_embeddings=bool(_get(config, "tie_word_embeddings", arch)),
        attention_bias=qkv_bias,
        qk_norm=arch in d.QK_NORM,
        sliding_window=window,
        layer_types=layer_types,
        hidden_act=str(act),
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=tuple(eos),
        name=name or str(config.get("_name_or_path", "") or ""),
        extra=extra,
        **gemma_fields(config, arch, source, require_supported),
    )
    return replace(spec, **experts, **moe_fields(config, arch, source, require_supported))


def check_engine_spec(spec: ModelSpec, source: object) -> None:
    """Raise :class:`ModelLoadError` for what a spec may describe but the engine cannot run.

    NOTE: not part of ``spec_from_hf_config(require_supported=True)``: a spec with per-layer
    windows is still a valid description; only building an engine from it must fail.
    """
    # NOTE: layer_types mixing "sliding" and "full" runs: one KV layer group per kind
    # (fitserve.kv.group), each layer reading its group's batch.
    if spec.kv_lora_rank:
        raise ModelLoadError(f"{source}: multi-head latent attention (MLA) models are not supported")
    if spec.num_experts and spec.architecture not in MOE_ARCHITECTURES:
        raise ModelLoadError(f"{source}: mixture-of-experts {spec.architecture} is not supported "
                             f"(the engine runs experts of {', '.join(MOE_ARCHITECTURES)})")


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object from ``path``, or :class:`ModelLoadError` naming the file."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise ModelLoadError(f"{path}: missing file") from exc
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{path}: not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path}: expected a JSON object")
    return data


def packed_formats(config: Mapping[str, Any], source: object) -> dict[str, str] | None:
    """The engine layout of each packed tensor of a `fitserve quantize` checkpoint
    (``quantization_config.formats``: HF weight name -> "int4-g32-asym", "int8-ch" ...), or None
    for a folder without ``quantization_config`` or a pre-quantized one (compressed-tensors,
    GPTQ, AWQ: ``fitserve.loading.hf_quant_config``; what the engine cannot hold of it raises).

    Raises :class:`ModelLoadError` naming ``source`` for another ``quant_method``, a missing or empty
    ``formats``, a name that is not a ``.weight`` or a format that is not an engine packed
    layout of ``fitserve.ledger.formats`` (spelled as the table spells it).
    """
    quant = config.get("quantization_config")
    if not quant:
        return None
    method = quant.get("quant_method", "?") if isinstance(quant, Mapping) else "?"
    if method in PREQUANT_METHODS:  # held as stored by fitserve.quant.hf_checkpoint_formats
        problems = quant_problems(config)
        if problems:
            raise ModelLoadError(f"{source}: {'; '.join(problems)}")
        return None
    if method == MXFP4_METHOD and normalize_architecture(config) == "gpt_oss":
        return None  # gpt-oss's MXFP4 experts: fitserve.loading.mxfp4
    if method != FITSERVE_QUANT_METHOD:
        raise ModelLoadError(f"{source}: quantized checkpoints ({method}) are not supported "
                             f"(quant_method {FITSERVE_QUANT_METHOD!r}: fitserve quantize, "
                             f"{', '.join(map(repr, PREQUANT_METHODS))})")
    formats = quant.get("formats")
    if not isinstance(formats, Mapping) or not formats:
        raise ModelLoadError(f"{source}: quantization_config has no 'formats' "
                             "(tensor name -> packed format)")
    out: dict[str, str] = {}
    for name, fmt in formats.items():
        try:
            layout = weight_format(str(fmt))
        except PlanError:
            layout = None
        if not str(name).endswith(".weight") or layout is None or layout.packed is None or (
                layout.name != fmt):
            raise ModelLoadError(f"{source}: tensor {name!r}: unknown packed format {fmt!r} in "
                                 "quantization_config.formats (int4-g<32|64|128>-<sym|asym>, "
                                 "int8-g<32|64|128>, int8-ch)")
        out[str(name)] = layout.name
    return out


def spec_from_hf_folder(path: Path, *, require_supported: bool = True) -> ModelSpec:
    """The spec of an HF folder (or its config.json): config.json + generation_config.json.

    The name is ``_name_or_path``, else the folder's name. The engine's mode also refuses
    quantized checkpoints other than fitserve's own (``packed_formats``) and specs
    :func:`check_engine_spec` refuses.
    """
    config_path = path / "config.json" if path.is_dir() else path
    folder = config_path.parent
    config = read_json(config_path)
    if require_supported:
        packed_formats(config, config_path)
    gen_path = folder / "generation_config.json"
    gen = read_json(gen_path) if gen_path.is_file() else None
    spec = spec_from_hf_config(
        config, source=config_path, require_supported=require_supported, generation_config=gen
    )
    if require_supported:
        check_engine_spec(spec, config_path)
    return spec if spec.name else replace(spec, name=folder.resolve().name)
