"""Hostile and broken clients against a real `fitserve serve`: each gets a bounded answer, and
the server keeps serving everyone else (checked after every case with a real request).

The server runs with short limits so the timeouts are seen quickly: --header-timeout 2,
--body-timeout 2, --send-timeout 3. Waits are bounded by those limits plus a margin; nothing
asserts a speed.
"""

from __future__ import annotations

import json
import re
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from fitserve.server.connections import raise_fd_limit
from fitserve.server.protocol.common import MAX_N
from tests.e2e.conftest import API_KEY, MODEL, Server, start_server, stop_server

AUTH = {"Authorization": f"Bearer {API_KEY}"}
HEADER_TIMEOUT, BODY_TIMEOUT, SEND_TIMEOUT = 2.0, 2.0, 3.0
MAX_MODEL_LEN = 256


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = start_server(tmp_path_factory.mktemp("hostile"), "--api-key", API_KEY,
                     "--header-timeout", str(HEADER_TIMEOUT), "--body-timeout", str(BODY_TIMEOUT),
                     "--send-timeout", str(SEND_TIMEOUT), "--max-model-len", str(MAX_MODEL_LEN),
                     "--num-kv-blocks", "272", "--log-level", "warning")
    yield s
    assert stop_server(s) == 0, s.log.read_text()[-4000:]


def _still_serving(srv: Server) -> None:
    r = httpx.post(f"{srv.url}/v1/completions", headers=AUTH, timeout=120,
                   json={"model": MODEL, "prompt": "The sky is", "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] == "length"


def _connect(srv: Server, rcvbuf: int | None = None) -> socket.socket:
    host, port = srv.url.removeprefix("http://").split(":")
    s = socket.socket()
    if rcvbuf is not None:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.settimeout(30)
    s.connect((host, int(port)))
    return s


def _closed_by_peer(s: socket.socket, within: float) -> bool:
    """True if the server closes the connection (EOF or reset) within ``within`` seconds."""
    s.settimeout(within)
    try:
        while True:
            data = s.recv(65536)
            if not data:
                return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False


def _response(s: socket.socket) -> tuple[int, dict[str, Any]]:
    """Read one HTTP response (the server closes the connection after it)."""
    data = b""
    try:
        while chunk := s.recv(65536):
            data += chunk
    except (ConnectionResetError, TimeoutError):
        pass
    head, _, body = data.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    return status, json.loads(body)


def test_idle_connections_are_closed_and_do_not_block_others(srv: Server) -> None:
    soft, _ = raise_fd_limit() or (1024, 1024)
    count = max(100, min(2000, soft - 200))
    idle = [_connect(srv) for _ in range(count)]
    slow = _connect(srv)
    slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # a head that never ends
    try:
        t0 = time.monotonic()
        _still_serving(srv)  # served with every idle connection open
        assert _closed_by_peer(slow, HEADER_TIMEOUT + 10), "the never-ending request head was cut off"
        deadline = t0 + HEADER_TIMEOUT + 20
        still_open = 0
        for s in idle:
            if not _closed_by_peer(s, max(0.05, deadline - time.monotonic())):
                still_open += 1
        assert still_open == 0, f"{still_open} of {count} idle connections outlived the header timeout"
    finally:
        for s in [*idle, slow]:
            s.close()
    _still_serving(srv)


def test_a_body_that_never_finishes_is_408(srv: Server) -> None:
    s = _connect(srv)
    try:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + API_KEY.encode()
                  + b"\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"prompt\": \"hel")
        t0 = time.monotonic()
        status, body = _response(s)
        assert status == 408, body
        assert body["error"]["code"] == "request_timeout" and "did not arrive" in body["error"]["message"]
        assert time.monotonic() - t0 < BODY_TIMEOUT + 15
    finally:
        s.close()
    _still_serving(srv)


def test_oversized_headers_get_431(srv: Server) -> None:
    s = _connect(srv)
    try:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 70_000 + b"\r\n\r\n")
        status, body = _response(s)
        assert status == 431, body
        assert body["error"]["type"] == "invalid_request_error" and "larger than" in body["error"]["message"]
    finally:
        s.close()
    # a head under the limit (64 KiB) is served as usual
    assert httpx.get(f"{srv.url}/health", headers={"X-Big": "a" * 30_000}).status_code == 200
    _still_serving(srv)


def test_a_stream_nobody_reads_is_aborted_after_the_send_timeout(srv: Server) -> None:
    # 16 x 230 chunks of ~1.5 KB: the (capped) socket buffers fill within the first ~30 steps,
    # long before the engine is done, so the send timeout ends a request still generating
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": MAX_MODEL_LEN - 26, "n": MAX_N,
            "ignore_eos": True, "logprobs": 20, "stream": True}
    raw = json.dumps(body).encode()
    s = _connect(srv, rcvbuf=4096)
    aborts_before = srv.metric("fitserve_requests_total", '{finish_reason="abort"}')
    try:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + API_KEY.encode()
                  + b"\r\nContent-Type: application/json\r\nContent-Length: " + str(len(raw)).encode()
                  + b"\r\n\r\n" + raw)
        # never read: the server's writes block once the (capped) socket buffers are full
        # NOTE: generous: the stall needs ~10 steps of 16 sequences, on a machine maybe shared
        deadline, served = time.monotonic() + 300, 0
        while time.monotonic() < deadline and "aborting the request" not in srv.log.read_text():
            if served < 3:
                _still_serving(srv)  # others are served while the stalled stream waits
                served += 1
            time.sleep(0.5)
        log = srv.log.read_text()
        assert re.search(r"read nothing for 3 s; aborting the request", log), log[-3000:]
        srv.wait_idle(60)  # its KV blocks came back while the socket is still open
        assert srv.metric("fitserve_requests_total", '{finish_reason="abort"}') - aborts_before == MAX_N
    finally:
        s.close()
    _still_serving(srv)


def test_n_and_max_tokens_at_their_limits_at_once(srv: Server) -> None:
    # a long prompt (token ids: its length is exact) keeps the completion at the limit short
    prompt = [28, 504, 253, 1345] * ((MAX_MODEL_LEN - 24) // 4)
    room = MAX_MODEL_LEN - len(prompt)
    r = httpx.post(f"{srv.url}/v1/completions", headers=AUTH, timeout=600, json={
        "model": MODEL, "prompt": prompt, "max_tokens": room, "n": MAX_N, "ignore_eos": True})
    assert r.status_code == 200, r.text
    out = r.json()
    assert sorted(c["index"] for c in out["choices"]) == list(range(MAX_N))
    assert all(c["finish_reason"] == "length" for c in out["choices"])
    assert out["usage"]["completion_tokens"] == MAX_N * room
    for over in ({"max_tokens": room + 1, "n": MAX_N}, {"max_tokens": room, "n": MAX_N + 1}):
        r = httpx.post(f"{srv.url}/v1/completions", headers=AUTH, timeout=60,
                       json={"model": MODEL, "prompt": prompt, "ignore_eos": True, **over})
        assert r.status_code == 400, (over, r.text)
        assert r.json()["error"]["param"] in ("max_tokens", "n"), r.text
    srv.wait_idle()


@pytest.mark.parametrize("raw, needle", [
    (b'{"prompt": "hi \\ud800 there", "max_tokens": 3}', "surrogate"),
    (b'{"prompt": "hi", "stop": ["\\udc00"], "max_tokens": 3}', "surrogate"),
    (b'{"messages": [{"role": "user", "content": "\\ud83d"}], "max_tokens": 3}', "surrogate"),
    (b'{"prompt": "hi \xff\xfe", "max_tokens": 3}', "not valid JSON"),
    (b'{"prompt": "hi", "stop": ["\xc3\x28"], "max_tokens": 3}', "not valid JSON"),
    (b'{"prompt": ' + b"[" * 20_000 + b"]" * 20_000 + b"}", "nested too deeply"),
    (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
])
def test_invalid_text_and_nesting_are_400(srv: Server, raw: bytes, needle: str) -> None:
    path = "/v1/chat/completions" if b"messages" in raw else "/v1/completions"
    r = httpx.post(f"{srv.url}{path}", content=raw, headers={**AUTH, "Content-Type": "application/json"},
                   timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and needle in err["message"], err


def test_many_hostile_clients_at_once_cost_no_one_an_answer(srv: Server) -> None:
    """Slow bodies, stalled readers and idle sockets while good requests run: all good ones succeed."""
    sockets = []
    for _ in range(20):
        s = _connect(srv)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 50\r\n\r\n{")
        sockets.append(s)
    answers: list[int] = []

    def good() -> None:
        r = httpx.post(f"{srv.url}/v1/completions", headers=AUTH, timeout=300,
                       json={"model": MODEL, "prompt": "Hello", "max_tokens": 8, "temperature": 0})
        answers.append(r.status_code)

    threads = [threading.Thread(target=good) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    for s in sockets:
        s.close()
    assert answers == [200] * 6
    srv.wait_idle()
