"""Prometheus metrics (``fitserve_`` prefix, and vLLM's ``vllm:`` names beside them: see
fitserve.server.vllm_metrics) and the short history the dashboard plots. No ``_created``
series (prometheus_client's ``disable_created_metrics``): they double every counter's lines.

Observations come from the engine thread (one call per engine step); prometheus-client's
metrics are thread-safe, and the dashboard history is guarded by a lock.

Speculative decoding (vLLM's names, ``fitserve_`` prefix): the counters
``fitserve_spec_decode_num_drafts`` / ``_num_draft_tokens`` / ``_num_accepted_tokens`` and
``_num_accepted_tokens_per_pos{position="0".."k-1"}`` (``_total`` appended by the client), and
the gauges ``fitserve_spec_decode_acceptance_rate`` and ``_mean_accepted_length`` (since start).
NOTE: they are always registered, at 0 while speculation is off, so a scraper sees one stable
set of series whatever the flags; the per-position series appear once speculation runs (the
positions are known only then).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

from fitserve.kv.manager import KVStats
from fitserve.server.vllm_metrics import FinishedRequest, VllmMetrics
from fitserve.spec_decode.stats import SpecDecodeStats

disable_created_metrics()  # type: ignore[no-untyped-call]

# CPU-friendly buckets: a 135M model on two cores has TTFTs of 0.05-10 s.
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10, 20, 40, 80)
_ITL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 2.5, 5)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320)
HISTORY_SECONDS = 300.0


@dataclass(slots=True)
class EngineGauges:
    """What the engine thread publishes after a step (or when it goes idle)."""

    num_running: int
    num_waiting: int
    total_preemptions: int
    kv: KVStats
    spec_decode: SpecDecodeStats | None = None  # None: speculative decoding is off
    slo_deprioritized: int = 0  # --scheduling-policy slo: requests queued behind on-time ones
    slo_step_time_correction: float | None = None  # its measured / predicted step time
    kv_block_bytes: int = 0  # one KV block's bytes: kv.touched_blocks x this are resident


class Metrics:
    """All server metrics in a private registry (so several apps can live in one process)."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.ttft = Histogram("fitserve_time_to_first_token_seconds",
                              "Time from request arrival to its first token", buckets=_TTFT_BUCKETS, registry=r)
        self.itl = Histogram("fitserve_inter_token_latency_seconds",
                             "Time between consecutive output tokens of a request", buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram("fitserve_e2e_request_latency_seconds",
                             "Time from request arrival to its last token", buckets=_E2E_BUCKETS, registry=r)
        self.running = Gauge("fitserve_num_requests_running", "Requests holding KV blocks", registry=r)
        self.waiting = Gauge("fitserve_num_requests_waiting", "Requests queued for admission", registry=r)
        self.preemptions = Counter("fitserve_preemptions", "Requests preempted (blocks taken back)", registry=r)
        self.kv_used = Gauge("fitserve_kv_blocks_used", "KV cache blocks in use", registry=r)
        self.kv_total = Gauge("fitserve_kv_blocks_total", "KV cache blocks in the pool", registry=r)
        self.kv_touched = Gauge("fitserve_kv_blocks_touched", "KV blocks ever used: on CPU the "
                                "pool is backed as blocks are first written, so these are resident",
                                registry=r)
        self.kv_resident = Gauge("fitserve_kv_cache_resident_bytes", "Bytes of the KV pool resident "
                                 "on CPU: touched blocks x block bytes", registry=r)
        self.kv_usage = Gauge("fitserve_kv_cache_usage_ratio", "Fraction of KV blocks in use", registry=r)
        self.kv_frag = Gauge("fitserve_kv_fragmentation_ratio",
                             "Unused fraction of allocated KV slots (internal fragmentation)", registry=r)
        self.prefix_queries = Counter("fitserve_prefix_cache_queries",
                                      "Tokens of admitted requests looked up in the prefix cache", registry=r)
        self.prefix_hits = Counter("fitserve_prefix_cache_hits",
                                   "Tokens found in the prefix cache (not recomputed)", registry=r)
        self.prefix_evictable = Gauge("fitserve_prefix_cache_evictable_blocks",
                                      "Free KV blocks still holding a cached prefix (reclaimed on demand)",
                                      registry=r)
        self.kv_shared = Gauge("fitserve_kv_shared_blocks",
                               "KV blocks held by more than one sequence (forks, beams, prefix hits)",
                               registry=r)
        self.prompt_tokens = Counter("fitserve_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.generation_tokens = Counter("fitserve_generation_tokens", "Generated tokens", registry=r)
        self.added = Counter("fitserve_requests_added", "Engine requests queued (a client request "
                             "with n choices adds n; a beam search adds 1)", registry=r)
        self.requests = Counter("fitserve_requests", "Finished requests by finish reason",
                                ["finish_reason"], registry=r)
        self.rejected = Counter("fitserve_requests_rejected", "Requests refused: 503 queue full, 429 slo admission",
                                ["status"], registry=r)
        self.engine_alive = Gauge("fitserve_engine_alive", "1 while the engine thread runs", registry=r)
        self.slo_deprioritized = Counter("fitserve_slo_deprioritized", "Requests the slo policy "
                                         "queued behind the on-time ones", registry=r)
        self.slo_correction = Gauge("fitserve_slo_step_time_correction", "slo policy: measured / "
                                    "predicted step time (running average)", registry=r)
        self._last_deprioritized = 0
        self.spec = _SpecDecodeMetrics(r)
        self.vllm = VllmMetrics(r)
        self.totals = [0, 0]  # prompt tokens (at first token), generated tokens: the throughput log
        self._lock = threading.Lock()
        self._last_preemptions = 0
        self._last_prefix = (0, 0)  # (queries, hits) already counted
        # The dashboard's charts: per-second sums, newest last, none older than the window.
        # NOTE: sums, not samples: memory stays constant however many tokens flow.
        self._bins: deque[_Bin] = deque()

    # -- observations (engine thread) ---------------------------------------------------------
    def _bin(self, now: float) -> _Bin:
        """The current second's sums (caller holds the lock); drops bins past the window."""
        sec = int(now)
        if not self._bins or self._bins[-1].second != sec:
            self._bins.append(_Bin(sec))
            while self._bins[0].second < sec - HISTORY_SECONDS - 1:
                self._bins.popleft()
        return self._bins[-1]

    def observe_ttft(self, seconds: float, prompt_tokens: int = 0) -> None:
        """A request's first token, ``seconds`` after it arrived; its prompt counts as done."""
        self.ttft.observe(seconds)
        self.vllm.observe("ttft", seconds)
        self.vllm.inc("prompt_tokens", prompt_tokens)
        self.totals[0] += prompt_tokens
        with self._lock:
            b = self._bin(time.time())
            b.ttft_sum += seconds
            b.ttft_count += 1

    def observe_tokens(self, num_tokens: int, gap_seconds: float | None) -> None:
        """``num_tokens`` new tokens of one request; ``gap_seconds`` since its previous ones."""
        self.generation_tokens.inc(num_tokens)
        self.vllm.inc("generation_tokens", num_tokens)
        self.totals[1] += num_tokens
        if gap_seconds is not None and num_tokens > 0:
            self.vllm.observe_gap(gap_seconds / num_tokens, num_tokens)
        now = time.time()
        with self._lock:
            b = self._bin(now)
            b.tokens += num_tokens
            if gap_seconds is not None and num_tokens > 0:
                per_token = gap_seconds / num_tokens
                for _ in range(num_tokens):
                    self.itl.observe(per_token)
                b.itl_sum += per_token
                b.itl_count += 1

    def observe_finished(self, reason: str, e2e_seconds: float | None,
                         request: FinishedRequest | None = None) -> None:
        """A request left; ``request`` has its timestamps (None: aborted before any)."""
        self.requests.labels(finish_reason=reason).inc()
        if e2e_seconds is not None:
            self.e2e.observe(e2e_seconds)
        self.vllm.observe_finished(request or FinishedRequest(reason, 0.0, None, None, None, 0, 0))

    def observe_step(self, num_tokens: int) -> None:
        """One engine step that computed ``num_tokens`` tokens (vllm:iteration_tokens_total)."""
        self.vllm.observe("iteration_tokens", num_tokens)

    def set_gauges(self, g: EngineGauges) -> None:
        self.running.set(g.num_running)
        self.waiting.set(g.num_waiting)
        delta = g.total_preemptions - self._last_preemptions
        if delta > 0:
            self.preemptions.inc(delta)
            self.vllm.inc("preemptions", delta)
        self._last_preemptions = g.total_preemptions
        self.kv_used.set(g.kv.used_blocks)
        self.kv_total.set(g.kv.num_blocks)
        usage = g.kv.used_blocks / g.kv.num_blocks if g.kv.num_blocks else 0.0
        self.kv_usage.set(usage)
        self.vllm.set_state(g.num_running, g.num_waiting, usage)
        self.kv_frag.set(g.kv.fragmentation)
        # the engine's counts are totals since start; the counters advance by the difference
        queries, hits = g.kv.prefix_cache_queries, g.kv.prefix_cache_hits
        if queries > self._last_prefix[0]:
            self.prefix_queries.inc(queries - self._last_prefix[0])
            self.vllm.inc("prefix_queries", queries - self._last_prefix[0])
        if hits > self._last_prefix[1]:
            self.prefix_hits.inc(hits - self._last_prefix[1])
            self.vllm.inc("prefix_hits", hits - self._last_prefix[1])
        self._last_prefix = (queries, hits)
        self.prefix_evictable.set(g.kv.evictable_cached_blocks)
        self.kv_shared.set(g.kv.shared_blocks)
        self.kv_touched.set(g.kv.touched_blocks)
        self.kv_resident.set(g.kv.touched_blocks * g.kv_block_bytes)
        if g.spec_decode is not None:
            self.spec.update(g.spec_decode)
        if g.slo_deprioritized > self._last_deprioritized:
            self.slo_deprioritized.inc(g.slo_deprioritized - self._last_deprioritized)
            self._last_deprioritized = g.slo_deprioritized
        if g.slo_step_time_correction is not None:
            self.slo_correction.set(g.slo_step_time_correction)

    def baseline(self, g: EngineGauges) -> None:
        """Take the engine's totals in ``g`` as the counters' zero (its start-up warm-up ran
        steps that are not served work); gauges are set as usual."""
        self._last_preemptions = g.total_preemptions
        self._last_prefix = (g.kv.prefix_cache_queries, g.kv.prefix_cache_hits)
        self._last_deprioritized = g.slo_deprioritized
        if g.spec_decode is not None:
            st = g.spec_decode
            self.spec._last = (st.num_drafts, st.num_draft_tokens, st.num_accepted_tokens)
            self.spec._last_pos = list(st.accepted_per_position)
        self.set_gauges(g)

    # -- readers (HTTP thread) ----------------------------------------------------------------
    def exposition(self) -> bytes:
        """The Prometheus text format of every metric."""
        return generate_latest(self.registry)

    def history(self, window_s: float = HISTORY_SECONDS, bucket_s: float = 5.0) -> list[dict[str, Any]]:
        """Per-bucket mean TTFT and ITL (ms) and output tokens/s over the last ``window_s``."""
        now = time.time()
        start = now - window_s
        n = int(window_s // bucket_s)
        sums = [[0.0, 0, 0.0, 0, 0] for _ in range(n)]  # ttft sum, count, itl sum, count, tokens

        def slot(t: float) -> int | None:
            i = int((t - start) // bucket_s)
            return i if 0 <= i < n else None

        with self._lock:
            for b in self._bins:
                if (i := slot(b.second + 0.5)) is not None:
                    acc = sums[i]
                    acc[0] += b.ttft_sum
                    acc[1] += b.ttft_count
                    acc[2] += b.itl_sum
                    acc[3] += b.itl_count
                    acc[4] += b.tokens
        out = []
        for i, (ts, tc, is_, ic, tok) in enumerate(sums):
            out.append({
                "t": round(start + (i + 1) * bucket_s - now, 1),  # seconds relative to now (<= 0)
                "ttft_ms": round(1000 * ts / tc, 1) if tc else None,
                "itl_ms": round(1000 * is_ / ic, 2) if ic else None,
                "tokens_per_s": round(tok / bucket_s, 2),
            })
        return out


@dataclass(slots=True)
class _Bin:
    """One second of the dashboard's history: sums of what was observed in it."""

    second: int
    ttft_sum: float = 0.0
    ttft_count: int = 0
    itl_sum: float = 0.0
    itl_count: int = 0
    tokens: int = 0


class _SpecDecodeMetrics:
    """Speculative decoding's counters and gauges, advanced from the engine's totals since start.

    Like the prefix-cache counters, each counter advances by the difference between the
    engine's total and the total last seen; a total that went down (a new engine) is taken as
    the new baseline, so a counter never goes backwards.
    """

    def __init__(self, r: CollectorRegistry) -> None:
        self.num_drafts = Counter("fitserve_spec_decode_num_drafts",
                                  "Drafts verified by the target (one per speculating request and step)", registry=r)
        self.num_draft_tokens = Counter("fitserve_spec_decode_num_draft_tokens",
                                        "Draft tokens proposed and verified by the target", registry=r)
        self.num_accepted_tokens = Counter("fitserve_spec_decode_num_accepted_tokens",
                                           "Draft tokens the target accepted", registry=r)
        self.accepted_per_pos = Counter("fitserve_spec_decode_num_accepted_tokens_per_pos",
                                        "Draft tokens accepted, by position in the draft (0-based)",
                                        ["position"], registry=r)
        self.acceptance_rate = Gauge("fitserve_spec_decode_acceptance_rate",
                                     "Accepted over proposed draft tokens since start", registry=r)
        self.mean_accepted_length = Gauge("fitserve_spec_decode_mean_accepted_length",
                                          "Tokens emitted per target verification step since start "
                                          "(1 + accepted drafts per chunk)", registry=r)
        self._last: tuple[int, int, int] = (0, 0, 0)  # (drafts, draft tokens, accepted) counted
        self._last_pos: list[int] = []

    def update(self, st: SpecDecodeStats) -> None:
        now = (st.num_drafts, st.num_draft_tokens, st.num_accepted_tokens)
        for counter, new, old in zip((self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens),
                                     now, self._last, strict=True):
            if new > old:
                counter.inc(new - old)
        self._last = now
        last_pos = self._last_pos + [0] * (len(st.accepted_per_position) - len(self._last_pos))
        for pos, (new, old) in enumerate(zip(st.accepted_per_position, last_pos, strict=False)):
            child = self.accepted_per_pos.labels(position=str(pos))  # exported (at 0) from now on
            if new > old:
                child.inc(new - old)
        self._last_pos = list(st.accepted_per_position)
        self.acceptance_rate.set(st.acceptance_rate)
        self.mean_accepted_length.set(st.mean_accepted_length)
