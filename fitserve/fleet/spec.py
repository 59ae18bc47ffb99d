"""What one replica is built from (:class:`ReplicaSpec`) and the fleet around it
(:class:`FleetSpec`): plain data, picklable, no Ray."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from fitserve.config import EngineConfig
from fitserve.fleet.routing import RoutingPolicy
from fitserve.server.settings import ServerSettings


@dataclass(frozen=True, slots=True)
class ReplicaSpec:
    """One replica: its engine and server settings and the CPUs Ray reserves for it."""

    config: EngineConfig
    settings: ServerSettings
    num_cpus: float = 1.0  # Ray's num_cpus; the engine runs max(1, round(num_cpus)) torch threads
    capacity: float | None = None  # capacity units the router weighs it by (None: its threads)
    chat_template: str | None = None
    warm_up: bool = True
    pull_default: bool = False  # fetch the default model first (on a node that lacks it)
    generation: int = 0  # the rollout it belongs to (POST /fleet/rollout adds one)

    @property
    def threads(self) -> int:
        return max(1, round(self.num_cpus))

    @property
    def capacity_units(self) -> float:
        return float(self.threads) if self.capacity is None else self.capacity


@dataclass(frozen=True, slots=True)
class ReplicaGroup:
    """Identical replicas (one Serve deployment): how many, and the accelerator each takes."""

    replica: ReplicaSpec
    num_replicas: int = 2
    name: str = "replica"
    accelerator_type: str | None = None  # Ray's name (e.g. "H100"): replicas go to such nodes
    num_gpus: float = 0.0  # GPUs per replica (its tensor-parallel size)

    def __post_init__(self) -> None:
        if self.num_replicas < 1:
            raise ValueError(f"--replicas must be >= 1, got {self.num_replicas}")
        if self.replica.num_cpus <= 0:
            raise ValueError(f"--replica-cpus must be > 0, got {self.replica.num_cpus}")

    @property
    def capacity_units(self) -> float:
        return self.num_replicas * self.replica.capacity_units


@dataclass(frozen=True, slots=True)
class FleetSpec:
    """The application: replica groups (one Serve deployment each) behind one ingress."""

    groups: tuple[ReplicaGroup, ...]
    policy: RoutingPolicy = field(default_factory=RoutingPolicy)
    name: str = "fitserve"
    max_retries: int = 2  # another replica tried after a 429/503 or a replica that died
    canary: dict[str, object] | None = None  # POST /fleet/canary's body, started with the fleet

    def __post_init__(self) -> None:
        names = [g.name for g in self.groups]
        if not names or len(set(names)) != len(names):
            raise ValueError(f"a fleet needs one or more replica groups with distinct names, got {names}")

    @property
    def num_replicas(self) -> int:
        return sum(g.num_replicas for g in self.groups)


def share_host_memory(config: EngineConfig, num_replicas: int) -> EngineConfig:
    """The config with its host-memory share divided among replicas that share a host.

    NOTE: with --gpu-memory-utilization each engine's budget is a share of the RAM free at
    start-up; N replicas on one machine would each claim that share. Each gets 1/N of it instead
    (conservative on a multi-node cluster, where a replica has the node to itself). Without it
    the pool is --kv-cache-memory / --num-kv-blocks or the fixed default, per replica.
    """
    share = config.cache.host_memory_utilization
    if share is None or num_replicas == 1:
        return config
    return dataclasses.replace(config, cache=dataclasses.replace(config.cache,
                                                                host_memory_utilization=share / num_replicas))
