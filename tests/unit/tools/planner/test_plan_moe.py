"""`fitserve plan` and `fitserve plan capacity` for every MoE model of the catalog, in process:
the MoE section's figures recomputed from the ledger, and `plan capacity gpt-oss-20b`, which
exited 2 before ("unknown weight format 'gpt-oss-mxfp4'" in the roofline step model)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from fitserve.cli.main import main as fitserve_main
from fitserve.ledger import runtime
from fitserve.ledger.hardware import get_hardware
from fitserve.ledger.moe import active_bytes, expected_experts_touched
from fitserve.ledger.step_time import roofline_step_model
from fitserve.ledger.weights import model_weight_bytes
from fitserve.loading.support import spec_problems
from fitserve.tools.planner.cli import main
from fitserve.tools.planner.layouts import LayoutQuery, candidate_layouts
from fitserve.tools.planner.model_source import catalog_entry, load_catalog
from fitserve.tools.sheets._rates import Workload
from fitserve.tools.sheets.capacity_steps import rates
from fitserve.tools.sheets.sheet import build_sheet

SLO = ["--slo-tpot-ms", "50", "--slo-ttft-ms", "500"]
# per model: flags that make the plan fit (weights: gpt-oss-20b 12.8 GiB, -120b 60.8 GiB,
# Qwen3-30B-A3B 56.9 GiB, Mixtral 87.0 GiB in bf16, DeepSeek-V3 625 GiB in fp8)
# (gpt-oss-20b at tp 2: its MXFP4 experts split only at whole 32-column blocks, and
# 2880 / 4 = 720 columns is 22.5 of them: the engine refuses --tp 4, so the planner does too)
FITS = {"gpt-oss-20b": ["--gpus", "2", "--tp", "2"], "gpt-oss-120b": [],
        "Qwen3-30B-A3B": ["--gpus", "2", "--tp", "2"], "Mixtral-8x7B": ["--gpus", "2", "--tp", "2"],
        "DeepSeek-V3": ["--gpu", "h200", "--gpus", "8", "--tp", "8"]}
CAPACITY_GPUS = {"DeepSeek-V3": ["--gpus", "h200"]}


def test_every_catalog_moe_model_is_listed() -> None:
    moe = {m["name"] for m in load_catalog() if catalog_entry(m["name"]).spec.num_experts}
    assert moe == set(FITS)


def test_plan_capacity_gpt_oss_20b(capsys: pytest.CaptureFixture[str]) -> None:
    """Exit 2 before this change; now the steady-state step of the TPOT-bound replica."""
    assert fitserve_main(["plan", "capacity", "gpt-oss-20b", *SLO]) == 0
    sh = build_sheet("capacity", ["gpt-oss-20b", *SLO])
    sec = {ln.name: ln for ln in sh.sections[0].lines}
    n = sec["MoE: tokens per step at capacity, experts read"].value
    assert isinstance(n, int) and n > 1
    # the step model reads the experts an n-token step touches, and n is the fixed point:
    # an (n-1)-token model's capacity carries >= n-1 tokens a step, the n-token one's <= n
    spec = catalog_entry("gpt-oss-20b").spec
    model = roofline_step_model(spec, "h100", weight_fmt="gpt-oss-mxfp4", step_tokens=n)
    assert sec["step-time model"].value == model.describe()
    w = Workload(1024, 256, 0.050, 0.500, 9)
    kv_seqs = sec["KV ceiling, sequences of 1,280"].value
    assert isinstance(kv_seqs, int)
    below = roofline_step_model(spec, "h100", weight_fmt="gpt-oss-mxfp4", step_tokens=n - 1)
    assert rates(below, w, kv_seqs).step_tokens(w) >= n - 1
    assert rates(model, w, kv_seqs).step_tokens(w) <= n
    assert sec["replica capacity at the SLO"].value == pytest.approx(
        rates(model, w, kv_seqs).tpot)  # 67.17 req/s, set by TPOT


def test_plan_step_time_section_of_gpt_oss_20b(capsys: pytest.CaptureFixture[str]) -> None:
    """Exit 2 before (the same mix name); the decode step reads the experts 32 tokens touch."""
    plan = _plan(capsys, ["gpt-oss-20b", "--context", "8k", "--concurrency", "32",
                          "--slo-tpot-ms", "50"])
    sec = next(s for s in plan["sections"] if s["title"].startswith("Step time"))
    got = {ln["formula"]: ln["value"] for ln in sec["lines"]}
    spec = catalog_entry("gpt-oss-20b").spec
    m = roofline_step_model(spec, "h100", weight_fmt="gpt-oss-mxfp4", step_tokens=32)
    assert got["StepTimeModel.predict"] == pytest.approx(m.predict(32, 32, 32 * 8192))


def _plan(capsys: pytest.CaptureFixture[str], args: list[str], code: int = 0) -> dict[str, Any]:
    capsys.readouterr()
    assert main([*args, "--json"]) == code
    out: dict[str, Any] = json.loads(capsys.readouterr().out)
    return out


@pytest.mark.parametrize("name", sorted(FITS))
def test_plan_and_capacity_for_every_moe_model(name: str,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    plan = _plan(capsys, [name, *FITS[name], "--context", "4k", "--concurrency", "32"])
    sec = next(s for s in plan["sections"] if s["title"].startswith("Mixture of experts"))
    lines = {ln["name"]: ln for ln in sec["lines"]}
    e = catalog_entry(name)
    s, tp = e.spec, int(FITS[name][FITS[name].index("--tp") + 1]) if "--tp" in FITS[name] else 1
    wb = model_weight_bytes(s, e.native_weights, tp=tp)
    ab = active_bytes(s, model_weight_bytes(s, e.native_weights))
    assert lines["active bytes per token, whole model"]["value"] == ab.per_token
    assert lines[f"weights per GPU (tp={tp})"]["value"] == wb.total
    touched = expected_experts_touched(s.num_experts, s.num_experts_per_token, 32)
    assert lines["experts touched per layer, batch 32"]["value"] == pytest.approx(touched)
    assert lines["decode weight read, batch 1"]["value"] == pytest.approx(
        active_bytes(s, wb).step_read(1))
    assert any("engine: megatron-style" in n for n in sec["notes"])
    if tp > 1:
        assert "engine: megatron-style" in lines[f"TP {tp}, megatron-style"]["shown"]
    capsys.readouterr()
    assert fitserve_main(["plan", "capacity", name, *SLO, *CAPACITY_GPUS.get(name, [])]) == 0


@pytest.mark.parametrize("name", sorted(FITS))
def test_plan_on_cpu_for_every_moe_model(name: str, monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(runtime, "runtime_baseline_bytes", lambda **_: 300 << 20)
    # NOTE: host RAM differs between machines: a what-if memory large enough for each model
    # a model the engine cannot run (yet) is still planned, then refused by name: exit 1
    e = catalog_entry(name)
    refused = bool(spec_problems(e.spec))
    plan = _plan(capsys, [name, "--gpu", "cpu", "--gpu-memory", "4TiB", "--context", "4k"],
                 1 if refused else 0)
    fit = json.dumps(plan["sections"])
    assert ("engine: cannot run" in fit) is refused
    weights = plan["engine"]["weight_bytes"]
    if name.startswith("gpt-oss"):  # experts as stored (MXFP4), the rest bf16: the mix
        assert weights == model_weight_bytes(e.spec, "gpt-oss-mxfp4").total
    else:  # the engine's dtype throughout
        dtype = plan["engine"]["dtype"]
        assert weights == model_weight_bytes(e.spec, dtype, base_dtype=dtype).total


@pytest.mark.parametrize("name", ["gpt-oss-20b", "gpt-oss-120b"])
def test_plan_on_cpu_with_tp_prices_the_engines_scheme(name: str, monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """`plan gpt-oss-* --gpu cpu --tp 2` (it divided by the CPU's absent link bandwidth when
    pricing the pipeline layouts): the TP layout and the engine's Megatron expert split are
    priced, its all-reduces 2 per layer, the per-rank weights the tp=2 ledger's."""
    monkeypatch.setattr(runtime, "runtime_baseline_bytes", lambda **_: 300 << 20)
    plan = _plan(capsys, [name, "--gpu", "cpu", "--gpus", "2", "--tp", "2",
                          "--gpu-memory", "4TiB", "--context", "4k"])
    sec = next(s for s in plan["sections"] if s["title"].startswith("Mixture of experts"))
    lines = {ln["name"]: ln for ln in sec["lines"]}
    s = catalog_entry(name).spec
    assert f"{2 * s.num_layers} collectives/step" in lines["TP 2, megatron-style"]["shown"]
    assert "engine: megatron-style" in lines["TP 2, megatron-style"]["shown"]
    assert lines["weights per GPU (tp=2)"]["value"] == model_weight_bytes(
        s, "gpt-oss-mxfp4", tp=2).total
    layouts = next(x for x in plan["sections"] if x["title"].startswith("Layouts"))
    assert "TP2" in {ln["name"] for ln in layouts["lines"]}


def test_layout_search_offers_only_what_the_engine_splits(capsys: pytest.CaptureFixture[str]
                                                          ) -> None:
    """gpt-oss-20b's MXFP4 experts split at whole 32-column blocks: on 4 GPUs the layouts are
    those with tp 1 or 2 (2880 / 4 = 720 columns is 22.5 blocks); --tp 4 is refused by name,
    in `plan` and `plan capacity`."""
    q = LayoutQuery(4, 4096, 1, "gpt-oss-mxfp4", "bf16")
    got = candidate_layouts(catalog_entry("gpt-oss-20b").spec, get_hardware("h100"), q)
    assert {x.name for x in got} == {"DP4", "PP2xDP2", "PP4", "TP2xDP2", "TP2xPP2"}
    for cmd in (["gpt-oss-20b", "--gpus", "4", "--tp", "4"],
                ["capacity", "gpt-oss-20b", *SLO, "--tp", "4"]):
        capsys.readouterr()
        assert fitserve_main(["plan", *cmd]) == 2
        assert "720 columns per rank is not a whole number of the packed weights' groups " \
               "of 32" in capsys.readouterr().err


@pytest.mark.parametrize("name", sorted(FITS))
def test_plan_capacity_on_cpu_for_every_moe_model(name: str, tmp_path: Any,
                                                  monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """`plan capacity NAME --gpus cpu` answers for every MoE model of the catalog (a capacity,
    or exit 1 naming why this CPU misses the SLO), never an error."""
    from tests.unit.tools.seeded_cpu import seed_cpu

    seed_cpu(tmp_path, monkeypatch)
    code = fitserve_main(["plan", "capacity", name, "--slo-tpot-ms", "5000",
                          "--slo-ttft-ms", "60000", "--gpus", "cpu"])
    out = capsys.readouterr()
    assert code in (0, 1), out.err
    assert "replica capacity" in out.out
