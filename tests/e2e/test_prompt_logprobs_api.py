"""Prompt logprobs over HTTP with the official openai client: echo + logprobs on /v1/completions
(OpenAI's legacy shape, max_tokens 0 as lm-eval sends it), vLLM's prompt_logprobs field on
completions and chat, streaming with echo, and the 400s.

The values themselves are checked against transformers in tests/numerics/test_prompt_logprobs.py;
here the positions are checked against the server itself: the prompt logprobs of a greedy
continuation, echoed back as a prompt, equal the logprobs it was generated with (an off-by-one
row or a lost prefix moves them by O(1)).
"""

from __future__ import annotations

import math
from typing import Any

import httpx
import openai
import pytest

from tests.e2e.conftest import API_KEY, MODEL, Server

PROMPT = "The capital of France is"
# prefill (prompt rows) vs decode (one row, another kernel) in fp32: rounding only
ATOL = 1e-3


def token_ids(server: Server, text: str) -> list[int]:
    r = httpx.post(f"{server.url}/tokenize", json={"prompt": text}, headers={"Authorization": f"Bearer {API_KEY}"},
                   timeout=30)
    return r.json()["tokens"]


def test_echo_max_tokens_0_scores_the_prompt(server: Server, client: Any) -> None:
    ids = token_ids(server, PROMPT)
    r = client.completions.create(model=MODEL, prompt=PROMPT, echo=True, logprobs=3, max_tokens=0)
    c = r.choices[0]
    assert c.text == PROMPT and c.finish_reason == "length"
    lp = c.logprobs
    assert len(lp.tokens) == len(ids) and "".join(lp.tokens) == PROMPT
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v is not None and v <= 0 for v in lp.token_logprobs[1:])
    assert all(len(t) == 3 and max(t.values()) >= v for t, v in zip(lp.top_logprobs[1:], lp.token_logprobs[1:],
                                                                       strict=True))
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(ids))]
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 0


def test_prompt_logprobs_sit_at_the_right_positions(server: Server, client: Any) -> None:
    ids = token_ids(server, PROMPT)
    gen = client.completions.create(model=MODEL, prompt=ids, max_tokens=3, temperature=0, logprobs=0)
    generated = gen.choices[0].logprobs
    cont = [token_ids(server, t) for t in generated.tokens]
    assert all(len(c) == 1 for c in cont)
    scored = client.completions.create(model=MODEL, prompt=ids + [c[0] for c in cont], echo=True, logprobs=1,
                                       max_tokens=0).choices[0].logprobs
    for got, want, top in zip(scored.token_logprobs[-3:], generated.token_logprobs, scored.top_logprobs[-3:],
                              strict=True):
        assert math.isclose(got, want, abs_tol=ATOL), (got, want)
        assert math.isclose(max(top.values()), got, abs_tol=ATOL)  # greedy tokens are their top 1


def test_echo_with_generation_and_stream(server: Server, client: Any) -> None:
    ids = token_ids(server, PROMPT)
    whole = client.completions.create(model=MODEL, prompt=PROMPT, echo=True, logprobs=2, max_tokens=3,
                                      temperature=0).choices[0]
    lp = whole.logprobs
    assert len(lp.tokens) == len(ids) + 3 and whole.text == "".join(lp.tokens)
    assert whole.text.startswith(PROMPT) and lp.token_logprobs[0] is None
    chunks = [c.choices[0] for c in client.completions.create(
        model=MODEL, prompt=PROMPT, echo=True, logprobs=2, max_tokens=3, temperature=0, stream=True) if c.choices]
    assert chunks[0].text.startswith(PROMPT)
    assert chunks[0].logprobs.tokens[: len(ids)] == lp.tokens[: len(ids)]
    streamed = [v for c in chunks for v in c.logprobs.token_logprobs]
    assert streamed[0] is None
    assert all(math.isclose(a, b, abs_tol=ATOL) for a, b in zip(streamed[1:], lp.token_logprobs[1:], strict=True))
    assert "".join(c.text for c in chunks) == whole.text
    only = [c.choices[0] for c in client.completions.create(
        model=MODEL, prompt=PROMPT, echo=True, logprobs=1, max_tokens=0, stream=True) if c.choices]
    assert "".join(c.text for c in only) == PROMPT
    assert sum(len(c.logprobs.tokens) for c in only) == len(ids)


def test_vllm_prompt_logprobs_field(server: Server, client: Any) -> None:
    ids = token_ids(server, PROMPT)
    echo = client.completions.create(model=MODEL, prompt=PROMPT, echo=True, logprobs=1, max_tokens=0)
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, extra_body={"prompt_logprobs": 2})
    plp = r.choices[0].model_extra["prompt_logprobs"]
    assert r.choices[0].logprobs is None and len(plp) == len(ids) and plp[0] is None
    for tid, entry, want in zip(ids[1:], plp[1:], echo.choices[0].logprobs.token_logprobs[1:], strict=True):
        own = entry[str(tid)]
        assert math.isclose(own["logprob"], want, abs_tol=1e-6) and own["rank"] >= 1
        assert own["decoded_token"] and 2 <= len(entry) <= 3  # the prompt's token and the top 2
        ranks = sorted(e["rank"] for k, e in entry.items() if k != str(tid) or own["rank"] <= 2)
        assert ranks[:2] == [1, 2]
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1)
    assert plain.choices[0].model_extra["prompt_logprobs"] is None
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=1,
                                          extra_body={"prompt_logprobs": 0})
    cp = chat.model_extra["prompt_logprobs"]
    assert cp[0] is None and len(cp) == chat.usage.prompt_tokens
    assert all(len(e) == 1 and next(iter(e.values()))["logprob"] <= 0 for e in cp[1:])


@pytest.mark.parametrize("kw,param", [
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 1, "stream": True, "extra_body": {"prompt_logprobs": 1}}, "prompt_logprobs"),
    ({"max_tokens": 1, "extra_body": {"prompt_logprobs": 21}}, "prompt_logprobs"),
])
def test_bad_requests_name_the_field(client: Any, kw: dict[str, Any], param: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=PROMPT, **kw)
    assert info.value.body["param"] == param, info.value.body
