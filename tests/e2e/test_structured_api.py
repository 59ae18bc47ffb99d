"""Structured output through the official client against a real server: OpenAI's
response_format (json_object, json_schema) and vLLM's guided_json / guided_regex / guided_choice /
guided_grammar (and its newer structured_outputs); every output validates, streamed or not;
a bad schema, regex or grammar is a 400 naming the problem, and the server goes on."""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import openai
import pytest

from tests.e2e.conftest import MODEL

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
ASK = [{"role": "user", "content": "Describe a person as JSON with a name and an age."}]
PHONE = r"[0-9]{3}-[0-9]{4}"
CHOICES = ["red", "green", "blue"]
GBNF = 'root ::= answer " " digit\nanswer ::= "yes" | "no"\ndigit ::= [0-9]'
LARK = 'start: ANSWER " " DIGIT\nANSWER: "yes" | "no"\nDIGIT: /[0-9]/'
GRAMMAR_TEXT = r"(yes|no) [0-9]"


def chat(client: Any, **kw: Any) -> Any:
    kw.setdefault("temperature", 0)
    return client.chat.completions.create(model=MODEL, messages=kw.pop("messages", ASK), **kw)


def streamed_chat(client: Any, **kw: Any) -> tuple[str, str | None]:
    chunks = list(chat(client, stream=True, **kw))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, [c.choices[0].finish_reason for c in chunks if c.choices][-1]


def test_json_schema(client) -> None:  # type: ignore[no-untyped-def]
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    r = chat(client, response_format=fmt, max_tokens=40)
    jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)
    assert r.choices[0].finish_reason == "stop"  # the grammar completed
    text, finish = streamed_chat(client, response_format=fmt, max_tokens=40)
    assert (text, finish) == (r.choices[0].message.content, "stop")


def test_json_object_and_guided_json(client) -> None:  # type: ignore[no-untyped-def]
    r = chat(client, response_format={"type": "json_object"}, max_tokens=40)
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    for schema in (PERSON, json.dumps(PERSON)):  # an object, or its JSON text
        c = client.completions.create(model=MODEL, prompt="A person as JSON:", max_tokens=40, temperature=0,
                                      extra_body={"guided_json": schema})
        jsonschema.validate(json.loads(c.choices[0].text), PERSON)
    so = chat(client, max_tokens=40, extra_body={"structured_outputs": {"json": PERSON}})  # vLLM's newer form
    jsonschema.validate(json.loads(so.choices[0].message.content), PERSON)


def test_response_format_text_is_no_constraint(client) -> None:  # type: ignore[no-untyped-def]
    free = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6, temperature=0)
    text = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6, temperature=0,
                                     extra_body={"response_format": {"type": "text"}})
    assert text.choices[0].text == free.choices[0].text


def test_guided_regex(client) -> None:  # type: ignore[no-untyped-def]
    r = client.completions.create(model=MODEL, prompt="Call me at", max_tokens=12, temperature=0,
                                  extra_body={"guided_regex": PHONE})
    assert re.fullmatch(PHONE, r.choices[0].text) and r.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(model=MODEL, prompt="Call me at", max_tokens=12, temperature=0,
                                            stream=True, extra_body={"guided_regex": PHONE}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text


def test_guided_choice(client) -> None:  # type: ignore[no-untyped-def]
    r = chat(client, messages=[{"role": "user", "content": "Name a colour."}], max_tokens=8, n=2,
             temperature=1.0, seed=3, extra_body={"guided_choice": CHOICES})
    assert all(c.message.content in CHOICES for c in r.choices)
    text, finish = streamed_chat(client, messages=[{"role": "user", "content": "Name a colour."}], max_tokens=8,
                                 extra_body={"guided_choice": CHOICES})
    assert text in CHOICES and finish == "stop"


@pytest.mark.parametrize("grammar", [GBNF, LARK], ids=["gbnf", "lark"])
def test_guided_grammar(client, grammar: str) -> None:  # type: ignore[no-untyped-def]
    r = client.completions.create(model=MODEL, prompt="Is the sky blue? Answer and rate 0-9:", max_tokens=8,
                                  temperature=0, extra_body={"guided_grammar": grammar})
    assert re.fullmatch(GRAMMAR_TEXT, r.choices[0].text), r.choices[0].text


@pytest.mark.parametrize(("extra", "param", "words"), [
    ({"guided_json": {"type": 7}}, "guided_json", "json"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format", "json"),
    ({"guided_regex": "a(b"}, "guided_regex", "regex"),
    ({"guided_regex": "(?<=a)b"}, "guided_regex", "regex"),
    ({"guided_grammar": "root ::= missing_rule"}, "guided_grammar", "grammar"),
    ({"guided_grammar": "start: (((("}, "guided_grammar", "grammar"),
])
def test_invalid_constraints_are_400_and_the_server_goes_on(client, extra: dict[str, Any], param: str,
                                                             words: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="x", max_tokens=4, extra_body=extra)
    err = info.value.body
    assert err["param"] == param and words in err["message"].lower(), err
    assert client.completions.create(model=MODEL, prompt="ok", max_tokens=2).choices[0].text is not None


@pytest.mark.parametrize(("extra", "param"), [
    ({"guided_regex": PHONE, "guided_choice": CHOICES}, "guided_choice"),
    ({"response_format": {"type": "json_object"}, "guided_json": PERSON}, "guided_json"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_choice": ["a", ""]}, "guided_choice"),
    ({"guided_choice": "red"}, "guided_choice"),
    ({"guided_json": "not json"}, "guided_json"),
    ({"guided_json": "[1, 2]"}, "guided_json"),
    ({"guided_json": ["not", "a", "schema"]}, "guided_json"),
    ({"guided_regex": ""}, "guided_regex"),
    ({"guided_grammar": ""}, "guided_grammar"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": "{}"}}}, "response_format"),
    ({"response_format": {"type": "json_object", "json_schema": {"name": "x", "schema": {}}}}, "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"structured_outputs": {"regex": PHONE, "choice": CHOICES}}, "structured_outputs"),
    ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
])
def test_malformed_fields_are_400_naming_the_field(client, extra: dict[str, Any], param: str) -> None:  # type: ignore[no-untyped-def]
    for create in (client.completions.create, client.chat.completions.create):
        body = {"prompt": "x"} if create == client.completions.create else {"messages": ASK}
        with pytest.raises(openai.BadRequestError) as info:
            create(model=MODEL, max_tokens=4, extra_body=extra, **body)
        assert info.value.body["param"] == param, info.value.body
