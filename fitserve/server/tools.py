"""OpenAI tool calling, the request side: check ``tools`` / ``tool_choice``, decide what the
model is shown and what its output is parsed for, and build the grammar that enforces
``tool_choice: "required"`` or a named function.

The calls are written in the Hermes / Qwen2.5 format, which is also what the server teaches a
model whose chat template has no place for tools (``fitserve.server.chat_render``)::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

``fitserve.server.tool_calls`` parses them back out of the generated text.

``tool_choice``:

- ``"none"``: no tool is shown, nothing is parsed (the history's calls are still rendered);
- ``"auto"`` (the default with tools): tools shown; the output is parsed, calls or not;
- ``"required"``: a grammar makes the output one ``<tool_call>`` block whose JSON is
  ``{"name": <one of the tools>, "arguments": <matching its parameters schema>}``, so it
  always parses; with ``parallel_tool_calls: true`` (explicitly) up to MAX_PARALLEL_CALLS
  blocks, newline separated.

  NOTE: OpenAI's default is parallel calls, but a grammar that allows another block after each
  one lets a small model repeat calls until max_tokens, ending inside an unclosed block (seen
  with SmolLM2-135M); so parallel calls under ``required`` are opt-in. ``auto`` parses as many
  calls as the model makes unless ``parallel_tool_calls`` is false;
- ``{"type": "function", "function": {"name": N}}``: the same grammar with the one tool N.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from fitserve.server.errors import bad_request
from fitserve.server.protocol.chat import ChatCompletionRequest
from fitserve.server.protocol.structured import MAX_TOOLS, TOOL_NAME_PATTERN, ToolDefinition
from fitserve.structured.guided import GuidedDecoding

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
MAX_PARALLEL_CALLS = 8  # with `required` and parallel calls: the grammar's bound on the number of calls
# NOTE: compact JSON with fixed separators (llguidance's "x-guidance" options): with free
# whitespace, small models loop on newlines inside the object until max_tokens.
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}
_NAME = re.compile(TOOL_NAME_PATTERN)


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """What a chat request's tools mean for this request.

    ``shown``: the tool definitions the prompt presents (OpenAI's ``{"type": "function",
    "function": {...}}`` dicts; empty with ``tool_choice: "none"``). ``names``: the functions
    the output parser accepts (None: parse nothing). ``max_calls``: None for no limit.
    ``guided``: the grammar of ``required`` / a named function, else None. ``parser``: the
    ``--tool-call-parser`` format the output is read in (see ``tool_call_formats``).
    """

    shown: list[dict[str, Any]]
    names: frozenset[str] | None
    max_calls: int | None
    guided: GuidedDecoding | None
    parser: str = "hermes"

    @property
    def parses(self) -> bool:
        return self.names is not None


def _check_tools(tools: list[ToolDefinition]) -> None:
    if len(tools) > MAX_TOOLS:
        raise bad_request(f"at most {MAX_TOOLS} tools are allowed, got {len(tools)}", "tools")
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        fn = tool.function
        if not _NAME.fullmatch(fn.name):
            raise bad_request(f"tools[{i}].function.name must be 1..64 letters, digits, '_' or '-', "
                              f"got {fn.name!r}", "tools")
        if fn.name in seen:
            raise bad_request(f"tools[{i}]: two tools are named {fn.name!r}", "tools")
        seen.add(fn.name)
        params = fn.parameters
        if params is not None and params.get("type", "object") != "object":
            raise bad_request(f"tools[{i}].function.parameters must be a JSON schema of an object "
                              f"(type \"object\"), got type {params.get('type')!r}", "tools")


def _tool_dict(tool: ToolDefinition) -> dict[str, Any]:
    """The definition as OpenAI's JSON (what chat templates and the Hermes prompt show)."""
    fn: dict[str, Any] = {"name": tool.function.name}
    if tool.function.description is not None:
        fn["description"] = tool.function.description
    fn["parameters"] = tool.function.parameters if tool.function.parameters is not None else {
        "type": "object", "properties": {}}
    return {"type": "function", "function": fn}


def shown_tools(tools: list[ToolDefinition]) -> list[dict[str, Any]]:
    """Checked tool definitions as the prompt shows them (OpenAI's JSON); a 400 for a bad one."""
    _check_tools(tools)
    return [_tool_dict(t) for t in tools]


def plan_tools(req: ChatCompletionRequest, user_guided: bool) -> ToolPlan | None:
    """The request's :class:`ToolPlan` (None without tools); a 400 for a bad tool or choice.

    ``user_guided``: the request has its own output constraint (response_format, guided_*):
    it cannot be combined with ``required`` / a named function (two grammars), and with
    ``auto`` the output follows that constraint, so no tool calls are parsed from it.
    """
    tools = req.tools or []
    choice = req.tool_choice
    if not tools:
        if choice is not None and choice not in ("none", "auto"):
            raise bad_request("tool_choice requires tools", "tool_choice")
        if req.parallel_tool_calls is not None:
            raise bad_request("parallel_tool_calls requires tools", "parallel_tool_calls")
        return None
    shown = shown_tools(tools)
    choice = choice if choice is not None else "auto"
    if choice == "none":
        return ToolPlan([], None, None, None)
    one = req.parallel_tool_calls is False
    if choice == "auto":
        names = None if user_guided else frozenset(t.function.name for t in tools)
        return ToolPlan(shown, names, 1 if one else None, None)
    if user_guided:
        raise bad_request("tool_choice required or a named function cannot be combined with response_format "
                          "or guided_* (both are grammars for the whole output)", "tool_choice")
    if choice == "required":
        chosen = tools
    else:
        assert not isinstance(choice, str)
        chosen = [t for t in tools if t.function.name == choice.function.name]
        if not chosen:
            raise bad_request(f"tool_choice names the function {choice.function.name!r}, which is not one "
                              "of the tools", "tool_choice")
        one = True  # OpenAI: a named function is called once
    max_calls = MAX_PARALLEL_CALLS if req.parallel_tool_calls and not one else 1
    grammar = tool_call_grammar(chosen, max_calls)
    return ToolPlan(shown, frozenset(t.function.name for t in chosen), max_calls,
                    GuidedDecoding("grammar", grammar))


def _hoist_defs(schemas: list[dict[str, Any]]) -> dict[str, Any]:
    """The ``$defs`` (and ``definitions``) of the tools' parameter schemas, for the root schema.

    A parameters schema refers to its definitions as ``#/$defs/X``, from its own root; nested
    under ``arguments`` those references resolve against the call schema's root, so the
    definitions move there. Two tools defining one name differently is a 400.
    """
    root: dict[str, Any] = {}
    for schema in schemas:
        for key in ("$defs", "definitions"):
            defs = schema.get(key)
            if defs is None:
                continue
            if not isinstance(defs, dict):
                raise bad_request(f"tools: a parameters schema's {key} must be an object", "tools")
            into = root.setdefault(key, {})
            for name, value in defs.items():
                if name in into and into[name] != value:
                    raise bad_request(f"tools: two parameters schemas define {key}/{name} differently; "
                                      "tool_choice required cannot combine them", "tools")
                into[name] = value
    return root


def tool_call_grammar(tools: list[ToolDefinition], max_calls: int) -> str:
    """llguidance Lark: 1..``max_calls`` ``<tool_call>`` blocks, each a JSON call of one tool.

    ::

        start: call ("\\n" call){0,max_calls-1}
        call: "<tool_call>\\n" %json {anyOf: [{name: const N, arguments: <N's schema>}, ...]} "\\n</tool_call>"

    ``name`` comes first (llguidance keeps the schema's property order).
    """
    params = [t.function.parameters if t.function.parameters is not None else _NO_ARGUMENTS for t in tools]
    options = [{"type": "object",
                "properties": {"name": {"const": t.function.name}, "arguments": p},
                "required": ["name", "arguments"], "additionalProperties": False}
               for t, p in zip(tools, params, strict=True)]
    schema: dict[str, Any] = dict(options[0]) if len(options) == 1 else {"anyOf": options}
    schema.update(_hoist_defs(params))
    schema["x-guidance"] = _JSON_OPTIONS
    body = json.dumps(schema, ensure_ascii=False)
    more = f' ("\\n" call){{0,{max_calls - 1}}}' if max_calls > 1 else ""
    return (f"start: call{more}\n"
            f'call: "{TOOL_CALL_OPEN}\\n" call_json "\\n{TOOL_CALL_CLOSE}"\n'
            f"call_json: %json {body}\n")
