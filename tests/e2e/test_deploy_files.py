"""The deployment files (deploy/), checked as far as a machine without docker or systemd allows:
they parse, the dashboard queries only series the server exports (scraped from the shared
server), Prometheus targets the port the service listens on, and every command line in them
parses with the CLI's own argparse."""

from __future__ import annotations

import configparser
import json
import re
import shlex
from pathlib import Path
from typing import Any

import httpx
import yaml

from fitserve.cli.main import build_parser
from tests.e2e.conftest import Server

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
METRIC = re.compile(r"\b((?:vllm:|fitserve_)[a-zA-Z0-9_:]+)")


def _serve_args(argv: list[str]) -> Any:
    """``fitserve serve ...`` parsed by the CLI's parser (argparse exits on an unknown flag)."""
    assert Path(argv[0]).name == "fitserve" and argv[1] == "serve", argv
    return build_parser().parse_args(argv[1:])


def test_dashboard_queries_only_exported_series(server: Server, auth: dict[str, str]) -> None:
    dash = json.loads((DEPLOY / "grafana" / "fitserve.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    assert len(exprs) >= 20 and len({p["id"] for p in dash["panels"]}) == len(dash["panels"])
    text = httpx.get(f"{server.url}/metrics", headers=auth, timeout=10).text
    exported = {m.group(1) for m in re.finditer(r"^([^\s{#]+)", text, re.M)}
    queried = {name for e in exprs for name in METRIC.findall(e)}
    assert queried and queried <= exported, sorted(queried - exported)
    # the model_name selector matches the series' label (the template variable's source)
    assert all('model_name="$model_name"' in e for e in exprs if "vllm:" in e)
    var = dash["templating"]["list"][0]
    assert var["name"] == "model_name" and METRIC.findall(var["definition"])[0] in exported
    ds_uids = {p["datasource"]["uid"] for p in dash["panels"]}
    provisioned = yaml.safe_load((DEPLOY / "grafana/provisioning/datasources/prometheus.yaml").read_text())
    assert ds_uids == {provisioned["datasources"][0]["uid"]}


def test_compose_prometheus_and_grafana_wiring() -> None:
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    services = compose["services"]
    assert set(services) == {"fitserve", "prometheus", "grafana"}
    fs = services["fitserve"]
    args = _serve_args(fs["command"])
    assert args.host == "0.0.0.0" and args.metrics_public  # Prometheus scrapes without the key
    assert f"{args.port}:{args.port}" in fs["ports"] and "FITSERVE_API_KEY" in fs["environment"]
    assert (DEPLOY / fs["build"]["context"] / fs["build"]["dockerfile"]).is_file()
    # Prometheus: its config is the mounted file, and it targets the service on its port
    mounts = dict(v.rsplit(":", 2)[:2] if v.endswith(":ro") else v.split(":", 1)
                  for v in services["prometheus"]["volumes"])
    prom_file = next(src for src, dst in mounts.items() if dst == "/etc/prometheus/prometheus.yml")
    prom = yaml.safe_load((DEPLOY / prom_file).read_text())
    job = prom["scrape_configs"][0]
    assert job["metrics_path"] == "/metrics"
    assert job["static_configs"][0]["targets"] == [f"fitserve:{args.port}"]
    # Grafana: provisioning and the dashboard file are mounted where the provider looks
    gmounts = dict(v.removesuffix(":ro").split(":", 1) for v in services["grafana"]["volumes"])
    provider = yaml.safe_load((DEPLOY / "grafana/provisioning/dashboards/fitserve.yaml").read_text())
    dash_dir = provider["providers"][0]["options"]["path"]
    assert any(dst.startswith(dash_dir + "/") and (DEPLOY / src).is_file() for src, dst in gmounts.items())
    assert gmounts["./grafana/provisioning"] == "/etc/grafana/provisioning"


def test_systemd_unit_and_dockerfile_command_lines_parse() -> None:
    unit = configparser.ConfigParser(interpolation=None, strict=True)
    unit.optionxform = str  # type: ignore[assignment,method-assign]  # systemd keys are case-sensitive
    unit.read_string((DEPLOY / "fitserve.service").read_text())
    svc = unit["Service"]
    args = _serve_args(shlex.split(svc["ExecStart"]))
    assert args.host == "0.0.0.0" and args.api_key is None  # the key comes from the environment
    assert "FITSERVE_API_KEY" in (DEPLOY / "fitserve.service").read_text()
    assert shlex.split(svc["ExecStartPre"])[1:] == ["-m", "fitserve.kernels.cpu.build"]
    assert int(svc["TimeoutStopSec"]) > args.shutdown_timeout  # SIGTERM drains before SIGKILL
    docker = (DEPLOY / "Dockerfile").read_text()
    cmd = json.loads(re.search(r"^CMD (\[.*\])$", docker, re.M).group(1))  # type: ignore[union-attr]
    assert _serve_args(cmd).host == "0.0.0.0"
    torch_pin = re.search(r'"torch==([\d.]+)"', (DEPLOY.parent / "pyproject.toml").read_text()).group(1)  # type: ignore[union-attr]
    assert f"torch=={torch_pin} --index-url https://download.pytorch.org/whl/cpu" in docker
    assert "python -m fitserve.kernels.cpu.build" in docker and "fitserve pull smollm2-135m" in docker
