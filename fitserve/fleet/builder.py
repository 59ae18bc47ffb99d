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

from fitserve.fleet.fleet_config import fleet_spec_from_args
from fitserve.fleet.ingress import FleetIngress
from fitserve.fleet.replica import FitserveReplica
from fitserve.fleet.spec import FleetSpec, ReplicaGroup

DRAIN_TIMEOUT_S = 30.0  # a replaced replica's running requests get this long to finish
ROUTING_STATS_PERIOD_S = 1.0  # how often Serve polls each replica's KV usage and capacity


def replica_deployment_name(spec: FleetSpec, group: ReplicaGroup) -> str:
    return f"{spec.name}-{group.name}"


def build_replica_deployment(spec: FleetSpec, group: ReplicaGroup, generation: int | None = None) -> Deployment:
    """One group's replicas: ``num_replicas`` copies with their CPUs/GPUs, routed by FleetRouter.

    ``generation``: pin the deployment's version to it, so that a redeploy with the next one is
    Serve's rolling update of these replicas (and one with the same, none); None leaves the
    version to Serve (a config file's ``serve deploy``)."""
    settings = group.replica.settings
    # NOTE: Serve's per-replica cap (default 5) would hold requests in the ingress while the
    # engine has room; the engine's own queue (max_num_seqs running + max_waiting) is the cap.
    max_ongoing = group.replica.config.scheduler.max_num_seqs + settings.max_waiting
    actor: dict[str, Any] = {"num_cpus": group.replica.num_cpus}
    if group.num_gpus:
        actor["num_gpus"] = group.num_gpus
    if group.accelerator_type:
        actor["accelerator_type"] = group.accelerator_type
    versioned: dict[str, Any] = {} if generation is None else {"version": f"gen-{generation}", "_internal": True}
    return serve.deployment(FitserveReplica).options(
        **versioned, name=replica_deployment_name(spec, group), num_replicas=group.num_replicas,
        ray_actor_options=actor, max_ongoing_requests=max_ongoing,
        request_router_config=RequestRouterConfig(
            request_router_class="fitserve.fleet.router.FleetRouter",
            request_router_kwargs={"policy": dataclasses.asdict(spec.policy)},
            request_routing_stats_period_s=ROUTING_STATS_PERIOD_S,
            request_routing_stats_timeout_s=5.0),
        health_check_period_s=2.0, health_check_timeout_s=30.0,
        # NOTE: a replaced replica (rolling update, scale-down) takes no new request, and Serve
        # waits for its running ones (a stream counts until its last chunk), checking every
        # wait_loop_s, for up to timeout_s (then it is killed and its streams end with an error
        # event); fitserve serve's own --shutdown-timeout is 30 s too
        graceful_shutdown_timeout_s=DRAIN_TIMEOUT_S, graceful_shutdown_wait_loop_s=0.5,
    )


def build_fitserve_app(spec: FleetSpec, generation: int | None = None) -> Application:
    """The fleet as one Serve application (``serve.run(build_fitserve_app(spec))``).

    ``generation`` (``fitserve serve --replicas``): the replicas' rollout generation; the
    ingress's version is pinned then, so a rollout replaces the replicas and keeps the ingress
    (its routing state, a canary's counts)."""
    groups = [(replica_deployment_name(spec, g),
               build_replica_deployment(spec, g, generation).bind(
                   dataclasses.replace(g.replica, generation=generation or 0)),
               g.capacity_units)
              for g in spec.groups]
    pinned: dict[str, Any] = {} if generation is None else {"version": "ingress", "_internal": True}
    ingress = serve.deployment(FleetIngress).options(
        **pinned, name=f"{spec.name}-ingress", num_replicas=1, ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=100_000)
    return ingress.bind(groups, api_key=spec.groups[0].replica.settings.api_key, policy=spec.policy,
                        max_retries=spec.max_retries, generation=generation or 0, canary=spec.canary)


def app_builder(args: dict[str, Any]) -> Application:
    """Ray Serve's application builder for a config file (``import_path:
    fitserve.fleet.builder:app_builder``, what ``fitserve plan capacity --emit-ray-config``
    writes); ``args`` as :func:`fleet_spec_from_args` reads them."""
    return build_fitserve_app(fleet_spec_from_args(args))


__all__ = ["app_builder", "build_fitserve_app", "build_replica_deployment", "fleet_spec_from_args"]
