"""The tool-call formats ``--tool-call-parser`` picks (vLLM's names), whole or as they stream.

- ``hermes``: ``<tool_call>{...}</tool_call>`` blocks (:class:`~fitserve.server.tool_calls.ToolCallParser`);
- ``llama3_json``: Llama 3.1 / 3.2's JSON call, the whole output, optionally after
  ``<|python_tag|>``; several calls separated by ``;``::

      <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}

- ``mistral``: text, then ``[TOOL_CALLS]`` and a JSON list of calls (tokenizer v3..v7), or the
  v11 form ``[TOOL_CALLS]name[ARGS]{...}`` repeated; ids are 9 letters and digits, as
  Mistral's templates require::

      [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]

The format applies to ``tool_choice: "auto"`` with a chat template that reads ``tools``; a grammar
(``required``, a named function) and the server's own tool prompt (a template without ``tools``)
write Hermes blocks, so those are parsed as Hermes (``serving.prepare_chat``).

Each parser is fed the content part of the output (after any reasoning) and returns
``(content, calls)`` per delta and at ``finish()``; a streamed choice adds up to the same content
and calls as the whole text. A call block that does not parse (bad JSON, an unknown tool, more
calls than ``max_calls``) is returned as text, exactly as written.

NOTE: streaming sends each call whole (index, id, name and all its arguments in one delta)
once its JSON is complete; for llama3_json and mistral the JSON ends with the output, so the
calls come with the last chunk. OpenAI clients accept a call in one delta.
"""

from __future__ import annotations

import json
import secrets
import string
from collections.abc import Callable, Collection
from typing import Any, Protocol

from fitserve.server.tool_calls import ParsedToolCall, ToolCallParser, new_call_id, parse_call_json

PYTHON_TAG = "<|python_tag|>"
MISTRAL_TOOL_CALLS = "[TOOL_CALLS]"
MISTRAL_ARGS = "[ARGS]"
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral")
SPECIAL_TOKEN_FORMATS = frozenset({"llama3_json", "mistral"})  # decode with special tokens kept
_ALNUM = string.ascii_letters + string.digits


class ToolParser(Protocol):
    """What :class:`~fitserve.server.choices.ChoiceText` feeds a choice's content through."""

    calls: list[ParsedToolCall]

    def feed(self, delta: str) -> tuple[str, list[ParsedToolCall]]: ...

    def finish(self) -> tuple[str, list[ParsedToolCall]]: ...


def mistral_call_id() -> str:
    """Mistral's tool call id: 9 random letters and digits."""
    return "".join(secrets.choice(_ALNUM) for _ in range(9))


def _partial_prefix(text: str, tag: str) -> bool:
    """Whether ``text`` is a proper prefix of ``tag`` (it may still turn into it)."""
    return len(text) < len(tag) and tag.startswith(text)


def _json_objects(text: str, sep: str) -> list[Any] | None:
    """Consecutive JSON values in ``text`` separated by whitespace and ``sep``; None if not."""
    decoder = json.JSONDecoder()
    out: list[Any] = []
    i = 0
    while True:
        while i < len(text) and (text[i].isspace() or (out and text[i] == sep)):
            i += 1
        if i == len(text):
            return out or None
        try:
            value, i = decoder.raw_decode(text, i)
        except ValueError:
            return None
        out.append(value)


class _HeldCallsParser:
    """A format whose calls run to the end of the output: the text before the start marker
    streams, everything from the marker on is held and parsed at the end."""

    def __init__(self, names: Collection[str], max_calls: int | None, new_id: Callable[[], str]) -> None:
        self.names = frozenset(names)
        self.max_calls = max_calls
        self.calls: list[ParsedToolCall] = []
        self._new_id = new_id
        self._buf = ""
        self._held = False  # the marker was seen: the rest is held to the end
        self._finished = False

    def feed(self, delta: str) -> tuple[str, list[ParsedToolCall]]:
        if self._finished:
            raise RuntimeError("feed() after finish()")
        self._buf += delta
        if self._held:
            return "", []
        start, keep = self._marker(self._buf)
        if start is None:
            safe, self._buf = self._buf[:len(self._buf) - keep], self._buf[len(self._buf) - keep:]
            return safe, []
        self._held = True
        text, self._buf = self._buf[:start], self._buf[start:]
        return text, []

    def finish(self) -> tuple[str, list[ParsedToolCall]]:
        if self._finished:
            return "", []
        self._finished = True
        rest, self._buf = self._buf, ""
        if not self._held:
            return rest, []
        parsed = self._parse(rest)
        if parsed is None or (self.max_calls is not None and len(parsed) > self.max_calls):
            return rest, []  # not calls of this request: the text as written
        self.calls = [ParsedToolCall(self._new_id(), name, args) for name, args in parsed]
        return "", list(self.calls)

    def _marker(self, text: str) -> tuple[int | None, int]:
        """``(where the calls start or None, chars to hold back at the end)``."""
        raise NotImplementedError

    def _parse(self, text: str) -> list[tuple[str, str]] | None:
        """The calls of the held text (from the marker on), or None if it is not calls."""
        raise NotImplementedError

    def _call(self, obj: Any) -> tuple[str, str] | None:
        return parse_call_json(json.dumps(obj), self.names) if isinstance(obj, dict) else None


class Llama3JsonParser(_HeldCallsParser):
    """Llama 3.1 / 3.2 JSON calls: the output (after whitespace) starts with ``{`` or ``<|python_tag|>``."""

    _plain = False  # the output started as text: it never holds a call

    def _marker(self, text: str) -> tuple[int | None, int]:
        head = text.lstrip()
        if head.startswith(("{", PYTHON_TAG)):
            return 0, 0
        if not head or _partial_prefix(head, PYTHON_TAG):
            return None, len(text)  # whitespace so far, or maybe the tag
        self._plain = True  # vLLM: only an output that starts with a call is one
        return None, 0

    def feed(self, delta: str) -> tuple[str, list[ParsedToolCall]]:
        if self._plain and not self._finished:
            return delta, []
        return super().feed(delta)

    def _parse(self, text: str) -> list[tuple[str, str]] | None:
        body = text.lstrip()
        body = body[len(PYTHON_TAG):] if body.startswith(PYTHON_TAG) else body
        objs = _json_objects(body, ";")
        calls = [self._call(o) for o in objs] if objs else None
        return None if calls is None or None in calls else [c for c in calls if c is not None]


class MistralParser(_HeldCallsParser):
    """Mistral: content, then ``[TOOL_CALLS]`` and the calls."""

    def _marker(self, text: str) -> tuple[int | None, int]:
        i = text.find(MISTRAL_TOOL_CALLS)
        if i >= 0:
            return i, 0
        for n in range(min(len(text), len(MISTRAL_TOOL_CALLS) - 1), 0, -1):
            if MISTRAL_TOOL_CALLS.startswith(text[-n:]):
                return None, n
        return None, 0

    def _parse(self, text: str) -> list[tuple[str, str]] | None:
        body = text[len(MISTRAL_TOOL_CALLS):]
        if body.lstrip().startswith(("[", "{")):  # [TOOL_CALLS][{...}, ...]
            objs = _json_objects(body, ",")
            if objs is None or len(objs) != 1:
                return None
            items = objs[0] if isinstance(objs[0], list) else [objs[0]]
            calls = [self._call(o) for o in items]
        else:  # v11: name[ARGS]{...}, each after its own [TOOL_CALLS]
            calls = [self._v11_call(part) for part in body.split(MISTRAL_TOOL_CALLS)]
        return None if not calls or None in calls else [c for c in calls if c is not None]

    def _v11_call(self, part: str) -> tuple[str, str] | None:
        name, sep, args = part.partition(MISTRAL_ARGS)
        if not sep:
            return None
        try:
            obj = json.loads(args)
        except ValueError:
            return None
        return self._call({"name": name.strip(), "arguments": obj})


def make_tool_parser(name: str, names: Collection[str], max_calls: int | None,
                     new_id: Callable[[], str] | None = None) -> ToolParser:
    """The ``--tool-call-parser`` named ``name`` for one choice."""
    if name == "hermes":
        return ToolCallParser(names, max_calls, new_id or new_call_id)
    if name == "llama3_json":
        return Llama3JsonParser(names, max_calls, new_id or new_call_id)
    if name == "mistral":
        return MistralParser(names, max_calls, new_id or mistral_call_id)
    raise ValueError(f"unknown tool call parser {name!r}; known: {', '.join(TOOL_CALL_PARSERS)}")


def parse_with(name: str, text: str, names: Collection[str], max_calls: int | None = None,
               new_id: Callable[[], str] | None = None) -> tuple[str, list[ParsedToolCall]]:
    """The whole content -> ``(content, calls)`` with the parser ``name``."""
    parser = make_tool_parser(name, names, max_calls, new_id)
    content, calls = parser.feed(text)
    more, rest = parser.finish()
    return content + more, calls + rest
