"""Hugging Face model folders: config.json + *.safetensors (sharded too) + tokenizer files."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from fitserve.config import ModelSpec
from fitserve.loading.errors import ModelLoadError
from fitserve.loading.hf_config import check_weights, spec_from_hf_config
from fitserve.loading.tokenizer import Tokenizer

_DTYPE_NAMES = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise ModelLoadError(f"{path}: missing file") from exc
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{path}: not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path}: expected a JSON object")
    return data


def spec_from_folder(folder: Path) -> ModelSpec:
    """The :class:`ModelSpec` of an HF folder (config.json, plus generation_config.json EOS ids)."""
    config_path = folder / "config.json"
    config = _read_json(config_path)
    if config.get("quantization_config"):
        method = config["quantization_config"].get("quant_method", "?")
        raise ModelLoadError(f"{config_path}: quantized checkpoints ({method}) are not supported")
    gen_path = folder / "generation_config.json"
    gen = _read_json(gen_path) if gen_path.is_file() else None
    spec = spec_from_hf_config(config, source=config_path, generation_config=gen)
    return spec if spec.name else replace(spec, name=folder.name)


def safetensors_files(folder: Path) -> list[Path]:
    """The weight files of a folder: from ``model.safetensors.index.json`` if present."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelLoadError(f"{index}: no weight_map")
        files = [folder / f for f in dict.fromkeys(weight_map.values())]
        for f in files:
            if not f.is_file():
                raise ModelLoadError(f"{f}: missing file (listed in {index.name})")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{folder}: no *.safetensors files")
    return files


def read_safetensors(files: list[Path], dtype: torch.dtype) -> tuple[dict[str, torch.Tensor], str]:
    """Read all tensors converted to ``dtype``; also name the dominant stored dtype."""
    weights: dict[str, torch.Tensor] = {}
    stored: Counter[str] = Counter()
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as fh:
                for name in fh.keys():  # noqa: SIM118 (safe_open has no __iter__)
                    tensor = fh.get_tensor(name)
                    if tensor.dtype not in _DTYPE_NAMES:
                        raise ModelLoadError(
                            f"{path}: tensor {name!r} has unsupported type {tensor.dtype}; "
                            f"supported: {', '.join(_DTYPE_NAMES.values())}"
                        )
                    if tensor.dim() >= 2:
                        stored[_DTYPE_NAMES[tensor.dtype]] += tensor.numel()
                    weights[name] = tensor.to(dtype)
        except (SafetensorError, OSError) as exc:
            raise ModelLoadError(f"{path}: corrupt or unreadable safetensors file: {exc}") from exc
    return weights, (stored.most_common(1)[0][0] if stored else "f32")


def read_hf_folder(
    folder: Path, dtype: torch.dtype = torch.float32
) -> tuple[ModelSpec, dict[str, torch.Tensor], Tokenizer, str]:
    """Everything an HF folder holds: (spec, weights, tokenizer, dominant stored dtype)."""
    if not folder.is_dir():
        raise ModelLoadError(f"{folder}: no such folder")
    spec = spec_from_folder(folder)
    tokenizer = Tokenizer.from_folder(
        folder, eos_token_ids=spec.eos_token_ids, bos_token_id=spec.bos_token_id
    )
    if not spec.eos_token_ids and tokenizer.eos_token_ids:
        spec = replace(spec, eos_token_ids=tokenizer.eos_token_ids)
    weights, fmt = read_safetensors(safetensors_files(folder), dtype)
    check_weights(weights, spec, folder)
    return spec, weights, tokenizer, fmt
