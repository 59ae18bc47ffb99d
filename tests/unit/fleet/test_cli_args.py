"""``fitserve serve --replicas``'s flags: bad values are clear errors before any Ray or model work,
and the flags reach the fleet's spec (threads per replica, capacity, routing, memory share)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from fitserve.cli.main import build_parser, main
from fitserve.config import EngineConfig
from fitserve.fleet.spec import ReplicaSpec, share_host_memory
from fitserve.server.settings import ServerSettings


@pytest.mark.parametrize(("argv", "message"), [
    (["--replicas", "0"], "must be >= 1"),
    (["--replicas", "2", "--routing", "random"], "invalid choice"),
])
def test_bad_replica_flags_are_argparse_errors(argv: list[str], message: str,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["serve", *argv])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_threads_with_replicas_is_refused_before_ray_starts(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--replicas", "2", "--threads", "2"]) == 2
    assert "--replicas takes no --threads" in capsys.readouterr().err


def test_replica_spec_threads_capacity_and_memory_share() -> None:
    args = build_parser().parse_args(["serve", "--replicas", "3", "--replica-cpus", "2",
                                      "--routing", "least-load", "--gpu-memory-utilization", "0.6"])
    assert (args.replicas, args.replica_cpus, args.routing) == (3, 2.0, "least-load")
    spec = ReplicaSpec(EngineConfig(), ServerSettings(), num_cpus=args.replica_cpus)
    assert (spec.threads, spec.capacity_units) == (2, 2.0)
    assert dataclasses.replace(spec, capacity=0.5).capacity_units == 0.5
    config = EngineConfig(host_memory_utilization=0.6)
    assert share_host_memory(config, 3).cache.host_memory_utilization == pytest.approx(0.2)
    assert share_host_memory(EngineConfig(), 3) == EngineConfig()  # the fixed default pool: per replica


def test_a_bad_fleet_config_is_refused_before_ray_starts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = f"{tmp_path}/nope.json"
    assert main(["serve", "--fleet-config", missing]) == 2
    assert "nope.json" in capsys.readouterr().err
    bad = f"{tmp_path}/bad.json"
    with open(bad, "w") as f:
        f.write('{"groups": [{"name": "g", "num_replicas": 1, "engine": {"max_num_seqs": 0}}]}')
    assert main(["serve", "--fleet-config", bad]) == 2
    assert "max_num_seqs" in capsys.readouterr().err
