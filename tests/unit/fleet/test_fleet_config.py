"""``fitserve serve --fleet-config FILE``: replica groups from the Serve config ``plan capacity
--emit-ray-config`` writes (or its args alone, JSON or YAML), each group's ``engine`` keys over
the command line's engine config; and a rollout's generation as the replica deployment's version
(the next one is Serve's rolling update of the replicas; the ingress keeps its version)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fitserve.config import EngineConfig
from fitserve.fleet.fleet_config import fleet_spec_from_args, load_fleet_args
from fitserve.fleet.routing import RoutingPolicy
from fitserve.server.settings import ServerSettings

ARGS = {"groups": [
    {"name": "big", "num_replicas": 1, "num_cpus": 2},
    {"name": "small", "num_replicas": 2, "num_cpus": 1, "capacity": 0.5,
     "engine": {"scheduling_policy": "slo", "slo_ttft_ms": 5000, "max_num_seqs": 4}},
    {"name": "canary", "num_replicas": 1, "model": "other-model", "engine": {"dtype": "bfloat16"}},
], "canary": {"group": "canary", "stages": [5, 100]}}


def test_groups_take_the_command_lines_config_and_change_their_keys(tmp_path: Path) -> None:
    base = EngineConfig("smollm2-135m", dtype="float32", max_model_len=1024, num_kv_blocks=256)
    settings = ServerSettings(model_name="m", api_key="k")
    path = tmp_path / "serve.yaml"
    path.write_text("applications:\n- name: fitserve\n  import_path: fitserve.fleet.builder:app_builder\n"
                    f"  args: {json.dumps(ARGS)}\n")
    spec = fleet_spec_from_args(load_fleet_args(path), base, settings, RoutingPolicy("least-load"))
    big, small, canary = spec.groups
    assert (big.replica.threads, big.replica.capacity_units, big.num_replicas) == (2, 2.0, 1)
    assert big.replica.config == base
    assert small.capacity_units == 1.0 and small.replica.config.scheduler.scheduling_policy == "slo"
    assert (small.replica.config.scheduler.slo_ttft_ms, small.replica.config.scheduler.max_num_seqs) == (5000, 4)
    assert small.replica.config.cache.num_kv_blocks == 256 and small.replica.config.max_model_len == 1024
    assert (canary.replica.config.model, canary.replica.config.dtype) == ("other-model", "bfloat16")
    assert spec.policy.mode == "least-load" and spec.canary == ARGS["canary"]
    assert big.replica.settings is settings and big.replica.pull_default


def test_bad_fleet_files_are_clear_errors(tmp_path: Path) -> None:
    path = tmp_path / "fleet.json"
    path.write_text(json.dumps({"applications": [{"args": {"model": "m"}}]}))
    with pytest.raises(ValueError, match="no fleet groups"):
        load_fleet_args(path)
    with pytest.raises(ValueError, match="fleet group 'g': .*'no_such_key'"):
        fleet_spec_from_args({"model": "m", "groups": [{"name": "g", "num_replicas": 1,
                                                        "engine": {"no_such_key": 1}}]})
    with pytest.raises(ValueError, match="needs a name and num_replicas"):
        fleet_spec_from_args({"model": "m", "groups": [{"name": "g"}]})


def test_a_rollout_is_a_new_replica_version_and_the_same_ingress() -> None:
    builder = pytest.importorskip("fitserve.fleet.builder", reason="the fitserve[ray] extra is not installed")
    spec = fleet_spec_from_args({"model": "m", "groups": [{"name": "g", "num_replicas": 2}]})
    (group,) = spec.groups
    versions = [builder.build_replica_deployment(spec, group, g).version for g in (0, 1, 1)]
    assert versions[0] != versions[1] == versions[2]
    assert builder.build_replica_deployment(spec, group).version is None  # serve deploy: Serve's own
    deployment = builder.build_replica_deployment(spec, group, 1)
    assert deployment._deployment_config.graceful_shutdown_timeout_s == builder.DRAIN_TIMEOUT_S
    ingress_versions = {builder.build_fitserve_app(spec, g)._bound_deployment.version for g in (0, 1)}
    assert ingress_versions == {"ingress"}
