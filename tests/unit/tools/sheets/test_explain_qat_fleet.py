"""`plan explain qat-fleet`, derived by hand.

Llama-3.3-70B: 69,501,714,432 matmul params, 15e12 pretraining tokens, KV 327,680 B per token
(80 layers x 2 x 8 x 128 x 2 B); H100 80e9 B, bf16 989.4e12; H200 141e9 B.
"""

from __future__ import annotations

import math

import pytest

from fitserve.ledger.hardware import get_hardware
from fitserve.ledger.speed import decode_step_roofline
from fitserve.tools.planner.model_source import resolve_model
from fitserve.tools.sheets.sheet import Sheet, build_sheet

QAT_H100_H = 6 * 69_501_714_432 * (0.001 * 15e12) / (989.4e12 * 0.4) / 3600  # 4,390.4 h


def sheet(*argv: str) -> Sheet:
    return build_sheet("explain", ["qat-fleet", *argv])


def rate(gpu: str, fmt: str, tp: int) -> float:
    spec = resolve_model("Llama-3.3-70B").spec
    step = decode_step_roofline(spec, get_hardware(gpu), batch=64, context=2048,
                                weight_fmt=fmt, kv_dtype="bf16", tp=tp)
    return 64 / step.seconds


def test_h100_fleet_and_payback() -> None:
    s = sheet()
    # KV: 64 x 2048 x 327,680 B = 42.9e9. bf16 141e9 B: TP2 70.5e9 + 21.5e9 > 72e9 (90% of
    # 80e9), TP4 35.3e9 + 10.7e9 fits -> TP4; int4 ~37e9: TP1 no, TP2 18.5e9 + 21.5e9 fits
    bf16 = math.ceil(20_000 / rate("h100", "bf16", 4)) * 4
    int4 = math.ceil(20_000 / rate("h100", "int4-g128", 2)) * 2
    assert (bf16, int4) == (24, 10)
    assert s.data["saved_gpus"] == 14
    assert s.data["qat_gpu_hours"] == pytest.approx(QAT_H100_H)
    # 4,390.4 / (14 x 730 = 10,220) = 0.4296 months
    assert s.data["payback_months"] == pytest.approx(QAT_H100_H / 10_220)
    assert s.data["go"] is True and s.verdict.startswith("consider QAT")


def test_when_not_to_touch_it() -> None:
    # one replica serves 500 tok/s either way: nothing saved
    small = sheet("--model", "Llama-3.1-8B", "--traffic", "500")
    assert small.data["saved_gpus"] == 0 and small.data["go"] is False
    assert small.verdict.startswith("do not touch QAT")
    # 1% of pretraining (150e9 tokens) costs 43,904 h; at 5,000 tok/s on H200 bf16 TP2
    # and int4 TP1 the payback is longer than a 6-month life
    h200 = sheet("--gpu", "h200", "--traffic", "5000", "--qat-fraction", "0.01")
    qat = 6 * 69_501_714_432 * 150e9 / (989.4e12 * 0.4) / 3600
    bf16 = math.ceil(5000 / rate("h200", "bf16", 2)) * 2
    int4 = math.ceil(5000 / rate("h200", "int4-g128", 1))
    assert h200.data["saved_gpus"] == bf16 - int4
    assert h200.data["payback_months"] == pytest.approx(qat / ((bf16 - int4) * 730))
    assert h200.data["payback_months"] > 6 and h200.data["go"] is False
