"""Resolve an EngineConfig's "auto" values and size the KV pool through the planner's ledger.

The KV pool is sized by the same functions `fitserve plan` prints: ``cpu_engine_memory_plan``
on a CPU (a fixed budget, default ``DEFAULT_CPU_KV_BYTES``) and ``engine_memory_plan`` on CUDA
(what total x utilization leaves after weights, activations, logits, workspace and whatever is
already in use on the device). The engine never carries a rule of its own.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from fitserve.config import EngineConfig, ModelSpec
from fitserve.ledger.memory import (
    DEFAULT_CPU_KV_BYTES,
    DEFAULT_GPU_WORKSPACE_BYTES,
    EngineMemoryPlan,
    cpu_engine_memory_plan,
    engine_memory_plan,
)
from fitserve.runner.placement import dtype_name

log = logging.getLogger("fitserve.engine")

__all__ = [
    "DEFAULT_CPU_KV_BYTES",
    "KVPoolSize",
    "check_pool_fits",
    "size_kv_pool",
]

@dataclass(frozen=True, slots=True)
class KVPoolSize:
    """The KV pool the engine allocates, and the ledger it was sized from."""

    num_blocks: int
    block_size: int
    bytes_per_token: int
    budget_bytes: int | None  # the KV budget the blocks were cut from (None: blocks given)
    block_bytes: int = 0  # bytes of one block, all layers, K and V
    memory_plan: EngineMemoryPlan | None = None  # every line, as `fitserve plan` prints it

    @property
    def allocated_bytes(self) -> int:
        """What the runner's KV tensors take: num_blocks x block_bytes (a hybrid model: every
        layer group's pool, ``EngineMemoryPlan.kv_allocated_bytes``)."""
        plan = self.memory_plan
        if plan is not None and len(plan.kv_groups) > 1:
            return plan.kv_allocated_bytes
        return self.num_blocks * self.block_bytes


def engine_kv_format(cfg: EngineConfig, dtype: torch.dtype) -> str:
    """The KV format (a ``plan.formats.KV_FORMATS`` name) the engine runs: the model dtype's,
    or a quantized one from ``kv_cache_dtype`` / ``kv_cache_scales`` (ValueError if bad)."""
    from fitserve.ledger.errors import PlanError
    from fitserve.ledger.formats import resolve_engine_kv_format

    try:
        return resolve_engine_kv_format(cfg.cache.kv_cache_dtype, cfg.cache.kv_cache_scales, dtype_name(dtype))
    except PlanError as exc:
        raise ValueError(str(exc)) from exc


def size_kv_pool(
    cfg: EngineConfig, spec: ModelSpec, kv_dtype: torch.dtype, device: torch.device, weight_bytes: int,
    output_staging: bool = False,
) -> KVPoolSize:
    """Number of KV blocks, from the same ledger functions `fitserve plan` prints
    (``output_staging``: the model runs projections through the ggml block kernels)."""
    kv_name = engine_kv_format(cfg, kv_dtype)
    act_bytes = torch.finfo(kv_dtype).bits // 8
    cache, sched = cfg.cache, cfg.scheduler
    plan: EngineMemoryPlan
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        # NOTE: the weights are already on the device, so "in use" excludes them.
        plan = engine_memory_plan(
            spec, weight_bytes=weight_bytes, total_memory_bytes=total,
            memory_utilization=cache.gpu_memory_utilization,
            max_num_batched_tokens=sched.max_num_batched_tokens, max_num_seqs=sched.max_num_seqs,
            block_size=cache.block_size, kv_dtype=kv_name, act_dtype_bytes=act_bytes,
            workspace_bytes=DEFAULT_GPU_WORKSPACE_BYTES,
            kv_cache_memory_bytes=cache.kv_cache_memory_bytes, kv_blocks=cache.num_kv_blocks,
            in_use_bytes=max(0, total - free - weight_bytes))
    else:
        from fitserve.kernels.cpu.paged_attention import paged_attention_available

        # NOTE: the engine's max_model_len (check_max_model_len: the requested value, else the
        # model's max_position_embeddings) sizes the RoPE tables and the attention scratch;
        # whether decode runs the fused C++ kernel or gathers K/V is the runner's own test.
        def cpu_plan(kv_bytes: int | None, kv_blocks: int | None) -> EngineMemoryPlan:
            return cpu_engine_memory_plan(
                spec, weight_bytes=weight_bytes, max_num_batched_tokens=sched.max_num_batched_tokens,
                max_num_seqs=sched.max_num_seqs, block_size=cache.block_size, kv_dtype=kv_name,
                act_dtype_bytes=act_bytes, kv_cache_memory_bytes=kv_bytes, kv_blocks=kv_blocks,
                max_model_len=cfg.max_model_len or spec.max_position_embeddings,
                fused_decode=paged_attention_available(), output_staging=output_staging)

        kv_bytes = cache.kv_cache_memory_bytes
        if cache.host_memory_utilization is not None and kv_bytes is None and cache.num_kv_blocks is None:
            kv_bytes = host_kv_budget(cache.host_memory_utilization, cpu_plan(None, 1))
        plan = cpu_plan(kv_bytes, cache.num_kv_blocks)
    budget = None if cache.num_kv_blocks is not None else plan.kv_pool_bytes
    return KVPoolSize(plan.num_kv_blocks, cache.block_size, plan.kv_bytes_per_token, budget,
                      plan.block_bytes, plan)


def available_host_bytes() -> int:
    """RAM available for new allocations now (Linux's MemAvailable; else torch's view of the total)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import os

    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"))


def host_kv_budget(fraction: float, one_block: EngineMemoryPlan, available: int | None = None) -> int:
    """vLLM's --gpu-memory-utilization read on a CPU: the engine may hold ``fraction`` of the RAM
    available at start-up; the KV pool is that less what the ledger reserves besides it (runtime,
    weights, RoPE tables and the step peak, from a one-block plan). ValueError if nothing is left."""
    avail = available_host_bytes() if available is None else available
    total = int(fraction * avail)
    others = one_block.resident_bytes + one_block.step_bytes
    kv = total - others
    log.info("--gpu-memory-utilization %.2f on CPU: %.2f GiB of %.2f GiB available; weights, runtime and step "
             "scratch take %.2f GiB, the KV pool gets %.2f GiB", fraction, total / 2**30, avail / 2**30,
             others / 2**30, max(kv, 0) / 2**30)
    if kv < one_block.block_bytes:
        raise ValueError(f"--gpu-memory-utilization {fraction}: {fraction} x {avail / 2**30:.2f} GiB available "
                         f"RAM = {total / 2**30:.2f} GiB leaves no room for KV blocks after the "
                         f"{others / 2**30:.2f} GiB the weights and step scratch need: raise it, or give "
                         "--kv-cache-memory")
    return kv


def check_pool_fits(pool: KVPoolSize, max_model_len: int, max_chunk: int | None = None) -> None:
    """Fail at start-up, naming the knobs, when one max_model_len request cannot fit (a windowed
    layer group needs only its window and one step's chunk of at most ``max_chunk`` tokens, as
    the scheduler admits it)."""
    from fitserve.ledger.kv import window_span_blocks

    capacity = pool.num_blocks * pool.block_size
    groups = pool.memory_plan.kv_groups if pool.memory_plan is not None else ()
    if groups and max_chunk is not None:
        whole = -(-max_model_len // pool.block_size)
        need = [whole if g.window is None else min(whole, window_span_blocks(
            g.window, pool.block_size, min(max_model_len, max_chunk))) for g in groups]
        if all(g.usable_blocks >= n for g, n in zip(groups, need, strict=True)):
            return
    elif capacity >= max_model_len:
        return
    need_blocks = -(-max_model_len // pool.block_size)
    need_bytes = need_blocks * (pool.block_bytes or pool.block_size * pool.bytes_per_token)
    raise ValueError(
        f"the KV cache holds {pool.num_blocks} blocks x {pool.block_size} tokens = {capacity} tokens, "
        f"too few for one request of max_model_len={max_model_len}: raise the KV cache memory "
        f"(--kv-cache-memory / kv_cache_memory_bytes; at least {need_bytes} bytes) or lower "
        f"--max-model-len to at most {capacity}"
    )


