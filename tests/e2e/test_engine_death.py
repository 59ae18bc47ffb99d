"""The engine thread dying mid-service (tests.faults' KILL_TOKEN hook): open
requests get an error at once, /health says dead, new requests get 503 without waiting, and the
process exits non-zero on SIGTERM (an orchestrator restarts it)."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx

from tests.e2e.conftest import MODEL, start_server, stop_server
from tests.faults import KILL_TOKEN


def test_a_dead_engine_fails_open_requests_and_refuses_new_ones(tmp_path: Path) -> None:
    srv = start_server(tmp_path, "--max-model-len", "512", module="tests.faults")
    try:
        url = srv.url
        lines: list[str] = []
        started = threading.Event()

        def stream() -> None:
            body = {"model": MODEL, "prompt": "Tell me a story:", "max_tokens": 400, "ignore_eos": True,
                    "stream": True}
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
                assert r.status_code == 200
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        lines.append(line[6:])
                        started.set()

        t = threading.Thread(target=stream)
        t.start()
        assert started.wait(120)
        killer = httpx.post(f"{url}/v1/completions", timeout=120,
                            json={"model": MODEL, "prompt": [KILL_TOKEN, 28], "max_tokens": 4})
        t.join(120)
        assert not t.is_alive(), "the open stream ended"
        assert killer.status_code == 500 and "InjectedEngineDeath" in killer.json()["error"]["message"]
        assert lines[-1] != "[DONE]" and json.loads(lines[-1])["error"]["type"] == "server_error", lines[-3:]

        health = httpx.get(f"{url}/health", timeout=10)
        assert health.status_code == 503 and health.json()["status"] == "dead", health.text
        t0 = time.monotonic()
        for path, body in (("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
            r = httpx.post(f"{url}{path}", json={"model": MODEL, **body}, timeout=10)
            assert r.status_code == 503 and "not running" in r.json()["error"]["message"], r.text
        assert time.monotonic() - t0 < 10, "refused at once, not after a wait"
        assert srv.metric("fitserve_engine_alive") == 0
        assert srv.metric("fitserve_requests_total", '{finish_reason="error"}') == 2
        assert "engine loop died" in srv.log.read_text()
    finally:
        code = stop_server(srv)
    assert code == 1, srv.log.read_text()[-3000:]
