"""Hugging Face model folders: config.json + *.safetensors (sharded too) + tokenizer files."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from fitserve.config import ModelSpec
from fitserve.loading.errors import ModelLoadError
from fitserve.loading.hf_config import check_weights, read_json, spec_from_hf_folder
from fitserve.loading.tokenizer import Tokenizer
from fitserve.quant.hold import HeldTensor, held_format, hold

_DTYPE_NAMES = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}


def spec_from_folder(folder: Path) -> ModelSpec:
    """The engine's :class:`ModelSpec` of an HF folder: the torch-free reader the planner also
    uses (``hf_config.spec_from_hf_folder``), in its strict mode."""
    return spec_from_hf_folder(folder, require_supported=True)


def safetensors_files(folder: Path) -> list[Path]:
    """The weight files of a folder: from ``model.safetensors.index.json`` if present."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
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


def read_safetensors(files: list[Path], dtype: torch.dtype,
                     weights: str | None = None
                     ) -> tuple[dict[str, HeldTensor], str, dict[str, str]]:
    """Read all tensors converted to ``dtype``; also name the dominant stored dtype, and each
    tensor's stored dtype (name -> "bf16", "f32" ...).

    ``weights``: a ``--weights`` choice ("int4"/"int8": RTN-pack each tensor as it is read,
    per ``fitserve.quant.hold.held_format``), or None for plain ``dtype`` tensors.
    """
    out: dict[str, HeldTensor] = {}
    stored_as: dict[str, str] = {}
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
                    stored_as[name] = _DTYPE_NAMES[tensor.dtype]
                    if weights is None:
                        out[name] = tensor.to(dtype)
                    else:
                        out[name] = hold(tensor, held_format(weights, name, tensor.dim(),
                                                             stored_as[name], dtype))
        except (SafetensorError, OSError) as exc:
            raise ModelLoadError(f"{path}: corrupt or unreadable safetensors file: {exc}") from exc
    return out, (stored.most_common(1)[0][0] if stored else "f32"), stored_as


def read_hf_folder(
    folder: Path, dtype: torch.dtype = torch.float32, weights: str | None = None
) -> tuple[ModelSpec, dict[str, HeldTensor], Tokenizer, str, dict[str, str]]:
    """Everything an HF folder holds: (spec, weights, tokenizer, dominant stored dtype, each
    tensor's stored dtype); ``weights`` as in :func:`read_safetensors`."""
    if not folder.is_dir():
        raise ModelLoadError(f"{folder}: no such folder")
    spec = spec_from_folder(folder)
    tokenizer = Tokenizer.from_folder(
        folder, eos_token_ids=spec.eos_token_ids, bos_token_id=spec.bos_token_id
    )
    if not spec.eos_token_ids and tokenizer.eos_token_ids:
        spec = replace(spec, eos_token_ids=tokenizer.eos_token_ids)
    held, fmt, stored = read_safetensors(safetensors_files(folder), dtype, weights)
    check_weights(held, spec, folder)
    return spec, held, tokenizer, fmt, stored
