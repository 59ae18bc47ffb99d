"""Known CPU figures in a fresh FITSERVE_HOME, so planner tests run on exact numbers and never
measure this machine (shared by the plan and capacity-sheet tests)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from fitserve.ledger import cpu_measure
from fitserve.ledger.hardware import CPU_CACHE_VERSION

FIGURES = {"mem_bytes_per_s": 12.5e9, "flops": 3e10, "threads": 2, "runs_kept": 7,
           "matmul_rows": [32, 512], "attention_flops": 4.5e10,
           "matmul_flops": {"bf16": [2.0e11, 3.0e11], "f32": [5e10, 6e10],
                            "int8act": [4.0e11, 5.0e11]},
           "step_overhead_s": 1.25e-4, "layer_overhead_s": 2.5e-5, "engine_note": ""}


def seed_cpu(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``home`` as FITSERVE_HOME with this CPU's cache holding FIGURES (2 threads), a quick
    probe that agrees with them, and any new measurement an error."""
    monkeypatch.setenv("FITSERVE_HOME", str(home))
    monkeypatch.setattr(cpu_measure, "default_threads", lambda: 2)
    (home / "hardware-cpu.json").write_text(json.dumps(
        {"version": CPU_CACHE_VERSION, **FIGURES, "cpu_model": cpu_measure.cpu_model(),
         "measured_at": time.time()}))
    monkeypatch.setattr(cpu_measure, "probe_copy_bandwidth", lambda t=None: 12.5e9)

    def no_measure(threads: int | None = None, **kw: object) -> None:
        raise AssertionError("measured again")

    monkeypatch.setattr(cpu_measure, "measure_figures", no_measure)
