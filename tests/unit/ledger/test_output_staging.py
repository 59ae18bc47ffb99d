"""The ledger's "output staging" line: the float32 rows the ggml block kernels write before a
GgmlLinear casts them to the model dtype, bounded per call (fitserve.model.ggml_linear), counted
in the attention and MLP phases of a CPU step, by hand for SmolLM2-135M and SmolLM2-1.7B."""

from __future__ import annotations

from dataclasses import replace

from fitserve.ledger.memory import cpu_engine_memory_plan, cpu_step_phases
from fitserve.ledger.scratch import (
    OUTPUT_STAGING_FLOATS,
    cpu_attention_scratch,
    output_staging_bytes,
    output_staging_rows,
    projection_staging_bytes,
)
from fitserve.tools.planner.model_source import catalog_entry

SMOL = catalog_entry("SmolLM2-135M").spec  # H 576, I 1536, q 576, kv 192
# SmolLM2-1.7B's shape (bench_formats.py --shape 1.7b): H 2048, I 8192, 32 heads, no GQA
BIG = replace(SMOL, hidden_size=2048, intermediate_size=8192, num_heads=32, num_kv_heads=32,
              head_dim=64, num_layers=24)
MIB = 1 << 20


def test_rows_per_call() -> None:
    assert OUTPUT_STAGING_FLOATS == 4 * MIB
    assert output_staging_rows(16384) == 256  # 1.7B gate/up: 256 x 16384 x 4 B = 16 MiB
    assert output_staging_rows(3072) == 1365  # 135M gate/up
    assert output_staging_rows(49152) == 85  # a vocab-wide lm_head
    assert output_staging_rows(5 * MIB) == 1  # wider than the budget: one row a call
    assert output_staging_rows(0) == OUTPUT_STAGING_FLOATS


def test_bytes_by_hand() -> None:
    assert output_staging_bytes(2048, (16384, 2048), 2) == 256 * 16384 * 4 == 16 * MIB
    assert output_staging_bytes(100, (16384, 2048), 2) == 100 * 16384 * 4
    assert output_staging_bytes(2048, (16384,), 4) == 0  # float32: the output is the activation
    assert output_staging_bytes(0, (16384,), 2) == 0
    # 1.7B: o_proj 2048 wide (every row at once: 16 MiB) over q/k/v's 6144 (682 rows a call:
    # 682 x 6144 x 4 B, 16 KiB less); gate/up 16384 (256 rows)
    assert 682 * 6144 * 4 < 2048 * 2048 * 4
    assert projection_staging_bytes(BIG, 2048, 2) == (2048 * 2048 * 4, 256 * 16384 * 4)
    # 135M at 2,048 tokens: q/k/v 960 wide (every row at once), gate/up 3072 (1365 rows)
    assert projection_staging_bytes(SMOL, 2048, 2) == (2048 * 960 * 4, 1365 * 3072 * 4)


def test_plan_line_and_phases() -> None:
    kw = dict(weight_bytes=0, max_num_batched_tokens=2048, max_num_seqs=64, block_size=16,
              kv_dtype="bf16", act_dtype_bytes=2, kv_blocks=10, max_model_len=1024, threads=2,
              fused_decode=True)
    plan = cpu_engine_memory_plan(BIG, output_staging=True, **kw)  # type: ignore[arg-type]
    assert plan.line("output staging").bytes == 16 * MIB
    dense = cpu_engine_memory_plan(BIG, **kw)  # type: ignore[arg-type]
    assert "output staging" not in [m.name for m in dense.lines]
    assert plan.step_bytes - dense.step_bytes == 16 * MIB + 16 * MIB  # mlp, and attention kept
    scratch = cpu_attention_scratch(BIG, max_num_batched_tokens=2048, max_model_len=1024,
                                    max_num_seqs=64, block_size=16, act_bytes=2, kv_bytes=2,
                                    threads=2, fused_decode=True)
    rest = plan.line("logits").bytes + plan.line("sampler").bytes
    plain = cpu_step_phases(BIG, 2048, 2, scratch, rest)
    staged = cpu_step_phases(BIG, 2048, 2, scratch, rest, output_staging=True)
    assert staged["mlp"] - plain["mlp"] == 16 * MIB
    assert staged["attention"] - plain["attention"] == 2048 * 2048 * 4
    assert staged["sampling"] == plain["sampling"]
    # the MLP phase sets the step peak; the attention phase is retained beside it
    assert plan.step_phase == "mlp"
    assert plan.step_bytes == (scratch.step_tensor_bytes + staged["mlp"] + staged["attention"]
                               + staged["sampling"])
    assert plan.line("allocator retention").bytes == staged["attention"] + staged["sampling"]
