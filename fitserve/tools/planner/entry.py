"""A model to plan: its spec plus what the catalog or the file says about it (no I/O here)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from fitserve.config import ModelSpec


@dataclass(frozen=True)
class ModelEntry:
    """A model to plan: its spec plus what the catalog or file says about it."""

    spec: ModelSpec
    native_weights: str  # the format the published checkpoint ships in
    dtype: str  # activation dtype
    source: str
    published_params: float | None = None
    published_active_params: float | None = None
    file_weight_bytes: int | None = None  # GGUF: the file's own tensor bytes
    engine_file_format: str | None = None  # the file `fitserve pull` fetches for the engine
    # Hugging Face tensor name -> the format the file stores it in (GGUF: its ggml type), for
    # the engine's weights held as stored; None: not known (catalog entries, config.json).
    stored_formats: Mapping[str, str] | None = None
    # what fitserve's engine lacks to run this file (fitserve.loading.support: architecture,
    # tensor types, tokenizer); empty: it can, or not known (catalog entries)
    engine_refusal: tuple[str, ...] = ()
