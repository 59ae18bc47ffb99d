"""OpenAI's logit_bias, echo, suffix and user against a real server: each works or is a 400,
none is accepted and dropped."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from tests.e2e.conftest import API_KEY, MODEL, Server

PROMPT = "The capital of France is"


def token_ids(server: Server, text: str) -> list[int]:
    r = httpx.post(f"{server.url}/tokenize", json={"prompt": text}, headers={"Authorization": f"Bearer {API_KEY}"},
                   timeout=30)
    return r.json()["tokens"]


def greedy(client: Any, **kw: Any) -> Any:
    return client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=0, **kw)


def test_logit_bias_bans_and_forces_tokens(server: Server, client) -> None:  # type: ignore[no-untyped-def]
    free = greedy(client).choices[0]
    first = token_ids(server, free.logprobs.tokens[0])
    assert len(first) == 1
    banned = greedy(client, logit_bias={str(first[0]): -100}).choices[0]
    assert banned.logprobs.tokens[0] != free.logprobs.tokens[0]
    [blue] = token_ids(server, " blue")
    forced = greedy(client, logit_bias={str(blue): 100}).choices[0]
    assert forced.text == " blue" * 4
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                          temperature=0, logit_bias={str(blue): 100})
    assert chat.choices[0].message.content == " blue" * 3


@pytest.mark.parametrize("bias", [{"49152": 1}, {"-1": 1}, {"abc": 1}, {"007": 1}, {"5": 101}, {"5": -100.5},
                                  {"5": "1"}])
def test_bad_logit_bias_is_400(client, bias: dict[str, Any]) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, logit_bias=bias)
    assert info.value.body["param"] == "logit_bias", info.value.body


def test_echo_prepends_the_prompt(server: Server, client) -> None:  # type: ignore[no-untyped-def]
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0).choices[0].text
    echoed = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, echo=True)
    assert echoed.choices[0].text == PROMPT + plain
    ids = token_ids(server, PROMPT)
    by_ids = client.completions.create(model=MODEL, prompt=[ids, ids], max_tokens=3, temperature=0, echo=True, n=2)
    assert [c.text for c in by_ids.choices] == [PROMPT + plain] * 4
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, echo=True,
                                            stream=True))
    assert chunks[0].choices[0].text.startswith(PROMPT)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == PROMPT + plain


def test_suffix_is_400(client) -> None:  # type: ignore[no-untyped-def]
    # (echo with logprobs works: tests/e2e/test_prompt_logprobs_api.py)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, suffix=" end.")
    assert info.value.body["param"] == "suffix" and "not supported" in info.value.body["message"]


def test_user_is_accepted(client) -> None:  # type: ignore[no-untyped-def]
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, user="user-1234")
    assert r.choices[0].text is not None


def test_beam_search_refuses_constraints(client) -> None:  # type: ignore[no-untyped-def]
    for extra in ({"guided_choice": ["a", "b"]}, {"logit_bias": {"5": 1}}):
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, n=2,
                                      extra_body={"use_beam_search": True, **extra})
        assert info.value.body["param"] == "use_beam_search", info.value.body
