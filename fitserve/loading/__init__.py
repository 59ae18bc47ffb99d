"""Model files in: GGUF files, Hugging Face folders, and the pulled default model.

    loaded = load_model("smollm2-135m")          # or a .gguf path, or an HF folder
    loaded.spec, loaded.weights["model.embed_tokens.weight"], loaded.tokenizer.encode("hi")

Weights use Hugging Face parameter names whatever the file format, as float tensors of the
requested dtype (GGUF tensors are dequantized, and llama.cpp's Q/K row permutation undone).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from fitserve.config import ModelSpec
from fitserve.loading.chat_template import ChatTemplateError
from fitserve.loading.errors import (
    MissingTensorError,
    ModelLoadError,
    UnsupportedArchitectureError,
    UnsupportedTensorTypeError,
)
from fitserve.loading.gguf import SUPPORTED_GGUF_TYPES, read_gguf, read_gguf_tokenizer
from fitserve.loading.hf_config import expected_weight_shapes, spec_from_hf_config
from fitserve.loading.pull import DEFAULT_MODEL, KNOWN_MODELS, fitserve_home, pull
from fitserve.loading.safetensors import read_hf_folder, spec_from_folder
from fitserve.loading.tokenizer import IncrementalDetokenizer, Tokenizer

__all__ = [
    "DEFAULT_MODEL",
    "KNOWN_MODELS",
    "SUPPORTED_GGUF_TYPES",
    "ChatTemplateError",
    "IncrementalDetokenizer",
    "LoadedModel",
    "MissingTensorError",
    "ModelLoadError",
    "Tokenizer",
    "UnsupportedArchitectureError",
    "UnsupportedTensorTypeError",
    "expected_weight_shapes",
    "fitserve_home",
    "load_model",
    "load_tokenizer",
    "pull",
    "resolve_model_path",
    "spec_from_hf_config",
]


@dataclass(slots=True)
class LoadedModel:
    """A model read from disk: its spec, HF-named weights, tokenizer and where it came from."""

    spec: ModelSpec
    weights: dict[str, torch.Tensor]
    tokenizer: Tokenizer
    path: Path
    file_format: str  # "gguf" | "safetensors"
    weight_format: str  # dominant stored type: "Q4_1", "F16"... (GGUF) or "bf16", "f32"...


def resolve_model_path(model: str | Path) -> Path:
    """A .gguf file or HF folder for ``model``: an existing path, or a known name (pulled)."""
    path = Path(model).expanduser()
    if path.exists():
        if path.is_dir() and not (path / "config.json").is_file():
            ggufs = sorted(path.glob("*.gguf"))
            if len(ggufs) == 1:
                return ggufs[0]
            raise ModelLoadError(
                f"{path}: folder has no config.json"
                + (f" and {len(ggufs)} .gguf files; name one" if ggufs else " and no .gguf file")
            )
        return path
    if isinstance(model, str) and model in KNOWN_MODELS:
        return pull(model)
    raise ModelLoadError(
        f"{model}: no such file or folder, and not a known model name "
        f"(known: {', '.join(KNOWN_MODELS)})"
    )


def load_model(model: str | Path, dtype: torch.dtype = torch.float32) -> LoadedModel:
    """Load a model from a .gguf file, an HF folder, or a known name like ``"smollm2-135m"``.

    Raises :class:`ModelLoadError` (naming the file and the problem) on any bad input.
    """
    path = resolve_model_path(model)
    if path.is_dir():
        spec, weights, tok, fmt = read_hf_folder(path, dtype)
        return LoadedModel(spec, weights, tok, path, "safetensors", fmt)
    with open(path, "rb") as fh:
        magic = fh.read(4)
    if path.suffix == ".gguf" or magic == b"GGUF":
        spec, weights, tok, fmt = read_gguf(path, dtype)
        return LoadedModel(spec, weights, tok, path, "gguf", fmt)
    if path.name == "config.json":
        return load_model(path.parent, dtype)
    raise ModelLoadError(f"{path}: not a GGUF file or an HF model folder (starts with {magic!r})")


def load_tokenizer(model: str | Path) -> Tokenizer:
    """Only the tokenizer (and chat template) of ``model``, without reading any weights."""
    path = resolve_model_path(model)
    if path.is_dir():
        spec = spec_from_folder(path)
        return Tokenizer.from_folder(
            path, eos_token_ids=spec.eos_token_ids, bos_token_id=spec.bos_token_id
        )
    return read_gguf_tokenizer(path)
