"""Every client mistake is an OpenAI-style error with the right status code, never a 5xx."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from tests.e2e.conftest import API_KEY, MODEL, Server

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
CMPL = {"model": MODEL, "prompt": "hi", "max_tokens": 2}


def post(server: Server, path: str, body: Any = None, *, raw: bytes | None = None,
         headers: dict[str, str] | None = None) -> httpx.Response:
    h = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json", **(headers or {})}
    return httpx.post(f"{server.url}{path}", json=body if raw is None else None, content=raw, headers=h, timeout=60)


def assert_error(r: httpx.Response, status: int, param: str | None = None) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err
    return err


@pytest.mark.parametrize(
    ("path", "override", "param"),
    [
        ("/v1/completions", {"max_tokens": 2000}, "max_tokens"),  # prompt + max_tokens > 1024
        ("/v1/completions", {"prompt": "hi " * 1100}, "prompt"),
        ("/v1/chat/completions", {"max_completion_tokens": 1024}, "max_completion_tokens"),
        ("/v1/completions", {"temperature": -0.5}, "temperature"),
        ("/v1/completions", {"top_p": 0}, "top_p"),
        ("/v1/chat/completions", {"top_p": 1.5}, "top_p"),
        ("/v1/completions", {"n": 17}, "n"),
        ("/v1/completions", {"n": 0}, "n"),
        ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("/v1/completions", {"logprobs": 21}, "logprobs"),
        ("/v1/completions", {"stop": [str(i) for i in range(17)]}, "stop"),
        ("/v1/completions", {"max_tokens": "5"}, "max_tokens"),  # wrong types
        ("/v1/completions", {"n": 1.5}, "n"),
        ("/v1/chat/completions", {"messages": "hi"}, "messages"),
        ("/v1/chat/completions", {"messages": []}, "messages"),
        ("/v1/completions", {"prompt": [1, "a"]}, "prompt"),
        ("/v1/completions", {"prompt": [10**9]}, "prompt"),
        ("/v1/completions", {"prompt": ""}, "prompt"),
        ("/v1/chat/completions", {"chat_template": "{{ 7*7 }}"}, "chat_template"),
        ("/v1/chat/completions", {"chat_template_kwargs": {"enable_thinking": True}}, "chat_template_kwargs"),
        ("/v1/completions", {"min_p": 2}, "min_p"),
        ("/v1/completions", {"presence_penalty": 3}, "presence_penalty"),
        ("/v1/completions", {"stream_options": {"include_usage": True}}, "stream_options"),
    ],
)
def test_invalid_parameters_are_400(server: Server, path: str, override: dict[str, Any], param: str) -> None:
    base = CHAT if "chat" in path else CMPL
    assert_error(post(server, path, {**base, **override}), 400, param)


def test_malformed_json_and_non_object(server: Server) -> None:
    assert_error(post(server, "/v1/completions", raw=b'{"prompt": "hi",'), 400)
    assert_error(post(server, "/v1/completions", raw=b"[1, 2]"), 400)
    assert_error(post(server, "/v1/chat/completions", raw=b"\xff\xfe"), 400)


def test_unknown_model_is_404(server: Server, client) -> None:  # type: ignore[no-untyped-def]
    assert_error(post(server, "/v1/completions", {**CMPL, "model": "gpt-9"}), 404, "model")
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=CHAT["messages"], max_tokens=1)


def test_api_key_is_401(server: Server) -> None:
    assert_error(post(server, "/v1/completions", CMPL, headers={"Authorization": "Bearer wrong"}), 401)
    r = httpx.post(f"{server.url}/v1/completions", json=CMPL)
    assert_error(r, 401)
    assert_error(httpx.get(f"{server.url}/v1/models"), 401)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="bad", max_retries=0).models.list()


def test_body_too_large_is_413(server: Server) -> None:
    assert_error(post(server, "/v1/completions", {**CMPL, "prompt": "x" * 70_000}), 413)


def test_unknown_route_and_method(server: Server) -> None:
    assert_error(httpx.get(f"{server.url}/v1/nothing-here"), 404)
    assert_error(httpx.get(f"{server.url}/v1/completions"), 405)


def test_openai_client_raises_bad_request(client) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2, temperature=-1)
    assert "temperature" in str(info.value)


def test_server_still_healthy_after_errors(server: Server, client) -> None:  # type: ignore[no-untyped-def]
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert client.completions.create(model=MODEL, prompt="ok", max_tokens=2).choices[0].text is not None
    server.wait_idle()
