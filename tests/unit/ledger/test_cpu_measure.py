"""The CPU's measured figures: which runs count, when the cache is trusted, when re-measured."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from fitserve.ledger import cpu_measure
from fitserve.ledger.cpu_measure import CpuFigures, cached_is_usable, good_median
from fitserve.ledger.hardware import cpu_hardware

DAY = 24 * 3600.0


def test_good_median_drops_disturbed_runs() -> None:
    # best 1.0; within 1.25x: 1.0, 1.1, 1.2, 1.25 -> median (1.1 + 1.2) / 2 = 1.15; 2.0 and
    # 3.0 (another process held the cores) are dropped. A plain best-of would say 1.0, a
    # plain median 1.225.
    assert good_median([1.2, 3.0, 1.0, 1.1, 2.0, 1.25]) == pytest.approx((1.15, 4))
    assert good_median([2.0]) == (2.0, 1)


def figures(bw: float = 20e9, model: str = "CPU X", threads: int = 2, at: float = 0.0
            ) -> CpuFigures:
    return CpuFigures(bw, 100e9, model, threads, at, 7)


@pytest.mark.parametrize(("cached", "probe", "usable", "why"), [
    (figures(), 20e9, True, "cached"),
    (figures(), 24.9e9, True, "cached"),  # 24.5% above: within 25%
    (figures(), 15.1e9, True, "cached"),  # 24.5% below
    (figures(), 25.1e9, False, "quick probe read 25.1 GB/s against the cached 20.0"),
    (figures(bw=9.5e9), 24.8e9, False, "quick probe read 24.8"),  # the stale 9.5
    (figures(model="CPU Y"), 20e9, False, "another CPU (CPU Y)"),
    (figures(threads=1), 20e9, False, "with 1 threads, this process has 2"),
    (figures(at=-31 * DAY), 20e9, False, "older than 30 days"),
])
def test_cache_policy(cached: CpuFigures, probe: float, usable: bool, why: str) -> None:
    ok, reason = cached_is_usable(cached, now=0.0, model="CPU X", threads=2,
                                  probe=lambda: probe)
    assert ok is usable and why in reason


def test_cpu_hardware_remeasures_when_the_probe_disagrees(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FITSERVE_HOME", str(tmp_path))
    monkeypatch.setattr(cpu_measure, "cpu_model", lambda: "CPU X")
    monkeypatch.setattr(cpu_measure, "default_threads", lambda: 2)
    runs: list[float] = []

    def measure(threads: int | None = None) -> CpuFigures:
        runs.append(1.0)
        return figures(bw=[9.5e9, 24.8e9][len(runs) - 1], at=time.time() - len(runs))

    monkeypatch.setattr(cpu_measure, "measure_figures", measure)
    monkeypatch.setattr(cpu_measure, "probe_copy_bandwidth", lambda t=None: 24.0e9)
    assert cpu_hardware().mem_bytes_per_s == 9.5e9  # nothing cached: measured (while busy)
    hw = cpu_hardware()  # the probe reads 24.0 vs 9.5 cached: measured again
    assert hw.mem_bytes_per_s == 24.8e9 and len(runs) == 2
    assert cpu_hardware().mem_bytes_per_s == 24.8e9 and len(runs) == 2  # probe agrees now
    saved = json.loads((tmp_path / "hardware-cpu.json").read_text())
    assert saved["cpu_model"] == "CPU X" and saved["mem_bytes_per_s"] == 24.8e9
    assert "24.8 GB/s copy" in hw.source and "CPU X" in hw.source
    assert hw.measured_at == saved["measured_at"]


def test_a_damaged_cache_is_measured_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                           ) -> None:
    monkeypatch.setenv("FITSERVE_HOME", str(tmp_path))
    (tmp_path / "hardware-cpu.json").write_text('{"key": "old v1 format"}')
    monkeypatch.setattr(cpu_measure, "measure_figures", lambda threads=None: figures(bw=7e9))
    assert cpu_hardware().mem_bytes_per_s == 7e9
