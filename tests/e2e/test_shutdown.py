"""Backpressure (503 + Retry-After) and graceful SIGTERM, on a server of their own."""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import MODEL, start_server


def test_overload_503_then_sigterm_drains_and_exits_0(tmp_path: Path) -> None:
    # One running sequence at a time and one waiting slot: the third request is over the limit.
    srv = start_server(tmp_path, "--max-num-seqs", "1", "--max-waiting", "1", "--shutdown-timeout", "120")
    try:
        first_chunk = threading.Event()
        results: dict[str, object] = {}

        def stream_a() -> None:
            body = {"model": MODEL, "prompt": "Count:", "max_tokens": 64, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", f"{srv.url}/v1/completions", json=body, timeout=300) as r:
                lines = []
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        lines.append(line)
                        first_chunk.set()
                results["a"] = lines

        def request_b() -> None:
            body = {"model": MODEL, "prompt": "Hello", "max_tokens": 3, "ignore_eos": True}
            results["b"] = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=300)

        ta = threading.Thread(target=stream_a)
        ta.start()
        assert first_chunk.wait(120), "stream A started"
        tb = threading.Thread(target=request_b)
        tb.start()
        deadline = time.monotonic() + 30
        while srv.metric("fitserve_num_requests_waiting") < 1:  # B is queued behind A
            assert time.monotonic() < deadline
            time.sleep(0.05)
        r = httpx.post(f"{srv.url}/v1/completions", json={"model": MODEL, "prompt": "C", "max_tokens": 2})
        assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1, r.text
        assert r.json()["error"]["code"] == "overloaded"
        assert srv.metric("fitserve_requests_rejected_total", '{status="503"}') == 1

        srv.proc.send_signal(signal.SIGTERM)  # A and B are still in flight
        time.sleep(0.5)
        with pytest.raises(httpx.HTTPError):  # no longer accepting connections
            httpx.get(f"{srv.url}/health", timeout=2)
        ta.join(120)
        tb.join(120)
        a = results["a"]
        assert isinstance(a, list) and a[-1] == "data: [DONE]", "A finished its stream"
        b = results["b"]
        assert isinstance(b, httpx.Response) and b.status_code == 200, "B finished after A"
        assert b.json()["usage"]["completion_tokens"] == 3
        assert srv.proc.wait(60) == 0, srv.log.read_text()[-3000:]
    finally:
        if srv.proc.poll() is None:
            srv.proc.kill()
