"""The format table: block layouts checked against the gguf package, bytes by hand."""

from __future__ import annotations

import gguf
import pytest

from fitserve.ledger.errors import PlanError
from fitserve.ledger.formats import (
    WEIGHT_FORMATS,
    dtype_bytes,
    kv_element_bytes,
    kv_scale_bytes_per_head,
    resolve_kv_dtype,
    weight_bytes,
    weight_format,
)
from fitserve.ledger.weights import model_weight_bytes, use_more_bits
from fitserve.tools.planner.model_source import catalog_entry


def test_gguf_blocks_match_the_gguf_package() -> None:
    # Independent reference: gguf.GGML_QUANT_SIZES[type] = (block elements, bytes per block).
    for f in WEIGHT_FORMATS.values():
        if f.gguf:
            block, nbytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[f.name]]
            assert (f.block_elements, f.block_bits) == (block, nbytes * 8), f.name
    assert gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.MXFP4] == (32, 17)
    assert weight_format("mxfp4").block_bits == 17 * 8


def test_every_type_the_engine_loads_has_a_row() -> None:
    """The ledger counts any GGUF file the engine loads: every type of SUPPORTED_GGUF_TYPES
    (probed from gguf-py) has a table row of gguf's own block layout; the held-as-stored
    types (raw blocks or packed) are exactly what fitserve.quant.ggml_blocks dequantizes."""
    from fitserve.ledger.formats import GGML_HELD_TYPES, GGUF_PACKED
    from fitserve.loading.gguf_spec import SUPPORTED_GGUF_TYPES
    from fitserve.quant.ggml_blocks import GGML_BLOCK_TYPES

    assert {"Q2_K", "Q3_K", "Q5_0", "IQ2_XXS", "IQ4_XS", "TQ1_0"} <= set(SUPPORTED_GGUF_TYPES)
    for name in SUPPORTED_GGUF_TYPES:
        block, nbytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name]]
        f = weight_format(name)
        assert f.block_bits / f.block_elements == nbytes * 8 / block, name
    assert set(GGML_HELD_TYPES) | set(GGUF_PACKED) == set(GGML_BLOCK_TYPES)


def test_bits_per_weight() -> None:
    assert weight_format("Q4_0").bits_per_weight == 4.5  # 18 B * 8 / 32
    assert weight_format("Q4_1").bits_per_weight == 5.0  # 20 B * 8 / 32
    assert weight_format("Q8_0").bits_per_weight == 8.5  # 34 B * 8 / 32
    assert weight_format("Q4_K").bits_per_weight == 4.5  # 144 B * 8 / 256
    assert weight_format("Q5_K").bits_per_weight == 5.5  # 176 B * 8 / 256
    assert weight_format("Q6_K").bits_per_weight == 6.5625  # 210 B * 8 / 256
    # int4 g128 asymmetric: 4 bits + (16-bit scale + 4-bit zero) / 128 = 4.15625
    assert weight_format("int4-g128").bits_per_weight == 4 + 20 / 128
    assert weight_format("int4-g32-sym").bits_per_weight == 4 + 16 / 32


def test_weight_bytes_exact() -> None:
    assert weight_bytes(1000, "bf16") == 2000
    assert weight_bytes(1000, "bfloat16") == 2000
    assert weight_bytes(1000, "f32") == 4000
    assert weight_bytes(1000, "fp8") == 1000 + 4  # + one f32 per-tensor scale
    # int8 per-channel: 4096 x 1024 codes + 4096 rows x f32 scale
    assert weight_bytes(4096 * 1024, "int8", rows=4096) == 4096 * 1024 + 4096 * 4
    # int4-g128, 4096 x 4096: 131,072 groups x 532 bits / 8 = 8,716,288 B
    assert weight_bytes(4096 * 4096, "int4-g128") == 8_716_288
    assert weight_bytes(256, "Q4_K") == 144
    assert weight_bytes(257, "Q4_K") == 288  # partial block rounds up
    assert weight_bytes(64, "Q4_1") == 40


def test_bad_formats() -> None:
    with pytest.raises(PlanError, match="per-channel"):
        weight_bytes(10, "int8")
    with pytest.raises(PlanError, match="unknown weight format"):
        weight_format("int3")
    with pytest.raises(PlanError, match="group"):
        weight_format("int4-g7")
    with pytest.raises(PlanError, match="activation dtype"):
        dtype_bytes("fp8")


def test_kv_formats() -> None:
    assert kv_element_bytes("bf16") == 2.0
    assert kv_element_bytes("fp8") == 1.0
    assert kv_element_bytes("int8") == 1.0
    assert kv_scale_bytes_per_head("int8") == 4
    assert kv_scale_bytes_per_head("fp8") == 0  # per-layer scales, not per token
    assert resolve_kv_dtype("auto", "bf16") == "bf16"
    assert resolve_kv_dtype("float16", "bf16") == "f16"
    with pytest.raises(PlanError, match="auto"):
        kv_element_bytes("auto")
    with pytest.raises(PlanError, match="unknown KV format"):
        kv_element_bytes("int4")


def test_use_more_bits_picks_half_of_32_layers() -> None:
    # n=32: i < 4 (4 layers), i >= 28 (4), (i - 4) % 3 == 2 for i in 4..27: 6, 9, ..., 27 (8)
    assert sum(use_more_bits(i, 32) for i in range(32)) == 16


def test_q4_k_m_effective_bits_llama3_8b() -> None:
    # llama.cpp's Q4_K_M of Llama-3-8B is 4.58 GiB = 4.92e9 B over 8.03e9 weights: ~4.89 bpw.
    wb = model_weight_bytes(catalog_entry("Llama-3.1-8B").spec, "Q4_K_M")
    assert wb.bits_per_weight == pytest.approx(4.89, rel=0.03)
    assert wb.total == pytest.approx(4.58 * 2**30, rel=0.03)


def test_gpt_oss_native_mxfp4_checkpoint_size() -> None:
    # Model card: gpt-oss-20b checkpoint 12.8 GiB, gpt-oss-120b 60.8 GiB (experts MXFP4).
    for name, gib in (("gpt-oss-20b", 12.8), ("gpt-oss-120b", 60.8)):
        wb = model_weight_bytes(catalog_entry(name).spec, "gpt-oss-mxfp4")
        assert wb.total / 2**30 == pytest.approx(gib, rel=0.02), name


def test_fp8_keeps_embedding_and_lm_head_bf16() -> None:
    # Llama-3.1-8B fp8: 6,979,321,856 linear weights in 1 B (+4 B scale per tensor, 7 x 32
    # tensors) + embedding and lm_head 2 x 525,336,576 x 2 B + 266,240 vector params x 2 B.
    spec = catalog_entry("Llama-3.1-8B").spec
    wb = model_weight_bytes(spec, "fp8")
    linear = 32 * (4096 * 4096 * 2 + 4096 * 1024 * 2 + 3 * 4096 * 14336)
    assert linear == 6_979_321_856
    assert wb.total == linear + 7 * 32 * 4 + 2 * 525_336_576 * 2 + (32 * 2 + 1) * 4096 * 2
