"""Speculative decoding economics on the roofline, checked by hand: tokens per verification
E = (1 - alpha^(k+1)) / (1 - alpha), speedup E x T_decode / (T_verify + k x draft x T_decode),
and the batch where the (k + 1)x FLOPs of verification stop it paying."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from fitserve.ledger.errors import PlanError
from fitserve.ledger.hardware import get_hardware
from fitserve.ledger.weights import model_weight_bytes
from fitserve.tools.planner.cli import main
from fitserve.tools.planner.model_source import catalog_entry
from fitserve.tools.planner.speculative import (
    Speculation,
    crossover_batch,
    expected_tokens_per_step,
    extra_flops_fraction,
    speculative_economics,
    speculative_speedup,
    verify_step,
)

ROOT = Path(__file__).resolve().parents[4]
L8 = catalog_entry("Llama-3.1-8B").spec
H100 = get_hardware("h100")
WB = model_weight_bytes(L8, "bf16")
KW: dict[str, Any] = {"kv_dtype": "bf16", "weights_fmt": "bf16"}


def test_expected_tokens_per_step_exact() -> None:
    assert expected_tokens_per_step(0.5, 3) == 1.875  # 1 + 1/2 + 1/4 + 1/8
    assert expected_tokens_per_step(0.7, 4) == pytest.approx(1 + 0.7 + 0.49 + 0.343 + 0.2401)
    for k in (1, 2, 4, 8):
        assert expected_tokens_per_step(1.0, k) == k + 1  # every draft kept
        assert expected_tokens_per_step(0.0, k) == 1.0  # only the target's own token
    # k + 1 positions computed, E kept: 4 / 1.875 - 1 = 13.3% more FLOPs per kept token
    assert extra_flops_fraction(0.5, 3) == pytest.approx(4 / 1.875 - 1)
    assert extra_flops_fraction(1.0, 4) == 0.0
    assert extra_flops_fraction(0.0, 4) == 4.0


@pytest.mark.parametrize(("k", "alpha", "cost", "named"), [
    (0, 0.5, 0.1, "got 0"), (2.5, 0.5, 0.1, "got 2.5"), (True, 0.5, 0.1, "got True"),
    (4, 1.5, 0.0, "got 1.5"), (4, -0.1, 0.0, "got -0.1"), (4, math.nan, 0.0, "got nan"),
    (4, 0.5, -1.0, "got -1.0"), (4, 0.5, math.inf, "got inf")])
def test_bad_input_is_a_plan_error_naming_the_value(k: Any, alpha: float, cost: float,
                                                    named: str) -> None:
    with pytest.raises(PlanError, match=named):
        Speculation(k, alpha, cost)
    if cost == 0.0:
        with pytest.raises(PlanError, match=named):
            expected_tokens_per_step(alpha, k)


def test_batch_1_on_a_bandwidth_bound_model() -> None:
    # Llama-3.1-8B bf16 at batch 1 reads 16 GB of weights for 15 GFLOPs: 5 positions cost the
    # same step as 1, so speculation pays E / (1 + k x draft_cost)
    def at_1(sp: Speculation) -> float:
        return speculative_speedup(L8, H100, WB, sp, batch=1, context=1024, **KW)

    assert at_1(Speculation(4, 0.9, 0.02)) == pytest.approx(
        expected_tokens_per_step(0.9, 4) / 1.08, rel=1e-12)
    assert at_1(Speculation(4, 0.9, 0.02)) > 3
    assert at_1(Speculation(4, 0.0, 0.05)) == pytest.approx(1 / 1.2, rel=1e-12)  # < 1
    assert at_1(Speculation(4, 0.0, 0.0)) == 1.0  # nothing gained, nothing lost, memory-bound


def test_crossover_moves_with_alpha_and_draft_cost() -> None:
    def cross(alpha: float, cost: float) -> float:
        c = crossover_batch(L8, H100, WB, Speculation(4, alpha, cost), context=128, **KW)
        return math.inf if c is None else c

    costs = (0.0, 0.02, 0.05, 0.1, 0.3)
    table = [[cross(a, d) for d in costs] for a in (0.0, 0.3, 0.5, 0.7, 0.9, 1.0)]
    for row in table:  # dearer drafts stop paying sooner
        assert row == sorted(row, reverse=True)
    for col in zip(*table, strict=True):  # better acceptance pays longer
        assert list(col) == sorted(col)
    assert table[0][1] == 1  # alpha = 0 with any draft cost never pays
    assert table[0][0] == 68  # alpha = 0, free draft: speedup T_decode / T_verify < 1 once
    # verification turns compute-bound, at 5 x B x F / peak > (W + B x kv) / bw


def test_speedup_and_crossover_by_hand() -> None:
    # Llama-3.1-8B bf16 on H100 at context 128, k = 4, alpha = 0.7, draft cost 0.05 (tp = 1)
    assert (H100.mem_bytes_per_s, H100.bf16_flops) == (3.35e12, 989.4e12)
    w = 2 * 8_030_261_248  # weight bytes read per step
    kv = 131_072 * 128  # KV bytes read per sequence
    f = 15_009_316_864 + 32 * 4 * 32 * 128 * 128  # FLOPs per token: 2 x matmul + attention
    k, alpha, cost = 4, 0.7, 0.05
    e = 1 + 0.7 + 0.49 + 0.343 + 0.2401

    def t_decode(b: int) -> float:
        return max((w + b * kv) / 3.35e12, b * f / 989.4e12)

    def t_verify(b: int) -> float:  # weights once, each sequence's KV once, 5x the FLOPs
        return max((w + b * kv) / 3.35e12, b * (k + 1) * f / 989.4e12)

    def speedup(b: int) -> float:
        return e * t_decode(b) / (t_verify(b) + k * cost * t_decode(b))

    sp = Speculation(k, alpha, cost)
    for b in (1, 4, 16, 64, 128, 194, 195, 256, 1024):
        assert speculative_speedup(L8, H100, WB, sp, batch=b, context=128, **KW) == (
            pytest.approx(speedup(b), rel=1e-12))
    vs = verify_step(L8, H100, WB, batch=64, k=k, context=128, **KW)
    assert (vs.batch, vs.weight_bytes, vs.kv_bytes, vs.flops) == (320, w, 64 * kv, 320 * f)
    # first batch with speedup < 1, by a plain scan: (E - 0.2) (W + B kv) / bw < 5 B F / peak
    first = next(b for b in range(1, 4097) if speedup(b) < 1)
    assert first == 195
    assert crossover_batch(L8, H100, WB, sp, context=128, **KW) == 195
    assert crossover_batch(L8, H100, WB, sp, context=128, max_batch=194, **KW) is None


def test_long_context_kv_reads_keep_it_paying() -> None:
    # at 8k tokens each sequence reads 1 GiB of KV per step, once either way: verification
    # stays memory-bound at every batch, the speedup stays E / (1 + k x draft_cost)
    ec = speculative_economics(L8, H100, WB, Speculation(4, 0.7, 0.05), context=8192, **KW)
    assert [b for b, _ in ec.speedups] == [1, 4, 16, 32, 64, 128, 256]
    for _, s in ec.speedups:
        assert s == pytest.approx(ec.expected_tokens / 1.2, rel=1e-12)
    assert ec.crossover_batch is None and ec.pays_again_at is None
    assert ec.draft_cost_per_verify == pytest.approx(0.2)
    assert ec.flops_per_token == 15_009_316_864 + 32 * 4 * 32 * 128 * 8192
    assert ec.extra_flops_per_token == pytest.approx(ec.flops_per_token * (5 / 2.7731 - 1))


def test_moe_verification_touches_more_experts() -> None:
    # Mixtral (2 of 8 experts): 5 positions of one sequence touch 1 - 0.75^5 = 76% of the
    # experts, one touches 25%, so at batch 1 verification reads ~2.6x the expert bytes
    mx = catalog_entry("Mixtral-8x7B").spec
    wb = model_weight_bytes(mx, "bf16")
    sp = Speculation(4, 0.7, 0.05)
    one, sixteen = (speculative_speedup(mx, H100, wb, sp, batch=b, context=1024, **KW)
                    for b in (1, 16))
    assert one < sixteen < expected_tokens_per_step(0.7, 4) / 1.2


def fitserve_plan(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "fitserve.cli", "plan", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, check=False)


def test_cli_prints_the_section_and_json_has_it() -> None:
    flags = ["smollm2-135m", "--gpu", "h100", "--speculative", "4,0.8,0.05"]
    out = fitserve_plan(*flags)
    assert out.returncode == 0, out.stderr
    assert "Speculative decoding: k=4, alpha=0.8, draft cost 0.05" in out.stdout
    assert "stops paying from batch" in out.stdout
    js = fitserve_plan(*flags, "--json")
    assert js.returncode == 0, js.stderr
    sec = next(s for s in json.loads(js.stdout)["sections"]
               if s["title"].startswith("Speculative decoding"))
    lines = {line["name"]: line["value"] for line in sec["lines"]}
    assert lines["expected tokens per step"] == pytest.approx((1 - 0.8**5) / 0.2)  # 3.3616
    assert lines["draft cost per verification"] == pytest.approx(0.2)
    assert [n for n in lines if n.startswith("speedup")] == [
        f"speedup, batch {b}" for b in (1, 4, 16, 32, 64, 128, 256)]
    assert lines["speedup, batch 1"] == pytest.approx(3.3616 / 1.2)
    assert "stops paying from batch" in lines
    assert any("compute-bound" in note for note in sec["notes"])


@pytest.mark.parametrize(("value", "why"), [("0,0.5,0.1", "k"), ("4,1.5,0", "alpha")])
def test_cli_bad_speculative_exits_non_zero_naming_the_flag(value: str, why: str) -> None:
    out = fitserve_plan("smollm2-135m", "--gpu", "h100", "--speculative", value)
    assert out.returncode == 2
    assert f"--speculative {value}: speculative {why} " in out.stderr


@pytest.mark.parametrize("value", ["4,0.5", "4,x,0", "4.5,0.5,0", "4,0.5,-1", "4,0.5,inf"])
def test_bad_speculative_in_process(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    capsys.readouterr()
    assert main(["smollm2-135m", "--gpu", "h100", "--speculative", value]) == 2
    assert "--speculative" in capsys.readouterr().err


def test_cpu_plan_has_the_section(capsys: pytest.CaptureFixture[str]) -> None:
    capsys.readouterr()
    assert main(["smollm2-135m", "--gpu", "cpu", "--speculative", "4,0.7,0.05", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    sec = next(s for s in plan["sections"] if s["title"].startswith("Speculative decoding"))
    speedups = [line["value"] for line in sec["lines"] if line["name"].startswith("speedup")]
    assert len(speedups) == 7 and all(s > 0 for s in speedups)
    capsys.readouterr()
    assert main(["smollm2-135m", "--gpu", "cpu", "--json"]) == 0
    assert not any(s["title"].startswith("Speculative")
                   for s in json.loads(capsys.readouterr().out)["sections"])
