"""``fitserve plan capacity ... --emit-ray-config FILE``: the capacity plan as a Ray Serve config
file (``serve deploy FILE`` / ``serve run FILE``) for fitserve's fleet: one replica group per
accelerator type, with its replica count, GPUs per replica (the replica's TP size), Ray's
accelerator type and its routing weight in capacity units (``fitserve.fleet.builder:app_builder``
reads it)."""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from fitserve.ledger.errors import PlanError
from fitserve.ledger.hardware import get_hardware


class GpuCapacity(Protocol):
    """What this module reads of capacity.GpuCapacity (not imported: capacity imports this)."""

    @property
    def name(self) -> str: ...
    @property
    def tp(self) -> int: ...
    @property
    def rate(self) -> float: ...
    @property
    def per_gpu(self) -> float: ...

# NOTE: Ray's accelerator type names (ray.util.accelerators.accelerators) for the GPU catalog's
# names; a table, not an import: the planner runs without Ray installed. A test checks each
# value against Ray's own constants where Ray is installed.
RAY_ACCELERATOR_TYPES: dict[str, str] = {
    "a100-40gb": "A100-40G", "a100-80gb": "A100-80G", "h100": "H100", "h200": "H200",
    "b200": "B200", "l40s": "L40S", "mi300x": "AMD-Instinct-MI300X-OAM",
}
BUILDER = "fitserve.fleet.builder:app_builder"


@dataclass(frozen=True)
class GroupPlan:
    """One accelerator type's replicas, as the capacity sheet computed them."""

    gpu: str
    replicas: int
    tp: int
    rate: float  # req/s of one replica at the SLO


def fleet_replicas(fleet: dict[str, float], tp: dict[str, int]) -> dict[str, int]:
    """--fleet GPU=N: whole replicas of each GPU (N // tp)."""
    return {gpu: int(n) // tp[gpu] for gpu, n in fleet.items()}


def demand_replicas(rate: float, demand: float, utilization: float) -> int:
    """Replicas of one GPU that serve ``demand`` req/s at ``utilization`` of their SLO rate."""
    return math.ceil(demand / utilization / rate - 1e-9)


def serve_config(model: str, groups: list[GroupPlan], unit_rps: float, routing: str = "affinity") -> dict[str, Any]:
    """The Ray Serve config file's content (a dict ready for JSON, which is YAML too)."""
    used = [g for g in groups if g.replicas > 0]
    if not used:
        raise PlanError("--emit-ray-config: the plan has no replica to deploy")
    return {"applications": [{
        "name": "fitserve", "route_prefix": "/", "import_path": BUILDER,
        "args": {"model": model, "routing": routing, "groups": [{
            "name": g.gpu, "num_replicas": g.replicas, "num_gpus": g.tp, "tensor_parallel_size": g.tp,
            "num_cpus": 1, "accelerator_type": RAY_ACCELERATOR_TYPES.get(g.gpu, g.gpu.upper()),
            "capacity": round(g.rate / unit_rps, 6)} for g in used]},
    }]}


def write_serve_config(path: str, config: dict[str, Any]) -> None:
    Path(path).write_text(json.dumps(config, indent=2) + "\n")


def emit_ray_config(args: argparse.Namespace, caps: Sequence[GpuCapacity], ref: GpuCapacity,
                    fleet: dict[str, float] | None, util: float) -> None:
    """--emit-ray-config: --fleet's whole replicas per GPU, else --demand-rps on the unit GPU."""
    if fleet is not None:
        named = {get_hardware(n).name: v for n, v in fleet.items()}
        reps = fleet_replicas(named, {g.name: g.tp for g in caps})
    elif args.demand_rps is not None:
        reps = {ref.name: demand_replicas(ref.rate, args.demand_rps, util)}
    else:
        raise PlanError("--emit-ray-config needs --fleet (GPUs owned) or --demand-rps (GPUs to buy)")
    groups = [GroupPlan(g.name, reps.get(g.name, 0), g.tp, g.rate) for g in caps if g.rate > 0]
    write_serve_config(args.emit_ray_config, serve_config(args.model, groups, ref.per_gpu))
