"""The ledger's layer-group pools: the max-concurrency line equals what the KV manager admits,
and the per-request line equals the blocks the manager holds."""

from __future__ import annotations

from fitserve.kv.group import KVGroup
from fitserve.kv.manager import KVCacheManager
from fitserve.ledger.kv import kv_block_bytes, request_kv
from fitserve.ledger.kv_groups import request_kv_held
from fitserve.ledger.memory import cpu_engine_memory_plan
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
