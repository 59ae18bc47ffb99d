"""vLLM's periodic throughput line and an access log line per request, at info level.

Every ``FITSERVE_LOG_STATS_INTERVAL`` seconds (default 10, vLLM's) the server logs::

    Avg prompt throughput: 41.3 tokens/s, Avg generation throughput: 12.0 tokens/s,
    Running: 1 reqs, Waiting: 0 reqs, KV cache usage: 0.3%, Prefix cache hit rate: 12.5%

as vLLM's ``LoggingStatLogger`` does ("GPU KV cache usage" there): at info while tokens flowed in
this interval or the one before (so a burst ends with one line of zeros), at debug when idle.
Prompt tokens count when a request's first token comes (vLLM's accounting), generated tokens as
they are produced.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from fitserve.server.metrics import EngineGauges, Metrics

log = logging.getLogger("fitserve.server")
access_log = logging.getLogger("fitserve.access")


class ThroughputLogger:
    """Turns the metrics' running totals into one line per interval (see the module note)."""

    def __init__(self, metrics: Metrics, gauges: Callable[[], EngineGauges | None]) -> None:
        self.metrics = metrics
        self.gauges = gauges
        self._last_time = time.monotonic()
        self._last_totals = tuple(metrics.totals)
        self._last_rates = (0.0, 0.0)
        self._last_prefix = (0, 0)

    def log(self) -> str:
        """Log the line for the interval since the previous call (and return it)."""
        now = time.monotonic()
        totals = tuple(self.metrics.totals)
        dt = max(now - self._last_time, 1e-9)
        rates = ((totals[0] - self._last_totals[0]) / dt, (totals[1] - self._last_totals[1]) / dt)
        g = self.gauges()
        running, waiting, usage, hit_rate = 0, 0, 0.0, 0.0
        if g is not None:
            running, waiting = g.num_running, g.num_waiting
            usage = g.kv.used_blocks / g.kv.num_blocks if g.kv.num_blocks else 0.0
            q = g.kv.prefix_cache_queries - self._last_prefix[0]
            h = g.kv.prefix_cache_hits - self._last_prefix[1]
            hit_rate = h / q if q > 0 else 0.0
            self._last_prefix = (g.kv.prefix_cache_queries, g.kv.prefix_cache_hits)
        line = (f"Avg prompt throughput: {rates[0]:.1f} tokens/s, Avg generation throughput: "
                f"{rates[1]:.1f} tokens/s, Running: {running} reqs, Waiting: {waiting} reqs, "
                f"KV cache usage: {100 * usage:.1f}%, Prefix cache hit rate: {100 * hit_rate:.1f}%")
        busy = any(rates) or any(self._last_rates)
        log.log(logging.INFO if busy else logging.DEBUG, "%s", line)
        self._last_time, self._last_totals, self._last_rates = now, totals, rates
        return line

    async def run(self, interval_s: float) -> None:
        """Log every ``interval_s`` seconds until cancelled."""
        while True:
            await asyncio.sleep(interval_s)
            self.log()


Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
ASGIApp = Callable[[Scope, Callable[[], Awaitable[Message]], Callable[[Message], Awaitable[None]]],
                   Awaitable[None]]


class AccessLogMiddleware:
    """One info line per HTTP request when its response ends: client, method, path, status, ms.

    NOTE: pure ASGI (not BaseHTTPMiddleware), so streamed responses pass through untouched; the
    time is to the end of the response body, i.e. a stream's whole length.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Callable[[], Awaitable[Message]],
                       send: Callable[[Message], Awaitable[None]]) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        status = [500]

        async def send_and_watch(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_and_watch)
        finally:
            client = scope.get("client")
            access_log.info('%s "%s %s HTTP/%s" %d %.1f ms', f"{client[0]}:{client[1]}" if client else "-",
                            scope["method"], scope["path"], scope.get("http_version", "1.1"), status[0],
                            1000 * (time.perf_counter() - t0))
