"""A fleet from a file or a dict: the ``args`` of the Ray Serve config that ``fitserve plan
capacity --emit-ray-config`` writes (what :func:`fitserve.fleet.builder.app_builder` gets from
``serve deploy``), and ``fitserve serve --fleet-config FILE``. No Ray here."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from fitserve.fleet.routing import RoutingPolicy
from fitserve.fleet.spec import FleetSpec, ReplicaGroup, ReplicaSpec


def load_fleet_args(path: str | Path) -> dict[str, Any]:
    """The fleet's args from a JSON or YAML file: a Serve config (its first application's
    ``args``) or the args alone."""
    text = Path(path).read_text()
    data: Any
    if str(path).endswith((".yaml", ".yml")):
        import yaml  # NOTE: Ray Serve's own dependency

        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ValueError(f"{path}: not YAML: {exc}") from None
    else:
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise ValueError(f"{path}: not JSON: {exc}") from None
    if isinstance(data, dict) and isinstance(data.get("applications"), list) and data["applications"]:
        data = data["applications"][0].get("args")
    if not isinstance(data, dict) or not isinstance(data.get("groups"), list):
        raise ValueError(f"{path}: no fleet groups (a Serve config's applications[0].args.groups, or groups)")
    return data


def fleet_spec_from_args(args: dict[str, Any], base: Any = None, settings: Any = None,
                         policy: RoutingPolicy | None = None, chat_template: str | None = None) -> FleetSpec:
    """{model, groups: [{name, num_replicas, num_cpus, num_gpus, accelerator_type, capacity,
    tensor_parallel_size, model?, engine?}], routing?, api_key?, served_model_name?, canary?} as a
    FleetSpec. ``engine``: EngineConfig keyword arguments for that group (e.g. {"dtype":
    "bfloat16", "max_num_seqs": 8, "scheduling_policy": "slo"}); a group's ``model`` replaces the
    fleet's (a canary of another model). ``base``/``settings``: ``fitserve serve``'s own
    EngineConfig, ServerSettings and RoutingPolicy, which the file's keys then change."""
    from fitserve.config import EngineConfig
    from fitserve.server.settings import ServerSettings

    model = str(args.get("model", base.model if base is not None else ""))
    if not model:
        raise ValueError("the fleet config names no model")
    if settings is None:
        settings = ServerSettings(model_name=str(args.get("served_model_name", model)), api_key=args.get("api_key"))
    groups = []
    for g in args["groups"]:
        if not isinstance(g, dict) or "name" not in g or "num_replicas" not in g:
            raise ValueError(f"each fleet group needs a name and num_replicas, got {g!r}")
        engine = dict(g.get("engine") or {})
        engine["tensor_parallel_size"] = int(g.get("tensor_parallel_size", engine.get("tensor_parallel_size", 1)))
        group_model = str(g.get("model", model))
        try:
            config = (EngineConfig(group_model, **engine) if base is None
                      else dataclasses.replace(base, model=group_model, **engine))
        except TypeError as exc:  # an unknown engine key
            raise ValueError(f"fleet group {g['name']!r}: {exc}") from None
        config.validate()
        replica = ReplicaSpec(config, settings, num_cpus=float(g.get("num_cpus", 1)), capacity=g.get("capacity"),
                              chat_template=chat_template, pull_default=group_model == "smollm2-135m")
        groups.append(ReplicaGroup(replica,
                                   num_replicas=int(g["num_replicas"]), name=str(g["name"]),
                                   accelerator_type=g.get("accelerator_type"), num_gpus=float(g.get("num_gpus", 0))))
    policy = policy or RoutingPolicy()
    if "routing" in args:
        policy = dataclasses.replace(policy, mode=args["routing"])
    return FleetSpec(tuple(groups), policy, canary=args.get("canary"))
