"""--gpu-memory-utilization on a CPU: the engine's whole budget is that share of the available
RAM, and the KV pool gets exactly what the ledger's other lines leave of it."""

from __future__ import annotations

import dataclasses

import pytest

from fitserve.config import EngineConfig, ModelSpec
from fitserve.engine.sizing import available_host_bytes, host_kv_budget, size_kv_pool
from fitserve.ledger.memory import cpu_engine_memory_plan

SMOL = ModelSpec("llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                 num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, max_position_embeddings=2048,
                 name="SmolLM2")
WEIGHTS = 100 << 20
GIB = 1 << 30


def one_block_plan():  # type: ignore[no-untyped-def]
    return cpu_engine_memory_plan(SMOL, weight_bytes=WEIGHTS, max_num_batched_tokens=2048, max_num_seqs=64,
                                  block_size=16, kv_dtype="bf16", act_dtype_bytes=2, kv_blocks=1,
                                  max_model_len=2048)


def test_kv_budget_is_the_share_less_the_other_lines() -> None:
    plan = one_block_plan()
    kv = host_kv_budget(0.5, plan, available=8 * GIB)
    assert kv == 4 * GIB - plan.resident_bytes - plan.step_bytes
    # the ledger's peak with that pool is within one block of the share
    full = cpu_engine_memory_plan(SMOL, weight_bytes=WEIGHTS, max_num_batched_tokens=2048, max_num_seqs=64,
                                  block_size=16, kv_dtype="bf16", act_dtype_bytes=2, kv_cache_memory_bytes=kv,
                                  max_model_len=2048)
    assert 4 * GIB - full.block_bytes <= full.peak_bytes <= 4 * GIB + (full.step_bytes - plan.step_bytes)
    with pytest.raises(ValueError, match="--gpu-memory-utilization"):
        host_kv_budget(0.01, plan, available=GIB)


def test_engine_sizing_reads_it_on_cpu_only_when_given() -> None:
    import torch

    cfg = EngineConfig(model="x", dtype="bfloat16", device="cpu", max_model_len=2048)
    default = size_kv_pool(cfg, SMOL, torch.bfloat16, torch.device("cpu"), WEIGHTS)
    frac = dataclasses.replace(cfg, cache=dataclasses.replace(cfg.cache, host_memory_utilization=0.25))
    pool = size_kv_pool(frac, SMOL, torch.bfloat16, torch.device("cpu"), WEIGHTS)
    share = 0.25 * available_host_bytes()
    assert default.budget_bytes == 1 << 30  # the fixed default when the flag is absent
    assert pool.budget_bytes is not None and abs(pool.budget_bytes - share) < 0.05 * share + 256 * (1 << 20)
