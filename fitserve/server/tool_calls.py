"""Tool calls out of generated text, whole or as it streams.

A call is a ``<tool_call>`` block holding a JSON object ``{"name": N, "arguments": {...}}``
(``"parameters"`` is accepted for ``"arguments"``, and arguments given as JSON text), N one of
the request's tools. When the text has no block, the whole text being one such bare JSON object
counts as one call (small models often drop the tags).

The rules, the same whichever way the text is cut into deltas (:class:`ToolCallParser` is fed
the deltas; :func:`parse_tool_calls` feeds it the whole text at once)::

    text <tool_call>{valid call}</tool_call> text   ->  content "text" + "text", one call
    <tool_call>{not JSON, unknown name...}</tool_call>  ->  content: the block as written
    <tool_call>{...  (never closed)                     ->  content: as written
    {"name": "f", "arguments": {...}}  (alone)          ->  one call, no content

- whitespace next to a valid block is dropped (the newlines around it are format, not text);
  everything else of the content is exactly as generated;
- past ``max_calls`` calls, further blocks stay text;
- streaming holds back only what could still turn into a call: a possible start of
  ``<tool_call>`` at the end of the text, whitespace that may precede a block, an open block,
  and, while the text so far could be a bare JSON call (it starts with ``{``), all of it.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

from fitserve.server.tools import TOOL_CALL_CLOSE, TOOL_CALL_OPEN


@dataclass(frozen=True, slots=True)
class ParsedToolCall:
    """One call: its id (``call_`` + 24 hex digits), function name and arguments as JSON text."""

    id: str
    name: str
    arguments: str

    def message_dict(self) -> dict[str, Any]:
        """As in a response's ``message.tool_calls``."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}

    def delta_dict(self, index: int) -> dict[str, Any]:
        """As in a stream chunk's ``delta.tool_calls`` (the whole call in one delta)."""
        return {"index": index, **self.message_dict()}


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _partial_tag(text: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``<tool_call>``."""
    for n in range(min(len(text), len(TOOL_CALL_OPEN) - 1), 0, -1):
        if TOOL_CALL_OPEN.startswith(text[-n:]):
            return n
    return 0


class ToolCallParser:
    """Incremental parser: ``feed(delta)`` and, at the end, ``finish()`` each return
    ``(content, calls)``: the text now safe to send and the calls completed since the last call."""

    def __init__(self, names: Collection[str], max_calls: int | None = None,
                 new_id: Callable[[], str] = new_call_id) -> None:
        self.names = frozenset(names)
        self.max_calls = max_calls
        self.calls: list[ParsedToolCall] = []  # all calls so far
        self._new_id = new_id
        self._buf = ""  # not yet decided
        self._mode = "start"  # start | json (could be a bare call) | text | block (inside <tool_call>)
        self._ws = ""  # whitespace held back: dropped if it turns out to touch a valid block
        self._pre_ws = ""  # the held whitespace before the open block
        self._after_call = False  # the last thing was a valid block: leading whitespace goes
        self._finished = False

    # -- public -------------------------------------------------------------------------------
    def feed(self, delta: str) -> tuple[str, list[ParsedToolCall]]:
        if self._finished:
            raise RuntimeError("feed() after finish()")
        self._buf += delta
        return self._run(final=False)

    def finish(self) -> tuple[str, list[ParsedToolCall]]:
        if self._finished:
            return "", []
        out, calls = self._run(final=True)
        self._finished = True
        if self._mode == "block":  # never closed: as written
            out += self._text(self._pre_ws + TOOL_CALL_OPEN + self._buf)
            self._buf = ""
        if not self._after_call:
            out += self._ws
        self._ws = ""
        return out, calls

    # -- the state machine ----------------------------------------------------------------------
    def _run(self, final: bool) -> tuple[str, list[ParsedToolCall]]:
        before = len(self.calls)
        out: list[str] = []
        while True:
            if self._mode == "start":
                head = self._buf.lstrip()
                if not head:
                    if not final:
                        break
                    self._mode = "text"
                    continue
                self._mode = "json" if head[0] == "{" else "text"
            elif self._mode == "json":
                if not final:
                    break
                if self._call(self._buf):
                    self._buf = ""
                    self._after_call = True
                    break
                self._mode = "text"  # not a call: read it again as text
            elif self._mode == "text":
                if not self._scan_text(out, final):
                    break
            elif not self._scan_block(out):
                break
        return "".join(out), self.calls[before:]

    def _scan_text(self, out: list[str], final: bool) -> bool:
        """Text up to the next ``<tool_call>``; True if a block opened (go on), False when done."""
        i = self._buf.find(TOOL_CALL_OPEN)
        if i < 0:
            keep = 0 if final else _partial_tag(self._buf)
            safe, self._buf = self._buf[:len(self._buf) - keep], self._buf[len(self._buf) - keep:]
            out.append(self._text(safe))
            return False
        out.append(self._text(self._buf[:i]))
        self._buf = self._buf[i + len(TOOL_CALL_OPEN):]
        self._pre_ws, self._ws = self._ws, ""
        self._mode = "block"
        return True

    def _scan_block(self, out: list[str]) -> bool:
        """The open block, once closed: a call, or text as written. False while it is open."""
        j = self._buf.find(TOOL_CALL_CLOSE)
        if j < 0:
            return False
        inner, self._buf = self._buf[:j], self._buf[j + len(TOOL_CALL_CLOSE):]
        self._mode = "text"
        if self._call(inner):
            self._pre_ws = ""
            self._after_call = True
        else:
            out.append(self._text(self._pre_ws + TOOL_CALL_OPEN + inner + TOOL_CALL_CLOSE))
        return True

    def _text(self, piece: str) -> str:
        """What of a piece of plain text can be sent: all but its trailing whitespace, which is
        held (with any held before) until text follows; whitespace after a valid call goes."""
        core = piece.strip()
        if not core:
            self._ws += piece
            return ""
        start = len(piece) - len(piece.lstrip())
        lead = "" if self._after_call else self._ws + piece[:start]
        self._ws = piece[start + len(core):]
        self._after_call = False
        return lead + core

    # -- one call -------------------------------------------------------------------------------
    def _call(self, text: str) -> bool:
        """Record ``text`` (a block's inside, or the whole output) as a call if it is one."""
        if self.max_calls is not None and len(self.calls) >= self.max_calls:
            return False
        parsed = parse_call_json(text, self.names)
        if parsed is None:
            return False
        self.calls.append(ParsedToolCall(self._new_id(), *parsed))
        return True


def parse_call_json(text: str, names: Collection[str]) -> tuple[str, str] | None:
    """``(name, arguments JSON)`` if ``text`` is a JSON call of one of ``names``, else None."""
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or obj["name"] not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # arguments as JSON text
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return obj["name"], json.dumps(args, ensure_ascii=False)


def parse_tool_calls(text: str, names: Collection[str], max_calls: int | None = None,
                     new_id: Callable[[], str] = new_call_id) -> tuple[str, list[ParsedToolCall]]:
    """The whole output -> ``(content, calls)``, by the same rules as the stream."""
    parser = ToolCallParser(names, max_calls, new_id)
    content, calls = parser.feed(text)
    more, rest = parser.finish()
    return content + more, calls + rest
