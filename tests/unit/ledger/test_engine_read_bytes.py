"""The weights a decode step of the engine reads, for the planner's speed lines
(``ledger.weights.engine_read_weight_bytes``), in exact bytes on the default model's shape: the
Q4_1 file held as stored reads 96,506,496 B a token (the tied table as int8, read by the
lm_head), where the main format's count keeps the table in bf16 (123,048,576 B)."""

from __future__ import annotations

from fitserve.config import ModelSpec
from fitserve.ledger.moe import moe_step_weight_read
from fitserve.ledger.weight_names import expected_weight_shapes
from fitserve.ledger.weights import (
    engine_format_rule,
    engine_read_weight_bytes,
    engine_weight_bytes,
    model_weight_bytes,
)

SMOL = ModelSpec("llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                 num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64,
                 tie_word_embeddings=True, name="SmolLM2-135M")
# as the GGUF stores it: every projection Q4_1, the tied table Q8_0, the norms F32
STORED = {n: ("F32" if len(s) == 1 else "Q8_0" if "embed" in n else "Q4_1")
          for n, s in expected_weight_shapes(SMOL).items()}
DECODER = 30 * (576 * 576 * 2 + 576 * 192 * 2 + 3 * 576 * 1536)  # 106,168,320 weights
TABLE = 49152 * 576  # 28,311,552
NORMS = 61 * 576  # 35,136


def test_default_model_reads_its_tied_table_as_int8() -> None:
    rule = engine_format_rule("as-stored", "bf16")
    wb = engine_read_weight_bytes(SMOL, "bf16", stored=STORED, rule=rule)
    want = DECODER * 20 // 32 + TABLE * 34 // 32 + NORMS * 2
    assert want == 66_355_200 + 30_081_024 + 70_272 == 96_506_496
    assert wb.total == want
    assert {ln.name: ln.bytes for ln in wb.lines} == {
        "dense_int4-g32-asym": 66_355_200, "dense_int8-g32": 30_081_024, "dense_bf16": 70_272}
    # what the engine holds (its weights line, panels aside) is what it reads: one table
    assert wb.total == engine_weight_bytes(SMOL, "bf16", stored=STORED, rule=rule, panels=False)
    # the count the speed lines used before: the table in bf16 beside the same decoder
    old = model_weight_bytes(SMOL, "int4-g32-asym", base_dtype="bf16").total
    assert old == 66_355_200 + TABLE * 2 + 70_272 == 123_048_576


def test_untied_embedding_is_a_lookup_and_experts_are_read_as_touched() -> None:
    untied = ModelSpec("llama", vocab_size=256, hidden_size=64, intermediate_size=128,
                       num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                       tie_word_embeddings=False)
    wb = engine_read_weight_bytes(untied, "bf16")
    held = engine_weight_bytes(untied, "bf16", panels=False)
    assert held - wb.total == 256 * 64 * 2  # the embedding table, not read per token
    moe = ModelSpec("qwen3_moe", vocab_size=256, hidden_size=64, intermediate_size=128,
                    num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, num_experts=8,
                    num_experts_per_token=2, moe_intermediate_size=32,
                    tie_word_embeddings=True)
    wb = engine_read_weight_bytes(moe, "bf16")
    experts = 2 * 8 * 3 * 64 * 32 * 2  # layers x experts x 3 projections, bf16
    assert sum(ln.bytes for ln in wb.lines if ln.name.startswith("expert_")) == experts
    # one token reads 2 of 8 experts: the rest of the weights and a quarter of the experts
    assert moe_step_weight_read(moe, wb, 1) == wb.total - experts + experts * 2 / 8
