"""vLLM's Prometheus metrics (``vllm:`` names, ``model_name`` and ``engine`` labels), exported
beside fitserve's own so dashboards and alerts written for vLLM read this server unchanged.

Names, label names and buckets follow vLLM's v1 ``PrometheusStatLogger``
(vllm/v1/metrics/loggers.py). What each means here:

- ``vllm:num_requests_running`` / ``_waiting``, ``vllm:kv_cache_usage_perc`` (a 0-1 fraction, as
  vLLM's), ``vllm:prefix_cache_queries`` / ``_hits`` (tokens), ``vllm:num_preemptions``: the
  engine's state after each step.
- ``vllm:prompt_tokens`` (a request's prompt, counted when its first token comes, as vLLM),
  ``vllm:generation_tokens``; ``vllm:iteration_tokens_total``: tokens computed per engine step
  (prefill chunks + decode tokens + verified drafts).
- per request, when it finishes: ``vllm:request_success{finished_reason}`` (stop, length, abort,
  error), ``vllm:e2e_request_latency_seconds`` (arrival to last token), ``_queue_time``
  (arrival to first scheduled), ``_prefill_time`` (first scheduled to first token),
  ``_decode_time`` (first to last token), ``_inference_time`` (first scheduled to last token),
  ``vllm:request_prompt_tokens`` / ``_generation_tokens``. Aborted and failed requests are
  counted in request_success only (their times are not a served request's).
- per token: ``vllm:time_to_first_token_seconds``, and the gap per token between a request's
  outputs as both ``vllm:inter_token_latency_seconds`` and ``vllm:time_per_output_token_seconds``
  (vLLM's older name for the same observation).

NOTE: the token-count histograms' buckets are vLLM's 1-2-5 series up to 1M tokens (vLLM stops at
max_model_len, unknown when the metrics are built here); counts and sums are the same.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# vLLM v1's buckets (vllm/v1/metrics/loggers.py)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                           50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
FINISHED_REASONS = ("stop", "length", "abort", "error")
LABELS = ("model_name", "engine")


def one_two_five_buckets(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_value`` (vLLM's ``build_1_2_5_buckets``)."""
    out: list[int] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


@dataclass(slots=True)
class FinishedRequest:
    """One finished request's timestamps (time.monotonic()) and token counts."""

    finished_reason: str
    arrival: float
    scheduled: float | None  # first scheduled (left the queue)
    first_token: float | None
    last_token: float | None
    prompt_tokens: int
    generation_tokens: int


class VllmMetrics:
    """The ``vllm:`` families in ``registry``; :meth:`bind` names the model (label values)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        r, lab = registry, LABELS
        self._families = {
            "running": Gauge("vllm:num_requests_running", "Number of requests in model execution batches.", lab, registry=r),
            "waiting": Gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", lab, registry=r),
            "kv_usage": Gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", lab, registry=r),
            "prefix_queries": Counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of "
                                      "queried tokens.", lab, registry=r),
            "prefix_hits": Counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached "
                                   "tokens.", lab, registry=r),
            "preemptions": Counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.",
                                   lab, registry=r),
            "prompt_tokens": Counter("vllm:prompt_tokens", "Number of prefill tokens processed.", lab, registry=r),
            "generation_tokens": Counter("vllm:generation_tokens", "Number of generation tokens processed.",
                                         lab, registry=r),
            "iteration_tokens": Histogram("vllm:iteration_tokens_total", "Histogram of number of tokens per "
                                          "engine_step.", lab, registry=r, buckets=ITERATION_TOKEN_BUCKETS),
            "request_prompt_tokens": Histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.",
                                               lab, registry=r, buckets=one_two_five_buckets(1_000_000)),
            "request_generation_tokens": Histogram("vllm:request_generation_tokens", "Number of generation "
                                                   "tokens processed.", lab, registry=r,
                                                   buckets=one_two_five_buckets(1_000_000)),
            "ttft": Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              lab, registry=r, buckets=TTFT_BUCKETS),
            "itl": Histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             lab, registry=r, buckets=TPOT_BUCKETS),
            "tpot": Histogram("vllm:time_per_output_token_seconds", "Histogram of time per output token in "
                              "seconds.", lab, registry=r, buckets=TPOT_BUCKETS),
        }
        for key, name, doc in (
            ("e2e", "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds."),
            ("queue", "vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request."),
            ("inference", "vllm:request_inference_time_seconds", "Histogram of time spent in RUNNING phase "
                                                                  "for request."),
            ("prefill", "vllm:request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for "
                                                              "request."),
            ("decode", "vllm:request_decode_time_seconds", "Histogram of time spent in DECODE phase for request."),
        ):
            self._families[key] = Histogram(name, doc, lab, registry=r, buckets=REQUEST_LATENCY_BUCKETS)
        self._success = Counter("vllm:request_success", "Count of successfully processed requests.",
                                [*lab, "finished_reason"], registry=r)
        self._c: dict[str, Any] = {}  # key -> the family's child for this model
        self._finished: dict[str, Counter] = {}

    def bind(self, model_name: str, engine: str = "0") -> None:
        """Create every series for ``model_name`` (at 0), so a scraper sees them all at once."""
        self._c = {k: f.labels(model_name, engine) for k, f in self._families.items()}
        self._finished = {r: self._success.labels(model_name, engine, r) for r in FINISHED_REASONS}

    def _child(self, key: str) -> Any:
        if not self._c:
            self.bind("")
        return self._c[key]

    # -- observations (engine thread) ---------------------------------------------------------
    def set_state(self, running: int, waiting: int, kv_usage: float) -> None:
        self._child("running").set(running)
        self._child("waiting").set(waiting)
        self._child("kv_usage").set(kv_usage)

    def inc(self, key: str, amount: float) -> None:
        """Advance one counter ("prefix_queries", "prefix_hits", "preemptions", "prompt_tokens",
        "generation_tokens") by ``amount`` > 0."""
        if amount > 0:
            self._child(key).inc(amount)

    def observe(self, key: str, value: float) -> None:
        """One observation of a histogram ("iteration_tokens", "ttft", "itl", ...)."""
        self._child(key).observe(value)

    def observe_gap(self, per_token_seconds: float, num_tokens: int) -> None:
        """``num_tokens`` output tokens that came ``per_token_seconds`` apart each."""
        for _ in range(num_tokens):
            self.observe("itl", per_token_seconds)
            self.observe("tpot", per_token_seconds)

    def observe_finished(self, req: FinishedRequest) -> None:
        reason = req.finished_reason if req.finished_reason in FINISHED_REASONS else "stop"
        if not self._finished:
            self.bind("")
        self._finished[reason].inc()
        if reason in ("abort", "error") or req.last_token is None:
            return
        self.observe("e2e", req.last_token - req.arrival)
        scheduled = req.scheduled if req.scheduled is not None else req.arrival
        first = req.first_token if req.first_token is not None else req.last_token
        self.observe("queue", scheduled - req.arrival)
        self.observe("prefill", first - scheduled)
        self.observe("decode", req.last_token - first)
        self.observe("inference", req.last_token - scheduled)
        self.observe("request_prompt_tokens", req.prompt_tokens)
        self.observe("request_generation_tokens", req.generation_tokens)
