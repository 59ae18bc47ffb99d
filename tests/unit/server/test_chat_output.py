"""A chat response built from generated text by the serving path (prepare_chat, then the choice
builder and the per-delta ChoiceText the stream uses) with --reasoning-parser and
--tool-call-parser: the prompt decides where the output starts, reasoning goes to
reasoning_content, tool calls come out of the content only."""

from __future__ import annotations

import json
from typing import Any

from fitserve.loading.chat_template import render_chat_template
from fitserve.server.choices import ChoiceText
from fitserve.server.protocol.chat import ChatCompletionRequest
from fitserve.server.serving import ModelContext, Prepared, prepare_chat
from fitserve.server.streaming import _choice

# DeepSeek-R1's template ends the prompt inside an opened think block
R1_TEMPLATE = ("{% for m in messages %}<｜{{ m.role }}｜>{{ m.content }}{% endfor %}"
               "{% if add_generation_prompt %}<｜Assistant｜><think>\n{% endif %}")
# Qwen3's: enable_thinking=False writes an empty block into the prompt
QWEN3_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                  "{% if add_generation_prompt %}<|im_start|>assistant\n"
                  "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
                  "{% endif %}")
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]


class FakeTokenizer:
    """The template and a character-level encode: all prepare_chat needs."""

    def __init__(self, template: str) -> None:
        self.chat_template = template

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, *,
                            chat_template: str | None = None, **kw: Any) -> str:
        return render_chat_template(chat_template or self.chat_template, messages,
                                    add_generation_prompt=add_generation_prompt, **kw)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) % 1000 for c in text]


def prepared(template: str, reasoning: str | None, tool_parser: str = "hermes", **body: Any) -> Prepared:
    ctx = ModelContext("m", FakeTokenizer(template), 4096, 1000, 0,  # type: ignore[arg-type]
                       tool_call_parser=tool_parser, reasoning_parser=reasoning)
    req = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "17*3?"}], **body})
    return prepare_chat(req, ctx)


def streamed_message(prep: Prepared, text: str, cut: int) -> dict[str, Any]:
    """The stream's deltas of ``text`` cut at ``cut``, added up into a message."""
    shaped = ChoiceText(prep, 0)
    pieces = [shaped.stream(text[:cut], False), shaped.stream(text[cut:], True)]
    return {"reasoning": "".join(p.reasoning for p in pieces), "content": "".join(p.content for p in pieces),
            "tool_calls": [{k: v for k, v in c.items() if k not in ("index", "id")} for p in pieces for c in p.calls]}


def test_deepseek_r1_output_starts_inside_the_block() -> None:
    prep = prepared(R1_TEMPLATE, "deepseek_r1")
    assert prep.reasoning_opened
    choice = _choice(prep, 0, "17 * 3: 10 * 3 + 7 * 3 = 51.\n</think>\n\n**51**", None, "stop", None)
    assert choice["message"] == {"role": "assistant", "content": "\n\n**51**", "tool_calls": [],
                                 "reasoning_content": "17 * 3: 10 * 3 + 7 * 3 = 51.\n",
                                 "reasoning": "17 * 3: 10 * 3 + 7 * 3 = 51.\n"}
    assert choice["finish_reason"] == "stop"


def test_qwen3_without_thinking_has_no_reasoning() -> None:
    prep = prepared(QWEN3_TEMPLATE, "qwen3", chat_template_kwargs={"enable_thinking": False})
    assert not prep.reasoning_opened  # the prompt's block is already closed
    message = _choice(prep, 0, "**51**", None, "stop", None)["message"]
    assert message["content"] == "**51**" and message["reasoning_content"] is None


def test_qwen3_thinks_then_calls_a_tool_parsed_from_the_content_only() -> None:
    prep = prepared(QWEN3_TEMPLATE, "qwen3", tools=TOOLS)
    # a call written inside the think block is reasoning, not a call
    text = ('<think>\nI could write <tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>'
            '; no, Paris.\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')
    choice = _choice(prep, 0, text, None, "stop", None)
    message = choice["message"]
    assert message["content"] is None and choice["finish_reason"] == "tool_calls"
    assert [json.loads(c["function"]["arguments"]) for c in message["tool_calls"]] == [{"city": "Paris"}]
    assert "Rome" in message["reasoning_content"] and message["reasoning_content"].endswith("Paris.\n")
    whole = {"reasoning": message["reasoning_content"], "content": "",
             "tool_calls": [{k: v for k, v in c.items() if k != "id"} for c in message["tool_calls"]]}
    for cut in range(len(text) + 1):
        assert streamed_message(prep, text, cut) == whole, cut


TAKES_TOOLS = "{{ tools | tojson }}{{ messages[0].content }}"  # reads `tools`, as Mistral's and Llama 3.1's do


def test_tool_call_parser_choice_reaches_the_choice() -> None:
    prep = prepared(TAKES_TOOLS, None, "mistral", tools=TOOLS)
    assert prep.tools is not None and prep.tools.parser == "mistral"
    assert prep.params.skip_special_tokens is False  # [TOOL_CALLS] is a special token
    message = _choice(prep, 0, '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]',
                      None, "stop", None)["message"]
    assert "reasoning_content" not in message  # no --reasoning-parser: the body is as before
    assert message["content"] is None and len(message["tool_calls"][0]["id"]) == 9
    # a grammar (tool_choice required) writes Hermes blocks whatever the parser
    forced = prepared(TAKES_TOOLS, None, "mistral", tools=TOOLS, tool_choice="required")
    assert forced.tools is not None and forced.tools.parser == "hermes"
    # and so does a template that ignores tools: the server showed them Hermes style
    taught = prepared("{{ messages[0].content }}", None, "llama3_json", tools=TOOLS)
    assert taught.tools is not None and taught.tools.parser == "hermes"
    message = _choice(taught, 0, '<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>',
                      None, "stop", None)["message"]
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_weather"]
