"""``fitserve plan capacity ... --emit-ray-config FILE``: the capacity plan as a Ray Serve config
file (``serve deploy FILE`` / ``serve run FILE``) for fitserve's fleet: one replica group per
accelerator type, with its replica count, GPUs per replica (the replica's TP size), Ray's
accelerator type and its routing weight in capacity units (``fitserve.fleet.builder:app_builder``
reads it). A CPU replica kind (``cpu:N``) is a group of N CPUs each, no GPU; where kinds differ in
weight format, each group's engine holds its own (``weights``)."""

from __future__ import annotations

import argparse
import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from fitserve.ledger.errors import PlanError
from fitserve.tools.sheets.capacity_kinds import ReplicaKind, find_kind


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
    @property
    def threads(self) -> int: ...
    @property
    def weights(self) -> str: ...

# NOTE: Ray's accelerator type names (ray.util.accelerators.accelerators) for the GPU catalog's
# names; a table, not an import: the planner runs without Ray installed. A test checks each
# value against Ray's own constants where Ray is installed.
RAY_ACCELERATOR_TYPES: dict[str, str] = {
    "a100-40gb": "A100-40G", "a100-80gb": "A100-80G", "h100": "H100", "h200": "H200",
    "b200": "B200", "l40s": "L40S", "mi300x": "AMD-Instinct-MI300X-OAM",
}
BUILDER = "fitserve.fleet.builder:app_builder"
# the planner's weight formats the engine holds at load (EngineConfig.weights), by name
ENGINE_WEIGHTS = {"bf16": "bf16", "f16": "float16", "fp16": "float16", "f32": "float32",
                  "fp32": "float32", "float32": "float32", "int4": "int4", "int8": "int8",
                  "fp8": "fp8"}


@dataclass(frozen=True)
class GroupPlan:
    """One accelerator type's replicas, as the capacity sheet computed them."""

    gpu: str
    replicas: int
    tp: int
    rate: float  # req/s of one replica at the SLO
    threads: int = 0  # a CPU replica's threads (0: a GPU replica)
    weights: str | None = None  # the engine's weights, where the kinds differ in format


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
        "args": {"model": model, "routing": routing, "groups": [_group(g, unit_rps) for g in used]},
    }]}


def _group(g: GroupPlan, unit_rps: float) -> dict[str, Any]:
    """One group of the Serve config: a GPU replica (its TP size in GPUs, Ray's accelerator
    type) or a CPU one (its threads in CPUs: the replica runs that many torch threads)."""
    out: dict[str, Any] = {"name": re.sub(r"[^a-z0-9_-]+", "-", g.gpu.lower()),
                           "num_replicas": g.replicas}
    if g.threads:
        out |= {"num_cpus": g.threads, "num_gpus": 0, "tensor_parallel_size": 1}
    else:
        out |= {"num_gpus": g.tp, "tensor_parallel_size": g.tp, "num_cpus": 1,
                "accelerator_type": RAY_ACCELERATOR_TYPES.get(g.gpu, g.gpu.upper())}
    if g.weights is not None:
        out["engine"] = {"weights": g.weights}
    out["capacity"] = round(g.rate / unit_rps, 6)
    return out


def write_serve_config(path: str, config: dict[str, Any]) -> None:
    Path(path).write_text(json.dumps(config, indent=2) + "\n")


def _engine_weights(caps: Sequence[GpuCapacity]) -> dict[str, str | None]:
    """Each kind's engine weights where the kinds differ in format (else None: the model's own)."""
    if len({g.weights for g in caps}) < 2:
        return {g.name: None for g in caps}
    out: dict[str, str | None] = {}
    for g in caps:
        if g.weights.lower() not in ENGINE_WEIGHTS:
            raise PlanError(f"--emit-ray-config: the engine does not convert weights to "
                            f"{g.weights!r} at load (it does {', '.join(sorted(ENGINE_WEIGHTS))}); "
                            f"compare one format, the model file's own, or those")
        out[g.name] = ENGINE_WEIGHTS[g.weights.lower()]
    return out


def emit_ray_config(args: argparse.Namespace, caps: Sequence[GpuCapacity], ref: GpuCapacity,
                    fleet: dict[str, float] | None, util: float, kinds: list[ReplicaKind]) -> None:
    """--emit-ray-config: --fleet's whole replicas per kind, else --demand-rps on the unit's."""
    if fleet is not None:
        named = {find_kind("--fleet", n, kinds).name: v for n, v in fleet.items()}
        reps = fleet_replicas(named, {g.name: g.tp for g in caps})
    elif args.demand_rps is not None:
        reps = {ref.name: demand_replicas(ref.rate, args.demand_rps, util)}
    else:
        raise PlanError("--emit-ray-config needs --fleet (GPUs owned) or --demand-rps (GPUs to buy)")
    engine = _engine_weights(caps)
    groups = [GroupPlan(g.name, reps.get(g.name, 0), g.tp, g.rate, g.threads, engine[g.name])
              for g in caps if g.rate > 0]
    write_serve_config(args.emit_ray_config, serve_config(args.model, groups, ref.per_gpu))
