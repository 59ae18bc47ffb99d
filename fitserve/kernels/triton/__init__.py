"""Triton versions of the forward and split-KV (paged) decode kernels.

On CUDA they compile for the GPU; on a CPU-only machine they run under the Triton interpreter
(``TRITON_INTERPRET=1`` must be set before this package is imported, since ``@triton.jit``
decides at decoration time). Import :mod:`fitserve.kernels.triton.forward` or
:mod:`fitserve.kernels.triton.decode` only after checking :func:`triton_available`.
"""

from __future__ import annotations

import importlib.util
import os


def triton_available() -> bool:
    """True when the ``triton`` package can be imported."""
    return importlib.util.find_spec("triton") is not None


def interpreter_enabled() -> bool:
    """True when Triton kernels will run in the CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0", "false", "False")
