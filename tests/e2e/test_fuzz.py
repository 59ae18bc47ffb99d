"""Hypothesis-generated request bodies: never a 5xx, the server stays up, no block leaks."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.e2e.conftest import API_KEY, MODEL, Server

JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
SMALL = st.integers(-2, 2)  # token counts that keep generation short
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "developer", "tool", "x"]),
     "content": st.text(max_size=40) | JSON},
)
FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "model": st.sampled_from([MODEL, "other"]) | JSON,
    "prompt": st.text(max_size=60) | st.lists(st.integers(-5, 60000), max_size=12)
    | st.lists(st.text(max_size=10), max_size=3) | JSON,
    "messages": st.lists(MESSAGE, max_size=3) | JSON,
    "max_tokens": SMALL | JSON.filter(lambda v: not isinstance(v, int) or v < 3),
    "max_completion_tokens": SMALL,
    "temperature": st.floats(-1, 3) | JSON,
    "top_p": st.floats(-0.5, 1.5) | JSON,
    "top_k": st.integers(-3, 100000) | JSON,
    "min_p": st.floats(-1, 2),
    "n": st.sampled_from([-1, 0, 1, 2, 16, 17]) | JSON.filter(lambda v: not isinstance(v, int) or v > 16),
    "stop": st.text(max_size=5) | st.lists(st.text(max_size=5), max_size=20) | JSON,
    "seed": st.integers(-(2**70), 2**70) | JSON,
    "logprobs": st.integers(-2, 25) | st.booleans() | JSON,
    "top_logprobs": st.integers(-2, 25) | JSON,
    "presence_penalty": st.floats(-3, 3), "frequency_penalty": st.floats(-3, 3),
    "repetition_penalty": st.floats(-1, 3) | JSON,
    "stop_token_ids": st.lists(st.integers(-2, 2**40), max_size=4) | JSON,
    "ignore_eos": st.booleans() | JSON,
    "stream": st.booleans(),
    "stream_options": st.none() | st.fixed_dictionaries({"include_usage": st.booleans() | JSON}) | JSON,
    "chat_template": st.text(max_size=10),
}


@st.composite
def bodies(draw: st.DrawFn) -> tuple[str, bytes]:
    chat = draw(st.booleans())
    path = "/v1/chat/completions" if chat else "/v1/completions"
    if draw(st.integers(0, 9)) == 0:  # some bodies are not JSON objects at all
        return path, draw(st.binary(max_size=40) | JSON.map(lambda v: json.dumps(v).encode()))
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 2}
    body["messages" if chat else "prompt"] = [{"role": "user", "content": "hi"}] if chat else "hi"
    for name in draw(st.lists(st.sampled_from(sorted(FIELDS)), max_size=5, unique=True)):
        body[name] = draw(FIELDS[name])
    if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = 2  # keep generation short: a missing limit would run to max_model_len
    return path, json.dumps(body).encode()


@pytest.fixture(scope="module")
def http(server: Server) -> Any:
    with httpx.Client(base_url=server.url, timeout=120,
                      headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}) as c:
        yield c


@settings(max_examples=60, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(case=bodies())
def test_fuzzed_bodies_never_5xx(http: httpx.Client, case: tuple[str, bytes]) -> None:
    path, raw = case
    r = http.post(path, content=raw)
    assert r.status_code < 500, (raw, r.status_code, r.text)
    if r.status_code >= 400:
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    elif r.headers["content-type"].startswith("text/event-stream"):
        assert r.text.rstrip().endswith("data: [DONE]") or '"error"' in r.text


def test_after_fuzz_healthy_and_no_leaks(server: Server, http: httpx.Client) -> None:
    server.wait_idle()
    assert http.get("/health").status_code == 200
    assert http.post("/v1/completions", json={"model": MODEL, "prompt": "ok", "max_tokens": 2}).status_code == 200
