"""The tiny models' weights are seeded the same way in every process (whatever PYTHONHASHSEED)."""

from __future__ import annotations

import os
import subprocess
import sys
import zlib

from .tiny_models import tiny_seed

ARCHS = ("llama", "mistral", "qwen2", "qwen3")


def test_seed_does_not_depend_on_the_hash_seed() -> None:
    code = ("from tests.numerics.tiny_models import tiny_seed; "
            f"print([tiny_seed(a) for a in {ARCHS!r}])")
    outs = {
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                       env={**os.environ, "PYTHONHASHSEED": hs}).stdout.strip()
        for hs in ("1", "2")
    }
    assert outs == {str([zlib.crc32(a.encode()) for a in ARCHS])}
    assert len({tiny_seed(a) for a in ARCHS}) == len(ARCHS)  # and each architecture its own
