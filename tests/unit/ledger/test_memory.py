"""The engine memory plan: lines in reservation order, exact block counts, clear failures."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fitserve.ledger.errors import PlanError
from fitserve.ledger.kv import kv_block_bytes
from fitserve.ledger.memory import activation_peak_bytes, engine_memory_plan, num_kv_blocks
from fitserve.tools.planner.model_source import catalog_entry

SMOL = catalog_entry("SmolLM2-135M").spec
GIB = 1 << 30


def _smol_plan(total: int = GIB, weights: int = 100_000_000, **kw: int):  # type: ignore[no-untyped-def]
    args = dict(weight_bytes=weights, total_memory_bytes=total, memory_utilization=0.9,
                max_num_batched_tokens=2048, max_num_seqs=64, block_size=16, kv_dtype="bf16",
                act_dtype_bytes=2)
    args.update(kw)
    return engine_memory_plan(SMOL, **args)  # type: ignore[arg-type]


def test_smollm2_plan_by_hand() -> None:
    plan = _smol_plan()
    names = [line.name for line in plan.lines]
    assert names == ["weights", "activation peak", "logits", "workspace / graphs", "headroom",
                     "KV pool"]
    by = {line.name: line.bytes for line in plan.lines}
    # activation: per token max(attention 3 x 576 + 2 x 576 + 2 x 192 = 3264,
    #                           mlp 3 x 576 + 3 x 1536 = 6336) x 2 B, + 24 B of int64 ids,
    # positions and slots, x 2048 tokens
    assert by["activation peak"] == 2048 * (2 * 6336 + 24) == 26_001_408
    assert by["logits"] == 64 * 49152 * 4 == 12_582_912  # max_num_seqs x vocab x f32
    assert by["headroom"] == GIB - int(GIB * 0.9) == 107_374_183
    pool = GIB - 100_000_000 - 26_001_408 - 12_582_912 - 0 - 107_374_183
    assert by["KV pool"] == plan.kv_pool_bytes == pool == 827_783_321
    # one block: 16 tokens x 23,040 B (30 layers x 2 x 3 heads x 64 x 2 B) = 368,640 B
    assert plan.block_bytes == 368_640
    assert plan.num_kv_blocks == 827_783_321 // 368_640 == 2245
    assert plan.kv_tokens == 2245 * 16
    ceiling = plan.max_concurrent_sequences(2048)  # 128 blocks each: 2245 // 128 = 17
    assert (ceiling.value, ceiling.limited_by) == (17, "kv_pool")
    assert int(ceiling) == 17
    assert any("ceiling" in r or "assumed" in r for r in ceiling.reasons)
    short = plan.max_concurrent_sequences(16)
    assert (short.value, short.limited_by) == (64, "max_num_seqs")
    assert "2245" in short.reasons[0]


def test_num_kv_blocks_floor() -> None:
    block = kv_block_bytes(SMOL, 16, "bf16")
    assert num_kv_blocks(block * 10 + block - 1, SMOL, 16, "bf16") == 10
    assert num_kv_blocks(-5, SMOL, 16, "bf16") == 0


@given(st.integers(0, 10**12), st.sampled_from([1, 8, 16, 32, 128]),
       st.sampled_from(["bf16", "fp8", "int8"]), st.sampled_from([1, 3]))
def test_blocks_fill_but_never_exceed_budget(budget: int, bs: int, kv: str, tp: int) -> None:
    n = num_kv_blocks(budget, SMOL, bs, kv, tp)
    b = kv_block_bytes(SMOL, bs, kv, tp=tp)
    assert n * b <= budget < (n + 1) * b


def test_weights_that_do_not_fit_name_the_weights() -> None:
    with pytest.raises(PlanError, match=r"weights .* uses up"):
        _smol_plan(weights=2 * GIB)


def test_activation_that_eats_the_rest_is_named() -> None:
    with pytest.raises(PlanError, match=r"activation peak .* uses up"):
        _smol_plan(weights=800_000_000, max_num_batched_tokens=16384)


def test_workspace_line_and_tp() -> None:
    plan = _smol_plan(workspace_bytes=10_000_000, tp=3)
    by = {line.name: line.bytes for line in plan.lines}
    assert by["workspace / graphs"] == 10_000_000
    assert plan.block_bytes == 16 * 30 * 2 * 1 * 64 * 2  # one KV head per rank
    # attention per token: 3 x 576 + (2 x 576 + 2 x 192) / 3 = 2240; mlp 1728 + 1536 = 3264
    assert by["activation peak"] == 2048 * (2 * 3264 + 24) == activation_peak_bytes(SMOL, 2048,
                                                                                    2, 3)


def test_bad_utilization() -> None:
    with pytest.raises(PlanError, match="utilization"):
        _smol_plan(memory_utilization=1.5)  # type: ignore[arg-type]
