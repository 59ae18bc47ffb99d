"""`fitserve bench` against the test server: a small run writes its JSON and PNG reports."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from fitserve.bench.report import percentile
from fitserve.bench.workloads import LengthDist, make_workload
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


def test_bench_cli_writes_reports(server: Server, tmp_path: Path) -> None:
    out_json, out_png = tmp_path / "r.json", tmp_path / "r.png"
    cmd = [sys.executable, "-m", "fitserve.cli", "bench", "--base-url", f"{server.url}/v1", "--api-key", API_KEY,
           "--request-rate", "20", "--num-requests", "6", "--warmup", "1", "--prompt-len", "uniform:4:12",
           "--output-len", "fixed:3", "--slo-ttft-ms", "60000", "--slo-tpot-ms", "60000",
           "--output-json", str(out_json), "--output-png", str(out_png), "--no-progress", "--api", "chat"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr + proc.stdout
    assert "goodput" in proc.stdout
    summary = json.loads(out_json.read_text())["summary"]
    assert summary["completed"] == 6 and summary["failed"] == 0
    assert summary["total_output_tokens"] == 18  # ignore_eos: exactly 3 tokens each
    assert summary["ttft_ms"]["p50"] > 0 and summary["goodput"] > 0 and summary["slo_attainment"] == 1.0
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
