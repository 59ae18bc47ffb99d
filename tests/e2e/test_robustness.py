"""Server robustness on real `fitserve serve` processes: huge prompts off the event loop,
one failing request isolated, atomic admission, and the API key on /metrics and the dashboard.

Timing-free: each test records the order of events (or counts answers), never durations.
"""

from __future__ import annotations

import asyncio
import json
import random
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import API_KEY, MODEL, Server, start_server, stop_server
from tests.faults import FAULT_TOKEN

AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def big_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A server with the default 1 MiB body limit, --metrics-public and the test-only fault hook."""
    # tests.faults: any step holding a prompt that starts with FAULT_TOKEN fails
    srv = start_server(tmp_path_factory.mktemp("big"), "--api-key", API_KEY, "--metrics-public",
                       module="tests.faults")
    yield srv
    assert stop_server(srv) == 0, srv.log.read_text()[-4000:]


class Stream(threading.Thread):
    """A streaming completion read in the background; records each chunk in a shared event list."""

    def __init__(self, url: str, body: dict[str, Any], events: list[str], lock: threading.Lock,
                 tag: str = "chunk") -> None:
        super().__init__(daemon=True)
        self.url, self.body, self.events, self.lock, self.tag = url, body, events, lock, tag
        self.first = threading.Event()
        self.stop = threading.Event()
        self.text = ""
        self.done = False

    def run(self) -> None:
        with httpx.stream("POST", f"{self.url}/v1/completions", json={**self.body, "stream": True},
                          headers=AUTH, timeout=300) as r:
            assert r.status_code == 200, r.read()
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    self.done = True
                    return
                if line.startswith("data: "):
                    chunk = json.loads(line[6:])
                    self.text += chunk["choices"][0]["text"] if chunk.get("choices") else ""
                    with self.lock:
                        self.events.append(self.tag)
                    self.first.set()
                if self.stop.is_set():
                    return  # leaving closes the connection: the server aborts the request


# -- 3. a 1 MiB prompt is tokenized off the event loop --------------------------------------------
def _huge_text(limit: int) -> str:
    rng = random.Random(0)
    words = ["paged", "attention", "block", "table", "token", "budget", "queue", "stream", "cache"]
    return " ".join(rng.choice(words) for _ in range(limit // 5))[:limit]


def test_a_1mib_prompt_does_not_stall_other_streams(big_server: Server) -> None:
    events: list[str] = []
    lock = threading.Lock()
    stream = Stream(big_server.url, {"model": MODEL, "prompt": "Tell me a long story:", "max_tokens": 900,
                                     "ignore_eos": True, "temperature": 0}, events, lock)
    stream.start()
    assert stream.first.wait(120), "the open stream started"
    huge = _huge_text((1 << 20) - 400)
    requests = [
        ("/v1/completions", {"model": MODEL, "prompt": huge, "max_tokens": 1}),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": huge}], "max_tokens": 1}),
        ("/v1/completions", {"model": MODEL, "prompt": huge, "max_tokens": 1}),
    ]
    try:
        for i, (path, body) in enumerate(requests):
            raw = json.dumps(body).encode()
            assert len(raw) <= 1 << 20, "within the server's default --max-body-bytes"
            with lock:
                events.append(f"sent {i}")
            r = httpx.post(f"{big_server.url}{path}", content=raw, timeout=300,
                           headers={**AUTH, "Content-Type": "application/json"})
            with lock:
                events.append(f"answered {i}")
            # It was tokenized in full (~350k tokens) before being refused for its length.
            assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    finally:
        stream.stop.set()
        stream.join(120)
    assert not stream.done, "the open stream outlived the huge requests (else the test is vacuous)"
    during = [events[events.index(f"sent {i}"): events.index(f"answered {i}")].count("chunk")
              for i in range(len(requests))]
    assert all(n > 0 for n in during), f"stream chunks received while each huge prompt was tokenized: {during}"
    big_server.wait_idle()


# -- 4. a failing request gets a 500; the others are untouched -----------------------------------
GOOD = [[1, 504, 1326, 28, 9690, 198], [1, 9690, 198, 504, 28, 1326, 17, 44]]


def _body(prompt: list[int]) -> dict[str, Any]:
    return {"model": MODEL, "prompt": prompt, "max_tokens": 16, "ignore_eos": True, "temperature": 0}


def test_a_failing_request_fails_alone(big_server: Server) -> None:
    url = big_server.url
    reference = []
    for p in GOOD:  # fault-free, one at a time
        r = httpx.post(f"{url}/v1/completions", json=_body(p), headers=AUTH, timeout=300)
        assert r.status_code == 200, r.text
        reference.append(r.json()["choices"][0]["text"])
    errors_before = big_server.metric("fitserve_requests_total", '{finish_reason="error"}')

    events: list[str] = []
    lock = threading.Lock()
    streams = [Stream(url, _body(p), events, lock, tag=f"good {i}") for i, p in enumerate(GOOD)]
    for s in streams:
        s.start()
    for s in streams:
        assert s.first.wait(120)
    # Both are decoding now: the bad prompt's first step runs in a batch with them.
    bad = httpx.post(f"{url}/v1/completions", json=_body([FAULT_TOKEN, 28, 504]), headers=AUTH, timeout=300)
    with lock:
        events.append("bad answered")
    for s in streams:
        s.join(300)
    assert bad.status_code == 500, bad.text
    err = bad.json()["error"]
    assert err["type"] == "server_error" and "InjectedFault" in err["message"], err
    assert [s.text for s in streams] == reference, "the others' outputs equal the fault-free run"
    assert all(s.done for s in streams)
    assert any(e.startswith("good") for e in events[events.index("bad answered") + 1:]), \
        "vacuous: the good streams had finished before the bad request failed"

    # A streaming request that fails gets its error as an SSE event, then the stream ends.
    with httpx.stream("POST", f"{url}/v1/completions", json={**_body([FAULT_TOKEN, 5]), "stream": True},
                      headers=AUTH, timeout=300) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert json.loads(lines[-1][6:])["error"]["type"] == "server_error", lines

    big_server.wait_idle()  # every block of the failed requests is back
    assert big_server.metric("fitserve_requests_total", '{finish_reason="error"}') - errors_before == 2
    log = big_server.log.read_text()
    assert "rerunning them in halves" in log, "vacuous: the fault never hit a step shared with others"
    assert "Traceback" in log and "InjectedFault" in log, "an internal error is logged with its traceback"


# -- 5. racing requests cannot overshoot max_waiting ----------------------------------------------
async def _burst(url: str, n: int) -> list[tuple[int, str | None, str | None]]:
    """n concurrent chat streams; each holds its connection until all n have their status."""
    results: list[tuple[int, str | None, str | None]] = []
    all_in = asyncio.Event()

    async def one(client: httpx.AsyncClient, i: int) -> None:
        body = {"model": MODEL, "messages": [{"role": "user", "content": f"Request {i}"}],
                "max_tokens": 50, "ignore_eos": True, "stream": True}
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
            code = None
            if r.status_code != 200:
                code = json.loads(await r.aread())["error"]["code"]
            results.append((r.status_code, r.headers.get("retry-after"), code))
            if len(results) == n:
                all_in.set()
            await all_in.wait()  # an accepted request stays queued until the burst is over

    limits = httpx.Limits(max_connections=n + 4, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        await asyncio.wait_for(asyncio.gather(*(one(client, i) for i in range(n))), 180)
    return results


def test_racing_requests_never_overshoot_max_waiting(tmp_path: Path) -> None:
    srv = start_server(tmp_path, "--max-num-seqs", "1", "--max-waiting", "3")
    try:
        events: list[str] = []
        running = Stream(srv.url, {"model": MODEL, "prompt": "Count:", "max_tokens": 800, "ignore_eos": True},
                         events, threading.Lock())
        running.start()  # holds the only running slot: nothing else leaves the queue meanwhile
        assert running.first.wait(120)
        # more sequences than the queue holds can never be admitted: a 400, not a 503 to retry
        big = httpx.post(f"{srv.url}/v1/completions", timeout=60,
                         json={"model": MODEL, "prompt": "hi", "max_tokens": 2, "n": 4})
        assert big.status_code == 400 and "--max-waiting 3" in big.json()["error"]["message"], big.text
        results = asyncio.run(_burst(srv.url, 16))
        accepted = [r for r in results if r[0] == 200]
        refused = [r for r in results if r[0] != 200]
        assert len(accepted) == 3, results  # exactly max_waiting: never more, and not vacuous
        assert all(code == 503 and retry is not None and int(retry) >= 1 and err == "overloaded"
                   for code, retry, err in refused), refused
        assert srv.metric("fitserve_requests_rejected_total", '{status="503"}') == 13
        assert not running.done
        running.stop.set()
        running.join(120)
        srv.wait_idle()
    finally:
        stop_server(srv)


# -- 6. the API key guards /metrics and the dashboard; --metrics-public opens /metrics only -------
PROTECTED = ["/metrics", "/dashboard", "/dashboard/app.js", "/dashboard/state"]


def test_api_key_guards_metrics_and_dashboard(server: Server) -> None:
    basic = httpx.BasicAuth("anyone", API_KEY)
    for path in PROTECTED:
        r = httpx.get(f"{server.url}{path}", timeout=30)
        assert r.status_code == 401, (path, r.status_code)
        assert r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(f"{server.url}{path}", headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert httpx.get(f"{server.url}{path}", headers=AUTH).status_code == 200, path
        assert httpx.get(f"{server.url}{path}", auth=basic).status_code == 200, path  # what a browser sends
        if path.startswith("/dashboard"):  # so a browser asks for the key
            assert r.headers["www-authenticate"].startswith("Basic"), path
    assert "fitserve_kv_blocks_total" in httpx.get(f"{server.url}/metrics", headers=AUTH).text
    assert httpx.get(f"{server.url}/health").status_code == 200  # /health alone stays open
    assert httpx.get(f"{server.url}/ready").status_code == 401
    assert httpx.get(f"{server.url}/ready", headers=AUTH).status_code == 200


def test_metrics_public_opens_metrics_only(big_server: Server) -> None:
    r = httpx.get(f"{big_server.url}/metrics", timeout=30)
    assert r.status_code == 200 and "fitserve_kv_blocks_total" in r.text
    for path in PROTECTED[1:] + ["/v1/models"]:
        assert httpx.get(f"{big_server.url}{path}", timeout=30).status_code == 401, path
        assert httpx.get(f"{big_server.url}{path}", headers=AUTH, timeout=30).status_code == 200, path
    assert httpx.get(f"{big_server.url}/health").status_code == 200
