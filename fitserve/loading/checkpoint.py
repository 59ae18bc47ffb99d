"""The `fitserve quantize` checkpoint: a Hugging Face folder holding the engine's packed weights
exactly as the engine holds them (no float round trip on either side).

Folder layout::

    OUT/
      config.json             the source's HF config (for a GGUF source, one written from its
                              ModelSpec: config_from_spec) + "quantization_config" (below)
      model.safetensors       per packed weight W (HF name "<prefix>.weight"):
                                <prefix>.qweight  uint8 [N, K_padded/2] (int4) | int8 [N, K_padded]
                                <prefix>.scales   float16 [N, K_padded/G]
                                <prefix>.mins     float16 [N, K_padded/G]   (asymmetric int4 only)
                              dense tensors (norms, biases) under their own names, float32
      tokenizer.json, tokenizer_config.json (special tokens, add_bos_token, chat template)
      generation_config.json  when the source recommends sampling defaults

    "quantization_config": {"quant_method": "fitserve", "method": "rtn" | "awq" | "gptq",
        "bits": 4 | 8, "group_size": G | null (int8 per channel), "symmetric": bool,
        "formats": {HF weight name: "int4-g32-asym" | "int8-ch" | ...}, ... method details}

The codes follow ``fitserve.quant.packed``'s contract; ``formats`` names each tensor's layout
in the one formats table (``fitserve.ledger.formats``), which is what both the loader
(``fitserve.loading.safetensors``) and the planner (``fitserve.tools.planner.model_source``) read, so the
plan counts the very bytes the engine holds. K (the logical width) is not stored: it is the
spec's (``expected_weight_shapes``), and ``K_padded = ceil(K / G) * G`` follows from it.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from fitserve.config import ModelSpec
from fitserve.ledger.formats import weight_format
from fitserve.loading.generation_defaults import GenerationDefaults
from fitserve.loading.hf_config import FITSERVE_QUANT_METHOD
from fitserve.loading.tokenizer import Tokenizer
from fitserve.quant.held import HeldTensor
from fitserve.quant.packed import PackedWeight, channel_group, padded_k

PARTS = ("qweight", "scales", "mins")
WEIGHTS_FILE = "model.safetensors"
# Files of an HF source copied as they are (the tokenizer, its template, sampling defaults).
_HF_COPIED = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
              "chat_template.jinja", "chat_template.json", "generation_config.json")
# What a rewrite with --force replaces (stale shards would otherwise be read with the new ones).
_OWNED = ("config.json", "model.safetensors.index.json", *_HF_COPIED)
_ARCH_CLASSES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                 "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def prefix_of(hf_name: str) -> str:
    """``model.layers.0.mlp.up_proj.weight`` -> ``model.layers.0.mlp.up_proj``."""
    return hf_name.removesuffix(".weight")


def split_packed(hf_name: str, pw: PackedWeight) -> dict[str, torch.Tensor]:
    """The safetensors entries of one packed weight: ``<prefix>.qweight`` / ``.scales`` (/
    ``.mins``), the engine's tensors as they are (contiguous)."""
    return {f"{prefix_of(hf_name)}.{part}": t.contiguous() for part, t in pw.tensors().items()}


def join_packed(hf_name: str, fmt: str, shape: tuple[int, int],
                parts: Mapping[str, torch.Tensor]) -> PackedWeight:
    """The PackedWeight of ``hf_name`` (logical ``shape`` ``(N, K)``) stored in layout ``fmt``
    from its ``parts`` (``{"qweight": ..., "scales": ..., "mins": ...}``).

    Raises ValueError naming the missing or unexpected part, or the shape/dtype the contract
    wants (``fitserve.quant.packed.check_packed``).
    """
    layout = weight_format(fmt).packed
    if layout is None:
        raise ValueError(f"{fmt!r} is not an engine packed format")
    n, k = shape
    g = layout.group_size or channel_group(k)
    need = {"qweight", "scales"} | (set() if layout.symmetric else {"mins"})
    prefix = prefix_of(hf_name)
    missing = sorted(need - set(parts))
    if missing:
        raise ValueError(f"{fmt} needs {', '.join(f'{prefix}.{p}' for p in missing)}, absent")
    extra = sorted(set(parts) - need)
    if extra:
        raise ValueError(f"{', '.join(f'{prefix}.{p}' for p in extra)} present, but {fmt} has "
                         "no such part")
    return PackedWeight(layout.kind, n, k, padded_k(k, g), g, parts["qweight"], parts["scales"],
                        parts.get("mins"))


def config_from_spec(spec: ModelSpec, *, torch_dtype: str = "float32") -> dict[str, Any]:
    """A Hugging Face ``config.json`` for ``spec`` (llama, mistral, qwen2, qwen3), every field
    written out so that ``spec_from_hf_config`` reads the same spec back (its name aside).

    Raises ValueError for what a config.json of that architecture cannot say (interleaved RoPE,
    a bias the architecture does not have).
    """
    arch = spec.architecture
    if arch not in _ARCH_CLASSES:
        raise ValueError(f"cannot write a config.json for architecture {arch!r}; supported: "
                         f"{', '.join(_ARCH_CLASSES)}")
    if spec.rope_interleaved:
        raise ValueError("interleaved RoPE has no Hugging Face config field")
    if spec.attention_bias != (arch == "qwen2"):
        raise ValueError(f"{arch} with attention_bias={spec.attention_bias} has no config.json "
                         "spelling the engine reads back")
    ids = list(spec.eos_token_ids)
    eos: int | list[int] | None = (ids[0] if len(ids) == 1 else ids) if ids else None
    cfg: dict[str, Any] = {
        "architectures": [_ARCH_CLASSES[arch]], "model_type": arch,
        "hidden_size": spec.hidden_size, "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers, "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads, "head_dim": spec.head_dim,
        "vocab_size": spec.vocab_size, "max_position_embeddings": spec.max_position_embeddings,
        "rms_norm_eps": spec.rms_norm_eps, "rope_theta": spec.rope_theta,
        "hidden_act": spec.hidden_act, "tie_word_embeddings": spec.tie_word_embeddings,
        "bos_token_id": spec.bos_token_id, "eos_token_id": eos, "torch_dtype": torch_dtype,
    }
    if arch in ("llama", "qwen3"):
        cfg["attention_bias"] = False
    if spec.name:
        cfg["_name_or_path"] = spec.name
    if spec.rope_scaling is not None:
        r = spec.rope_scaling
        cfg["rope_scaling"] = {"rope_type": r.kind, "factor": r.factor,
                               "low_freq_factor": r.low_freq_factor,
                               "high_freq_factor": r.high_freq_factor,
                               "original_max_position_embeddings":
                                   r.original_max_position_embeddings}
    cfg.update(_window_fields(spec))
    return cfg


def _window_fields(spec: ModelSpec) -> dict[str, Any]:
    """Sliding-window fields as each config class reads them (llama has none)."""
    if spec.architecture == "llama":
        return {}
    w = spec.sliding_window
    if spec.architecture == "mistral":
        return {"sliding_window": w}
    if w is None:
        return {"use_sliding_window": False, "sliding_window": None}
    kinds = spec.layer_types or ("sliding",) * spec.num_layers
    return {"use_sliding_window": True, "sliding_window": w,
            "layer_types": [f"{k}_attention" for k in kinds]}


def check_output(out: Path, *, force: bool, source: Path | None = None) -> None:
    """Raise ValueError unless ``out`` may receive a checkpoint: absent, an empty folder, or
    (with ``force``) a non-empty folder other than the ``source`` model's own."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out}: exists and is not a folder")
    home = None if source is None else source.resolve() if source.is_dir() else (
        source.resolve().parent)
    if home is not None and out.resolve() == home:
        raise ValueError(f"{out}: the output folder holds the model being quantized; choose "
                         "another -o")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ValueError(f"{out}: output folder exists and is not empty (pass --force to "
                         "overwrite the checkpoint files in it)")


def prepare_output(out: Path, *, force: bool) -> None:
    """Make ``out`` ready to receive a checkpoint (``check_output``, then: with ``force``,
    remove the files a checkpoint writes and any *.safetensors there; create the folder).

    NOTE: --force never removes the folder itself nor files a checkpoint does not own (vLLM
    and llm-compressor users point -o at existing folders; deleting them whole is a surprise).
    """
    check_output(out, force=force)
    if out.is_dir():
        for f in [*out.glob("*.safetensors"), *(out / n for n in _OWNED)]:
            if f.is_file():
                f.unlink()
    out.mkdir(parents=True, exist_ok=True)


def checkpoint_tensors(weights: Mapping[str, HeldTensor]) -> dict[str, torch.Tensor]:
    """The safetensors entries of held weights: packed ones split (``split_packed``), dense
    ones in float32 (norms and biases; lossless from any float source)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in weights.items():
        if isinstance(t, torch.Tensor):
            out[name] = t.detach().to(torch.float32).contiguous()
        elif isinstance(t, PackedWeight):
            out.update(split_packed(name, t))
        else:
            raise ValueError(f"tensor {name!r} is held as {type(t).__name__} ({t.format}); a "
                             "checkpoint stores int4/int8 packed weights and dense tensors")
    return out


def write_checkpoint(out: Path, *, spec: ModelSpec, weights: Mapping[str, HeldTensor],
                     quantization_config: Mapping[str, Any], tokenizer: Tokenizer,
                     source: Path, generation_defaults: GenerationDefaults) -> Path:
    """Write the folder described in the module docstring into ``out`` (already prepared by
    :func:`prepare_output`) and return it. ``source`` is the model quantized: an HF folder
    (its config.json and tokenizer files are carried over) or a GGUF file (they are written
    from ``spec`` and ``tokenizer``). ``quantization_config`` must name each packed tensor's
    format under ``"formats"``."""
    from safetensors.torch import save_file

    formats = quantization_config.get("formats", {})
    for name, t in weights.items():
        if not isinstance(t, torch.Tensor) and formats.get(name) != t.format:
            raise ValueError(f"tensor {name!r} is {t.format}, quantization_config.formats says "
                             f"{formats.get(name)!r}")
    quant = {"quant_method": FITSERVE_QUANT_METHOD, **quantization_config}
    if source.is_dir():
        config = json.loads((source / "config.json").read_text(encoding="utf-8"))
        for f in _HF_COPIED:
            if (source / f).is_file():
                shutil.copyfile(source / f, out / f)
    else:
        config = config_from_spec(spec)
        _write_tokenizer(out, tokenizer, spec)
        _write_generation_config(out, generation_defaults, spec)
    config["quantization_config"] = quant
    partial = out / (WEIGHTS_FILE + ".partial")
    save_file(checkpoint_tensors(weights), str(partial), metadata={"format": "pt"})
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(partial, 0o666 & ~umask)  # NOTE: safetensors creates it 0600; a checkpoint is shared
    os.replace(partial, out / WEIGHTS_FILE)  # no half-written model.safetensors on a crash
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return out


def _write_tokenizer(out: Path, tokenizer: Tokenizer, spec: ModelSpec) -> None:
    """tokenizer.json (the ``tokenizers`` backend, post-processor included) and a
    tokenizer_config.json that ``Tokenizer.from_folder`` reads back to the same tokenizer."""
    tokenizer.backend.save(str(out / "tokenizer.json"))
    config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast",
                              "clean_up_tokenization_spaces": False,
                              "model_max_length": spec.max_position_embeddings}
    config.update({k: v for k, v in tokenizer.special_tokens.items() if v is not None})
    if tokenizer.add_bos_token is not None:
        config["add_bos_token"] = tokenizer.add_bos_token
    if tokenizer.chat_template:
        config["chat_template"] = tokenizer.chat_template
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False)
                                               + "\n", encoding="utf-8")


def _write_generation_config(out: Path, defaults: GenerationDefaults, spec: ModelSpec) -> None:
    """generation_config.json with the source's sampling defaults (none: no file)."""
    values = defaults.values()
    if not values:
        return
    gen: dict[str, Any] = {"do_sample": True, **values, "bos_token_id": spec.bos_token_id,
                           "eos_token_id": list(spec.eos_token_ids) or None}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n",
                                                encoding="utf-8")
