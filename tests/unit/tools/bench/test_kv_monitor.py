"""`fitserve bench` reports KV utilisation and fragmentation per run from the server's /metrics
(issue 42, item 11), and flags a fragmentation >= 5%. The figures are derived by hand from
block arithmetic: a sequence of n tokens in blocks of B holds ceil(n / B) blocks, and only the
last one can be partly filled."""

from __future__ import annotations

import http.server
import threading
import time
from collections.abc import Iterator

import pytest

from fitserve.tools.bench.kv_monitor import (
    KVMonitor,
    KVSample,
    format_kv,
    kv_summary,
    metrics_url,
    parse_sample,
)


def exposition(used: int, total: int, frag: float) -> str:
    return ("# HELP fitserve_kv_blocks_used KV cache blocks in use\n"
            f"fitserve_kv_blocks_used {used}.0\nfitserve_kv_blocks_total {total}.0\n"
            f'fitserve_kv_fragmentation_ratio{{model="m"}} {frag}\n'
            "fitserve_num_requests_running 1.0\n")


def frag_of(lengths: list[int], block: int) -> tuple[int, float]:
    """(blocks held, unused share of allocated slots): the plain block arithmetic."""
    blocks = sum(-(-n // block) for n in lengths)
    return blocks, (blocks * block - sum(lengths)) / (blocks * block)


def test_parse_and_summarize_by_hand() -> None:
    assert parse_sample(exposition(12, 100, 0.25)) == KVSample(12.0, 100.0, 0.25)
    assert parse_sample("fitserve_kv_blocks_used 3.0\n") is None  # not every gauge: no sample
    # sample 1: idle; sample 2: 4 sequences of 20 tokens in 16-token blocks: 2 blocks each, 8
    # blocks = 128 slots for 80 tokens: 48 / 128 = 37.5% unused; sample 3: 2 sequences of 64
    # tokens: 8 blocks, all full: 0%
    b2, f2 = frag_of([20] * 4, 16)
    b3, f3 = frag_of([64, 64], 16)
    assert (b2, f2, b3, f3) == (8, 0.375, 8, 0.0)
    s = kv_summary([KVSample(0, 64, 0.0), KVSample(b2, 64, f2), KVSample(b3, 64, f3)])
    assert s is not None
    # utilisation: (0 + 8 + 8) / 64 / 3 = 8.33%; peak 12.5%
    assert (s["utilization_mean"], s["utilization_peak"]) == (round(16 / 64 / 3, 4), 0.125)
    # fragmentation over the run: unused slots / allocated slots = (48 + 0) / (128 + 128)
    assert s["fragmentation"] == round(48 / 256, 4) == 0.1875 and s["fragmentation_peak"] == 0.375
    assert s["fragmentation_flag"] is True
    assert "FLAG: fragmentation >= 5%" in format_kv(s)
    # 100 sequences of 1,000 tokens in 16-token blocks: 63 blocks each, 8 unused slots each:
    # 800 / 100,800 = 0.79% -> no flag
    b, f = frag_of([1000] * 100, 16)
    quiet = kv_summary([KVSample(b, 8000, f)])
    assert quiet is not None and quiet["fragmentation"] == round(800 / 100_800, 4)
    assert quiet["fragmentation_flag"] is False and "FLAG" not in format_kv(quiet)
    assert kv_summary([]) is None and "no fitserve KV gauges" in format_kv(None)
    assert metrics_url("http://127.0.0.1:8000/v1/") == "http://127.0.0.1:8000/metrics"


class _Scripted(http.server.BaseHTTPRequestHandler):
    texts: list[str] = []

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        body = (self.texts.pop(0) if len(self.texts) > 1 else self.texts[0]).encode()
        self.send_response(200 if self.path == "/metrics" else 404)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_: object) -> None:
        return


@pytest.fixture
def scripted() -> Iterator[tuple[str, type[_Scripted]]]:
    handler = type("Handler", (_Scripted,), {"texts": []})
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}/v1", handler
    srv.shutdown()
    srv.server_close()


def test_monitor_scrapes_during_a_run(scripted: tuple[str, type[_Scripted]]) -> None:
    base, handler = scripted
    handler.texts[:] = [exposition(0, 64, 0.0), exposition(8, 64, 0.375), exposition(8, 64, 0.0)]
    mon = KVMonitor(metrics_url(base), interval_s=0.01).start()
    deadline = time.monotonic() + 5
    while len(mon.samples) < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    s = mon.stop()
    assert s is not None and s["samples"] >= 4
    assert mon.samples[:3] == [KVSample(0, 64, 0.0), KVSample(8, 64, 0.375), KVSample(8, 64, 0.0)]
    held = sum(x.used_blocks for x in mon.samples)
    assert s["fragmentation"] == round(8 * 0.375 / held, 4)  # the later samples all hold 8, 0%
    handler.texts[:] = ["some_other_server_metric 1.0\n"]
    other = KVMonitor(metrics_url(base), interval_s=0.01).start()
    time.sleep(0.05)
    assert other.stop() is None
