"""`fitserve plan --slo-tpot-ms`: the roofline step-time section, its numbers recomputed here
from the planner's own byte and FLOP functions."""

from __future__ import annotations

import json
import math

import pytest

from fitserve.ledger.flops import flops_per_token
from fitserve.ledger.hardware import get_hardware
from fitserve.ledger.kv import request_kv
from fitserve.ledger.weights import model_weight_bytes
from fitserve.tools.planner.cli import main
from fitserve.tools.planner.model_source import catalog_entry

ARGS = ["llama-3.1-8b", "--gpu", "h100", "--concurrency", "32", "--context", "4k",
        "--prompt-tokens", "1k", "--new-tokens", "256", "--slo-tpot-ms", "50", "--json"]


def _section(capsys: pytest.CaptureFixture[str], args: list[str]) -> dict[str, float]:
    capsys.readouterr()
    assert main(args) == 0
    plan = json.loads(capsys.readouterr().out)
    secs = [s for s in plan["sections"] if s["title"].startswith("Step time")]
    return {} if not secs else {line["formula"]: line["value"] for line in secs[0]["lines"]}


def test_step_time_section_is_the_roofline_term_by_term(capsys: pytest.CaptureFixture[str]) -> None:
    got = _section(capsys, ARGS)
    spec, hw = catalog_entry("llama-3.1-8b").spec, get_hardware("h100")
    a = model_weight_bytes(spec, "bf16", base_dtype="bf16").total / hw.mem_bytes_per_s
    b = flops_per_token(spec, 0).total / hw.peak_flops("bf16")
    d = request_kv(spec, 1, "bf16").bytes_reclaimed / hw.mem_bytes_per_s
    bsz, ctx, tpot, p, o = 32, 4096, 0.050, 1024, 256
    assert got["StepTimeModel.predict"] == pytest.approx(a + b * bsz + d * bsz * ctx, rel=1e-12)
    cap = math.floor((tpot - a - b * bsz - d * bsz * ctx) / (b + d))
    assert got["StepTimeModel.max_new_tokens"] == cap
    knee = (tpot - a - d * p) / (tpot * (b * (p + o) + d * o * (p + o / 2)))
    assert got["predicted_knee"] == pytest.approx(knee, rel=1e-12)


def test_no_target_no_section_and_a_bad_target_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert _section(capsys, [a for a in ARGS if a not in ("--slo-tpot-ms", "50")]) == {}
    capsys.readouterr()
    assert main([*ARGS[:-3], "--slo-tpot-ms", "-5"]) == 2
    assert "--slo-tpot-ms must be > 0" in capsys.readouterr().err
