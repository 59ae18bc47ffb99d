"""The throughput line (vLLM's LoggingStatLogger format) and the access log, without a model."""

from __future__ import annotations

import asyncio
import logging

import httpx
import pytest

from fitserve.config import EngineConfig
from fitserve.kv.manager import KVStats
from fitserve.server import stat_logger
from fitserve.server.app import create_app
from fitserve.server.engine_loop import EngineLoop
from fitserve.server.metrics import EngineGauges, Metrics
from fitserve.server.settings import ServerSettings
from fitserve.server.stat_logger import ThroughputLogger


def _kv(used: int, queries: int, hits: int) -> KVStats:
    return KVStats(num_blocks=40, used_blocks=used, free_blocks=40 - used, allocated_slots=16 * used,
                   used_slots=16 * used, fragmentation=0.0, prefix_cache_queries=queries,
                   prefix_cache_hits=hits)


def test_throughput_line_rates_over_the_interval(monkeypatch: pytest.MonkeyPatch,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    clock = [100.0]
    monkeypatch.setattr(stat_logger.time, "monotonic", lambda: clock[0])
    m = Metrics()
    gauges = [EngineGauges(1, 2, 0, _kv(10, 0, 0))]
    logger = ThroughputLogger(m, lambda: gauges[0])
    m.observe_ttft(0.1, prompt_tokens=40)  # a prompt is counted when its first token comes
    m.observe_tokens(1, None)
    m.observe_tokens(19, 0.5)
    gauges[0] = EngineGauges(1, 2, 0, _kv(10, 64, 16))
    clock[0] += 2.0
    with caplog.at_level(logging.DEBUG, logger="fitserve.server"):
        first = logger.log()
        clock[0] += 2.0
        second = logger.log()  # nothing new: zeros, still at info (the interval before was busy)
        clock[0] += 2.0
        logger.log()  # idle twice: debug
    assert first == ("Avg prompt throughput: 20.0 tokens/s, Avg generation throughput: 10.0 tokens/s, "
                     "Running: 1 reqs, Waiting: 2 reqs, KV cache usage: 25.0%, Prefix cache hit rate: 25.0%")
    assert second.startswith("Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 0.0 tokens/s")
    assert [r.levelno for r in caplog.records] == [logging.INFO, logging.INFO, logging.DEBUG]


def test_access_log_line_per_request(caplog: pytest.LogCaptureFixture) -> None:
    loop = EngineLoop(EngineConfig(), Metrics(), engine_factory=lambda _c: None)  # type: ignore[arg-type,return-value]
    app = create_app(loop, ServerSettings())

    async def go() -> list[int]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return [(await c.get("/health")).status_code, (await c.post("/v1/completions", json={})).status_code]

    with caplog.at_level(logging.INFO, logger="fitserve.access"):
        codes = asyncio.run(go())
    lines = [r.getMessage() for r in caplog.records if r.name == "fitserve.access"]
    assert len(lines) == 2, lines
    for line, path, code in zip(lines, ("GET /health", "POST /v1/completions"), codes, strict=True):
        assert f'"{path} HTTP/1.1" {code} ' in line and line.endswith(" ms"), line


def test_metrics_baseline_leaves_the_warm_up_out() -> None:
    """The engine's totals at ready (its warm-up steps) are the counters' zero, fitserve_* and
    vllm:* alike; what comes after counts in full."""
    m = Metrics()
    m.vllm.bind("m")
    m.baseline(EngineGauges(0, 0, 3, _kv(0, 40, 16)))  # warm-up: 40 queried, 16 hit, 3 preempted
    m.set_gauges(EngineGauges(1, 0, 4, _kv(2, 65, 26)))
    text = m.exposition().decode()
    for line in ("fitserve_prefix_cache_queries_total 25.0", "fitserve_prefix_cache_hits_total 10.0",
                 "fitserve_preemptions_total 1.0",
                 'vllm:prefix_cache_queries_total{engine="0",model_name="m"} 25.0',
                 'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 10.0',
                 'vllm:num_preemptions_total{engine="0",model_name="m"} 1.0',
                 'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.05'):
        assert line in text.splitlines(), line
