"""An async load generator for any OpenAI-compatible endpoint, timing every streamed token.

Each request streams (``stream=True`` with ``stream_options.include_usage``); the client notes
when each content chunk arrives. TTFT is the time to the first non-empty chunk, inter-token
latencies are the gaps between later chunks, and output tokens come from the usage chunk when
the server sends one (else one token per chunk).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from fitserve.tools.bench.workloads import Arrivals, BenchRequest


@dataclass(slots=True)
class Target:
    """Where and how to send requests."""

    base_url: str  # e.g. http://127.0.0.1:8000/v1
    model: str
    api: str = "completions"  # or "chat"
    api_key: str | None = None
    ignore_eos: bool = True
    timeout_s: float = 600.0
    extra_body: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class RequestResult:
    """Timings of one request; times are seconds since the run started."""

    start: float
    prompt_tokens: int
    max_tokens: int
    ok: bool = False
    error: str | None = None
    ttft: float | None = None
    e2e: float | None = None
    output_tokens: int = 0
    chunk_times: list[float] = field(default_factory=list)

    @property
    def itls(self) -> list[float]:
        t = self.chunk_times
        return [b - a for a, b in zip(t, t[1:], strict=False)]

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first."""
        if self.ttft is None or self.e2e is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


def _body(target: Target, req: BenchRequest) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": target.model, "max_tokens": req.max_tokens, "temperature": 0.0, "stream": True,
        "stream_options": {"include_usage": True}, **target.extra_body,
    }
    if target.ignore_eos:
        body["ignore_eos"] = True
    if target.api == "chat":
        body["messages"] = [{"role": "user", "content": req.prompt}]
    else:
        body["prompt"] = req.prompt
    return body


def _chunk_text(obj: dict[str, Any], api: str) -> str:
    text = ""
    for choice in obj.get("choices") or []:
        if api == "chat":
            text += (choice.get("delta") or {}).get("content") or ""
        else:
            text += choice.get("text") or ""
    return text


async def send_one(client: httpx.AsyncClient, target: Target, req: BenchRequest, t0: float) -> RequestResult:
    """Send one streaming request and time it (never raises: errors land in the result)."""
    path = "/chat/completions" if target.api == "chat" else "/completions"
    start = time.perf_counter()
    res = RequestResult(start=start - t0, prompt_tokens=req.prompt_tokens, max_tokens=req.max_tokens)
    usage_tokens = None
    try:
        async with client.stream("POST", target.base_url.rstrip("/") + path, json=_body(target, req)) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                obj = json.loads(data)
                if "error" in obj:
                    res.error = str(obj["error"])[:200]
                    return res
                if obj.get("usage"):
                    usage_tokens = obj["usage"].get("completion_tokens")
                if _chunk_text(obj, target.api):
                    now = time.perf_counter() - t0
                    if res.ttft is None:
                        res.ttft = now - res.start
                    res.chunk_times.append(now)
    except (httpx.HTTPError, json.JSONDecodeError, OSError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"[:200]
        return res
    res.e2e = time.perf_counter() - start
    res.output_tokens = usage_tokens if usage_tokens is not None else len(res.chunk_times)
    res.ok = res.ttft is not None
    if not res.ok:
        res.error = "no tokens received"
    return res


@dataclass(slots=True)
class RunLimits:
    """Stop after ``num_requests`` or ``duration_s`` (whichever first); ``warmup`` unrecorded first."""

    num_requests: int
    duration_s: float | None = None
    warmup: int = 0


async def run_load(
    target: Target, workload: list[BenchRequest], arrivals: Arrivals, limits: RunLimits,
    *, seed: int = 0, on_done: Callable[[RequestResult], None] | None = None,
) -> tuple[list[RequestResult], float]:
    """Run the workload; return the recorded results and the measured wall time in seconds."""
    headers = {"Authorization": f"Bearer {target.api_key}"} if target.api_key else {}
    conc = arrivals.concurrency if arrivals.mode == "concurrency" else 1000
    pool = httpx.Limits(max_connections=max(conc, 1), max_keepalive_connections=max(conc, 1))
    async with httpx.AsyncClient(timeout=target.timeout_s, headers=headers, limits=pool) as client:
        if limits.warmup:
            warm = workload[: limits.warmup]
            sem = asyncio.Semaphore(max(1, min(conc, len(warm))))

            async def _warm(r: BenchRequest) -> None:
                async with sem:
                    await send_one(client, target, r, time.perf_counter())

            await asyncio.gather(*(_warm(r) for r in warm))
        todo = workload[limits.warmup: limits.warmup + limits.num_requests]
        t0 = time.perf_counter()
        deadline = None if limits.duration_s is None else t0 + limits.duration_s
        results: list[RequestResult] = []

        async def _send(r: BenchRequest) -> None:
            res = await send_one(client, target, r, t0)
            results.append(res)
            if on_done is not None:
                on_done(res)

        if arrivals.mode == "concurrency":
            queue = iter(todo)

            async def worker() -> None:
                for r in queue:
                    if deadline is not None and time.perf_counter() >= deadline:
                        return
                    await _send(r)

            await asyncio.gather(*(worker() for _ in range(max(1, arrivals.concurrency))))
        else:
            rng = random.Random(seed)
            tasks = []
            next_at = t0
            for r in todo:
                next_at += arrivals.gaps(rng)
                if deadline is not None and next_at >= deadline:
                    break
                await asyncio.sleep(max(0.0, next_at - time.perf_counter()))
                tasks.append(asyncio.create_task(_send(r)))
            await asyncio.gather(*tasks)
        return results, time.perf_counter() - t0


async def discover_model(base_url: str, api_key: str | None) -> str:
    """The first model id the endpoint lists."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(timeout=30, headers=headers) as client:
        r = await client.get(base_url.rstrip("/") + "/models")
        r.raise_for_status()
        return str(r.json()["data"][0]["id"])
