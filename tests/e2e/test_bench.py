"""`fitserve bench` against the test server: a small run writes its JSON and PNG reports."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from fitserve.tools.bench.loadgen import RequestResult
from fitserve.tools.bench.report import SLO, percentile, summarize
from fitserve.tools.bench.workloads import LengthDist, make_workload
from tests.e2e.conftest import API_KEY, Server


def test_length_distributions() -> None:
    rng = random.Random(0)
    assert LengthDist.parse("fixed:7").sample(rng) == 7
    assert all(3 <= LengthDist.parse("uniform:3:9").sample(rng) <= 9 for _ in range(100))
    chat = [LengthDist.parse("chat:64:1024").sample(rng) for _ in range(2000)]
    assert max(chat) <= 1024 and sorted(chat)[1000] < 100 < max(chat)  # median ~64, long tail
    for bad in ("fixed:0", "uniform:9:3", "zipf", "chat:1"):
        with pytest.raises(ValueError):
            LengthDist.parse(bad)
    w = make_workload(3, LengthDist.parse("fixed:5"), LengthDist.parse("fixed:2"), seed=1)
    assert [len(r.prompt.split()) for r in w] == [5, 5, 5] and w == make_workload(
        3, LengthDist.parse("fixed:5"), LengthDist.parse("fixed:2"), seed=1)
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5 and percentile([], 90) is None


def _meets(r: dict[str, Any], ttft_ms: float | None, tpot_ms: float | None) -> bool:
    """The plain rule, on one per-request record of the JSON report (times in seconds)."""
    if not r["ok"] or r["ttft"] is None:
        return False
    if ttft_ms is not None and r["ttft"] * 1000 > ttft_ms:
        return False
    return tpot_ms is None or r["tpot"] is None or r["tpot"] * 1000 <= tpot_ms


def _result(ttft: float | None, e2e: float | None, tokens: int, ok: bool = True) -> RequestResult:
    return RequestResult(start=0.0, prompt_tokens=4, max_tokens=tokens, ok=ok, ttft=ttft, e2e=e2e,
                         output_tokens=tokens)


def test_slo_met_misses_and_boundaries() -> None:
    r = _result(ttft=0.25, e2e=0.75, tokens=3)  # binary-exact: TPOT (0.75 - 0.25) / 2 = 0.25 s
    assert r.tpot == 0.25
    assert SLO(250.0, 250.0).met(r)  # both exactly on the bound: met (<=)
    assert not SLO(249.999, 250.0).met(r)  # TTFT misses
    assert not SLO(250.0, 249.999).met(r)  # TPOT misses
    assert not SLO(100.0, 100.0).met(r)  # both miss
    assert SLO(None, 250.0).met(r) and SLO(250.0, None).met(r) and SLO().met(r)
    assert not SLO(None, 249.999).met(r) and not SLO(249.999, None).met(r)
    assert SLO(250.0, 1.0).met(_result(ttft=0.25, e2e=0.25, tokens=1))  # one token: no TPOT to miss
    assert not SLO().met(_result(ttft=0.1, e2e=0.2, tokens=3, ok=False))  # failed: never good
    assert not SLO().met(_result(ttft=None, e2e=0.2, tokens=0))
    # the seconds -> ms conversion never moves a decimal bound: t = ms / 1000 meets ms
    for ms in range(1, 2001):
        assert SLO(float(ms), None).met(_result(ttft=ms / 1000, e2e=ms / 1000, tokens=1)), ms


def test_bench_cli_writes_reports(server: Server, tmp_path: Path) -> None:
    out_json, out_png = tmp_path / "r.json", tmp_path / "r.png"
    slo_ttft, slo_tpot = 500.0, 100.0
    cmd = [sys.executable, "-m", "fitserve.cli", "bench", "--base-url", f"{server.url}/v1", "--api-key", API_KEY,
           "--request-rate", "20", "--num-requests", "6", "--warmup", "1", "--prompt-len", "uniform:4:12",
           "--output-len", "fixed:3", "--slo-ttft-ms", str(slo_ttft), "--slo-tpot-ms", str(slo_tpot),
           "--output-json", str(out_json), "--output-png", str(out_png), "--no-progress", "--api", "chat"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr + proc.stdout
    assert "goodput" in proc.stdout
    report = json.loads(out_json.read_text())
    summary, records = report["summary"], report["requests"]
    assert summary["completed"] == 6 and summary["failed"] == 0 and len(records) == 6
    assert summary["total_output_tokens"] == 18  # ignore_eos: exactly 3 tokens each
    assert summary["ttft_ms"]["p50"] > 0
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the server's KV over the run, scraped from its /metrics (fitserve's gauges)
    kv = summary["kv"]
    assert kv is not None and kv["samples"] >= 1 and 0 <= kv["fragmentation"] < 1
    assert 0 <= kv["utilization_mean"] <= kv["utilization_peak"] <= 1
    assert "KV: utilisation" in proc.stdout
    # goodput and attainment are exactly the requests meeting both targets, from the records
    good = sum(_meets(r, slo_ttft, slo_tpot) for r in records)
    assert summary["slo"] == {"ttft_ms": slo_ttft, "tpot_ms": slo_tpot}
    assert summary["slo_attainment"] == round(good / 6, 4)
    dur = summary["duration_s"]  # rounded to 1 ms; goodput used the unrounded wall time
    assert abs(summary["goodput"] - good / dur) <= good * 0.0005 / (dur * (dur - 0.0005)) + 5e-5
    # the same records against targets at their own medians: some requests meet, some miss
    results = [RequestResult(start=r["start"], prompt_tokens=r["prompt_tokens"], max_tokens=3, ok=r["ok"],
                             error=r["error"], ttft=r["ttft"], e2e=r["e2e"], output_tokens=r["output_tokens"])
               for r in records]
    assert [x.tpot for x in results] == [r["tpot"] for r in records]
    mid_ttft = sorted(r["ttft"] for r in records)[3] * 1000
    mid_tpot = sorted(r["tpot"] for r in records)[3] * 1000
    for slo in (SLO(mid_ttft, None), SLO(None, mid_tpot), SLO(mid_ttft, mid_tpot)):
        k = sum(_meets(r, slo.ttft_ms, slo.tpot_ms) for r in records)
        again = summarize(results, dur, slo, {})
        assert again["slo_attainment"] == round(k / 6, 4)
        assert again["goodput"] == round(k / dur, 4)
        if slo.tpot_ms is None or slo.ttft_ms is None:
            assert 4 <= k < 6  # the median request is on the bound, so it meets; the slowest miss


def test_bench_cli_sweep_with_overlay(server: Server, tmp_path: Path) -> None:
    """Two Poisson rates x 2 requests: the sweep table, its JSON, and a PNG with an overlay."""
    earlier = {"kind": "goodput-sweep", "meta": {"label": "earlier", "slo": {}},
               "rates": [{"offered_rate": 10.0, "goodput": 5.0}, {"offered_rate": 20.0, "goodput": 4.0}]}
    (tmp_path / "earlier.json").write_text(json.dumps(earlier))
    out_json, out_png = tmp_path / "sweep.json", tmp_path / "sweep.png"
    cmd = [sys.executable, "-m", "fitserve.cli", "bench", "--base-url", f"{server.url}/v1", "--api-key", API_KEY,
           "--request-rate", "10,20", "--num-requests", "2", "--warmup", "0", "--prompt-len", "fixed:6",
           "--output-len", "fixed:3", "--slo-ttft-ms", "60000", "--slo-tpot-ms", "60000", "--label", "now",
           "--output-json", str(out_json), "--output-png", str(out_png), "--overlay", str(tmp_path / "earlier.json"),
           "--knee", "15", "--no-progress"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr + proc.stdout
    assert "goodput sweep" in proc.stdout
    sweep = json.loads(out_json.read_text())
    assert sweep["kind"] == "goodput-sweep" and sweep["meta"]["label"] == "now"
    assert sweep["meta"]["workload"]["num_requests"] == 2
    rows = sweep["rates"]
    assert [r["offered_rate"] for r in rows] == [10.0, 20.0]
    for r in rows:  # loose targets: every request completes and is good
        assert (r["requests"], r["completed"], r["good"], r["rejected"], r["failed_other"]) == (2, 2, 2, 0, 0)
        assert r["good_fraction"] == 1.0 and r["goodput"] == r["offered_rate"]  # offered x fraction
        assert r["goodput_wall"] == r["request_throughput"] > 0
        assert r["total_output_tokens"] == 6
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
