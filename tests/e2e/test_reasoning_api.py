"""--reasoning-parser qwen3 through the official client: SmolLM2 does not think, so a guided_regex
makes it write a think block; reasoning_content and content come back split, whole and streamed."""

from __future__ import annotations

import re

from tests.e2e.conftest import MODEL

THINKING = r"<think>[a-z]{1,6}</think>[a-z]{1,4}"
ASK = [{"role": "user", "content": "Say a word."}]


def test_think_block_goes_to_reasoning_content(client) -> None:  # type: ignore[no-untyped-def]
    args = {"model": MODEL, "messages": ASK, "max_tokens": 24, "temperature": 0,
            "extra_body": {"guided_regex": THINKING}}
    message = client.chat.completions.create(**args).choices[0].message
    raw = f"<think>{message.reasoning_content}</think>{message.content}"
    assert re.fullmatch(THINKING, raw), raw  # the forced output, split at the tags
    assert message.reasoning == message.reasoning_content  # current vLLM's name for the field
    reasoning, content, order = "", "", []
    for chunk in client.chat.completions.create(**args, stream=True):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        if getattr(delta, "reasoning_content", None):
            reasoning += delta.reasoning_content
            order.append("r")
        if delta.content:
            content += delta.content
            order.append("c")
    assert (reasoning, content) == (message.reasoning_content, message.content)
    assert order == sorted(order, reverse=True)  # all reasoning deltas come before any content


def test_no_think_block_is_plain_content(client) -> None:  # type: ignore[no-untyped-def]
    message = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=2, temperature=0).choices[0].message
    assert message.content and message.reasoning_content is None
