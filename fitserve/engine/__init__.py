"""The engine: the core loop (core: add / abort / step / stats), the builder that loads, sizes
and wires its parts into one frozen record (builder), the ledger-backed sizing it uses (sizing:
device, dtype, KV pool, start-up checks), outputs (detokenize, stops), beams, the step-time
model's calibration, and the offline LLM."""

from __future__ import annotations

from typing import Any

__all__ = ["Engine"]


def __getattr__(name: str) -> Any:
    # NOTE: lazy, so importing a light submodule (outputs, sizing) does not load the core loop
    if name == "Engine":
        from fitserve.engine.core import Engine

        return Engine
    raise AttributeError(f"module 'fitserve.engine' has no attribute {name!r}")
