"""A real `fitserve serve` subprocess for the e2e tests, plus helpers to read its metrics."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

API_KEY = "test-key"
MODEL = "smollm2-135m"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Server:
    """A running server: its URL, process and log file."""

    url: str
    proc: subprocess.Popen[bytes]
    log: Path

    def metric(self, name: str, labels: str = "") -> float:
        """The value of one sample in /metrics (``labels`` as written, e.g. '{status="503"}')."""
        # /metrics needs the API key when the server has one (ignored by servers without)
        text = httpx.get(f"{self.url}/metrics", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=10).text
        m = re.search(rf"^{re.escape(name + labels)} (\S+)$", text, re.M)
        return float(m.group(1)) if m else 0.0

    def wait_idle(self, timeout: float = 30.0) -> None:
        """Wait until no request runs or waits and every KV block is free; fail otherwise."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            used = self.metric("fitserve_kv_blocks_used")
            busy = self.metric("fitserve_num_requests_running") + self.metric("fitserve_num_requests_waiting")
            if used == 0 and busy == 0:
                return
            time.sleep(0.2)
        raise AssertionError(f"server not idle after {timeout}s: {used} KV blocks still used")


def start_server(tmp: Path, *extra: str, module: str = "fitserve.cli") -> Server:
    """Start `python -m fitserve.cli serve` (or ``module``'s entry point to it, e.g. the test
    faults' tests.faults) on a free port and wait for /health."""
    port = free_port()
    log = tmp / f"server-{port}.log"
    cmd = [sys.executable, "-m", module, "serve", "--port", str(port), "--dtype", "float32",
           "--max-model-len", "1024", "--num-kv-blocks", "256", "--log-level", "warning", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{log.read_text()}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return Server(url, proc, log)
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    proc.kill()
    raise RuntimeError(f"server did not become healthy:\n{log.read_text()}")


def stop_server(server: Server) -> int:
    if server.proc.poll() is None:
        server.proc.send_signal(signal.SIGTERM)
        try:
            server.proc.wait(60)
        except subprocess.TimeoutExpired:
            server.proc.kill()
            server.proc.wait()
    return server.proc.returncode


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """One server for the session, with an API key so 401 can be tested, and vLLM's qwen3
    reasoning parser (an output that does not open <think> is unchanged by it)."""
    srv = start_server(tmp_path_factory.mktemp("server"), "--api-key", API_KEY,
                       "--max-body-bytes", "65536", "--reasoning-parser", "qwen3")
    yield srv
    code = stop_server(srv)
    assert code == 0, srv.log.read_text()[-4000:]


@pytest.fixture(scope="session")
def client(server: Server):  # type: ignore[no-untyped-def]
    """The official OpenAI client pointed at the test server."""
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {API_KEY}"}
