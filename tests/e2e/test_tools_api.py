"""OpenAI tool calling through the official client against a real server (SmolLM2, whose chat
template has no `tools`: the server shows them Hermes style and parses `<tool_call>` blocks).

`required` and a named function are grammar-enforced, so their calls always parse and their
arguments match the schema; `auto` is the model's choice (greedy, so a given prompt decides the
same way every run); a tool result goes back in a `tool` message."""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from tests.e2e.conftest import API_KEY, MODEL, Server

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
           "required": ["city"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 999},
                                        "b": {"type": "integer", "minimum": 0, "maximum": 999}},
       "required": ["a", "b"], "additionalProperties": False}
TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "get_weather", "description": "The current weather in a city",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "add", "description": "Add two numbers", "parameters": ADD}},
]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]
# greedy SmolLM2 calls the tool when its history shows it calling one before
ASK_AGAIN = [{"role": "user", "content": "What is the weather in Rome?"},
             {"role": "assistant", "content": None, "tool_calls": [
                 {"id": "call_1", "type": "function",
                  "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
             {"role": "user", "content": "What is the weather in Paris?"}]


def check_calls(calls: Any, names: set[str]) -> None:
    assert calls, "no tool calls"
    for c in calls:
        assert c.type == "function" and c.id.startswith("call_") and c.function.name in names
        jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])


def streamed(client: Any, **kw: Any) -> tuple[str, list[dict[str, Any]], str | None]:
    """(content, tool calls as joined from their deltas, finish_reason) of a streamed chat."""
    content, calls, finish = "", [], None
    chunks = list(client.chat.completions.create(model=MODEL, stream=True, temperature=0, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    for chunk in chunks:
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for d in choice.delta.tool_calls or []:
            if d.index == len(calls):  # a new call: OpenAI's first delta has its id, type and name
                assert d.id.startswith("call_") and d.type == "function" and d.function.name
                calls.append({"id": d.id, "name": d.function.name, "arguments": ""})
            calls[d.index]["arguments"] += d.function.arguments or ""
        finish = choice.finish_reason or finish
    return content, calls, finish


def test_required_always_parses(client) -> None:  # type: ignore[no-untyped-def]
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                       temperature=0, max_tokens=48)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    check_calls(choice.message.tool_calls, set(SCHEMAS))
    assert len(choice.message.tool_calls) == 1 and choice.message.content is None


def test_named_function_streams_like_the_response(client) -> None:  # type: ignore[no-untyped-def]
    kw = {"messages": [{"role": "user", "content": "What is 2 plus 3?"}], "tools": TOOLS,
          "tool_choice": {"type": "function", "function": {"name": "add"}}, "max_tokens": 40}
    r = client.chat.completions.create(model=MODEL, temperature=0, **kw)
    assert r.choices[0].finish_reason == "tool_calls"
    check_calls(r.choices[0].message.tool_calls, {"add"})
    content, calls, finish = streamed(client, **kw)
    assert finish == "tool_calls" and content == ""
    want = r.choices[0].message.tool_calls[0]
    assert [(c["name"], c["arguments"]) for c in calls] == [("add", want.function.arguments)]


def test_auto_calls_when_the_model_does_and_streams_the_same(client) -> None:  # type: ignore[no-untyped-def]
    r = client.chat.completions.create(model=MODEL, messages=ASK_AGAIN, tools=TOOLS, temperature=0, max_tokens=40)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
    check_calls(choice.message.tool_calls, set(SCHEMAS))
    assert json.loads(choice.message.tool_calls[0].function.arguments) == {"city": "Paris"}
    content, calls, finish = streamed(client, messages=ASK_AGAIN, tools=TOOLS, max_tokens=40)
    assert (content, finish) == ("", "tool_calls")
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (c.function.name, c.function.arguments) for c in choice.message.tool_calls]


def test_auto_answers_in_text_when_the_model_does(client) -> None:  # type: ignore[no-untyped-def]
    msgs = [{"role": "user", "content": "Say hello."}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, tools=TOOLS, temperature=0, max_tokens=12)
    choice = r.choices[0]
    assert choice.message.content and not choice.message.tool_calls
    assert choice.finish_reason in ("stop", "length")
    content, calls, finish = streamed(client, messages=msgs, tools=TOOLS, max_tokens=12)
    assert (content, calls, finish) == (choice.message.content, [], choice.finish_reason)


def test_none_shows_no_tools(server: Server, client) -> None:  # type: ignore[no-untyped-def]
    plain = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=1).usage.prompt_tokens
    none = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="none",
                                          max_tokens=1).usage.prompt_tokens
    auto = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=1).usage.prompt_tokens
    assert none == plain < auto


def test_a_tool_result_goes_back_and_gets_an_answer(server: Server, client) -> None:  # type: ignore[no-untyped-def]
    first = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                           temperature=0, max_tokens=48)
    message = first.choices[0].message
    call = message.tool_calls[0]
    history = [*ASK, message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": '{"temperature_c": 21, "sky": "sunny"}'}]
    r = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, tool_choice="none",
                                       temperature=0, max_tokens=16)
    assert r.choices[0].message.content and r.choices[0].finish_reason in ("stop", "length")
    # the call and its result are in the prompt (as Hermes text: the template has no tool role)
    tokens = httpx.post(f"{server.url}/tokenize", json={"messages": history},
                        headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30).json()["tokens"]
    text = httpx.post(f"{server.url}/detokenize", json={"tokens": tokens},
                      headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30).json()["prompt"]
    assert f'<tool_call>\n{{"name": "{call.function.name}", "arguments": {call.function.arguments}}}' in text
    assert '<tool_response>\n{"temperature_c": 21, "sky": "sunny"}\n</tool_response>' in text
    assert r.usage.prompt_tokens == len(tokens)


@pytest.mark.parametrize(("override", "param"), [
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": ["city"]}}]}, "tools"),
    ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"messages": [*ASK, {"role": "tool", "content": "no id"}]}, "messages"),
    ({"messages": [{"role": "user", "content": "x", "tool_call_id": "call_1"}]}, "messages"),
    ({"functions": [{"name": "f"}]}, "functions"),
])
def test_bad_tools_are_400(client, override: dict[str, Any], param: str) -> None:  # type: ignore[no-untyped-def]
    body = {"messages": ASK, "max_tokens": 2, **override}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, **body)
    assert info.value.body["param"] == param, info.value.body


def test_an_invalid_parameters_schema_is_400_and_the_server_goes_on(client) -> None:  # type: ignore[no-untyped-def]
    bad = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                        "properties": {"x": {"type": 7}}}}}]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=ASK, tools=bad, tool_choice="required", max_tokens=8)
    assert info.value.body["param"] == "tools"
    assert client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=2).choices[0].message.content
