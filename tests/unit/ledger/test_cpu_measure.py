"""The CPU's measured figures: which runs count, when the cache is trusted, when re-measured."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from fitserve.ledger import cpu_measure
from fitserve.ledger.cpu_measure import CpuFigures, cached_is_usable, good_median
from fitserve.ledger.hardware import cpu_hardware, measured_cpu

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

    def measure(threads: int | None = None, *, engine: object = None) -> CpuFigures:
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
    monkeypatch.setattr(cpu_measure, "measure_figures",
                        lambda threads=None, engine=None: figures(bw=7e9))
    assert cpu_hardware().mem_bytes_per_s == 7e9


ENGINE_JSON = ('{"matmul_rows": [32, 512], "matmul_flops": {"bf16": [4e11, 8e11], '
               '"int8act": [6e11, 9e11]}, "attention_flops": 9e10, "step_overhead_s": 0.0001, '
               '"layer_overhead_s": 1.5e-05, "threads": 2}')


def test_engine_rates_parse_and_reject() -> None:
    e = cpu_measure.EngineRates.from_json(ENGINE_JSON)
    assert e.matmul_rows == (32, 512) and e.matmul_flops["int8act"] == [6e11, 9e11]
    assert (e.attention_flops, e.step_overhead_s, e.layer_overhead_s) == (9e10, 1e-4, 1.5e-5)
    for bad, why in [(ENGINE_JSON.replace('"attention_flops": 9e10, ', ""), "attention_flops"),
                     (ENGINE_JSON.replace("[4e11, 8e11]", "[4e11]"), "mismatched"),
                     (ENGINE_JSON.replace("0.0001", "-0.0001"), "negative"),
                     ("not json", "not the engine-rates JSON")]:
        with pytest.raises(ValueError, match=why):
            cpu_measure.EngineRates.from_json(bad)


def test_engine_rates_carry_each_k_and_the_attention_items() -> None:
    at_k = ENGINE_JSON.replace('"matmul_flops"', '"matmul_k": [576, 2048], "matmul_flops"').replace(
        "[4e11, 8e11]", "[3e11, 7e11, 4e11, 8e11]").replace(
        "[6e11, 9e11]", "[5e11, 8e11, 6e11, 9e11]").replace(
        '"threads": 2}', '"threads": 2, "attention_seq_s": 6e-07, "attention_kv_s": 2e-12}')
    e = cpu_measure.EngineRates.from_json(at_k)
    assert e.matmul_k == (576, 2048) and e.matmul_flops["int8act"] == [5e11, 8e11, 6e11, 9e11]
    assert (e.attention_seq_s, e.attention_kv_s) == (6e-7, 2e-12)
    hw = measured_cpu(mem_bytes_per_s=5e10, engine=e, threads=2)
    assert (hw.matmul_k, hw.attention_seq_s, hw.attention_kv_s) == ((576, 2048), 6e-7, 2e-12)
    assert hw.peak_flops("int4-g32-asym", 32, 576) == 5e11
    assert hw.peak_flops("int4-g32-asym", 512, 2048) == 9e11
    assert "(each at K = 576/2048)" in hw.source and "600 ns per sequence" in hw.source
    old = cpu_measure.EngineRates.from_json(ENGINE_JSON)  # one K, no items: as before
    assert old.matmul_k == () and old.attention_seq_s == old.attention_kv_s == 0.0
    assert old.attention_tile_min_group == 0 and "AMX tile" not in hw.source
    tiled = cpu_measure.EngineRates.from_json(at_k.replace('"attention_kv_s": 2e-12', (
        '"attention_kv_s": 2e-12, "attention_tile_flops": 2e11, "attention_tile_kv_s": 1e-12, '
        '"attention_tile_min_group": 8')))
    hw = measured_cpu(mem_bytes_per_s=5e10, engine=tiled, threads=2)
    assert (hw.attention_tile_flops, hw.attention_tile_kv_s, hw.attention_tile_min_group) == (
        2e11, 1e-12, 8)
    assert "on the AMX tile from 8 query heads per KV head: 200 GFLOP/s" in hw.source
    for bad in (at_k.replace("[3e11, 7e11, 4e11, 8e11]", "[3e11, 7e11]"),
                at_k.replace("6e-07", "-6e-07"), at_k.replace("2e-12", "-2e-12")):
        with pytest.raises(ValueError, match="mismatched or negative"):
            cpu_measure.EngineRates.from_json(bad)


def test_engine_rates_carry_the_one_row_linears_weight_rates() -> None:
    gemv = ENGINE_JSON.replace('"threads": 2}', '"threads": 2, "gemv_k": [576, 2048], '
                               '"gemv_bytes_per_s": {"int8act": [3.6e10, 3.9e10]}}')
    e = cpu_measure.EngineRates.from_json(gemv)
    assert e.gemv_k == (576, 2048) and e.gemv_bytes_per_s == {"int8act": [3.6e10, 3.9e10]}
    assert cpu_measure.describe_gemv(e) == "; one-row linears' weight GB/s at K = 576/2048: int8act 36.0/39.0"
    old = cpu_measure.EngineRates.from_json(ENGINE_JSON)  # a probe without them: no floor
    assert old.gemv_k == () and old.gemv_bytes_per_s == {} and cpu_measure.describe_gemv(old) == ""
    for bad in (gemv.replace("[3.6e10, 3.9e10]", "[3.6e10]"), gemv.replace("3.6e10", "0")):
        with pytest.raises(ValueError, match="mismatched or negative"):
            cpu_measure.EngineRates.from_json(bad)


def test_a_failed_engine_probe_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_measure, "ENGINE_RATES_MODULE", "fitserve.no_such_module")
    with pytest.raises(RuntimeError, match="fitserve.no_such_module failed .exit 1.: .*No module"):
        cpu_measure.measure_engine_rates(1)


def test_engine_rates_kept_when_only_the_bandwidth_moved(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A probe that disagrees re-measures the copy bandwidth; the engine's rates (compute,
    seconds to measure) are kept while the CPU, thread count and age still match."""
    monkeypatch.setenv("FITSERVE_HOME", str(tmp_path))
    monkeypatch.setattr(cpu_measure, "cpu_model", lambda: "CPU X")
    monkeypatch.setattr(cpu_measure, "default_threads", lambda: 2)
    monkeypatch.setattr(cpu_measure, "_timed_copies",
                        lambda nbytes, repeats, t, read_only=False: [0.04 if read_only else 0.05] * 3)
    monkeypatch.setattr(cpu_measure, "measure_matmul_flops", lambda: 5e10)
    probes: list[int] = []

    def probe(threads: int) -> cpu_measure.EngineRates:
        probes.append(threads)
        return cpu_measure.EngineRates.from_json(ENGINE_JSON)

    monkeypatch.setattr(cpu_measure, "measure_engine_rates", probe)
    monkeypatch.setattr(cpu_measure, "probe_copy_bandwidth", lambda t=None: 1e9)  # disagrees
    first = cpu_hardware()
    second = cpu_hardware()
    assert probes == [2]  # measured once, kept on the second full measure
    # the memory bandwidth is the read rate (256 MiB summed in 0.04 s), the copy's beside it
    assert first.mem_bytes_per_s == second.mem_bytes_per_s == (256 << 20) / 0.04
    assert "6.7 GB/s read, 10.7 GB/s copy" in second.source and "the read rate" in second.source
    assert second.matmul_rates == (("bf16", (4e11, 8e11)), ("int8act", (6e11, 9e11)))
    assert (second.attention_flops, second.step_overhead_s, second.layer_overhead_s) == (
        9e10, 1e-4, 1.5e-5)
    assert "int8act 600/900" in second.source and "overhead 0.100 ms + 15.0 us per layer" in second.source
    # another thread count: the engine is measured again
    monkeypatch.setattr(cpu_measure, "default_threads", lambda: 1)
    cpu_hardware()
    assert probes == [2, 1]


def test_read_and_copy_bandwidth_count_their_own_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """A copy moves 2 x nbytes per run (read + write), a read nbytes; each figure is the bytes
    over the median of the undisturbed runs (a run 2x the best is dropped)."""
    seen: list[bool] = []

    def runs(nbytes: int, repeats: int, t: int, read_only: bool = False) -> list[float]:
        seen.append(read_only)
        return [0.5, 0.5, 0.55, 1.0]

    monkeypatch.setattr(cpu_measure, "_timed_copies", runs)
    nbytes = 1 << 20
    assert cpu_measure.measure_copy_bandwidth(nbytes, threads=2) == 2 * nbytes / 0.5
    assert cpu_measure.measure_read_bandwidth(nbytes, threads=2) == nbytes / 0.5
    assert seen == [False, True]


def test_a_real_read_is_timed() -> None:
    """The plain read runs for real: a positive, finite rate on 1 and 2 threads."""
    for threads in (1, 2):
        rate = cpu_measure.measure_read_bandwidth(8 << 20, repeats=3, threads=threads)
        assert 1e8 < rate < 1e13
