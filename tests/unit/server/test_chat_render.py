"""How a chat request's tools and tool history reach the chat template (fitserve.server.chat_render):
passed to a template that reads `tools`, written Hermes style for one that does not."""

from __future__ import annotations

import json
from typing import Any

import pytest

from fitserve.loading.chat_template import render_chat_template, template_variables
from fitserve.server.chat_render import render_chat, template_takes_tools
from fitserve.server.errors import APIError
from fitserve.server.protocol.chat import ChatMessage

# SmolLM2's template (no tools) and a Qwen2.5-like one that shows tools and tool calls itself
PLAIN = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
         "{% if add_generation_prompt %}<|assistant|>{% endif %}")
WITH_TOOLS = ("{% if tools %}TOOLS:{% for t in tools %}{{ t | tojson }};{% endfor %}{{ '\\n' }}{% endif %}"
              "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}"
              "{% for c in m.tool_calls or [] %}CALL {{ c.function.name }} {{ c.function.arguments | tojson }}"
              "{% endfor %}{% if m.tool_call_id %} (for {{ m.tool_call_id }}){% endif %}{{ '\\n' }}{% endfor %}")
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
HISTORY = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris and Rome?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    {"role": "tool", "tool_call_id": "call_2", "content": "rainy"},
]


class FakeTokenizer:
    """What render_chat needs of a Tokenizer: its template, and applying it."""

    def __init__(self, template: str) -> None:
        self.chat_template = template

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, *,
                            chat_template: str | None = None, **kw: Any) -> str:
        return render_chat_template(chat_template or self.chat_template, messages,
                                    add_generation_prompt=add_generation_prompt, **kw)


def msgs(raw: list[dict[str, Any]]) -> list[ChatMessage]:
    return [ChatMessage.model_validate(m) for m in raw]


def test_which_templates_take_tools() -> None:
    assert "tools" not in template_variables(PLAIN) and "tools" in template_variables(WITH_TOOLS)
    assert not template_takes_tools(FakeTokenizer(PLAIN)) and template_takes_tools(FakeTokenizer(WITH_TOOLS))


def test_a_template_with_tools_gets_them_and_the_calls_as_objects() -> None:
    text = render_chat(FakeTokenizer(WITH_TOOLS), msgs(HISTORY), [TOOL])  # type: ignore[arg-type]
    assert text.startswith(f"TOOLS:{json.dumps(TOOL, ensure_ascii=False)};\n<|system|>Be brief.\n")
    assert 'CALL get_weather {"city": "Paris"}CALL get_weather {"city": "Rome"}' in text  # arguments: objects
    assert "<|tool|>sunny (for call_1)\n<|tool|>rainy (for call_2)\n" in text
    assert "TOOLS" not in render_chat(FakeTokenizer(WITH_TOOLS), msgs(HISTORY[:2]), [])  # type: ignore[arg-type]


def test_a_template_without_tools_gets_them_hermes_style() -> None:
    text = render_chat(FakeTokenizer(PLAIN), msgs(HISTORY), [TOOL])  # type: ignore[arg-type]
    system, rest = text.split("\n<|user|>", 1)
    assert system.startswith("<|system|>Be brief.\n\n# Tools\n")
    assert f"<tools>\n{json.dumps(TOOL, ensure_ascii=False)}\n</tools>" in system
    assert '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>' in system
    assert ('<|assistant|><tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>\n') in rest
    # consecutive tool results: one user message of <tool_response> blocks
    assert ("<|user|><tool_response>\nsunny\n</tool_response>\n<tool_response>\nrainy\n</tool_response>\n"
            "<|assistant|>") in rest


def test_without_a_system_message_the_tools_get_one() -> None:
    text = render_chat(FakeTokenizer(PLAIN), msgs(HISTORY[1:2]), [TOOL])  # type: ignore[arg-type]
    assert text.startswith("<|system|># Tools\n") and "<|user|>Weather in Paris and Rome?" in text
    assert render_chat(FakeTokenizer(PLAIN), msgs(HISTORY[1:2]), []) == (  # type: ignore[arg-type]
        "<|user|>Weather in Paris and Rome?\n<|assistant|>")


@pytest.mark.parametrize("raw", [
    [],
    [{"role": "tool", "content": "no id"}],
    [{"role": "user", "content": "x", "tool_call_id": "call_1"}],
    [{"role": "user", "content": "x", "tool_calls": HISTORY[2]["tool_calls"]}],
])
def test_bad_conversations_are_400(raw: list[dict[str, Any]]) -> None:
    with pytest.raises(APIError) as info:
        render_chat(FakeTokenizer(PLAIN), msgs(raw), [])  # type: ignore[arg-type]
    assert info.value.status == 400 and info.value.param == "messages"
