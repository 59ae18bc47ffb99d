"""The official OpenAI client against a real `fitserve serve`: the happy paths."""

from __future__ import annotations

import httpx

from tests.e2e.conftest import MODEL, Server

MSG = [{"role": "user", "content": "Name three colours."}]


def test_models_health_ready(server: Server, client) -> None:  # type: ignore[no-untyped-def]
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    assert httpx.get(f"{server.url}/ready").status_code == 401  # the key covers all but /health
    assert httpx.get(f"{server.url}/ready", headers={"Authorization": "Bearer test-key"}).status_code == 200


def test_completion(client) -> None:  # type: ignore[no-untyped-def]
    r = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=6, temperature=0)
    assert r.object == "text_completion" and len(r.choices) == 1
    assert r.choices[0].finish_reason in ("length", "stop") and r.choices[0].text
    assert r.usage.prompt_tokens > 0 and 0 < r.usage.completion_tokens <= 6


def test_completion_batch_prompts_and_token_ids(client) -> None:  # type: ignore[no-untyped-def]
    r = client.completions.create(model=MODEL, prompt=["One,", "Two,"], max_tokens=3, temperature=0, n=2)
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    # greedy: the two children of one prompt agree
    by = {c.index: c.text for c in r.choices}
    assert by[0] == by[1] and by[2] == by[3]
    ids = client.completions.create(model=MODEL, prompt=[504, 1326, 28], max_tokens=3, temperature=0)
    assert ids.usage.prompt_tokens == 3 and ids.choices[0].text


def test_repeated_prompt_reports_cached_tokens(client) -> None:  # type: ignore[no-untyped-def]
    """Prefix caching (on by default): the second identical prompt's usage names the prompt
    tokens it took from the cache, whole 16-token blocks, never its last token."""
    prompt = [500 + (i * 37) % 3000 for i in range(70)]  # token ids: no tokenizer rounding
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    second = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens == second.usage.prompt_tokens == 70
    assert second.usage.prompt_tokens_details.cached_tokens == 64  # 4 blocks; 70 - 1 = 69 caps it
    assert second.choices[0].text == first.choices[0].text


def test_chat(client) -> None:  # type: ignore[no-untyped-def]
    r = client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=8, temperature=0)
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_chat_stream_matches_non_stream(client) -> None:  # type: ignore[no-untyped-def]
    full = client.chat.completions.create(model=MODEL, messages=MSG, max_completion_tokens=8, temperature=0)
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=MSG, max_tokens=8, temperature=0, stream=True,
        stream_options={"include_usage": True},
    ))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_completion_stream_done_marker(server: Server, auth: dict[str, str]) -> None:
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 5, "stream": True, "temperature": 0}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, headers=auth, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and len(events) >= 2


def test_n_children_differ_and_seed_reproducible(client) -> None:  # type: ignore[no-untyped-def]
    kw = dict(model=MODEL, prompt="My favourite animal is", max_tokens=8, temperature=1.0, n=3, seed=1234)
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    ta = [c.text for c in sorted(a.choices, key=lambda c: c.index)]
    tb = [c.text for c in sorted(b.choices, key=lambda c: c.index)]
    assert ta == tb, "same seed, same texts"
    assert len(set(ta)) > 1, "child j gets seed + j, so children differ"


def test_stop_strings(client) -> None:  # type: ignore[no-untyped-def]
    free = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=12, temperature=0).choices[0].text
    assert " 6" in free, free
    r = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=12, temperature=0, stop=[" 6"])
    c = r.choices[0]
    assert c.finish_reason == "stop" and " 6" not in c.text and free.startswith(c.text)
    chunks = list(client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=12, temperature=0,
                                            stop=" 6", stream=True))
    assert "".join(ch.choices[0].text for ch in chunks) == c.text


def test_logprobs(client) -> None:  # type: ignore[no-untyped-def]
    r = client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=4, temperature=0,
                                       logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for tok in content:
        assert tok.logprob <= 0 and len(tok.top_logprobs) == 3
        assert tok.top_logprobs[0].logprob >= tok.top_logprobs[-1].logprob
        assert tok.token == tok.top_logprobs[0].token  # greedy picks the top token
    c = client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, temperature=0, logprobs=2).choices[0]
    assert len(c.logprobs.tokens) == len(c.logprobs.token_logprobs) == len(c.logprobs.top_logprobs)
    assert "".join(c.logprobs.tokens) == c.text


def test_metrics_exposed(server: Server, auth: dict[str, str]) -> None:
    text = httpx.get(f"{server.url}/metrics", headers=auth).text
    for name in ("fitserve_time_to_first_token_seconds_bucket", "fitserve_inter_token_latency_seconds_bucket",
                 "fitserve_e2e_request_latency_seconds_bucket", "fitserve_num_requests_running",
                 "fitserve_num_requests_waiting", "fitserve_preemptions_total", "fitserve_kv_blocks_used",
                 "fitserve_kv_blocks_total", "fitserve_kv_fragmentation_ratio", "fitserve_prompt_tokens_total",
                 "fitserve_generation_tokens_total", 'fitserve_requests_total{finish_reason="length"}',
                 "fitserve_prefix_cache_queries_total", "fitserve_prefix_cache_hits_total",
                 "fitserve_prefix_cache_evictable_blocks"):
        assert name in text, name
    assert server.metric("fitserve_kv_blocks_total") == 256
    assert server.metric("fitserve_generation_tokens_total") > 0
    # blocks are reused before fresh ones are touched; the resident bytes are theirs
    touched = server.metric("fitserve_kv_blocks_touched")
    assert 1 <= touched <= 256
    # SmolLM2 in float32 (the server fixture): 16 tokens x 30 layers x 2 (K, V) x 3 KV heads x
    # 64 x 4 B per block
    assert server.metric("fitserve_kv_cache_resident_bytes") == touched * 16 * 46_080
    assert server.metric("fitserve_prefix_cache_queries_total") >= server.metric(
        "fitserve_prefix_cache_hits_total")
