"""Hugging Face model folders: config.json + *.safetensors (sharded too) + tokenizer files.

A `fitserve quantize` checkpoint is such a folder whose config.json names packed tensors
(``quantization_config.formats``); their ``.qweight/.scales/.mins`` come back as the
PackedWeights that were written (``fitserve.loading.checkpoint``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from fitserve.config import ModelSpec
from fitserve.loading.checkpoint import PARTS, join_packed, prefix_of
from fitserve.loading.errors import ModelLoadError
from fitserve.loading.fused_weights import split_fused
from fitserve.loading.hf_config import (
    check_weights,
    expected_weight_shapes,
    packed_formats,
    read_json,
    spec_from_hf_folder,
)
from fitserve.loading.mxfp4 import Mxfp4Experts
from fitserve.loading.prequant import PrequantPieces, rehold
from fitserve.loading.tokenizer import Tokenizer
from fitserve.quant.convert import held_format, hold
from fitserve.quant.held import HeldTensor

# a packed tensor of a checkpoint: (its format, its logical shape (N, K))
PackedEntry = tuple[str, tuple[int, int]]

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
                     weights: str | None = None, *, packed: Mapping[str, PackedEntry] | None = None,
                     spec: ModelSpec | None = None, prequant: PrequantPieces | None = None
                     ) -> tuple[dict[str, HeldTensor], str, dict[str, str]]:
    """Read all tensors converted to ``dtype``; also name the dominant stored format, and each
    tensor's stored format (name -> "bf16", "f32", "int4-g32-asym" ...).

    ``weights``: a ``--weights`` choice ("int4"/"int8": RTN-pack each tensor as it is read,
    per ``fitserve.quant.convert.held_format``), or None for plain ``dtype`` tensors.
    ``packed``: the packed tensors of a `fitserve quantize` checkpoint (HF name -> (format,
    (N, K)), see ``fitserve.loading.checkpoint``): their ``<prefix>.qweight/.scales/.mins`` are
    joined into a PackedWeight, held as it is when the choice's format is the stored one
    ("as-stored", or "int4"/"int8" whose RTN format it is), else dequantized (then cast, or
    RTN-packed into the choice's format). ``spec``: a fused tensor of its architecture (Phi-3's
    qkv_proj, gate_up_proj) is split into the engine's names first (fitserve.loading.fused_weights).
    ``prequant``: a compressed-tensors / GPTQ / AWQ checkpoint's quantized weights, gathered and
    held as stored (``fitserve.loading.prequant``), or re-held by ``weights`` as above.
    """
    packed = packed or {}
    parts = {prefix_of(name): name for name in packed}
    pieces: dict[str, dict[str, torch.Tensor]] = {name: {} for name in packed}
    out: dict[str, HeldTensor] = {}
    stored_as: dict[str, str] = {}
    stored: Counter[str] = Counter()
    # gpt-oss's MXFP4 experts (*_blocks / *_scales pairs), held once both halves are read
    mxfp4 = Mxfp4Experts(spec) if spec is not None and spec.architecture == "gpt_oss" else None
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as fh:
                for name in fh.keys():  # noqa: SIM118 (safe_open has no __iter__)
                    prefix, _, part = name.rpartition(".")
                    if prequant is not None and prequant.takes(prefix, part):
                        prequant.pieces.setdefault(prefix, {})[part] = fh.get_tensor(name)
                        continue
                    if mxfp4 is not None and mxfp4.takes(name):
                        mxfp4.add(name, fh.get_tensor(name))
                        continue
                    if part in PARTS and prefix in parts:
                        pieces[parts[prefix]][part] = fh.get_tensor(name)
                        continue
                    tensor = fh.get_tensor(name)
                    if tensor.dtype not in _DTYPE_NAMES and part in PARTS:
                        raise ModelLoadError(
                            f"{path}: tensor {name!r} is a packed part, but config.json's "
                            f"quantization_config.formats does not name {prefix}.weight")
                    if tensor.dtype not in _DTYPE_NAMES:
                        raise ModelLoadError(
                            f"{path}: tensor {name!r} has unsupported type {tensor.dtype}; "
                            f"supported: {', '.join(_DTYPE_NAMES.values())}"
                        )
                    if tensor.dim() >= 2:
                        stored[_DTYPE_NAMES[tensor.dtype]] += tensor.numel()
                    split = [(name, tensor)] if spec is None else _split(spec, name, tensor, path)
                    for part, t in split:
                        stored_as[part] = _DTYPE_NAMES[t.dtype]
                        if weights is None:
                            out[part] = t.to(dtype)
                        else:
                            out[part] = hold(t.contiguous(), held_format(
                                weights, part, t.dim(), stored_as[part], dtype))
        except (SafetensorError, OSError) as exc:
            raise ModelLoadError(f"{path}: corrupt or unreadable safetensors file: {exc}") from exc
    source = files[0].parent if files else Path(".")
    for name, (fmt, shape) in packed.items():
        if name in out:
            raise ModelLoadError(f"{source}: tensor {name!r} is stored both dense and packed "
                                 f"({fmt})")
        out[name] = _held_packed(name, fmt, shape, pieces[name], dtype, weights, source)
        stored_as[name] = fmt
        stored[fmt] += shape[0] * shape[1]
    if prequant is not None:
        prequant.hold_all(out, stored_as, stored, dtype, weights, source)
    if mxfp4 is not None:
        mxfp4.hold_all(out, stored_as, stored, dtype, weights, source)
    return out, (stored.most_common(1)[0][0] if stored else "f32"), stored_as


def _split(spec: ModelSpec, name: str, tensor: torch.Tensor, path: Path
           ) -> list[tuple[str, torch.Tensor]]:
    try:
        return split_fused(spec, name, tensor)
    except ValueError as exc:
        raise ModelLoadError(f"{path}: {exc}") from exc


def _held_packed(name: str, fmt: str, shape: tuple[int, int], pieces: dict[str, torch.Tensor],
                 dtype: torch.dtype, weights: str | None, source: Path) -> HeldTensor:
    """One packed tensor of a checkpoint, in the form ``weights`` holds it."""
    try:
        pw = join_packed(name, fmt, shape, pieces)
    except ValueError as exc:
        raise ModelLoadError(f"{source}: tensor {name!r} ({fmt}): {exc}") from exc
    return rehold(name, pw, dtype, weights)


def packed_entries(config_path: Path, spec: ModelSpec) -> dict[str, PackedEntry]:
    """The packed tensors a folder's config.json declares (``quantization_config.formats``),
    with their logical shapes from ``spec``; {} for a plain folder. ModelLoadError for a name
    the architecture has no 2-D weight of."""
    formats = packed_formats(read_json(config_path), config_path) or {}
    shapes = expected_weight_shapes(spec)
    out: dict[str, PackedEntry] = {}
    for name, fmt in formats.items():
        shape = shapes.get(name)
        if shape is None or len(shape) != 2:
            raise ModelLoadError(f"{config_path}: tensor {name!r} in quantization_config.formats "
                                 f"is not a weight matrix of this {spec.architecture} model")
        out[name] = (fmt, (shape[0], shape[1]))
    return out


def read_hf_folder(
    folder: Path, dtype: torch.dtype = torch.float32, weights: str | None = None
) -> tuple[ModelSpec, dict[str, HeldTensor], Tokenizer, str, dict[str, str]]:
    """Everything an HF folder holds: (spec, weights, tokenizer, dominant stored format, each
    tensor's stored format); ``weights`` as in :func:`read_safetensors`, which also reads a
    `fitserve quantize` checkpoint's packed tensors (``fitserve.loading.checkpoint``)."""
    if not folder.is_dir():
        raise ModelLoadError(f"{folder}: no such folder")
    spec = spec_from_folder(folder)
    tokenizer = Tokenizer.from_folder(
        folder, eos_token_ids=spec.eos_token_ids, bos_token_id=spec.bos_token_id
    )
    if not spec.eos_token_ids and tokenizer.eos_token_ids:
        spec = replace(spec, eos_token_ids=tokenizer.eos_token_ids)
    packed = packed_entries(folder / "config.json", spec)
    prequant = PrequantPieces.of_folder(folder / "config.json", spec)
    held, fmt, stored = read_safetensors(safetensors_files(folder), dtype, weights, packed=packed,
                                          spec=spec, prequant=prequant)
    check_weights(held, spec, folder)
    return spec, held, tokenizer, fmt, stored
