"""The goodput sweep of `fitserve bench`: rate lists, good/rejected counting, JSON, PNG, overlay."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

from fitserve.tools.bench import cli as cli_bench
from fitserve.tools.bench.cli import BenchConfig, add_bench_parser, run_sweep
from fitserve.tools.bench.kv_monitor import KVSample, kv_summary
from fitserve.tools.bench.loadgen import RequestResult
from fitserve.tools.bench.report import SLO
from fitserve.tools.bench.sweep import (
    SWEEP_KIND,
    check_rates,
    format_sweep_table,
    http_status,
    load_sweep,
    measured_knee,
    parse_rates,
    rate_summary,
    retext_workload,
    write_goodput_png,
    write_sweep_json,
)
from fitserve.tools.bench.workloads import Arrivals, BenchRequest

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _ok(ttft: float, e2e: float, tokens: int = 3) -> RequestResult:
    return RequestResult(start=0.0, prompt_tokens=4, max_tokens=tokens, ok=True, ttft=ttft, e2e=e2e,
                         output_tokens=tokens)


def _failed(error: str) -> RequestResult:
    return RequestResult(start=0.0, prompt_tokens=4, max_tokens=3, error=error)


def test_parse_rates_and_bad_values() -> None:
    assert parse_rates("0.5,1,2,4") == [0.5, 1.0, 2.0, 4.0]
    assert parse_rates(" 3 ") == [3.0] and parse_rates("4, 1") == [4.0, 1.0]  # order kept
    for bad, words in [("1,,2", "empty rate"), ("", "empty rate"), ("1,x", "'x' is not a number"),
                       ("0", "> 0"), ("1,-2", "> 0"), ("inf", "finite"), ("nan", "finite"),
                       ("1,2,1", "appears twice")]:
        with pytest.raises(ValueError, match=words):
            parse_rates(bad)
    with pytest.raises(ValueError, match="at least one"):
        check_rates([])
    # the CLI turns the same errors into argparse usage errors (exit 2), naming the flag
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_bench_parser(parser.add_subparsers(dest="command"))
    assert parser.parse_args(["bench", "--request-rate", "1,2"]).request_rate == [1.0, 2.0]
    assert parser.parse_args(["bench", "--request-rate", "2"]).request_rate == [2.0]
    with pytest.raises(SystemExit):
        parser.parse_args(["bench", "--request-rate", "1,0"])


def test_rate_summary_counts_good_and_rejected_exactly() -> None:
    # binary-exact times: TPOT of _ok(t, t + 0.5) with 3 tokens = 0.25 s
    results = [
        _ok(0.25, 0.75),  # good: TTFT 250 <= 500, TPOT 250 <= 250
        _ok(0.5, 1.0),  # good: both exactly on the bound
        _ok(0.75, 1.25),  # TTFT misses
        _ok(0.25, 1.25),  # TPOT 500 misses
        _failed("HTTP 429: b'predicted to miss its TTFT target'"),
        _failed("HTTP 429: b'busy'"),
        _failed("HTTP 503: b'queue full'"),
        _failed("HTTP 500: b'boom'"),
        _failed("ReadTimeout: timed out"),
        _failed("no tokens received"),
    ]
    assert [http_status(r) for r in results[4:]] == [429, 429, 503, 500, None, None]
    row = rate_summary(results, 8.0, SLO(500.0, 250.0), offered_rate=2.5)
    assert row["offered_rate"] == 2.5
    assert row["requests"] == 10 and row["completed"] == 4 and row["failed"] == 6
    assert row["good"] == 2 and row["good_fraction"] == 0.2  # rejected requests count against
    assert row["goodput"] == 0.5  # offered 2.5 req/s x 2 good / 10 requests
    assert row["goodput_wall"] == 0.25 and row["request_throughput"] == 0.5  # 2 and 4 per 8 s
    assert row["rejected"] == 3 and row["rejected_by_status"] == {"429": 2, "503": 1}
    assert row["failed_other"] == 3
    assert row["ttft_ms"]["p50"] == 375.0 and row["ttft_ms"]["p99"] == pytest.approx(742.5)
    assert row["slo"] == {"ttft_ms": 500.0, "tpot_ms": 250.0}
    empty = rate_summary([], 1.0, SLO(), 1.0)
    assert empty["good"] == 0 and empty["good_fraction"] is None and empty["rejected"] == 0


def _sweep(label: str, points: list[tuple[float, float]]) -> dict[str, Any]:
    rows = [{"offered_rate": x, "goodput": y} for x, y in points]
    return {"kind": SWEEP_KIND, "meta": {"label": label, "slo": {"ttft_ms": 1000.0, "tpot_ms": 100.0}},
            "rates": rows}


def test_measured_knee() -> None:
    s = _sweep("fcfs", [(0.5, 0.5), (1.0, 0.95), (2.0, 1.7), (3.0, 1.0)])
    assert measured_knee(s) == 1.0  # 1.7 < 0.9 x 2
    assert measured_knee(s, fraction=0.85) == 2.0
    assert measured_knee(_sweep("x", [(1.0, 0.1)])) is None
    rows = [{"offered_rate": 1.0, "goodput": 0.9, "good_fraction": 0.9},
            {"offered_rate": 3.0, "goodput": 2.67, "good_fraction": 0.89}]
    assert measured_knee({"rates": rows}) == 1.0  # the fraction decides, where the rows have it


def test_goodput_png_with_overlay_and_knee(tmp_path: Path) -> None:
    fcfs, slo = _sweep("fcfs", [(0.5, 0.5), (2.0, 0.4), (1.0, 0.9)]), _sweep("slo", [(0.5, 0.5), (1.0, 1.0)])
    write_sweep_json(fcfs, tmp_path / "fcfs.json")
    assert load_sweep(tmp_path / "fcfs.json") == fcfs
    out = tmp_path / "plots" / "goodput.png"
    write_goodput_png([slo, load_sweep(tmp_path / "fcfs.json")], out, knee=1.5)
    assert out.read_bytes()[:8] == PNG_MAGIC
    write_goodput_png([fcfs], tmp_path / "one.png")  # no knee
    assert (tmp_path / "one.png").read_bytes()[:8] == PNG_MAGIC
    with pytest.raises(ValueError, match="at least one"):
        write_goodput_png([], tmp_path / "none.png")
    (tmp_path / "bad.json").write_text(json.dumps({"summary": {}, "requests": []}))  # a single run
    with pytest.raises(ValueError, match="not a goodput sweep"):
        load_sweep(tmp_path / "bad.json")
    (tmp_path / "junk.json").write_text("{")
    with pytest.raises(ValueError, match="junk.json"):
        load_sweep(tmp_path / "junk.json")
    with pytest.raises(ValueError, match="cannot read"):
        load_sweep(tmp_path / "missing.json")


def test_retext_keeps_lengths_and_changes_text() -> None:
    base = [BenchRequest("0 the of and", 4, 7), BenchRequest("1 in is", 3, 2)]
    a, b = retext_workload(base, "0/1"), retext_workload(base, "0/2")
    assert a == retext_workload(base, "0/1")  # reproducible
    assert [(r.prompt_tokens, r.max_tokens, len(r.prompt.split())) for r in a] == [(4, 7, 4), (3, 2, 3)]
    assert [r.prompt for r in a] != [r.prompt for r in b] != [r.prompt for r in base]


def test_run_sweep_json_shape(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """run_sweep with the load runs replaced: one fresh run per rate, the rows and meta it writes."""
    calls: list[tuple[Arrivals, list[str]]] = []

    def fake_run_once(cfg: BenchConfig, prep: Any, arrivals: Arrivals, workload: list[BenchRequest],
                      desc: str) -> tuple[list[RequestResult], float, dict[str, Any] | None]:
        calls.append((arrivals, [r.prompt for r in workload]))
        good = [_ok(0.25, 0.75) for _ in range(round(arrivals.rate * 2))]
        kv = kv_summary([KVSample(8, 64, 0.375)]) if arrivals.rate == 2.0 else None
        return [*good, _failed("HTTP 429: b'no'")], 2.0, kv

    monkeypatch.setattr(cli_bench, "_run_once", fake_run_once)
    cfg = BenchConfig(model="m", num_requests=5, warmup=1, duration_s=2.0, seed=3, slo_ttft_ms=500.0,
                      slo_tpot_ms=250.0, label="fcfs", output_json=tmp_path / "s.json",
                      output_png=tmp_path / "s.png", progress=False, prompt_len="fixed:6")
    overlay = _sweep("earlier", [(1.0, 1.0), (2.0, 1.5)])
    sweep = run_sweep(cfg, [1.0, 2.0], overlays=[overlay], knee=1.7)
    assert [a.rate for a, _ in calls] == [1.0, 2.0] and {a.mode for a, _ in calls} == {"poisson"}
    assert len(calls[0][1]) == 6 and calls[0][1] != calls[1][1]  # warm-up + 5, fresh text per rate
    assert sweep["kind"] == SWEEP_KIND
    assert sweep["meta"] == {
        "label": "fcfs", "model": "m", "base_url": cfg.base_url, "api": "completions",
        "slo": {"ttft_ms": 500.0, "tpot_ms": 250.0},
        "workload": {"prompt_len": "fixed:6", "output_len": "fixed:64", "ignore_eos": True,
                     "arrival": "poisson", "num_requests": 5, "duration_s": 2.0, "warmup": 1, "seed": 3},
    }
    rows = sweep["rates"]
    assert [(r["offered_rate"], r["good"], r["goodput"], r["rejected"], r["requests"]) for r in rows] == [
        (1.0, 2, 0.6667, 1, 3), (2.0, 4, 1.6, 1, 5)]
    assert [r["goodput_wall"] for r in rows] == [1.0, 2.0]  # good per 2 s of wall time
    assert json.loads((tmp_path / "s.json").read_text()) == sweep
    assert (tmp_path / "s.png").read_bytes()[:8] == PNG_MAGIC
    table = format_sweep_table(sweep)
    assert "TTFT <= 500.0 ms" in table and len(table.splitlines()) == 3 + 2
    # per-rate KV columns: none from a server without fitserve gauges, 12.5% / 37.5% flagged
    assert [r["kv"] is None for r in rows] == [True, False]
    assert "KV frag" in table and table.splitlines()[-1].endswith("12.5%   37.5%!")
    with pytest.raises(ValueError, match="twice"):
        run_sweep(cfg, [1.0, 1.0])
