"""The OpenAPI document (fitserve.server.openapi) without a server: its shape per settings, and
that what the server's builders write validates against it. The real server is fuzzed against
it in tests/e2e/test_openapi_fuzz.py."""

from __future__ import annotations

from typing import Any

import pytest

from fitserve.server.errors import error_body
from fitserve.server.openapi import build_openapi
from fitserve.server.protocol.chat import ChatCompletionRequest, chat_body
from fitserve.server.protocol.common import ModelCard, ModelList, PromptTokensDetails, Usage
from fitserve.server.protocol.completions import CompletionRequest, completion_chunk
from fitserve.server.settings import ServerSettings

jsonschema_rs = pytest.importorskip("jsonschema_rs")


def validator(doc: dict[str, Any], name: str) -> Any:
    root = {"$ref": f"#/components/schemas/{name}", "components": doc["components"]}
    return jsonschema_rs.Draft202012Validator(root)


def test_request_schemas_name_the_model_fields_and_the_served_model() -> None:
    doc = build_openapi(ServerSettings(model_name="m1", api_key="k"))
    schemas = doc["components"]["schemas"]
    for model in (CompletionRequest, ChatCompletionRequest):
        props = schemas[model.__name__]["properties"]
        assert set(props) == set(model.model_fields)
        assert props["model"]["anyOf"][0] == {"type": "string", "enum": ["m1"]}
    assert validator(doc, "CompletionRequest").is_valid({"prompt": "hi", "n": 16, "stop": ["x"] * 16})
    for bad in ({"prompt": ""}, {"prompt": "hi", "n": 17}, {"prompt": "hi", "top_p": 0}, {"prompt": [[]]},
                {"prompt": "hi", "guided_choice": []}, {"prompt": "hi", "logit_bias": {"-1": 1}},
                {"prompt": "hi", "logit_bias": {"5": 101}}, {"prompt": "hi", "guided_regex": ""},
                {"prompt": "hi", "response_format": {"type": "xml"}}, {"prompt": "hi", "model": "other"}, {}):
        assert not validator(doc, "CompletionRequest").is_valid(bad), bad
    assert not validator(doc, "ChatCompletionRequest").is_valid({"messages": []})
    chat = validator(doc, "ChatCompletionRequest")
    msgs = [{"role": "user", "content": "hi"}]
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    assert chat.is_valid({"messages": msgs, "tools": [tool], "tool_choice": "required"})
    assert chat.is_valid({"messages": msgs, "tools": [tool],
                          "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})
    assert chat.is_valid({"messages": [*msgs, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]})
    assert chat.is_valid({"messages": msgs, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object"}}}})
    for bad in ({"tools": [{"type": "function", "function": {"name": "has space"}}]},
                {"tools": [{"type": "function", "function": {}}]}, {"tool_choice": "sometimes"},
                {"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]}):
        assert not chat.is_valid({"messages": msgs, **bad}), bad


def test_security_follows_the_settings() -> None:
    keyed = build_openapi(ServerSettings(api_key="k"))
    assert keyed["security"] == [{"bearerAuth": []}]
    assert keyed["paths"]["/health"]["get"]["security"] == []  # the only open route
    for path in ("/ready", "/metrics", "/v1/models", "/openapi.json"):
        assert "security" not in keyed["paths"][path]["get"], path  # the document's: the key
    assert "401" in keyed["paths"]["/v1/completions"]["post"]["responses"]
    public = build_openapi(ServerSettings(api_key="k", metrics_public=True))
    assert public["paths"]["/metrics"]["get"]["security"] == []
    open_doc = build_openapi(ServerSettings(api_key=None))
    assert "security" not in open_doc and "securitySchemes" not in open_doc["components"]
    for item in open_doc["paths"].values():
        for op in item.values():
            assert "security" not in op and "401" not in op["responses"]


def test_what_the_server_writes_validates() -> None:
    doc = build_openapi(ServerSettings(api_key="k"))
    usage = Usage(prompt_tokens=2, completion_tokens=1, total_tokens=3,
                  prompt_tokens_details=PromptTokensDetails(cached_tokens=0))
    lps = {"tokens": ["a"], "token_logprobs": [-0.5], "top_logprobs": [{"a": -0.5}], "text_offset": [0]}
    body = completion_chunk("cmpl-1", 1, "m", [{"index": 0, "text": "a", "logprobs": lps,
                                                 "finish_reason": "length", "stop_reason": None,
                                                 "prompt_logprobs": None}], usage=usage)
    assert validator(doc, "Completion").is_valid(body)
    # echo with logprobs (the prompt's first token null) and vLLM's prompt_logprobs
    echoed = {"tokens": ["a", "b"], "token_logprobs": [None, -0.5], "top_logprobs": [None, {"b": -0.5}],
              "text_offset": [0, 1]}
    plp = [None, {"7": {"logprob": -0.5, "rank": 1, "decoded_token": "b"}}]
    body = completion_chunk("cmpl-1", 1, "m", [{"index": 0, "text": "ab", "logprobs": echoed,
                                                 "finish_reason": "length", "stop_reason": None,
                                                 "prompt_logprobs": plp}], usage=usage)
    assert validator(doc, "Completion").is_valid(body)
    entry = {"token": "a", "logprob": -0.5, "bytes": [97]}
    chat = chat_body("chatcmpl-1", 1, "m", [{"index": 0, "message": {"role": "assistant", "content": "a",
                                                                     "tool_calls": []},
                                             "logprobs": {"content": [{**entry, "top_logprobs": [entry]}]},
                                             "finish_reason": "stop", "stop_reason": 2}], chunk=False, usage=usage,
                     prompt_logprobs=plp)
    assert validator(doc, "ChatCompletion").is_valid(chat)
    first = chat_body("chatcmpl-1", 1, "m", [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                              "logprobs": None, "finish_reason": None}], chunk=True)
    last = chat_body("chatcmpl-1", 1, "m", [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop",
                                             "stop_reason": None}], chunk=True)
    assert validator(doc, "ChatCompletionChunk").is_valid(first)
    assert validator(doc, "ChatCompletionChunk").is_valid(last)
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    calls = chat_body("chatcmpl-1", 1, "m", [{"index": 0, "message": {"role": "assistant", "content": None,
                                                                      "tool_calls": [call]},
                                              "logprobs": None, "finish_reason": "tool_calls", "stop_reason": None}],
                      chunk=False, usage=usage)
    assert validator(doc, "ChatCompletion").is_valid(calls)
    delta = chat_body("chatcmpl-1", 1, "m", [{"index": 0, "delta": {"tool_calls": [{"index": 0, **call}]},
                                              "logprobs": None, "finish_reason": "tool_calls",
                                              "stop_reason": None}], chunk=True)
    assert validator(doc, "ChatCompletionChunk").is_valid(delta)
    thought = {"role": "assistant", "content": "b", "tool_calls": [], "reasoning_content": "a", "reasoning": "a"}
    assert validator(doc, "ChatCompletion").is_valid(  # --reasoning-parser's keys
        chat_body("chatcmpl-1", 1, "m", [{"index": 0, "message": thought, "logprobs": None, "finish_reason": "stop",
                                          "stop_reason": None}], chunk=False, usage=usage))
    assert validator(doc, "ChatCompletionChunk").is_valid(
        chat_body("chatcmpl-1", 1, "m", [{"index": 0, "delta": {"reasoning_content": "a", "reasoning": "a"},
                                          "logprobs": None, "finish_reason": None}], chunk=True))
    assert validator(doc, "TokenizeResponse").is_valid({"count": 1, "max_model_len": 8, "tokens": [5],
                                                        "token_strs": None})
    assert validator(doc, "DetokenizeResponse").is_valid({"prompt": "hi"})
    assert validator(doc, "CompletionChunk").is_valid(completion_chunk("c", 1, "m", [], usage=usage))
    assert not validator(doc, "Completion").is_valid({**body, "extra": 1})  # closed
    assert validator(doc, "ErrorResponse").is_valid(error_body(400, "bad", param="n"))
    card = ModelCard(id="m", created=1, max_model_len=64, sampling_defaults={"temperature": 1.0},
                     sampling_defaults_source={"temperature": "server"})
    assert validator(doc, "ModelList").is_valid(ModelList(data=[card]).model_dump())


def test_tokenizer_routes_are_documented() -> None:
    doc = build_openapi(ServerSettings(model_name="m1", api_key="k"))
    for path in ("/tokenize", "/detokenize"):
        op = doc["paths"][path]["post"]
        assert "security" not in op and "401" in op["responses"] and "400" in op["responses"], path
    tokenize = {"anyOf": [{"$ref": "#/components/schemas/TokenizeCompletionRequest"},
                          {"$ref": "#/components/schemas/TokenizeChatRequest"}],
                "components": doc["components"]}
    v = jsonschema_rs.Draft202012Validator(tokenize)
    assert v.is_valid({"prompt": "hi"}) and v.is_valid({"messages": [{"role": "user", "content": "hi"}]})
    assert not v.is_valid({"prompt": 3}) and not v.is_valid({}) and not v.is_valid({"prompt": "x", "model": "m2"})
    assert validator(doc, "DetokenizeRequest").is_valid({"tokens": [0, 5]})
    assert not validator(doc, "DetokenizeRequest").is_valid({"tokens": [-1]})
