"""Model files in: GGUF files, Hugging Face folders, and the pulled default model.

    loaded = load_model("smollm2-135m")          # or a .gguf path, or an HF folder
    loaded.spec, loaded.weights["model.embed_tokens.weight"], loaded.tokenizer.encode("hi")

Weights use Hugging Face parameter names whatever the file format, as float tensors of the
requested dtype (GGUF tensors are dequantized, and llama.cpp's Q/K row permutation undone);
``load_model(..., weights="as-stored" | "int4" | "int8")`` holds some as
``fitserve.quant.PackedWeight`` instead (GGUF Q4_0/Q4_1/Q8_0 as stored, or RTN at load).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fitserve.config import ModelSpec
from fitserve.loading.errors import (
    MissingTensorError,
    ModelLoadError,
    UnsupportedArchitectureError,
    UnsupportedTensorTypeError,
)
from fitserve.loading.generation_defaults import GenerationDefaults, read_generation_defaults
from fitserve.loading.hf_config import expected_weight_shapes, spec_from_hf_config

if TYPE_CHECKING:
    import torch

    from fitserve.loading.chat_template import ChatTemplateError
    from fitserve.loading.gguf import SUPPORTED_GGUF_TYPES
    from fitserve.loading.pull import DEFAULT_MODEL, KNOWN_MODELS, pull
    from fitserve.loading.tokenizer import IncrementalDetokenizer, Tokenizer

# NOTE: PEP 562 lazy names. Importing a torch-free reader (fitserve.loading.hf_config,
# fitserve.loading.gguf_spec) runs this package's __init__ first; the planner does that, and
# it must not pull in torch (gguf.py, safetensors.py) nor tokenizers/jinja2/tqdm. The names
# below resolve on first use: ``from fitserve.loading import load_model, Tokenizer`` works.
_LAZY: dict[str, str] = {
    "SUPPORTED_GGUF_TYPES": "fitserve.loading.gguf",
    "ChatTemplateError": "fitserve.loading.chat_template",
    "DEFAULT_MODEL": "fitserve.loading.pull",
    "KNOWN_MODELS": "fitserve.loading.pull",
    "pull": "fitserve.loading.pull",
    "IncrementalDetokenizer": "fitserve.loading.tokenizer",
    "Tokenizer": "fitserve.loading.tokenizer",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'fitserve.loading' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


__all__ = [
    "DEFAULT_MODEL",
    "KNOWN_MODELS",
    "SUPPORTED_GGUF_TYPES",
    "ChatTemplateError",
    "GenerationDefaults",
    "IncrementalDetokenizer",
    "LoadedModel",
    "MissingTensorError",
    "ModelLoadError",
    "Tokenizer",
    "UnsupportedArchitectureError",
    "UnsupportedTensorTypeError",
    "expected_weight_shapes",
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
    # torch.Tensor, or fitserve.quant.PackedWeight for weights held packed (see ``weights``)
    weights: dict[str, Any]
    tokenizer: Tokenizer
    path: Path
    file_format: str  # "gguf" | "safetensors"
    weight_format: str  # dominant stored type: "Q4_1", "F16"... (GGUF) or "bf16", "f32"...
    # sampling defaults the file recommends (generation_config.json / GGUF general.sampling.*)
    generation_defaults: GenerationDefaults = field(default_factory=GenerationDefaults)
    # each tensor's stored type (HF name -> "Q4_1", "F32", "bf16" ...) and the resolved
    # --weights choice it was loaded with (None: every tensor dense in the load dtype)
    stored_formats: dict[str, str] = field(default_factory=dict)
    weights_choice: str | None = None


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
    from fitserve.loading.pull import KNOWN_MODELS, pull

    if isinstance(model, str) and model in KNOWN_MODELS:
        return pull(model)
    raise ModelLoadError(
        f"{model}: no such file or folder, and not a known model name "
        f"(known: {', '.join(KNOWN_MODELS)})"
    )


def load_model(model: str | Path, dtype: torch.dtype | None = None,
               weights: str | None = None) -> LoadedModel:
    """Load a model from a .gguf file, an HF folder, or a known name like ``"smollm2-135m"``.

    ``dtype`` (default float32) is what every weight is converted to; ``weights`` a resolved
    ``--weights`` choice ("as-stored", "int4", "int8", see ``plan.formats.
    resolve_engine_weights``) holds tensors packed as that choice says (PackedWeight values).
    Raises :class:`ModelLoadError` (naming the file and the problem) on any bad input.
    """
    import torch

    from fitserve.loading.gguf import read_gguf
    from fitserve.loading.safetensors import read_hf_folder

    dtype = torch.float32 if dtype is None else dtype
    path = resolve_model_path(model)
    if path.is_dir():
        spec, held, tok, fmt, stored = read_hf_folder(path, dtype, weights)
        return LoadedModel(spec, held, tok, path, "safetensors", fmt,
                           read_generation_defaults(path), stored, weights)
    with open(path, "rb") as fh:
        magic = fh.read(4)
    if path.suffix == ".gguf" or magic == b"GGUF":
        spec, held, tok, fmt, gen, stored = read_gguf(path, dtype, weights)
        return LoadedModel(spec, held, tok, path, "gguf", fmt, gen, stored, weights)
    if path.name == "config.json":
        return load_model(path.parent, dtype, weights)
    raise ModelLoadError(f"{path}: not a GGUF file or an HF model folder (starts with {magic!r})")


def load_tokenizer(model: str | Path) -> Tokenizer:
    """Only the tokenizer (and chat template) of ``model``, without reading any weights."""
    from fitserve.loading.gguf import read_gguf_tokenizer
    from fitserve.loading.safetensors import spec_from_folder
    from fitserve.loading.tokenizer import Tokenizer

    path = resolve_model_path(model)
    if path.is_dir():
        spec = spec_from_folder(path)
        return Tokenizer.from_folder(
            path, eos_token_ids=spec.eos_token_ids, bos_token_id=spec.bos_token_id
        )
    return read_gguf_tokenizer(path)
