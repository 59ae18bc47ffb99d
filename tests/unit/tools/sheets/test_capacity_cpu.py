"""`fitserve plan capacity --gpus cpu:N`: CPU replicas priced on this CPU's cached figures.

A replica of t threads on a CPU measured with T = 2 gets t/T of every throughput figure (copy
bandwidth, the engine's matmul and attention rates, RAM) and keeps the whole per-step and per-layer
overhead; written out below as a Hardware by hand, then through the ledger's roofline step model
and the capacity sheet's closed forms (its module docstring):

    H = a + c + d P,  K = b (P + O) + c O + d O (P + O/2)
    TPOT (T - H) / (T K);  KV ceiling B: B / (O H + B K);  units = rate / rate of the unit kind
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from fitserve.ledger.errors import PlanError
from fitserve.ledger.hardware import Hardware, cpu_hardware
from fitserve.ledger.step_time import roofline_step_model
from fitserve.tools.planner.model_source import catalog_entry
from fitserve.tools.sheets.sheet import build_sheet
from tests.unit.tools.seeded_cpu import seed_cpu

P, NEW, T = 128, 64, 0.200
SLO = ["SmolLM2-135M", "--slo-tpot-ms", "200", "--slo-ttft-ms", "10000", "--prompt-tokens", "128",
       "--new-tokens", "64", "--max-num-seqs", "8"]


@pytest.fixture()
def seeded_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """This CPU's cache holding FIGURES (2 threads), and a quick probe that agrees with them."""
    seed_cpu(tmp_path, monkeypatch)


def one_thread(memory_bytes: int) -> Hardware:
    """FIGURES' CPU with 1 of its 2 threads, by hand: every rate halved, the overhead whole."""
    return Hardware("cpu:1", memory_bytes // 2, 6.25e9, 1.5e11, None, None, "none", 0.0, 0.0, "",
                    measured=True, cores=1, matmul_rows=(32, 512),
                    matmul_rates=(("bf16", (1.0e11, 1.5e11)), ("f32", (2.5e10, 3e10)),
                                  ("int8act", (2.0e11, 2.5e11))),
                    attention_flops=2.25e10, step_overhead_s=1.25e-4, layer_overhead_s=2.5e-5)


def closed_forms(a: float, b: float, c: float, d: float, seqs: int) -> tuple[float, float]:
    """(TPOT rate, KV-ceiling rate) of the sheet's docstring, by hand."""
    h = a + c + d * P
    k = b * (P + NEW) + c * NEW + d * NEW * (P + NEW / 2)
    return (T - h) / (T * k), seqs / (NEW * h + seqs * k)


def test_cpu_replicas_by_threads_and_weights(seeded_cpu: None) -> None:
    sheet = build_sheet("capacity", [*SLO, "--gpus", "cpu:1,cpu:2", "--weights", "bf16,int4"])
    data = sheet.data
    assert set(data) == {"cpu:1/bf16", "cpu:1/int4", "cpu:2/bf16", "cpu:2/int4", "unit_rps"}
    spec = catalog_entry("SmolLM2-135M").spec
    hw1 = one_thread(cpu_hardware().memory_bytes)
    for fmt in ("bf16", "int4"):
        m = roofline_step_model(spec, hw1, weight_fmt=fmt, kv_dtype="bf16")
        tpot, kv = closed_forms(m.a, m.b, m.c, m.d, 8)
        row = data[f"cpu:1/{fmt}"]
        assert (row["tp"], row["threads"], row["weights"]) == (1, 1, fmt)
        assert row["rate"] == pytest.approx(min(tpot, kv), rel=1e-12)
        assert row["binding"] == ("TPOT" if tpot < kv else "KV pool")
    # the unit is the first kind (cpu:1/bf16); int4 reads ~1/4 of bf16's bytes per decode step,
    # two threads twice the bandwidth and engine rates: more units each way
    unit = data["cpu:1/bf16"]["rate"]
    assert data["unit_rps"] == unit and data["cpu:1/bf16"]["units"] == 1.0
    for name in ("cpu:1/int4", "cpu:2/bf16", "cpu:2/int4"):
        assert data[name]["units"] == pytest.approx(data[name]["rate"] / unit, rel=1e-12)
    assert data["cpu:1/int4"]["units"] > 1.5 and data["cpu:2/bf16"]["units"] > 1.5
    assert data["cpu:2/int4"]["units"] > max(data["cpu:1/int4"]["units"], data["cpu:2/bf16"]["units"])
    # two threads: the bandwidth-bound step part halves, the overhead (125 us + 30 x 25 us) stays
    m1 = roofline_step_model(spec, hw1, weight_fmt="bf16", kv_dtype="bf16")
    hw2 = cpu_hardware()
    m2 = roofline_step_model(spec, hw2, weight_fmt="bf16", kv_dtype="bf16")
    assert m1.a - 875e-6 == pytest.approx(2 * (m2.a - 875e-6), rel=1e-9)


def test_ray_config_carries_the_cpu_units_and_threads(seeded_cpu: None, tmp_path: Path) -> None:
    out = tmp_path / "serve.json"
    sheet = build_sheet("capacity", [*SLO, "--gpus", "cpu:2,cpu:1", "--weights", "bf16,int4",
                                     "--unit-gpu", "cpu:1/bf16", "--fleet",
                                     "cpu:2/bf16=1,cpu:1/int4=2,cpu:1/bf16=1",
                                     "--emit-ray-config", str(out)])
    groups = {g["name"]: g for g in json.loads(out.read_text())["applications"][0]["args"]["groups"]}
    assert set(groups) == {"cpu-2-bf16", "cpu-1-int4", "cpu-1-bf16"}  # no cpu:2/int4 owned
    unit = sheet.data["cpu:1/bf16"]["rate"]
    for name, threads, fmt, reps in (("cpu:2/bf16", 2, "bf16", 1), ("cpu:1/int4", 1, "int4", 2),
                                     ("cpu:1/bf16", 1, "bf16", 1)):
        g = groups[name.replace(":", "-").replace("/", "-")]
        assert (g["num_replicas"], g["num_cpus"], g["num_gpus"], g["engine"]) == (
            reps, threads, 0, {"weights": fmt})
        assert "accelerator_type" not in g
        assert g["capacity"] == pytest.approx(sheet.data[name]["rate"] / unit, abs=1e-6)
    assert groups["cpu-1-bf16"]["capacity"] == 1.0
    assert groups["cpu-1-int4"]["capacity"] > 1.0 and groups["cpu-2-bf16"]["capacity"] > 1.0
    fleet_config = pytest.importorskip("fitserve.fleet.fleet_config")
    spec = fleet_config.fleet_spec_from_args(json.loads(out.read_text())["applications"][0]["args"])
    by = {g.name: g for g in spec.groups}
    assert by["cpu-2-bf16"].replica.threads == 2 and by["cpu-1-int4"].replica.config.weights == "int4"
    assert by["cpu-1-int4"].replica.capacity_units == groups["cpu-1-int4"]["capacity"]


def test_one_format_keeps_the_device_names_and_a_gpu_beside_a_cpu(seeded_cpu: None) -> None:
    sheet = build_sheet("capacity", [*SLO, "--gpus", "cpu:1,h100", "--weights", "bf16"])
    assert {"cpu:1", "h100"} <= set(sheet.data)
    assert sheet.data["h100"]["units"] > 100 * sheet.data["cpu:1"]["units"] == 100.0
    plain = build_sheet("capacity", [*SLO, "--gpus", "cpu", "--weights", "bf16"])
    assert plain.data["cpu:2"]["threads"] == 2  # cpu alone: every thread it was measured with


@pytest.mark.parametrize(("extra", "message"), [
    (["--gpus", "cpu:3"], "measured with 2 threads"),
    (["--gpus", "cpu:0"], "at least 1 thread"),
    (["--gpus", "cpu:1", "--weights", "bf16,int4", "--unit-gpu", "cpu:1"], "names several of"),
    (["--gpus", "cpu:1", "--unit-gpu", "cpu:2"], "--unit-gpu cpu:2 is not one of --gpus (cpu:1)"),
    (["--gpus", "cpu:1", "--weights", "bf16,q4_1", "--fleet", "cpu:1/bf16=1",
      "--emit-ray-config", "x.json"], "does not convert weights to 'q4_1'"),
])
def test_bad_cpu_kinds_name_the_problem(seeded_cpu: None, extra: list[str], message: str) -> None:
    with pytest.raises(PlanError, match=re.escape(message)):
        build_sheet("capacity", [*SLO, *extra])


def test_units_follow_the_kv_ceiling_where_it_binds(seeded_cpu: None) -> None:
    """One thread each, a ceiling of 4 vs 1 sequence (the e2e fleet's two groups): B / (O H + B K)
    with B = 4 and 1, so the 4-sequence replica is worth 4 (O H + K) / (O H + 4 K) units."""
    args = ["SmolLM2-135M", "--gpus", "cpu:1", "--slo-tpot-ms", "1000", "--slo-ttft-ms", "600000",
            "--prompt-tokens", "8", "--new-tokens", "24", "--weights", "q4_1"]
    big = build_sheet("capacity", [*args, "--max-num-seqs", "4"]).data["cpu:1"]
    small = build_sheet("capacity", [*args, "--max-num-seqs", "1"]).data["cpu:1"]
    assert big["binding"] == small["binding"] == "KV pool"
    m = roofline_step_model(catalog_entry("SmolLM2-135M").spec,
                            one_thread(cpu_hardware().memory_bytes), weight_fmt="q4_1")
    h = m.a + m.c + m.d * 8
    k = m.b * 32 + m.c * 24 + m.d * 24 * 20
    assert big["rate"] / small["rate"] == pytest.approx(4 * (24 * h + k) / (24 * h + 4 * k), rel=1e-12)
    assert 3 < big["rate"] / small["rate"] < 4
    assert math.isclose(small["rate"], 1 / (24 * h + k), rel_tol=1e-12)


def test_a_replica_of_fewer_threads_takes_its_share_of_every_cpu_figure() -> None:
    """Half the threads: half the rates, twice the per-item costs of the decode attention
    (its work items spread over the cores as its FLOPs do)."""
    from fitserve.tools.sheets.capacity_kinds import cpu_replica_hardware

    hw = Hardware("cpu", 1 << 34, 20e9, 100e9, None, None, "none", 0.0, 0.0, "test", cores=4,
                  matmul_rows=(32,), matmul_rates=(("bf16", (400e9,)),), attention_flops=80e9,
                  attention_seq_s=5e-7, attention_kv_s=2e-12, attention_tile_flops=300e9,
                  attention_tile_kv_s=3e-12, attention_tile_min_group=8)
    half = cpu_replica_hardware(hw, 2)
    assert (half.cores, half.matmul_rates, half.attention_flops) == (2, (("bf16", (200e9,)),),
                                                                    40e9)
    assert (half.attention_seq_s, half.attention_kv_s) == (1e-6, 4e-12)
    assert (half.attention_tile_flops, half.attention_tile_kv_s,
            half.attention_tile_min_group) == (150e9, 6e-12, 8)
