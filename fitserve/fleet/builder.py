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
from fitserve.fleet.spec import FleetSpec

ROUTING_STATS_PERIOD_S = 1.0  # how often Serve polls each replica's KV usage and capacity


def replica_deployment_name(spec: FleetSpec) -> str:
    return f"{spec.name}-replica"


def build_replica_deployment(spec: FleetSpec) -> Deployment:
    """The replicas: ``num_replicas`` copies, ``num_cpus`` each, routed by FleetRouter."""
    settings = spec.replicas.settings
    # NOTE: Serve's per-replica cap (default 5) would hold requests in the ingress while the
    # engine has room; the engine's own queue (max_num_seqs running + max_waiting) is the cap.
    max_ongoing = spec.replicas.config.scheduler.max_num_seqs + settings.max_waiting
    return serve.deployment(FitserveReplica).options(
        name=replica_deployment_name(spec), num_replicas=spec.num_replicas,
        ray_actor_options={"num_cpus": spec.replicas.num_cpus}, max_ongoing_requests=max_ongoing,
        request_router_config=RequestRouterConfig(
            request_router_class="fitserve.fleet.router.FleetRouter",
            request_router_kwargs={"policy": dataclasses.asdict(spec.policy)},
            request_routing_stats_period_s=ROUTING_STATS_PERIOD_S,
            request_routing_stats_timeout_s=5.0),
        health_check_period_s=2.0, health_check_timeout_s=30.0, graceful_shutdown_timeout_s=30.0,
    )


def build_fitserve_app(spec: FleetSpec | dict[str, Any]) -> Application:
    """The fleet as one Serve application (``serve.run(build_fitserve_app(spec))``)."""
    if isinstance(spec, dict):
        spec = FleetSpec(**spec)
    settings = spec.replicas.settings
    ingress = serve.deployment(FleetIngress).options(
        name=f"{spec.name}-ingress", num_replicas=1, ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=100_000)
    return ingress.bind(build_replica_deployment(spec).bind(spec.replicas), replica_deployment_name(spec),
                        api_key=settings.api_key, max_retries=spec.max_retries)
