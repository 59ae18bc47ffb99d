"""POST /tokenize and /detokenize (vLLM's shapes) against a real server: the counts are the
engine tokenizer's and the chat template's, detokenize round-trips, the key and bad input."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from fitserve.loading import load_tokenizer
from fitserve.loading.pull import DEFAULT_MODEL, model_path
from fitserve.loading.tokenizer import Tokenizer
from tests.e2e.conftest import API_KEY, MODEL, Server

MSGS = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return load_tokenizer(model_path(DEFAULT_MODEL))


def post(server: Server, path: str, body: dict[str, Any], key: str | None = API_KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{server.url}{path}", json=body, headers=headers, timeout=60)


def ok(r: httpx.Response) -> dict[str, Any]:
    assert r.status_code == 200, r.text
    return r.json()


def test_prompt_counts_are_the_tokenizers_and_the_completions(server: Server, client, tok: Tokenizer) -> None:  # type: ignore[no-untyped-def]
    text = "The quick brown fox jumps over the lazy dog. Ünïcödé ✓ 你好"
    body = ok(post(server, "/tokenize", {"model": MODEL, "prompt": text}))
    assert body["tokens"] == tok.encode(text) and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == 1024 and body["token_strs"] is None
    usage = client.completions.create(model=MODEL, prompt=text, max_tokens=1).usage
    assert usage.prompt_tokens == body["count"]
    strs = ok(post(server, "/tokenize", {"prompt": "hello world", "return_token_strs": True}))["token_strs"]
    assert strs == [tok.backend.id_to_token(i) for i in tok.encode("hello world")]
    assert ok(post(server, "/tokenize", {"prompt": ""}))["count"] == len(tok.encode(""))


def test_chat_counts_apply_the_template(server: Server, client, tok: Tokenizer) -> None:  # type: ignore[no-untyped-def]
    body = ok(post(server, "/tokenize", {"messages": MSGS}))
    want = tok.encode(tok.apply_chat_template(MSGS, add_generation_prompt=True), add_special_tokens=False)
    assert body["tokens"] == want
    usage = client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=1).usage
    assert usage.prompt_tokens == body["count"]
    bare = ok(post(server, "/tokenize", {"messages": MSGS, "add_generation_prompt": False}))
    assert bare["tokens"] == tok.encode(tok.apply_chat_template(MSGS, add_generation_prompt=False),
                                        add_special_tokens=False)
    assert bare["count"] < body["count"]


def test_chat_counts_with_tools_match_the_chat_completion(server: Server, client) -> None:  # type: ignore[no-untyped-def]
    plain = ok(post(server, "/tokenize", {"messages": MSGS}))
    with_tools = ok(post(server, "/tokenize", {"messages": MSGS, "tools": TOOLS}))
    assert with_tools["count"] > plain["count"]
    # SmolLM2's template has no `tools`: the server wrote them into the system message
    text = ok(post(server, "/detokenize", {"tokens": with_tools["tokens"]}))["prompt"]
    assert "Be brief." in text and "<tools>" in text and '"name": "get_weather"' in text and "<tool_call>" in text
    usage = client.chat.completions.create(model=MODEL, messages=MSGS, tools=TOOLS, max_tokens=1).usage
    assert usage.prompt_tokens == with_tools["count"]


def test_detokenize_round_trips(server: Server, tok: Tokenizer) -> None:
    for text in ("hello world", "  leading spaces and\nnewlines\t", "Ünïcödé ✓ 你好 🙂", "<|im_start|>user\nhi"):
        ids = ok(post(server, "/tokenize", {"prompt": text}))["tokens"]
        assert ok(post(server, "/detokenize", {"model": MODEL, "tokens": ids}))["prompt"] == text
    assert ok(post(server, "/detokenize", {"tokens": []}))["prompt"] == ""
    chat = ok(post(server, "/tokenize", {"messages": MSGS}))["tokens"]
    assert ok(post(server, "/detokenize", {"tokens": chat}))["prompt"] == tok.apply_chat_template(MSGS)


def test_the_api_key_applies(server: Server) -> None:
    for path, body in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [1]})):
        assert post(server, path, body, key=None).status_code == 401
        assert post(server, path, body, key="wrong").status_code == 401


@pytest.mark.parametrize(("path", "body", "status", "param"), [
    ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
    ("/detokenize", {"tokens": [49152]}, 400, "tokens"),
    ("/detokenize", {"tokens": [10**12]}, 400, "tokens"),
    ("/detokenize", {"tokens": ["5"]}, 400, "tokens"),
    ("/detokenize", {}, 400, "tokens"),
    ("/tokenize", {"prompt": 5}, 400, "prompt"),
    ("/tokenize", {}, 400, "prompt"),
    ("/tokenize", {"prompt": "hi", "messages": MSGS}, 400, "prompt"),
    ("/tokenize", {"messages": []}, 400, "messages"),
    ("/tokenize", {"messages": [{"role": "tool", "content": "x"}]}, 400, "messages"),
    ("/tokenize", {"messages": MSGS, "chat_template": "{{ 7 * 7 }}"}, 400, "chat_template"),
    ("/tokenize", {"messages": MSGS, "tools": [{"type": "function", "function": {"name": "a b"}}]}, 400, "tools"),
    ("/tokenize", {"prompt": "hi", "model": "gpt-9"}, 404, "model"),
    ("/detokenize", {"tokens": [1], "model": "gpt-9"}, 404, "model"),
])
def test_bad_input(server: Server, path: str, body: dict[str, Any], status: int, param: str) -> None:
    r = post(server, path, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"], err
    assert post(server, "/tokenize", {"prompt": "still serving"}).status_code == 200
