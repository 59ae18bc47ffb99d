"""FLOPs, roofline, crossover, energy and layouts, checked by hand on small cases."""

from __future__ import annotations

import dataclasses
import math

import pytest

from fitserve.ledger.flops import attention_crossover_context, flops_per_token, prefill_flops
from fitserve.ledger.hardware import get_hardware
from fitserve.ledger.parallel import ring_allreduce_seconds, tp_allreduce
from fitserve.ledger.speed import compute_bound_batch, decode_step, quant_crossover
from fitserve.ledger.weights import model_weight_bytes
from fitserve.tools.planner.energy import best_point, energy_curve, energy_per_token
from fitserve.tools.planner.layouts import LayoutQuery, recommend_layout
from fitserve.tools.planner.model_source import catalog_entry

L8 = catalog_entry("Llama-3.1-8B").spec
H100 = get_hardware("h100")


def test_flops_per_token_and_crossover() -> None:
    # 2 x matmul (lm_head included, embedding lookup not): 2 x (8,030,261,248 - 525,336,576
    # - 266,240 vectors) = 15,009,316,864; attention: 32 layers x 4 x 32 heads x 128 x ctx
    f = flops_per_token(L8, 8192)
    assert f.matmul == 15_009_316_864
    assert f.attention == 32 * 4 * 32 * 128 * 8192
    # attention = rest at ceil(15,009,316,864 / 524,288) = 28,628 tokens
    assert attention_crossover_context(L8) == 28_628
    # Mistral: every layer windowed at 4096, attention is capped below 2N forever
    assert attention_crossover_context(catalog_entry("Mistral-7B-v0.1").spec) is None


def test_prefill_flops_causal_sum() -> None:
    # P tokens: body 2 x (matmul - lm_head) x P + lm_head once + attention sum_{i<=P} i
    p = prefill_flops(L8, 4)
    lm = 128256 * 4096
    assert p.matmul == 2 * (15_009_316_864 // 2 - lm) * 4 + 2 * lm
    assert p.attention == 32 * 4 * 32 * 128 * (1 + 2 + 3 + 4)


def test_decode_roofline_batch_1_is_memory_bound() -> None:
    wb = model_weight_bytes(L8, "bf16")
    s = decode_step(L8, H100, wb, batch=1, context=1024, kv_dtype="bf16", weights_fmt="bf16")
    assert s.weight_bytes == wb.total == 2 * 8_030_261_248
    assert s.kv_bytes == 131_072 * 1024
    assert s.t_memory == pytest.approx((wb.total + 131_072 * 1024) / 3.35e12)
    assert s.bound == "memory"
    assert s.seconds == s.t_memory  # tp=1: no collectives


def test_a_cpus_one_row_linears_floor_the_weight_kernels() -> None:
    # a CPU whose int4 one-row linears stream 36 GB/s at K = 576 and 39 at K = 2048 against a
    # 80 GB/s copy: W1 of an int4 model is bound by the kernels' rate, not the bandwidth
    base = dataclasses.replace(H100, name="cpu", mem_bytes_per_s=80e9, bf16_flops=1e12, cores=2)
    hw = dataclasses.replace(base, gemv_k=(576, 2048), gemv_rates=(("int8act", (36e9, 39e9)),))
    assert hw.weight_stream_rate("int4-g32-asym", 576) == 36e9
    assert hw.weight_stream_rate("Q4_0", 4096) == 39e9  # held packed; flat past the measured K
    assert hw.weight_stream_rate("int8-g32", 1024) == pytest.approx(
        36e9 + 3e9 * math.log(1024 / 576) / math.log(2048 / 576))
    # no floor where that kernel was not timed: a ggml block type, bf16 and fp8 here, an
    # unmeasured CPU
    assert hw.weight_stream_rate("Q4_K", 576) == hw.weight_stream_rate("bf16", 576) == 0.0
    assert hw.weight_stream_rate("fp8-ch", 576) == 0.0
    # --weights fp8 (e4m3 or e5m2, any scale granularity) reads at the fp8 GEMV's own rate
    fp8 = dataclasses.replace(hw, gemv_rates=(*hw.gemv_rates, ("fp8", (17e9, 19e9))))
    assert fp8.weight_stream_rate("fp8-ch", 576) == fp8.weight_stream_rate("fp8", 576) == 17e9
    assert fp8.weight_stream_rate("int8-ch", 2048) == 39e9  # the int8 lm_head: int8act's
    assert base.weight_stream_rate("int4-g32-asym", 576) == 0.0
    wb = model_weight_bytes(L8, "int4-g32-asym")
    s = decode_step(L8, hw, wb, batch=1, context=1024, kv_dtype="bf16",
                    weights_fmt="int4-g32-asym")
    plain = decode_step(L8, base, wb, batch=1, context=1024, kv_dtype="bf16",
                        weights_fmt="int4-g32-asym")
    int4 = sum(ln.bytes for ln in wb.lines if ln.fmt == "int4-g32-asym")
    assert 0 < int4 < wb.total  # the embedding / lm_head stay bf16: no measured rate, no floor
    assert s.t_dequant == pytest.approx(int4 / 39e9 * s.weight_bytes / wb.total)  # hidden 4096
    assert s.t_dequant > max(plain.t_dequant, s.t_memory) and s.bound == "dequant"
    assert s.seconds - plain.seconds == pytest.approx(
        s.t_dequant - max(plain.t_memory, plain.t_compute, plain.t_dequant))


def test_compute_bound_batch_is_the_turning_point() -> None:
    wb = model_weight_bytes(L8, "bf16")
    b = compute_bound_batch(L8, H100, wb, context=128, kv_dtype="bf16", weights_fmt="bf16")
    assert b is not None
    kw = {"context": 128, "kv_dtype": "bf16", "weights_fmt": "bf16"}
    assert decode_step(L8, H100, wb, batch=b, **kw).bound == "compute"  # type: ignore[arg-type]
    assert decode_step(L8, H100, wb, batch=b - 1, **kw).bound == "memory"  # type: ignore[arg-type]
    # B x F / peak = (W + B x kv) / bw  ->  B = W / (F x bw / peak - kv), with F the FLOPs of
    # one token at context 128 and kv = 131,072 B x 128 per sequence: about 469
    f = flops_per_token(L8, 128).total
    assert b == int(wb.total / (f * 3.35e12 / 989.4e12 - 131_072 * 128)) + 1


def test_int4_stops_paying_once_bf16_is_compute_bound() -> None:
    i4, bf = model_weight_bytes(L8, "int4-g128"), model_weight_bytes(L8, "bf16")
    x = quant_crossover(L8, H100, i4, bf, context=128, kv_dtype="bf16")
    # batch 1 is memory-bound on both: the ratio of bytes read (embedding and lm_head stay bf16)
    kv = 131_072 * 128
    assert x.speedups[0][1] == pytest.approx((bf.total + kv) / (i4.total + kv))
    assert 2.5 < x.speedups[0][1] < 3.0
    assert x.stops_paying_at is not None and 128 <= x.stops_paying_at <= 512


def test_allreduce_arithmetic() -> None:
    ar = tp_allreduce(L8, H100, tp=8, tokens=1, act_dtype_bytes=2)
    assert ar.calls_per_step == 64  # 2 per layer
    assert ar.bytes_per_call == 4096 * 2
    # decode's 8 KiB message is latency-bound: with 8 us per call and 1 us per hop,
    #   ring     8 + 2 x 7 x 1 us + 2 x 7/8 x 8192 / 450e9 = 22.03 us
    #   tree     8 + 2 x 3 x (1 us + 8192 / 450e9)          = 14.11 us
    #   one-shot 8 + 1 us + 7 x 8192 / 450e9                =  9.13 us  <- fastest
    assert ar.algorithm == "one-shot"
    assert ar.wire_bytes_per_call == 7 * 8192
    assert ar.seconds_per_call == pytest.approx(8e-6 + 1e-6 + 7 * 8192 / 450e9)
    # a 2048-token prefill step's 16 MiB is bandwidth-bound: the ring's 2 x 7/8 factor wins
    #   ring 22 us + 1.75 x 16 MiB / 450e9 = 87.2 us; tree 8 + 6 x (1 + 37.3) = 237.7 us;
    #   one-shot 9 us + 7 x 16 MiB / 450e9 = 270.0 us
    big = tp_allreduce(L8, H100, tp=8, tokens=2048, act_dtype_bytes=2)
    assert big.algorithm == "ring"
    assert big.seconds_per_call == pytest.approx(8e-6 + 14e-6 + 2 * 7 / 8 * 2048 * 8192 / 450e9)
    assert ring_allreduce_seconds(8192, 8, H100) == pytest.approx(8e-6 + 2 * 7 / 8 * 8192 / 450e9)


def test_energy_per_token() -> None:
    assert energy_per_token(700.0, 100.0) == 7.0
    wb = model_weight_bytes(L8, "bf16")
    steps = [decode_step(L8, H100, wb, batch=b, context=1024, kv_dtype="bf16",
                         weights_fmt="bf16") for b in (1, 8, 64)]
    pts = energy_curve(steps, 700.0, 1)
    assert pts[0].joules_per_token == pytest.approx(700.0 * steps[0].seconds)
    assert best_point(pts).batch == 64


def test_layouts_mla_prefers_attention_dp() -> None:
    # DeepSeek-V3 fp8 on 8 x H200 at 64 x 32k: TP8 stores the latent 8 times and does not fit;
    # attention-DP keeps one copy per sequence.
    spec = catalog_entry("DeepSeek-V3").spec
    c = recommend_layout(spec, get_hardware("h200"), LayoutQuery(8, 32768, 64, "fp8-block", "fp8"))
    by = {x.name: x for x in c.layouts}
    assert by["TP8"].duplicated_kv_bytes == 64 * 7 * 61 * 576 * 32768
    assert not by["TP8"].fits
    assert c.recommended is not None and c.recommended.attention_dp
    assert "no duplicate KV" in c.reason


def test_layouts_gqa_past_kv_heads_duplicate() -> None:
    spec = catalog_entry("Qwen2.5-7B").spec  # 4 KV heads
    c = recommend_layout(spec, H100, LayoutQuery(4, 8192, 16, "bf16", "bf16"))
    by = {x.name: x for x in c.layouts}
    assert by["TP4"].duplicated_kv_bytes == 0
    assert by["DP4"].duplicated_kv_bytes == 0
    assert c.recommended is not None
