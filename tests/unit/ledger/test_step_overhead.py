"""The measured CPU's terms in the step-time model, checked by hand: the engine's matmul rate per
path and row count, its decode attention rate, and the fixed cost per step and per layer
(fitserve.ledger.hardware, fitserve.ledger.speed, fitserve.ledger.step_time)."""

from __future__ import annotations

import dataclasses
import math

import pytest

from fitserve.ledger.errors import PlanError
from fitserve.ledger.flops import flops_per_token, prefill_flops
from fitserve.ledger.hardware import Hardware, cpu_matmul_path
from fitserve.ledger.kv import request_kv
from fitserve.ledger.speed import (
    attention_fixed_seconds,
    decode_attention_seconds,
    decode_step,
    prefill_time,
    runs_attention_tile,
    workload_speed,
)
from fitserve.ledger.step_time import roofline_step_model
from fitserve.ledger.weights import model_weight_bytes
from fitserve.tools.planner.model_source import catalog_entry

SMOL = catalog_entry("SmolLM2-135M").spec  # 30 layers
BASE = Hardware("cpu", 1 << 34, 20e9, 100e9, None, None, "none", 0.0, 0.0, "test", cores=0)
# cores=0: no weight-kernel (dequant) term, so the terms below are the whole step
CPU = dataclasses.replace(
    BASE, matmul_rows=(32, 512),
    matmul_rates=(("bf16", (200e9, 400e9)), ("f32", (50e9, 80e9)), ("int8act", (300e9, 600e9))),
    attention_flops=40e9, step_overhead_s=1e-4, layer_overhead_s=2e-5)


@pytest.mark.parametrize(("fmt", "path"), [
    ("int4-g32-asym", "int8act"), ("int8-g32", "int8act"), ("Q4_K", "int8act"),
    ("gguf-file:Q4_1", "int8act"), ("IQ4_NL", "int8act"), ("bf16", "bf16"), ("f16", "bf16"),
    ("fp8-ch", "bf16"), ("f32", "f32"), ("float32", "f32")])
def test_each_format_runs_on_its_path(fmt: str, path: str) -> None:
    assert cpu_matmul_path(fmt) == path


def test_rate_by_rows_log_linear_between_the_measured_counts() -> None:
    assert CPU.peak_flops("int4-g32-asym", 1) == 300e9  # flat below 32 rows
    assert CPU.peak_flops("int4-g32-asym", 32) == 300e9
    assert CPU.peak_flops("int4-g32-asym", 2048) == 600e9  # flat past 512
    assert CPU.peak_flops("int4-g32-asym") == 600e9  # no row count: the largest measured
    # 128 rows: log2(128/32) / log2(512/32) = 2/4 of the way
    assert CPU.peak_flops("int4-g32-asym", 128) == pytest.approx(450e9, rel=1e-12)
    assert CPU.peak_flops("f32", 128) == pytest.approx(65e9, rel=1e-12)
    # without measured engine rates: the catalog rule (bf16 peak)
    assert BASE.peak_flops("int4-g32-asym", 128) == 100e9
    assert CPU.step_overhead(30) == pytest.approx(1e-4 + 30 * 2e-5, rel=1e-12)


def test_rate_by_rows_and_k_log_linear_between_the_measured_ones() -> None:
    """Rates measured at two K (K-major: each K's rates at every row count) are read at the
    step's rows, then at the model's K, each log-linear between its measured points."""
    hw = dataclasses.replace(CPU, matmul_k=(576, 2048),
                             matmul_rates=(("bf16", (100e9, 200e9, 300e9, 500e9)),
                                           ("int8act", (300e9, 600e9, 400e9, 800e9))))
    assert hw.peak_flops("int4-g32-asym", 32, 576) == 300e9
    assert hw.peak_flops("int4-g32-asym", 512, 2048) == 800e9
    assert hw.peak_flops("int4-g32-asym", 128, 576) == pytest.approx(450e9, rel=1e-12)
    assert hw.peak_flops("int4-g32-asym", 128, 2048) == pytest.approx(600e9, rel=1e-12)
    assert hw.peak_flops("int4-g32-asym", 128, 4096) == pytest.approx(600e9, rel=1e-12)
    assert hw.peak_flops("int4-g32-asym", 128) == pytest.approx(600e9, rel=1e-12)  # largest K
    # K = 1024: log(1024 / 576) / log(2048 / 576) of the way from 450 to 600 (at 128 rows)
    f = math.log(1024 / 576) / math.log(2048 / 576)
    assert hw.peak_flops("int4-g32-asym", 128, 1024) == pytest.approx(450e9 + f * 150e9,
                                                                      rel=1e-12)
    assert hw.peak_flops("bf16", 2048, 576) == 200e9
    # a decode step reads the rate at the model's hidden size (SmolLM2: 576)
    wb = model_weight_bytes(SMOL, "int4-g32-asym")
    st = decode_step(SMOL, hw, wb, batch=32, context=200, kv_dtype="bf16",
                     weights_fmt="int4-g32-asym")
    assert st.t_compute == pytest.approx(32 * flops_per_token(SMOL, 200).matmul / 300e9,
                                         rel=1e-12)


def test_decode_attention_pays_its_fixed_cost_per_sequence_and_kv_head() -> None:
    hw = dataclasses.replace(CPU, attention_seq_s=5e-7)
    wb = model_weight_bytes(SMOL, "int4-g32-asym")
    tf = flops_per_token(SMOL, 200)
    st = decode_step(SMOL, hw, wb, batch=32, context=200, kv_dtype="bf16",
                     weights_fmt="int4-g32-asym")
    # 32 sequences x 30 layers x 3 KV heads x 0.5 us beside the FLOPs at 40 GFLOP/s
    assert attention_fixed_seconds(SMOL, hw, 32) == pytest.approx(32 * 30 * 3 * 5e-7, rel=1e-12)
    assert st.t_attention == pytest.approx(32 * tf.attention / 40e9 + 32 * 30 * 3 * 5e-7,
                                           rel=1e-12)
    assert attention_fixed_seconds(SMOL, hw, 32, tp=3) == pytest.approx(32 * 30 * 5e-7,
                                                                        rel=1e-12)
    # + each KV head's rows: 32 sequences x 30 layers x 200 keys x 3 KV heads x 64 dims x 2 ps
    # (the query heads' part stays at the FLOP rate)
    kv = dataclasses.replace(hw, attention_kv_s=2e-12)
    st = decode_step(SMOL, kv, wb, batch=32, context=200, kv_dtype="bf16",
                     weights_fmt="int4-g32-asym")
    assert st.t_attention == pytest.approx(32 * tf.attention / 40e9 + 32 * 30 * 3 * 5e-7
                                           + 32 * 30 * 200 * 3 * 64 * 2e-12, rel=1e-12)
    assert decode_attention_seconds(SMOL, kv, 32 * tf.attention / 3, 32, tp=3) == pytest.approx(
        32 * tf.attention / 3 / 40e9 + 32 * 30 * 5e-7 + 32 * 30 * 200 * 64 * 2e-12, rel=1e-12)
    assert decode_attention_seconds(SMOL, kv, 0.0, 32) == 0.0  # no decodes: no attention


def test_decode_attention_on_the_amx_tile_from_its_group() -> None:
    """Where the CPU runs the AMX-BF16 tile from 8 query heads per KV head, a model with that
    many pays the tile's rates (its FLOPs at attention_tile_flops, its KV rows at
    attention_tile_kv_s; the fixed cost per item unchanged); SmolLM2 (3 per KV head) keeps the
    vector tile's."""
    tile = dataclasses.replace(CPU, attention_seq_s=5e-7, attention_kv_s=2e-12,
                               attention_tile_flops=160e9, attention_tile_kv_s=1e-12,
                               attention_tile_min_group=8)
    wide = dataclasses.replace(SMOL, num_heads=24, num_kv_heads=3)  # 8 query heads per KV head
    fixed = 32 * 30 * 3 * 5e-7
    for spec, flops, kv_s in ((SMOL, 40e9, 2e-12), (wide, 160e9, 1e-12)):
        attn = 32 * flops_per_token(spec, 200).attention
        assert runs_attention_tile(spec, tile) == (spec is wide)
        assert decode_attention_seconds(spec, tile, attn, 32) == pytest.approx(
            attn / flops + 32 * 30 * 200 * 3 * 64 * kv_s + fixed, rel=1e-12)
    assert not runs_attention_tile(wide, dataclasses.replace(tile, attention_tile_min_group=0))


def test_decode_step_adds_attention_and_overhead_to_the_larger_floor() -> None:
    wb = model_weight_bytes(SMOL, "int4-g32-asym")
    batch, ctx = 32, 200
    st = decode_step(SMOL, CPU, wb, batch=batch, context=ctx, kv_dtype="bf16",
                     weights_fmt="int4-g32-asym")
    tf = flops_per_token(SMOL, ctx)
    overhead = 1e-4 + SMOL.num_layers * 2e-5
    want_memory = wb.total / 20e9  # the KV is read inside the attention phase
    want_compute = batch * tf.matmul / 300e9  # 32 rows: the int8act rate at 32
    want_attention = batch * tf.attention / 40e9
    assert st.t_memory == pytest.approx(want_memory, rel=1e-12)
    assert st.t_compute == pytest.approx(want_compute, rel=1e-12)
    assert st.t_attention == pytest.approx(want_attention, rel=1e-12)
    assert st.t_overhead == pytest.approx(overhead, rel=1e-12)
    assert st.seconds == pytest.approx(
        max(want_memory, want_compute) + want_attention + overhead, rel=1e-12)
    # a GPU's roofline (no measured terms): KV in the memory floor, no attention phase
    g = decode_step(SMOL, BASE, wb, batch=batch, context=ctx, kv_dtype="bf16",
                    weights_fmt="int4-g32-asym")
    kv = batch * request_kv(SMOL, ctx, "bf16").bytes_reclaimed
    assert g.t_memory == pytest.approx((wb.total + kv) / 20e9, rel=1e-12)
    assert g.t_attention == 0.0 and g.t_overhead == 0.0
    assert g.t_compute == pytest.approx(batch * tf.total / 100e9, rel=1e-12)


def test_overhead_makes_a_tiny_step_overhead_bound() -> None:
    slow = dataclasses.replace(CPU, step_overhead_s=1.0)
    st = decode_step(SMOL, slow, model_weight_bytes(SMOL, "bf16"), batch=1, context=1,
                     kv_dtype="bf16", weights_fmt="bf16")
    assert st.bound == "overhead" and "overhead 1000.600 ms" in st.describe()


def test_roofline_step_model_carries_the_overhead_in_a() -> None:
    with_oh = roofline_step_model(SMOL, CPU, weight_fmt="bf16", kv_dtype="bf16")
    without = roofline_step_model(SMOL, dataclasses.replace(CPU, step_overhead_s=0.0,
                                                            layer_overhead_s=0.0),
                                  weight_fmt="bf16", kv_dtype="bf16")
    assert with_oh.a - without.a == pytest.approx(1e-4 + 30 * 2e-5, rel=1e-9)
    assert (with_oh.b, with_oh.d) == (without.b, without.d)


def test_workload_is_its_steps_added_up() -> None:
    """One request (W1's shape): its prompt in one step (prefill_time's), then a decode step
    per token after the first, at contexts p + 1 .. p + o - 1 (decode_step's)."""
    wb = model_weight_bytes(SMOL, "bf16")
    p, o = 100, 5
    w = workload_speed(SMOL, CPU, wb, input_len=p, output_len=o, batch_size=1,
                       kv_dtype="bf16", weights_fmt="bf16", max_num_batched_tokens=2048)
    pf = prefill_time(SMOL, CPU, wb, prompt_len=p, kv_dtype="bf16", weights_fmt="bf16")
    assert [s.seconds for s in w.prefill_steps] == [pytest.approx(pf.seconds, rel=1e-12)]
    # the prompt's attention at the measured attention rate, the rest at the matmul rate
    att = prefill_flops(SMOL, p).attention
    assert pf.t_attention == pytest.approx(att / 40e9, rel=1e-12)
    assert pf.t_compute == pytest.approx((prefill_flops(SMOL, p).total - att)
                                         / CPU.peak_flops("bf16", p), rel=1e-12)
    steps = [decode_step(SMOL, CPU, wb, batch=1, context=p + i, kv_dtype="bf16",
                         weights_fmt="bf16").seconds for i in range(1, o)]
    assert len(w.decode_steps) == o - 1
    assert w.decode_s == pytest.approx(sum(steps), rel=1e-12)
    assert w.tokens_per_s == pytest.approx(o / (pf.seconds + sum(steps)), rel=1e-12)
    assert w.decode_tokens_per_s == pytest.approx((o - 1) / sum(steps), rel=1e-12)
    with pytest.raises(PlanError, match="--output-len must be >= 1"):
        workload_speed(SMOL, CPU, wb, input_len=1, output_len=0, batch_size=1,
                       kv_dtype="bf16", weights_fmt="bf16")
