"""Soak a running server with mixed traffic and account for every request it accepted.

A round sends ``requests`` requests, ``concurrency`` at a time: completions and chats, streamed
and not, random ``n`` (1-4), random ``max_tokens``, stop strings, and clients that leave early
(a stream closed after a few chunks, a plain request cancelled while it waits). After each
round the server must come back to rest: no KV block in use, no request in its table. Across
rounds, the server's RSS must settle: the growth from round 1 to round 2 of the same load, less
what the KV pool's newly touched blocks account for (the pool is backed as blocks are first
written, and a growing prefix cache touches more of it, by design), is what a leak looks like,
and :func:`soak` reports it.

Accounting, per request the server accepted (HTTP 200): a client that stayed got every choice
exactly once with one finish_reason each and, for a stream, exactly one ``[DONE]``; the server's
finished-request counters (one per engine request: stop, length, abort, error) grew by exactly
the number of choices it accepted, so nothing was lost and nothing answered twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import re
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx

STOPS = [".", "\n", " the", "!", "ing", ","]
WORDS = ["paged", "attention", "block", "table", "token", "budget", "queue", "stream", "cache",
         "river", "mountain", "kernel", "memory", "robot", "garden", "ocean", "planet"]
FINISH_REASONS = ("stop", "length", "abort", "error")


@dataclass(slots=True)
class SoakConfig:
    """One round's traffic; every random choice comes from ``seed``."""

    requests: int = 160
    concurrency: int = 24
    max_tokens: tuple[int, int] = (8, 48)
    n_values: tuple[int, ...] = (1, 2, 3, 4)
    p_stream: float = 0.5
    p_chat: float = 0.5
    p_stop: float = 0.3
    p_leave: float = 0.15  # the client disconnects before the answer is complete
    seed: int = 0
    timeout_s: float = 300.0  # one request; a hang fails the soak


@dataclass(slots=True)
class Outcome:
    """What one client saw."""

    status: int | None  # None: no HTTP status (transport error)
    choices: int  # n of the request
    left: bool = False  # the client disconnected on purpose
    finished: int = 0  # choices that got a finish_reason
    duplicates: int = 0  # finish_reasons beyond one per choice, [DONE] beyond one
    missing: int = 0  # choices of a completed answer without a finish_reason
    error: str | None = None


@dataclass(slots=True)
class ServerState:
    """The server at rest (or not): from /metrics, /dashboard/state and /proc."""

    rss_mib: float | None
    kv_blocks_used: float
    requests_in_table: int
    running: int
    waiting: int
    finished: dict[str, float]
    added: float  # engine requests the server queued, since it started
    kv_resident_mib: float = 0.0  # the KV pool's touched blocks (fitserve_kv_cache_resident_bytes)

    @property
    def at_rest(self) -> bool:
        return self.kv_blocks_used == 0 and self.requests_in_table == 0 and self.running == 0 and self.waiting == 0


@dataclass(slots=True)
class RoundReport:
    index: int
    sent: int
    statuses: Counter[int | None]
    left: int
    added: int  # engine requests the server queued in this round (its counter)
    accepted_seen: int  # choices of requests the client saw accepted (HTTP 200)
    accepted_unknown: int  # choices of plain requests cancelled before any status came back
    left_choices: int  # choices of requests whose client left early
    finished: dict[str, float]  # the server's finished-request counters, this round's growth
    duplicates: int
    missing: int
    transport_errors: int
    rest: ServerState
    wall_s: float

    @property
    def fivexx(self) -> int:
        return sum(v for k, v in self.statuses.items() if k is not None and k >= 500)

    @property
    def lost(self) -> int:
        """Engine requests queued but never finished (positive) or finished twice (negative)."""
        return self.added - int(sum(self.finished.values()))

    def problems(self) -> list[str]:
        """Everything wrong with this round (empty: it passed)."""
        out = []
        if self.fivexx:
            out.append(f"{self.fivexx} responses with status 5xx")
        if self.lost:
            out.append(f"{self.lost} engine requests queued but not finished exactly once")
        if not self.accepted_seen <= self.added <= self.accepted_seen + self.accepted_unknown:
            out.append(f"the server queued {self.added} engine requests; clients saw {self.accepted_seen} "
                       f"accepted (+ up to {self.accepted_unknown} unknown)")
        if self.finished.get("abort", 0) > self.left_choices:
            out.append(f"{self.finished['abort']:.0f} aborts but only {self.left_choices} choices left early")
        if self.finished.get("error", 0):
            out.append(f"{self.finished['error']:.0f} engine requests failed")
        if self.duplicates:
            out.append(f"{self.duplicates} choices answered twice")
        if self.missing:
            out.append(f"{self.missing} choices of complete answers lack a finish_reason")
        if self.transport_errors:
            out.append(f"{self.transport_errors} requests got no HTTP answer")
        if not self.rest.at_rest:
            out.append(f"not at rest: {self.rest.kv_blocks_used:.0f} KV blocks used, "
                       f"{self.rest.requests_in_table} requests in the table")
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "round": self.index, "sent": self.sent, "statuses": {str(k): v for k, v in self.statuses.items()},
            "left_early": self.left, "engine_requests_added": self.added,
            "engine_requests_finished": self.finished, "lost": self.lost,
            "answered_twice": self.duplicates, "missing_choices": self.missing, "5xx": self.fivexx,
            "transport_errors": self.transport_errors, "kv_blocks_used": self.rest.kv_blocks_used,
            "requests_in_table": self.rest.requests_in_table, "rss_mib": self.rest.rss_mib,
            "kv_resident_mib": self.rest.kv_resident_mib,
            "wall_s": round(self.wall_s, 1),
        }


def _request(rng: random.Random, cfg: SoakConfig, model: str) -> tuple[str, dict[str, Any], bool]:
    """(path, body, leave early?) of one random request."""
    n = rng.choice(cfg.n_values)
    words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 40)))
    body: dict[str, Any] = {"model": model, "max_tokens": rng.randint(*cfg.max_tokens), "n": n,
                            "temperature": rng.choice([0.0, 0.7, 1.0]), "seed": rng.randint(0, 2**31)}
    if rng.random() < cfg.p_stop:
        body["stop"] = rng.sample(STOPS, rng.randint(1, 3))
    if rng.random() < cfg.p_stream:
        body["stream"] = True
        if rng.random() < 0.5:
            body["stream_options"] = {"include_usage": True}
    if rng.random() < cfg.p_chat:
        body["messages"] = [{"role": "user", "content": f"Write about {words}"}]
        path = "/v1/chat/completions"
    else:
        body["prompt"] = f"A story about {words}:"
        path = "/v1/completions"
    return path, body, rng.random() < cfg.p_leave


async def _stream(client: httpx.AsyncClient, url: str, body: dict[str, Any], leave_after: int | None) -> Outcome:
    out = Outcome(status=None, choices=body["n"], left=leave_after is not None)
    reasons: Counter[int] = Counter()
    done = chunks = 0
    async with client.stream("POST", url, json=body) as r:
        out.status = r.status_code
        if r.status_code != 200:
            await r.aread()
            return out
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done += 1
                continue
            obj = json.loads(line[6:])
            if "error" in obj:
                out.error = str(obj["error"])[:200]
                break
            for ch in obj.get("choices") or []:
                if ch.get("finish_reason") is not None:
                    reasons[ch["index"]] += 1
            chunks += 1
            if leave_after is not None and chunks >= leave_after:
                return out  # leaving the block closes the connection mid-stream
    out.finished = len(reasons)
    out.duplicates = sum(v - 1 for v in reasons.values()) + max(0, done - 1)
    if out.error is None:
        out.missing = out.choices - len(reasons) + (1 if done == 0 else 0)
    return out


async def _plain(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> Outcome:
    out = Outcome(status=None, choices=body["n"])
    r = await client.post(url, json=body)
    out.status = r.status_code
    if r.status_code == 200:
        choices = r.json()["choices"]
        idx = Counter(c["index"] for c in choices if c.get("finish_reason") is not None)
        out.finished = len(idx)
        out.duplicates = sum(v - 1 for v in idx.values())
        out.missing = out.choices - len(idx)
    return out


async def _one(client: httpx.AsyncClient, base: str, path: str, body: dict[str, Any], leave: bool,
               rng: random.Random, timeout_s: float) -> Outcome:
    url = base + path
    try:
        if body.get("stream"):
            coro = _stream(client, url, body, rng.randint(1, 6) if leave else None)
            return await asyncio.wait_for(coro, timeout_s)
        if leave:  # a plain request whose client gives up while it waits
            task = asyncio.ensure_future(_plain(client, url, body))
            await asyncio.sleep(rng.uniform(0.05, 0.6))
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                return Outcome(status=None, choices=body["n"], left=True)  # accepted or not: unknown
            return task.result()
        return await asyncio.wait_for(_plain(client, url, body), timeout_s)
    except (httpx.HTTPError, OSError, TimeoutError, json.JSONDecodeError) as exc:
        return Outcome(status=None, choices=body["n"], error=f"{type(exc).__name__}: {exc}"[:200])


def _metric_values(text: str, name: str) -> dict[str, float]:
    """label-set -> value for one metric name in a Prometheus exposition."""
    out = {}
    for m in re.finditer(rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$", text, re.M):
        out[m.group(1) or ""] = float(m.group(2))
    return out


def _rss_mib(pid: int | None) -> float | None:
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def server_state(base: str, headers: dict[str, str], pid: int | None) -> ServerState:
    text = httpx.get(f"{base}/metrics", headers=headers, timeout=30).text
    finished = {r: 0.0 for r in FINISH_REASONS}
    for labels, v in _metric_values(text, "fitserve_requests_total").items():
        m = re.search(r'finish_reason="([^"]+)"', labels)
        if m:
            finished[m.group(1)] = finished.get(m.group(1), 0.0) + v
    used = sum(_metric_values(text, "fitserve_kv_blocks_used").values())
    running = int(sum(_metric_values(text, "fitserve_num_requests_running").values()))
    waiting = int(sum(_metric_values(text, "fitserve_num_requests_waiting").values()))
    state = httpx.get(f"{base}/dashboard/state", headers=headers, timeout=30).json()
    added = sum(_metric_values(text, "fitserve_requests_added_total").values())
    kv_resident = sum(_metric_values(text, "fitserve_kv_cache_resident_bytes").values()) / (1 << 20)
    return ServerState(_rss_mib(pid), used, len(state.get("requests", [])), running, waiting, finished,
                       added, kv_resident)


def wait_rest(base: str, headers: dict[str, str], pid: int | None, timeout_s: float = 60.0) -> ServerState:
    """Poll until the server is at rest (or the timeout passes: the last state is returned)."""
    deadline = time.monotonic() + timeout_s
    while True:
        st = server_state(base, headers, pid)
        if st.at_rest or time.monotonic() > deadline:
            return st
        time.sleep(0.25)


async def run_round(base: str, api_key: str | None, model: str, cfg: SoakConfig, index: int,
                    pid: int | None = None) -> RoundReport:
    """One round of ``cfg.requests`` requests; returns its accounting once the server is at rest."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    rng = random.Random(cfg.seed)  # every round replays the same load
    before = await asyncio.to_thread(server_state, base, headers, pid)
    specs = [_request(rng, cfg, model) for _ in range(cfg.requests)]
    sem = asyncio.Semaphore(cfg.concurrency)
    limits = httpx.Limits(max_connections=cfg.concurrency + 8, max_keepalive_connections=cfg.concurrency)
    t0 = time.perf_counter()
    async with httpx.AsyncClient(headers=headers, timeout=cfg.timeout_s, limits=limits) as client:
        async def gated(path: str, body: dict[str, Any], leave: bool, seed: int) -> Outcome:
            async with sem:
                return await _one(client, base, path, body, leave, random.Random(seed), cfg.timeout_s)

        outcomes = await asyncio.gather(*(gated(p, b, lv, rng.randint(0, 2**31)) for p, b, lv in specs))
    wall = time.perf_counter() - t0
    rest = await asyncio.to_thread(wait_rest, base, headers, pid)
    # NOTE: a plain request cancelled while it waited may or may not have been queued, so the
    # clients' view bounds the server's count; the server's own counters must balance exactly.
    finished = {r: rest.finished.get(r, 0.0) - before.finished.get(r, 0.0) for r in rest.finished}
    return RoundReport(
        index=index, sent=len(outcomes), statuses=Counter(o.status for o in outcomes if o.status is not None),
        left=sum(o.left for o in outcomes), added=int(rest.added - before.added),
        accepted_seen=sum(o.choices for o in outcomes if o.status == 200),
        accepted_unknown=sum(o.choices for o in outcomes if o.status is None and o.left),
        left_choices=sum(o.choices for o in outcomes if o.left), finished=finished,
        duplicates=sum(o.duplicates for o in outcomes),
        missing=sum(o.missing for o in outcomes if not o.left and o.status == 200),
        transport_errors=sum(1 for o in outcomes if o.status is None and not o.left), rest=rest, wall_s=wall,
    )


@dataclass(slots=True)
class SoakReport:
    rounds: list[RoundReport] = field(default_factory=list)

    @property
    def rss_growth_mib(self) -> float | None:
        """RSS after the last round minus after the first (the same load each round), less the
        growth of the KV pool's resident blocks."""
        first, last = self.rounds[0].rest, self.rounds[-1].rest
        if first.rss_mib is None or last.rss_mib is None:
            return None
        return (last.rss_mib - first.rss_mib) - (last.kv_resident_mib - first.kv_resident_mib)

    def ok(self, rss_bound_mib: float) -> bool:
        growth = self.rss_growth_mib
        return not any(r.problems() for r in self.rounds) and (growth is None or growth <= rss_bound_mib)


def soak(base: str, api_key: str | None, model: str, cfg: SoakConfig, rounds: int = 2,
         pid: int | None = None) -> SoakReport:
    report = SoakReport()
    for i in range(rounds):
        report.rounds.append(asyncio.run(run_round(base, api_key, model, cfg, i + 1, pid)))
    return report
