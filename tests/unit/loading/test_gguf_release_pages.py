"""Loading a GGUF drops each tensor's mapped file pages once its bytes are copied out, so the
file is not resident twice (its pages beside the held copy) at the load's peak."""

from __future__ import annotations

import mmap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from fitserve.loading import gguf as gguf_loader
from fitserve.loading.gguf import read_gguf_weights
from fitserve.loading.gguf_spec import header_from_reader, open_gguf, spec_from_gguf_header
from tests.tiny_gguf import TinyGGUF, write_tiny_gguf

SMAPS = Path("/proc/self/smaps")
pytestmark = pytest.mark.skipif(not SMAPS.exists() or not hasattr(mmap, "MADV_DONTNEED"),
                                reason="needs Linux's /proc/self/smaps and madvise")


def mapped_rss(path: Path) -> int:
    """Resident bytes of this process's mappings of ``path`` (from /proc/self/smaps)."""
    total, inside = 0, False
    for line in SMAPS.read_text().splitlines():
        head = line.split()
        if head and "-" in head[0] and len(head) >= 5 and ":" not in head[0]:
            inside = len(head) >= 6 and head[5] == str(path)
        elif inside and line.startswith("Rss:"):
            total += int(head[1]) * 1024
    return total


def test_tensor_pages_are_released_and_nothing_is_lost(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_tiny_gguf(tmp_path / "m.gguf", TinyGGUF(hidden=256, ff=512, layers=3,
                                                          qtype=Q.Q8_0,
                                                          types={"ffn_down": Q.Q4_K}))
    reader = open_gguf(path)
    spec = spec_from_gguf_header(header_from_reader(reader, path), require_supported=True)
    data_bytes = sum(int(t.n_bytes) for t in reader.tensors)
    # the file's resident pages each time the loader copies a Q4_K tensor out (its peak)
    during: list[int] = []
    real = gguf_loader.ggml_from_gguf

    def spy(*args: Any, **kwargs: Any) -> Any:
        during.append(mapped_rss(path))
        return real(*args, **kwargs)

    monkeypatch.setattr(gguf_loader, "ggml_from_gguf", spy)
    held, _, stored = read_gguf_weights(reader, spec, path, torch.bfloat16, "as-stored")
    assert set(stored.values()) >= {"Q8_0", "Q4_K"} and len(during) == 3
    # held without the release, the last copy would find the tensors before it resident
    # (> 2/3 of the data); with it, about one tensor and the fault-around window
    assert max(during) < data_bytes / 3, (during, data_bytes)
    assert mapped_rss(path) <= 2 * mmap.PAGESIZE  # after the load: nothing of the file
    # the released pages come back from the file unchanged: the held blocks equal them
    t = next(t for t in reader.tensors if t.name == "blk.2.ffn_down.weight")
    blocks = held["model.layers.2.mlp.down_proj.weight"].blocks  # type: ignore[union-attr]
    assert np.array_equal(blocks.numpy().reshape(-1), np.asarray(t.data).reshape(-1))
