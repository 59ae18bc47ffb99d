"""A chat request's messages (and tools) -> the prompt text, through the model's chat template.

Used by /v1/chat/completions and by /tokenize (so a counted chat prompt is the generated one).

Two ways to show tools, chosen by whether the template reads a ``tools`` variable:

- it does (Qwen2.5, Llama 3.1, Hermes...): ``tools`` is passed to the template, as
  transformers' ``apply_chat_template(tools=...)`` does, and the history's messages keep their
  OpenAI form: an assistant message's ``tool_calls`` (arguments parsed into an object, as
  templates expect) and ``tool`` messages with their ``tool_call_id``;
- it does not (SmolLM2's): the server writes the tools into the system message in the
  Hermes / Qwen2.5 style (``<tools>`` JSON lines ``</tools>`` and the instruction to answer with
  ``<tool_call>{"name": ..., "arguments": ...}</tool_call>``), an assistant's calls become
  those blocks in its text, and ``tool`` results become a user message of
  ``<tool_response>`` blocks (consecutive results merged into one), which is how those models
  are trained to see them. A template that knows no ``tool`` role then still renders.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from fitserve.loading.chat_template import (
    ChatTemplateError,
    check_chat_template,
    template_globals,
    template_variables,
)
from fitserve.loading.tokenizer import NO_TEMPLATE_HINT, Tokenizer
from fitserve.server.errors import bad_request
from fitserve.server.protocol.chat import ChatMessage, ChatTemplateFields
from fitserve.server.protocol.common import MAX_MESSAGES
from fitserve.server.tools import TOOL_CALL_CLOSE, TOOL_CALL_OPEN

# NOTE: Qwen2.5's wording of the Hermes tool prompt: the format these models were trained on.
_TOOLS_HEAD = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
               "You are provided with function signatures within <tools></tools> XML tags:\n<tools>")
_TOOLS_TAIL = ("</tools>\n\nFor each function call, return a json object with function name and arguments "
               f"within {TOOL_CALL_OPEN}{TOOL_CALL_CLOSE} XML tags:\n{TOOL_CALL_OPEN}\n"
               '{"name": <function-name>, "arguments": <args-json-object>}\n' + TOOL_CALL_CLOSE)


# Template variables the server sets itself (or the template's own helpers): not chat_template_kwargs'.
_SERVER_SET = frozenset({"messages", "tools", "documents", "add_generation_prompt", "continue_final_message",
                         "chat_template", *template_globals()})


def check_messages(messages: list[ChatMessage]) -> None:
    """The conversation's shape: a 400 naming ``messages`` for what no template could render."""
    if not messages:
        raise bad_request("messages must not be empty", "messages")
    if len(messages) > MAX_MESSAGES:
        raise bad_request(f"at most {MAX_MESSAGES} messages are allowed", "messages")
    for i, m in enumerate(messages):
        if m.role == "tool" and not m.tool_call_id:
            raise bad_request(f"messages[{i}]: a tool message needs tool_call_id", "messages")
        if m.role != "tool" and m.tool_call_id is not None:
            raise bad_request(f"messages[{i}]: tool_call_id is only allowed in a tool message", "messages")
        if m.role != "assistant" and m.tool_calls:
            raise bad_request(f"messages[{i}]: only an assistant message can have tool_calls", "messages")


def _arguments(text: str) -> Any:
    """A call's arguments as the object templates expect (the text itself if it is not JSON)."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def _native(m: ChatMessage) -> dict[str, Any]:
    """A message in OpenAI's form, for a template that knows tools."""
    role = "system" if m.role == "developer" else m.role
    out: dict[str, Any] = {"role": role, "content": m.text()}
    if m.name is not None:
        out["name"] = m.name
    if m.tool_calls:
        out["tool_calls"] = [{"id": c.id, "type": "function",
                              "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)}}
                             for c in m.tool_calls]
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    return out


def _call_block(name: str, arguments: str) -> str:
    args = _arguments(arguments)
    return f"{TOOL_CALL_OPEN}\n{json.dumps({'name': name, 'arguments': args}, ensure_ascii=False)}\n{TOOL_CALL_CLOSE}"


def _hermes(messages: list[ChatMessage], tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages for a template without tools: tools in the system message, calls and results as text."""
    out: list[dict[str, Any]] = []
    for m in messages:
        msg = _native(m)
        msg.pop("tool_call_id", None)
        calls = msg.pop("tool_calls", None)
        if calls:
            blocks = [_call_block(c.function.name, c.function.arguments) for c in m.tool_calls or []]
            msg["content"] = "\n".join([msg["content"], *blocks] if msg["content"] else blocks)
        if m.role == "tool":
            response = f"<tool_response>\n{msg['content']}\n</tool_response>"
            if out and out[-1].get("_tool_results"):
                out[-1]["content"] += "\n" + response
                continue
            msg = {"role": "user", "content": response, "_tool_results": True}
        out.append(msg)
    for msg in out:
        msg.pop("_tool_results", None)
    if tools:
        block = "\n".join([_TOOLS_HEAD, *(json.dumps(t, ensure_ascii=False) for t in tools), _TOOLS_TAIL])
        if out and out[0]["role"] == "system":
            out[0]["content"] = f"{out[0]['content']}\n\n{block}" if out[0]["content"] else block
        else:
            out.insert(0, {"role": "system", "content": block})
    return out


def template_takes_tools(tokenizer: Tokenizer, template: str | None = None) -> bool:
    """Whether the chat template (``template``, else the model's) reads ``tools``."""
    source = template or tokenizer.chat_template
    return bool(source) and "tools" in template_variables(source)


@dataclass(frozen=True, slots=True)
class TemplateChoice:
    """How one request renders: the template's text and the knobs it passes."""

    template: str
    add_generation_prompt: bool
    continue_final_message: bool
    kwargs: dict[str, Any]


def _request_template(tokenizer: Tokenizer, req: ChatTemplateFields | None, trusted: bool) -> str:
    """The template text this request uses: its own (when trusted), else the server's."""
    if req is not None and req.chat_template is not None:
        if not trusted:
            raise bad_request("a chat_template sent with the request is refused: a template is code the server "
                              "runs; start the server with --trust-request-chat-template to allow it",
                              "chat_template")
        try:
            return check_chat_template(req.chat_template)
        except ChatTemplateError as exc:
            raise bad_request(str(exc), "chat_template") from None
    if not tokenizer.chat_template:
        raise bad_request(NO_TEMPLATE_HINT, "messages")
    return tokenizer.chat_template


def choose_template(tokenizer: Tokenizer, req: ChatTemplateFields | None, trusted: bool = False) -> TemplateChoice:
    """Check a request's chat-template fields (each works or is a 400 naming it)."""
    template = _request_template(tokenizer, req, trusted)
    if req is None:
        return TemplateChoice(template, True, False, {})
    cont = req.continue_final_message
    if cont and req.add_generation_prompt:
        raise bad_request("continue_final_message and add_generation_prompt cannot both be true: one continues "
                          "the last message, the other starts a new assistant turn", "continue_final_message")
    add = (not cont) if req.add_generation_prompt is None else req.add_generation_prompt
    kwargs = dict(req.chat_template_kwargs or {})
    own = sorted(kwargs.keys() & _SERVER_SET)
    if own:
        raise bad_request(f"chat_template_kwargs cannot set {own}: the server sets them (use the request's own "
                          "fields)", "chat_template_kwargs")
    unread = sorted(kwargs.keys() - template_variables(template))
    if unread:
        raise bad_request(f"chat_template_kwargs: the chat template never reads {unread}", "chat_template_kwargs")
    return TemplateChoice(template, add, cont, kwargs)


def render_chat(tokenizer: Tokenizer, messages: list[ChatMessage], tools: list[dict[str, Any]],
                req: ChatTemplateFields | None = None, *, trusted: bool = False) -> str:
    """The prompt text of ``messages`` with ``tools`` shown (OpenAI tool dicts; may be empty).

    ``req`` carries the request's chat-template fields; ``trusted``: the server accepts a
    request's own ``chat_template``. A template error (or no template) is a 400.
    """
    check_messages(messages)
    choice = choose_template(tokenizer, req, trusted)
    options: dict[str, Any] = {"chat_template": choice.template, "add_generation_prompt": choice.add_generation_prompt,
                               "continue_final_message": choice.continue_final_message, **choice.kwargs}
    try:
        if template_takes_tools(tokenizer, choice.template):
            extra: dict[str, Any] = {"tools": tools} if tools else {}
            return tokenizer.apply_chat_template([_native(m) for m in messages], **options, **extra)
        return tokenizer.apply_chat_template(_hermes(messages, tools), **options)
    except Exception as exc:  # noqa: BLE001 - template errors are the request's fault
        raise bad_request(f"could not apply the chat template: {exc}", "messages") from None
