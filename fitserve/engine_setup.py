"""Resolve an EngineConfig's "auto" values and size the KV pool through the planner's ledger."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fitserve.config import EngineConfig, ModelSpec

DEFAULT_CPU_KV_BYTES = 1 << 30  # like vLLM's CPU backend: a fixed KV space (1 GiB here)

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was requested but CUDA is not available")
    if name.split(":")[0] not in ("cpu", "cuda"):
        raise ValueError(f"unknown device {name!r} (use cpu, cuda or auto)")
    return torch.device(name)


def cpu_has_fast_bf16() -> bool:
    """True where the CPU has native bf16 dot products (AVX512-BF16 or AMX)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        if device.type == "cuda":
            return torch.bfloat16
        return torch.bfloat16 if cpu_has_fast_bf16() else torch.float32
    if name not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r} (use float32, bfloat16, float16 or auto)")
    return _DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    return {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}[dtype]


@dataclass(frozen=True, slots=True)
class KVPoolSize:
    num_blocks: int
    block_size: int
    bytes_per_token: int
    budget_bytes: int | None


def size_kv_pool(
    cfg: EngineConfig, spec: ModelSpec, kv_dtype: torch.dtype, device: torch.device, weight_bytes: int
) -> KVPoolSize:
    """Number of KV blocks, from the same ledger functions `fitserve plan` prints."""
    from fitserve.plan.kv import kv_bytes_per_token
    from fitserve.plan.memory import num_kv_blocks

    kv_name = dtype_name(kv_dtype)
    per_token = kv_bytes_per_token(spec, kv_name)
    if cfg.num_kv_blocks is not None:
        return KVPoolSize(cfg.num_kv_blocks, cfg.block_size, per_token, None)
    budget = cfg.kv_cache_memory_bytes
    if budget is None:
        if device.type == "cuda":
            free, total = torch.cuda.mem_get_info(device)
            budget = int(total * cfg.gpu_memory_utilization) - weight_bytes - (total - free)
        else:
            budget = DEFAULT_CPU_KV_BYTES
    blocks = num_kv_blocks(max(budget, 0), spec, cfg.block_size, kv_name)
    return KVPoolSize(blocks, cfg.block_size, per_token, budget)


def check_pool_fits(pool: KVPoolSize, max_model_len: int) -> None:
    """Fail at start-up, naming the knobs, when one max_model_len request cannot fit."""
    capacity = pool.num_blocks * pool.block_size
    if capacity >= max_model_len:
        return
    need_blocks = -(-max_model_len // pool.block_size)
    need_bytes = need_blocks * pool.block_size * pool.bytes_per_token
    raise ValueError(
        f"the KV cache holds {pool.num_blocks} blocks x {pool.block_size} tokens = {capacity} tokens, "
        f"too few for one request of max_model_len={max_model_len}: raise the KV cache memory "
        f"(--kv-cache-memory / kv_cache_memory_bytes; at least {need_bytes} bytes) or lower "
        f"--max-model-len to at most {capacity}"
    )
