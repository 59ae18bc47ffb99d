"""`fitserve plan ... --gpu cpu` prints the bandwidth, engine FLOP/s and step overhead it used,
and its workload lines are the ledger's workload_speed on those figures."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import pytest

from fitserve.ledger import runtime
from fitserve.ledger.hardware import cpu_hardware
from fitserve.ledger.speed import workload_speed
from fitserve.ledger.weights import model_weight_bytes
from fitserve.tools.planner.cli import _add_arguments, main, render, request_from_args
from fitserve.tools.planner.model_source import catalog_entry
from fitserve.tools.planner.sections_run import build_plan
from tests.unit.tools.seeded_cpu import seed_cpu


@pytest.fixture()
def seeded_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """This CPU's cache holding known figures, and a quick probe that agrees with them."""
    seed_cpu(tmp_path, monkeypatch)
    # NOTE: this empty home would measure the engine's RSS baseline in a child (seconds);
    # the memory lines are not what is checked here
    monkeypatch.setattr(runtime, "measure_runtime_baseline", lambda timeout_s=0.0: 400 << 20)


def test_plan_prints_the_figures_it_used_and_its_workload_is_the_ledgers(
        seeded_cpu: None, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "1000")  # rich: no wrapping of the lines checked
    args = ["SmolLM2-135M", "--gpu", "cpu", "--weights", "bf16", "--context", "1024",
            "--input-len", "64", "--output-len", "16", "--batch-size", "8"]
    parser = argparse.ArgumentParser()
    _add_arguments(parser)
    plan = build_plan(request_from_args(parser.parse_args(args)))
    render(plan, explain=False)
    out = capsys.readouterr().out
    # the figures every speed line divides by, and when they were measured
    assert "12.5 GB/s copy" in out
    assert "engine matmul GFLOP/s at M = 32/512 rows: bf16 200/300, f32 50/60, int8act 400/500" in out
    assert "decode attention 45 GFLOP/s" in out
    assert "step overhead 0.125 ms + 25.0 us per layer" in out
    assert "measured " + time.strftime("%Y-%m-%d", time.gmtime()) in out
    # the workload section: its fixed cost per step, 125 us + 30 layers x 25 us = 875 us
    assert "125.00 us per step + 25.00 us x 30 layers = 875.00 us" in out
    sec = next(s for s in plan.sections if s.title.startswith("Workload on cpu"))
    one, many = sec.lines
    spec, hw = catalog_entry("SmolLM2-135M").spec, cpu_hardware()
    wb = model_weight_bytes(spec, "bf16", base_dtype="bf16")
    w1 = workload_speed(spec, hw, wb, batch_size=1, input_len=64, output_len=16,
                        kv_dtype="bf16", weights_fmt="bf16")
    w2 = workload_speed(spec, hw, wb, batch_size=8, input_len=64, output_len=16,
                        kv_dtype="bf16", weights_fmt="bf16")
    assert one.name == "single stream (64 in, 16 out)"
    assert one.value == pytest.approx(w1.decode_tokens_per_s, rel=1e-12)
    assert many.name == "batch of 8 (64 in, 16 out)"
    assert many.value == pytest.approx(w2.tokens_per_s, rel=1e-12)
    assert f"{w2.tokens_per_s:,.1f} tok/s generated" in out


def test_bad_workload_flags_name_the_flag(seeded_cpu: None, capsys: pytest.CaptureFixture[str]
                                          ) -> None:
    assert main(["SmolLM2-135M", "--gpu", "cpu", "--batch-size", "0"]) == 2
    assert "--batch-size must be >= 1, got 0" in capsys.readouterr().err


def _workload(args: list[str]) -> tuple[object, str]:
    parser = argparse.ArgumentParser()
    _add_arguments(parser)
    plan = build_plan(request_from_args(parser.parse_args(args)))
    return next(s for s in plan.sections if s.title.startswith("Workload on cpu")), plan


@pytest.mark.parametrize(("blocks", "held"), [(20, 4), (39, 7)])
def test_a_batch_the_kv_pool_cannot_hold_is_named_with_what_would_hold_it(
        seeded_cpu: None, blocks: int, held: int) -> None:
    # 8 requests x (64 + 16) tokens = 8 x 5 blocks of 16 = 40 blocks at the batch's end
    sec, plan = _workload(["SmolLM2-135M", "--gpu", "cpu", "--weights", "bf16", "--context",
                           "1024", "--input-len", "64", "--output-len", "16", "--batch-size", "8",
                           "--num-kv-blocks", str(blocks)])
    room = sec.lines[2]  # type: ignore[attr-defined]
    assert room.name == "KV at the batch's end (8 x 80 tokens)"
    assert room.value == 40
    assert room.shown == f"40 blocks > {blocks} in the pool"
    note = sec.notes[0]  # type: ignore[attr-defined]
    block_bytes = plan.engine.block_bytes  # type: ignore[attr-defined]
    assert f"the KV pool holds {held} of the 8 sequences at their full 80 tokens" in note
    assert "preempts" in note
    assert f"--num-kv-blocks 40 (--kv-cache-memory {-(-40 * block_bytes // 2**20)}M" in note


def test_a_batch_the_pool_holds_adds_no_line_and_max_num_seqs_is_named(seeded_cpu: None) -> None:
    base = ["SmolLM2-135M", "--gpu", "cpu", "--weights", "bf16", "--context", "1024",
            "--input-len", "64", "--output-len", "16", "--batch-size", "8"]
    sec, _ = _workload([*base, "--num-kv-blocks", "40"])  # exactly enough
    assert len(sec.lines) == 2  # type: ignore[attr-defined]
    sec, _ = _workload([*base, "--max-num-seqs", "4"])
    assert sec.lines[2].value == 4  # type: ignore[attr-defined]
    assert sec.lines[2].shown == "4 < 8"  # type: ignore[attr-defined]
    assert sec.notes[0].startswith("--batch-size 8 > max_num_seqs 4: the engine runs 4 at once")  # type: ignore[attr-defined]
