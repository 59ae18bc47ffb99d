"""The ledger's layer-group pools: the max-concurrency line equals what the KV manager admits,
and the per-request line equals the blocks the manager holds."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from fitserve.kv.group import KVGroup
from fitserve.kv.manager import KVCacheManager
from fitserve.ledger.kv import kv_block_bytes, request_kv
from fitserve.ledger.kv_groups import request_kv_held
from fitserve.ledger.memory import cpu_engine_memory_plan
from fitserve.tools.planner.report import PlanRequest
from fitserve.tools.planner.sections_run import build_plan
from tests.unit.kv.test_kv_groups import gemma3_like


def grow_to(kv: KVCacheManager, rid: str, context: int, chunk: int) -> bool:
    """Run a request's prompt in chunks, then one decode step at ``context``: False if it stops."""
    done = 0
    while done < context - 1:
        end = min(context - 1, done + chunk)
        if kv.allocate_slots(rid, done, end) is None:
            return False
        done = end
    return kv.allocate_slots(rid, done, context) is not None


def test_max_concurrency_at_32k_equals_what_the_manager_holds() -> None:
    spec = gemma3_like()
    bs, ctx, budget = 16, 32768, 2 << 30
    mp = cpu_engine_memory_plan(spec, weight_bytes=0, max_num_batched_tokens=2048, max_num_seqs=16,
                                block_size=bs, kv_dtype="bf16", act_dtype_bytes=2,
                                kv_cache_memory_bytes=budget, max_model_len=ctx, threads=1,
                                fused_decode=True)
    full, windowed = mp.kv_groups
    assert windowed.num_blocks == 16 * 34 + 128 + 1
    assert mp.kv_allocated_bytes == full.pool_bytes + windowed.pool_bytes <= budget
    ceiling = mp.max_concurrent_sequences(ctx)
    assert (ceiling.value, ceiling.limited_by) == (full.num_blocks // 2048, "kv_pool") == (14, "kv_pool")
    kv = KVCacheManager.from_groups([KVGroup(g.kind, g.num_blocks, g.window) for g in mp.kv_groups],
                                    bs, enable_caching=False)
    admitted = 0
    while grow_to(kv, f"r{admitted}", ctx, 2048):
        admitted += 1
        blocks, held = request_kv_held(spec, ctx, bs, "bf16")
        assert blocks == (2048, 32)
        assert kv.stats().group_used_blocks == (2048 * admitted, 32 * admitted)
    assert admitted == ceiling.value
    assert not grow_to(kv, "one-more", ctx, 2048)
    # without reclaiming, the budget holds 2 such sequences; the planner's per-request line with
    # windows reclaimed (bytes_reclaimed) says 14.7 fit, and the engine holds 14
    saving = request_kv(spec, ctx, "bf16")
    assert budget // kv_block_bytes(spec, bs, "bf16") // 2048 == 2
    assert admitted == budget // saving.bytes_reclaimed == 14
    assert held - saving.bytes_reclaimed < 22 * kv_block_bytes(spec, bs, "bf16") // 26  # < 1 block a layer


def test_max_concurrency_grows_by_the_ratio_the_planner_prints(tmp_path: Path) -> None:
    """`fitserve plan` on a Gemma-3-1B-shaped config at 32k prints the KV of a request with every
    layer keeping every token and with the windows reclaimed (its saving, 83.3%): the requests
    the grouped manager admits over the plain one (every layer a full group, the same budget) grow
    by that ratio, to the ceiling the plan prints."""
    spec, bs, ctx, budget = gemma3_like(), 16, 32768, 2 << 30
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "vocab_size": 262144,
        "hidden_size": 1152, "intermediate_size": 6912, "num_hidden_layers": 26,
        "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256,
        "max_position_embeddings": ctx, "sliding_window": 512, "sliding_window_pattern": 6,
        "torch_dtype": "bfloat16"}))
    plan = build_plan(PlanRequest(model=str(tmp_path), gpu="cpu", context=ctx, block_size=bs,
                                  kv_cache_memory_bytes=budget, max_num_seqs=16,
                                  dtype="bfloat16"))
    lines = {ln.name: ln for s in plan.sections for ln in s.lines}
    every_layer = lines[f"KV per request @ {ctx} tokens"].value
    windowed = lines["KV per request, windows reclaimed"]
    m = re.search(r"saving ([\d.]+)%", windowed.explain)
    assert m and float(m.group(1)) == 83.3
    assert isinstance(every_layer, int) and isinstance(windowed.value, int)
    ratio = every_layer / windowed.value
    assert ratio == pytest.approx(1 / (1 - 0.833), rel=1e-3)
    # the plain allocator: one pool of all 26 layers' blocks, every block kept
    plain = KVCacheManager(budget // kv_block_bytes(spec, bs, "bf16"), bs, enable_caching=False)
    n_plain = 0
    while grow_to(plain, f"p{n_plain}", ctx, 2048):
        n_plain += 1
    # the grouped allocator, pools as the engine sizes them
    mp = cpu_engine_memory_plan(spec, weight_bytes=0, max_num_batched_tokens=2048, max_num_seqs=16,
                                block_size=bs, kv_dtype="bf16", act_dtype_bytes=2,
                                kv_cache_memory_bytes=budget, max_model_len=ctx, threads=1,
                                fused_decode=True)
    grouped = KVCacheManager.from_groups([KVGroup(g.kind, g.num_blocks, g.window)
                                          for g in mp.kv_groups], bs, enable_caching=False)
    n_grouped = 0
    while grow_to(grouped, f"g{n_grouped}", ctx, 2048):
        n_grouped += 1
    assert (n_plain, n_grouped) == (budget // every_layer, int(budget / every_layer * ratio))
    assert (n_plain, n_grouped) == (2, 14)
    assert lines[f"max concurrent @ {ctx} (ceiling)"].value == n_grouped
