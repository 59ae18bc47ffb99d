"""Where and how wide the model runs: the config's device and dtype resolved against this machine,
its context length checked against the model, and host memory handed back after loading.

Rank 0 (fitserve.engine.builder) and every tensor-parallel worker (fitserve.dist.worker) resolve
them with these same functions, so the ranks cannot disagree.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
from typing import Any

import torch

from fitserve import envs
from fitserve.config import ModelSpec
from fitserve.ledger.hardware import cpu_engine_dtype

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "f32": torch.float32, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was requested but CUDA is not available")
    if name.split(":")[0] not in ("cpu", "cuda"):
        raise ValueError(f"unknown device {name!r} (use cpu, cuda or auto)")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """"auto": bf16 on CUDA; on CPU the planner's ``cpu_engine_dtype`` (bf16 with AVX512-BF16 or
    AMX, else f32), so `fitserve plan --gpu cpu` and the engine cannot pick differently."""
    if name == "auto":
        if device.type == "cuda":
            return torch.bfloat16
        return _DTYPES[cpu_engine_dtype()]
    if name not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r} (use float32, bfloat16, float16 or auto)")
    return _DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    """The planner's name of a torch dtype: "f32", "bf16" or "f16"."""
    return {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}[dtype]


def check_max_model_len(requested: int | None, spec: ModelSpec) -> int:
    """``requested`` (None: the model's max_position_embeddings), refused past the trained length.

    The trained length is ``max_position_embeddings``, times the factor of linear RoPE scaling
    (as vLLM derives it; llama3 scaling already counts in max_position_embeddings). Longer is
    a ValueError unless ``FITSERVE_ALLOW_LONG_MAX_MODEL_LEN=1`` (vLLM's
    ``VLLM_ALLOW_LONG_MAX_MODEL_LEN``), which logs a warning instead.
    """
    if requested is None:
        return spec.max_position_embeddings
    trained, how = spec.max_position_embeddings, "max_position_embeddings"
    if spec.rope_scaling is not None and spec.rope_scaling.kind == "linear":
        trained = int(trained * spec.rope_scaling.factor)
        how += f" {spec.max_position_embeddings} x linear RoPE factor {spec.rope_scaling.factor:g}"
    if requested <= trained:
        return requested
    what = f"max_model_len={requested} is longer than the model's trained context ({trained} tokens, {how})"
    allow = envs.FITSERVE_ALLOW_LONG_MAX_MODEL_LEN
    if allow():
        logging.getLogger("fitserve.engine").warning(
            "%s (%s is set): positions past it were never trained; outputs may be wrong", what, allow.name)
        return requested
    raise ValueError(
        f"{what}; outputs past it degrade. Lower --max-model-len, or "
        f"set {allow.name}=1 to allow it anyway"
    )


def release_freed_host_memory() -> bool:
    """Return memory that the C allocator holds but no longer uses to the OS (glibc's
    ``malloc_trim(0)``); False where there is no glibc.

    NOTE: loading dequantizes every tensor through f32 scratch and keeps a second copy of the
    weights until the model has copied them; glibc keeps those freed chunks resident (they sit
    between live tensors on the heap), ~340 MiB for SmolLM2 in bf16. Trimming before the KV
    pool is allocated makes the process's peak RSS what the ledger says it is.
    """
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


@functools.cache
def _malloc_trim() -> Any:
    """glibc's malloc_trim, looked up once (find_library runs ldconfig: too slow per step)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        trim = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim
