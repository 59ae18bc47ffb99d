"""vLLM's metric names on /metrics (fitserve.server.vllm_metrics), read from the shared server:
every name present with vLLM's labels, and after a few requests the counters and histogram
counts move by exactly what those requests did (the test's own accounting, from the responses)."""

from __future__ import annotations

import re

import httpx
import pytest

from fitserve.server.vllm_metrics import TTFT_BUCKETS
from tests.e2e.conftest import MODEL, Server

LABELS = f'engine="0",model_name="{MODEL}"'
GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")
COUNTERS = ("vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:prefix_cache_queries_total",
            "vllm:prefix_cache_hits_total", "vllm:num_preemptions_total")
PER_REQUEST = ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds",
               "vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds",
               "vllm:request_decode_time_seconds", "vllm:request_inference_time_seconds",
               "vllm:request_prompt_tokens", "vllm:request_generation_tokens")
PER_TOKEN = ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds")
VLLM_NAMES = (*GAUGES, *COUNTERS, *PER_REQUEST, *PER_TOKEN, "vllm:iteration_tokens_total",
              "vllm:request_success_total")


def scrape(server: Server, auth: dict[str, str]) -> dict[str, float]:
    """Every sample on /metrics: 'name{labels}' -> value."""
    text = httpx.get(f"{server.url}/metrics", headers=auth, timeout=10).text
    assert "_created" not in text  # prometheus_client's creation-time series are off
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^(\S+) (\S+)$", text, re.M)}


def test_vllm_metrics_count_the_requests_sent(server: Server, auth: dict[str, str]) -> None:
    server.wait_idle()
    before = scrape(server, auth)
    for name in VLLM_NAMES:  # every series exists (at 0) before any request, with vLLM's labels
        key = (f'{name}{{engine="0",finished_reason="stop",model_name="{MODEL}"}}'
               if name == "vllm:request_success_total" else
               f"{name}_count{{{LABELS}}}" if name in (*PER_REQUEST, *PER_TOKEN, "vllm:iteration_tokens_total")
               else f"{name}{{{LABELS}}}")
        assert key in before, key
    prompts: list[int] = []
    prefilled = 0
    reasons: list[str] = []
    for body in ({"prompt": "The capital of France is", "max_tokens": 5, "temperature": 0},
                 {"prompt": "One, two, three,", "max_tokens": 4, "temperature": 0, "stop": [" four"]},
                 {"prompt": "Once upon a time", "max_tokens": 6, "n": 2, "seed": 1}):
        r = httpx.post(f"{server.url}/v1/completions", headers=auth, timeout=120, json={"model": MODEL, **body})
        assert r.status_code == 200, r.text
        reasons += [c["finish_reason"] for c in r.json()["choices"]]
        # each of the n choices is an engine request with the whole prompt
        prompts += [r.json()["usage"]["prompt_tokens"]] * len(r.json()["choices"])
        prefilled += r.json()["usage"]["prompt_tokens"]  # n choices share one prefill (forked blocks)
    server.wait_idle()
    after = scrape(server, auth)

    def delta(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    requests = len(reasons)  # engine requests: n=2 is two
    for reason in ("stop", "length", "abort", "error"):
        key = f'vllm:request_success_total{{engine="0",finished_reason="{reason}",model_name="{MODEL}"}}'
        assert delta(key) == reasons.count(reason), reason
    for name in PER_REQUEST:
        assert delta(f"{name}_count{{{LABELS}}}") == requests, name
    prompt = sum(prompts)
    generated = delta(f"vllm:generation_tokens_total{{{LABELS}}}")
    assert delta(f"vllm:prompt_tokens_total{{{LABELS}}}") == prompt
    assert delta(f"vllm:request_prompt_tokens_sum{{{LABELS}}}") == prompt
    assert delta(f"vllm:request_generation_tokens_sum{{{LABELS}}}") == generated
    # each request's tokens after its first one are one inter-token gap each
    for name in PER_TOKEN:
        assert delta(f"{name}_count{{{LABELS}}}") == generated - requests, name
    # tokens computed per step: each prompt once (less what the prefix cache supplied) and every
    # generated token but each request's last (sampled, never fed back)
    hits = delta(f"vllm:prefix_cache_hits_total{{{LABELS}}}")
    assert delta(f"vllm:iteration_tokens_total_sum{{{LABELS}}}") == prefilled - hits + generated - requests
    assert delta(f"vllm:prefix_cache_queries_total{{{LABELS}}}") >= hits >= 0
    # phases add up: e2e = queue + prefill + decode, inference = prefill + decode
    s = {n: delta(f"{n}_sum{{{LABELS}}}") for n in PER_REQUEST}
    assert s["vllm:e2e_request_latency_seconds"] == pytest.approx(
        s["vllm:request_queue_time_seconds"] + s["vllm:request_prefill_time_seconds"]
        + s["vllm:request_decode_time_seconds"], rel=1e-6)
    assert s["vllm:request_inference_time_seconds"] == pytest.approx(
        s["vllm:request_prefill_time_seconds"] + s["vllm:request_decode_time_seconds"], rel=1e-6)
    assert 0 < s["vllm:time_to_first_token_seconds"] <= s["vllm:e2e_request_latency_seconds"]
    # vLLM's buckets, cumulative, +Inf = count
    ttft_buckets = [f'vllm:time_to_first_token_seconds_bucket{{engine="0",le="{b}",model_name="{MODEL}"}}'
                    for b in TTFT_BUCKETS]
    assert all(k in after for k in ttft_buckets)
    inf = after[f'vllm:time_to_first_token_seconds_bucket{{engine="0",le="+Inf",model_name="{MODEL}"}}']
    assert inf == after[f"vllm:time_to_first_token_seconds_count{{{LABELS}}}"]
    assert after[f"vllm:num_requests_running{{{LABELS}}}"] == 0
    assert 0 <= after[f"vllm:kv_cache_usage_perc{{{LABELS}}}"] <= 1
