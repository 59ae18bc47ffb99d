"""``fitserve plan capacity --emit-ray-config``: the file carries the sheet's own replica counts
(--fleet's GPUs // tp, or the replicas --demand-rps needs) and routing weights (rate / unit), in
Ray Serve's config schema, with Ray's accelerator type names; and the ingress's choice among
replica groups splits load by capacity units."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from fitserve.fleet.groups import GroupPicker
from fitserve.fleet.routing import RoutingPolicy
from fitserve.tools.sheets.ray_config import RAY_ACCELERATOR_TYPES
from fitserve.tools.sheets.sheet import build_sheet

SLO = ["--slo-tpot-ms", "50", "--slo-ttft-ms", "1000", "--gpus", "h100,a100-80gb"]


def test_fleet_config_has_the_sheets_replicas_and_weights(tmp_path: Path) -> None:
    out = tmp_path / "serve.json"
    sheet = build_sheet("capacity", ["llama-3.1-8b", *SLO, "--fleet", "h100=5,a100-80gb=8",
                                     "--emit-ray-config", str(out)])
    app = json.loads(out.read_text())["applications"][0]
    groups = {g["name"]: g for g in app["args"]["groups"]}
    unit = sheet.data["unit_rps"]
    for gpu, owned in (("h100", 5), ("a100-80gb", 8)):
        row = sheet.data[gpu]
        assert groups[gpu]["num_replicas"] == owned // row["tp"]
        assert groups[gpu]["num_gpus"] == row["tp"] == groups[gpu]["tensor_parallel_size"]
        assert groups[gpu]["capacity"] == pytest.approx(row["rate"] / unit, rel=1e-5)
    assert app["import_path"] == "fitserve.fleet.builder:app_builder"
    schema = pytest.importorskip("ray.serve.schema")
    schema.ServeDeploySchema.model_validate(json.loads(out.read_text()))  # Serve's own file schema
    builder = pytest.importorskip("fitserve.fleet.builder")
    spec = builder.fleet_spec_from_args(app["args"])
    for group in spec.groups:  # the deployments app_builder makes of it
        deployment = builder.build_replica_deployment(spec, group)
        assert deployment.num_replicas == groups[group.name]["num_replicas"]
        assert deployment.ray_actor_options == {"num_cpus": 1, "num_gpus": groups[group.name]["num_gpus"],
                                                "accelerator_type": groups[group.name]["accelerator_type"]}
        assert group.replica.capacity_units == groups[group.name]["capacity"]
    from ray.serve import Application

    assert isinstance(builder.app_builder(app["args"]), Application)


def test_demand_config_buys_the_replicas_the_sheet_says(tmp_path: Path) -> None:
    out = tmp_path / "serve.json"
    sheet = build_sheet("capacity", ["llama-3.1-8b", *SLO, "--demand-rps", "100", "--emit-ray-config", str(out)])
    (group,) = json.loads(out.read_text())["applications"][0]["args"]["groups"]
    assert group["name"] == "h100"
    assert group["num_replicas"] == math.ceil(100 / 0.8 / sheet.data["h100"]["rate"])


def test_emit_without_a_fleet_or_demand_is_a_clear_error(tmp_path: Path) -> None:
    from fitserve.ledger.errors import PlanError

    with pytest.raises(PlanError, match="--emit-ray-config needs --fleet"):
        build_sheet("capacity", ["llama-3.1-8b", *SLO, "--emit-ray-config", str(tmp_path / "x.json")])


def test_accelerator_names_are_rays() -> None:
    accelerators = pytest.importorskip("ray.util.accelerators.accelerators")
    rays = {v for k, v in vars(accelerators).items() if k[:1].isupper() and isinstance(v, str)}
    assert set(RAY_ACCELERATOR_TYPES.values()) <= rays


def test_groups_share_load_by_capacity_units() -> None:
    """With requests held open, least-load group choice gives a 3-unit group three requests
    for each of a 1-unit group's."""
    picker = GroupPicker({"big": 3.0, "small": 1.0}, RoutingPolicy("least-load"))
    for _ in range(40):
        picker.started(picker.order("")[0], "")
    assert picker.in_flight == {"big": 30, "small": 10}
