"""Test helper: copy a GGUF file with extra metadata keys, tensors byte for byte (gguf's own tool)."""

from __future__ import annotations

from pathlib import Path

import gguf
from gguf.scripts.gguf_new_metadata import MetadataDetails, copy_with_new_metadata


def copy_gguf_with_sampling(src: Path, dst: Path, **sampling: float | int) -> Path:
    """``src`` plus ``general.sampling.<key>`` = value (float32, or int32 for ints, as GGUFWriter.add_sampling_* write them), at ``dst``.

    Keys are gguf's own names (``temp``, ``top_k``, ``top_p``, ``min_p``, ``penalty_repeat``),
    so the file is what llama.cpp's converter would write for those defaults.
    """
    reader = gguf.GGUFReader(str(src), "r")
    arch = reader.get_field(gguf.Keys.General.ARCHITECTURE)
    assert arch is not None
    new: dict[str, MetadataDetails] = {}
    for key, value in sampling.items():
        vtype = gguf.GGUFValueType.INT32 if isinstance(value, int) else gguf.GGUFValueType.FLOAT32
        new[f"general.sampling.{key}"] = MetadataDetails(vtype, value)
    writer = gguf.GGUFWriter(str(dst), arch=str(arch.contents()), endianess=reader.endianess)
    copy_with_new_metadata(reader, writer, new, [])
    return dst
