"""Golden KV bytes per token, TP replication, sliding windows both ways, MLA."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fitserve.ledger.errors import PlanError
from fitserve.ledger.kv import (
    check_tp,
    kv_block_bytes,
    kv_bytes_per_token,
    kv_replication,
    request_kv,
)
from fitserve.tools.planner.model_source import catalog_entry

# bf16, whole model, tp=1: layers x 2 (K, V) x kv_heads x head_dim x 2 B
GOLDEN_BF16 = {
    "Llama-3.1-8B": 32 * 2 * 8 * 128 * 2,  # 131,072
    "Llama-3.3-70B": 80 * 2 * 8 * 128 * 2,  # 327,680
    "Llama-3.1-405B": 126 * 2 * 8 * 128 * 2,  # 516,096
    "Mistral-7B-v0.1": 32 * 2 * 8 * 128 * 2,  # 131,072 (before the window)
    "Mixtral-8x7B": 32 * 2 * 8 * 128 * 2,  # 131,072
    "Qwen2.5-7B": 28 * 2 * 4 * 128 * 2,  # 57,344
    "Qwen2.5-72B": 80 * 2 * 8 * 128 * 2,  # 327,680
    "Qwen3-32B": 64 * 2 * 8 * 128 * 2,  # 262,144
    "Gemma-2-9B": 42 * 2 * 8 * 256 * 2,  # 344,064
    "Gemma-2-27B": 46 * 2 * 16 * 128 * 2,  # 376,832
    "Gemma-3-27B": 62 * 2 * 16 * 128 * 2,  # 507,904
    "gpt-oss-20b": 24 * 2 * 8 * 64 * 2,  # 49,152
    "gpt-oss-120b": 36 * 2 * 8 * 64 * 2,  # 73,728
    "DeepSeek-V3": 61 * (512 + 64) * 2,  # MLA latent, one per layer: 70,272
    "SmolLM2-135M": 30 * 2 * 3 * 64 * 2,  # 23,040
}


@pytest.mark.parametrize("name", sorted(GOLDEN_BF16))
def test_golden_kv_bytes_per_token(name: str) -> None:
    spec = catalog_entry(name).spec
    assert kv_bytes_per_token(spec, "bf16") == GOLDEN_BF16[name]
    assert kv_bytes_per_token(spec, "fp8") == GOLDEN_BF16[name] // 2
    assert kv_block_bytes(spec, 16, "bf16") == 16 * GOLDEN_BF16[name]


def test_int8_kv_scales() -> None:
    # 32 layers x 2 x 8 heads x (128 x 1 B + 4 B f32 scale per token per head) = 67,584
    spec = catalog_entry("Llama-3.1-8B").spec
    assert kv_bytes_per_token(spec, "int8") == 32 * 2 * 8 * (128 + 4) == 67_584


def test_tp_divides_kv_heads_then_replicates() -> None:
    spec = catalog_entry("Llama-3.1-405B").spec  # 128 heads, 8 KV heads
    # tp=8: one KV head per rank: 126 x 2 x 1 x 128 x 2 = 64,512 B, no duplicate
    assert kv_bytes_per_token(spec, "bf16", tp=8) == 64_512
    assert kv_replication(spec, 8) == 1.0
    # tp=16: still one whole head per rank, so every head is stored twice
    assert kv_bytes_per_token(spec, "bf16", tp=16) == 64_512
    assert kv_replication(spec, 16) == 2.0
    dup = 16 * 64_512 - GOLDEN_BF16["Llama-3.1-405B"]
    assert dup == 516_096  # one full extra copy per token across the 16 GPUs
    smol = catalog_entry("SmolLM2-135M").spec  # 9 heads, 3 KV heads
    assert kv_bytes_per_token(smol, "bf16", tp=3) == 30 * 2 * 1 * 64 * 2
    assert kv_replication(smol, 9) == 3.0


def test_mla_latent_is_replicated_on_every_rank() -> None:
    spec = catalog_entry("DeepSeek-V3").spec
    assert kv_bytes_per_token(spec, "bf16", tp=8) == 70_272  # not divided
    assert kv_replication(spec, 8) == 8.0
    # versus a GQA model of the same size class: MLA at tp=1 is 70,272 vs Llama-405B 516,096
    assert kv_bytes_per_token(spec, "bf16") < GOLDEN_BF16["Llama-3.1-405B"] / 7


def test_bad_tp() -> None:
    with pytest.raises(PlanError, match="does not divide the 9 attention heads"):
        check_tp(catalog_entry("SmolLM2-135M").spec, 2)
    with pytest.raises(PlanError, match="KV heads"):
        check_tp(catalog_entry("Qwen2.5-7B").spec, 14)  # 28 heads; 4 KV heads vs 14
    with pytest.raises(PlanError):
        check_tp(catalog_entry("Llama-3.1-8B").spec, 0)


def test_sliding_window_both_ways() -> None:
    # Mistral-7B: every layer windowed at 4096. At 32,768 tokens a reclaiming allocator keeps
    # 4096 per layer: saving 1 - 4096/32768 = 87.5%; without reclaiming, the full 32,768.
    m = request_kv(catalog_entry("Mistral-7B-v0.1").spec, 32768, "bf16")
    assert m.bytes_all_layers == 131_072 * 32768
    assert m.bytes_reclaimed == 131_072 * 4096
    assert m.window_saving == pytest.approx(0.875)
    # Below the window there is nothing to save.
    assert request_kv(catalog_entry("Mistral-7B-v0.1").spec, 2048, "bf16").window_saving == 0
    # Gemma-2-9B: 21 of 42 layers windowed at 4096; at 8192: (21/42) x (1 - 4096/8192) = 25%
    g = request_kv(catalog_entry("Gemma-2-9B").spec, 8192, "bf16")
    assert (g.full_layers, g.sliding_layers) == (21, 21)
    assert g.bytes_reclaimed == 8192 * (21 * 8192 + 21 * 4096)
    assert g.window_saving == pytest.approx(0.25)
    # Gemma-3-27B: 5 sliding : 1 full -> 52 of 62 windowed at 1024; at 128k (131,072):
    g3 = request_kv(catalog_entry("Gemma-3-27B").spec, 131072, "bf16")
    assert g3.sliding_layers == 52
    assert g3.window_saving == pytest.approx(52 / 62 * (1 - 1024 / 131072))
    # gpt-oss-20b: 12 of 24 layers with a 128-token window
    o = request_kv(catalog_entry("gpt-oss-20b").spec, 131072, "bf16")
    assert o.bytes_reclaimed == 2048 * (12 * 131072 + 12 * 128)


def test_qwen2_sliding_window_field_is_unused() -> None:
    spec = catalog_entry("Qwen2.5-7B").spec  # use_sliding_window: false
    assert spec.sliding_window is None
    assert request_kv(spec, 131072, "bf16").window_saving == 0


@given(st.sampled_from(sorted(GOLDEN_BF16)), st.sampled_from([1, 2, 4, 8]),
       st.sampled_from(["bf16", "fp8", "int8", "f32"]))
def test_per_rank_bytes_times_tp_never_below_unsharded(name: str, tp: int, kv: str) -> None:
    spec = catalog_entry(name).spec
    try:
        check_tp(spec, tp)
    except PlanError:
        return
    assert tp * kv_bytes_per_token(spec, kv, tp=tp) >= kv_bytes_per_token(spec, kv)
    assert tp * kv_bytes_per_token(spec, kv, tp=tp) == kv_replication(spec, tp) * \
        kv_bytes_per_token(spec, kv)
