"""The Serve application, as Ray Serve LLM builds its own: ``build_fitserve_app(spec)`` returns an
``Application`` for ``serve.run`` (a replica deployment bound into an ingress deployment), and
``build_replica_deployment(spec)`` the replicas alone (for a user's own ingress)."""

from __future__ import annotations

import dataclasses
from typing import Any

from ray import serve
from ray.serve import Application
from ray.serve.config import RequestRouterConfig
from ray.serve.deployment import Deployment

from fitserve.fleet.ingress import FleetIngress
from fitserve.fleet.replica import FitserveReplica
from fitserve.fleet.routing import RoutingPolicy
from fitserve.fleet.spec import FleetSpec, ReplicaGroup, ReplicaSpec

ROUTING_STATS_PERIOD_S = 1.0  # how often Serve polls each replica's KV usage and capacity


def replica_deployment_name(spec: FleetSpec, group: ReplicaGroup) -> str:
    return f"{spec.name}-{group.name}"


def build_replica_deployment(spec: FleetSpec, group: ReplicaGroup) -> Deployment:
    """One group's replicas: ``num_replicas`` copies with their CPUs/GPUs, routed by FleetRouter."""
    settings = group.replica.settings
    # NOTE: Serve's per-replica cap (default 5) would hold requests in the ingress while the
    # engine has room; the engine's own queue (max_num_seqs running + max_waiting) is the cap.
    max_ongoing = group.replica.config.scheduler.max_num_seqs + settings.max_waiting
    actor: dict[str, Any] = {"num_cpus": group.replica.num_cpus}
    if group.num_gpus:
        actor["num_gpus"] = group.num_gpus
    if group.accelerator_type:
        actor["accelerator_type"] = group.accelerator_type
    return serve.deployment(FitserveReplica).options(
        name=replica_deployment_name(spec, group), num_replicas=group.num_replicas,
        ray_actor_options=actor, max_ongoing_requests=max_ongoing,
        request_router_config=RequestRouterConfig(
            request_router_class="fitserve.fleet.router.FleetRouter",
            request_router_kwargs={"policy": dataclasses.asdict(spec.policy)},
            request_routing_stats_period_s=ROUTING_STATS_PERIOD_S,
            request_routing_stats_timeout_s=5.0),
        health_check_period_s=2.0, health_check_timeout_s=30.0, graceful_shutdown_timeout_s=30.0,
        graceful_shutdown_wait_loop_s=0.5,  # how often a draining replica checks for requests left
    )


def build_fitserve_app(spec: FleetSpec) -> Application:
    """The fleet as one Serve application (``serve.run(build_fitserve_app(spec))``)."""
    groups = [(replica_deployment_name(spec, g), build_replica_deployment(spec, g).bind(g.replica), g.capacity_units)
              for g in spec.groups]
    ingress = serve.deployment(FleetIngress).options(
        name=f"{spec.name}-ingress", num_replicas=1, ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=100_000)
    return ingress.bind(groups, api_key=spec.groups[0].replica.settings.api_key, policy=spec.policy,
                        max_retries=spec.max_retries)


def app_builder(args: dict[str, Any]) -> Application:
    """Ray Serve's application builder for a config file (``import_path:
    fitserve.fleet.builder:app_builder``, what ``fitserve plan capacity --emit-ray-config``
    writes); ``args`` as :func:`fleet_spec_from_args` reads them."""
    return build_fitserve_app(fleet_spec_from_args(args))


def fleet_spec_from_args(args: dict[str, Any]) -> FleetSpec:
    """{model, groups: [{name, num_replicas, num_cpus, num_gpus, accelerator_type, capacity,
    tensor_parallel_size}], routing?, api_key?, served_model_name?} as a FleetSpec."""
    from fitserve.config import EngineConfig
    from fitserve.server.settings import ServerSettings

    model = str(args["model"])
    settings = ServerSettings(model_name=str(args.get("served_model_name", model)), api_key=args.get("api_key"))
    groups = tuple(
        ReplicaGroup(ReplicaSpec(EngineConfig(model, tensor_parallel_size=int(g.get("tensor_parallel_size", 1))),
                                 settings, num_cpus=float(g.get("num_cpus", 1)), capacity=g.get("capacity")),
                     num_replicas=int(g["num_replicas"]), name=str(g["name"]),
                     accelerator_type=g.get("accelerator_type"), num_gpus=float(g.get("num_gpus", 0)))
        for g in args["groups"])
    return FleetSpec(groups, RoutingPolicy(args.get("routing", "affinity")))
