"""A plan's model from a GGUF file's header: the engine's own header reader, no tensor data.

The spec comes from ``fitserve.loading.gguf_spec`` (the reader the engine's loader uses) in
its describing mode: any architecture, per-layer head counts as their maximum.
"""

from __future__ import annotations

from pathlib import Path

from fitserve.ledger.errors import PlanError
from fitserve.loading.errors import ModelLoadError
from fitserve.loading.gguf_spec import (
    read_gguf_header,
    spec_from_gguf_header,
    stored_types,
    unsupported_types,
)
from fitserve.loading.support import gguf_support
from fitserve.tools.planner.entry import ModelEntry


def gguf_entry(path: Path) -> ModelEntry:
    """Read the architecture facts, tensor types and the file's weight bytes from a header."""
    if not path.is_file():
        raise PlanError(f"no such GGUF file: {path}")
    try:
        header = read_gguf_header(path)
        spec = spec_from_gguf_header(header, require_supported=False)
    except ModelLoadError as e:
        raise PlanError(str(e)) from e  # the message names the file
    by_type: dict[str, int] = {}
    for t in header.tensors:
        by_type[t.type_name] = by_type.get(t.type_name, 0) + t.n_bytes
    main = max(by_type, key=lambda k: by_type[k]) if by_type else "F32"
    types = ", ".join(f"{k} {v:,} B" for k, v in sorted(by_type.items(), key=lambda kv: -kv[1]))
    source = f"{path} (tensors: {types})"
    refused = sorted(set(unsupported_types(header).values()))
    if refused:  # the loader's own list (SUPPORTED_GGUF_TYPES: what gguf-py dequantizes)
        source += f"; fitserve's engine cannot load tensors of type {', '.join(refused)}"
    per_layer = [k for k in ("attention.head_count_kv", "attention.head_count",
                             "feed_forward_length")
                 if isinstance(header.fields.get(f"{header.fields.get('general.architecture')}.{k}"),
                               list)]
    if per_layer:
        # NOTE: the engine refuses per-layer values that differ; the plan takes the largest.
        source += f"; per-layer {', '.join(per_layer)} planned at their maximum (an upper bound)"
    # NOTE: the GPU weights line uses the file's own bytes; main_type only names the format.
    return ModelEntry(spec, f"gguf-file:{main}", "f32", source,
                      file_weight_bytes=header.file_weight_bytes,
                      stored_formats=stored_types(header),
                      engine_refusal=gguf_support(header).missing)
