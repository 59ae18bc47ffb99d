"""The tool-call parser (fitserve.server.tool_calls): whole texts, and the same texts streamed
with every cut point (and every pair of cut points), which must add up to the same result."""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator

import pytest

from fitserve.server.tool_calls import (
    ParsedToolCall,
    ToolCallParser,
    parse_call_json,
    parse_tool_calls,
)

NAMES = {"get_weather", "add"}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
CALL2 = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'


def ids() -> Iterator[str]:
    return (f"call_{i}" for i in itertools.count())


def whole(text: str, max_calls: int | None = None) -> tuple[str, list[ParsedToolCall]]:
    return parse_tool_calls(text, NAMES, max_calls, new_id=ids().__next__)


def streamed(pieces: list[str], max_calls: int | None = None) -> tuple[str, list[ParsedToolCall]]:
    parser = ToolCallParser(NAMES, max_calls, new_id=ids().__next__)
    content, calls = "", []
    for p in pieces:
        c, k = parser.feed(p)
        content, calls = content + c, calls + k
    c, k = parser.finish()
    assert parser.finish() == ("", [])  # idempotent
    return content + c, calls + k


# (text, content, [(name, arguments)])
CASES = [
    ("Hello there, how are you?", "Hello there, how are you?", []),
    ("  spaces around  \n", "  spaces around  \n", []),
    ("", "", []),
    ("\n\n", "\n\n", []),
    (CALL, "", [("get_weather", '{"city": "Paris"}')]),
    (f"Let me check.\n{CALL}\n", "Let me check.", [("get_weather", '{"city": "Paris"}')]),
    (f"{CALL}\n{CALL2}", "", [("get_weather", '{"city": "Paris"}'), ("add", '{"a": 1, "b": 2}')]),
    (f"A {CALL} B", "AB", [("get_weather", '{"city": "Paris"}')]),
    ("<tool_call>\nnot json\n</tool_call> after", "<tool_call>\nnot json\n</tool_call> after", []),
    ('x <tool_call>{"name": "unknown", "arguments": {}}</tool_call>',
     'x <tool_call>{"name": "unknown", "arguments": {}}</tool_call>', []),
    (f"{CALL} then <tool_call>\n{{\"name\": \"add\"", "then <tool_call>\n{\"name\": \"add\"",
     [("get_weather", '{"city": "Paris"}')]),  # the second block never closed: text
    ('{"name": "add", "arguments": {"a": 1}}', "", [("add", '{"a": 1}')]),  # bare JSON
    (' {"name": "add", "parameters": {"a": 1}} \n', "", [("add", '{"a": 1}')]),  # Llama's key
    ('{"name": "add", "arguments": "{\\"a\\": 1}"}', "", [("add", '{"a": 1}')]),  # arguments as text
    ('{"name": "add"}', "", [("add", "{}")]),
    ('{"city": "Paris"}', '{"city": "Paris"}', []),  # JSON, not a call
    ('{"name": "add", "arguments": [1]}', '{"name": "add", "arguments": [1]}', []),
    ('{"name": "add", "arguments": {}} and more', '{"name": "add", "arguments": {}} and more', []),
    ("a < b <tool_ca", "a < b <tool_ca", []),  # a partial tag at the end is text
    ("<tool_call", "<tool_call", []),
    ("</tool_call> stray", "</tool_call> stray", []),
    (f"{{ {CALL}", "{", [("get_weather", '{"city": "Paris"}')]),
    ('<tool_call>{"name": "add", "arguments": {"s": "</tool"}}</tool_call>', "",
     [("add", '{"s": "</tool"}')]),
    ('<tool_call>{"name": "add", "arguments": {"s": "é✓"}}</tool_call>', "", [("add", '{"s": "é✓"}')]),
]


@pytest.mark.parametrize(("text", "content", "calls"), CASES)
def test_whole_text(text: str, content: str, calls: list[tuple[str, str]]) -> None:
    got_content, got_calls = whole(text)
    assert got_content == content
    assert [(c.name, c.arguments) for c in got_calls] == calls
    assert [c.id for c in got_calls] == [f"call_{i}" for i in range(len(calls))]


@pytest.mark.parametrize(("text", "content", "calls"), CASES)
def test_every_single_cut_streams_the_same(text: str, content: str, calls: list[tuple[str, str]]) -> None:
    want = whole(text)
    for i in range(len(text) + 1):
        assert streamed([text[:i], text[i:]]) == want, i


@pytest.mark.parametrize(("text", "content", "calls"), CASES)
def test_every_pair_of_cuts_and_char_by_char(text: str, content: str, calls: list[tuple[str, str]]) -> None:
    want = whole(text)
    assert streamed(list(text)) == want
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1, 3):
            assert streamed([text[:i], text[i:j], text[j:]]) == want, (i, j)


def test_content_is_sent_as_early_as_it_can_be() -> None:
    parser = ToolCallParser(NAMES)
    assert parser.feed("Hello wor") == ("Hello wor", [])
    assert parser.feed("ld ") == ("ld", [])  # trailing space held: a block might follow
    assert parser.feed("and <tool_") == (" and", [])  # a possible tag held
    content, calls = parser.feed('call>\n{"name": "add", "arguments": {}}\n</tool_call>')
    assert content == "" and [c.name for c in calls] == ["add"]
    assert parser.finish() == ("", [])


def test_a_call_is_reported_once_its_block_closes() -> None:
    parser = ToolCallParser(NAMES)
    head, tail = CALL[:-5], CALL[-5:]
    assert parser.feed(head) == ("", [])
    content, calls = parser.feed(tail)
    assert content == "" and len(calls) == 1 and calls[0].id.startswith("call_") and len(calls[0].id) == 29


def test_a_bare_json_candidate_is_held_to_the_end() -> None:
    parser = ToolCallParser(NAMES)
    assert parser.feed('{"a": 1') == ("", [])
    assert parser.finish() == ('{"a": 1', [])


def test_max_calls_leaves_the_rest_as_text() -> None:
    content, calls = whole(f"{CALL}\n{CALL2}", max_calls=1)
    assert [c.name for c in calls] == ["get_weather"] and content == CALL2
    assert streamed(list(f"{CALL}\n{CALL2}"), max_calls=1) == (content, calls)


def test_dicts_in_openai_shape() -> None:
    (_, [call]) = whole(CALL)
    assert call.message_dict() == {"id": "call_0", "type": "function",
                                   "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    assert call.delta_dict(3) == {"index": 3, **call.message_dict()}
    assert json.loads(call.arguments) == {"city": "Paris"}


def test_parse_call_json() -> None:
    assert parse_call_json('{"name": "add", "arguments": {"a": 1}}', NAMES) == ("add", '{"a": 1}')
    for bad in ("", "[]", '{"name": 1}', '{"name": "nope", "arguments": {}}', '{"arguments": {}}',
                '{"name": "add", "arguments": "not json"}', '{"name": "add", "arguments": 3}'):
        assert parse_call_json(bad, NAMES) is None, bad


def test_feed_after_finish_is_an_error() -> None:
    parser = ToolCallParser(NAMES)
    parser.finish()
    with pytest.raises(RuntimeError):
        parser.feed("x")
