"""The step-time model's per-format kernel cost (fitserve.ledger.dequant), checked by hand."""

from __future__ import annotations

import dataclasses

import pytest

from fitserve.ledger.dequant import DEQUANT_NS_PER_WEIGHT, dequant_seconds, format_ns_per_weight
from fitserve.ledger.hardware import Hardware, get_hardware
from fitserve.ledger.speed import decode_step
from fitserve.ledger.step_time import roofline_step_model
from fitserve.ledger.weights import model_weight_bytes
from fitserve.tools.planner.model_source import catalog_entry

SMOL = catalog_entry("SmolLM2-135M").spec
# a 2-core CPU: 20 GB/s, 200 GFLOP/s
CPU = Hardware("cpu", 1 << 34, 20e9, 200e9, None, None, "none", 0.0, 0.0, "test", cores=2)


def test_ns_per_weight_by_rows_and_name() -> None:
    ns1, ns8 = DEQUANT_NS_PER_WEIGHT["Q4_K"]
    assert format_ns_per_weight("Q4_K", 1) == ns1
    assert format_ns_per_weight("Q4_K", 8) == pytest.approx(ns8, rel=1e-12)
    assert format_ns_per_weight("Q4_K", 4) == pytest.approx(ns1 + 3 * (ns8 - ns1) / 7)
    # the GGUF types the engine holds packed read their packed format's figures
    assert format_ns_per_weight("Q8_0", 1) == DEQUANT_NS_PER_WEIGHT["int8-g32"][0]
    assert format_ns_per_weight("Q4_0", 1) == DEQUANT_NS_PER_WEIGHT["int4-g32-sym"][0]
    assert format_ns_per_weight("f32", 1) == 0.0  # no measured CPU kernel
    # gpt-oss's MXFP4 experts (GGUF type name or the ledger's) read their rows' cost
    assert format_ns_per_weight("MXFP4", 1) == format_ns_per_weight("mxfp4", 1) == (
        DEQUANT_NS_PER_WEIGHT["mxfp4"][0]) > 0
    with pytest.raises(ValueError, match="at least 1 row"):
        format_ns_per_weight("Q4_K", 0)


def test_bf16_model_costs_its_parameters_times_the_figure() -> None:
    wb = model_weight_bytes(SMOL, "bf16")
    # every tensor bf16: elements = the model's parameters (an independent count)
    want = wb.num_params * DEQUANT_NS_PER_WEIGHT["bf16"][0] * 1e-9 / 2
    assert dequant_seconds(wb, rows=1, cores=2) == pytest.approx(want, rel=1e-9)
    assert dequant_seconds(wb, rows=1, cores=0) == 0.0  # not a CPU


def test_decode_step_takes_the_largest_floor() -> None:
    q5 = model_weight_bytes(SMOL, "Q5_0")
    st = decode_step(SMOL, CPU, q5, batch=1, context=100, kv_dtype="bf16", weights_fmt="Q5_0")
    assert st.t_dequant == pytest.approx(dequant_seconds(q5, rows=1, cores=2))
    assert st.seconds == max(st.t_memory, st.t_compute, st.t_dequant) + st.t_comm
    # at 20 GB/s the stream is slower than the Q5_0 kernel; at 400 GB/s the kernel bounds W1
    assert st.bound == "memory" and st.t_dequant > 0
    fast = dataclasses.replace(CPU, mem_bytes_per_s=400e9)
    st = decode_step(SMOL, fast, q5, batch=1, context=100, kv_dtype="bf16", weights_fmt="Q5_0")
    assert st.bound == "dequant" and st.seconds == st.t_dequant + st.t_comm
    # Q4_0's kernel is cheaper per weight than Q5_0's (same stream class): the term follows it
    q4 = model_weight_bytes(SMOL, "Q4_0")
    st4 = decode_step(SMOL, fast, q4, batch=1, context=100, kv_dtype="bf16", weights_fmt="Q4_0")
    assert st4.t_dequant < st.t_dequant
    # an accelerator has no such term
    h100 = get_hardware("h100")
    assert decode_step(SMOL, h100, q5, batch=1, context=100, kv_dtype="bf16",
                       weights_fmt="Q5_0").t_dequant == 0.0


def test_roofline_step_model_reads_the_kernel_cost() -> None:
    fast = dataclasses.replace(CPU, mem_bytes_per_s=400e9)
    m = roofline_step_model(SMOL, fast, weight_fmt="Q5_0")
    q5 = model_weight_bytes(SMOL, "Q5_0")
    k1 = dequant_seconds(q5, rows=1, cores=2)
    assert m.a == pytest.approx(k1)  # the kernel, not the 400 GB/s stream, sets a
    assert m.b >= dequant_seconds(q5, rows=2, cores=2) - k1
