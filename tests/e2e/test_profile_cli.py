"""`fitserve profile` as a user runs it, and the measured step-time model on a real engine.

Kept cheap (the suite is near its time limit): a tiny random-weight model for the full run,
one short run on the default model, bad flags in-process (they fail before any model loads),
quick calibration sweeps on a tiny engine. Subprocesses run torch on one thread: on a shared
2-core machine a two-thread pool waits on a busy core at every op.
"""

from __future__ import annotations

import csv
import json
import math
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from fitserve.cli import main
from fitserve.config import EngineConfig
from fitserve.engine.calibration_sweep import QUICK_SWEEP, ClippedSweep, EngineLimits, clip_sweep
from fitserve.envs import fitserve_home
from fitserve.ledger.errors import PlanError
from fitserve.ledger.step_time import load_step_model


@pytest.fixture()
def profile_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh FITSERVE_HOME (so step-models/ starts empty) that links the real one's other
    entries (models, compiled C++ kernels): nothing is pulled or rebuilt."""
    real = fitserve_home()
    home = tmp_path / "fitserve-home"
    home.mkdir()
    if real.is_dir():
        for entry in real.iterdir():
            if entry.name != "step-models":
                (home / entry.name).symlink_to(entry)
    monkeypatch.setenv("FITSERVE_HOME", str(home))
    return home


@pytest.fixture()
def tiny_llama(tiny_hf_model_dir: Callable[..., Any]) -> Path:
    folder: Path = tiny_hf_model_dir("llama")
    return folder


def _profile(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "FITSERVE_HOME": str(home), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "fitserve.cli", "profile", "--threads", "1", *args],
                          capture_output=True, text=True, timeout=300, env=env)


def _rows(path: Path) -> list[dict[str, str]]:
    with path.open() as f:
        return list(csv.DictReader(f))


def _check_summary(summary: dict[str, Any], out: Path) -> None:
    for name in ("trace.json", "ops.csv", "ops_by_shape.csv", "shapes.csv", "summary.json"):
        assert (out / name).is_file(), name
    trace = json.loads((out / "trace.json").read_text())
    assert trace["traceEvents"], "an empty trace"
    ops = _rows(out / "ops.csv")
    assert ops and any(r["op"].startswith("aten::") for r in ops)
    assert sum(float(r["share"]) for r in ops) == pytest.approx(1.0, abs=1e-3)
    assert _rows(out / "ops_by_shape.csv") and _rows(out / "shapes.csv")
    lat = summary["latency_ms"]
    for name in ("ttft_ms", "tpot_ms", "itl_ms"):
        p = lat[name]
        assert p["n"] >= 1 and 0 < p["p50"] <= p["p90"] <= p["p99"], (name, p)
    u = summary["utilisation"]
    assert 0 < u["step_busy_share"] <= 1 and u["cpu_utilization"] > 0 and u["threads"] == 1
    assert "warm-up" in summary["method"] and "1 torch threads" in summary["method"]


def test_profile_tiny_model_writes_every_file_and_json(tiny_llama: Path, tmp_path: Path,
                                                       profile_home: Path) -> None:
    out = tmp_path / "prof"
    proc = _profile(profile_home, "--model", str(tiny_llama), "--num-prompts", "3", "--input-len", "12",
                    "--output-len", "6", "--trace-steps", "4", "--output-dir", str(out), "--json")
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    assert summary == json.loads((out / "summary.json").read_text())
    _check_summary(summary, out)
    assert summary["workload"] == {"name": "custom", "num_prompts": 3, "input_len": 12,
                                   "output_len": 6, "ignore_eos": True}
    assert summary["latency_ms"]["ttft_ms"]["n"] == 3 and summary["latency_ms"]["itl_ms"]["n"] == 3 * 5
    assert summary["throughput"]["output_tokens"] == 18 and summary["trace"]["steps"] == 4
    window = summary["trace"]["step_records"]  # the profiled pass computes the prompts again
    assert len(window) == 4 and window[0]["num_prefill_tokens"] == 3 * 12 and window[-1]["num_decodes"] == 3
    kinds = {r["kind"] for r in summary["steps_by_shape"]}
    assert {"prefill", "decode"} <= kinds


def test_profile_default_model_short_run_prints_tables(smollm2_path: Path, tmp_path: Path,
                                                       profile_home: Path) -> None:
    out = tmp_path / "prof"
    proc = _profile(profile_home, "--model", str(smollm2_path), "--num-prompts", "2", "--input-len", "16",
                    "--output-len", "6", "--trace-steps", "3", "--max-model-len", "256",
                    "--output-dir", str(out))
    assert proc.returncode == 0, proc.stderr
    for heading in ("per-token latency (ms)", "steps by shape", "top ops by self CPU time",
                    "step_busy_share", "cpu_utilization"):
        assert heading in proc.stdout
    _check_summary(json.loads((out / "summary.json").read_text()), out)


def test_bad_flags_exit_nonzero_naming_the_problem(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    def fails(*args: str) -> str:
        try:
            code = main(["profile", *args])
        except SystemExit as exc:  # argparse
            code = int(exc.code or 0)
        assert code == 2, args
        return capsys.readouterr().err

    assert "--num-prompts: must be >= 1, got 0" in fails("--num-prompts", "0")
    assert "invalid choice: 'bogus'" in fails("--workload", "bogus")
    assert "--trace-steps: must be >= 0" in fails("--trace-steps", "-1")
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    err = fails("--output-dir", str(blocker / "out"))
    assert f"--output-dir {blocker / 'out'} is not a writable directory" in err
    assert "leave out --workload W1" in fails("--workload", "W1", "--num-prompts", "2")


@pytest.fixture()
def slo_engine(tiny_llama: Path, profile_home: Path, one_thread: None) -> Iterator[Any]:
    """A tiny engine with the slo policy (it resolves its step-time model at start: nothing is
    saved in the fresh FITSERVE_HOME, so it calibrates) and small limits the sweep must clip to."""
    from fitserve.engine.core import Engine

    yield Engine(EngineConfig(model=str(tiny_llama), dtype="float32", device="cpu", max_model_len=160,
                              max_num_seqs=6, max_num_batched_tokens=96, num_kv_blocks=48,
                              scheduling_policy="slo", slo_tpot_ms=1000.0, slo_ttft_ms=60_000.0))


def test_calibrate_then_resolve_saves_and_reloads(slo_engine: Any, profile_home: Path,
                                                  tmp_path: Path) -> None:
    from fitserve.engine.calibrate import (
        calibrate_step_model,
        resolve_step_model,
        step_model_path,
    )

    engine = slo_engine
    path = step_model_path(engine)  # the engine measured and saved it at start-up
    assert path.parent == profile_home / "step-models"
    started_with = engine.scheduler.step_model
    assert load_step_model(path) == started_with and "step_model" in engine.startup_seconds
    saved = json.loads(path.read_text())
    assert saved["meta"]["key"] == path.stem and saved["meta"]["threads"] == 1
    assert math.isfinite(saved["held_out_error"]["median_rel"])

    model, error = calibrate_step_model(engine, quick=True)
    assert error.n >= 4 and all(math.isfinite(v) for v in (error.median_rel, error.p90_rel, error.max_rel))
    assert not engine.has_unfinished_requests() and engine.scheduler.step_model == started_with
    assert engine.stats().kv.used_blocks == 0 and engine.reset_prefix_cache() == 0  # idle, cache empty
    assert max(r.seqs for r in engine.step_log) <= 6 and max(r.new_tokens for r in engine.step_log) <= 96

    steps = engine.num_steps
    assert resolve_step_model(engine) == started_with and engine.num_steps == steps  # loaded, not re-run
    path.write_text("{corrupt")  # a bad saved file is measured again and replaced
    remeasured = resolve_step_model(engine)
    assert engine.num_steps > steps and load_step_model(path) == remeasured

    bad = tmp_path / "bad-step-model.json"
    bad.write_text("{not json")
    engine.config = replace(engine.config, step_model=str(bad))
    with pytest.raises(PlanError, match="bad-step-model.json"):
        resolve_step_model(engine)


def test_cli_calibrate_writes_the_model_where_the_engine_finds_it(tiny_llama: Path, tmp_path: Path,
                                                                  profile_home: Path, one_thread: None,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cal"
    assert main(["profile", "--model", str(tiny_llama), "--dtype", "float32", "--workload", "calibrate",
                 "--quick", "--max-model-len", "160", "--output-dir", str(out), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    saved = Path(summary["saved_to"])
    assert saved.parent == profile_home / "step-models"
    assert load_step_model(saved) == load_step_model(out / "step_model.json")
    assert summary["held_out_steps"] >= 4 and math.isfinite(summary["held_out_error"]["median_rel"])
    rows = _rows(out / "steps.csv")
    assert len(rows) == summary["fitted_steps"] + summary["held_out_steps"]


def test_sweep_clips_to_any_engine() -> None:
    # 6 seqs, 96-token budget, 160-token context, 48 blocks of 16
    s = clip_sweep(QUICK_SWEEP, EngineLimits(6, 96, 160, 48, 16, True))
    assert s == ClippedSweep(chunk_sizes=(16, 96), chunk_repeats=1, short_prompt=16, short_batches=(1, 4, 6),
                             decode_tokens=7, long_context=112, long_batches=(1, 6), cached_chunks=(47,),
                             mixed_batch=4, mixed_chunks=(92,))
    # one sequence, an 8-token budget, a 3-block pool: prompt chunks only (too few to fit, later)
    s = clip_sweep(QUICK_SWEEP, EngineLimits(1, 8, 16, 3, 4, False))
    assert s.chunk_sizes == (8,) and s.short_batches == () and s.long_context == 0
