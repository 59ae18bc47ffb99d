"""--tool-call-parser llama3_json and mistral (fitserve.server.tool_call_formats) on the models'
own output formats, the same whole and streamed at every cut; hermes stays tool_calls.py's."""

from __future__ import annotations

import itertools
import json
import re

import pytest

from fitserve.server.tool_call_formats import make_tool_parser, mistral_call_id, parse_with

NAMES = {"get_current_weather", "add"}
WEATHER = '{"city": "Dallas", "state": "TX", "unit": "fahrenheit"}'

# (parser, output, content, [(name, arguments)])
CASES = [
    # Llama 3.1 / 3.2 JSON tool calling (the prompt asks for {"name": ..., "parameters": ...})
    ("llama3_json", '{"name": "get_current_weather", "parameters": ' + WEATHER + "}", "",
     [("get_current_weather", WEATHER)]),
    ("llama3_json", '<|python_tag|>{"name": "add", "parameters": {"a": 3, "b": 4}}', "", [("add", '{"a": 3, "b": 4}')]),
    ("llama3_json", '{"name": "add", "parameters": {"a": 1, "b": 2}}; {"name": "add", "parameters": {"a": 3, "b": 4}}',
     "", [("add", '{"a": 1, "b": 2}'), ("add", '{"a": 3, "b": 4}')]),
    ("llama3_json", "\n\n" + '{"name": "add", "arguments": {"a": 1}}', "", [("add", '{"a": 1}')]),
    ("llama3_json", "The weather in Dallas is sunny.", "The weather in Dallas is sunny.", []),
    ("llama3_json", 'Use {"name": "add"} like this', 'Use {"name": "add"} like this', []),  # text first
    ("llama3_json", '{"name": "nope", "parameters": {}}', '{"name": "nope", "parameters": {}}', []),
    ("llama3_json", '{"name": "add", "parameters": {"a": 1}', '{"name": "add", "parameters": {"a": 1}', []),
    ("llama3_json", "<|python", "<|python", []),
    # Mistral (tokenizer v3-v7): [TOOL_CALLS] then a JSON list
    ("mistral", "[TOOL_CALLS][{\"name\": \"get_current_weather\", \"arguments\": " + WEATHER + "}]", "",
     [("get_current_weather", WEATHER)]),
    ("mistral", 'Let me check. [TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": 2}}, '
                '{"name": "get_current_weather", "arguments": {"city": "Paris"}}]', "Let me check. ",
     [("add", '{"a": 1, "b": 2}'), ("get_current_weather", '{"city": "Paris"}')]),
    # Mistral v11 (Magistral, Mistral-Small-3.2): [TOOL_CALLS]name[ARGS]{...}
    ("mistral", '[TOOL_CALLS]get_current_weather[ARGS]{"city": "Dallas"}[TOOL_CALLS]add[ARGS]{"a": 1}', "",
     [("get_current_weather", '{"city": "Dallas"}'), ("add", '{"a": 1}')]),
    ("mistral", "No tools needed [TOOL_CALL] here.", "No tools needed [TOOL_CALL] here.", []),
    ("mistral", "[TOOL_CALLS][{\"name\": \"add\", \"arguments\": {", "[TOOL_CALLS][{\"name\": \"add\", \"arguments\": {",
     []),
    ("mistral", "[TOOL_CALLS]add[ARGS]{not json}", "[TOOL_CALLS]add[ARGS]{not json}", []),
]


def ids(prefix: str) -> object:
    counter = itertools.count()
    return lambda: f"{prefix}{next(counter)}"


def streamed(parser: str, pieces: list[str], max_calls: int | None = None) -> tuple[str, list[tuple[str, str]]]:
    p = make_tool_parser(parser, NAMES, max_calls)
    outs = [p.feed(x) for x in pieces] + [p.finish()]
    return "".join(c for c, _ in outs), [(c.name, c.arguments) for _, cs in outs for c in cs]


@pytest.mark.parametrize(("parser", "text", "content", "calls"), CASES)
def test_whole(parser: str, text: str, content: str, calls: list[tuple[str, str]]) -> None:
    got_content, got = parse_with(parser, text, NAMES)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got] == [(n, json.loads(a)) for n, a in calls]


@pytest.mark.parametrize(("parser", "text", "content", "calls"), CASES)
def test_every_cut_and_char_by_char_stream_the_same(parser: str, text: str, content: str,
                                                    calls: list[tuple[str, str]]) -> None:
    whole = streamed(parser, [text])
    for i in range(len(text) + 1):
        assert streamed(parser, [text[:i], text[i:]]) == whole, i
    assert streamed(parser, list(text)) == whole


def test_text_before_the_calls_streams_at_once() -> None:
    p = make_tool_parser("mistral", NAMES, None)
    assert p.feed("Let me check [TOOL") == ("Let me check ", [])  # a possible marker is held
    assert p.feed("_CALLS][{\"name\": \"add\", \"arguments\": {}}]") == ("", [])
    content, calls = p.finish()
    assert content == "" and [c.name for c in calls] == ["add"] and p.calls == calls
    q = make_tool_parser("llama3_json", NAMES, None)
    assert q.feed("Sunny") == ("Sunny", [])  # plain text is never held
    assert q.feed(' {"name": "add"}') == (' {"name": "add"}', [])


def test_more_calls_than_allowed_stay_text() -> None:
    two = '{"name": "add", "parameters": {}}; {"name": "add", "parameters": {}}'
    assert parse_with("llama3_json", two, NAMES, max_calls=1) == (two, [])
    assert len(parse_with("llama3_json", two, NAMES, max_calls=2)[1]) == 2


def test_ids() -> None:
    assert all(re.fullmatch(r"[A-Za-z0-9]{9}", mistral_call_id()) for _ in range(50))
    _, calls = parse_with("mistral", '[TOOL_CALLS][{"name": "add", "arguments": {}}]', NAMES)
    assert re.fullmatch(r"[A-Za-z0-9]{9}", calls[0].id)
    _, calls = parse_with("llama3_json", '{"name": "add", "parameters": {}}', NAMES)
    assert re.fullmatch(r"call_[0-9a-f]{24}", calls[0].id)
    assert calls[0].delta_dict(0) == {"index": 0, "id": calls[0].id, "type": "function",
                                      "function": {"name": "add", "arguments": "{}"}}


def test_unknown_parser() -> None:
    with pytest.raises(ValueError, match="unknown tool call parser 'pythonic'; known: hermes, llama3_json, mistral"):
        make_tool_parser("pythonic", NAMES, None)
